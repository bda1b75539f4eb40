"""/metrics and /healthz, served on a unix endpoint as on TCP; the endpoint's bounds (``koordrp.bounds``) on
Twisted's fakes and a Clock; its unix socket's mode and lock; the closed set of metric labels."""

import errno
import gc
import os
import resource
import signal
import socket
import stat
import time
from typing import Callable

from twisted.internet import reactor
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, fail, inlineCallbacks, succeed
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IHalfCloseableProtocol
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.internet.threads import deferToThread
from twisted.logger import formatEvent
from twisted.python import usage
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.server import Site
from twisted.web.test.requesthelper import DummyRequest
from zope.interface import implementer

from koordrp import bounds, defaults
from koordrp.bounds import ABORT_SECONDS, Bounds, BoundedConnection, BoundedFactory
from koordrp.cri.methods import KNOWN_METHODS
from koordrp.hooks.messages import PodHookRequest
from koordrp.metrics import CRI_METHODS, OTHER_METHOD, Metrics
from koordrp.store import Store
from koordrp.web import FRESH_SECONDS, METRICS_BOUNDS, LiveResource, UnixListening, metrics_service, unix_listening
from tests.support.logs import logged_events
from tests.support.tempdirs import short_tempdir

LIVEZ = b"GET /livez HTTP/1.1\r\nHost: koordrp\r\n\r\n"


def get(path: str, url_path: str) -> bytes:
    """A whole HTTP/1.0 answer to GET ``url_path``, from the unix socket ``path``."""
    with socket.socket(socket.AF_UNIX) as client:
        client.connect(path)
        client.sendall(f"GET {url_path} HTTP/1.0\r\n\r\n".encode())
        answer = b""
        while chunk := client.recv(65536):
            answer += chunk
    return answer


class UnixEndpointTests(TestCase):
    @inlineCallbacks
    def test_metrics_and_health_answer_on_a_unix_socket(self):  # type: ignore[no-untyped-def]
        path = os.path.join(short_tempdir(self), "metrics.sock")
        metrics = Metrics()
        metrics.cri_call("StartContainer", "OK", 0.002)
        store = Store()
        metrics.watch_store(store)
        store.put_pod("p1", PodHookRequest(), PodHookRequest())
        served = metrics_service(f"unix:{path}", metrics, lambda: succeed(None), reactor)
        served.startService()
        self.addCleanup(served.stopService)
        scraped = yield deferToThread(get, path, "/metrics")
        self.assertTrue(scraped.startswith(b"HTTP/1.0 200 OK"), scraped[:200])
        self.assertIn(b'koordrp_cri_calls_total{code="OK",method="StartContainer"} 1.0', scraped)
        for sample in (b"koordrp_store_pods 1.0", b"koordrp_store_containers 0.0", b"koordrp_state_files 0.0"):
            self.assertIn(b"\n" + sample + b"\n", scraped)
        self.assertIn(b"\nkoordrp_state_files_unreadable_total 0.0\n", scraped)
        self.assertIn(b"\nkoordrp_ready 1.0\n", scraped)
        health = yield deferToThread(get, path, "/healthz")
        # The scrape asked the backend already (koordrp_ready): its answer is recent.
        self.assertTrue(health.startswith(b"HTTP/1.0 200 OK") and b"\r\n\r\nok: the backend answered " in health, health)

    @inlineCallbacks
    def test_alive_while_the_runtime_is_away(self):  # type: ignore[no-untyped-def]
        path = os.path.join(short_tempdir(self), "metrics.sock")
        served = metrics_service(f"unix:{path}", Metrics(), lambda: fail(RuntimeError("containerd is away")), reactor)
        served.startService()
        self.addCleanup(served.stopService)
        health = yield deferToThread(get, path, "/healthz")
        self.assertTrue(health.startswith(b"HTTP/1.0 503") and health.endswith(b"unhealthy: containerd is away\n"), health)
        live = yield deferToThread(get, path, "/livez")
        self.assertTrue(live.startswith(b"HTTP/1.0 200 OK") and live.endswith(b"ok: koordrp's reactor answers\n"), live)


