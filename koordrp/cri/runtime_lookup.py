"""Reading pods and containers back from containerd, for store misses and for the store's rebuild.

The reads block their thread (a grpc worker, or the reactor's pool for the rebuild); they are
``async`` only to fit ``koordrp.flows``' reader protocols, and never suspend. Answers are parsed
here rather than by grpc: containerd 1.6 takes text that is not UTF-8 (its generated code checks
none) and answers with it, which Python's protobuf refuses. Such a pod or container is unreadable,
and it must not hide the others, nor look like a runtime that is away.
"""

from typing import Callable, TypeVar

import grpc
from google.protobuf import empty_pb2
from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

from koordrp.api.cri.v1 import api_pb2 as cri
from koordrp.cri.runtime_info import (
    RuntimeInfoError,
    container_info_from_status,
    container_sandbox_id,
    pod_info_from_status,
)
from koordrp.flows import LookupFailed, PodSource, Unreadable
from koordrp.store import ContainerState, StoredContainer, StoredPod

Found = TypeVar("Found")
Parsed = TypeVar("Parsed", bound=Message)

_RUNTIME_SERVICE = "/runtime.v1.RuntimeService/"
_LENGTH_DELIMITED = 2


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


def _parsed(kind: type[Parsed], raw: bytes) -> Parsed:
    try:
        return kind.FromString(raw)
    except DecodeError as error:
        raise RuntimeInfoError(f"the answer cannot be parsed: {error}") from None


def _fields(raw: bytes, number: int) -> list[bytes]:
    """The length-delimited fields numbered ``number`` of a message, read without its schema."""
    found = UnknownFieldSet(empty_pb2.Empty.FromString(raw))
    fields = (found[index] for index in range(len(found)))
    return [field.data for field in fields if field.field_number == number and field.wire_type == _LENGTH_DELIMITED]


def listed_ids(raw: bytes) -> list[str]:
    """The ids of a ListPodSandbox or ListContainers answer: its items (field 1), each one's id (field 1).

    Nothing else of an item is read, so one with text that is not UTF-8 hides no other.
    """
    return [identifier.decode("utf-8", "replace") for item in _fields(raw, 1) for identifier in _fields(item, 1)]


class RuntimeLookup:
    """containerd's answers about pods and containers, as the store keeps them."""

    def __init__(self, channel: grpc.Channel) -> None:
        def method(name: str) -> "grpc.UnaryUnaryMultiCallable[bytes, bytes]":
            return channel.unary_unary(_RUNTIME_SERVICE + name, _registered_method=True)  # type: ignore[call-arg]

        self._pod_status = method("PodSandboxStatus")
        self._container_status = method("ContainerStatus")
        self._list_pods = method("ListPodSandbox")
        self._list_containers = method("ListContainers")

    def pod(self, sandbox_id: str, timeout: float | None) -> StoredPod | None:
        """The pod as the runtime has it, or None when the runtime does not know it."""

        def read() -> StoredPod:
            request = cri.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id, verbose=True).SerializeToString()
            status = _parsed(cri.PodSandboxStatusResponse, self._pod_status(request, timeout=timeout))
            return StoredPod(pod_info_from_status(status), stopped=status.status.state != cri.SANDBOX_READY)

        return _ask(f"PodSandboxStatus of {sandbox_id}", read)

    def container_status(self, container_id: str, timeout: float | None) -> cri.ContainerStatusResponse | None:
        request = cri.ContainerStatusRequest(container_id=container_id, verbose=True).SerializeToString()
        return _ask(
            f"ContainerStatus of {container_id}",
            lambda: _parsed(cri.ContainerStatusResponse, self._container_status(request, timeout=timeout)),
        )

    def listed(self, timeout: float | None) -> tuple[list[str], list[str]]:
        try:
            sandboxes = self._list_pods(cri.ListPodSandboxRequest().SerializeToString(), timeout=timeout)
            containers = self._list_containers(cri.ListContainersRequest().SerializeToString(), timeout=timeout)
        except grpc.RpcError as error:
            call: grpc.Call = error  # type: ignore[assignment]
            raise LookupFailed(f"{call.code().name}: {call.details()}") from None
        return listed_ids(sandboxes), listed_ids(containers)

    def within(self, timeout: float | None) -> "BoundedLookup":
        return BoundedLookup(self, timeout)


# CONTAINER_UNKNOWN may well be running: a later Stop still owes its PostStopContainer.
_RUNTIME_STATES = {cri.CONTAINER_CREATED: ContainerState.CREATED, cri.CONTAINER_EXITED: ContainerState.STOPPED}


async def stored_container(status: cri.ContainerStatusResponse | None, pods: PodSource) -> StoredContainer | None:
    """The container a verbose ContainerStatus describes, its pod from ``pods``."""
    if status is None:
        return None
    try:
        sandbox_id = container_sandbox_id(status)
        info = container_info_from_status(status, await pods(sandbox_id))
        return StoredContainer(sandbox_id, info, _RUNTIME_STATES.get(status.status.state, ContainerState.RUNNING))
    except RuntimeInfoError as error:
        raise Unreadable(f"ContainerStatus of {status.status.id}: {error}") from None


class BoundedLookup:
    """``koordrp.flows.RuntimeInventory`` over containerd, every question bounded by ``timeout``."""

    def __init__(self, lookup: RuntimeLookup, timeout: float | None) -> None:
        self._lookup = lookup
        self._timeout = timeout

    async def read_pod(self, sandbox_id: str) -> StoredPod | None:
        return self._lookup.pod(sandbox_id, self._timeout)

    async def read_container(self, container_id: str, pods: PodSource) -> StoredContainer | None:
        return await stored_container(self._lookup.container_status(container_id, self._timeout), pods)

    async def listed(self) -> tuple[list[str], list[str]]:
        return self._lookup.listed(self._timeout)
