"""Docker mode's buffers and its questions to dockerd, on real sockets: every buffer bounded, every failure answered.

koordrp is the real Docker mode service on the real reactor, in front of a scripted dockerd
(``tests.fake.dockerd``); clients are plain blocking sockets in threads, writing their whole request
before reading, as naive HTTP clients do.
"""

import json
import select
import socket
from dataclasses import replace
from typing import Any, cast

from twisted.internet import reactor
from twisted.internet.address import UNIXAddress
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.testing import MemoryReactorClock, StringTransportWithDisconnection
from twisted.internet.threads import deferToThread
from twisted.logger import formatEvent
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer

from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from koordrp.bounds import BoundedFactory
from koordrp.call import Parts, SkipLabel
from koordrp.docker import dockerd as dockerd_module
from koordrp.docker import proxy as proxy_module
from koordrp.docker import service as service_module
from koordrp.docker.http import MAX_BODY_BYTES, MAX_HEAD_BYTES, RequestHead, json_response
from koordrp.docker.proxy import DOCKER_BOUNDS, DockerProxyFactory, IDockerInterceptor
from koordrp.bounds import FEWEST_CONNECTIONS, METRICS_DESCRIPTORS, OWN_DESCRIPTORS, connection_cap
from koordrp.hooks.types import FailurePolicy, HookServerConfig, HookServers, HookType
from koordrp.store import Store
from koordrp.trouble import Backoff
from tests.fake.dockerd import WEDGED, Endless, ScriptedDockerd, answer
from tests.fake.flows import ScriptedStages
from tests.support.waiting import until
from tests.unit.test_docker_waits import DockerModeTestCase

QUESTION_SECONDS = 0.5
FORTY_EIGHT_MB = 48_000_000
CREATE = b"POST /v1.41/containers/create?name=k8s_POD_web_default_uid-1_0 HTTP/1.1\r\nHost: docker\r\n"
SANDBOX = {
    "Image": "pause",
    "Labels": {"io.kubernetes.docker.type": "podsandbox"},
    "HostConfig": {"CgroupParent": "kubepods-besteffort-pod1.slice"},
}
SERVERS = HookServers(
    (HookServerConfig("tuner.json", "/run/t.sock", FailurePolicy.IGNORE, frozenset({HookType.PRE_RUN_POD_SANDBOX}), 2.0),)
)


def naive_client(path: str, parts: list[bytes]) -> bytes:
    """Connect, write every part, then read until the end: what came back."""
    client = socket.socket(socket.AF_UNIX)
    client.connect(path)
    try:
        for part in parts:
            client.sendall(part)
        received = b""
        while data := client.recv(65536):
            received += data
        return received
    finally:
        client.close()


def status_and_message(response: bytes) -> tuple[int, str]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), str(json.loads(body).get("message", ""))


def read_until_closed(client: socket.socket, timeout: float = 30.0) -> bytes:
    """What came until koordrp closed ``client`` (an end of file or a reset); AssertionError if it is still open
    after ``timeout`` seconds (a generous bound, not a measure)."""
    client.settimeout(timeout)
    received = b""
    try:
        while data := client.recv(65536):
            received += data
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"koordrp kept the connection open {timeout:g}s") from None
    return received


def hung_up_within(client: socket.socket, seconds: float) -> bool:
    poller = select.poll()
    poller.register(client, select.POLLHUP)
    return bool(poller.poll(seconds * 1000))


