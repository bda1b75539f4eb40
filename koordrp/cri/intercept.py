"""The lifecycle calls: parsed, run through the hooks, forwarded, remembered.

Each handler runs on a grpc worker thread. Its pure work (building hook requests, merging, applying)
is in koordrp.lifecycle; hook stages cross into the reactor through the HookBridge, once per stage;
the runtime is called from this thread.
"""

import copy
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import grpc
from cri_api.v1 import api_pb2 as cri
from google.protobuf.message import DecodeError, Message
from twisted.logger import Logger

from koordrp import calllog, lifecycle
from koordrp.calllog import CallRecord
from koordrp.cri.backend import BackendChannel
from koordrp.cri.bridge import HookBridge, HookStageTimeout
from koordrp.cri.passthrough import relay_failure, remaining_timeout
from koordrp.cri.runtime_lookup import LookupFailed, RuntimeLookup
from koordrp.hooks.dispatcher import StageOutcome
from koordrp.hooks.types import HookServers, HookType
from koordrp.lifecycle import HookRequest, PodHookRequest
from koordrp.logtext import shortened
from koordrp.store import Store, StoredContainer

RUNTIME_SERVICE = "/runtime.v1.RuntimeService/"

Found = TypeVar("Found")


@dataclass(frozen=True)
class SkipLabel:
    key: str
    value: str

    def skips(self, labels: Any) -> bool:
        return bool(labels.get(self.key) == self.value)


class LifecycleCall:
    """One intercepted CRI call: its context, the hook snapshot it arrived under, its upstream."""

    def __init__(self, interceptor: "Interceptor", method: str, context: grpc.ServicerContext) -> None:
        self.interceptor = interceptor
        self.method = method
        self.context = context
        self.servers: HookServers = interceptor.hooks.current_servers()
        self.record = CallRecord(method.rsplit("/", 1)[-1])
        self.skipping = False
        """The pod carries the skip label: no hook is called for this call."""

    def hooks(self, hook: HookType, request: HookRequest) -> StageOutcome:
        """Run a pre hook stage; the request comes back as the hooks changed it (untouched when skipping)."""
        self.record.subject = request
        if self.skipping:
            self.interceptor.hooks.skipped(hook, self.servers)
            return StageOutcome(request)
        try:
            outcome = self.interceptor.hooks.run(hook, self.servers, request, remaining_timeout(self.context))
        except HookStageTimeout as error:
            self.context.abort(grpc.StatusCode.UNAVAILABLE, f"koordrp: {error}")
        self.record.ran(hook.value, outcome.called)
        if outcome.failure is not None:
            self.context.abort(grpc.StatusCode.UNKNOWN, outcome.failure.message)
        return outcome

    def adjust(
        self,
        hook: HookType,
        request: Any,
        raw: bytes,
        hook_request: HookRequest,
        apply: Callable[[Any, Any, Any], bool],
    ) -> tuple[HookRequest, bytes]:
        """Run a pre hook stage and write its changes into the CRI request; unchanged, the bytes stay kubelet's."""
        before = copy.deepcopy(hook_request)
        after = self.hooks(hook, hook_request).request
        return after, request.SerializeToString() if apply(request, before, after) else raw

    def notify(self, hook: HookType, request: HookRequest) -> None:
        self.record.subject = request
        if self.skipping:
            self.interceptor.hooks.skipped(hook, self.servers)
        else:
            self.interceptor.hooks.notify(hook, self.servers, request)
            self.record.ran(hook.value, [server.name for server in self.servers.subscribed(hook)])

    def forward(self, request: bytes) -> bytes:
        upstream = self.interceptor.upstream(self.method)
        try:
            response, call = upstream.with_call(
                request, timeout=remaining_timeout(self.context), metadata=self.context.invocation_metadata()
            )
        except grpc.RpcError as error:
            relay_failure(error, self.context, self.interceptor.backend)
            raise
        trailing = call.trailing_metadata()
        if trailing:
            self.context.set_trailing_metadata(trailing)
        return bytes(response)

    def pod(self, sandbox_id: str) -> PodHookRequest | None:
        """The pod from the store, or read back from the runtime (and remembered) if the store lacks it."""
        store, lookup = self.interceptor.store, self.interceptor.lookup
        pod = store.pod(sandbox_id)
        if pod is None:
            pod = self._read_back("pod", sandbox_id, lambda: lookup.pod(sandbox_id, remaining_timeout(self.context)))
            if pod is not None:
                store.learn([(sandbox_id, pod)], [])
        return pod

    def container(self, container_id: str) -> StoredContainer | None:
        """The container from the store, or read back from the runtime (and remembered)."""
        store, lookup = self.interceptor.store, self.interceptor.lookup
        stored = store.container(container_id)
        if stored is None:
            stored = self._read_back(
                "container", container_id, lambda: lookup.container(container_id, self.pod, remaining_timeout(self.context))
            )
            if stored is not None:
                store.learn([], [(container_id, stored)])
        return stored

    def _read_back(self, kind: str, identifier: str, read: Callable[[], Found | None]) -> Found | None:
        if not identifier:
            return None
        try:
            return read()
        except LookupFailed as error:
            self.interceptor.log.warn(
                "{kind} {id} is not in the store and could not be read from the runtime: {error}",
                kind=kind,
                id=shortened(identifier, 80),
                error=shortened(str(error)),
            )
            return None


