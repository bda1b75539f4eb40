"""The lifecycle calls in CRI mode: kubelet's requests parsed and run through ``koordrp.flows``.

Each handler runs on a grpc worker thread and drives its flow to the end there
(``flows.run_blocking``): hook stages cross into the reactor through the HookBridge, once per stage;
the runtime is called, and read back from, on this thread.
"""

import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Coroutine, Generic, TypeVar

import grpc
from google.protobuf.message import DecodeError

from koordrp import calllog, flows
from koordrp.api.cri.v1 import api_pb2 as cri
from koordrp.cri import translate
from koordrp.cri.backend import BackendChannel
from koordrp.cri.bridge import HookBridge, HookStageTimeout
from koordrp.cri.passthrough import relay_failure, remaining_timeout
from koordrp.cri.runtime_lookup import RuntimeLookup, stored_container
from koordrp.store import StoredContainer, StoredPod

RUNTIME_SERVICE = "/runtime.v1.RuntimeService/"

Request = TypeVar("Request")
Flow = Coroutine[Any, Any, "CRIReply"]


@dataclass(frozen=True)
class CRIReply:
    """The runtime's answer: a failed call never comes back as one, it has ended the RPC already."""

    raw: bytes
    created_id: str = ""
    ok: bool = True


@dataclass(frozen=True)
class _Method(Generic[Request]):
    """How one lifecycle method is read and which flow it takes."""

    parse: Callable[[bytes], Request]
    flow: Callable[["flows.Call[CRIReply]", Request], Flow]
    created_id: Callable[[bytes], str] | None = None


def _sandbox_id(raw: bytes) -> str:
    return cri.RunPodSandboxResponse.FromString(raw).pod_sandbox_id


def _container_id(raw: bytes) -> str:
    return cri.CreateContainerResponse.FromString(raw).container_id


# Each method reads its own request type: a table of them can only say Any.
_METHODS: dict[str, _Method[Any]] = {
    "RunPodSandbox": _Method(
        cri.RunPodSandboxRequest.FromString,
        lambda call, request: flows.run_pod_sandbox(call, translate.RunPodSandbox(request)),
        _sandbox_id,
    ),
    "CreateContainer": _Method(
        cri.CreateContainerRequest.FromString,
        lambda call, request: flows.create_container(call, translate.CreateContainer(request)),
        _container_id,
    ),
    "StartContainer": _Method(
        cri.StartContainerRequest.FromString, lambda call, request: flows.start_container(call, request.container_id)
    ),
    "UpdateContainerResources": _Method(
        cri.UpdateContainerResourcesRequest.FromString,
        lambda call, request: flows.update_container_resources(call, translate.UpdateContainerResources(request)),
    ),
    "StopContainer": _Method(
        cri.StopContainerRequest.FromString, lambda call, request: flows.stop_container(call, request.container_id)
    ),
    "StopPodSandbox": _Method(
        cri.StopPodSandboxRequest.FromString, lambda call, request: flows.stop_pod_sandbox(call, request.pod_sandbox_id)
    ),
    "RemoveContainer": _Method(
        cri.RemoveContainerRequest.FromString, lambda call, request: flows.remove_container(call, request.container_id)
    ),
    "RemovePodSandbox": _Method(
        cri.RemovePodSandboxRequest.FromString,
        lambda call, request: flows.remove_pod_sandbox(call, request.pod_sandbox_id),
    ),
}