class DockerModeOnRealSockets(DockerModeTestCase):
    def setUp(self) -> None:
        self.dockerd = ScriptedDockerd({
            "GET /containers/json": answer(200, []),
            "GET /info": answer(200, {"CgroupDriver": "systemd"}),
            "POST /containers/create": answer(201, {"Id": "created-1", "Warnings": []}, "Created"),
        })
        self.stages = ScriptedStages()
        self.servers = HookServers()
        self.store = Store()
        parts = Parts(self.store, self.stages, lambda: self.servers, SkipLabel("skip", "true"), reactor)
        self.serve(self.dockerd, parts, driver_backoff=Backoff(0.05, 0.2), question_seconds=QUESTION_SECONDS)

    def lines(self, containing: str) -> list[str]:
        texts = [formatEvent(event) for event in self.events]
        return [text for text in texts if containing in text]

    def ask(self, *parts: bytes) -> "Deferred[bytes]":
        return deferToThread(naive_client, self.listen, list(parts))

    def created(self) -> dict[str, Any]:
        """The body the last create reached dockerd with."""
        [*_, raw] = self.dockerd.asked("POST /v1.41/containers/create")
        return cast(dict[str, Any], json.loads(raw.partition(b"\r\n\r\n")[2]))

    # Every buffer bounded

    @inlineCallbacks
    def test_a_48_mb_chunk_is_answered_413_from_its_size_line(self):  # type: ignore[no-untyped-def]
        self.start()
        response = yield self.ask(CREATE + b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % FORTY_EIGHT_MB)
        self.assertEqual(status_and_message(response), (413, "koordrp: body larger than 1 MiB"))
        self.assertEqual(self.dockerd.asked("POST"), [])

    @inlineCallbacks
    def test_a_client_that_writes_its_whole_body_first_still_reads_the_answer(self):  # type: ignore[no-untyped-def]
        self.start()
        eight_mb = [b"x" * (1 << 20)] * 8  # far more than a socket buffer holds
        for framing, body in (
            (b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % (8 << 20), [*eight_mb, b"\r\n0\r\n\r\n"]),
            (b"Content-Length: %d\r\n\r\n" % (8 << 20), eight_mb),
        ):
            response = yield self.ask(CREATE + framing, *body)
            self.assertEqual(status_and_message(response), (413, "koordrp: body larger than 1 MiB"))

    @inlineCallbacks
    def test_a_client_that_keeps_sending_after_the_answer_is_cut_off(self):  # type: ignore[no-untyped-def]
        self.patch(proxy_module, "LINGER_SECONDS", 0.1)
        self.start()
        client = socket.socket(socket.AF_UNIX)
        self.addCleanup(client.close)
        client.connect(self.listen)
        client.sendall(CREATE + b"Content-Length: %d\r\n\r\n" % FORTY_EIGHT_MB)
        answered = yield deferToThread(client.recv, 65536)
        self.assertEqual(status_and_message(answered)[0], 413)
        # Nothing more is said, and the client never closes: koordrp lets go of it all the same.
        self.assertTrue((yield deferToThread(hung_up_within, client, 30)))

    @inlineCallbacks
    def test_a_head_that_never_ends_is_answered_431(self):  # type: ignore[no-untyped-def]
        self.start()
        response = yield self.ask(b"GET /info HTTP/1.1\r\nX-Long: " + b"x" * (MAX_HEAD_BYTES + 10))
        self.assertEqual(status_and_message(response), (431, "koordrp: request head larger than 64 KiB"))

    @inlineCallbacks
    def test_a_chunk_line_that_never_ends_is_answered_400(self):  # type: ignore[no-untyped-def]
        self.start()
        response = yield self.ask(CREATE + b"Transfer-Encoding: chunked\r\n\r\n5;" + b"e" * 8000)
        self.assertEqual(status_and_message(response), (400, "koordrp: chunk size line longer than 4096 bytes"))

    @inlineCallbacks
    def test_a_chunked_body_within_the_limit_reaches_dockerd_whole(self):  # type: ignore[no-untyped-def]
        self.start()
        body = json.dumps({**SANDBOX, "Env": ["PAD=" + "p" * (MAX_BODY_BYTES - 1000)]}).encode()
        chunks = [b"%x;part=%d\r\n%s\r\n" % (len(body[at : at + 70000]), at, body[at : at + 70000]) for at in range(0, len(body), 70000)]
        response = yield self.ask(CREATE + b"Transfer-Encoding: chunked\r\n\r\n", *chunks, b"0\r\nTrailer: x\r\n\r\n")
        self.assertEqual(status_and_message(response)[0], 201)
        self.assertEqual(self.created(), json.loads(body))

    @inlineCallbacks
    def test_an_answer_larger_than_koordrp_reads_is_502_naming_dockerd(self):  # type: ignore[no-untyped-def]
        self.dockerd.answers["POST /containers/create"] = answer(201, {"Id": "x" * dockerd_module.MAX_ANSWER_BYTES})
        self.start()
        body = json.dumps({"Image": "busybox"}).encode()
        response = yield self.ask(CREATE + b"Content-Length: %d\r\n\r\n" % len(body), body)
        status, message = status_and_message(response)
        self.assertEqual(status, 502)
        self.assertIn("docker.sock: dockerd's answer is larger than 4 MiB", message)
        self.assertEqual(self.lines("failed inside koordrp"), [])

    @inlineCallbacks
    def test_a_create_while_dockerd_is_away_is_answered_503_naming_it(self):  # type: ignore[no-untyped-def]
        self.start()
        yield Deferred.fromCoroutine(until(lambda: self.lines("cgroup driver is systemd")))
        backend = self.service.settings.backend_path
        yield self.port.stopListening()
        body = json.dumps({"Image": "busybox"}).encode()
        response = yield self.ask(CREATE + b"Content-Length: %d\r\n\r\n" % len(body), body)
        status, message = status_and_message(response)
        self.assertEqual(status, 503)
        self.assertIn(f"koordrp: backend unix://{backend} is unavailable", message)
        self.assertEqual(self.lines("failed inside koordrp"), [])

    # Every connection bounded

    def bounded(self, **changes: float) -> None:
        """Start with the service's connection bounds changed."""
        bounds = replace(self.service.settings.bounds, **changes)  # type: ignore[arg-type]
        self.service.settings = replace(self.service.settings, bounds=bounds)
        self.start()

    def connected(self, request: bytes = b"") -> socket.socket:
        client = socket.socket(socket.AF_UNIX)
        self.addCleanup(client.close)
        client.connect(self.listen)
        client.sendall(request)
        return client

    @inlineCallbacks
    def test_a_connection_that_sends_nothing_or_half_a_head_is_closed_and_calls_go_on(self):  # type: ignore[no-untyped-def]
        self.bounded(idle_seconds=0.2, arrival_seconds=0.2)
        silent, half = self.connected(), self.connected(b"GET /v1.41/info HTTP/1.1\r\nHost: do")
        for client in (silent, half):
            self.assertEqual((yield deferToThread(read_until_closed, client)), b"")
        response = yield self.create_sandbox()
        self.assertEqual(status_and_message(response)[0], 201)
        assert self.service.bounded is not None
        self.assertEqual((self.service.bounded.closed["idle"], self.service.bounded.closed["slow"]), (1, 1))

    @inlineCallbacks
    def test_over_the_cap_a_connection_is_closed_at_once_and_the_streams_go_on(self):  # type: ignore[no-untyped-def]
        self.dockerd.answers["GET /events"] = Endless(STREAM_BEGINS)
        self.bounded(connections=2)
        streams = [self.connected(EVENTS) for _ in range(2)]
        for stream in streams:
            self.assertEqual((yield deferToThread(stream.recv, 65536)), STREAM_BEGINS)
        self.assertEqual((yield deferToThread(read_until_closed, self.connected(EVENTS))), b"")
        self.assertEqual(len(self.dockerd.asked("GET /v1.41/events")), 2)
        [line] = self.lines("Docker API connections: at most")
        self.assertIn("at most 2 open, 256 of", line)

    @inlineCallbacks
    def test_the_cap_follows_the_descriptor_limit_and_a_limit_too_low_is_told(self):  # type: ignore[no-untyped-def]
        self.patch(service_module, "descriptor_limit", lambda: 300)
        self.start()
        assert self.service.bounded is not None
        self.assertEqual(self.service.bounded.bounds.connections, FEWEST_CONNECTIONS)
        [warning] = self.lines("file descriptors: clients may take")
        self.assertIn("only 300 file descriptors", warning)
        response = yield self.create_sandbox()
        self.assertEqual(status_and_message(response)[0], 201)

    # dockerd's cgroup driver

    def subscribe_a_mover(self) -> None:
        self.servers = SERVERS
        self.stages.answers[HookType.PRE_RUN_POD_SANDBOX] = hook.PodSandboxHookResponse(
            cgroup_parent="/kubepods.slice/kubepods-burstable.slice/moved.slice", labels={"seen": "1"}
        )

    def create_sandbox(self) -> "Deferred[bytes]":
        body = json.dumps(SANDBOX).encode()
        return self.ask(CREATE + b"Content-Length: %d\r\n\r\n" % len(body), body)

    @inlineCallbacks
    def test_read_at_start_and_used_for_creates(self):  # type: ignore[no-untyped-def]
        self.subscribe_a_mover()
        self.start()
        response = yield self.create_sandbox()
        self.assertEqual(status_and_message(response)[0], 201)
        self.assertEqual(self.created()["HostConfig"]["CgroupParent"], "moved.slice")
        self.assertEqual(len(self.dockerd.asked("GET /info")), 1)
        self.assertEqual(len(self.lines("dockerd's cgroup driver is systemd")), 1)

    @inlineCallbacks
    def test_a_failed_answer_leaves_cgroup_parents_alone_and_is_asked_again_until_it_names_it(self):  # type: ignore[no-untyped-def]
        self.dockerd.answers["GET /info"] = answer(500, {"message": "info is broken"}, "Internal Server Error")
        self.subscribe_a_mover()
        self.start()
        yield Deferred.fromCoroutine(until(lambda: len(self.dockerd.asked("GET /info")) >= 3))
        response = yield self.create_sandbox()
        self.assertEqual(status_and_message(response)[0], 201)
        created = self.created()
        # What the client sent, with every other change the hooks made.
        self.assertEqual((created["HostConfig"]["CgroupParent"], created["Labels"]["seen"]), ("kubepods-besteffort-pod1.slice", "1"))
        [line] = self.lines("containers/create pod")
        self.assertIn(
            "left alone (dockerd's cgroup driver is not known: GET /info failed) "
            'cgroup_parent "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1.slice"'
            '→"/kubepods.slice/kubepods-burstable.slice/moved.slice"',
            line,
        )
        [warning] = self.lines("cannot read dockerd's cgroup driver")
        self.assertIn("GET /info: dockerd answered 500: info is broken", warning)
        self.dockerd.answers["GET /info"] = answer(200, {"CgroupDriver": "systemd"})
        yield Deferred.fromCoroutine(until(lambda: self.lines("dockerd's cgroup driver is systemd again")))
        response = yield self.create_sandbox()
        self.assertEqual(self.created()["HostConfig"]["CgroupParent"], "moved.slice")
        self.assertEqual(self.lines("failed inside koordrp"), [])

    @inlineCallbacks
    def test_a_pod_whose_sandbox_kept_its_cgroup_parent_keeps_its_containers_with_it(self):  # type: ignore[no-untyped-def]
        self.dockerd.answers["GET /info"] = answer(500, {"message": "info is broken"}, "Internal Server Error")
        self.subscribe_a_mover()
        self.start()
        yield self.create_sandbox()
        self.assertEqual(self.created()["HostConfig"]["CgroupParent"], "kubepods-besteffort-pod1.slice")
        self.dockerd.answers["GET /info"] = answer(200, {"CgroupDriver": "systemd"})
        yield Deferred.fromCoroutine(until(lambda: self.lines("dockerd's cgroup driver is systemd again")))
        # The pod is kept as dockerd got it: hooks see where it is, and its containers join its sandbox.
        pod = self.store.pod("created-1")
        assert pod is not None
        self.assertEqual(pod.given.cgroup_parent, "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1.slice")
        self.dockerd.answers["POST /containers/create"] = answer(201, {"Id": "container-1", "Warnings": []}, "Created")
        body = json.dumps({
            "Image": "busybox",
            "Labels": {"io.kubernetes.docker.type": "container", "io.kubernetes.sandbox.id": "created-1"},
            "HostConfig": {"CgroupParent": "kubepods-besteffort-pod1.slice"},
        }).encode()
        name = b"POST /v1.41/containers/create?name=k8s_app_web_default_uid-1_0 HTTP/1.1\r\nHost: docker\r\n"
        response = yield self.ask(name + b"Content-Length: %d\r\n\r\n" % len(body), body)
        self.assertEqual(status_and_message(response)[0], 201)
        self.assertEqual(self.created()["HostConfig"]["CgroupParent"], "kubepods-besteffort-pod1.slice")

    @inlineCallbacks
    def test_an_info_that_does_not_answer_holds_a_create_no_longer_than_koordrps_bound(self):  # type: ignore[no-untyped-def]
        self.dockerd.answers["GET /info"] = WEDGED
        self.subscribe_a_mover()
        self.start()
        response = yield self.create_sandbox()
        self.assertEqual(status_and_message(response)[0], 201)
        self.assertEqual(self.created()["HostConfig"]["CgroupParent"], "kubepods-besteffort-pod1.slice")
        [warning] = self.lines("cannot read dockerd's cgroup driver")
        self.assertIn(f"GET /info: no answer within {QUESTION_SECONDS:g}s", warning)
        # One question at a time: the create waited for the one asked at start.
        self.assertEqual(len(self.dockerd.asked("GET /info")), 1)


