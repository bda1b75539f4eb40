"""NRI mode's store kept true between synchronizations, from containerd's NRI alone.

containerd tells its plugin of every pod and container at Synchronize (once per connection) and of
each as it comes and goes, but not of the stop and removal of a pod it ran before it last restarted
(``koordrp.nri.told``). NRI has no call that lists; a synchronization does. So every
``--reconcile-interval`` seconds, while the store holds such a pod none of whose containers is
created or running (``NRIService.going_untold``: a pod goes only after its containers, whose stops
containerd tells of), koordrp opens a second connection to the NRI socket, registers as
``<name>-listing``, takes containerd's synchronization, refuses it and closes. A plugin whose
synchronization fails is never called: containerd logs the refusal (``failed to synchronize
plugin``) and forgets it. The store forgets the pods the synchronization leaves out; containers it
does not forget this way, since containerd tells of the removal of every container it synchronized
(and Synchronize leaves out the exited ones, which are stopped but still there).

A listing is dear to containerd, not to koordrp: it holds containerd's NRI lock while it builds the
synchronization (pod starts wait), ~0.15 s for a node of 110 pods (benchmarks/README.md). So a
node's long-running pods cost no listing, and while koordrp is not containerd's plugin none is made
(its next Synchronize agrees anyway).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, AbstractSet, Callable

from twisted.application import service
from twisted.internet.defer import Deferred, TimeoutError as DeferredTimeout, fail, succeed
from twisted.internet.endpoints import UNIXClientEndpoint
from twisted.internet.interfaces import IReactorTime, IReactorUNIX
from twisted.internet.protocol import Factory
from twisted.python.failure import Failure

from koordrp.adapters import LookupFailed
from koordrp.api.nri.v1alpha1 import api_pb2 as nri
from koordrp.nri.connection import UNKNOWN, UNIMPLEMENTED, NRIConnection, NRIError
from koordrp.nri.plugin import REGISTER_SECONDS, PluginIdentity
from koordrp.nri.wire import MAX_TTRPC_MESSAGE
from koordrp.resync import StoreSync
from koordrp.store import Store
from koordrp.text import shortened

if TYPE_CHECKING:
    # Only --metrics-endpoint loads prometheus_client: it costs a node daemon ~6 MB of RSS.
    from koordrp.metrics import Metrics

QUESTION_SECONDS = 30.0
"""How long a listing may take, from the connection to containerd's last part of its synchronization."""

LINGER_SECONDS = 1.0
"""How long the connection stays after the refusal: containerd's ttrpc client fails a call whose answer it has
not read yet when the connection closes, and would log that instead of the refusal's reason."""

NOT_STAYING = "not a plugin: koordrp's listing reads the node's pods this way (NRI has no call that lists) and leaves"

# Configure must name events; none of them is ever sent to a plugin whose synchronization failed.
_EVENTS = 1 << (nri.REMOVE_POD_SANDBOX - 1)