class Recorder(Protocol):
    """What a wrapped protocol was given."""

    def __init__(self) -> None:
        self.received = b""
        self.lost = False

    def dataReceived(self, data: bytes) -> None:
        self.received += data

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.lost = True


@implementer(IHalfCloseableProtocol)
class HalfCloser(Recorder):
    def __init__(self) -> None:
        super().__init__()
        self.read_closed = False

    def readConnectionLost(self) -> None:
        self.read_closed = True

    def writeConnectionLost(self) -> None:
        pass


SMALL = Bounds(connections=2, arrival_seconds=10.0, idle_seconds=30.0, arrival_bytes=100)


def connect(factory: BoundedFactory) -> tuple[BoundedConnection, StringTransport]:
    connection = factory.buildProtocol(IPv4Address("TCP", "127.0.0.1", 40000))
    assert connection is not None
    transport = StringTransport()
    connection.makeConnection(transport)
    return connection, transport


def lost(connection: BoundedConnection) -> None:
    """What the reactor does once a closed connection's socket is gone."""
    connection.connectionLost(Failure(ConnectionDone()))


class BoundsTests(SynchronousTestCase):
    """A connection cap and idle and drip bounds around any factory, on a Clock."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.events = logged_events(self)

    def factory(self, protocol: type[Protocol] = Recorder, limits: Bounds = SMALL) -> BoundedFactory:
        return BoundedFactory(Factory.forProtocol(protocol), limits, self.clock, "the test endpoint")

    def test_a_connection_that_sends_nothing_is_closed_at_the_idle_bound(self) -> None:
        factory = self.factory()
        connection, transport = connect(factory)
        self.clock.advance(SMALL.idle_seconds - 0.01)
        self.assertFalse(transport.disconnecting)
        self.clock.advance(0.01)
        self.assertTrue(transport.disconnecting)
        self.assertEqual((connection.closed_for, factory.closed[bounds.IDLE], factory.open), (bounds.IDLE, 1, 1))
        self.assertFalse(transport.disconnected)  # closed, not aborted: the client reads an end of file
        lost(connection)
        self.assertEqual((factory.open, self.clock.getDelayedCalls()), (0, []))

    def test_a_drip_fed_request_is_closed_at_the_arrival_bound_however_often_a_byte_comes(self) -> None:
        factory = self.factory()
        connection, transport = connect(factory)
        self.clock.advance(5)  # waiting, then its first byte starts the request's bound
        for _ in range(5):
            connection.dataReceived(b"G")
            self.clock.advance(2 - 0.001 if _ == 4 else 2)
        self.assertFalse(transport.disconnecting)  # 9.999 s after the first byte
        self.clock.advance(0.001)
        self.assertTrue(transport.disconnecting)
        self.assertEqual((connection.closed_for, factory.closed[bounds.SLOW]), (bounds.SLOW, 1))
        connection.dataReceived(b"G")  # what still comes is dropped
        wrapped = connection.wrappedProtocol
        assert isinstance(wrapped, Recorder)
        self.assertEqual(wrapped.received, b"GGGGG")

    def test_a_client_that_does_not_read_is_aborted_after_the_close(self) -> None:
        connection, transport = connect(self.factory())
        self.clock.advance(SMALL.idle_seconds)
        self.assertTrue(transport.disconnecting)
        self.assertFalse(transport.disconnected)
        self.clock.advance(ABORT_SECONDS)
        self.assertTrue(transport.disconnected)

    def test_a_request_larger_than_its_bound_is_closed_unread(self) -> None:
        factory = self.factory()
        connection, transport = connect(factory)
        connection.dataReceived(b"x" * SMALL.arrival_bytes)
        self.assertFalse(transport.disconnecting)
        connection.dataReceived(b"x")
        self.assertTrue(transport.disconnecting)
        self.assertEqual(factory.closed[bounds.OVERSIZED], 1)

    def test_no_bound_while_a_request_is_answered_then_the_idle_bound_again(self) -> None:
        connection, transport = connect(self.factory())
        connection.dataReceived(b"whole request")
        self.assertIs(connection.wrappedProtocol.transport, connection)  # type: ignore[attr-defined]
        bounds.arrived(connection)
        self.clock.advance(SMALL.idle_seconds * 10)
        self.assertFalse(transport.disconnecting)
        bounds.waiting(connection)
        self.clock.advance(SMALL.idle_seconds - 0.01)
        self.assertFalse(transport.disconnecting)
        self.clock.advance(0.01)
        self.assertEqual(connection.closed_for, bounds.IDLE)

    def test_over_the_cap_the_connection_waiting_longest_is_aborted_for_the_new_one(self) -> None:
        factory = self.factory()
        first, first_transport = connect(factory)
        self.clock.advance(1)
        second, second_transport = connect(factory)
        self.clock.advance(1)
        first.dataReceived(b"G")  # its request still arriving: it has waited longest without one in hand
        third, third_transport = connect(factory)
        self.assertEqual((first.closed_for, second.closed_for, third.closed_for), (bounds.EVICTED, None, None))
        self.assertTrue(first_transport.disconnected)  # aborted: its descriptor goes on the reactor's next turn
        self.assertFalse(second_transport.disconnecting or third_transport.disconnecting)
        self.assertEqual(factory.open, 3)
        # One abort at a time: until its descriptor is closed, a new connection is closed at once.
        self.assertIsNone(factory.buildProtocol(IPv4Address("TCP", "127.0.0.1", 40001)))
        lost(first)
        self.assertEqual((factory.open, factory.closed[bounds.REFUSED]), (2, 1))
        fourth, _ = connect(factory)
        self.assertEqual((second.closed_for, third.closed_for, fourth.closed_for), (bounds.EVICTED, None, None))

    def test_over_the_cap_a_new_connection_is_closed_at_once_while_every_one_is_answered(self) -> None:
        factory = self.factory()
        held = [connect(factory)[0] for _ in range(SMALL.connections)]
        for connection in held:
            bounds.arrived(connection)
        self.assertIsNone(factory.buildProtocol(IPv4Address("TCP", "127.0.0.1", 40001)))
        self.assertEqual((factory.open, factory.closed[bounds.REFUSED]), (2, 1))
        bounds.waiting(held[1])
        self.assertIsNotNone(factory.buildProtocol(IPv4Address("TCP", "127.0.0.1", 40002)))
        self.assertEqual((held[0].closed_for, held[1].closed_for), (None, bounds.EVICTED))

    def test_closing_connections_is_said_at_most_once_a_minute_idle_ones_never(self) -> None:
        factory = self.factory()

        def gone() -> None:  # what the reactor does once each closed connection's socket is closed
            for closed in [connection for connection in factory.protocols if connection.closed_for is not None]:
                lost(closed)

        for _ in range(5):
            connect(factory)
            gone()
        self.clock.advance(SMALL.idle_seconds)
        gone()
        connect(factory)[0].dataReceived(b"x" * 200)
        gone()
        self.clock.advance(bounds.WARN_EVERY_SECONDS)
        connect(factory)[0].dataReceived(b"x" * 200)
        said = [formatEvent(event) for event in self.events if event.get("log_namespace") == "koordrp.bounds.BoundedFactory"]
        self.assertEqual(len(said), 2, said)
        self.assertEqual(
            said[0],
            "the test endpoint closed connections: 1 without a request in hand, for newer ones (2 open at most); "
            "at most one such line a minute",
        )
        self.assertIn(": 2 whose request was larger than 100 bytes, 2 without a request in hand, for newer ones (2 open at most);", said[1])
        self.assertEqual(factory.closed[bounds.IDLE], 2)

    def test_half_closes_reach_a_protocol_that_takes_them(self) -> None:
        connection, _ = connect(self.factory(HalfCloser))
        self.assertTrue(IHalfCloseableProtocol.providedBy(connection))
        connection.readConnectionLost()
        wrapped = connection.wrappedProtocol
        assert isinstance(wrapped, HalfCloser)
        self.assertTrue(wrapped.read_closed)
        self.assertFalse(IHalfCloseableProtocol.providedBy(connect(self.factory())[0]))


class MetricsEndpointBoundsTests(SynchronousTestCase):
    """The metrics endpoint's own HTTP channel tells the bounds where its requests begin and end."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.factory = metrics_service("tcp:0", Metrics(), lambda: succeed(None), self.clock).factory
        self.factory.doStart()
        self.addCleanup(self.factory.doStop)

    def test_a_request_dripped_a_byte_every_two_seconds_is_closed_unanswered_at_ten_seconds(self) -> None:
        connection, transport = connect(self.factory)
        for byte in LIVEZ[:5]:
            connection.dataReceived(bytes([byte]))
            self.clock.advance(2)
        self.assertTrue(transport.disconnecting)
        self.assertEqual((connection.closed_for, transport.value()), (bounds.SLOW, b""))

    def test_an_answered_connection_is_kept_alive_until_the_idle_bound(self) -> None:
        connection, transport = connect(self.factory)
        connection.dataReceived(LIVEZ)
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 200 OK"), transport.value())
        self.assertTrue(transport.value().endswith(b"ok: koordrp's reactor answers\n"))
        self.clock.advance(METRICS_BOUNDS.idle_seconds - 0.01)
        connection.dataReceived(LIVEZ)  # the next request, at once
        self.assertEqual(transport.value().count(b"HTTP/1.1 200 OK"), 2)
        self.clock.advance(METRICS_BOUNDS.idle_seconds - 0.01)
        self.assertFalse(transport.disconnecting)
        self.clock.advance(0.01)
        self.assertEqual(connection.closed_for, bounds.IDLE)

    def test_pipelined_requests_are_answered_and_a_dripped_one_after_them_is_closed(self) -> None:
        connection, transport = connect(self.factory)
        connection.dataReceived(LIVEZ + LIVEZ + LIVEZ[:3])
        self.assertEqual(transport.value().count(b"HTTP/1.1 200 OK"), 2)
        self.clock.advance(METRICS_BOUNDS.arrival_seconds)
        self.assertIsNone(connection.closed_for)  # the channel read the start of it itself: waiting, for now
        connection.dataReceived(b"T")  # the rest of it, dripped: the request's bound from now
        self.clock.advance(METRICS_BOUNDS.arrival_seconds)
        self.assertEqual(connection.closed_for, bounds.SLOW)

    def test_a_header_flood_is_cut_at_the_bound_not_buffered(self) -> None:
        connection, transport = connect(self.factory)
        connection.dataReceived(b"GET /metrics HTTP/1.1\r\n" + b"X-A: " + b"a" * METRICS_BOUNDS.arrival_bytes)
        self.assertEqual((connection.closed_for, transport.value()), (bounds.OVERSIZED, b""))


