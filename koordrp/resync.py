"""Keeping the store in agreement with the runtime: at start, after the runtime was away, and every
``--reconcile-interval`` seconds, so that what was removed behind koordrp's back is forgotten.

Every front end reads what its runtime has with ``read_everything``; ``agree`` decides what the
store makes of it. ``StoreSync`` reads it at start and then periodically, and retries while the
runtime cannot say, a second after the first failure and less often after each next one
(``koordrp.trouble``: one line when that starts, one for each new reason, one when it is over); a
periodic reading that changes nothing logs nothing. NRI mode agrees with what
containerd tells at Synchronize too, and in between forgets the pods containerd does not tell of by
a listing of its own (``koordrp.nri.listing``).
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, AbstractSet, Awaitable, Callable, TypeVar

from twisted.internet.defer import CancelledError, Deferred, ensureDeferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from koordrp.adapters import LookupFailed, RuntimeInventory, RuntimeListing, Unreadable
from koordrp.hooks.messages import PodHookRequest
from koordrp.store import Store, StoredContainer, StoredPod
from koordrp.text import shortened
from koordrp.trouble import RETRY_CAP_SECONDS, RETRY_SECONDS, Backoff, Retrying, Trouble

if TYPE_CHECKING:
    # Only --metrics-endpoint loads prometheus_client: it costs a node daemon ~6 MB of RSS.
    from koordrp.metrics import Metrics

Result = TypeVar("Result")

log = Logger()


@dataclass(frozen=True)
class Snapshot:
    """What the runtime has: the id of every Kubernetes pod and container it lists, and those of them read
    back, as the store keeps them."""

    pod_ids: AbstractSet[str]
    container_ids: AbstractSet[str]
    pods: list[tuple[str, StoredPod]]
    containers: list[tuple[str, StoredContainer]]
    unreadable: AbstractSet[str] = frozenset()
    """The ids listed whose answers koordrp could not read (each told once, with a warning)."""


async def read_everything(
    runtime: RuntimeInventory, timeout: float | None, store: Store | None = None, skip: AbstractSet[str] = frozenset()
) -> Snapshot:
    """Every Kubernetes pod and container the runtime has, as the store keeps them; each question bounded by ``timeout``.

    What ``store`` has already, and the ids in ``skip``, are listed but not read again: an entry a
    call wrote is at least as fresh. One that cannot be read is left out with a warning; one the
    runtime no longer knows is left out; if the runtime cannot be asked, LookupFailed says why.
    """
    sandbox_ids, container_ids = await runtime.listed(timeout)

    def unknown(identifier: str) -> bool:
        if identifier in skip:
            return False
        return store is None or not (store.has_pod(identifier) or store.has_container(identifier))

    pods: dict[str, StoredPod] = {}
    unreadable: set[str] = set()
    for sandbox_id in filter(unknown, sandbox_ids):
        pod = await _readable("pod", sandbox_id, runtime.read_pod(sandbox_id, timeout), unreadable)
        if pod is not None:
            pods[sandbox_id] = pod

    async def listed_pod(sandbox_id: str) -> PodHookRequest | None:
        found = pods.get(sandbox_id)
        if found is None and store is not None:
            found = store.pod(sandbox_id)
        return None if found is None else found.given

    containers: list[tuple[str, StoredContainer]] = []
    for container_id in filter(unknown, container_ids):
        reading = runtime.read_container(container_id, listed_pod, timeout)
        stored = await _readable("container", container_id, reading, unreadable)
        if stored is not None:
            containers.append((container_id, stored))
    return Snapshot(frozenset(sandbox_ids), frozenset(container_ids), list(pods.items()), containers, frozenset(unreadable))


async def _readable(kind: str, identifier: str, reading: Awaitable[Result | None], unreadable: set[str]) -> Result | None:
    try:
        return await reading
    except Unreadable as error:
        unreadable.add(identifier)
        log.warn(
            "{kind} {id} cannot be read from the runtime; left out: {error}",
            kind=kind,
            id=shortened(identifier, 80),
            error=shortened(str(error)),
        )
        return None


def agree(
    store: Store,
    found: Snapshot,
    known_before: tuple[AbstractSet[str], AbstractSet[str]],
    runtime: str,
    quiet: bool = False,
) -> None:
    """The store agrees with what ``runtime`` (named in the log line) has, read after ``known_before``.

    The line says what the store holds now, and what it learnt and forgot; ``quiet``: only if it
    learnt or forgot something.
    """
    forgotten, learnt = store.reconcile((found.pod_ids, found.container_ids), found.pods, found.containers, known_before)
    if quiet and not (forgotten or learnt):
        return
    pods, containers = store.sizes()
    log.info(
        "store {done} {runtime}: {pods} pods, {containers} containers ({learnt} learnt, {forgotten} forgotten)",
        done="reconciled with" if quiet else "rebuilt from",
        runtime=runtime,
        pods=pods,
        containers=containers,
        learnt=learnt,
        forgotten=forgotten,
    )


class StoreSync:
    """Keeps the store in agreement with one runtime: reads it at start, every ``interval`` seconds (0: only
    at start), and at once when told (``sync``: the runtime is back)."""

    log = Logger()

    def __init__(
        self,
        store: Store,
        inventory: RuntimeListing,
        clock: IReactorTime,
        runtime: str,
        interval: float = 0.0,
        timeout: float | None = None,
        metrics: "Metrics | None" = None,
        due: Callable[[], bool] = lambda: True,
    ) -> None:
        """``runtime`` names ``inventory`` in log lines; each question to it is bounded by ``timeout``;
        ``due`` says whether a reading is wanted now (one that is not waits for the next interval).

        An inventory that reads back (``RuntimeInventory``): what the runtime lists and the store lacks
        is read back and learnt. A listing alone: the store learns what appears from elsewhere (NRI
        mode: containerd's events, which tell of a pod sandbox just before containerd lists it), so a
        reading only forgets, and only what the store knew before the previous reading began: so
        young a pod is not taken for gone. Where koordrp hears of a pod or container only once the
        runtime has made it (the proxies), a reading forgets what the store knew before it began.
        """
        self._store = store
        self._inventory = inventory
        self._clock = clock
        self._runtime = runtime
        self._interval = interval
        self._timeout = timeout
        self._learns = isinstance(inventory, RuntimeInventory)
        self._due = due
        self._next: IDelayedCall | None = None
        self._reading: Deferred[None] | None = None
        self._running = False
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
        self._known_earlier: tuple[AbstractSet[str], AbstractSet[str]] = (frozenset(), frozenset())
        self._unreadable: AbstractSet[str] = frozenset()

    def start(self) -> None:
        self._running = True
        self.sync()

    def stop(self) -> None:
        self._running = False
        self._cancel_next()
        if self._reading is not None:
            self._reading.cancel()

    def _cancel_next(self) -> None:
        self._retrying.cancel()
        if self._next is not None and self._next.active():
            self._next.cancel()
        self._next = None

    def sync(self) -> None:
        """Read the runtime now (the next reading is put off); a reading under way stands for it."""
        self._read(periodic=False)

    def _read(self, periodic: bool) -> None:
        self._cancel_next()
        if not self._running or self._reading is not None:
            return
        known_now = self._store.ids()
        known_before = known_now if self._learns else self._known_earlier
        self._known_earlier = known_now
        if not self._due():
            self._read_done(None)
            return
        reading = ensureDeferred(self._snapshot())
        # What goes wrong in agreeing with a reading is a failure too: said, and retried.
        agreed = reading.addCallback(lambda found: self._agree(found, known_before, periodic)).addErrback(self._failed)
        self._reading = agreed
        agreed.addBoth(self._read_done)

    async def _snapshot(self) -> Snapshot:
        if isinstance(self._inventory, RuntimeInventory):
            return await read_everything(self._inventory, self._timeout, self._store, self._unreadable)
        pod_ids, container_ids = await self._inventory.listed(self._timeout)
        return Snapshot(frozenset(pod_ids), frozenset(container_ids), [], [])

    def _read_done(self, result: object) -> None:
        self._reading = None
        # A failed reading is retried by its back-off (``_failed``).
        if self._running and self._retrying.failing is None and self._interval > 0:
            self._next = self._clock.callLater(self._interval, self._read, True)

    def _agree(self, found: Snapshot, known_before: tuple[AbstractSet[str], AbstractSet[str]], periodic: bool) -> None:
        self._unreadable = (self._unreadable & (found.pod_ids | found.container_ids)) | found.unreadable
        # Only a rebuild (at start, after trouble) is told when nothing changed.
        agree(self._store, found, known_before, self._runtime, quiet=periodic or not self._learns)
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
            self._retrying.failed(reason, lambda: self._read(False), runtime=self._runtime)
