"""Docker mode's stop on real sockets: calls in flight get --grace-period, streams do not hold it.

koordrp is the real Docker mode service on the real reactor, in front of a scripted dockerd
(``tests.fake.dockerd``) that answers when the test says; clients are plain blocking sockets in
threads.
"""

import json
import socket
from dataclasses import dataclass, field
from typing import cast

from twisted.internet import reactor
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.threads import deferToThread
from twisted.logger import formatEvent

from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from koordrp.call import Parts, SkipLabel
from koordrp.hooks.messages import ContainerHookRequest
from koordrp.hooks.types import FailurePolicy, HookServerConfig, HookServers, HookType
from koordrp.store import Store
from tests.fake.dockerd import WEDGED, Endless, Held, ScriptedDockerd, answer
from tests.fake.flows import ScriptedStages
from tests.support.waiting import until
from tests.unit.test_docker_bounds import CREATE, SANDBOX, status_and_message
from tests.unit.test_docker_waits import DockerModeTestCase

LONG_GRACE = 120.0
"""A grace no test waits out: a stop that ends is one that did not wait for it."""
EVENTS = b"GET /v1.41/events HTTP/1.1\r\nHost: docker\r\n\r\n"
EVENTS_BEGIN = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
KILL = b"POST /v1.41/containers/not-kubernetes/kill HTTP/1.1\r\nHost: docker\r\nContent-Length: 0\r\n\r\n"
STOP = b"POST /v1.41/containers/c-1/stop?t=10 HTTP/1.1\r\nHost: docker\r\nContent-Length: 0\r\n\r\n"


@dataclass
class DrainWatchingStages(ScriptedStages):
    """Remembers how many post stages had been announced when each drain began."""

    announced_at_drain: list[int] = field(default_factory=list)

    def drain(self, timeout: float) -> "Deferred[None]":
        self.announced_at_drain.append(len(self.announced))
        return super().drain(timeout)


def exchange(path: str, request: bytes) -> bytes:
    """Send ``request`` whole, then read until koordrp closes: what came back (b"" if it was cut)."""
    client = socket.socket(socket.AF_UNIX)
    client.connect(path)
    received = b""
    try:
        client.sendall(request)
        while data := client.recv(65536):
            received += data
    except ConnectionResetError:
        pass
    finally:
        client.close()
    return received


