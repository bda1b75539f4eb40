"""NRI mode's reconcile between containerd's synchronizations: containerd's CRI socket lists every pod
sandbox and container, and the store forgets what is no longer listed.

NRI has no call that lists. containerd tells a plugin of everything at Synchronize (once per
connection) and of each pod and container as it comes and goes, but not of every going: containerd
1.7 does not tell of the removal of pods made before it restarted, and a pod that goes while the
plugin is not connected is only missing from the next Synchronize. containerd's CRI plugin, which NRI
lives in, answers ListPodSandbox and ListContainers on containerd's own socket
(``--remote-runtime-service-endpoint``), as it does for CRI mode. The store learns nothing from it:
what appears, NRI tells of, as containerd made it after every plugin's adjustment (CRI's verbose
status shows kubelet's request instead), and Synchronize leaves out the exited containers CRI lists,
which would then be learnt and forgotten in turn.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc
from twisted.application import service
from twisted.internet.interfaces import IReactorFromThreads, IReactorTime

from koordrp.cri.backend import CHANNEL_OPTIONS
from koordrp.cri.runtime_lookup import RuntimeLookup
from koordrp.resync import StoreSync
from koordrp.store import Store
from koordrp.unix import grpc_target

if TYPE_CHECKING:
    # Only --metrics-endpoint loads prometheus_client: it costs a node daemon ~6 MB of RSS.
    from koordrp.metrics import Metrics

QUESTION_SECONDS = 30.0


class CRIListing(service.Service):
    """Reconciles the store with containerd's CRI listing every ``interval`` seconds, forgetting only."""

    def __init__(
        self, path: str, reactor: IReactorFromThreads, store: Store, interval: float, metrics: Metrics | None = None
    ) -> None:
        """``reactor`` also provides IReactorTime."""
        self.path = path
        self._metrics = metrics
        self._reactor = reactor
        self._store = store
        self._interval = interval
        self._sync: StoreSync | None = None

    def _new_channel(self) -> grpc.Channel:
        return grpc.insecure_channel(grpc_target(self.path), options=CHANNEL_OPTIONS)

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        # A channel for each reading (a listing: this service reads nothing back), closed after it: an open
        # channel keeps grpcio's threads waking several times a second (~0.75 ms of CPU a second, for a
        # reading a minute). And grpcio does not survive fork(): a channel is made once twistd has daemonized.
        lookup = RuntimeLookup(self._reactor, self._new_channel)
        clock = IReactorTime(self._reactor)
        self._sync = StoreSync(
            self._store, lookup, clock, "containerd's CRI", self._interval, QUESTION_SECONDS, False, self._metrics
        )
        self._sync.start()

    def stopService(self) -> None:
        super().stopService()  # type: ignore[no-untyped-call]
        if self._sync is not None:
            self._sync.stop()
            self._sync = None