class LiveTests(SynchronousTestCase):
    def live(self, count: object) -> tuple[int, bytes]:
        def descriptors() -> tuple[int, int]:
            if isinstance(count, OSError):
                raise count
            assert isinstance(count, tuple)
            return count

        request = DummyRequest([b"livez"])
        body = LiveResource(descriptors).render(request)
        assert isinstance(body, bytes)
        return request.responseCode or 200, body

    def test_503_with_the_reason_when_descriptors_run_out(self) -> None:
        self.assertEqual(self.live((900, 1024)), (200, b"ok: koordrp's reactor answers\n"))
        self.assertEqual(
            self.live((1000, 1024)),
            (503, b"unhealthy: 1000 of koordrp's 1024 file descriptors are open, fewer than 64 free\n"),
        )
        self.assertEqual(
            self.live(OSError(errno.EMFILE, os.strerror(errno.EMFILE))),
            (503, b"unhealthy: cannot count koordrp's open file descriptors: Too many open files\n"),
        )

    def test_descriptors_are_counted_from_proc(self) -> None:
        used, limit = bounds.descriptors_in_use()
        with open(os.devnull) as _:
            self.assertEqual(bounds.descriptors_in_use(), (used + 1, limit))
        self.assertEqual(limit, resource.getrlimit(resource.RLIMIT_NOFILE)[0])

    def test_the_soft_limit_is_raised_to_the_hard_one(self) -> None:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        self.addCleanup(resource.setrlimit, resource.RLIMIT_NOFILE, (soft, hard))
        lower = min(soft, 256)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lower, hard))
        self.assertEqual(bounds.raise_descriptor_limit(), (lower, hard))
        self.assertEqual(resource.getrlimit(resource.RLIMIT_NOFILE), (hard, hard))
        self.assertEqual(bounds.raise_descriptor_limit(), (hard, hard))