class Interceptor:
    """Typed handlers for the CRI methods that have hooks or change the store."""

    log = Logger()

    def __init__(
        self, backend: BackendChannel, store: Store, hooks: HookBridge, skip: SkipLabel, lookup: RuntimeLookup
    ) -> None:
        self.backend = backend
        self.store = store
        self.hooks = hooks
        self.skip = skip
        self.lookup = lookup
        self._upstreams: dict[str, grpc.UnaryUnaryMultiCallable] = {}  # type: ignore[type-arg]
        flows: dict[str, tuple[type[Message], Callable[[LifecycleCall, Any, bytes], bytes]]] = {
            "RunPodSandbox": (cri.RunPodSandboxRequest, self.run_pod_sandbox),
            "CreateContainer": (cri.CreateContainerRequest, self.create_container),
            "StartContainer": (cri.StartContainerRequest, self.start_container),
            "UpdateContainerResources": (cri.UpdateContainerResourcesRequest, self.update_container_resources),
            "StopContainer": (cri.StopContainerRequest, self.stop_container),
            "StopPodSandbox": (cri.StopPodSandboxRequest, self.stop_pod_sandbox),
            "RemoveContainer": (cri.RemoveContainerRequest, self.remove_container),
            "RemovePodSandbox": (cri.RemovePodSandboxRequest, self.remove_pod_sandbox),
        }
        self.handlers: dict[str, Callable[[bytes, grpc.ServicerContext], bytes]] = {
            RUNTIME_SERVICE + name: self._handler(RUNTIME_SERVICE + name, kind, flow) for name, (kind, flow) in flows.items()
        }

    def upstream(self, method: str) -> grpc.UnaryUnaryMultiCallable:  # type: ignore[type-arg]
        upstream = self._upstreams.get(method)
        if upstream is None:
            upstream = self._upstreams[method] = self.backend.channel.unary_unary(
                method, _registered_method=True  # type: ignore[call-arg]
            )
        return upstream

    def _handler(
        self, method: str, kind: type[Message], flow: Callable[[LifecycleCall, Any, bytes], bytes]
    ) -> Callable[[bytes, grpc.ServicerContext], bytes]:
        short_name = method.rsplit("/", 1)[-1]

        def handle(raw: bytes, context: grpc.ServicerContext) -> bytes:
            try:
                request = kind.FromString(raw)
            except DecodeError as error:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"koordrp: cannot parse the {short_name} request: {error}")
            call = LifecycleCall(self, method, context)
            started = time.monotonic()
            outcome = "OK"
            try:
                return flow(call, request, raw)
            except Exception:
                code = context.code()  # type: ignore[attr-defined]
                outcome = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
                raise
            finally:
                # Written from the reactor, as every other log line is.
                self.hooks.in_reactor(calllog.write, call.record, outcome, time.monotonic() - started)

        return handle

    # The flows, one per method: DESIGN.md's lifecycle table.

    def run_pod_sandbox(self, call: LifecycleCall, request: Any, raw: bytes) -> bytes:
        pod = lifecycle.pod_hook_request(request)
        call.skipping = self.skip.skips(pod.labels)
        adjusted, raw = call.adjust(HookType.PRE_RUN_POD_SANDBOX, request, raw, pod, lifecycle.apply_to_run_pod_sandbox)
        response = call.forward(raw)
        self.store.put_pod(cri.RunPodSandboxResponse.FromString(response).pod_sandbox_id, lifecycle.as_pod_request(adjusted))
        return response

    def create_container(self, call: LifecycleCall, request: Any, raw: bytes) -> bytes:
        pod = call.pod(request.pod_sandbox_id)
        if pod is None:
            # The runtime does not know the sandbox: it will answer with its own error.
            return call.forward(raw)
        call.skipping = self.skip.skips(pod.labels)
        container = lifecycle.container_hook_request(pod, request)
        adjusted, raw = call.adjust(HookType.PRE_CREATE_CONTAINER, request, raw, container, lifecycle.apply_to_create_container)
        response = call.forward(raw)
        container_id = cri.CreateContainerResponse.FromString(response).container_id
        stored = lifecycle.created_container_info(request, lifecycle.as_container_request(adjusted), container_id)
        self.store.put_container(container_id, request.pod_sandbox_id, stored)
        return response

    def start_container(self, call: LifecycleCall, request: Any, raw: bytes) -> bytes:
        stored = call.container(request.container_id)
        if stored is None:
            return call.forward(raw)
        call.skipping = self.skip.skips(stored.info.pod_labels)
        container = lifecycle.as_container_request(call.hooks(HookType.PRE_START_CONTAINER, stored.info).request)
        response = call.forward(raw)
        call.notify(HookType.POST_START_CONTAINER, container)
        return response

    def update_container_resources(self, call: LifecycleCall, request: Any, raw: bytes) -> bytes:
        stored = call.container(request.container_id)
        if stored is None:
            return call.forward(raw)
        container = lifecycle.fold_update_request(stored.info, request)
        call.skipping = self.skip.skips(container.pod_labels)
        hook = HookType.PRE_UPDATE_CONTAINER_RESOURCES
        adjusted, raw = call.adjust(hook, request, raw, container, lifecycle.apply_to_update_container_resources)
        response = call.forward(raw)
        self.store.put_container(request.container_id, stored.sandbox_id, lifecycle.as_container_request(adjusted))
        return response

    def stop_container(self, call: LifecycleCall, request: Any, raw: bytes) -> bytes:
        stored = call.container(request.container_id)
        response = call.forward(raw)
        if stored is not None:
            call.skipping = self.skip.skips(stored.info.pod_labels)
            call.notify(HookType.POST_STOP_CONTAINER, stored.info)
        return response

    def stop_pod_sandbox(self, call: LifecycleCall, request: Any, raw: bytes) -> bytes:
        pod = call.pod(request.pod_sandbox_id)
        response = call.forward(raw)
        if pod is not None:
            call.skipping = self.skip.skips(pod.labels)
            call.notify(HookType.POST_STOP_POD_SANDBOX, pod)
        return response

    def remove_container(self, call: LifecycleCall, request: Any, raw: bytes) -> bytes:
        stored = self.store.container(request.container_id)
        call.record.subject = stored.info if stored is not None else None
        response = call.forward(raw)
        self.store.forget_container(request.container_id)
        return response

    def remove_pod_sandbox(self, call: LifecycleCall, request: Any, raw: bytes) -> bytes:
        call.record.subject = self.store.pod(request.pod_sandbox_id)
        response = call.forward(raw)
        self.store.forget_pod(request.pod_sandbox_id)
        return response
