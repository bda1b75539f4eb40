"""Reading pods and containers back from containerd, for store misses and for the store's rebuild.

The reads block their thread (a grpc worker, or the reactor's pool for the rebuild); they are
``async`` only to fit ``koordrp.flows``' reader protocols, and never suspend.
"""

from typing import Callable, TypeVar

import grpc

from koordrp.api.cri.v1 import api_pb2 as cri
from koordrp.cri.runtime_info import RuntimeInfoError, container_info_from_status, container_sandbox_id, pod_info_from_status
from koordrp.flows import LookupFailed, PodSource, Unreadable
from koordrp.hooks.messages import PodHookRequest
from koordrp.store import StoredContainer

Found = TypeVar("Found")
Response = TypeVar("Response")

_RUNTIME_SERVICE = "/runtime.v1.RuntimeService/"


def _ask(what: str, read: Callable[[], Found]) -> Found | None:
    """``read()``, None when the runtime says it does not know the id, LookupFailed when it cannot say."""
    try:
        return read()
    except grpc.RpcError as error:
        call: grpc.Call = error  # type: ignore[assignment]
        if call.code() is grpc.StatusCode.NOT_FOUND:
            return None
        raise LookupFailed(f"{what}: {call.code().name}: {call.details()}") from None
    except RuntimeInfoError as error:
        raise Unreadable(f"{what}: {error}") from None


class RuntimeLookup:
    """containerd's answers about pods and containers, as the store keeps them."""

    def __init__(self, channel: grpc.Channel) -> None:
        def method(name: str, response: type[Response]) -> Callable[..., Response]:
            return channel.unary_unary(
                _RUNTIME_SERVICE + name,
                request_serializer=lambda request: request.SerializeToString(),
                response_deserializer=response.FromString,  # type: ignore[attr-defined]
                _registered_method=True,  # type: ignore[call-arg]
            )

        self._pod_status = method("PodSandboxStatus", cri.PodSandboxStatusResponse)
        self._container_status = method("ContainerStatus", cri.ContainerStatusResponse)
        self._list_pods = method("ListPodSandbox", cri.ListPodSandboxResponse)
        self._list_containers = method("ListContainers", cri.ListContainersResponse)

    def pod(self, sandbox_id: str, timeout: float | None) -> PodHookRequest | None:
        """The pod as the runtime has it, or None when the runtime does not know it."""

        def read() -> PodHookRequest:
            request = cri.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id, verbose=True)
            return pod_info_from_status(self._pod_status(request, timeout=timeout))

        return _ask(f"PodSandboxStatus of {sandbox_id}", read)

    def container_status(self, container_id: str, timeout: float | None) -> cri.ContainerStatusResponse | None:
        request = cri.ContainerStatusRequest(container_id=container_id, verbose=True)
        return _ask(f"ContainerStatus of {container_id}", lambda: self._container_status(request, timeout=timeout))

    def listed(self, timeout: float | None) -> tuple[list[str], list[str]]:
        try:
            sandboxes = self._list_pods(cri.ListPodSandboxRequest(), timeout=timeout).items
            containers = self._list_containers(cri.ListContainersRequest(), timeout=timeout).containers
        except grpc.RpcError as error:
            call: grpc.Call = error  # type: ignore[assignment]
            raise LookupFailed(f"{call.code().name}: {call.details()}") from None
        return [sandbox.id for sandbox in sandboxes], [container.id for container in containers]

    def within(self, timeout: float | None) -> "BoundedLookup":
        return BoundedLookup(self, timeout)


async def stored_container(status: cri.ContainerStatusResponse | None, pods: PodSource) -> StoredContainer | None:
    """The container a verbose ContainerStatus describes, its pod from ``pods``."""
    if status is None:
        return None
    try:
        sandbox_id = container_sandbox_id(status)
        return StoredContainer(sandbox_id, container_info_from_status(status, await pods(sandbox_id)))
    except RuntimeInfoError as error:
        raise Unreadable(f"ContainerStatus of {status.status.id}: {error}") from None


class BoundedLookup:
    """``koordrp.flows.RuntimeInventory`` over containerd, every question bounded by ``timeout``."""

    def __init__(self, lookup: RuntimeLookup, timeout: float | None) -> None:
        self._lookup = lookup
        self._timeout = timeout

    async def read_pod(self, sandbox_id: str) -> PodHookRequest | None:
        return self._lookup.pod(sandbox_id, self._timeout)

    async def read_container(self, container_id: str, pods: PodSource) -> StoredContainer | None:
        return await stored_container(self._lookup.container_status(container_id, self._timeout), pods)

    async def listed(self) -> tuple[list[str], list[str]]:
        return self._lookup.listed(self._timeout)
