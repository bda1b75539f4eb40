"""How a grpc thread hands work to the reactor, and when the reactor wakes for it.

Three ways, from the most urgent: ``reactor.callFromThread`` wakes it at once; ``unwoken`` queues the
work without waking it, to run with whatever wakes it next, in order; ``Later`` queues it the same way
and has a kernel timer wake the reactor a moment later if nothing does before. ``Later`` is for work
that must be done soon but not while a caller is taking its answer: on a node with two cores, a
reactor that wakes as an answer leaves takes a core the caller needs to receive it.
"""

import ctypes
import os
import threading
import time
from typing import Callable, NoReturn, Protocol

from twisted.internet.base import ReactorBase
from twisted.internet.interfaces import IReactorFDSet, IReactorFromThreads, IReadDescriptor
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

Queue = Callable[..., None]


def _twisteds_own(reactor: IReactorFromThreads) -> bool:
    """Whether ``callFromThread`` is Twisted's own, which queues work then wakes the reactor (asyncio's is not)."""
    own: object = getattr(type(reactor), "callFromThread", None)
    return own is ReactorBase.callFromThread


def unwoken(reactor: IReactorFromThreads) -> Queue:
    """What queues work for the reactor from another thread without waking it: Twisted's ``callFromThread``
    without its wake-up. The next ``callFromThread`` wakes the reactor, which runs everything queued, in
    order. (A reactor whose ``callFromThread`` is not Twisted's own is woken.)
    """
    if not _twisteds_own(reactor):
        return reactor.callFromThread
    queue: list[tuple[Callable[..., object], tuple[object, ...], dict[str, object]]] = getattr(reactor, "threadCallQueue")

    def queued(work: Callable[..., object], *args: object) -> None:
        queue.append((work, args, {}))

    return queued


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class TimerFD:
    """A Linux timerfd that expires once, ``seconds`` after each ``arm``, and is readable from then until
    ``clear``. Python 3.11's ``os`` has no timerfd functions: libc's are called through ctypes."""

    def __init__(self, seconds: float) -> None:
        """OSError: the kernel or libc has no timerfd. ``seconds`` must be a nanosecond or more (0 would disarm it)."""
        whole = int(seconds) if seconds > 0 else 0
        nanoseconds = int((seconds - whole) * 1e9) if seconds > 0 else 0
        if whole == 0 and nanoseconds == 0:
            raise ValueError(f"a timerfd expires after a nanosecond or more, not {seconds} seconds")
        try:
            # PyDLL keeps the GIL: taking it back after a system call of a microsecond could cost grpc's
            # thread a switch interval.
            libc = ctypes.PyDLL(None, use_errno=True)
            create, self._settime = libc.timerfd_create, libc.timerfd_settime
        except (OSError, AttributeError) as error:
            raise OSError(f"libc has no timerfd: {error}") from None
        descriptor: int = create(time.CLOCK_MONOTONIC, os.O_NONBLOCK | os.O_CLOEXEC)
        if descriptor < 0:
            _raise_errno("timerfd_create")
        self._descriptor = descriptor
        self._once = _Itimerspec(_Timespec(0, 0), _Timespec(whole, nanoseconds))

    def fileno(self) -> int:
        return self._descriptor

    def arm(self) -> None:
        if self._settime(self._descriptor, 0, ctypes.byref(self._once), None) < 0:
            _raise_errno("timerfd_settime")

    def clear(self) -> None:
        try:
            os.read(self._descriptor, 8)
        except BlockingIOError:
            pass  # not expired (again) since it was last cleared

    def close(self) -> None:
        os.close(self._descriptor)


def _nothing() -> None:
    pass


def _raise_errno(what: str) -> NoReturn:
    number = ctypes.get_errno()
    raise OSError(number, f"{what}: {os.strerror(number)}")


class Timer(Protocol):
    """What ``Later`` needs of a timer: ``TimerFD``, or a fake."""

    def fileno(self) -> int: ...

    def arm(self) -> None:
        """Expire once, a fixed time from now; readable from then on."""

    def clear(self) -> None:
        """Readable no more, until it expires again."""

    def close(self) -> None: ...


@implementer(IReadDescriptor)
class Later:
    """Queues work for the reactor from any thread, and has it run a moment later at most (``Timer``'s time),
    with no thread woken meanwhile: the timer is the kernel's. Something that wakes the reactor before
    runs it sooner, in order with what was queued with it.

    Without a timer (a reactor that is not Twisted's own, or no timerfd), the reactor is woken at once.
    """

    log = Logger()

    def __init__(self, reactor: IReactorFromThreads, timer: Timer | None) -> None:
        """``timer`` is Later's from now on (None: the reactor is woken at once); ``reactor`` also provides
        IReactorFDSet, on whose thread this is made."""
        self._reactor = reactor
        self._unwoken = unwoken(reactor)
        if timer is not None and not _twisteds_own(reactor):
            timer.close()  # work would not wait for it
            timer = None
        self._timer = timer
        self._arming = threading.Lock()
        self._armed = False
        if timer is not None:
            IReactorFDSet(reactor).addReader(self)

    @classmethod
    def on(cls, reactor: IReactorFromThreads, seconds: float) -> "Later":
        """A Later whose wake comes ``seconds`` after the work it follows, or at once where there is no timerfd (said)."""
        try:
            timer: Timer | None = TimerFD(seconds)
        except OSError as error:
            cls.log.info("{reason}: the reactor is woken for each CRI call's end as it comes", reason=error)
            timer = None
        return cls(reactor, timer)

    def queue(self, work: Callable[..., object], *args: object) -> None:
        """From any thread: ``work(*args)`` runs on the reactor within the timer's time."""
        with self._arming:
            timer = self._timer
            if timer is not None:
                self._unwoken(work, *args)
                if self._armed:
                    return  # its wake is coming: it runs what was queued before it, this too
                try:
                    timer.arm()
                except OSError as error:
                    self._reactor.callFromThread(self._arming_failed, error)  # runs the work too
                    return
                self._armed = True
                return
        self._reactor.callFromThread(work, *args)

    def _arming_failed(self, error: OSError) -> None:
        if self._timer is not None:  # said once
            self.log.warn(
                "cannot arm the CRI calls' timer ({reason}): the reactor is woken for each call's end as it comes",
                reason=error,
            )
        self.close()

    def close(self) -> None:
        """On the reactor: no more timer; what is queued is run at the reactor's next turn."""
        with self._arming:
            timer, self._timer = self._timer, None
            waiting, self._armed = self._armed, False
        if timer is None:
            return
        IReactorFDSet(self._reactor).removeReader(self)
        timer.close()
        if waiting:
            self._reactor.callFromThread(_nothing)  # the wake the timer owed

    # IReadDescriptor: the timer expired. The reactor runs what is queued right after.

    def fileno(self) -> int:
        timer = self._timer
        return -1 if timer is None else timer.fileno()

    def doRead(self) -> None:
        with self._arming:
            timer = self._timer
            self._armed = False
            if timer is not None:
                timer.clear()

    def connectionLost(self, reason: Failure) -> None:
        """The reactor let go of the timer (an error reading it, or its end): work wakes it at once from now on."""
        self.close()

    def logPrefix(self) -> str:
        return "Later"
