"""What NRI mode gives the flows (``koordrp.adapters``): containerd's part of a call (``NRIReply``), the backend of
one of containerd's requests (``NRIBackend``), what Synchronize told (``Synchronized``), and containerd's
UpdateContainers for what can still change in a created container (``LateAnswers``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from twisted.internet.defer import Deferred, TimeoutError as DeferredTimeout

from koordrp import adapters, flows
from koordrp.call import Call
from koordrp.api.nri.v1alpha1 import api_pb2 as nri
from koordrp.hooks.messages import ContainerHookRequest, placed_in_pod
from koordrp.nri import translate
from koordrp.nri.connection import NRIConnection, NRIError
from koordrp.store import StoredContainer, StoredPod

UPDATE_SECONDS = 30.0
"""How long koordrp waits for containerd to apply a late answer (containerd applies it between its calls to plugins)."""

def not_done(call: Call[NRIReply], why: str, because: str) -> None:
    """containerd did not do what the call told of, or did not take what its hooks changed: the call's line says
    ``why``, and names every change of its hooks as left alone ``because``."""
    call.record.why = why
    for hook in flows.METHOD_HOOKS[call.lifecycle]:
        call.record.leave_alone(hook, "", because)


@dataclass(frozen=True)
class NRIReply:
    """containerd's part of a call (adapters.Reply): whether it said it did it, and if not, what it told instead."""

    ok: bool
    created_id: str = ""
    why_not: str = ""

    @property
    def label(self) -> str:
        return adapters.OK_LABEL if self.ok else "NOT-CONFIRMED"


class NRIBackend:
    """``adapters.Backend`` for one NRI request: answering containerd, and what the request says of its pod and container."""

    def __init__(
        self,
        answer: Deferred[bytes],
        empty: bytes,
        pod: nri.PodSandbox | None,
        container: nri.Container | None,
        confirm: Callable[[], Deferred[str | None]] | None,
    ) -> None:
        """``pod`` and ``container``: what the request tells of them, if the flow may read them from it."""
        self._answer = answer
        self._empty = empty
        self._pod = pod
        self._container = container
        self._confirm = confirm

    async def forward(self, rewritten: bytes | None, timeout: float | None) -> NRIReply:
        """Answer containerd (``rewritten``: with the hooks' changes); then wait for its word that it did it."""
        created = self._container.id if self._container is not None else self._pod.id if self._pod is not None else ""
        if not self._answer.called:
            self._answer.callback(self._empty if rewritten is None else rewritten)
        if self._confirm is None:
            return NRIReply(True, created)
        why_not = await self._confirm()
        return NRIReply(why_not is None, created, why_not or "")

    async def read_pod(self, sandbox_id: str, timeout: float | None) -> StoredPod | None:
        if self._pod is None or sandbox_id != self._pod.id:
            return None
        return StoredPod.read_back(translate.pod_hook_request(self._pod), stopped=False)

    async def read_container(self, container_id: str, pods: adapters.PodSource, timeout: float | None) -> StoredContainer | None:
        container = self._container
        if container is None or self._pod is None or container_id != container.id:
            return None
        return await _stored_container(container, self._pod, pods)


async def _stored_container(container: nri.Container, pod: nri.PodSandbox, pods: adapters.PodSource) -> StoredContainer:
    """``container`` as the store keeps it, in its pod as ``pods`` has it (or as NRI told of it)."""
    request = translate.container_hook_request(container, pod.linux.cgroup_parent)
    stored_pod = await pods(container.pod_sandbox_id)
    if stored_pod is not None:
        placed_in_pod(request, stored_pod)
    return StoredContainer.read_back(container.pod_sandbox_id, request, translate.container_state(container.state))


class LateAnswers:
    """``adapters.LateUpdates`` on an NRI connection: containerd's UpdateContainers, the call a plugin makes to
    change a container it was not asked about."""

    def __init__(self, connection: NRIConnection | None) -> None:
        self._connection = connection

    async def apply(
        self, container_id: str, sent: ContainerHookRequest, answered: ContainerHookRequest
    ) -> tuple[adapters.LeftAlone, ...]:
        written = translate.late_update(container_id, sent, answered)
        if written.request is not None:
            await self.send(written.request)
        return written.left_alone

    async def send(self, request: bytes) -> None:
        """Have containerd apply ``request`` (an UpdateContainersRequest); LateNotApplied says why it did not."""
        if self._connection is None:
            raise adapters.LateNotApplied("koordrp is not connected to containerd's NRI")
        try:
            payload = await self._connection.call("UpdateContainers", request, UPDATE_SECONDS)
        except NRIError as error:
            raise adapters.LateNotApplied(f"containerd refused the update: {error}") from None
        except DeferredTimeout:
            raise adapters.LateNotApplied(f"containerd did not answer the update within {UPDATE_SECONDS:g}s") from None
        if nri.UpdateContainersResponse.FromString(payload).failed:
            raise adapters.LateNotApplied("containerd failed the update")


class Synchronized:
    """What containerd told at Synchronize, as ``adapters.RuntimeInventory`` (for the store to agree with)."""

    def __init__(self, request: nri.SynchronizeRequest) -> None:
        self._pods = {pod.id: pod for pod in request.pods}
        self._containers = {container.id: container for container in request.containers}

    async def listed(self, timeout: float | None) -> tuple[list[str], list[str]]:
        return list(self._pods), list(self._containers)

    async def read_pod(self, sandbox_id: str, timeout: float | None) -> StoredPod | None:
        pod = self._pods.get(sandbox_id)
        return None if pod is None else StoredPod.read_back(translate.pod_hook_request(pod), stopped=False)

    async def read_container(self, container_id: str, pods: adapters.PodSource, timeout: float | None) -> StoredContainer | None:
        container = self._containers.get(container_id)
        if container is None:
            return None
        return await _stored_container(container, self._pods.get(container.pod_sandbox_id, nri.PodSandbox()), pods)
