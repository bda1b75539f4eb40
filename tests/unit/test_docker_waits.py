"""Docker mode in front of a dockerd that accepts connections and never answers: every wait is bounded.

The wedged dockerd is a real unix socket server that reads and never writes; koordrp is the real
Docker mode service on the real reactor, with a real client on its own socket.
"""

import os
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import CancelledError, Deferred, inlineCallbacks
from twisted.internet.interfaces import IReactorUNIX
from twisted.internet.protocol import ClientFactory, Factory, Protocol
from twisted.internet.task import Clock
from twisted.logger import LogEvent
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.server import NOT_DONE_YET
from twisted.web.test.requesthelper import DummyRequest

from koordrp import adapters
from koordrp.call import Parts, SkipLabel
from koordrp.docker import dockerd
from koordrp.docker.dockerd import CgroupDriver, Dockerd
from koordrp.docker.service import DockerProxyService, DockerProxySettings
from koordrp.hooks.client import HookClients
from koordrp.hooks.dispatcher import Dispatcher
from koordrp.hooks.types import HookServers
from koordrp.metrics import Metrics
from koordrp.store import Store
from koordrp.trouble import RETRY_CAP_SECONDS, RETRY_SECONDS, Backoff
from koordrp.web import HealthResource
from tests.support.logs import logged_events
from tests.support.tempdirs import short_tempdir
from tests.support.waiting import until

QUESTION_SECONDS = 0.5
PROBE_SECONDS = 0.5


class _Silent(Protocol):
    def __init__(self) -> None:
        self.received = b""
        self.closed = False

    def dataReceived(self, data: bytes) -> None:
        self.received += data

    def connectionLost(self, reason: Failure = Failure(Exception())) -> None:
        self.closed = True


class WedgedDockerd(Factory):
    """Accepts every connection, reads whatever comes, answers nothing."""

    def __init__(self) -> None:
        self.connections: list[_Silent] = []

    def buildProtocol(self, addr: Any) -> _Silent:
        connection = _Silent()
        self.connections.append(connection)
        return connection

    def asked(self, start: bytes) -> list[_Silent]:
        return [connection for connection in self.connections if connection.received.startswith(start)]

    @property
    def open(self) -> int:
        return sum(not connection.closed for connection in self.connections)


def open_sockets() -> int:
    """This process's sockets (the reactor creates pipes for itself as it goes; those are not counted)."""
    links = []
    for name in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{name}"))
        except FileNotFoundError:  # the descriptor listdir itself used
            pass
    return sum(link.startswith("socket:") for link in links)


class DockerModeTestCase(TestCase):
    """koordrp's Docker mode service on the real reactor, in front of a dockerd on a real unix socket."""

    def serve(
        self,
        backend: Factory,
        parts: Parts,
        question_seconds: float = dockerd.QUESTION_SECONDS,
        probe_seconds: float = dockerd.PROBE_SECONDS,
        driver_backoff: Backoff | None = None,
        grace_period: float = 10.0,
    ) -> None:
        """``backend`` plays dockerd; the bounds and back-off are Dockerd's own, the grace the service's."""
        directory = short_tempdir(self)
        path = os.path.join(directory, "docker.sock")
        unix = IReactorUNIX(reactor)
        self.port = unix.listenUNIX(path, backend)
        self.addCleanup(self.port.stopListening)
        self.listen = os.path.join(directory, "koordrp", "koordrp.sock")
        asked = Dockerd(unix, path, question_seconds, probe_seconds, driver_backoff=driver_backoff)
        settings = DockerProxySettings(self.listen, path, grace_period=grace_period)
        self.service = DockerProxyService(settings, unix, parts, asked)
        self.events = logged_events(self)

    def start(self) -> None:
        self.service.startService()
        self.addCleanup(self.service.stopService)


