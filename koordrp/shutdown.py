"""SIGTERM is koordrp's normal way to stop, so it ends with exit status 0.

twistd re-raises the signal that stopped the reactor, which makes every ordinary stop look like a
crash (status 143) to whoever watches the process. This service takes over SIGTERM once the reactor
runs (the reactor installs its own handlers at start-up) and stops the reactor without recording
a signal; everything else about the shutdown is the reactor's usual one.
"""

import signal
from types import FrameType

from twisted.application import service
from twisted.internet.interfaces import IReactorCore, IReactorFromThreads
from twisted.logger import Logger


class OrderlyStopOnSIGTERM(service.Service):
    log = Logger()

    def __init__(self, reactor: IReactorCore) -> None:
        self._reactor = reactor

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self._reactor.callWhenRunning(signal.signal, signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self.log.info("SIGTERM received: shutting down")
        IReactorFromThreads(self._reactor).callFromThread(self._reactor.stop)