class ReadinessTests(SynchronousTestCase):
    """koordrp_ready on /metrics says what /healthz says, asked at each scrape as /healthz asks."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.metrics = Metrics()
        self.asked: list[Deferred[object]] = []
        self.answer: Callable[[], Deferred[object]] = lambda: succeed(None)
        served = metrics_service("tcp:0", self.metrics, self.probe, self.clock)
        site = served.factory.wrappedFactory
        assert isinstance(site, Site)
        self.health = site.resource.getChildWithDefault(b"healthz", DummyRequest([b"healthz"]))

    def probe(self) -> Deferred[object]:
        asking = self.answer()
        self.asked.append(asking)
        return asking

    def ready(self) -> float | None:
        return self.metrics.registry.get_sample_value("koordrp_ready")

    def healthz(self) -> DummyRequest:
        request = DummyRequest([b"healthz"])
        body = self.health.render(request)
        if isinstance(body, bytes):  # answered at once: twisted.web's site writes it and finishes
            request.write(body)
            request.finish()
        return request

    def code(self, request: DummyRequest) -> int | None:
        """The status /healthz answered, None while it has not."""
        return (request.responseCode or 200) if request.finished else None

    def test_nri_modes_probe_answers_at_once_and_the_gauge_is_its_answer_at_each_scrape(self) -> None:
        self.answer = lambda: fail(RuntimeError("koordrp is not registered with containerd's NRI yet"))
        self.assertEqual(self.ready(), 0)
        self.answer = lambda: succeed(None)
        self.assertEqual(self.ready(), 1)
        self.assertEqual(self.code(self.healthz()), 200)

    def test_a_recent_answer_is_not_asked_again_as_healthz_does_not(self) -> None:
        self.assertEqual(self.ready(), 1)
        self.clock.advance(FRESH_SECONDS - 1)
        self.assertEqual((self.ready(), self.code(self.healthz()), len(self.asked)), (1, 200, 1))
        self.clock.advance(1)
        self.assertEqual((self.ready(), len(self.asked)), (1, 2))

    def test_a_runtime_asked_on_its_socket_is_reported_a_scrape_later(self) -> None:
        """The proxies' probe answers later: a scrape does not wait for it, and reports what the last one found."""
        self.answer = Deferred
        self.assertIsNone(self.ready())  # no probe has ended yet: no sample
        self.asked[-1].callback(None)
        self.assertEqual(self.ready(), 1)
        self.clock.advance(FRESH_SECONDS)
        self.assertEqual(self.ready(), 1)  # asked again, not answered yet
        self.asked[-1].errback(RuntimeError("backend unix:///run/containerd/containerd.sock: UNAVAILABLE"))
        self.assertEqual(self.ready(), 0)

    def test_a_failure_ends_the_trust_in_an_earlier_answer_for_healthz_and_the_gauge_alike(self) -> None:
        self.assertEqual(self.code(self.healthz()), 200)
        self.clock.advance(FRESH_SECONDS)
        self.answer = lambda: fail(RuntimeError("containerd is away"))
        self.assertEqual((self.code(self.healthz()), self.ready()), (503, 0))
        self.answer = Deferred
        asked = len(self.asked)
        third = self.healthz()
        self.assertEqual((len(self.asked), self.code(third)), (asked + 1, None))  # asked again, not "answered 0.0s ago"
        self.asked[-1].errback(RuntimeError("containerd is away"))
        self.assertEqual(self.code(third), 503)

    def test_healthz_requests_and_scrapes_share_the_probe_in_flight(self) -> None:
        self.answer = Deferred
        first, second = self.healthz(), self.healthz()
        self.assertIsNone(self.ready())  # the scrape waits for nothing, and asks nothing more
        self.assertEqual(len(self.asked), 1)
        self.asked[0].errback(RuntimeError("containerd is away"))
        self.assertEqual((self.code(first), self.code(second), self.ready()), (503, 503, 0))
        self.assertEqual(b"".join(second.written), b"unhealthy: containerd is away\n")
        third = self.healthz()
        self.assertEqual(len(self.asked), 2)  # the next one once it has ended
        self.asked[1].callback(None)
        self.assertEqual((self.code(third), self.ready()), (200, 1))

    def test_a_request_whose_client_went_away_is_not_answered_and_stops_waiting(self) -> None:
        self.answer = Deferred
        gone, staying = self.healthz(), self.healthz()
        gone.processingFailed(Failure(ConnectionDone()))  # as twisted.web tells of a connection lost
        self.asked[0].callback(None)
        self.assertEqual((gone.finished, gone.written), (0, []))
        self.assertEqual(self.code(staying), 200)
        self.assertEqual(self.ready(), 1)  # the probe went on: its answer is remembered

    def test_a_client_gone_from_the_site_while_its_probe_runs_leaves_no_error(self) -> None:
        """A real twisted.web site on a memory transport: twisted.web refuses to finish such a request."""
        self.answer = Deferred
        factory = metrics_service("tcp:0", self.metrics, self.probe, self.clock).factory
        factory.doStart()
        self.addCleanup(factory.doStop)
        gone, gone_transport = connect(factory)
        gone.dataReceived(b"GET /healthz HTTP/1.1\r\nHost: koordrp\r\n\r\n")
        staying, staying_transport = connect(factory)
        staying.dataReceived(b"GET /healthz HTTP/1.1\r\nHost: koordrp\r\n\r\n")
        gone.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(len(self.asked), 1)
        self.asked[0].callback(None)
        gc.collect()  # an error left in a Deferred is logged as it is collected: trial fails the test for it
        self.assertEqual(gone_transport.value(), b"")
        self.assertTrue(staying_transport.value().startswith(b"HTTP/1.1 200 OK"), staying_transport.value())
        self.assertIn(b"\r\nok: the backend answers\n\r\n", staying_transport.value())