class WedgedDockerdTests(DockerModeTestCase):
    def setUp(self) -> None:
        self.wedged = WedgedDockerd()
        parts = Parts(Store(), Dispatcher(HookClients(reactor), reactor), HookServers, SkipLabel("skip", "true"), reactor)
        self.serve(self.wedged, parts, question_seconds=QUESTION_SECONDS, probe_seconds=PROBE_SECONDS)

    @inlineCallbacks
    def test_healthz_answers_503_naming_dockerd_within_the_probe_time(self):  # type: ignore[no-untyped-def]
        request = DummyRequest([b"healthz"])
        finished = request.notifyFinish()
        self.assertEqual(HealthResource(self.service.probe, reactor).render(request), NOT_DONE_YET)
        yield finished
        self.assertEqual(request.responseCode, 503)
        body = b"".join(request.written).decode()
        self.assertIn("(dockerd)", body)
        self.assertIn(f"no answer within {PROBE_SECONDS:g}s", body)
        yield Deferred.fromCoroutine(until(lambda: self.wedged.open == 0))

    @inlineCallbacks
    def test_a_store_rebuild_that_gets_no_answer_says_why_and_tries_again(self):  # type: ignore[no-untyped-def]
        self.start()
        listing = b"GET /containers/json"
        yield Deferred.fromCoroutine(until(lambda: len(self.wedged.asked(listing)) >= 2, timeout=QUESTION_SECONDS + RETRY_SECONDS + 2))
        warnings = [event for event in self.events if event.get("log_format", "").startswith("cannot read {runtime}")]
        self.assertEqual(len(warnings), 1)
        self.assertEqual(warnings[0]["runtime"], "dockerd")
        self.assertIn(f"no answer within {QUESTION_SECONDS:g}s", warnings[0]["problem"])

    @inlineCallbacks
    def test_a_client_that_goes_away_takes_its_exchange_with_dockerd_along(self):  # type: ignore[no-untyped-def]
        before = open_sockets()
        self.start()
        connected: Deferred[Protocol] = Deferred()

        class Client(Protocol):
            def connectionMade(self) -> None:
                connected.callback(self)

        # Not ClientFactory.forProtocol: Twisted types its result as a Factory, and connectUNIX takes a ClientFactory.
        factory = ClientFactory()
        factory.protocol = Client
        IReactorUNIX(reactor).connectUNIX(self.listen, factory)
        client = yield connected
        body = b'{"Image": "busybox"}'
        client.transport.write(
            b"POST /v1.41/containers/create HTTP/1.1\r\nHost: docker\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        create = b"POST /v1.41/containers/create"
        yield Deferred.fromCoroutine(until(lambda: self.wedged.asked(create)))
        client.transport.abortConnection()
        [exchange] = self.wedged.asked(create)
        yield Deferred.fromCoroutine(until(lambda: exchange.closed))
        yield self.service.stopService()
        yield Deferred.fromCoroutine(until(lambda: self.wedged.open == 0, timeout=QUESTION_SECONDS + 2))
        yield Deferred.fromCoroutine(until(lambda: open_sockets() <= before))


class CgroupDriverTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.questions: list[Deferred[str]] = []
        self.cancelled = 0
        self.metrics = Metrics()
        self.driver = CgroupDriver(self.ask, self.clock)
        self.events = logged_events(self)

    def ask(self) -> "Deferred[str]":
        question: Deferred[str] = Deferred(lambda _: self.cancel())
        self.questions.append(question)
        return question

    def cancel(self) -> None:
        self.cancelled += 1

    def failed_attempts(self) -> float | None:
        return self.metrics.registry.get_sample_value("koordrp_failed_attempts_total", {"activity": "docker-cgroup-driver"})

    def lines(self, start: str) -> list[LogEvent]:
        return [event for event in self.events if event.get("log_format", "").startswith(start)]

    def test_asked_at_start_and_kept_once_named(self) -> None:
        self.driver.start()
        waiting = self.driver.current()
        self.assertNoResult(waiting)
        self.questions[0].callback("systemd")
        self.assertEqual(self.successResultOf(waiting), "systemd")
        self.assertEqual(self.successResultOf(self.driver.current()), "systemd")
        self.assertEqual(len(self.questions), 1)
        self.assertEqual([event["driver"] for event in self.lines("dockerd's cgroup driver is")], ["systemd"])

    def test_a_failed_answer_is_not_kept_and_is_asked_again_until_dockerd_names_it(self) -> None:
        self.driver.start()
        waiting = self.driver.current()
        self.questions[0].errback(adapters.LookupFailed("GET /info: dockerd answered 500"))
        self.assertIsNone(self.successResultOf(waiting))
        # Until the next question, calls go on at once without it.
        self.assertIsNone(self.successResultOf(self.driver.current()))
        self.clock.advance(RETRY_SECONDS)
        # While a question is out, calls wait for its answer.
        waiting = self.driver.current()
        self.questions[1].errback(adapters.LookupFailed("GET /info: dockerd answered 500"))
        self.assertIsNone(self.successResultOf(waiting))
        self.clock.advance(2 * RETRY_SECONDS)
        self.questions[2].errback(adapters.LookupFailed("GET /info: no answer within 10s"))
        self.clock.advance(4 * RETRY_SECONDS)
        waiting = self.driver.current()
        self.questions[3].callback("cgroupfs")
        self.assertEqual(self.successResultOf(waiting), "cgroupfs")
        self.assertEqual([event["problem"] for event in self.lines("cannot read dockerd's cgroup driver")], [
            "GET /info: dockerd answered 500",
            "GET /info: no answer within 10s",
        ])
        [again] = self.lines("dockerd's cgroup driver is {driver} again")
        self.assertEqual((again["driver"], again["failures"]), ("cgroupfs", 3))
        # The line for a driver named at once is not written as well.
        self.assertEqual([event for event in self.events if event.get("log_format") == "dockerd's cgroup driver is {driver}"], [])
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_retries_back_off_to_a_cap_and_alternating_reasons_are_each_said_once(self) -> None:
        self.driver = CgroupDriver(self.ask, self.clock, metrics=self.metrics)
        self.driver.start()
        reasons = ["GET /info: dockerd answered 500", "GET /info: no answer within 10s"]
        waits = []
        for attempt in range(12):
            self.questions[-1].errback(adapters.LookupFailed(reasons[attempt % 2]))
            [retry] = self.clock.getDelayedCalls()
            waits.append(retry.getTime() - self.clock.seconds())
            self.clock.advance(waits[-1])
        self.assertEqual(waits[:6], [1.0, 2.0, 4.0, 8.0, 16.0, RETRY_CAP_SECONDS])
        self.assertEqual(set(waits[5:]), {RETRY_CAP_SECONDS})
        self.assertEqual([event["problem"] for event in self.lines("cannot read dockerd's cgroup driver")], reasons)
        self.assertEqual(self.failed_attempts(), 12)
        self.questions[-1].callback("systemd")
        self.assertEqual(len(self.lines("dockerd's cgroup driver is {driver} again")), 1)
        self.assertEqual(self.successResultOf(self.driver.current()), "systemd")
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_callers_share_one_question_and_leave_it_alone_when_they_give_up(self) -> None:
        self.driver.start()
        first, second = self.driver.current(), self.driver.current()
        first.cancel()
        self.failureResultOf(first, CancelledError)
        self.assertEqual(self.cancelled, 0)
        self.questions[0].callback("systemd")
        self.assertEqual(self.successResultOf(second), "systemd")
        self.assertEqual(len(self.questions), 1)

    def test_not_started_it_asks_when_asked(self) -> None:
        waiting = self.driver.current()
        self.questions[0].errback(adapters.LookupFailed("GET /info: connection refused"))
        self.assertIsNone(self.successResultOf(waiting))
        waiting = self.driver.current()
        self.questions[1].callback("systemd")
        self.assertEqual(self.successResultOf(waiting), "systemd")

    def test_stopping_ends_the_question_and_the_retries(self) -> None:
        self.driver.start()
        waiting = self.driver.current()
        self.driver.stop()
        self.assertEqual(self.cancelled, 1)
        self.assertIsNone(self.successResultOf(waiting))
        self.assertEqual(self.lines("cannot read"), [])
        self.driver.start()
        self.questions[1].errback(adapters.LookupFailed("GET /info: connection refused"))
        self.driver.stop()
        self.assertEqual(self.clock.getDelayedCalls(), [])
