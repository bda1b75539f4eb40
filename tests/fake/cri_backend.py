"""A small CRI backend on a real unix socket, for what containerd 1.6 cannot show.

containerd 1.6 streams no container events and answers quickly, so streaming, cancellation,
deadlines and trailing metadata are checked against this backend instead. Every method works on raw
bytes and records what reached it.
"""

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import grpc
from cri_api.v1 import api_pb2

from tests.fake import BytesHandler, FakeGrpcServer

RUNTIME = "/runtime.v1.RuntimeService/"
IMAGE = "/runtime.v1.ImageService/"
HEALTH_WATCH = "/grpc.health.v1.Health/Watch"


@dataclass
class ReceivedCall:
    method: str
    request: bytes
    metadata: dict[str, str | bytes]
    time_remaining: float | None


@dataclass
class FakeCRIBackend(FakeGrpcServer):
    """Behaviour per method, configurable by tests; unknown methods echo their request."""

    path: str
    name: str = "fake"
    events_to_send: int = 3
    event_interval: float = 0.0
    stream_forever: bool = False
    slow_call_seconds: float = 1.0
    calls: list[ReceivedCall] = field(default_factory=list)
    stream_cancelled: threading.Event = field(default_factory=threading.Event)
    slow_call_ended: threading.Event = field(default_factory=threading.Event)
    stop_arrived: threading.Event = field(default_factory=threading.Event)
    stop_given_up: threading.Event = field(default_factory=threading.Event)
    """Set when a StopContainer's caller gave up (cancelled, or its deadline passed) before the stop's end."""
    watches: int = 0
    """Health watches opened (koordrp holds one open; they are not in ``calls``)."""
    sandboxes: list[str] = field(default_factory=list)
    """The pod sandbox ids ListPodSandbox answers with."""
    containers: list[str] = field(default_factory=list)
    """The container ids ListContainers answers with."""
    watches_ending: threading.Event = field(default_factory=threading.Event)
    """Set: every open health watch ends with UNAVAILABLE, as when the runtime goes away."""
    before_answering: Callable[[str], None] | None = None
    """Called with the method of each unary call the runtime has done, before it answers."""

    def start(self) -> "FakeCRIBackend":
        self._serve(lambda server: None, handlers=[_Handler(self)])
        return self

    def record(self, method: str, request: bytes, context: grpc.ServicerContext) -> None:
        remaining = context.time_remaining()
        self.calls.append(
            ReceivedCall(
                method,
                request,
                {key: value for key, value in context.invocation_metadata()},
                None if remaining is None or remaining > 1e9 else remaining,
            )
        )

    # Each behaviour below is one method of the fake runtime.

    def version(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        context.set_trailing_metadata((("x-backend", self.name),))
        return api_pb2.VersionResponse(version="0.1.0", runtime_name=self.name).SerializeToString()

    def container_status(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        container_id = api_pb2.ContainerStatusRequest.FromString(request).container_id
        context.set_trailing_metadata((("x-backend", self.name), ("x-detail-bin", b"\x00\x01")))
        context.abort(grpc.StatusCode.NOT_FOUND, f'an error occurred when try to find container "{container_id}"')

    def exec_sync(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        context.add_callback(self.slow_call_ended.set)
        ended = threading.Event()
        context.add_callback(ended.set)
        ended.wait(self.slow_call_seconds)
        return api_pb2.ExecSyncResponse(stdout=b"late").SerializeToString()

    def stop_container(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """A stop that takes ``slow_call_seconds`` (a container slow to die), unless its caller gives up first."""
        self.stop_arrived.set()
        gone = threading.Event()
        context.add_callback(gone.set)
        if gone.wait(self.slow_call_seconds):
            self.stop_given_up.set()
        return api_pb2.StopContainerResponse().SerializeToString()

    def create_container(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        return api_pb2.CreateContainerResponse(container_id="created-1").SerializeToString()

    def list_pod_sandbox(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        items = [api_pb2.PodSandbox(id=identifier) for identifier in self.sandboxes]
        return api_pb2.ListPodSandboxResponse(items=items).SerializeToString()

    def list_containers(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        containers = [api_pb2.Container(id=identifier) for identifier in self.containers]
        return api_pb2.ListContainersResponse(containers=containers).SerializeToString()

    def list_images(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        return api_pb2.ListImagesResponse(images=[api_pb2.Image(id=self.name)]).SerializeToString()

    def health_watch(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        """grpc health's Watch, as containerd serves it: SERVING, then nothing until the caller leaves."""
        self.watches += 1
        yield b"\x08\x01"
        ending = self.watches_ending
        context.add_callback(ending.set)
        ending.wait()
        if context.is_active():
            context.abort(grpc.StatusCode.UNAVAILABLE, "the runtime is going away")

    def container_events(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        context.add_callback(self.stream_cancelled.set)
        sent = 0
        while self.stream_forever or sent < self.events_to_send:
            if not context.is_active():
                return
            yield api_pb2.ContainerEventResponse(container_id=f"c{sent}").SerializeToString()
            sent += 1
            time.sleep(self.event_interval)
        context.set_trailing_metadata((("x-events-sent", str(sent)),))


class _Handler(BytesHandler):
    def __init__(self, backend: FakeCRIBackend) -> None:
        self._backend = backend
        unary: dict[str, Callable[[bytes, grpc.ServicerContext], bytes]] = {
            RUNTIME + "Version": backend.version,
            RUNTIME + "ContainerStatus": backend.container_status,
            RUNTIME + "ExecSync": backend.exec_sync,
            RUNTIME + "CreateContainer": backend.create_container,
            RUNTIME + "StopContainer": backend.stop_container,
            # containerd 2.1 and later resize pods in place; 1.6 and 1.7 answer UNIMPLEMENTED.
            RUNTIME + "UpdatePodSandboxResources": lambda request, context: b"",
            RUNTIME + "ListPodSandbox": backend.list_pod_sandbox,
            RUNTIME + "ListContainers": backend.list_containers,
            IMAGE + "ListImages": backend.list_images,
        }
        self._unary = unary

    def service(self, details: grpc.HandlerCallDetails) -> "grpc.RpcMethodHandler[bytes, bytes]":
        backend, method = self._backend, details.method
        if method == HEALTH_WATCH:
            return grpc.unary_stream_rpc_method_handler(backend.health_watch)
        if method == RUNTIME + "GetContainerEvents":

            def stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
                backend.record(method, request, context)
                return backend.container_events(request, context)

            return grpc.unary_stream_rpc_method_handler(stream)
        behaviour = self._unary.get(method)
        if behaviour is not None:

            def unary(request: bytes, context: grpc.ServicerContext) -> bytes:
                backend.record(method, request, context)
                answer = behaviour(request, context)
                if backend.before_answering is not None:
                    backend.before_answering(method)
                return answer

            return grpc.unary_unary_rpc_method_handler(unary)

        def echo(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
            for request in requests:
                backend.record(method, request, context)
                yield request[::-1]

        return grpc.stream_stream_rpc_method_handler(echo)