class MetricLabelTests(SynchronousTestCase):
    def methods(self, metrics: Metrics) -> set[str]:
        return {sample.labels["method"] for family in metrics.registry.collect() for sample in family.samples if "method" in sample.labels}

    def test_a_method_koordrp_does_not_know_is_other_however_many_names_clients_call(self) -> None:
        metrics = Metrics()
        for number in range(1000):
            metrics.cri_call(f"Bogus{number}", "OK", 0.001)
            metrics.unary(f"/runtime.v1.RuntimeService/Bogus{number}", lambda request, context: b"")(b"", None)  # type: ignore[arg-type]
            list(metrics.streaming(f"/evil.Service/Version{number}", lambda request, context: iter([b""]))(b"", None))  # type: ignore[arg-type]
        metrics.unary("/evil.Service/Version", lambda request, context: b"")(b"", None)  # type: ignore[arg-type]
        self.assertEqual(self.methods(metrics), {OTHER_METHOD})
        series = {(sample.name, tuple(sorted(sample.labels.items()))) for family in metrics.registry.collect() for sample in family.samples}
        self.assertLess(len(series), 30)

    def test_known_methods_keep_their_names_in_every_mode(self) -> None:
        metrics = Metrics()
        metrics.unary("/runtime.v1.RuntimeService/Version", lambda request, context: b"")(b"", None)  # type: ignore[arg-type]
        metrics.unary("/runtime.v1alpha2.ImageService/PullImage", lambda request, context: b"")(b"", None)  # type: ignore[arg-type]
        list(metrics.streaming("/runtime.v1.RuntimeService/GetContainerEvents", lambda request, context: iter([]))(b"", None))  # type: ignore[arg-type]
        metrics.cri_call("UpdatePodSandboxResources", "OK", 0.001)  # an intercepted call, by the CRI method it stands for
        self.assertEqual(self.methods(metrics), {"Version", "PullImage", "GetContainerEvents", "UpdatePodSandboxResources"})

    def test_the_closed_set_is_the_one_the_proxy_routes(self) -> None:
        self.assertEqual(CRI_METHODS, frozenset(KNOWN_METHODS))


