"""Raw pass-through of CRI calls, against a stand-in backend on real unix sockets."""

import os
import threading
import time
from concurrent import futures

import grpc
from cri_api.v1 import api_pb2, api_pb2_grpc
from twisted.trial.unittest import SynchronousTestCase

from koordrp.cri.backend import BackendChannel
from koordrp.cri.methods import BackendRole
from koordrp.cri.passthrough import PassThroughHandler
from koordrp.cri.reachability import Reachability
from koordrp.unix import grpc_target
from tests.fake.cri_backend import FakeCRIBackend
from tests.support.tempdirs import short_tempdir


def wait_until(predicate, timeout: float = 30.0) -> bool:  # type: ignore[no-untyped-def]
    """Whether ``predicate()`` came true within ``timeout`` seconds: a generous bound for a loaded machine (5 s
    failed under a soak's load), never a measure of speed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())


def serve_pass_through(
    test: SynchronousTestCase, listen_path: str, runtime: BackendChannel, image: BackendChannel
) -> PassThroughHandler:
    """A grpc server on ``listen_path`` with koordrp's pass-through handler, stopped at cleanup."""
    handler = PassThroughHandler({BackendRole.RUNTIME: runtime, BackendRole.IMAGE: image})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), handlers=[handler])
    server.add_insecure_port(grpc_target(listen_path))
    server.start()
    test.addCleanup(lambda: server.stop(0).wait())
    return handler


class PassThroughTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = short_tempdir(self)
        self.runtime = self.start_backend("runtime")
        self.image = self.start_backend("image")
        self.reports: list[tuple[Reachability, str]] = []
        self.proxy_path = os.path.join(self.dir, "proxy.sock")
        self.handler = self.start_proxy(self.runtime.path, self.image.path)
        self.channel = self.client(self.proxy_path)
        self.stub = api_pb2_grpc.RuntimeServiceStub(self.channel)

    def start_backend(self, name: str) -> FakeCRIBackend:
        backend = FakeCRIBackend(os.path.join(self.dir, f"{name}.sock"), name=name).start()
        self.addCleanup(backend.stop)
        return backend

    def start_proxy(self, runtime_path: str, image_path: str) -> PassThroughHandler:
        def report(change: Reachability, path: str) -> None:
            self.reports.append((change, path))

        runtime = BackendChannel(runtime_path, report)
        image = BackendChannel(image_path, report)
        self.addCleanup(runtime.close)
        self.addCleanup(image.close)
        return serve_pass_through(self, self.proxy_path, runtime, image)

    def client(self, path: str) -> grpc.Channel:
        channel = grpc.insecure_channel(grpc_target(path))
        self.addCleanup(channel.close)
        return channel

    def test_response_metadata_and_trailers_pass_unchanged(self) -> None:
        direct = api_pb2_grpc.RuntimeServiceStub(self.client(self.runtime.path))
        expected, _ = direct.Version.with_call(api_pb2.VersionRequest(version="v1"))
        response, call = self.stub.Version.with_call(
            api_pb2.VersionRequest(version="v1"), metadata=(("x-caller", "kubelet"),)
        )
        self.assertEqual(response, expected)
        self.assertIn(("x-backend", "runtime"), [tuple(m) for m in call.trailing_metadata()])
        received = self.runtime.calls[-1]
        self.assertEqual(received.metadata["x-caller"], "kubelet")
        self.assertEqual(api_pb2.VersionRequest.FromString(received.request).version, "v1")

    def test_error_status_details_and_binary_trailers_pass_unchanged(self) -> None:
        direct = api_pb2_grpc.RuntimeServiceStub(self.client(self.runtime.path))
        request = api_pb2.ContainerStatusRequest(container_id="nope")
        with self.assertRaises(grpc.RpcError) as direct_error:
            direct.ContainerStatus(request)
        with self.assertRaises(grpc.RpcError) as proxied_error:
            self.stub.ContainerStatus(request)
        for attribute in ("code", "details", "trailing_metadata"):
            self.assertEqual(
                getattr(proxied_error.exception, attribute)(), getattr(direct_error.exception, attribute)()
            )
        self.assertEqual(proxied_error.exception.code(), grpc.StatusCode.NOT_FOUND)

    def test_caller_deadline_goes_upstream_and_expires(self) -> None:
        with self.assertRaises(grpc.RpcError) as error:
            self.stub.ExecSync(api_pb2.ExecSyncRequest(container_id="c"), timeout=0.3)
        self.assertEqual(error.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        remaining = self.runtime.calls[-1].time_remaining
        assert remaining is not None
        # grpc-timeout travels in whole units, rounded up at each of the two hops (0.301084 s was seen):
        # 10 ms of it still tells the caller's 0.3 s deadline from none.
        self.assertLessEqual(remaining, 0.31)

    def test_client_cancel_cancels_a_working_unary_call_upstream(self) -> None:
        self.runtime.slow_call_seconds = 10
        call = self.stub.ExecSync.future(api_pb2.ExecSyncRequest(container_id="c"))
        self.assertTrue(wait_until(lambda: bool(self.runtime.calls)))
        call.cancel()
        self.assertTrue(self.runtime.slow_call_ended.wait(5))

    def test_no_deadline_stays_no_deadline(self) -> None:
        self.stub.Version(api_pb2.VersionRequest())
        self.assertIsNone(self.runtime.calls[-1].time_remaining)

    def test_image_service_goes_to_the_image_endpoint(self) -> None:
        images = api_pb2_grpc.ImageServiceStub(self.channel).ListImages(api_pb2.ListImagesRequest())
        self.assertEqual([image.id for image in images.images], ["image"])
        self.assertEqual(self.image.calls[-1].method, "/runtime.v1.ImageService/ListImages")
        self.assertEqual(self.runtime.calls, [])

    def test_unknown_unary_method_is_forwarded_as_bytes(self) -> None:
        future_method = self.channel.unary_unary(
            "/runtime.v1.RuntimeService/SomethingNewer", request_serializer=None, response_deserializer=None
        )
        self.assertEqual(future_method(b"\x01\x02\x03"), b"\x03\x02\x01")
        self.assertEqual(self.runtime.calls[-1].method, "/runtime.v1.RuntimeService/SomethingNewer")

    def test_unknown_service_bidirectional_stream_is_forwarded(self) -> None:
        chat = self.channel.stream_stream("/example.v9.Other/Chat", request_serializer=None, response_deserializer=None)
        self.assertEqual(list(chat(iter([b"ab", b"cd", b""]))), [b"ba", b"dc", b""])

    def test_server_stream_relays_events_in_order_and_ends_with_backend(self) -> None:
        self.runtime.events_to_send = 5
        events = self.stub.GetContainerEvents(api_pb2.GetEventsRequest(), timeout=10)
        self.assertEqual([event.container_id for event in events], [f"c{i}" for i in range(5)])
        self.assertIn(("x-events-sent", "5"), [tuple(m) for m in events.trailing_metadata()])
        self.assertEqual(events.code(), grpc.StatusCode.OK)

    def test_client_cancel_ends_the_backend_stream(self) -> None:
        self.runtime.stream_forever = True
        self.runtime.event_interval = 0.01
        events = self.stub.GetContainerEvents(api_pb2.GetEventsRequest())
        self.assertEqual(next(events).container_id, "c0")
        events.cancel()
        self.assertTrue(self.runtime.stream_cancelled.wait(5))

    def test_shutdown_ends_streams_with_unavailable(self) -> None:
        self.runtime.stream_forever = True
        self.runtime.event_interval = 0.01
        events = self.stub.GetContainerEvents(api_pb2.GetEventsRequest())
        next(events)
        self.handler.streams.end_all()
        with self.assertRaises(grpc.RpcError) as error:
            list(events)
        self.assertEqual(error.exception.code(), grpc.StatusCode.UNAVAILABLE)
        self.assertIn("shutting down", error.exception.details())
        self.assertTrue(self.runtime.stream_cancelled.wait(5))


class BackendOutageTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = short_tempdir(self)
        self.backend_path = os.path.join(self.dir, "late.sock")
        self.proxy_path = os.path.join(self.dir, "proxy.sock")
        self.reports: list[tuple[Reachability, str]] = []
        self.lock = threading.Lock()
        backend = BackendChannel(self.backend_path, self.report)
        self.addCleanup(backend.close)
        serve_pass_through(self, self.proxy_path, backend, backend)
        channel = grpc.insecure_channel(grpc_target(self.proxy_path))
        self.addCleanup(channel.close)
        self.stub = api_pb2_grpc.RuntimeServiceStub(channel)

    def report(self, change: Reachability, path: str) -> None:
        with self.lock:
            self.reports.append((change, path))

    def test_missing_backend_is_unavailable_naming_it_then_recovers(self) -> None:
        for _ in range(5):
            with self.assertRaises(grpc.RpcError) as error:
                self.stub.Version(api_pb2.VersionRequest(), timeout=5)
            self.assertEqual(error.exception.code(), grpc.StatusCode.UNAVAILABLE)
            self.assertIn(f"unix://{self.backend_path}", error.exception.details())
        self.assertTrue(wait_until(lambda: bool(self.reports), timeout=30))  # told from grpc's own thread
        self.assertEqual(self.reports, [(Reachability.UNREACHABLE, self.backend_path)])

        backend = FakeCRIBackend(self.backend_path, name="late").start()
        self.addCleanup(backend.stop)

        def answers() -> bool:
            try:
                version: api_pb2.VersionResponse = self.stub.Version(api_pb2.VersionRequest(), timeout=1)
                return version.runtime_name == "late"
            except grpc.RpcError:
                return False

        self.assertTrue(wait_until(answers, timeout=30))
        self.assertTrue(wait_until(lambda: len(self.reports) == 2))
        self.assertEqual(self.reports[1], (Reachability.RECOVERED, self.backend_path))

    def test_the_backends_health_watch_is_held_open_and_opened_again_when_it_ends(self) -> None:
        """One call open on the channel keeps grpc's thread for calls as futures: none pays for starting it."""
        backend = FakeCRIBackend(self.backend_path, name="late").start()
        self.addCleanup(backend.stop)
        self.assertTrue(wait_until(lambda: backend.watches == 1))
        backend.watches_ending.set()  # the runtime is going away
        backend.watches_ending = threading.Event()
        self.assertTrue(wait_until(lambda: backend.watches == 2))