class CRIBackend:
    """``flows.Backend`` for one CRI call: forwarded from its worker, read back within its deadline."""

    def __init__(
        self,
        interceptor: "Interceptor",
        method: str,
        context: grpc.ServicerContext,
        raw: bytes,
        created_id: Callable[[bytes], str] | None,
    ) -> None:
        self._interceptor = interceptor
        self._method = method
        self._context = context
        self._raw = raw
        self._created_id = created_id

    async def forward(self, rewritten: bytes | None) -> CRIReply:
        context, backend = self._context, self._interceptor.backend
        upstream = self._interceptor.upstream(self._method)
        try:
            response, call = upstream.with_call(
                self._raw if rewritten is None else rewritten,
                timeout=remaining_timeout(context),
                metadata=context.invocation_metadata(),
            )
        except grpc.RpcError as error:
            relay_failure(error, context, backend)
            raise
        trailing = call.trailing_metadata()
        if trailing:
            context.set_trailing_metadata(trailing)
        raw = bytes(response)
        return CRIReply(raw, self._created_id(raw) if self._created_id is not None else "")

    async def read_pod(self, sandbox_id: str) -> StoredPod | None:
        return self._interceptor.lookup.pod(sandbox_id, remaining_timeout(self._context))

    async def read_container(self, container_id: str, pods: flows.PodSource) -> StoredContainer | None:
        status = self._interceptor.lookup.container_status(container_id, remaining_timeout(self._context))
        return await stored_container(status, pods)


class Interceptor:
    """Handlers for the CRI methods that have hooks or change the store."""

    def __init__(self, backend: BackendChannel, parts: flows.Parts, bridge: HookBridge, lookup: RuntimeLookup) -> None:
        self.backend = backend
        self.lookup = lookup
        self._parts = parts
        self._bridge = bridge
        self._upstreams: dict[str, grpc.UnaryUnaryMultiCallable[bytes, bytes]] = {}
        self.handlers: dict[str, Callable[[bytes, grpc.ServicerContext], bytes]] = {
            RUNTIME_SERVICE + name: self._handler(name, method) for name, method in _METHODS.items()
        }

    def upstream(self, method: str) -> "grpc.UnaryUnaryMultiCallable[bytes, bytes]":
        upstream = self._upstreams.get(method)
        if upstream is None:
            upstream = self._upstreams[method] = self.backend.channel.unary_unary(
                method, _registered_method=True  # type: ignore[call-arg]
            )
        return upstream

    def _handler(self, name: str, method: _Method[Request]) -> Callable[[bytes, grpc.ServicerContext], bytes]:
        path = RUNTIME_SERVICE + name

        def handle(raw: bytes, context: grpc.ServicerContext) -> bytes:
            backend = CRIBackend(self, path, context, raw, method.created_id)
            stages = self._bridge.stages(lambda: remaining_timeout(context))
            call = flows.Call(self._parts, name, stages, backend)
            started = time.monotonic()
            outcome = "OK"
            try:
                try:
                    flow = method.flow(call, method.parse(raw))
                except DecodeError as error:
                    flow = flows.unreadable(call, name, str(error))
                return flows.run_blocking(flow).raw
            except flows.UnreadableRequest as refusal:
                outcome = grpc.StatusCode.INVALID_ARGUMENT.name
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(refusal))
            except flows.HookFailed as failure:
                outcome = grpc.StatusCode.UNKNOWN.name
                context.abort(grpc.StatusCode.UNKNOWN, str(failure))
            except HookStageTimeout as error:
                outcome = grpc.StatusCode.UNAVAILABLE.name
                context.abort(grpc.StatusCode.UNAVAILABLE, f"koordrp: {error}")
            except Exception:
                code = context.code()  # type: ignore[attr-defined]
                outcome = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
                raise
            finally:
                ended = partial(self._bridge.in_reactor, _answered, call, outcome, time.monotonic() - started)
                # Once the answer has left (grpc calls back when the RPC ends): the post stages and the
                # log line do not compete with sending it.
                if not context.add_callback(ended):
                    ended()  # the caller is gone already

        return handle


def _answered(call: "flows.Call[CRIReply]", outcome: str, seconds: float) -> None:
    """On the reactor, once the call has answered: what it owes (flows.Call.answered), then its log line."""
    call.answered()
    calllog.write(call.record, outcome, seconds)
