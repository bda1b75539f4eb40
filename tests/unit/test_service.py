"""The CRI proxy service: where and how it listens, and how it stops."""

import os
import queue
import resource
import socket
import stat
import threading
from typing import Iterator, cast

import grpc
from cri_api.v1 import api_pb2, api_pb2_grpc
from twisted.internet import reactor
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.interfaces import IReactorThreads
from twisted.internet.threads import deferToThread
from twisted.logger import formatEvent
from twisted.trial.unittest import SynchronousTestCase, TestCase

from koordrp.cri import server as server_module
from koordrp.bounds import FEWEST_CONNECTIONS, METRICS_DESCRIPTORS, OWN_DESCRIPTORS, connection_cap
from koordrp.cri.server import CRIConnectionBounds, CRIProxyService, CRIProxySettings, server_options
from koordrp.call import Parts, SkipLabel
from koordrp.hooks.client import HookClients
from koordrp.hooks.dispatcher import Dispatcher
from koordrp.hooks.types import HookServers
from koordrp.metrics import Metrics
from koordrp.store import Store
from koordrp.unix import NotASocket, SocketInUse, UnsafeDirectory, grpc_target
from tests.fake.cri_backend import FakeCRIBackend
from tests.fake.reactor import InlineThreadsReactor
from tests.support.logs import logged_events
from tests.support.tempdirs import short_tempdir
from tests.support.waiting import until


def no_hooks(reactor: InlineThreadsReactor) -> Parts:
    return Parts(Store(), Dispatcher(HookClients(reactor), reactor), HookServers, SkipLabel("skip", "true"), reactor)


class CRIProxyServiceTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = short_tempdir(self)
        self.listen = os.path.join(self.dir, "run", "koordrp", "proxy.sock")
        self.backend = FakeCRIBackend(os.path.join(self.dir, "backend.sock"), name="backend").start()
        self.addCleanup(self.backend.stop)
        self.reactor = InlineThreadsReactor()
        self.events = logged_events(self)

    def make_service(self, grace: float = 5.0, socket_gid: int | None = None) -> CRIProxyService:
        settings = CRIProxySettings(
            listen_path=self.listen,
            runtime_path=self.backend.path,
            image_path=self.backend.path,
            grace_period=grace,
            max_workers=4,
            socket_gid=socket_gid,
        )
        return CRIProxyService(settings, self.reactor, no_hooks(self.reactor))

    def start(self, grace: float = 5.0, socket_gid: int | None = None) -> CRIProxyService:
        proxy = self.make_service(grace, socket_gid)
        proxy.startService()
        self.addCleanup(lambda: proxy.running and proxy.stopService())
        return proxy

    def stub(self) -> api_pb2_grpc.RuntimeServiceStub:
        channel = grpc.insecure_channel(grpc_target(self.listen))
        self.addCleanup(channel.close)
        return api_pb2_grpc.RuntimeServiceStub(channel)

    def test_listens_with_mode_0660_in_a_created_0755_directory(self) -> None:
        self.start()
        self.assertEqual(stat.S_IMODE(os.stat(self.listen).st_mode), 0o660)
        self.assertEqual(stat.S_IMODE(os.stat(os.path.dirname(self.listen)).st_mode), 0o755)
        self.assertEqual(self.stub().Version(api_pb2.VersionRequest(), timeout=5).runtime_name, "backend")

    def test_socket_group_is_configurable(self) -> None:
        self.start(socket_gid=4242)
        self.assertEqual(os.stat(self.listen).st_gid, 4242)
        self.assertEqual(stat.S_IMODE(os.stat(self.listen).st_mode), 0o660)

    def test_created_directory_is_0755_whatever_the_umask(self) -> None:
        previous = os.umask(0o077)
        try:
            self.start()
        finally:
            os.umask(previous)
        self.assertEqual(stat.S_IMODE(os.stat(os.path.dirname(self.listen)).st_mode), 0o755)

    def test_a_directory_others_can_write_or_own_is_refused(self) -> None:
        directory = os.path.dirname(self.listen)
        os.makedirs(directory)
        os.chmod(directory, 0o777)
        self.assertRaises(UnsafeDirectory, self.make_service().startService)
        os.chmod(directory, 0o755)
        os.chown(directory, 4242, -1)
        self.assertRaises(UnsafeDirectory, self.make_service().startService)

    def test_stale_socket_is_replaced(self) -> None:
        os.makedirs(os.path.dirname(self.listen))
        stale = socket.socket(socket.AF_UNIX)
        stale.bind(self.listen)
        stale.close()
        self.start()
        self.assertEqual(self.stub().Version(api_pb2.VersionRequest(), timeout=5).runtime_name, "backend")

    def test_socket_served_by_another_process_is_refused(self) -> None:
        os.makedirs(os.path.dirname(self.listen))
        live = socket.socket(socket.AF_UNIX)
        live.bind(self.listen)
        live.listen(1)
        self.addCleanup(live.close)
        self.assertRaises(SocketInUse, self.make_service().startService)

    def test_regular_file_in_the_way_is_refused_and_kept(self) -> None:
        os.makedirs(os.path.dirname(self.listen))
        with open(self.listen, "w") as f:
            f.write("operator's file")
        self.assertRaises(NotASocket, self.make_service().startService)
        with open(self.listen) as f:
            self.assertEqual(f.read(), "operator's file")

    def test_stop_lets_an_in_flight_call_finish_then_removes_the_socket(self) -> None:
        proxy = self.start(grace=5.0)
        self.backend.slow_call_seconds = 0.5
        stub = self.stub()
        outcome: list[object] = []
        call = threading.Thread(
            target=lambda: outcome.append(stub.ExecSync(api_pb2.ExecSyncRequest(container_id="c"), timeout=5))
        )
        call.start()
        while not [c for c in self.backend.calls if c.method.endswith("/ExecSync")]:
            threading.Event().wait(0.01)
        stopped = proxy.stopService()
        self.successResultOf(stopped)
        call.join(5)
        self.assertEqual([response.stdout for response in outcome], [b"late"])  # type: ignore[attr-defined]
        self.assertFalse(os.path.exists(self.listen))

    def test_stop_cancels_calls_that_outlive_the_grace_period(self) -> None:
        proxy = self.start(grace=0.1)
        self.backend.slow_call_seconds = 3
        stub = self.stub()
        errors: list[grpc.RpcError] = []

        def slow_call() -> None:
            try:
                stub.ExecSync(api_pb2.ExecSyncRequest(container_id="c"), timeout=10)
            except grpc.RpcError as error:
                errors.append(error)

        call = threading.Thread(target=slow_call)
        call.start()
        while not [c for c in self.backend.calls if c.method.endswith("/ExecSync")]:
            threading.Event().wait(0.01)
        self.successResultOf(proxy.stopService())
        call.join(5)
        self.assertEqual([error.code() for error in errors], [grpc.StatusCode.UNAVAILABLE])

    def test_reachability_is_logged_from_the_reactor(self) -> None:
        self.start()
        self.stub().Version(api_pb2.VersionRequest(), timeout=5)
        messages = [event.get("log_format") for event in self.events]
        self.assertIn("backend unix://{endpoint} is reachable", messages)
        self.assertTrue(self.reactor.from_threads)