class EndpointOptionTests(SynchronousTestCase):
    def test_a_unix_endpoint_is_0660_unless_it_says_its_mode(self) -> None:
        self.assertEqual(unix_listening("unix:/run/k/metrics.sock"), UnixListening("/run/k/metrics.sock", 0o660, 50, True))
        self.assertEqual(
            unix_listening("unix:address=/run/k/m.sock:mode=600:backlog=5:lockfile=0"), UnixListening("/run/k/m.sock", 0o600, 5, False)
        )
        self.assertEqual(unix_listening("unix:/run/k\\:x.sock"), UnixListening("/run/k:x.sock"))
        for other in ("tcp:9316", "tcp:9316:interface=127.0.0.1", "tcp6:9316"):
            self.assertIsNone(unix_listening(other))

    def test_endpoints_koordrp_cannot_take_are_usage_errors(self) -> None:
        for value in ("unix:metrics.sock", "unix:/run/m.sock:mode=999", "unix:/run/m.sock:colour=red", "nope:1"):
            options = defaults.Options()
            with self.assertRaises(usage.UsageError, msg=value) as raised:
                options.parseOptions([f"--metrics-endpoint={value}"])
            self.assertIn("--metrics-endpoint", str(raised.exception))
        options = defaults.Options()
        options.parseOptions(["--metrics-endpoint=unix:/run/k/m.sock:mode=640"])
        self.assertEqual(options["metrics-endpoint"], "unix:/run/k/m.sock:mode=640")


