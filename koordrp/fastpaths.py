"""The one door to Twisted's and CPython's private parts: each fast path that leans on them, checked before it
is used, beside the public way koordrp takes when it does not hold.

- **Unwoken hand-offs** (``FastPaths.unwoken``): work queued for the reactor from another thread without
  waking it, to run with whatever wakes it next, in order: Twisted's ``callFromThread`` without its
  wake-up, by appending to the reactor's private ``threadCallQueue`` as ``callFromThread`` does. The
  public way: ``callFromThread``, which wakes the reactor for each.
- **A kernel timer** (``FastPaths.timer``): a timerfd the reactor reads, armed from any thread without
  waking one: ``os.timerfd_*`` where Python has them (3.13), libc's through ctypes before. The public way
  to have work run a moment later from another thread wakes the reactor to set its ``callLater``, which
  is the wake the timer is there to spare: without one, the work wakes the reactor at once.
- **Writing at once** (``FastPaths.socket_send``): bytes written to a connection's socket by the caller,
  not on the reactor's next turn (``ISystemHandle``'s socket beside its transport). The public way:
  ``transport.write``.

Running benchmarks/hooks.py (the first two) or nri_starts.py (the third) with ``KOORDRP_FAST_PATHS=0``
in the environment shows what each saves. Each is checked before its first use
(``check`` runs them all): that the reactor's ``callFromThread`` is Twisted's own and queues
``(f, args, kwargs)`` in a list, that a timerfd expires and reads as one, that a transport's handle is a
non-blocking stream socket. One that does not hold is not used, and ``announce`` says so at start.
``KOORDRP_FAST_PATHS=0`` (or ``false``, ``no``, ``off``) in the environment turns all of them off.
"""

from __future__ import annotations

import os
import select
import socket
import sys
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Mapping, NoReturn, Protocol, Sequence

from twisted.internet.base import ReactorBase
from twisted.internet.interfaces import IConsumer, IReactorFromThreads, ISystemHandle, ITransport
from twisted.internet.unix import Client as UNIXClient
from twisted.logger import Logger

ENVIRONMENT = "KOORDRP_FAST_PATHS"
_OFF_VALUES = frozenset({"0", "false", "no", "off"})

Enqueue = Callable[..., None]
"""Hands ``work(*args)`` to the reactor from another thread."""

SocketSend = Callable[[bytes], int]
"""Writes what the socket takes of some bytes now; returns how many it took."""

_log = Logger()

class Timer(Protocol):
    """A timer the reactor reads: ``TimerFD``, or a test's."""

    def fileno(self) -> int: ...

    def arm(self) -> None:
        """Expire once, a fixed time from now; readable from then on."""

    def clear(self) -> None:
        """Readable no more, until it expires again."""

    def close(self) -> None: ...


def _nanoseconds(seconds: float) -> int:
    nanoseconds = int(seconds * 1e9) if seconds > 0 else 0
    if nanoseconds == 0:  # 0 would disarm it
        raise ValueError(f"a timerfd expires after a nanosecond or more, not {seconds} seconds")
    return nanoseconds


def _cleared(descriptor: int) -> None:
    try:
        os.read(descriptor, 8)
    except BlockingIOError:
        pass  # not expired (again) since it was last cleared


if sys.version_info >= (3, 13):
    TIMERFD_FROM = "os.timerfd_*"

    class TimerFD:
        """A Linux timerfd that expires once, ``seconds`` after each ``arm``, and is readable from then until
        ``clear``."""

        def __init__(self, seconds: float) -> None:
            """OSError: the kernel has no timerfd. ``seconds`` must be a nanosecond or more."""
            self._nanoseconds = _nanoseconds(seconds)
            self._descriptor = os.timerfd_create(time.CLOCK_MONOTONIC, flags=os.TFD_NONBLOCK | os.TFD_CLOEXEC)

        def fileno(self) -> int:
            return self._descriptor

        def arm(self) -> None:
            os.timerfd_settime_ns(self._descriptor, initial=self._nanoseconds)

        def clear(self) -> None:
            _cleared(self._descriptor)

        def close(self) -> None:
            os.close(self._descriptor)

