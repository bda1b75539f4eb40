"""How a grpc thread hands work to the reactor, and when the reactor wakes for it.

Three ways, from the most urgent: ``reactor.callFromThread`` wakes it at once; an unwoken queue
(``koordrp.fastpaths``) holds the work without waking it, to run with whatever wakes it next, in order;
``Later`` queues it the same way and has a kernel timer wake the reactor a moment later if nothing does
before. ``Later`` is for work that must be done soon but not while a caller is taking its answer: on a
node with two cores, a reactor that wakes as an answer leaves takes a core the caller needs to receive it.
Where the fast paths are off, each of them wakes the reactor at once.
"""

import threading
from typing import Callable

from twisted.internet.interfaces import IReactorFDSet, IReactorFromThreads, IReadDescriptor
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from koordrp import fastpaths
from koordrp.fastpaths import FastPaths, Timer


def _nothing() -> None:
    pass


@implementer(IReadDescriptor)
class Later:
    """Queues work for the reactor from any thread, and has it run a moment later at most (``Timer``'s time),
    with no thread woken meanwhile: the timer is the kernel's. Something that wakes the reactor before
    runs it sooner, in order with what was queued with it.

    Without a timer, or where work cannot be queued unwoken (``FastPaths.unwoken``), the reactor is woken at once.
    """

    log = Logger()

    def __init__(self, reactor: IReactorFromThreads, timer: Timer | None, paths: FastPaths = fastpaths.DEFAULT) -> None:
        """``timer`` is Later's from now on (None: the reactor is woken at once); ``reactor`` also provides
        IReactorFDSet, on whose thread this is made."""
        self._reactor = reactor
        unwoken = paths.unwoken(reactor)
        if timer is not None and unwoken is None:
            timer.close()  # work would not wait for it
            timer = None
        self._unwoken = unwoken
        self._timer = timer
        self._arming = threading.Lock()
        self._armed = False
        if timer is not None:
            IReactorFDSet(reactor).addReader(self)

    @classmethod
    def on(cls, reactor: IReactorFromThreads, seconds: float, paths: FastPaths = fastpaths.DEFAULT) -> "Later":
        """A Later whose wake comes ``seconds`` after the work it follows, or at once where the fast paths say so
        (said at start: ``fastpaths.announce``)."""
        return cls(reactor, paths.timer(seconds), paths)

    def queue(self, work: Callable[..., object], *args: object) -> None:
        """From any thread: ``work(*args)`` runs on the reactor within the timer's time."""
        with self._arming:
            timer, unwoken = self._timer, self._unwoken
            if timer is not None and unwoken is not None:
                unwoken(work, *args)
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