def get_or_refused(path: str, url_path: str) -> bytes | None:
    try:
        return get(path, url_path)
    except (FileNotFoundError, ConnectionRefusedError):
        return None


class Child:
    """A child process of this one, not reaped until ``reap`` (once it exits, a zombie until then)."""

    def __init__(self, case: SynchronousTestCase, program: str, *argv: str) -> None:
        self.pid = os.posix_spawn(program, list(argv), os.environ)
        self.reaped = False
        case.addCleanup(self.reap, kill=True)

    def state(self) -> str:
        with open(f"/proc/{self.pid}/status") as status:
            return next(line.split()[1] for line in status if line.startswith("State:"))

    def command(self) -> bytes:
        with open(f"/proc/{self.pid}/cmdline", "rb") as cmdline:
            return cmdline.read()

    def reap(self, kill: bool = False) -> None:
        if self.reaped:
            return
        if kill:
            os.kill(self.pid, signal.SIGKILL)  # not reaped yet: the pid is still this child's
        os.waitpid(self.pid, 0)
        self.reaped = True


def eventually(condition: Callable[[], bool], what: str) -> None:
    """Polls ``condition`` until it holds (an event a test waits for; 30 s is a generous bound, not a measure)."""
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


class UnixSocketTests(TestCase):
    """The unix socket: its mode, and a lock left by a koordrp gone, whatever now has its pid."""

    def setUp(self) -> None:
        self.directory = short_tempdir(self)
        self.path = os.path.join(self.directory, "metrics.sock")
        self.events = logged_events(self)

    def leave_a_stale_socket_locked_by(self, pid: int) -> None:
        with socket.socket(socket.AF_UNIX) as left:
            left.bind(self.path)  # bound, never served: what a koordrp killed leaves
        os.symlink(str(pid), self.path + ".lock")

    @inlineCallbacks
    def serve(self, endpoint: str | None = None):  # type: ignore[no-untyped-def]
        served = metrics_service(endpoint or f"unix:{self.path}", Metrics(), lambda: succeed(None), reactor)
        served.startService()
        self.addCleanup(served.stopService)
        answer = yield deferToThread(get_or_refused, self.path, "/livez")
        return served, answer

    @inlineCallbacks
    def assert_taken_over(self, pid: int):  # type: ignore[no-untyped-def]
        self.leave_a_stale_socket_locked_by(pid)
        served, answer = yield self.serve()
        self.assertIsNotNone(served.port)
        self.assertTrue(answer.startswith(b"HTTP/1.0 200 OK"), answer)
        self.assertEqual(os.readlink(self.path + ".lock"), str(os.getpid()))
        self.assertEqual(stat.S_IMODE(os.stat(self.path).st_mode), 0o660)
        yield served.stopService()
        self.assertFalse(os.path.lexists(self.path) or os.path.lexists(self.path + ".lock"))

    def test_a_lock_whose_pid_is_a_zombie_is_taken_over(self):  # type: ignore[no-untyped-def]
        zombie = Child(self, "/bin/true", "true")
        eventually(lambda: zombie.state() == "Z", "the child is a zombie")
        return self.assert_taken_over(zombie.pid)

    def test_a_lock_whose_pid_another_program_has_now_is_taken_over(self):  # type: ignore[no-untyped-def]
        return self.assert_taken_over(Child(self, "/bin/sleep", "sleep", "600").pid)

    def test_a_lock_with_this_koordrps_own_pid_is_taken_over(self):  # type: ignore[no-untyped-def]
        # In a container, koordrp's next start has the pid the last one had.
        return self.assert_taken_over(os.getpid())

    def test_a_lock_whose_process_is_gone_is_taken_over(self):  # type: ignore[no-untyped-def]
        gone = Child(self, "/bin/true", "true")
        gone.reap()
        return self.assert_taken_over(gone.pid)

    @inlineCallbacks
    def test_a_lock_held_by_a_live_koordrp_is_left_and_said_once(self):  # type: ignore[no-untyped-def]
        koordrp = Child(self, "/bin/sleep", "twistd", "600")
        eventually(lambda: koordrp.command() == b"twistd\x00600\x00", "the other runs as twistd")
        other = koordrp.pid
        self.leave_a_stale_socket_locked_by(other)
        served, answer = yield self.serve()
        self.assertEqual((served.port, answer), (None, None))
        self.assertEqual(os.readlink(self.path + ".lock"), str(other))
        [said] = [formatEvent(event) for event in self.events if event.get("log_namespace") == "koordrp.web.MetricsServer"]
        self.assertIn(f"cannot serve /metrics, /healthz and /livez on unix:{self.path}: {self.path} is locked", said)
        self.assertIn(f"by a live koordrp, pid {other} (twistd 600); koordrp goes on without them", said)

    @inlineCallbacks
    def test_the_mode_the_endpoint_says(self):  # type: ignore[no-untyped-def]
        served, answer = yield self.serve(f"unix:{self.path}:mode=600:lockfile=0")
        self.assertTrue(answer.startswith(b"HTTP/1.0 200 OK"), answer)
        self.assertEqual(stat.S_IMODE(os.stat(self.path).st_mode), 0o600)
        self.assertFalse(os.path.lexists(self.path + ".lock"))

    @inlineCallbacks
    def test_a_directory_others_may_write_is_refused_in_one_line(self):  # type: ignore[no-untyped-def]
        os.chmod(self.directory, 0o777)
        served, answer = yield self.serve()
        self.assertEqual((served.port, answer), (None, None))
        [said] = [formatEvent(event) for event in self.events if event.get("log_namespace") == "koordrp.web.MetricsServer"]
        self.assertIn("is group- or world-writable (mode 0777)", said)
