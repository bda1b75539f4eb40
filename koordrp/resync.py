"""Keeping the store in agreement with the runtime: at start, and after the runtime was away.

Every front end reads what its runtime has with ``read_everything`` (NRI mode: from what containerd
tells at Synchronize); ``agree`` decides what the store makes of it. ``StoreSync`` reads
it, and retries while the runtime cannot say, a second after the first failure and less often after
each next one (``koordrp.trouble``: one line when that starts, one for each new reason, one when it
is over).
"""

from typing import TYPE_CHECKING, Awaitable, Callable, TypeVar

from twisted.internet.defer import CancelledError, Deferred, maybeDeferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from koordrp.adapters import LookupFailed, RuntimeInventory, Unreadable
from koordrp.hooks.messages import PodHookRequest
from koordrp.store import Store, StoredContainer, StoredPod
from koordrp.text import shortened
from koordrp.trouble import Backoff, Retrying, Trouble

if TYPE_CHECKING:
    # Only --metrics-endpoint loads prometheus_client: it costs a node daemon ~6 MB of RSS.
    from koordrp.metrics import Metrics

RETRY_SECONDS = 1.0
"""The wait after a first failure; it doubles after each next one, up to RETRY_CAP_SECONDS."""
RETRY_CAP_SECONDS = 30.0
"""A CRI front end reads the runtime again as soon as it is reachable again, whatever the wait; a call
about what the store lacks reads it back itself."""

Result = TypeVar("Result")

log = Logger()

Snapshot = tuple[list[tuple[str, StoredPod]], list[tuple[str, StoredContainer]]]
"""Every Kubernetes pod and container the runtime has, by id, as the store keeps them."""


async def read_everything(runtime: RuntimeInventory, timeout: float | None) -> Snapshot:
    """Every Kubernetes pod and container the runtime has, as the store keeps them; each question bounded by ``timeout``.

    One that cannot be read is left out with a warning; one the runtime no longer knows is left
    out; if the runtime cannot be asked, LookupFailed says why.
    """
    sandbox_ids, container_ids = await runtime.listed(timeout)
    pods: dict[str, StoredPod] = {}
    for sandbox_id in sandbox_ids:
        pod = await _readable("pod", sandbox_id, runtime.read_pod(sandbox_id, timeout))
        if pod is not None:
            pods[sandbox_id] = pod

    async def listed_pod(sandbox_id: str) -> PodHookRequest | None:
        found = pods.get(sandbox_id)
        return None if found is None else found.given

    containers: list[tuple[str, StoredContainer]] = []
    for container_id in container_ids:
        stored = await _readable("container", container_id, runtime.read_container(container_id, listed_pod, timeout))
        if stored is not None:
            containers.append((container_id, stored))
    return list(pods.items()), containers


async def _readable(kind: str, identifier: str, reading: Awaitable[Result | None]) -> Result | None:
    try:
        return await reading
    except Unreadable as error:
        log.warn(
            "{kind} {id} cannot be read from the runtime; left out: {error}",
            kind=kind,
            id=shortened(identifier, 80),
            error=shortened(str(error)),
        )
        return None



def agree(store: Store, found: Snapshot, known_before: tuple[set[str], set[str]], runtime: str) -> None:
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
        self,
        store: Store,
        read: Callable[[], "Deferred[Snapshot]"],
        clock: IReactorTime,
        runtime: str,
        metrics: "Metrics | None" = None,
    ) -> None:
        """``read`` asks the runtime for everything; ``runtime`` names it in log lines."""
        self._store = store
        self._read = read
        self._runtime = runtime
        self._retrying = Retrying(
            clock,
            self.log,
            Trouble(
                "read {runtime}'s pods and containers again, after {failures} failed attempts",
                started="cannot read {runtime}'s pods and containers: {problem}; trying again in {retry:g}s, "
                "then less often (at most every {cap:g}s)",
            ),
            Backoff(RETRY_SECONDS, RETRY_CAP_SECONDS),
            "store-resync",
            metrics,
        )
        self._reading: Deferred[None] | None = None
        self._running = False

    def start(self) -> None:
        self._running = True
        self.sync()

    def stop(self) -> None:
        self._running = False
        self._retrying.cancel()
        if self._reading is not None:
            self._reading.cancel()

    def sync(self) -> None:
        """Read the runtime now (a retry already scheduled is replaced)."""
        self._retrying.cancel()
        if not self._running:
            return
        known_before = self._store.ids()
        reading: Deferred[Snapshot] = maybeDeferred(self._read)
        self._reading = agreed = reading.addCallbacks(lambda found: self._agree(found, known_before), self._failed)
        agreed.addBoth(self._read_done)

    def _read_done(self, result: object) -> None:
        self._reading = None

    def _agree(self, found: Snapshot, known_before: tuple[set[str], set[str]]) -> None:
        agree(self._store, found, known_before, self._runtime)
        self._retrying.succeeded(runtime=self._runtime)

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
        if self._running:
            self._retrying.failed(reason, self.sync, runtime=self._runtime)
