"""SIGTERM is koordrp's normal way to stop: it ends with exit status 0, as soon as the stop is over.

twistd re-raises the signal that stopped the reactor, which makes every ordinary stop look like a
crash (status 143) to whoever watches the process. This service takes over SIGTERM once the reactor
runs (the reactor installs its own handlers at start-up) and stops the reactor without recording
a signal; everything else about the shutdown is the reactor's usual one.

Once that shutdown is over (every service stopped, the front end's drain within ``--grace-period``
included, then the reactor's own triggers) and twistd has written its last line and removed its pid
file, the process ends at once (``os._exit``, from the first exit handler Python runs): what Python
would do next, tearing down every module and object (grpc's, protobuf's, Twisted's), is CPU work
that serves nothing, and took 0.1 s on an idle node and up to a second on a loaded one, past the
stop's bound.
"""

import atexit
import logging
import os
import signal
import sys
from types import FrameType
from typing import Callable

from twisted.application import service
from twisted.internet.interfaces import IReactorCore, IReactorFromThreads, IReactorTime
from twisted.logger import Logger


class OrderlyStopOnSIGTERM(service.Service):
    log = Logger()

    def __init__(
        self,
        reactor: IReactorCore,
        at_exit: Callable[[Callable[[], None]], object] = atexit.register,
        end: Callable[[int], None] = os._exit,
    ) -> None:
        """``at_exit`` and ``end``: how the process ends at once (tests give their own)."""
        self._reactor = reactor
        self._at_exit = at_exit
        self._end = end
        self._asked_at: float | None = None

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self._reactor.callWhenRunning(signal.signal, signal.SIGTERM, self._on_sigterm)
        self._reactor.addSystemEventTrigger("after", "shutdown", self._shut_down)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self.log.info("SIGTERM received: shutting down")
        if self._asked_at is None:
            self._asked_at = IReactorTime(self._reactor).seconds()
        IReactorFromThreads(self._reactor).callFromThread(self._reactor.stop)

    def _shut_down(self) -> None:
        """The reactor's shutdown is over: after SIGTERM, the process ends as soon as twistd has done with it
        (Python runs the exit handler registered last first)."""
        if self._asked_at is not None:
            self.log.info("stopped {seconds:.2f}s after SIGTERM", seconds=IReactorTime(self._reactor).seconds() - self._asked_at)
            self._at_exit(self._exit_at_once)

    def _exit_at_once(self) -> None:
        logging.shutdown()  # the one exit handler registered before (the standard library's), which this one skips
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        # An exception that ended twistd (printed by now) keeps its status.
        self._end(0 if getattr(sys, "last_value", None) is None else 1)