# Each client connection bounded (koordrp.bounds), on Twisted's fakes and clock.

EVENTS = b"GET /v1.41/events HTTP/1.1\r\nHost: docker\r\n\r\n"
STREAM_BEGINS = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
TWO = replace(DOCKER_BOUNDS, connections=2)


@implementer(IDockerInterceptor)
class HeldInterceptor:
    """Takes every request through hooks, and answers none until the test says."""

    def __init__(self) -> None:
        self.handled: list[bytes] = []

    def wants(self, head: RequestHead) -> bool:
        return head.method == "POST"

    def handle(self, head: RequestHead, body: bytes) -> "Deferred[object]":
        self.handled.append(body)
        return Deferred()


class BoundedClientConnections(SynchronousTestCase):
    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()
        self.interceptor = HeldInterceptor()
        proxy = DockerProxyFactory("/run/docker.sock", self.reactor, self.interceptor, lambda why: json_response(503, "", why))
        self.factory = BoundedFactory(proxy, TWO, self.reactor, "the Docker API socket")

    def connect(self) -> StringTransportWithDisconnection:
        """A client connection the factory took; its transport (what it was sent, whether it is still open)."""
        protocol = self.factory.buildProtocol(UNIXAddress(None))
        assert protocol is not None
        transport = StringTransportWithDisconnection()
        transport.protocol = protocol
        protocol.makeConnection(transport)
        return transport

    def dockerd_answers(self, data: bytes) -> StringTransportWithDisconnection:
        """dockerd takes the last exchange koordrp opened, and begins its answer with ``data``."""
        _, upstream_factory, _, _ = self.reactor.unixClients[-1]
        upstream = upstream_factory.buildProtocol(UNIXAddress("/run/docker.sock"))
        transport = StringTransportWithDisconnection()
        transport.protocol = upstream
        upstream.makeConnection(transport)
        upstream.dataReceived(data)
        return transport

    def test_a_connection_that_sends_nothing_is_closed_at_the_idle_bound(self) -> None:
        client = self.connect()
        self.reactor.advance(TWO.idle_seconds - 0.1)
        self.assertTrue(client.connected)
        self.reactor.advance(0.1)
        self.assertFalse(client.connected)
        self.assertEqual(self.factory.closed["idle"], 1)
        self.assertEqual(self.factory.open, 0)

    def test_a_head_dripped_a_byte_a_second_is_closed_at_the_arrival_bound_from_its_first_byte(self) -> None:
        client = self.connect()
        dripped = 0
        while client.connected:
            client.protocol.dataReceived(EVENTS[dripped : dripped + 1])
            dripped += 1
            self.reactor.advance(1.0)
        self.assertEqual(dripped, TWO.arrival_seconds)  # each byte did not start the bound again
        self.assertEqual(self.factory.closed["slow"], 1)
        self.assertEqual(self.reactor.unixClients, [])  # dockerd never heard of it
        self.assertEqual(client.value(), b"")

    def test_an_intercepted_body_dripped_is_closed_at_the_arrival_bound(self) -> None:
        client = self.connect()
        client.protocol.dataReceived(CREATE + b"Content-Length: 100\r\n\r\n")
        while client.connected:
            client.protocol.dataReceived(b"{")
            self.reactor.advance(1.0)
        self.assertEqual(self.factory.closed["slow"], 1)
        self.assertEqual(self.interceptor.handled, [])

    def test_a_stream_in_progress_is_not_closed(self) -> None:
        client = self.connect()
        client.protocol.dataReceived(EVENTS)
        dockerd = self.dockerd_answers(STREAM_BEGINS)
        self.reactor.advance(100 * (TWO.idle_seconds + TWO.arrival_seconds))
        dockerd.protocol.dataReceived(b"2\r\n{}\r\n")
        self.assertTrue(client.connected)
        self.assertEqual(client.value(), STREAM_BEGINS + b"2\r\n{}\r\n")
        self.assertIn(b"GET /v1.41/events HTTP/1.1", dockerd.value())

    def test_an_intercepted_call_waiting_for_its_hooks_is_not_closed(self) -> None:
        client = self.connect()
        client.protocol.dataReceived(CREATE + b"Content-Length: 2\r\n\r\n{}")
        self.reactor.advance(100 * (TWO.idle_seconds + TWO.arrival_seconds))
        self.assertTrue(client.connected)
        self.assertEqual(self.interceptor.handled, [b"{}"])

    def test_a_connection_is_closed_once_its_exchange_is_over_never_kept_idle(self) -> None:
        client = self.connect()
        client.protocol.dataReceived(EVENTS)
        dockerd = self.dockerd_answers(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        dockerd.loseConnection()
        self.assertFalse(client.connected)
        self.assertEqual(self.factory.open, 0)

    def test_over_the_cap_a_connection_is_closed_at_once_while_every_one_is_being_answered(self) -> None:
        streams = [self.connect() for _ in range(2)]
        for stream in streams:
            stream.protocol.dataReceived(EVENTS)
            self.dockerd_answers(STREAM_BEGINS)
        # None: the listening port closes the connection as it was accepted.
        self.assertIsNone(self.factory.buildProtocol(UNIXAddress(None)))
        self.assertEqual(self.factory.closed["refused"], 1)
        self.assertTrue(all(stream.connected for stream in streams))

    def test_at_the_cap_a_new_connection_takes_the_place_of_the_longest_without_a_request(self) -> None:
        stream, idle = self.connect(), self.connect()
        stream.protocol.dataReceived(EVENTS)
        newest = self.connect()
        self.assertFalse(idle.connected)
        self.assertTrue(stream.connected and newest.connected)
        self.assertEqual(self.factory.closed["evicted"], 1)
        newest.protocol.dataReceived(EVENTS)
        self.assertEqual(len(self.reactor.unixClients), 2)

    def test_the_cap_leaves_koordrps_own_descriptors_under_the_limit(self) -> None:
        self.assertEqual(connection_cap(1024, 2, 1 << 20), 1024)
        # Two descriptors a connection: its own, and its exchange with dockerd.
        self.assertEqual(connection_cap(1024, 2, 1024), (1024 - OWN_DESCRIPTORS - METRICS_DESCRIPTORS) // 2)
        self.assertEqual(connection_cap(1024, 2, 300), FEWEST_CONNECTIONS)