else:
    import ctypes

    TIMERFD_FROM = "libc's timerfd_* through ctypes"

    class _Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

    class _Itimerspec(ctypes.Structure):
        _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]

    def _raise_errno(what: str) -> NoReturn:
        number = ctypes.get_errno()
        raise OSError(number, f"{what}: {os.strerror(number)}")

    class TimerFD:
        """A Linux timerfd that expires once, ``seconds`` after each ``arm``, and is readable from then until
        ``clear``. This Python's ``os`` has no timerfd functions: libc's are called through ctypes."""

        def __init__(self, seconds: float) -> None:
            """OSError: the kernel or libc has no timerfd. ``seconds`` must be a nanosecond or more."""
            whole, nanoseconds = divmod(_nanoseconds(seconds), 1_000_000_000)
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
            _cleared(self._descriptor)

        def close(self) -> None:
            os.close(self._descriptor)


@dataclass(frozen=True)
class Path:
    """One fast path: what it does, what it leans on, and the public way taken without it."""

    name: str
    uses: str
    instead: str


UNWOKEN = Path(
    "unwoken hand-offs", "Twisted's private reactor.threadCallQueue", "callFromThread, which wakes the reactor for each"
)
TIMER = Path(
    "a CRI call's end woken a moment after its answer", f"a timerfd, {TIMERFD_FROM}", "the reactor woken at once for it"
)
AT_ONCE = Path("messages written at once", "the connection's socket beside its transport", "transport.write")


@dataclass(frozen=True)
class Verdict:
    """Whether a fast path is taken, and why not."""

    path: Path
    off: str | None = None
    """Why it is not taken (None: it is)."""


_ThreadCalls = list[tuple[Callable[..., object], tuple[object, ...], dict[str, object]]]


def _reactor_queue(reactor: IReactorFromThreads) -> _ThreadCalls | str:
    """The reactor's queue of calls from threads, or why it cannot take work without a wake."""
    if getattr(type(reactor), "callFromThread", None) is not ReactorBase.callFromThread:
        return "the reactor's callFromThread is not Twisted's ReactorBase's"
    queue: object = getattr(reactor, "threadCallQueue", None)
    if not isinstance(queue, list):
        return "the reactor has no threadCallQueue list"
    if not callable(getattr(reactor, "wakeUp", None)):
        return "the reactor has no wakeUp"
    ran: list[bool] = []

    def probe() -> None:
        ran.append(True)

    # The entry callFromThread itself queues is what queued work must look like (the probe runs, harmlessly, on
    # the reactor's next turn, or ran already on its thread).
    reactor.callFromThread(probe)
    if not ran and (probe, (), {}) not in queue:
        return "callFromThread no longer queues (f, args, kwargs) in threadCallQueue"
    return queue


def _timerfd_fails() -> str | None:
    """Why a timerfd cannot wake the reactor here (None: one expires, reads as expired, and clears)."""
    try:
        timer = TimerFD(1e-6)
    except (OSError, AttributeError) as error:  # AttributeError: a Python built without os.timerfd_*
        return str(error)
    try:
        timer.arm()
        # The bound is for a machine so loaded that it never comes, not a measure of speed.
        if not select.select([timer], [], [], 1.0)[0]:
            return "a timerfd armed for a microsecond did not expire within a second"
        timer.clear()
        if select.select([timer], [], [], 0)[0]:
            return "a timerfd read once stays readable"
    except OSError as error:
        return str(error)
    finally:
        timer.close()
    return None


def _own_socket(transport: ITransport) -> socket.socket | str:
    """The socket behind ``transport``, to write to beside it, or why there is none to."""
    if IConsumer(transport, None) is None:
        return "the transport is no IConsumer, which would say when it has written what it holds"
    handle = ISystemHandle(transport, None)
    if handle is None:
        return "the transport has no system handle"
    found = handle.getHandle()
    if not isinstance(found, socket.socket) or found.type != socket.SOCK_STREAM:
        return "the transport's handle is not a stream socket"
    if found.gettimeout() != 0.0:
        return "the transport's socket blocks"
    return found


