"""A runtime hook server on a real unix socket, scripted per hook by tests.

Each hook has a behaviour: a function from the request to the response (default: an empty answer,
which changes nothing), or a failure, or a delay. Every request that arrives is recorded, so tests
can check exactly what koordrp sent.
"""

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc

from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from koordrp.api.runtime.v1alpha1 import api_pb2_grpc as hook_grpc
from koordrp.hooks.types import HookType
from koordrp.sdk import reply
from tests.fake import FakeGrpcServer

Behaviour = Callable[[Any], Any]

POD_HOOKS = {hook_type.rpc_name for hook_type in HookType if hook_type.is_pod_hook}
HOOK_RPCS = {hook_type.rpc_name for hook_type in HookType}


def koordlet_cpuset_rule(request: hook.ContainerResourceHookRequest) -> hook.ContainerResourceHookResponse:
    """koordlet's answer for a pod whose cgroup parent is kubelet's besteffort one: a copy of the request,
    its cpuset cleared (hooks/cpuset/rule.go)."""
    response = reply(request)
    if "besteffort" in request.pod_cgroup_parent:
        response.container_resources.cpuset_cpus = ""
    return response


def empty_response(rpc: str) -> Any:
    return hook.PodSandboxHookResponse() if rpc in POD_HOOKS else hook.ContainerResourceHookResponse()


@dataclass
class Received:
    rpc: str
    request: Any


@dataclass
class FakeHookServer(FakeGrpcServer):
    path: str
    behaviours: dict[str, Behaviour] = field(default_factory=dict)
    failures: dict[str, grpc.StatusCode] = field(default_factory=dict)
    delays: dict[str, float] = field(default_factory=dict)
    received: list[Received] = field(default_factory=list)
    _stopping: threading.Event = field(default_factory=threading.Event)
    _waking: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> "FakeHookServer":
        self._stopping.clear()
        self._waking.clear()
        self._serve(lambda server: hook_grpc.add_RuntimeHookServiceServicer_to_server(_Servicer(self), server))
        return self

    def calls(self, rpc: str | None = None) -> list[Any]:
        with self._lock:
            return [r.request for r in self.received if rpc is None or r.rpc == rpc]

    def stop(self) -> None:
        self._stopping.set()
        self._waking.set()
        super().stop()

    def unwedge(self) -> None:
        """No more delays: every call asleep in one is answered now, as a wedged server that recovers answers its backlog."""
        self.delays.clear()
        self._waking.set()

    def rpcs(self) -> list[str]:
        with self._lock:
            return [r.rpc for r in self.received]

    def rpcs_once(self, count: int, timeout: float = 2.0) -> list[str]:
        """The RPCs received, once there are ``count`` of them: post hooks arrive after the CRI answer."""
        deadline = time.monotonic() + timeout
        while len(self.rpcs()) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.rpcs()

    def answer(self, rpc: str, request: Any, context: grpc.ServicerContext) -> Any:
        with self._lock:
            self.received.append(Received(rpc, request))
        delay = self.delays.get(rpc)
        if delay:
            # Interrupted by stop() or unwedge(): a handler still asleep would keep the test process
            # from exiting, or a wedged server from ever answering again.
            self._waking.wait(delay)
        code = self.failures.get(rpc)
        if code is not None:
            context.abort(code, f"{rpc} refused by the test")
        behaviour = self.behaviours.get(rpc)
        return behaviour(request) if behaviour is not None else empty_response(rpc)


class _Servicer(hook_grpc.RuntimeHookServiceServicer):  # type: ignore[misc]
    def __init__(self, server: FakeHookServer) -> None:
        self._server = server

    def __getattribute__(self, name: str) -> Any:
        if name in HOOK_RPCS:
            server = object.__getattribute__(self, "_server")
            return lambda request, context: server.answer(name, request, context)
        return object.__getattribute__(self, name)
