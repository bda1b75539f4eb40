"""Docker mode in front of a dockerd that accepts connections and never answers: every wait is bounded.

The wedged dockerd is a real unix socket server that reads and never writes; koordrp is the real
Docker mode service on the real reactor, with a real client on its own socket.
"""

import os
import time
from typing import Any, cast

from twisted.internet import reactor
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.interfaces import IReactorUNIX
from twisted.internet.protocol import ClientFactory, Factory, Protocol
from twisted.internet.task import deferLater
from twisted.logger import ILogObserver, LogEvent, globalLogPublisher
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase
from twisted.web.server import NOT_DONE_YET
from twisted.web.test.requesthelper import DummyRequest

from koordrp.call import Parts, SkipLabel
from koordrp.docker.dockerd import Dockerd
from koordrp.docker.service import DockerProxyService, DockerProxySettings
from koordrp.hooks.client import HookClients
from koordrp.hooks.dispatcher import Dispatcher
from koordrp.hooks.types import HookServers
from koordrp.resync import RETRY_SECONDS
from koordrp.store import Store
from koordrp.web import HealthResource
from tests.support.tempdirs import short_tempdir

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


async def until(condition: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await deferLater(reactor, 0.01, lambda: None)


class WedgedDockerdTests(TestCase):
    def setUp(self) -> None:
        directory = short_tempdir(self)
        self.wedged = WedgedDockerd()
        backend = os.path.join(directory, "docker.sock")
        unix = IReactorUNIX(reactor)
        port = unix.listenUNIX(backend, self.wedged)
        self.addCleanup(port.stopListening)
        self.listen = os.path.join(directory, "koordrp", "koordrp.sock")
        parts = Parts(Store(), Dispatcher(HookClients(reactor), reactor), HookServers, SkipLabel("skip", "true"), reactor)
        dockerd = Dockerd(unix, backend, question_seconds=QUESTION_SECONDS, probe_seconds=PROBE_SECONDS)
        self.service = DockerProxyService(DockerProxySettings(self.listen, backend), unix, parts, dockerd)
        self.events: list[LogEvent] = []
        observer = cast(ILogObserver, self.events.append)
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)

    def start(self) -> None:
        self.service.startService()
        self.addCleanup(self.service.stopService)

    @inlineCallbacks
    def test_healthz_answers_503_naming_dockerd_within_the_probe_time(self):  # type: ignore[no-untyped-def]
        request = DummyRequest([b"healthz"])
        finished = request.notifyFinish()
        started = time.monotonic()
        self.assertEqual(HealthResource(self.service.probe, reactor).render(request), NOT_DONE_YET)
        yield finished
        self.assertLess(time.monotonic() - started, PROBE_SECONDS + 1.0)
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
        self.assertIn(f"no answer within {QUESTION_SECONDS:g}s", warnings[0]["reason"])

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