class CountedOnceTests(TestCase):
    """On the real reactor: the front end counts with the parts' metrics, a passed-through call where it is forwarded
    and an intercepted one at its end (``Call.ended``), never both."""

    @inlineCallbacks
    def test_each_call_is_counted_once_whether_passed_through_or_intercepted(self):  # type: ignore[no-untyped-def]
        directory = short_tempdir(self)
        backend = FakeCRIBackend(os.path.join(directory, "backend.sock")).start()
        self.addCleanup(backend.stop)
        listen = os.path.join(directory, "proxy.sock")
        metrics = Metrics()
        threads = IReactorThreads(reactor)
        clients = HookClients(reactor)
        parts = Parts(Store(), Dispatcher(clients, reactor), HookServers, SkipLabel("skip", "true"), reactor, metrics)
        proxy = CRIProxyService(CRIProxySettings(listen, backend.path, backend.path, grace_period=5.0, max_workers=4), threads, parts)
        proxy.startService()
        self.addCleanup(proxy.stopService)
        channel = grpc.insecure_channel(grpc_target(listen))
        self.addCleanup(channel.close)
        stub = api_pb2_grpc.RuntimeServiceStub(channel)

        def call() -> None:
            stub.Version(api_pb2.VersionRequest(), timeout=5)
            remove = channel.unary_unary("/runtime.v1.RuntimeService/RemovePodSandbox", None, None)  # the fake answers in no schema
            remove(api_pb2.RemovePodSandboxRequest(pod_sandbox_id="p-1").SerializeToString(), timeout=5)

        def counted(method: str) -> float | None:
            return metrics.registry.get_sample_value("koordrp_cri_calls_total", {"method": method, "code": "OK"})

        yield deferToThread(call)
        yield Deferred.fromCoroutine(until(lambda: counted("RemovePodSandbox") is not None))
        self.assertEqual((counted("Version"), counted("RemovePodSandbox")), (1.0, 1.0))
        reachable = metrics.registry.get_sample_value("koordrp_backend_reachable", {"endpoint": backend.path})
        self.assertEqual(reachable, 1.0)


# Raw HTTP/2 on the CRI socket, as a client that means harm speaks it.

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
GOAWAY = 7
PING = 6


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


SETTINGS = frame(4, 0, 0)
SETTINGS_ACK = frame(4, 1, 0)
ENDLESS_HANDSHAKE = PREFACE + frame(4, 0, 0, b"\xff\x00\x00\x00\x00\x00" * 2000)
"""HTTP/2's preface and a SETTINGS frame of 2,000 settings (unknown ones): dripped, a handshake that takes minutes."""


def request_headers(path: str) -> bytes:
    """A HEADERS frame opening a call to ``path`` (HPACK literals, no Huffman), its request yet to come."""

    def literal(name: bytes, value: bytes) -> bytes:
        return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value

    fields = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", path.encode()), (b":authority", b"koordrp")]
    fields += [(b"content-type", b"application/grpc"), (b"te", b"trailers")]
    return frame(1, 0x4, 1, b"".join(literal(name, value) for name, value in fields))


def raw_connection(path: str, first: bytes = b"") -> socket.socket:
    """A unix connection to ``path`` that has sent ``first``; closed at cleanup by whoever made it."""
    client = socket.socket(socket.AF_UNIX)
    client.connect(path)
    if first:
        try:
            client.sendall(first)
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed as it came (over the cap): what it reads next says so
    return client


def frames_until_closed(client: socket.socket, timeout: float = 30.0) -> list[int]:
    """The kinds of the frames the server sent until it closed the connection (an end of file, or a reset);
    AssertionError if it is still open after ``timeout`` seconds (a generous bound, not a measure)."""
    client.settimeout(timeout)
    received = b""
    while True:
        try:
            data = client.recv(65536)
        except ConnectionResetError:
            break
        except TimeoutError:
            raise AssertionError(f"the server kept the connection open {timeout:g}s") from None
        if not data:
            break
        received += data
    kinds = []
    while len(received) >= 9:
        kinds.append(received[3])
        received = received[9 + int.from_bytes(received[:3], "big") :]
    return kinds