class StoppingWithCallsInFlight(DockerModeTestCase):
    def setUp(self) -> None:
        self.dockerd = ScriptedDockerd({
            "GET /containers/json": answer(200, []),
            "GET /info": answer(200, {"CgroupDriver": "systemd"}),
        })
        self.stages = DrainWatchingStages()
        self.store = Store()
        self.parts = Parts(self.store, self.stages, HookServers, SkipLabel("skip", "true"), reactor)

    def begin(self, grace_period: float) -> None:
        self.serve(self.dockerd, self.parts, grace_period=grace_period)
        self.start()

    def ask(self, request: bytes) -> "Deferred[bytes]":
        return deferToThread(exchange, self.listen, request)

    def lines(self, containing: str) -> list[str]:
        return [text for text in map(formatEvent, self.events) if containing in text]

    def asked(self, request: str) -> "Deferred[None]":
        return Deferred.fromCoroutine(until(lambda: self.dockerd.asked(request)))

    def stopping(self) -> "Deferred[None]":
        """Stop the service; fires once the stop has begun waiting for the calls in flight."""
        self.stopped = cast("Deferred[None]", self.service.stopService())
        return Deferred.fromCoroutine(until(lambda: self.lines("Docker call(s) in flight")))

    @inlineCallbacks
    def test_a_create_in_flight_is_answered_and_the_stop_waits_for_it_not_for_streams(self):  # type: ignore[no-untyped-def]
        created = self.dockerd.answers["POST /containers/create"] = Held(answer(201, {"Id": "created-1", "Warnings": []}))
        self.dockerd.answers["GET /events"] = Endless(EVENTS_BEGIN)
        self.begin(LONG_GRACE)
        stream = self.ask(EVENTS)
        yield self.asked("GET /v1.41/events")
        body = json.dumps(SANDBOX).encode()
        answered = self.ask(CREATE + b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        yield self.asked("POST /v1.41/containers/create")
        yield self.stopping()
        [line] = self.lines("Docker call(s) in flight")
        self.assertIn("stopping: 1 Docker call(s) in flight get up to", line)  # the stream is not one
        self.assertNoResult(self.stopped)
        created.release()
        self.assertEqual(status_and_message((yield answered))[0], 201)
        yield self.stopped
        self.assertIsNotNone(self.store.pod("created-1"))
        # The stream is closed once the calls are over.
        self.assertEqual((yield stream), EVENTS_BEGIN)
        self.assertEqual(self.lines("cut at the stop's bound"), [])

    @inlineCallbacks
    def test_a_stop_in_flight_has_its_post_stop_hooks_drained(self):  # type: ignore[no-untyped-def]
        container = ContainerHookRequest(
            pod_meta=hook.PodSandboxMetadata(name="web", namespace="default", uid="uid-1"),
            container_meta=hook.ContainerMetadata(name="app", id="c-1"),
        )
        self.parts = Parts(
            self.store,
            self.stages,
            lambda: HookServers(
                (HookServerConfig("watcher.json", "/run/w.sock", FailurePolicy.IGNORE, frozenset({HookType.POST_STOP_CONTAINER}), 2.0),)
            ),
            SkipLabel("skip", "true"),
            reactor,
        )
        stopped = self.dockerd.answers["POST /containers/c-1/stop"] = Held(answer(204))
        self.begin(LONG_GRACE)
        yield Deferred.fromCoroutine(until(lambda: self.lines("store rebuilt from dockerd")))
        self.store.put_container("c-1", "s-1", container, container)
        answered = self.ask(STOP)
        yield self.asked("POST /v1.41/containers/c-1/stop")
        yield self.stopping()
        self.assertEqual(self.stages.drains, [])
        stopped.release()
        self.assertEqual(int((yield answered).split(b" ")[1]), 204)
        yield self.stopped
        # The call's post stage was owed before the drain of post stages began: it was drained.
        self.assertEqual([stage.hook for stage in self.stages.announced], [HookType.POST_STOP_CONTAINER])
        self.assertEqual(self.stages.announced_at_drain, [1])

    @inlineCallbacks
    def test_a_request_passed_through_is_waited_for_until_dockerd_begins_its_answer(self):  # type: ignore[no-untyped-def]
        killed = self.dockerd.answers["POST /containers/not-kubernetes/kill"] = Held(answer(204))
        self.begin(LONG_GRACE)
        answered = self.ask(KILL)
        yield self.asked("POST /v1.41/containers/not-kubernetes/kill")
        yield self.stopping()
        self.assertNoResult(self.stopped)
        killed.release()
        self.assertEqual(int((yield answered).split(b" ")[1]), 204)
        yield self.stopped

    @inlineCallbacks
    def test_a_create_in_flight_to_a_wedged_dockerd_is_cut_at_the_bound(self):  # type: ignore[no-untyped-def]
        self.dockerd.answers["POST /containers/create"] = WEDGED
        self.begin(0.2)
        body = json.dumps(SANDBOX).encode()
        answered = self.ask(CREATE + b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        yield self.asked("POST /v1.41/containers/create")
        yield self.stopping()
        yield self.stopped
        self.assertEqual((yield answered), b"")
        [cut] = self.lines("cut at the stop's bound")
        self.assertIn("stopping: POST /v1.41/containers/create cut at the stop's bound, still waiting for its hooks or dockerd", cut)
        [line] = self.lines("/containers/create pod default/web")
        self.assertIn("CANCELLED", line)
        # koordrp's exchange with dockerd went with it.
        yield Deferred.fromCoroutine(until(lambda: self.dockerd.open == 0))
        self.assertIsNone(self.store.pod("created-1"))

    @inlineCallbacks
    def test_streams_alone_do_not_hold_the_stop(self):  # type: ignore[no-untyped-def]
        self.dockerd.answers["GET /events"] = Endless(EVENTS_BEGIN)
        self.begin(LONG_GRACE)
        client = socket.socket(socket.AF_UNIX)
        self.addCleanup(client.close)
        client.connect(self.listen)
        client.sendall(EVENTS)
        self.assertEqual((yield deferToThread(client.recv, 65536)), EVENTS_BEGIN)
        yield self.service.stopService()
        self.assertEqual(self.lines("Docker call(s) in flight"), [])
        self.assertEqual((yield deferToThread(client.recv, 65536)), b"")
