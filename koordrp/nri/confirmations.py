"""containerd's word that it did what it told the plugin of: its next event about the same container.

NRI tells a plugin of a create, start or update before containerd does it (the answer may change it),
and of its Post event once it has: so a flow's "forward" (answering containerd) is confirmed by the
container's PostCreateContainer, PostStartContainer or PostUpdateContainer, and refuted by a stop or a
removal that comes first.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime

from koordrp.api.nri.v1alpha1 import api_pb2 as nri

CONFIRM_SECONDS = 120.0
"""How long a create, start or update waits for containerd to say it happened (kubelet's own bound)."""

UNDONE_CREATE = "containerd undid the create after koordrp answered: it told of the container's stop before it was made"

# What each Post event confirms.
_CONFIRMED_BY: dict[int, str] = {
    nri.POST_CREATE_CONTAINER: "create",
    nri.POST_START_CONTAINER: "start",
    nri.POST_UPDATE_CONTAINER: "update",
}
_HAS_RUN = (nri.CONTAINER_RUNNING, nri.CONTAINER_PAUSED, nri.CONTAINER_STOPPED)


class Confirmations:
    """containerd's word, by its next event about a container, that it did what the plugin was told of."""

    def __init__(self, clock: IReactorTime) -> None:
        self._clock = clock
        self._waiting: dict[tuple[str, str], tuple[Deferred[str | None], IDelayedCall]] = {}

    def expect(self, kind: str, container_id: str) -> Deferred[str | None]:
        """Fires None once ``kind`` (create, start, update) of the container is confirmed; else with what containerd
        told instead (a stop or removal of the container first, a newer one of the same kind) or that it said
        nothing in CONFIRM_SECONDS."""
        key = (kind, container_id)
        self._settle(key, f"a newer {kind} of the container came first")
        waiting: Deferred[str | None] = Deferred(lambda _: self._forget(key))
        timer = self._clock.callLater(CONFIRM_SECONDS, self._settle, key, f"containerd did not say it did it within {CONFIRM_SECONDS:g}s")
        self._waiting[key] = (waiting, timer)
        return waiting

    def happened(self, event: int, container: nri.Container) -> None:
        """containerd told of ``event`` about ``container`` (as it is now)."""
        kind = _CONFIRMED_BY.get(event)
        if kind is not None:
            self._settle((kind, container.id), None)
        elif event == nri.STOP_CONTAINER:
            # containerd undoes a create that failed after the plugins answered (another plugin's
            # conflicting answer, the runtime's error) with a stop and a removal.
            self._settle(("create", container.id), UNDONE_CREATE)
            self._settle(("update", container.id), "containerd stopped the container before updating it")
            # containerd tells of a failed start as a stop of the container still created; one that has
            # run (even if it exited at once) did start.
            started = container.state in _HAS_RUN
            self._settle(("start", container.id), None if started else "containerd failed the start: it told of the container's stop while still created")
        elif event == nri.REMOVE_CONTAINER:
            for kind in ("create", "start", "update"):
                self._settle((kind, container.id), f"containerd removed the container before the {kind}")

    def _forget(self, key: tuple[str, str]) -> None:
        found = self._waiting.pop(key, None)
        if found is not None and found[1].active():
            found[1].cancel()

    def _settle(self, key: tuple[str, str], why_not: str | None) -> None:
        found = self._waiting.pop(key, None)
        if found is not None:
            waiting, timer = found
            if timer.active():
                timer.cancel()
            waiting.callback(why_not)

    def cancel_all(self) -> None:
        for waiting, _ in list(self._waiting.values()):
            waiting.cancel()
