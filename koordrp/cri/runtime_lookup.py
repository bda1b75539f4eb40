"""Reading pods and containers back from containerd, for store misses and for the store's rebuild.

Each question is a grpc call on the reactor (``call_unary``), bounded by the timeout it is given and
cancelled with the flow that asked it. Answers are parsed
here rather than by grpc: containerd 1.6 takes text that is not UTF-8 (its generated code checks
none) and answers with it, which Python's protobuf refuses. Such a pod or container is unreadable,
and it must not hide the others, nor look like a runtime that is away.
"""

from typing import TypeVar

import grpc
from google.protobuf import empty_pb2
from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper
from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet
from twisted.internet.interfaces import IReactorFromThreads

from koordrp.api.cri.v1 import api_pb2 as cri
from koordrp.cri.runtime_info import (
    RuntimeInfoError,
    container_info_from_status,
    container_sandbox_id,
    pod_info_from_status,
)
from koordrp.cri.backend import call_unary
from koordrp.adapters import LookupFailed, PodSource, Unreadable
from koordrp.store import ContainerState, StoredContainer, StoredPod, runtime_state

Parsed = TypeVar("Parsed", bound=Message)

_RUNTIME_SERVICE = "/runtime.v1.RuntimeService/"
_LENGTH_DELIMITED = 2


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
    """containerd's answers about pods and containers, as the store keeps them (``adapters.RuntimeInventory``)."""

    def __init__(self, reactor: IReactorFromThreads, channel: grpc.Channel) -> None:
        """``channel``: the proxy's own to the runtime."""
        self._reactor = reactor
        self._channel = channel

    async def _ask(self, what: str, method: str, request: bytes, timeout: float | None) -> bytes | None:
        """The answer's bytes; None when the runtime says it does not know the id; LookupFailed when it cannot say."""
        unary = self._channel.unary_unary(_RUNTIME_SERVICE + method, _registered_method=True)  # type: ignore[call-arg]
        answer = await call_unary(self._reactor, unary, request, timeout)
        if answer.ok:
            return answer.raw
        if answer.code is grpc.StatusCode.NOT_FOUND:
            return None
        raise LookupFailed(f"{what}: {answer.code.name}: {answer.details}")

    async def read_pod(self, sandbox_id: str, timeout: float | None) -> StoredPod | None:
        what = f"PodSandboxStatus of {sandbox_id}"
        request = cri.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id, verbose=True).SerializeToString()
        raw = await self._ask(what, "PodSandboxStatus", request, timeout)
        if raw is None:
            return None
        try:
            status = _parsed(cri.PodSandboxStatusResponse, raw)
            stopped = runtime_state(_name(cri.PodSandboxState, status.status.state)) is ContainerState.STOPPED
            return StoredPod.read_back(pod_info_from_status(status), stopped)
        except RuntimeInfoError as error:
            raise Unreadable(f"{what}: {error}") from None

    async def read_container(self, container_id: str, pods: PodSource, timeout: float | None) -> StoredContainer | None:
        what = f"ContainerStatus of {container_id}"
        request = cri.ContainerStatusRequest(container_id=container_id, verbose=True).SerializeToString()
        raw = await self._ask(what, "ContainerStatus", request, timeout)
        if raw is None:
            return None
        try:
            status = _parsed(cri.ContainerStatusResponse, raw)
            sandbox_id = container_sandbox_id(status)
            info = container_info_from_status(status, await pods(sandbox_id))
            return StoredContainer.read_back(sandbox_id, info, runtime_state(_name(cri.ContainerState, status.status.state)))
        except RuntimeInfoError as error:
            raise Unreadable(f"{what}: {error}") from None

    async def listed(self, timeout: float | None) -> tuple[list[str], list[str]]:
        sandboxes = await self._ask("ListPodSandbox", "ListPodSandbox", b"", timeout)
        containers = await self._ask("ListContainers", "ListContainers", b"", timeout)
        return listed_ids(sandboxes or b""), listed_ids(containers or b"")


def _name(enum: "EnumTypeWrapper", value: int) -> str:
    """The name CRI gives an enum value ("" for a value newer than koordrp's schema)."""
    try:
        return enum.Name(value)
    except ValueError:
        return ""