class _Lister:
    """One listing connection's side (``PluginCalls``): the pods of containerd's synchronization, then gone."""

    def __init__(self, identity: PluginIdentity, clock: IReactorTime) -> None:
        self._identity = identity
        self._clock = clock
        self._connection: NRIConnection | None = None
        self.connecting: Deferred[NRIConnection] | None = None
        self._parts: list[nri.SynchronizeRequest] = []
        self.pods: Deferred[set[str]] = Deferred(lambda _: self.close())
        """The pods containerd has; cancelling it closes the connection."""

    def made(self, connection: NRIConnection) -> None:
        self._connection = connection
        request = nri.RegisterPluginRequest(plugin_name=f"{self._identity.name}-listing", plugin_idx=self._identity.index)
        registering = connection.call("RegisterPlugin", request.SerializeToString(), REGISTER_SECONDS)
        registering.addErrback(lambda failure: self.failed(f"cannot register: {_reason(failure)}"))

    def called(self, method: str, payload: bytes, timeout: float | None) -> Deferred[bytes]:
        if method == "Configure":
            return succeed(nri.ConfigureResponse(events=_EVENTS).SerializeToString())
        if method != "Synchronize":
            return fail(NRIError(UNIMPLEMENTED, f"koordrp's listing does not handle {method}"))
        try:
            part = nri.SynchronizeRequest.FromString(payload)
        except Exception as error:  # protobuf's DecodeError, or worse
            self.failed(f"cannot read containerd's synchronization: {shortened(str(error))}")
            return fail(NRIError(UNKNOWN, "koordrp's listing cannot read the synchronization"))
        self._parts.append(part)
        if part.more:
            return succeed(nri.SynchronizeResponse(more=True).SerializeToString())
        if not self.pods.called:
            self.pods.callback({pod.id for each in self._parts for pod in each.pods})
        self._clock.callLater(LINGER_SECONDS, self.close)
        return fail(NRIError(UNKNOWN, NOT_STAYING))

    def oversized(self, length: int) -> None:
        self.failed(f"containerd sent {length} bytes at once, beyond the {MAX_TTRPC_MESSAGE >> 20} MiB ttrpc carries")

    def lost(self, reason: Failure) -> None:
        self.failed(f"the connection was lost: {_reason(reason)}")

    def failed(self, why: str) -> None:
        if not self.pods.called:
            self.pods.errback(LookupFailed(why))
        self.close()

    def close(self) -> None:
        if self.connecting is not None and not self.connecting.called:
            self.connecting.cancel()
        if self._connection is not None:
            self._connection.close()


def _reason(failure: Failure) -> str:
    if isinstance(failure.value, DeferredTimeout):
        return "no answer in time"
    return shortened(failure.getErrorMessage()).rstrip(".")


class NRIListing:
    """The pods containerd has, by a synchronization of a connection of their own (``adapters.RuntimeListing``)."""

    def __init__(self, reactor: IReactorUNIX, socket_path: str, identity: PluginIdentity, store: Store) -> None:
        self._reactor = reactor
        self._clock = IReactorTime(reactor)
        self._socket_path = socket_path
        self._identity = identity
        self._store = store

    async def listed(self, timeout: float | None) -> tuple[list[str], list[str]]:
        """The pods of containerd's synchronization, and the store's containers: containerd tells of their removal."""
        pods = await self._synchronization(timeout)
        return list(pods), list(self._store.ids()[1])

    def _synchronization(self, timeout: float | None) -> Deferred[set[str]]:
        lister = _Lister(self._identity, self._clock)
        endpoint = UNIXClientEndpoint(self._reactor, self._socket_path, timeout=REGISTER_SECONDS)  # type: ignore[no-untyped-call]
        factory = Factory.forProtocol(lambda: NRIConnection(lister, self._clock))
        factory.noisy = False
        lister.connecting = endpoint.connect(factory)  # type: ignore[no-untyped-call]
        lister.connecting.addErrback(lambda failure: lister.failed(f"cannot connect: {_reason(failure)}"))
        if timeout is not None:
            lister.pods.addTimeout(timeout, self._clock, lambda result, seconds: _too_long(seconds))
        return lister.pods


def _too_long(seconds: float) -> set[str]:
    raise LookupFailed(f"containerd's NRI did not synchronize the listing within {seconds:g}s")


class NRIListingService(service.Service):
    """Reads containerd's pods by NRI every ``interval`` seconds while some may go untold, or while something kept
    for one about to be made waits for a reading to go (``Store.awaits_a_reading``), forgetting only."""

    def __init__(
        self,
        reactor: IReactorUNIX,
        socket_path: str,
        identity: PluginIdentity,
        store: Store,
        untold: Callable[[], AbstractSet[str]],
        interval: float,
        metrics: Metrics | None = None,
    ) -> None:
        """``untold``: the pods of the store that may go without containerd telling of it (none: no reading is due)."""
        listing = NRIListing(reactor, socket_path, identity, store)
        clock = IReactorTime(reactor)
        self._sync = StoreSync(store, listing, clock, "containerd's NRI", interval, QUESTION_SECONDS, metrics, due=lambda: bool(untold()) or store.awaits_a_reading())

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self._sync.start()

    def stopService(self) -> None:
        super().stopService()  # type: ignore[no-untyped-call]
        self._sync.stop()