class FastPaths:
    """The fast paths koordrp may take, each checked before it is used; ``environ`` may turn them all off."""

    def __init__(self, environ: Mapping[str, str] = os.environ) -> None:
        self._environ = environ
        self._said: set[str] = set()

    @property
    def turned_off(self) -> str | None:
        """What in the environment turns every fast path off (None: nothing does)."""
        value = self._environ.get(ENVIRONMENT, "")
        return f"{ENVIRONMENT}={value}" if value.strip().lower() in _OFF_VALUES else None

    def unwoken(self, reactor: IReactorFromThreads) -> Enqueue | None:
        """What queues work for ``reactor`` from another thread without waking it: the next ``callFromThread``
        wakes the reactor, which runs everything queued, in order. None where that cannot be done
        (``reactor.callFromThread`` then)."""
        if self.turned_off:
            return None
        queue = _reactor_queue(reactor)
        if isinstance(queue, str):
            return None

        def queued(work: Callable[..., object], *args: object) -> None:
            queue.append((work, args, {}))

        return queued

    def timer(self, seconds: float) -> Timer | None:
        """A timerfd that expires ``seconds`` after each ``arm`` (None: none is to be used)."""
        if self.turned_off or self._timerfd_fails is not None:
            return None
        try:
            return TimerFD(seconds)
        except OSError as error:  # when the check's own worked: the descriptors ran out
            _log.warn("{path} off: {reason}; instead: {instead}", path=TIMER.name, reason=error, instead=TIMER.instead)
            return None

    @cached_property
    def _timerfd_fails(self) -> str | None:
        return _timerfd_fails()

    def socket_send(self, transport: ITransport) -> SocketSend | None:
        """What writes to ``transport``'s socket at once, beside the transport (None: write through the transport).

        Only while the transport holds nothing of its own, which its caller tracks as ``IConsumer``'s
        producer: bytes must never pass each other. A transport that has no socket to write to is said
        once for each reason.
        """
        if self.turned_off:
            return None
        found = _own_socket(transport)
        if isinstance(found, str):
            if found not in self._said:
                self._said.add(found)
                _log.info("{path} off for a connection: {reason}", path=AT_ONCE.name, reason=found)
            return None
        send = found.send

        def at_once(data: bytes) -> int:
            try:
                return send(data)
            except OSError:  # full (EAGAIN), or broken: the transport meets the same error and loses the connection
                return 0

        return at_once

    def check(self, reactor: IReactorFromThreads) -> list[Verdict]:
        """Each fast path, checked now: taken, or why not. (A connection's socket is checked as it is made.)"""
        turned_off = self.turned_off
        if turned_off:
            return [Verdict(UNWOKEN, turned_off), Verdict(TIMER, turned_off), Verdict(AT_ONCE, turned_off)]
        queue = _reactor_queue(reactor)
        queue_fails = queue if isinstance(queue, str) else None
        timer_fails = self._timerfd_fails
        if timer_fails is None and queue_fails is not None:
            timer_fails = "the work it wakes the reactor for cannot wait unwoken"
        at_once_fails = None
        if not (ISystemHandle.implementedBy(UNIXClient) and IConsumer.implementedBy(UNIXClient)):
            at_once_fails = "Twisted's unix transport no longer provides ISystemHandle and IConsumer"
        return [Verdict(UNWOKEN, queue_fails), Verdict(TIMER, timer_fails), Verdict(AT_ONCE, at_once_fails)]

    def announce(self, reactor: IReactorFromThreads | None = None, used: Sequence[Path] = (UNWOKEN, TIMER, AT_ONCE)) -> None:
        """Say, in one line, which of the fast paths the front end ``used`` koordrp takes (``check``). ``reactor``: the
        installed one by default."""
        if not used:
            _log.info("fast paths: this mode has none")
            return
        if reactor is None:
            from twisted.internet import reactor as installed

            reactor = IReactorFromThreads(installed)
        verdicts = [verdict for verdict in self.check(reactor) if verdict.path in used]
        turned_off = self.turned_off
        if turned_off:
            _log.info(
                "fast paths off ({setting}): {paths}; instead: {instead}",
                setting=turned_off,
                paths=", ".join(verdict.path.name for verdict in verdicts),
                instead="; ".join(verdict.path.instead for verdict in verdicts),
            )
            return
        taken = [f"{verdict.path.name} ({verdict.path.uses})" for verdict in verdicts if verdict.off is None]
        not_taken = [
            f"{verdict.path.name} ({verdict.off}; instead: {verdict.path.instead})"
            for verdict in verdicts
            if verdict.off is not None
        ]
        _log.info(
            "fast paths on: {taken}{not_taken}. {variable}=0 turns them off",
            taken="; ".join(taken) or "none",
            not_taken="; off: " + "; ".join(not_taken) if not_taken else "",
            variable=ENVIRONMENT,
        )


DEFAULT = FastPaths()
"""The fast paths as koordrp's environment says."""


def announce(reactor: IReactorFromThreads | None = None, used: Sequence[Path] = (UNWOKEN, TIMER, AT_ONCE)) -> None:
    """At start: which of the fast paths its front end uses koordrp takes (``FastPaths.announce``)."""
    DEFAULT.announce(reactor, used)