class CRIConnectionBoundsTests(SynchronousTestCase):
    """Every connection to the CRI socket bounded by grpc core, as koordrp sets it, on real sockets."""

    def setUp(self) -> None:
        self.dir = short_tempdir(self)
        self.listen = os.path.join(self.dir, "koordrp", "proxy.sock")
        self.backend = FakeCRIBackend(os.path.join(self.dir, "backend.sock"), name="backend").start()
        self.addCleanup(self.backend.stop)
        self.reactor = InlineThreadsReactor()
        self.events = logged_events(self)

    def start(self, **bounds: float) -> CRIProxyService:
        settings = CRIProxySettings(
            listen_path=self.listen,
            runtime_path=self.backend.path,
            image_path=self.backend.path,
            grace_period=1.0,
            max_workers=4,
            bounds=CRIConnectionBounds(**bounds),  # type: ignore[arg-type]
        )
        proxy = CRIProxyService(settings, self.reactor, no_hooks(self.reactor))
        proxy.startService()
        self.addCleanup(lambda: proxy.running and proxy.stopService())
        return proxy

    def channel(self) -> grpc.Channel:
        channel = grpc.insecure_channel(grpc_target(self.listen))
        self.addCleanup(channel.close)
        return channel

    def raw(self, first: bytes = b"") -> socket.socket:
        client = raw_connection(self.listen, first)
        self.addCleanup(client.close)
        return client

    def test_the_bounds_are_the_grpc_servers_options(self) -> None:
        options = dict(server_options(CRIConnectionBounds(), 200))
        self.assertEqual(
            {name: options[name] for name in options if name in BOUND_OPTIONS},
            {
                "grpc.server_handshake_timeout_ms": 10_000,
                "grpc.max_connection_idle_ms": 60_000,
                "grpc.keepalive_time_ms": 60_000,
                "grpc.keepalive_timeout_ms": 20_000,
                "grpc.http2.ping_timeout_ms": 20_000,
                "grpc.max_allowed_incoming_connections": 200,
            },
        )
        # The channel's own stay: koordrp refuses no message size the runtime takes.
        self.assertEqual(options["grpc.max_receive_message_length"], -1)

    def test_the_cap_leaves_koordrps_own_descriptors_under_the_limit(self) -> None:
        self.assertEqual(connection_cap(256, 1, 1 << 20), 256)
        self.assertEqual(connection_cap(256, 1, 512), 512 - OWN_DESCRIPTORS - METRICS_DESCRIPTORS)
        self.assertEqual(connection_cap(1024, 2, 1024), (1024 - OWN_DESCRIPTORS - METRICS_DESCRIPTORS) // 2)
        self.assertEqual(connection_cap(256, 1, resource.RLIM_INFINITY), 256)
        # Too low a limit to keep them: kubelet still gets in, and a warning says so.
        self.assertEqual(connection_cap(256, 1, 300), FEWEST_CONNECTIONS)

    def test_the_cap_follows_the_descriptor_limit_and_a_limit_too_low_is_told(self) -> None:
        self.patch(server_module, "descriptor_limit", lambda: 400)
        proxy = self.start()
        self.assertEqual(proxy.connections, 400 - OWN_DESCRIPTORS - METRICS_DESCRIPTORS)
        self.assertEqual(self.lines("file descriptors: clients may take"), [])
        proxy.stopService()
        self.patch(server_module, "descriptor_limit", lambda: 300)
        proxy = self.start()
        self.assertEqual(proxy.connections, FEWEST_CONNECTIONS)
        [warning] = self.lines("file descriptors: clients may take")
        self.assertIn("only 300 file descriptors", warning)

    def lines(self, containing: str) -> list[str]:
        return [text for text in (formatEvent(event) for event in self.events) if containing in text]

    def test_a_connection_that_sends_nothing_is_closed_at_the_handshake_bound(self) -> None:
        self.start(handshake_seconds=0.3, idle_seconds=600)
        frames_until_closed(self.raw())

    def test_a_connection_that_drips_its_preface_is_closed_at_the_handshake_bound(self) -> None:
        self.start(handshake_seconds=0.3, idle_seconds=600)
        client = self.raw()
        closed = threading.Event()
        dripping = threading.Thread(target=drip, args=(client, ENDLESS_HANDSHAKE, closed))
        dripping.start()
        self.addCleanup(dripping.join)
        self.addCleanup(closed.set)
        frames_until_closed(client)

    def test_a_connection_without_a_call_is_sent_goaway_and_closed_at_the_idle_bound(self) -> None:
        self.start(idle_seconds=0.3, handshake_seconds=600)
        self.assertIn(GOAWAY, frames_until_closed(self.raw(PREFACE + SETTINGS + SETTINGS_ACK)))

    def test_a_call_whose_client_went_silent_is_closed_when_its_ping_goes_unanswered(self) -> None:
        self.start(keepalive_seconds=0.3, ping_timeout_seconds=0.3, handshake_seconds=600, idle_seconds=600)
        half_a_request = request_headers("/runtime.v1.RuntimeService/Version")
        client = self.raw(PREFACE + SETTINGS + SETTINGS_ACK + half_a_request)
        self.assertIn(PING, frames_until_closed(client))
        # Its worker is free again: calls are answered.
        stub = api_pb2_grpc.RuntimeServiceStub(self.channel())
        self.assertEqual(stub.Version(api_pb2.VersionRequest(), timeout=30).runtime_name, "backend")

    def test_over_the_cap_a_connection_is_closed_at_once_and_the_open_ones_keep_serving(self) -> None:
        self.start(connections=2, handshake_seconds=600, idle_seconds=600)
        stub = api_pb2_grpc.RuntimeServiceStub(self.channel())
        stub.Version(api_pb2.VersionRequest(), timeout=30)
        held = self.raw(PREFACE + SETTINGS)
        over = [self.raw(PREFACE + SETTINGS) for _ in range(3)]
        for client in over:
            self.assertEqual(frames_until_closed(client), [])  # not a byte of HTTP/2: closed as it came
        held.settimeout(30)
        self.assertEqual(held.recv(9)[3], 4)  # the server's SETTINGS: served
        self.assertEqual(stub.Version(api_pb2.VersionRequest(), timeout=30).runtime_name, "backend")

    def test_a_stream_outlives_the_idle_bound_on_its_connection(self) -> None:
        self.start(idle_seconds=0.3)
        channel = self.channel()
        requests: queue.Queue[bytes | None] = queue.Queue()
        echo = channel.stream_stream("/example.Unknown/Echo", None, None)
        responses = cast(Iterator[bytes], echo(iter(requests.get, None), timeout=60))
        requests.put(b"one")
        self.assertEqual(next(responses), b"eno")
        # An idle connection opened now is closed by the bound: the stream's connection was as long without one.
        self.assertIn(GOAWAY, frames_until_closed(self.raw(PREFACE + SETTINGS + SETTINGS_ACK)))
        requests.put(b"two")
        self.assertEqual(next(responses), b"owt")
        requests.put(None)
        self.assertEqual(list(responses), [])

    def test_a_client_whose_connection_went_idle_calls_again_unaware(self) -> None:
        self.start(idle_seconds=0.3)
        channel = self.channel()
        went_idle = threading.Event()
        stub = api_pb2_grpc.RuntimeServiceStub(channel)
        stub.Version(api_pb2.VersionRequest(), timeout=30)

        def changed(state: grpc.ChannelConnectivity) -> None:
            if state is grpc.ChannelConnectivity.IDLE:
                went_idle.set()

        channel.subscribe(changed)
        self.assertTrue(went_idle.wait(30), "the connection was not closed at the idle bound")
        self.assertEqual(stub.Version(api_pb2.VersionRequest(), timeout=30).runtime_name, "backend")


BOUND_OPTIONS = {
    "grpc.server_handshake_timeout_ms",
    "grpc.max_connection_idle_ms",
    "grpc.keepalive_time_ms",
    "grpc.keepalive_timeout_ms",
    "grpc.http2.ping_timeout_ms",
    "grpc.max_allowed_incoming_connections",
}


def drip(client: socket.socket, data: bytes, stop: threading.Event, every: float = 0.05) -> None:
    """Send ``data`` a byte at a time, every ``every`` seconds, until it is all sent, ``stop`` is set or the
    connection is closed: the pace of a client that means to hold the connection."""
    for byte in data:
        if stop.wait(every):
            return
        try:
            client.sendall(bytes([byte]))
        except OSError:
            return
