"""Reading pods and containers back from the runtime, for store misses and start-up."""

from typing import Callable, TypeVar

import grpc
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from koordrp.lifecycle import PodHookRequest
from koordrp.runtime_info import RuntimeInfoError, container_info_from_status, pod_info_from_status, container_sandbox_id
from koordrp.store import StoredContainer


class LookupFailed(Exception):
    """The runtime could not say (unreachable, or an answer koordrp cannot read)."""


Found = TypeVar("Found")


def _ask(what: str, read: Callable[[], Found]) -> Found | None:
    """``read()``, None when the runtime says it does not know the id, LookupFailed for anything else."""
    try:
        return read()
    except grpc.RpcError as error:
        if error.code() is grpc.StatusCode.NOT_FOUND:
            return None
        raise LookupFailed(f"{what}: {error.code().name}: {error.details()}") from None
    except RuntimeInfoError as error:
        raise LookupFailed(f"{what}: {error}") from None


PodSource = Callable[[str], PodHookRequest | None]


class RuntimeLookup:
    def __init__(self, channel: grpc.Channel) -> None:
        self._runtime = cri_grpc.RuntimeServiceStub(channel)

    def pod(self, sandbox_id: str, timeout: float | None) -> PodHookRequest | None:
        """The pod as the runtime has it, or None when the runtime does not know it."""

        def read() -> PodHookRequest:
            request = cri.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id, verbose=True)
            return pod_info_from_status(self._runtime.PodSandboxStatus(request, timeout=timeout))

        return _ask(f"PodSandboxStatus of {sandbox_id}", read)

    def container(self, container_id: str, pods: PodSource, timeout: float | None) -> StoredContainer | None:
        """The container as the runtime has it, its pod from ``pods``; None when the runtime does not know it."""

        def read() -> StoredContainer:
            request = cri.ContainerStatusRequest(container_id=container_id, verbose=True)
            status = self._runtime.ContainerStatus(request, timeout=timeout)
            sandbox_id = container_sandbox_id(status)
            return StoredContainer(sandbox_id, container_info_from_status(status, pods(sandbox_id)))

        return _ask(f"ContainerStatus of {container_id}", read)

    def everything(self, timeout: float | None) -> tuple[list[tuple[str, PodHookRequest]], list[tuple[str, StoredContainer]]]:
        """Every pod and container the runtime has, as the store keeps them."""
        try:
            sandboxes = self._runtime.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=timeout).items
            containers = self._runtime.ListContainers(cri.ListContainersRequest(), timeout=timeout).containers
        except grpc.RpcError as error:
            raise LookupFailed(f"{error.code().name}: {error.details()}") from None
        pods: dict[str, PodHookRequest] = {}
        for sandbox in sandboxes:
            pod = self.pod(sandbox.id, timeout)
            if pod is not None:
                pods[sandbox.id] = pod
        found: list[tuple[str, StoredContainer]] = []
        for listed in containers:
            stored = self.container(listed.id, pods.get, timeout)
            if stored is not None:
                found.append((listed.id, stored))
        return list(pods.items()), found
