"""Keeping the store in agreement with the runtime: at start, and after the runtime was away.

Every front end reads what its runtime has with ``koordrp.flows.read_everything`` (NRI mode: what
containerd tells at Synchronize); ``agree`` decides what the store makes of it. ``StoreSync`` reads
it, and retries every second while the runtime cannot say, with one log
line when that starts (or its reason changes) and one when it is over.
"""

from typing import Callable

from twisted.internet.defer import CancelledError, Deferred, maybeDeferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from koordrp.flows import Inventory, LookupFailed
from koordrp.store import Store
from koordrp.text import shortened

RETRY_SECONDS = 1.0

log = Logger()


def agree(store: Store, found: Inventory, known_before: tuple[set[str], set[str]], runtime: str) -> None:
    """The store agrees with what ``runtime`` (named in the log line) has, read after ``known_before``."""
    pods, containers = found
    forgotten, learnt = store.reconcile(pods, containers, known_before)
    log.info(
        "store rebuilt from {runtime}: {pods} pods, {containers} containers ({learnt} learnt, {forgotten} forgotten)",
        runtime=runtime,
        pods=len(pods),
        containers=len(containers),
        learnt=learnt,
        forgotten=forgotten,
    )


class StoreSync:
    log = Logger()

    def __init__(
        self, store: Store, read: Callable[[], "Deferred[Inventory]"], clock: IReactorTime, runtime: str
    ) -> None:
        """``read`` asks the runtime for everything; ``runtime`` names it in log lines."""
        self._store = store
        self._read = read
        self._clock = clock
        self._runtime = runtime
        self._retry: IDelayedCall | None = None
        self._reading: Deferred[None] | None = None
        self._running = False
        self._failing: str | None = None

    def start(self) -> None:
        self._running = True
        self.sync()

    def stop(self) -> None:
        self._running = False
        self._cancel_retry()
        if self._reading is not None:
            self._reading.cancel()

    def _cancel_retry(self) -> None:
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
        self._retry = None

    def sync(self) -> None:
        """Read the runtime now (a retry already scheduled is replaced)."""
        self._cancel_retry()
        if not self._running:
            return
        known_before = self._store.ids()
        reading: Deferred[Inventory] = maybeDeferred(self._read)
        self._reading = agreed = reading.addCallbacks(lambda found: self._agree(found, known_before), self._failed)
        agreed.addBoth(self._read_done)

    def _read_done(self, result: object) -> None:
        self._reading = None

    def _agree(self, found: Inventory, known_before: tuple[set[str], set[str]]) -> None:
        agree(self._store, found, known_before, self._runtime)
        self._failing = None

    def _failed(self, failure: Failure) -> None:
        if isinstance(failure.value, CancelledError) and not self._running:
            return
        if isinstance(failure.value, LookupFailed):
            reason = shortened(str(failure.value)) or type(failure.value).__name__
        else:
            reason = f"{type(failure.value).__name__}: {shortened(str(failure.value))}"
            self.log.failure(
                "reading {runtime}'s pods and containers failed unexpectedly", failure, runtime=self._runtime
            )
        if reason != self._failing:
            self.log.warn(
                "cannot read {runtime}'s pods and containers: {reason}; trying again every {retry:g}s",
                runtime=self._runtime,
                reason=reason,
                retry=RETRY_SECONDS,
            )
        self._failing = reason
        if self._running:
            self._retry = self._clock.callLater(RETRY_SECONDS, self.sync)
