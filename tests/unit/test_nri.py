"""NRI mode: the wire (multiplexer and ttrpc), the connection, the plugin's events run through the flows, and
the service's reconnecting. containerd's side is tests/fake/nri.py; the hook stages are scripted."""

import os
import struct
from typing import Any, cast

from twisted.internet.defer import Deferred, TimeoutError as DeferredTimeout, fail, succeed
from twisted.internet.error import ConnectionDone, ConnectionRefusedError
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import LogEvent, LogLevel, formatEvent
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from koordrp import adapters
from koordrp.call import Parts, SkipLabel
from koordrp.api.nri.v1alpha1 import api_pb2 as nri
from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from koordrp.hooks.dispatcher import Dispatcher
from koordrp.hooks.limit import ANSWER_MARGIN, PreHookLimit
from koordrp.checkpoint import DirectoryCheckpoint, Kind
from koordrp.store import OwedStops
from koordrp.nri.catchup import REPLY_SLACK as CATCH_UP_REPLY_SLACK
from koordrp.hooks.messages import CATCH_UP_ANNOTATION, PodHookRequest
from koordrp.hooks.types import FailurePolicy, HookServerConfig, HookServers, HookType
from koordrp.nri import registration, translate
from koordrp.api.ttrpc import ttrpc_pb2
from koordrp.nri.connection import PLUGIN_SERVICE, RESOURCE_EXHAUSTED, UNIMPLEMENTED, UNKNOWN, NRIConnection, NRIError
from koordrp.nri.confirmations import CONFIRM_SECONDS, UNDONE_CREATE
from koordrp.nri.plugin import (
    EVENT_MASK,
    HANDLERS,
    NOT_DONE,
    REGISTER_SECONDS,
    EventHandler,
    GivenUp,
    NRIPlugin,
    PluginIdentity,
    RequestHandler,
    subscription,
)
from koordrp.metrics import Metrics
from koordrp.nri.service import CONNECT_RETRY_CAP_SECONDS, NRIService, NRISettings
from koordrp.nri.wire import (
    MAX_MUX_FRAME_SENT,
    MAX_TTRPC_MESSAGE,
    PLUGIN_SERVICE_CONNECTION,
    REQUEST,
    RESPONSE,
    RUNTIME_SERVICE_CONNECTION,
    MuxReader,
    Oversized,
    TtrpcMessage,
    TtrpcReader,
    WireError,
    mux_frames,
    ttrpc_message,
)
from koordrp.store import ContainerState, Store
from koordrp.trouble import RETRY_CAP_SECONDS, RETRY_SECONDS
from tests.fake.flows import ScriptedStages
from tests.fake.hook_clients import PendingCall, calls_to, scripted_clients
from tests.fake.nri import FakeContainerd
from tests.support.logs import logged_events

SKIP = SkipLabel("runtimeproxy.koordinator.sh/skip-hookserver", "true")
POD_PARENT = "/kubepods/besteffort/pod-uid-1"
PRE_CREATE = HookType.PRE_CREATE_CONTAINER
POST_START = HookType.POST_START_CONTAINER
POST_STOP = HookType.POST_STOP_CONTAINER


class LogCapture(SynchronousTestCase):
    def setUp(self) -> None:
        self.events = logged_events(self)

    def logged(self, text: str) -> list[LogEvent]:
        return [event for event in self.events if text in event.get("log_format", "")]


class WireTests(SynchronousTestCase):
    def test_frames_larger_than_containerd_reads_are_split_and_whatever_the_chunks_come_back_whole(self) -> None:
        data = bytes(range(256)) * 40
        framed = mux_frames(PLUGIN_SERVICE_CONNECTION, data)
        reader = MuxReader()
        chunks = [chunk for index in range(len(framed)) for chunk in reader.feed(framed[index : index + 1])]
        self.assertEqual(b"".join(chunk.data for chunk in chunks), data)
        ends = [index for index, chunk in enumerate(chunks) if chunk.ends_frame]
        self.assertEqual([end + 1 for end in ends], [MAX_MUX_FRAME_SENT, 2 * MAX_MUX_FRAME_SENT, len(data)])
        self.assertEqual({chunk.connection for chunk in chunks}, {PLUGIN_SERVICE_CONNECTION})

    def test_a_frame_is_handed_on_as_its_bytes_come_not_held_until_it_is_whole(self) -> None:
        """NRI 0.6's multiplexer sends frames of up to 16 MiB: a 4.8 MB synchronization comes as one."""
        reader = MuxReader()
        [chunk] = reader.feed(struct.pack(">II", PLUGIN_SERVICE_CONNECTION, 5 << 20) + b"x" * 1000)
        self.assertEqual((chunk.data, chunk.ends_frame), (b"x" * 1000, False))
        [rest] = reader.feed(b"y" * ((5 << 20) - 1000) + struct.pack(">II", 2, 0))
        self.assertEqual((len(rest.data), rest.ends_frame), ((5 << 20) - 1000, True))

    def test_a_message_beyond_ttrpcs_limit_is_dropped_as_it_comes_and_the_next_one_is_read(self) -> None:
        """ttrpc's server reads such a message's bytes and drops them (its channel's Discard), then answers
        its stream RESOURCE_EXHAUSTED; it never holds them."""
        reader = TtrpcReader()
        length = MAX_TTRPC_MESSAGE + 600_000
        header = struct.pack(">IIBB", length, 1, REQUEST, 0)
        found = list(reader.feed(header + b"z" * 100_000))
        self.assertEqual((found, len(reader._buffer)), ([], 0))  # nothing held
        for _ in range(length // 100_000 - 1):
            self.assertEqual(list(reader.feed(b"z" * 100_000)), [])
        next_message = ttrpc_message(3, REQUEST, b"next")
        found = list(reader.feed(b"z" * (length % 100_000) + next_message))
        self.assertEqual(found, [Oversized(1, REQUEST, length), TtrpcMessage(3, REQUEST, 0, b"next")])

    def test_messages_are_read_whatever_the_chunks(self) -> None:
        stream = ttrpc_message(1, REQUEST, b"") + ttrpc_message(3, REQUEST, b"abc" * 1000)
        reader = TtrpcReader()
        found = [message for index in range(0, len(stream), 7) for message in reader.feed(stream[index : index + 7])]
        self.assertEqual(found, [TtrpcMessage(1, REQUEST, 0, b""), TtrpcMessage(3, REQUEST, 0, b"abc" * 1000)])

    def test_a_response_is_framed_byte_for_byte_as_nri_and_ttrpc_lay_it_out(self) -> None:
        """multiplex: connection id, length (big-endian uint32 each); ttrpc: length, stream id, type, flags."""
        framed = mux_frames(PLUGIN_SERVICE_CONNECTION, ttrpc_message(7, RESPONSE, b"abc"))
        self.assertEqual(framed, bytes.fromhex("00000001 0000000d" "00000003 00000007 02 00") + b"abc")

    def test_a_frame_beyond_the_multiplexers_limit_is_an_error(self) -> None:
        self.assertRaises(WireError, MuxReader().feed, b"\x00\x00\x00\x01\xff\xff\xff\xff")


class RecordingPlugin:
    """``PluginCalls``: what containerd called, answered with ``answers`` (or a Deferred the test fires)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes, float | None]] = []
        self.answers: dict[str, Deferred[bytes]] = {}
        self.lost_because: list[Failure] = []
        self.oversized_requests: list[int] = []
        self.connection: NRIConnection | None = None

    def made(self, connection: NRIConnection) -> None:
        self.connection = connection

    def called(self, method: str, payload: bytes, timeout: float | None) -> Deferred[bytes]:
        self.calls.append((method, payload, timeout))
        return self.answers.get(method, succeed(b"answer"))

    def oversized(self, length: int) -> None:
        self.oversized_requests.append(length)

    def lost(self, reason: Failure) -> None:
        self.lost_because.append(reason)


class ConnectionTests(LogCapture):
    def setUp(self) -> None:
        super().setUp()
        self.clock = Clock()
        self.plugin = RecordingPlugin()
        self.connection = NRIConnection(self.plugin, self.clock)
        self.containerd = FakeContainerd(self.connection)

    def test_containerds_call_reaches_the_plugin_and_its_answer_goes_back_on_the_same_stream(self) -> None:
        stream = self.containerd.call("Configure", nri.ConfigureRequest(runtime_name="containerd"), timeout=2.0)
        [(method, payload, timeout)] = self.plugin.calls
        self.assertEqual((method, nri.ConfigureRequest.FromString(payload).runtime_name, timeout), ("Configure", "containerd", 2.0))
        self.assertEqual(self.containerd.answers()[stream].payload, b"answer")
        self.assertIs(self.plugin.connection, self.connection)

    def test_failures_reach_containerd_as_a_status(self) -> None:
        self.plugin.answers["CreateContainer"] = fail(NRIError(UNKNOWN, "koordrp: hook server a.json failed"))
        self.plugin.answers["StateChange"] = fail(ZeroDivisionError("oops"))
        first = self.containerd.call("CreateContainer", nri.CreateContainerRequest())
        second = self.containerd.call("StateChange", nri.StateChangeEvent())
        third = self.containerd.call("Anything", nri.Empty(), service="nri.pkg.api.v1alpha1.Elsewhere")
        answers = self.containerd.answers()
        self.assertEqual((answers[first].status.code, answers[first].status.message), (UNKNOWN, "koordrp: hook server a.json failed"))
        self.assertEqual(answers[second].status.code, UNKNOWN)
        self.assertIn("StateChange failed: oops", answers[second].status.message)
        self.assertEqual(answers[third].status.code, UNIMPLEMENTED)
        # A status the plugin decided was said where it decided it; an exception turned into one is said here, once.
        [line] = self.logged("answered containerd's NRI {method} with UNKNOWN")
        self.assertEqual((line["method"], line["error"], line["log_level"]), ("StateChange", "ZeroDivisionError: oops", LogLevel.error))
        self.assertEqual(self.flushLoggedErrors(), [])

    def test_a_request_that_is_not_ttrpc_is_answered_unknown_in_one_line(self) -> None:
        self.containerd.feed(mux_frames(PLUGIN_SERVICE_CONNECTION, ttrpc_message(1, REQUEST, b"\xff\xff")))
        answer = self.containerd.answers()[1]
        self.assertEqual(answer.status.code, UNKNOWN)
        self.assertIn("koordrp cannot read the ttrpc request", answer.status.message)
        [line] = self.logged("answered containerd's NRI {method} with UNKNOWN")
        self.assertEqual(line["method"], "request")
        self.assertTrue(line["error"].startswith("DecodeError: "), line["error"])
        self.assertEqual(self.plugin.calls, [])

    def test_a_call_koordrp_gave_up_on_is_said_in_one_line(self) -> None:
        self.plugin.answers["CreateContainer"] = fail(DeferredTimeout("no answer in time"))
        stream = self.containerd.call("CreateContainer", nri.CreateContainerRequest())
        answer = self.containerd.answers()[stream]
        self.assertEqual((answer.status.code, answer.status.message), (UNKNOWN, "koordrp gave up on CreateContainer"))
        [line] = self.logged("answered containerd's NRI {method} with UNKNOWN")
        self.assertEqual((line["method"], line["error"]), ("CreateContainer", "TimeoutError: no answer in time"))

    def test_an_answer_that_cannot_be_sent_is_logged(self) -> None:
        self.plugin.answers["StateChange"] = succeed(cast(bytes, "not bytes"))  # a bug koordrp's plugin could have
        self.containerd.call("StateChange", nri.StateChangeEvent())
        [logged] = self.logged("cannot answer containerd's {method}")
        self.assertEqual((logged["method"], logged["log_failure"].type), ("StateChange", TypeError))
        self.assertEqual(self.containerd.answers(), {})
        self.assertEqual(len(self.flushLoggedErrors(TypeError)), 1)

    def test_the_plugins_calls_use_odd_streams_and_get_containerds_answers(self) -> None:
        first = self.connection.call("RegisterPlugin", b"one", timeout=5)
        second = self.connection.call("RegisterPlugin", b"two", timeout=5)
        [one, two] = self.containerd.sent()
        self.assertEqual((one.stream_id, two.stream_id), (1, 3))
        assert one.request is not None
        self.assertEqual((one.request.service, one.request.method, one.request.timeout_nano), ("nri.pkg.api.v1alpha1.Runtime", "RegisterPlugin", 5 * 10**9))
        self.containerd.answer(3, code=3, error="invalid plugin index")
        self.containerd.answer(1, nri.Empty())
        self.assertEqual(self.successResultOf(first), b"")
        self.assertEqual(str(self.failureResultOf(second, NRIError).value), "invalid plugin index")

    def test_a_call_containerd_does_not_answer_times_out(self) -> None:
        answer = self.connection.call("RegisterPlugin", b"", timeout=5)
        self.clock.advance(5)
        self.failureResultOf(answer)
        self.containerd.answer(1, nri.Empty())  # too late: dropped
        self.assertFalse(self.containerd.transport.disconnecting)
        self.assertEqual(self.flushLoggedErrors(), [])

    def test_a_lost_connection_fails_what_waits_and_cancels_what_is_served(self) -> None:
        cancelled: list[object] = []
        self.plugin.answers["StateChange"] = Deferred(cancelled.append)
        self.containerd.call("StateChange", nri.StateChangeEvent())
        waiting = self.connection.call("RegisterPlugin", b"", timeout=5)
        self.containerd.sent()
        self.connection.connectionLost(Failure(ConnectionRefusedError()))
        self.failureResultOf(waiting, NRIError)
        self.assertEqual(len(cancelled), 1)
        self.assertEqual(len(self.plugin.lost_because), 1)
        self.assertEqual(self.containerd.sent(), [])  # nothing is written to a closed connection

    def test_bytes_that_break_the_framing_end_the_connection_and_are_why_it_was_lost(self) -> None:
        self.containerd.feed(b"\x00\x00\x00\x01\xff\xff\xff\xff")
        self.assertTrue(self.containerd.transport.disconnecting)
        self.connection.connectionLost(Failure(ConnectionRefusedError()))
        [reason] = self.plugin.lost_because
        self.assertIsInstance(reason.value, WireError)

    def test_a_request_beyond_ttrpcs_limit_is_answered_resource_exhausted_as_ttrpc_answers_it(self) -> None:
        request = ttrpc_pb2.Request(service=PLUGIN_SERVICE, method="Synchronize", payload=b"p" * MAX_TTRPC_MESSAGE)
        self.containerd.feed(mux_frames(PLUGIN_SERVICE_CONNECTION, struct.pack(">IIBB", request.ByteSize(), 1, REQUEST, 0)))
        self.containerd.feed(mux_frames(PLUGIN_SERVICE_CONNECTION, request.SerializeToString()))
        answer = self.containerd.answers()[1]
        self.assertEqual(answer.status.code, RESOURCE_EXHAUSTED)
        self.assertIn(f"exceeds the maximum message size of {MAX_TTRPC_MESSAGE}", answer.status.message)
        self.assertEqual((self.plugin.oversized_requests, self.plugin.calls), ([request.ByteSize()], []))
        stream = self.containerd.call("Configure", nri.ConfigureRequest())  # the connection goes on
        self.assertEqual(self.containerd.answers()[stream].payload, b"answer")

    def test_an_answer_beyond_ttrpcs_limit_fails_the_call_it_answers(self) -> None:
        waiting = self.connection.call("UpdateContainers", b"", timeout=5)
        self.containerd.sent()
        self.containerd.feed(mux_frames(RUNTIME_SERVICE_CONNECTION, struct.pack(">IIBB", MAX_TTRPC_MESSAGE + 1, 1, RESPONSE, 0)))
        self.containerd.feed(mux_frames(RUNTIME_SERVICE_CONNECTION, b"r" * (MAX_TTRPC_MESSAGE + 1)))
        self.assertEqual(self.failureResultOf(waiting, NRIError).value.code, RESOURCE_EXHAUSTED)

    def test_a_long_answer_goes_in_frames_containerd_can_read(self) -> None:
        self.plugin.answers["Synchronize"] = succeed(b"x" * 10000)
        stream = self.containerd.call("Synchronize", nri.SynchronizeRequest())
        self.assertEqual(self.containerd.answers()[stream].payload, b"x" * 10000)
        self.assertLessEqual(max(self.containerd.frames_sent), MAX_MUX_FRAME_SENT)


def nri_pod(labels: dict[str, str] | None = None, sandbox_id: str = "s-1") -> nri.PodSandbox:
    return nri.PodSandbox(
        id=sandbox_id, name="web", namespace="default", uid="uid-1", labels=labels or {}, linux=nri.LinuxPodSandbox(cgroup_parent=POD_PARENT)
    )


def nri_container(state: nri.ContainerState = nri.CONTAINER_UNKNOWN, env: tuple[str, ...] = ("A=1",)) -> nri.Container:
    resources = nri.LinuxResources()
    resources.cpu.shares.value, resources.cpu.cpus = 2, "0-3"
    return nri.Container(
        id="c-1",
        pod_sandbox_id="s-1",
        name="app",
        state=state,
        env=list(env),
        annotations={translate.RESTART_COUNT_ANNOTATION: "2"},
        linux=nri.LinuxContainer(resources=resources, cgroups_path=f"{POD_PARENT}/c-1"),
    )


def event(kind: nri.Event, container: nri.Container | None = None) -> nri.StateChangeEvent:
    changed = nri.StateChangeEvent(event=kind, pod=nri_pod())
    if container is not None:
        changed.container.CopyFrom(container)
    return changed


class PluginTests(LogCapture):
    def setUp(self) -> None:
        super().setUp()
        self.clock = Clock()
        self.store = Store()
        self.stages = ScriptedStages()
        self.servers = HookServers()
        self.metrics = Metrics()
        parts = Parts(self.store, self.stages, lambda: self.servers, SKIP, self.clock, self.metrics)
        self.synchronized = 0
        self.plugin = NRIPlugin(parts, PluginIdentity("koordrp", "10"), on_synchronized=self.count_synchronized)
        self.containerd = FakeContainerd(NRIConnection(self.plugin, self.clock))

    def count_synchronized(self, runtime: str, deadline: str) -> None:
        self.synchronized += 1

    def subscribe(self, *hooks: HookType, policy: FailurePolicy = FailurePolicy.IGNORE) -> None:
        self.servers = HookServers((HookServerConfig("a.json", "/run/a.sock", policy, frozenset(hooks), 2.0),))

    def call_lines(self) -> list[tuple[str, str]]:
        return [(line["method"], line["outcome"]) for line in self.events if line.get("log_namespace") == "koordrp.calls"]

    def run_pod(self) -> None:
        self.containerd.answers()  # the registration
        self.containerd.call("StateChange", event(nri.RUN_POD_SANDBOX))

    def create(self) -> nri.CreateContainerResponse:
        stream = self.containerd.call("CreateContainer", nri.CreateContainerRequest(pod=nri_pod(), container=nri_container()))
        answer = self.containerd.answers()[stream]
        self.assertEqual(answer.status.code, 0, answer.status.message)
        return nri.CreateContainerResponse.FromString(answer.payload)

    def start_container(self) -> None:
        """A pod run and its container created, confirmed and told to start: containerd's PostStartContainer is yet to come."""
        self.run_pod()
        self.create()
        self.containerd.call("StateChange", event(nri.POST_CREATE_CONTAINER, nri_container(nri.CONTAINER_CREATED)))
        self.containerd.call("StateChange", event(nri.START_CONTAINER, nri_container(nri.CONTAINER_CREATED)))

    def test_it_registers_and_subscribes_to_every_lifecycle_event(self) -> None:
        [registration] = self.containerd.sent()
        assert registration.request is not None
        request = nri.RegisterPluginRequest.FromString(registration.request.payload)
        self.assertEqual((request.plugin_name, request.plugin_idx), ("koordrp", "10"))
        stream = self.containerd.call("Configure", nri.ConfigureRequest(runtime_name="containerd", runtime_version="1.7.24"))
        events = nri.ConfigureResponse.FromString(self.containerd.answers()[stream].payload).events
        self.assertEqual(events, EVENT_MASK)
        self.assertEqual([bit for bit in range(1, nri.LAST) if events & 1 << (bit - 1)], list(range(1, nri.LAST)))

    def given_up(self) -> GivenUp:
        """Why the plugin closed its connection: the service says it, once for all attempts alike."""
        self.assertTrue(self.containerd.transport.disconnecting)
        assert self.plugin.given_up is not None
        self.assertEqual([event for event in self.events if event["log_level"] >= LogLevel.warn], [])
        return self.plugin.given_up

    def test_a_refused_registration_closes_the_connection_saying_why(self) -> None:
        self.containerd.answer(1, code=3, error='invalid plugin index "1"')
        self.assertEqual(
            self.given_up(), GivenUp('cannot register as plugin 10-koordrp: containerd\'s NRI refused it: invalid plugin index "1"', LogLevel.error)
        )

    def test_a_registration_containerd_does_not_answer_closes_the_connection_saying_why(self) -> None:
        self.clock.advance(REGISTER_SECONDS)
        self.assertIn(f"containerd's NRI did not answer within {REGISTER_SECONDS:g}s", self.given_up().reason)

    def test_a_synchronize_that_fails_closes_the_connection_for_a_new_one(self) -> None:
        """containerd keeps a plugin it could not synchronize connected but never calls it."""
        stream = self.containerd.call("Synchronize", nri.Empty(), payload=b"\xff")
        self.assertEqual(self.containerd.answers()[stream].status.code, UNKNOWN)
        self.assertIn("cannot synchronize with containerd's NRI", self.given_up().reason)
        self.assertEqual(self.synchronized, 0)

    def test_a_synchronization_beyond_ttrpcs_limit_closes_the_connection_naming_nri_0_6s_limit(self) -> None:
        """NRI 0.6 (containerd 1.7 before 1.7.26) sends it whole, then keeps the plugin but never calls it."""
        self.containerd.call("Configure", nri.ConfigureRequest(runtime_name="containerd", runtime_version="1.7.24"))
        self.plugin.oversized(4_817_207)
        given_up = self.given_up()
        self.assertEqual(given_up.level, LogLevel.error)
        for words in ("containerd 1.7.24's NRI", "4 MiB", "NRI 0.6 cannot split", "1.7.26", "--backend-runtime-mode=Containerd"):
            self.assertIn(words, given_up.reason)

    def test_an_oversized_request_once_synchronized_is_one_error_and_the_plugin_stays(self) -> None:
        self.containerd.call("Synchronize", nri.SynchronizeRequest())
        self.plugin.oversized(5 << 20)
        self.assertFalse(self.containerd.transport.disconnecting)
        [line] = self.logged("beyond the {limit} MiB ttrpc carries")
        self.assertEqual((line["length"], line["log_level"]), (5 << 20, LogLevel.error))

    def test_a_split_synchronization_is_collected_and_the_store_agrees_with_the_whole_once(self) -> None:
        """NRI 0.8 sends parts with ``more`` set; each is answered with ``more`` (NRI's stub does), and only the
        whole is everything containerd has: the store forgets what it lacks only then."""
        self.containerd.call("Synchronize", nri.SynchronizeRequest(pods=[nri_pod(sandbox_id="gone")]))
        self.assertEqual(self.store.sizes(), (1, 0))
        first = self.containerd.call("Synchronize", nri.SynchronizeRequest(pods=[nri_pod()], more=True))
        answer = self.containerd.answers()[first]
        self.assertEqual((answer.status.code, nri.SynchronizeResponse.FromString(answer.payload).more), (0, True))
        self.assertEqual((self.store.sizes(), self.synchronized), ((1, 0), 1))
        # The raw bytes of NRI 0.8's field 3, as containerd 2.1 sends them.
        part = nri.SynchronizeRequest(containers=[nri_container(nri.CONTAINER_RUNNING)]).SerializeToString() + bytes([3 << 3, 1])
        self.containerd.call("Synchronize", nri.Empty(), payload=part)
        last = self.containerd.call("Synchronize", nri.SynchronizeRequest(pods=[nri_pod(sandbox_id="s-2")]))
        answer = self.containerd.answers()[last]
        self.assertEqual((answer.status.code, nri.SynchronizeResponse.FromString(answer.payload).more), (0, False))
        self.assertEqual((self.store.sizes(), self.synchronized), ((2, 1), 2))
        self.assertIsNone(self.store.pod("gone"))
        self.assertIsNotNone(self.store.container("c-1"))

    def test_a_synchronization_whose_last_part_comes_after_the_first_parts_deadline_names_that_deadline(self) -> None:
        self.containerd.call("Synchronize", nri.SynchronizeRequest(pods=[nri_pod()], more=True), timeout=2.0)
        self.clock.advance(2.5)
        last = self.containerd.call("Synchronize", nri.SynchronizeRequest(), timeout=None)  # a part without a deadline
        answer = self.containerd.answers()[last]
        self.assertEqual(answer.status.message, "koordrp cannot synchronize: koordrp synchronized after containerd's deadline (2s from its first part)")
        self.assertEqual(self.synchronized, 0)

    def test_shutdown_is_answered(self) -> None:
        stream = self.containerd.call("Shutdown", nri.Empty())
        self.assertEqual(self.containerd.answers()[stream].status.code, 0)
        self.assertEqual(len(self.logged("shutting down")), 1)

    def test_synchronize_fills_the_store(self) -> None:
        request = nri.SynchronizeRequest(pods=[nri_pod()], containers=[nri_container(nri.CONTAINER_RUNNING)])
        stream = self.containerd.call("Synchronize", request)
        self.assertEqual(self.containerd.answers()[stream].status.code, 0)
        stored = self.store.container("c-1")
        assert stored is not None
        self.assertEqual((stored.state, stored.sandbox_id, stored.asked.pod_cgroup_parent), (ContainerState.RUNNING, "s-1", POD_PARENT))
        self.assertEqual((stored.asked.container_meta.attempt, dict(stored.asked.container_envs)), (2, {"A": "1"}))
        self.assertEqual((self.store.sizes(), self.synchronized), ((1, 1), 1))

    def test_a_create_is_answered_with_the_hooks_changes_and_stored_once_containerd_made_it(self) -> None:
        self.subscribe(PRE_CREATE)
        self.stages.behaviours[PRE_CREATE] = lambda request: hook.ContainerResourceHookResponse(
            container_envs={"ADDED": "1"}, container_resources=hook.LinuxContainerResources(cpu_shares=512, cpuset_cpus="0-3")
        )
        self.run_pod()
        adjust = self.create().adjust
        self.assertEqual(([(env.key, env.value) for env in adjust.env], adjust.linux.resources.cpu.shares.value), ([("ADDED", "1")], 512))
        self.assertFalse(adjust.linux.resources.cpu.cpus)  # unchanged: not named
        self.assertEqual((self.store.container("c-1"), self.call_lines()), (None, []))  # the run called no server: no line
        self.containerd.call("StateChange", event(nri.POST_CREATE_CONTAINER, nri_container(nri.CONTAINER_CREATED)))
        stored = self.store.container("c-1")
        assert stored is not None
        self.assertEqual((dict(stored.asked.container_envs), dict(stored.given.container_envs)), ({"A": "1"}, {"A": "1", "ADDED": "1"}))
        self.assertEqual(self.call_lines()[-1], ("CreateContainer", "OK"))

    def line(self, method: str) -> LogEvent:
        [found] = [line for line in self.events if line.get("log_namespace") == "koordrp.calls" and line["method"] == method]
        return found

    def test_a_create_containerd_undoes_is_not_stored_and_owes_no_post_stop(self) -> None:
        self.subscribe(POST_STOP)
        self.run_pod()
        self.create()
        self.containerd.call("StopContainer", nri.StopContainerRequest(pod=nri_pod(), container=nri_container()))
        self.containerd.call("StateChange", event(nri.REMOVE_CONTAINER, nri_container()))
        self.assertEqual(self.store.sizes(), (1, 0))
        self.assertEqual(self.stages.announced, [])
        self.assertIn(("CreateContainer", "NOT-CONFIRMED"), self.call_lines())

    def test_an_undone_create_says_why_applies_nothing_and_names_what_the_events_name(self) -> None:
        """Two NRI plugins setting one field make containerd fail the create after both answered; it then tells
        the plugins of the container's stop and removal."""
        self.subscribe(PRE_CREATE)
        self.stages.answers[PRE_CREATE] = hook.ContainerResourceHookResponse(container_resources=hook.LinuxContainerResources(cpu_shares=512))
        self.run_pod()
        for _ in range(2):
            self.create()
            self.containerd.call("StopContainer", nri.StopContainerRequest(pod=nri_pod(), container=nri_container(nri.CONTAINER_CREATED)))
            self.containerd.call("StateChange", event(nri.REMOVE_CONTAINER, nri_container()))
        create = [line for line in self.events if line.get("method") == "CreateContainer"][0]
        self.assertEqual((create["outcome"], create["why"]), ("NOT-CONFIRMED", UNDONE_CREATE))
        self.assertIn(f"left alone ({NOT_DONE}) resources.cpu_shares 2→512", create["hooks"])
        self.assertNotIn("changed", create["hooks"])
        text = formatEvent(create)
        self.assertIn(f"container app: NOT-CONFIRMED ({UNDONE_CREATE}) in ", text)
        self.assertNotIn("StopContainer", [method for method, _ in self.call_lines()])  # it called no server
        [warning] = self.logged("containerd undid a create that koordrp's hooks changed")
        self.assertEqual(warning["subject"], "pod default/web container app")
        self.assertIn("both tried to set", formatEvent(warning))

    def test_an_event_that_called_no_hook_server_and_went_well_gets_no_line_but_is_counted(self) -> None:
        """containerd logs its own events; an operator hears of those koordrp did something for or that went wrong."""
        self.subscribe(PRE_CREATE)
        self.start_container()
        self.containerd.call("StateChange", event(nri.POST_START_CONTAINER, nri_container(nri.CONTAINER_RUNNING)))
        self.assertEqual(self.call_lines(), [("CreateContainer", "OK")])
        counted = [
            self.metrics.registry.get_sample_value("koordrp_cri_calls_total", {"method": method, "code": "OK"})
            for method in ("RunPodSandbox", "CreateContainer", "StartContainer")
        ]
        self.assertEqual(counted, [1.0, 1.0, 1.0])

    def test_an_event_for_a_skipped_pod_or_that_went_wrong_gets_its_line(self) -> None:
        self.subscribe(HookType.PRE_RUN_POD_SANDBOX)
        self.containerd.answers()  # the registration
        skipped = nri.StateChangeEvent(event=nri.RUN_POD_SANDBOX, pod=nri_pod({SKIP.key: SKIP.value}))
        self.containerd.call("StateChange", skipped)
        self.subscribe()
        self.create()
        self.clock.advance(CONFIRM_SECONDS)
        self.assertEqual(self.call_lines(), [("RunPodSandbox", "OK"), ("CreateContainer", "NOT-CONFIRMED")])
        self.assertIn("PreRunPodSandbox@a.json: skipped", str(self.line("RunPodSandbox")["hooks"]))

    def test_a_create_never_confirmed_ends_after_a_bound(self) -> None:
        self.run_pod()
        self.create()
        self.clock.advance(CONFIRM_SECONDS)
        self.assertEqual(self.call_lines()[-1], ("CreateContainer", "NOT-CONFIRMED"))
        self.assertEqual(self.line("CreateContainer")["why"], f"containerd did not say it did it within {CONFIRM_SECONDS:g}s")

    def test_a_fail_policy_server_that_cannot_be_heard_fails_containerds_call(self) -> None:
        self.subscribe(PRE_CREATE, policy=FailurePolicy.FAIL)
        self.stages.failures[PRE_CREATE] = "no answer within 2s"
        self.run_pod()
        stream = self.containerd.call("CreateContainer", nri.CreateContainerRequest(pod=nri_pod(), container=nri_container()))
        answer = self.containerd.answers()[stream]
        self.assertEqual(answer.status.code, UNKNOWN)
        self.assertIn("a.json", answer.status.message)
        self.assertEqual((self.store.sizes(), self.call_lines()[-1]), ((1, 0), ("CreateContainer", "UNKNOWN")))

    def test_hooks_may_take_containerds_deadline_less_the_time_to_answer(self) -> None:
        self.subscribe(PRE_CREATE)
        self.run_pod()
        self.containerd.call("CreateContainer", nri.CreateContainerRequest(pod=nri_pod(), container=nri_container()), timeout=2.0)
        self.assertEqual(self.stages.budgets, [2.0 - ANSWER_MARGIN])

    def test_post_start_runs_once_the_container_has_started(self) -> None:
        self.subscribe(POST_START)
        self.start_container()
        self.assertEqual(self.stages.announced, [])
        self.containerd.call("StateChange", event(nri.POST_START_CONTAINER, nri_container(nri.CONTAINER_RUNNING)))
        self.assertEqual([stage.hook for stage in self.stages.announced], [POST_START])

    def test_each_stop_fires_post_stop_once_a_pods_stop_included(self) -> None:
        self.subscribe(POST_STOP)
        self.containerd.call("Synchronize", nri.SynchronizeRequest(pods=[nri_pod()], containers=[nri_container(nri.CONTAINER_RUNNING)]))
        stop = nri.StopContainerRequest(pod=nri_pod(), container=nri_container(nri.CONTAINER_STOPPED))
        self.containerd.call("StopContainer", stop)
        self.containerd.call("StopContainer", stop)
        self.containerd.call("StateChange", event(nri.STOP_POD_SANDBOX))
        self.assertEqual([stage.hook for stage in self.stages.announced], [POST_STOP])

    def test_a_confirmed_create_leaves_no_timer_behind(self) -> None:
        self.containerd.answer(1, nri.Empty())  # the registration
        self.run_pod()
        self.create()
        self.assertEqual(len(self.clock.getDelayedCalls()), 1)
        self.containerd.call("StateChange", event(nri.POST_CREATE_CONTAINER, nri_container(nri.CONTAINER_CREATED)))
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def started_then_stopped(self, state: nri.ContainerState) -> None:
        """A container created and told to start, then stopped before containerd's PostStartContainer."""
        self.subscribe(POST_START, POST_STOP)
        self.start_container()
        self.containerd.call("StopContainer", nri.StopContainerRequest(pod=nri_pod(), container=nri_container(state)))

    def test_a_start_containerd_failed_is_told_as_a_stop_of_a_created_container_and_fires_no_post_start(self) -> None:
        self.started_then_stopped(nri.CONTAINER_CREATED)
        self.assertEqual([stage.hook for stage in self.stages.announced], [POST_STOP])  # as a created container's stop
        self.assertIn(("StartContainer", "NOT-CONFIRMED"), self.call_lines())
        self.assertIn("containerd failed the start", self.line("StartContainer")["why"])

    def test_a_call_about_what_the_store_lacks_is_named_in_its_line_as_containerds_events_name_it(self) -> None:
        self.containerd.call("Synchronize", nri.SynchronizeRequest())
        self.containerd.call("StateChange", event(nri.START_CONTAINER, nri_container(nri.CONTAINER_CREATED)))
        self.containerd.call("StopContainer", nri.StopContainerRequest(pod=nri_pod(), container=nri_container(nri.CONTAINER_CREATED)))
        self.assertIn("StartContainer pod default/web (uid-1) container app: NOT-CONFIRMED", formatEvent(self.line("StartContainer")))

    def test_a_container_stopped_before_its_post_start_event_had_started(self) -> None:
        self.started_then_stopped(nri.CONTAINER_STOPPED)
        self.assertEqual([stage.hook for stage in self.stages.announced], [POST_START, POST_STOP])

    def test_the_stop_of_a_pod_the_store_lacks_is_not_read_back_and_fires_no_hooks(self) -> None:
        self.subscribe(HookType.POST_STOP_POD_SANDBOX)
        self.containerd.call("Synchronize", nri.SynchronizeRequest())
        self.containerd.call("StateChange", event(nri.STOP_POD_SANDBOX))
        self.assertEqual((self.stages.ran, self.stages.announced, self.store.sizes()), ([], [], (0, 0)))

    def test_an_update_is_answered_with_the_hooks_changes_and_stored_once_containerd_made_it(self) -> None:
        self.subscribe(HookType.PRE_UPDATE_CONTAINER_RESOURCES)
        self.stages.behaviours[HookType.PRE_UPDATE_CONTAINER_RESOURCES] = lambda request: hook.ContainerResourceHookResponse(
            container_resources=hook.LinuxContainerResources(cpu_shares=512, cpu_quota=25000)
        )
        self.containerd.call("Synchronize", nri.SynchronizeRequest(pods=[nri_pod()], containers=[nri_container(nri.CONTAINER_RUNNING)]))
        resources = nri.LinuxResources()
        resources.cpu.shares.value, resources.cpu.quota.value = 512, 50000
        request = nri.UpdateContainerRequest(pod=nri_pod(), container=nri_container(nri.CONTAINER_RUNNING), linux_resources=resources)
        stream = self.containerd.call("UpdateContainer", request)
        [update] = nri.UpdateContainerResponse.FromString(self.containerd.answers()[stream].payload).update
        self.assertEqual((update.container_id, update.linux.resources.cpu.quota.value, update.linux.resources.cpu.HasField("shares")), ("c-1", 25000, False))
        stored = self.store.container("c-1")
        assert stored is not None
        self.assertEqual(stored.asked.container_resources.cpu_quota, 0)  # not yet: containerd has not said it did it
        self.containerd.call("StateChange", event(nri.POST_UPDATE_CONTAINER, nri_container(nri.CONTAINER_RUNNING)))
        stored = self.store.container("c-1")
        assert stored is not None
        self.assertEqual((stored.asked.container_resources.cpu_quota, stored.given.container_resources.cpu_quota), (50000, 25000))
        self.assertEqual(self.call_lines()[-1], ("UpdateContainerResources", "OK"))

    def test_an_update_superseded_before_its_post_event_is_not_confirmed_and_the_newer_one_is(self) -> None:
        self.subscribe(HookType.PRE_UPDATE_CONTAINER_RESOURCES)
        self.containerd.call("Synchronize", nri.SynchronizeRequest(pods=[nri_pod()], containers=[nri_container(nri.CONTAINER_RUNNING)]))
        for quota in (50000, 25000):
            resources = nri.LinuxResources()
            resources.cpu.quota.value = quota
            update = nri.UpdateContainerRequest(pod=nri_pod(), container=nri_container(nri.CONTAINER_RUNNING), linux_resources=resources)
            self.containerd.call("UpdateContainer", update)
        self.assertEqual(self.call_lines(), [("UpdateContainerResources", "NOT-CONFIRMED")])
        self.containerd.call("StateChange", event(nri.POST_UPDATE_CONTAINER, nri_container(nri.CONTAINER_RUNNING)))
        self.assertEqual(self.call_lines()[-1], ("UpdateContainerResources", "OK"))
        stored = self.store.container("c-1")
        assert stored is not None
        self.assertEqual(stored.asked.container_resources.cpu_quota, 25000)

    def test_a_create_koordrp_cannot_read_goes_on_as_containerd_has_it_with_its_hooks_counted(self) -> None:
        self.subscribe(PRE_CREATE)
        stream = self.containerd.call("CreateContainer", nri.Empty(), payload=b"\xff")
        answer = self.containerd.answers()[stream]
        self.assertEqual((answer.status.code, answer.payload), (0, b""))
        self.assertEqual(self.stages.ran, [])
        self.assertEqual(len(self.logged("cannot read the {method} request")), 1)

    def test_a_create_koordrp_cannot_read_is_refused_if_a_fail_policy_server_must_see_it(self) -> None:
        self.subscribe(PRE_CREATE, policy=FailurePolicy.FAIL)
        stream = self.containerd.call("CreateContainer", nri.Empty(), payload=b"\xff")
        answer = self.containerd.answers()[stream]
        self.assertEqual(answer.status.code, 3)  # INVALID_ARGUMENT, as in the proxy
        self.assertIn("a.json", answer.status.message)
        self.assertEqual(self.call_lines()[-1], ("CreateContainer", "INVALID_ARGUMENT"))

    def test_a_lost_connection_ends_the_calls_waiting_for_containerd(self) -> None:
        self.run_pod()
        self.create()
        self.containerd.protocol.connectionLost(Failure(ConnectionRefusedError()))
        self.assertEqual(self.call_lines()[-1], ("CreateContainer", "CANCELLED"))
        self.assertEqual(self.store.sizes(), (1, 0))

    def test_an_event_koordrp_does_not_know_is_unimplemented(self) -> None:
        stream = self.containerd.call("Reconfigure", nri.Empty())
        self.assertEqual(self.containerd.answers()[stream].status.code, UNIMPLEMENTED)

    def test_a_failure_inside_a_handler_is_answered_unknown_and_said_in_one_line(self) -> None:
        def broken(pod: nri.PodSandbox) -> translate.RunPodSandbox:
            raise RuntimeError("a bug")

        self.patch(translate, "RunPodSandbox", broken)
        self.containerd.answers()  # the registration
        stream = self.containerd.call("StateChange", event(nri.RUN_POD_SANDBOX))
        answer = self.containerd.answers()[stream]
        self.assertEqual((answer.status.code, answer.status.message), (UNKNOWN, "koordrp: StateChange failed: a bug"))
        [line] = self.logged("answered containerd's NRI {method} with UNKNOWN")
        self.assertEqual(line["method"], "StateChange")
        self.assertEqual(line["error"], f"RuntimeError: a bug (in broken, {os.path.basename(__file__)}:{broken.__code__.co_firstlineno + 1})")
        self.assertEqual(self.flushLoggedErrors(), [])


class HandlerTableTests(SynchronousTestCase):
    """What the plugin asks containerd for is what its handlers take, as NRI's Go stub derives it."""

    def test_the_subscription_is_every_event_a_handler_takes(self) -> None:
        events = {handler.event for handler in HANDLERS.values() if handler.event is not None}
        self.assertEqual(EVENT_MASK, sum(1 << (event - 1) for event in events))
        self.assertEqual(subscription(HANDLERS.values()), EVENT_MASK)

    def test_a_handler_taken_out_takes_its_event_out_of_the_subscription(self) -> None:
        for name, handler in HANDLERS.items():
            rest = [other for other_name, other in HANDLERS.items() if other_name != name]
            expected = EVENT_MASK if handler.event is None else EVENT_MASK & ~(1 << (handler.event - 1))
            self.assertEqual(subscription(rest), expected, name)

    def test_each_event_has_one_handler_and_the_calls_every_plugin_gets_subscribe_to_nothing(self) -> None:
        told = [handler.event for handler in HANDLERS.values() if isinstance(handler, EventHandler)]
        self.assertEqual(len(told), len(set(told)))
        requested = {name: handler.event for name, handler in HANDLERS.items() if isinstance(handler, RequestHandler)}
        self.assertEqual(
            requested,
            {
                "Configure": None,
                "Synchronize": None,
                "Shutdown": None,
                "StateChange": None,
                "CreateContainer": nri.CREATE_CONTAINER,
                "UpdateContainer": nri.UPDATE_CONTAINER,
                "StopContainer": nri.STOP_CONTAINER,
            },
        )
        self.assertFalse(set(told) & set(requested.values()))


class LateAnswerTests(LogCapture):
    """A PreCreateContainer answer after containerd's deadline, with the real dispatcher and a server the test
    answers on its clock: containerd goes on without it, then gets its resources through UpdateContainers."""

    SLOW = HookServerConfig("slow.json", "/run/slow.sock", FailurePolicy.IGNORE, frozenset({PRE_CREATE}), 10.0)

    def setUp(self) -> None:
        super().setUp()
        self.clock = Clock()
        self.store = Store()
        self.clients = scripted_clients(self.clock)
        parts = Parts(self.store, Dispatcher(self.clients, self.clock), lambda: HookServers((self.SLOW,)), SKIP, self.clock)
        self.limits: list[PreHookLimit] = []
        self.deadlines: list[str] = []
        self.plugin = NRIPlugin(
            parts,
            PluginIdentity("koordrp", "10"),
            on_synchronized=lambda runtime, deadline: self.deadlines.append(deadline),
            on_configured=self.limits.append,
        )
        self.containerd = FakeContainerd(NRIConnection(self.plugin, self.clock))
        self.containerd.sent()  # the registration
        self.containerd.call("StateChange", event(nri.RUN_POD_SANDBOX))

    def create_past_the_deadline(self) -> PendingCall:
        """A create whose hook call misses containerd's 2 s: containerd is answered without the hook's changes."""
        stream = self.containerd.call("CreateContainer", nri.CreateContainerRequest(pod=nri_pod(), container=nri_container()), timeout=2.0)
        [pending] = calls_to(self.clients, self.SLOW.endpoint)
        self.clock.advance(2.0 - ANSWER_MARGIN)
        answer = self.containerd.answers()[stream]
        self.assertEqual((answer.status.code, nri.CreateContainerResponse.FromString(answer.payload).HasField("adjust")), (0, False))
        return pending

    def late_answer(self, pending: PendingCall) -> None:
        self.clock.advance(0.6)
        pending.answer(
            hook.ContainerResourceHookResponse(
                container_resources=hook.LinuxContainerResources(cpu_shares=512, cpuset_cpus="0-3"),
                container_envs={"LATE": "1"},
                container_annotations={"late": "1"},
            )
        )

    def created(self) -> None:
        self.containerd.call("StateChange", event(nri.POST_CREATE_CONTAINER, nri_container(nri.CONTAINER_CREATED)))

    def update_requested(self) -> tuple[int, nri.UpdateContainersRequest]:
        [sent] = [sent for sent in self.containerd.sent() if sent.request is not None]
        assert sent.request is not None
        self.assertEqual(sent.request.method, "UpdateContainers")
        return sent.stream_id, nri.UpdateContainersRequest.FromString(sent.request.payload)

    def create_line(self) -> str:
        [line] = [e for e in self.events if e.get("log_namespace") == "koordrp.calls" and e["method"] == "CreateContainer"]
        return str(line["hooks"])

    def test_a_late_answers_resources_reach_the_created_container_and_what_cannot_change_is_named(self) -> None:
        pending = self.create_past_the_deadline()
        self.created()
        self.assertEqual(pending.cancelled, [])  # not cut at containerd's deadline
        read_before = self.store.container("c-1")  # what a call holds meanwhile: the store's entry itself
        assert read_before is not None
        self.late_answer(pending)
        stream, request = self.update_requested()
        [update] = request.update
        self.assertEqual((update.container_id, update.linux.resources.cpu.shares.value), ("c-1", 512))
        self.assertFalse(update.linux.resources.cpu.cpus)  # unchanged: not named
        self.assertEqual([e for e in self.events if e.get("method") == "CreateContainer"], [])  # not before the update is answered
        self.containerd.answer(stream, nri.UpdateContainersResponse())
        self.assertEqual(read_before.given.container_resources.cpu_shares, 2)  # replaced, not changed in place
        self.assertEqual(
            self.create_line(),
            "PreCreateContainer@slow.json: late 2500.0 ms (no answer within 1.9s: went on without it, then applied what "
            "could change), changed resources.cpu_shares 2→512, left alone (late) annotations +late, envs +LATE",
        )
        stored = self.store.container("c-1")
        assert stored is not None
        self.assertEqual((stored.asked.container_resources.cpu_shares, stored.given.container_resources.cpu_shares), (2, 512))
        self.assertNotIn("LATE", stored.given.container_envs)

    def test_a_late_answer_changes_in_the_stored_container_only_what_it_sent(self) -> None:
        """kubelet's update between the create and the late answer stays what the store knows: the answer's
        resources are written over the container as the store has it then, and only those the update sent."""
        pending = self.create_past_the_deadline()
        self.created()
        resources = nri.LinuxResources()
        resources.memory.limit.value = 1 << 30
        kubelets = nri.UpdateContainerRequest(pod=nri_pod(), container=nri_container(nri.CONTAINER_CREATED), linux_resources=resources)
        self.containerd.call("UpdateContainer", kubelets)
        self.containerd.call("StateChange", event(nri.POST_UPDATE_CONTAINER, nri_container(nri.CONTAINER_CREATED)))
        self.late_answer(pending)
        stream, _ = self.update_requested()
        self.containerd.answer(stream, nri.UpdateContainersResponse())
        stored = self.store.container("c-1")
        assert stored is not None
        asked, given = stored.asked.container_resources, stored.given.container_resources
        self.assertEqual((asked.memory_limit_in_bytes, given.memory_limit_in_bytes), (1 << 30, 1 << 30))
        self.assertEqual((asked.cpu_shares, given.cpu_shares, given.cpuset_cpus), (2, 512, "0-3"))

    def test_what_a_late_answer_asked_that_the_update_could_not_send_is_not_stored_as_given(self) -> None:
        pending = self.create_past_the_deadline()
        self.created()
        self.clock.advance(0.6)
        # koordlet clears a best-effort pod's cpuset; NRI cannot, nor set an OOM score.
        pending.answer(
            hook.ContainerResourceHookResponse(
                container_resources=hook.LinuxContainerResources(cpu_shares=512, cpuset_cpus="", oom_score_adj=500)
            )
        )
        stream, _ = self.update_requested()
        self.containerd.answer(stream, nri.UpdateContainersResponse())
        self.assertIn('left alone (NRI can set a cpuset but not clear it) resources.cpuset_cpus "0-3"→""', self.create_line())
        stored = self.store.container("c-1")
        assert stored is not None
        given = stored.given.container_resources
        self.assertEqual((given.cpu_shares, given.cpuset_cpus, given.oom_score_adj), (512, "0-3", 0))

    def test_an_answer_that_comes_before_containerd_says_it_created_the_container_waits_for_it(self) -> None:
        self.late_answer(self.create_past_the_deadline())
        self.assertEqual([sent for sent in self.containerd.sent() if sent.request is not None], [])
        self.created()
        self.update_requested()

    def test_a_create_containerd_did_not_make_drops_the_late_call(self) -> None:
        pending = self.create_past_the_deadline()
        self.containerd.call("StateChange", event(nri.REMOVE_CONTAINER, nri_container()))
        self.assertEqual(len(pending.cancelled), 1)
        self.assertIn("PreCreateContainer@slow.json: timeout 1900.0 ms (no answer within 1.9s; went on without it)", self.create_line())

    def test_an_update_containerd_refuses_leaves_it_all_alone_and_says_why(self) -> None:
        pending = self.create_past_the_deadline()
        self.created()
        self.late_answer(pending)
        stream, _ = self.update_requested()
        self.containerd.answer(stream, code=UNKNOWN, error="no such container")
        self.assertIn(
            "then applied what could change), left alone (late, and not applied: containerd refused the update: "
            "no such container) annotations +late, resources.cpu_shares 2→512, envs +LATE",
            self.create_line(),
        )
        stored = self.store.container("c-1")
        assert stored is not None
        self.assertEqual(stored.given.container_resources.cpu_shares, 2)

    def test_a_container_removed_before_the_answer_came_is_left_alone(self) -> None:
        pending = self.create_past_the_deadline()
        self.created()
        self.containerd.call("StopContainer", nri.StopContainerRequest(pod=nri_pod(), container=nri_container(nri.CONTAINER_STOPPED)))
        self.containerd.call("StateChange", event(nri.REMOVE_CONTAINER, nri_container(nri.CONTAINER_STOPPED)))
        self.late_answer(pending)
        self.assertEqual([sent for sent in self.containerd.sent() if sent.request is not None], [])
        self.assertIn("left alone (late, and not applied: the container was removed meanwhile) annotations +late", self.create_line())

    def test_a_server_that_never_answers_ends_at_its_own_timeout(self) -> None:
        self.create_past_the_deadline()
        self.created()
        self.clock.advance(self.SLOW.timeout - (2.0 - ANSWER_MARGIN))
        self.assertIn("timeout 10000.0 ms (no answer within 1.9s, nor later: no answer within 10s; went on without it)", self.create_line())

    def test_containerd_2_says_its_deadline_and_1_7_gives_configure_it(self) -> None:
        self.containerd.call("Configure", nri.ConfigureRequest(runtime_name="containerd", request_timeout=10000), timeout=9.99)
        self.containerd.call("Configure", nri.ConfigureRequest(runtime_name="containerd"), timeout=1.99995)
        self.assertEqual([round(limit.seconds, 3) for limit in self.limits], [10 - ANSWER_MARGIN, 2 - ANSWER_MARGIN])
        self.assertIn("plugin_request_timeout", self.limits[0].source)
        self.containerd.call("Synchronize", nri.SynchronizeRequest())
        self.assertEqual(self.deadlines, ["2s (plugin_request_timeout)"])


class TranslateTests(SynchronousTestCase):
    def test_resources_and_attempt_come_from_nri_as_the_hook_api_has_them(self) -> None:
        container = nri_container()
        container.linux.resources.memory.limit.value = 1 << 30
        container.linux.resources.unified["memory.high"] = "max"
        container.linux.oom_score_adj.value = 1000
        request = translate.container_hook_request(container, POD_PARENT)
        resources = request.container_resources
        self.assertEqual(
            (resources.cpu_shares, resources.cpuset_cpus, resources.memory_limit_in_bytes, dict(resources.unified), resources.oom_score_adj),
            (2, "0-3", 1 << 30, {"memory.high": "max"}, 1000),
        )
        self.assertEqual((request.container_meta.attempt, request.container_meta.id, request.pod_cgroup_parent), (2, "c-1", POD_PARENT))

    def test_a_new_pod_parent_moves_the_containers_cgroups_path_with_either_driver(self) -> None:
        self.assertEqual(translate.moved_cgroups_path("/kubepods/pod1/c-1", "/kubepods/pod1", "/moved"), "/moved/c-1")
        self.assertEqual(
            translate.moved_cgroups_path("kubepods-pod1.slice:cri-containerd:c-1", "kubepods-pod1.slice", "moved.slice"),
            "moved.slice:cri-containerd:c-1",
        )
        self.assertIsNone(translate.moved_cgroups_path("/elsewhere/c-1", "/kubepods/pod1", "/moved"))

    def test_an_adjustment_carries_every_resource_nri_can_set_and_names_a_swap_change_left_alone(self) -> None:
        create = translate.CreateContainer(nri_pod(), nri_container())
        before = create.hook_request()
        after = hook.ContainerResourceHookRequest()
        after.CopyFrom(before)
        resources = after.container_resources
        resources.cpu_period, resources.cpu_quota, resources.memory_limit_in_bytes = 100000, 50000, 1 << 30
        resources.memory_swap_limit_in_bytes, resources.cpuset_mems = 2 << 30, "0"
        resources.unified["memory.high"] = "max"
        resources.hugepage_limits.add(page_size="2MB", limit=1 << 21)
        written = create.rewritten(before, after)
        assert written.request is not None
        sent = nri.CreateContainerResponse.FromString(written.request).adjust.linux.resources
        self.assertEqual(
            (sent.cpu.period.value, sent.cpu.quota.value, sent.memory.limit.value, sent.memory.HasField("swap"), sent.cpu.mems),
            (100000, 50000, 1 << 30, False, "0"),
        )
        self.assertEqual((dict(sent.unified), [(h.page_size, h.limit) for h in sent.hugepage_limits]), ({"memory.high": "max"}, [("2MB", 1 << 21)]))
        self.assertFalse(sent.cpu.HasField("shares") or sent.cpu.cpus)  # unchanged: not named
        self.assertEqual(
            written.left_alone, (adapters.LeftAlone("container_resources.memory_swap_limit_in_bytes", translate.NO_SWAP),)
        )

    def test_an_update_names_only_what_the_hooks_changed_and_leaves_the_rest_named(self) -> None:
        resources = nri.LinuxResources()
        resources.cpu.shares.value = 512
        update = translate.UpdateContainer(nri.Container(id="c-1"), resources)
        before = hook.ContainerResourceHookRequest(container_resources=translate.hook_resources(resources))
        after = hook.ContainerResourceHookRequest()
        after.CopyFrom(before)
        after.container_resources.cpu_quota = 50000
        after.container_annotations["seen"] = "1"
        written = update.rewritten(before, after)
        assert written.request is not None
        [sent] = nri.UpdateContainerResponse.FromString(written.request).update
        self.assertEqual(sent.container_id, "c-1")
        self.assertEqual((sent.linux.resources.cpu.quota.value, sent.linux.resources.cpu.HasField("shares")), (50000, False))
        self.assertIn(adapters.LeftAlone("container_annotations", translate.NOT_IN_AN_UPDATE), written.left_alone)


class ServiceTests(LogCapture):
    def setUp(self) -> None:
        super().setUp()
        self.reactor = MemoryReactorClock()
        self.metrics = Metrics()
        self.stages = ScriptedStages()
        self.store = Store()
        self.parts = Parts(self.store, self.stages, HookServers, SKIP, self.reactor, self.metrics)
        self.state_dir = self.mktemp()
        os.makedirs(self.state_dir)
        settings = NRISettings("/run/nri/nri.sock", PluginIdentity("koordrp", "10"), self.state_dir, grace_period=10.0)
        self.service = NRIService(settings, self.reactor, self.parts)
        self.service.startService()
        self.addCleanup(self.service.stopService)

    def attempt(self) -> Any:
        """The factory of the latest connection attempt."""
        address, factory, _, _ = self.reactor.unixClients[-1]
        self.assertEqual(address, "/run/nri/nri.sock")
        return factory

    def connected(self) -> FakeContainerd:
        return FakeContainerd(self.attempt().buildProtocol(None))

    def synchronized(self) -> FakeContainerd:
        containerd = self.connected()
        containerd.call("Configure", nri.ConfigureRequest(runtime_name="containerd", runtime_version="2.1.9"))
        containerd.call("Synchronize", nri.SynchronizeRequest(pods=[nri_pod()]))
        return containerd

    def failed_attempts(self) -> float | None:
        return self.metrics.registry.get_sample_value("koordrp_failed_attempts_total", {"activity": "nri-registration"})

    def warnings(self) -> list[LogEvent]:
        return [event for event in self.events if event["log_level"] >= LogLevel.warn]

    def test_a_socket_that_is_not_there_is_one_warning_and_tries_that_back_off_to_a_few_seconds(self) -> None:
        waits = []
        for tries in range(1, 7):
            self.assertEqual(len(self.reactor.unixClients), tries)
            self.attempt().clientConnectionFailed(None, Failure(ConnectionRefusedError("no such file")))
            [retry] = self.reactor.getDelayedCalls()
            waits.append(retry.getTime() - self.reactor.seconds())
            self.reactor.advance(waits[-1])
        self.assertEqual(waits, [RETRY_SECONDS, 2 * RETRY_SECONDS, 4 * RETRY_SECONDS, CONNECT_RETRY_CAP_SECONDS, CONNECT_RETRY_CAP_SECONDS, CONNECT_RETRY_CAP_SECONDS])
        [warning] = self.warnings()
        self.assertIn("cannot connect", warning["problem"])
        self.assertEqual(self.failed_attempts(), 6)
        self.failureResultOf(self.service.probe())

    def test_a_refusal_every_time_is_one_line_and_its_tries_back_off_to_the_cap(self) -> None:
        waits = []
        for _ in range(8):
            containerd = self.connected()
            containerd.answer(1, code=3, error='plugin "10-koordrp" already connected')
            self.assertTrue(containerd.transport.disconnecting)
            containerd.protocol.connectionLost(Failure(ConnectionDone()))
            [retry] = self.reactor.getDelayedCalls()
            waits.append(retry.getTime() - self.reactor.seconds())
            self.reactor.advance(waits[-1])
        self.assertEqual(waits, [1.0, 2.0, 4.0, 8.0, 16.0, RETRY_CAP_SECONDS, RETRY_CAP_SECONDS, RETRY_CAP_SECONDS])
        [error] = self.warnings()
        self.assertEqual(error["log_level"], LogLevel.error)
        self.assertIn("already connected", error["problem"])
        self.assertEqual(self.failed_attempts(), 8)
        # Then containerd takes it: one line says the trouble is over, and the next trouble starts afresh.
        self.synchronized()
        self.successResultOf(self.service.probe())
        [over] = self.logged("again, after {failures} failed attempts")
        self.assertEqual(over["failures"], 8)
        self.assertEqual(len(self.logged("registered with {runtime}'s NRI")), 1)

    def test_once_synchronized_it_is_healthy_and_a_lost_connection_is_tried_again(self) -> None:
        containerd = self.connected()
        self.failureResultOf(self.service.probe())
        containerd.call("Configure", nri.ConfigureRequest(runtime_name="containerd", runtime_version="1.7.24"))
        containerd.call("Synchronize", nri.SynchronizeRequest())
        self.successResultOf(self.service.probe())
        said = registration.read(self.state_dir)
        assert said is not None
        self.assertEqual((said.plugin, said.runtime, said.pid), ("10-koordrp", "containerd 1.7.24", os.getpid()))
        self.assertEqual(self.logged("registered with {runtime}'s NRI")[0]["plugin"], "10-koordrp")
        containerd.protocol.connectionLost(Failure(ConnectionRefusedError("containerd restarted")))
        self.failureResultOf(self.service.probe())
        self.assertIsNone(registration.read(self.state_dir))
        self.reactor.advance(RETRY_SECONDS)
        self.assertEqual(len(self.reactor.unixClients), 2)
        [warning] = self.warnings()
        self.assertIn("the connection was lost", warning["problem"])

    def test_stopping_says_koordrp_is_no_longer_registered_and_tries_no_more(self) -> None:
        containerd = self.connected()
        containerd.call("Synchronize", nri.SynchronizeRequest())
        self.assertIsNotNone(registration.read(self.state_dir))
        self.successResultOf(self.service.stopService())
        self.assertIsNone(registration.read(self.state_dir))
        self.assertTrue(containerd.transport.disconnecting)
        containerd.protocol.connectionLost(Failure(ConnectionRefusedError("closed")))
        self.assertEqual((self.reactor.getDelayedCalls(), len(self.reactor.unixClients)), ([], 1))

    def test_stopping_keeps_koordrp_registered_while_calls_in_flight_end_then_drains_post_hooks(self) -> None:
        containerd = self.synchronized()
        containerd.call("CreateContainer", nri.CreateContainerRequest(pod=nri_pod(), container=nri_container()))
        stopped = self.service.stopService()
        self.assertNoResult(stopped)
        self.assertFalse(containerd.transport.disconnecting)
        self.assertIsNotNone(registration.read(self.state_dir))
        # A pod created meanwhile still reaches koordrp, and containerd's confirmation ends the one in flight.
        answered = containerd.call("StateChange", event(nri.RUN_POD_SANDBOX))
        self.assertEqual(containerd.answers()[answered].status.code, 0)
        containerd.call("StateChange", event(nri.POST_CREATE_CONTAINER, nri_container(nri.CONTAINER_CREATED)))
        self.successResultOf(stopped)
        self.assertEqual(self.stages.drains, [10.0])
        self.assertTrue(containerd.transport.disconnecting)
        self.assertIsNone(registration.read(self.state_dir))

    def test_stopping_ends_within_its_bound_whatever_is_in_flight(self) -> None:
        containerd = self.synchronized()
        containerd.call("CreateContainer", nri.CreateContainerRequest(pod=nri_pod(), container=nri_container()))
        stopped = self.service.stopService()
        self.reactor.advance(4.0)
        self.assertNoResult(stopped)
        self.reactor.advance(6.0)
        self.successResultOf(stopped)
        self.assertEqual(self.stages.drains, [0.0])  # nothing left of the bound for post hooks
        self.assertTrue(containerd.transport.disconnecting)
        [waiting] = self.logged("of containerd's NRI calls in flight")
        self.assertEqual((waiting["count"], waiting["timeout"]), (1, 10.0))


class CatchUpTests(LogCapture):
    """What containerd made while koordrp was away gets the pre hooks it missed at Synchronize, with the real
    dispatcher, a state directory and a server the test answers on its clock."""

    CATCHING = frozenset({HookType.PRE_RUN_POD_SANDBOX, PRE_CREATE, HookType.PRE_START_CONTAINER, POST_START})

    def setUp(self) -> None:
        super().setUp()
        self.clock = Clock()
        self.directory = self.mktemp()
        self.checkpoint = DirectoryCheckpoint(self.directory)
        self.checkpoint.open()
        self.owed: list[OwedStops] = []
        self.store = Store(self.checkpoint, self.owed.append)
        self.clients = scripted_clients(self.clock)
        self.policy = FailurePolicy.IGNORE
        self.metrics = Metrics()
        parts = Parts(self.store, Dispatcher(self.clients, self.clock), self.servers, SKIP, self.clock, self.metrics)
        self.plugin = NRIPlugin(parts, PluginIdentity("koordrp", "10"))
        self.containerd = FakeContainerd(NRIConnection(self.plugin, self.clock))
        self.containerd.sent()  # the registration

    def servers(self) -> HookServers:
        return HookServers((HookServerConfig("tuner.json", "/run/tuner.sock", self.policy, self.CATCHING, 10.0),))

    def synchronize(self) -> int:
        request = nri.SynchronizeRequest(pods=[nri_pod()], containers=[nri_container(nri.CONTAINER_RUNNING)])
        return self.containerd.call("Synchronize", request, timeout=2.0)

    def create_asked(self) -> PendingCall:
        """The pod's PreRunPodSandbox answered: the container's PreCreateContainer, asked and not answered yet."""
        [pod_call] = calls_to(self.clients, "/run/tuner.sock")
        self.answer_all([pod_call])
        [_, create] = calls_to(self.clients, "/run/tuner.sock")
        return create

    def reply_left(self, stream: int) -> nri.SynchronizeResponse:
        """containerd's deadline (less what koordrp keeps to answer) comes: the reply leaves, a success."""
        self.clock.advance(2.0 - ANSWER_MARGIN - CATCH_UP_REPLY_SLACK)
        answer = self.containerd.answers()[stream]
        self.assertEqual(answer.status.code, 0)
        return nri.SynchronizeResponse.FromString(answer.payload)

    def answer_all(self, calls: list[PendingCall]) -> None:
        for pending in calls:
            if pending.hook is HookType.PRE_RUN_POD_SANDBOX:
                pending.answer(hook.PodSandboxHookResponse(cgroup_parent="/elsewhere"))
            else:
                pending.answer(
                    hook.ContainerResourceHookResponse(
                        container_resources=hook.LinuxContainerResources(cpu_shares=512), container_envs={"HOOKED": "1"}
                    )
                )

    def catch_up(self) -> list[PendingCall]:
        """Answers each pre hook as it comes, in order; the calls made."""
        for _ in range(3):
            self.answer_all([call for call in calls_to(self.clients, "/run/tuner.sock") if not call.answered.called])
        return calls_to(self.clients, "/run/tuner.sock")

    def test_each_missed_pre_hook_is_called_in_order_marked_and_the_resources_go_back_in_the_reply(self) -> None:
        stream = self.synchronize()
        calls = self.catch_up()
        self.assertEqual(
            [call.hook for call in calls],
            [HookType.PRE_RUN_POD_SANDBOX, PRE_CREATE, HookType.PRE_START_CONTAINER, POST_START],
        )
        marks = [
            (call.request.annotations if isinstance(call.request, PodHookRequest) else call.request.container_annotations)
            for call in calls
        ]
        self.assertEqual([mark.get(CATCH_UP_ANNOTATION) for mark in marks], ["true"] * 4)
        answer = self.containerd.answers()[stream]
        self.assertEqual(answer.status.code, 0, answer.status.message)
        [update] = nri.SynchronizeResponse.FromString(answer.payload).update
        self.assertEqual((update.container_id, update.linux.resources.cpu.shares.value), ("c-1", 512))
        stored = self.store.container("c-1")
        assert stored is not None
        self.assertTrue(stored.hooked)
        self.assertEqual(stored.asked.container_resources.cpu_shares, 2)  # what containerd had: kubelet's, as far as known
        self.assertNotIn(CATCH_UP_ANNOTATION, stored.asked.container_annotations)
        self.assertNotIn(CATCH_UP_ANNOTATION, stored.given.container_annotations)
        [line] = [e for e in self.events if e.get("log_namespace") == "koordrp.calls" and e["method"] == "CreateContainer (catch-up)"]
        self.assertIn("changed resources.cpu_shares 2→512, ", line["hooks"])
        self.assertIn("left alone (late) envs +HOOKED", line["hooks"])
        self.assertEqual(self.metrics.caught_up.labels("container")._value.get(), 1)

    def test_what_koordrp_saw_made_is_not_caught_up_again(self) -> None:
        self.catch_up_once()
        reopened = DirectoryCheckpoint(self.directory)  # what the state directory holds, read again
        reopened.open()
        restarted = Store(reopened)
        parts = Parts(restarted, Dispatcher(self.clients, self.clock), self.servers, SKIP, self.clock)
        containerd = FakeContainerd(NRIConnection(NRIPlugin(parts, PluginIdentity("koordrp", "10")), self.clock))
        stream = containerd.call("Synchronize", nri.SynchronizeRequest(pods=[nri_pod()], containers=[nri_container(nri.CONTAINER_RUNNING)]))
        self.assertEqual(containerd.answers()[stream].status.code, 0)
        self.assertEqual(len(calls_to(self.clients, "/run/tuner.sock")), 4)

    def catch_up_once(self) -> None:
        stream = self.synchronize()
        self.catch_up()
        self.assertEqual(self.containerd.answers()[stream].status.code, 0)

    def test_an_answer_that_misses_the_reply_follows_it_as_an_update(self) -> None:
        stream = self.synchronize()
        create = self.create_asked()
        self.assertEqual(list(self.reply_left(stream).update), [])
        self.answer_all([create])
        [sent] = [sent for sent in self.containerd.sent() if sent.request is not None]
        assert sent.request is not None
        self.assertEqual(sent.request.method, "UpdateContainers")
        [update] = nri.UpdateContainersRequest.FromString(sent.request.payload).update
        self.assertEqual(update.linux.resources.cpu.shares.value, 512)

    def test_a_fail_policy_server_that_cannot_be_heard_is_one_warning_and_refuses_nothing(self) -> None:
        self.policy = FailurePolicy.FAIL
        stream = self.synchronize()
        [pod_call] = calls_to(self.clients, "/run/tuner.sock")
        pod_call.answered.errback(RuntimeError("down"))
        self.catch_up()
        answer = self.containerd.answers()[stream]
        self.assertEqual(answer.status.code, 0, answer.status.message)
        [warning] = self.logged("was not heard at the catch-up")
        self.assertEqual((warning["server"], warning["hook"], warning["subject"]), ("tuner.json", "PreRunPodSandbox", "pod default/web"))
        self.assertEqual(self.metrics.catch_up_unheard.labels("tuner.json")._value.get(), 1)
        self.assertTrue(self.store.container("c-1").hooked)  # type: ignore[union-attr]

    def test_a_stopped_container_is_not_caught_up_and_owes_no_post_stop(self) -> None:
        request = nri.SynchronizeRequest(pods=[nri_pod()], containers=[nri_container(nri.CONTAINER_STOPPED)])
        stream = self.containerd.call("Synchronize", request, timeout=2.0)
        self.answer_all(calls_to(self.clients, "/run/tuner.sock"))
        self.assertEqual(self.containerd.answers()[stream].status.code, 0)
        self.assertEqual([call.hook for call in calls_to(self.clients, "/run/tuner.sock")], [HookType.PRE_RUN_POD_SANDBOX])
        self.containerd.call("StateChange", event(nri.REMOVE_POD_SANDBOX))
        self.assertEqual([stops.containers for stops in self.owed], [])  # its stop is not told: it was not caught up
        self.assertEqual(os.listdir(os.path.join(self.directory, "containers")), [])

    def test_a_split_synchronization_is_caught_up_as_one_in_its_last_reply(self) -> None:
        first = self.containerd.call("Synchronize", nri.SynchronizeRequest(pods=[nri_pod()], more=True), timeout=2.0)
        answer = self.containerd.answers()[first]
        self.assertEqual(nri.SynchronizeResponse.FromString(answer.payload), nri.SynchronizeResponse(more=True))
        self.assertEqual(calls_to(self.clients, "/run/tuner.sock"), [])  # nothing before the whole is known
        last = self.containerd.call("Synchronize", nri.SynchronizeRequest(containers=[nri_container(nri.CONTAINER_RUNNING)]))
        self.assertEqual(len(self.catch_up()), 4)
        [update] = nri.SynchronizeResponse.FromString(self.containerd.answers()[last].payload).update
        self.assertEqual(update.container_id, "c-1")

    def test_a_container_stopped_and_removed_while_its_hooks_answer_stays_gone(self) -> None:
        stream = self.synchronize()
        create = self.create_asked()
        self.reply_left(stream)
        self.containerd.call("StopContainer", nri.StopContainerRequest(pod=nri_pod(), container=nri_container(nri.CONTAINER_STOPPED)))
        self.containerd.call("StateChange", event(nri.REMOVE_CONTAINER, nri_container(nri.CONTAINER_STOPPED)))
        create.answer(hook.ContainerResourceHookResponse())
        self.assertIsNone(self.store.container("c-1"))
        self.assertEqual(os.listdir(os.path.join(self.directory, "containers")), [])
        self.assertEqual(len(calls_to(self.clients, "/run/tuner.sock")), 2)  # no PreStartContainer for it
        [line] = [e for e in self.events if e.get("log_namespace") == "koordrp.calls" and e["method"] == "CreateContainer (catch-up)"]
        self.assertEqual((line["outcome"], line["why"]), ("NOT-CONFIRMED", "containerd stopped or removed it meanwhile"))

    def test_a_second_synchronization_while_a_container_is_caught_up_calls_its_hooks_once(self) -> None:
        self.synchronize()
        create = self.create_asked()
        # containerd reconnects (a new connection's plugin, the same store) before the hook answers
        parts = Parts(self.store, Dispatcher(self.clients, self.clock), self.servers, SKIP, self.clock)
        plugin = NRIPlugin(parts, PluginIdentity("koordrp", "10"), catching_up=self.plugin._catching_up)
        again = FakeContainerd(NRIConnection(plugin, self.clock))
        stream = again.call("Synchronize", nri.SynchronizeRequest(pods=[nri_pod()], containers=[nri_container(nri.CONTAINER_RUNNING)]))
        self.assertEqual(again.answers()[stream].status.code, 0)
        self.assertEqual(len(calls_to(self.clients, "/run/tuner.sock")), 2)
        self.answer_all([create])

    def test_updates_of_a_reply_that_came_too_late_are_caught_up_again(self) -> None:
        """A reactor too busy to reply by the deadline: containerd never took the updates."""
        stream = self.synchronize()
        self.catch_up_in_time_but_reply_late()
        self.assertNotEqual(self.containerd.answers()[stream].status.code, 0)
        stored = self.store.container("c-1")
        assert stored is not None
        self.assertFalse(stored.hooked)
        self.assertEqual(os.listdir(os.path.join(self.directory, "containers")), [])

    def catch_up_in_time_but_reply_late(self) -> None:
        create = self.create_asked()
        self.answer_all([create])  # the update goes in the reply, the start is still asked
        self.clock.advance(1.95)  # the reply's timer runs this late

    def test_an_update_containerd_refuses_after_the_reply_is_named_and_caught_up_again(self) -> None:
        stream = self.synchronize()
        create = self.create_asked()
        self.reply_left(stream)
        self.answer_all([create])
        [sent] = [sent for sent in self.containerd.sent() if sent.request is not None]
        self.containerd.answer(sent.stream_id, nri.UpdateContainersResponse(failed=[nri.ContainerUpdate(container_id="c-1")]))
        self.assertFalse(self.store.container("c-1").hooked)  # type: ignore[union-attr]
        [line] = [e for e in self.events if e.get("log_namespace") == "koordrp.calls" and e["method"] == "CreateContainer (catch-up)"]
        self.assertEqual(line["outcome"], "NOT-CONFIRMED")
        self.assertIn("left alone (late, and not applied) resources.cpu_shares 2→512", line["hooks"])


BIG_ANNOTATION = 4_192_000
"""The answer that made containerd 2.1 take an adjustment, then fail the container's start (message length 4195702)."""


def bulky_container(args: int) -> nri.Container:
    """nri_container() with ``args`` bytes of arguments: what a hook request does not show, but containerd's messages carry."""
    container = nri_container()
    container.args.append("a" * args)
    return container


class AnswerSizeTests(LogCapture):
    """NRI mode: what koordrp answers containerd keeps every message containerd then sends about the container
    within ttrpc's 4 MiB, and an answer koordrp refuses (koordrp.hooks.validation) never reaches containerd.
    The real dispatcher, with a scripted server on the test's clock."""

    TUNER = "/run/koordrp-test/tuner.sock"

    def setUp(self) -> None:
        super().setUp()
        self.clock = Clock()
        self.store = Store()
        self.clients = scripted_clients(self.clock)
        self.policy = FailurePolicy.IGNORE
        servers = lambda: HookServers((HookServerConfig("tuner.json", self.TUNER, self.policy, frozenset({PRE_CREATE}), 10.0),))
        parts = Parts(self.store, Dispatcher(self.clients, self.clock), servers, SKIP, self.clock)
        self.plugin = NRIPlugin(parts, PluginIdentity("koordrp", "10"))
        self.containerd = FakeContainerd(NRIConnection(self.plugin, self.clock))
        self.containerd.sent()  # the registration
        self.containerd.call("StateChange", event(nri.RUN_POD_SANDBOX))

    def create(self, container: nri.Container, answer: hook.ContainerResourceHookResponse) -> ttrpc_pb2.Response:
        stream = self.containerd.call("CreateContainer", nri.CreateContainerRequest(pod=nri_pod(), container=container), timeout=2.0)
        [pending] = calls_to(self.clients, self.TUNER)
        pending.answer(answer)
        return self.containerd.answers()[stream]

    def line(self) -> str:
        self.containerd.call("StateChange", event(nri.POST_CREATE_CONTAINER, nri_container(nri.CONTAINER_CREATED)))
        [line] = [e for e in self.events if e.get("log_namespace") == "koordrp.calls" and e["method"] == "CreateContainer"]
        return str(line["hooks"])

    def test_an_annotation_just_under_ttrpcs_limit_is_refused_and_the_rest_of_the_answer_applies(self) -> None:
        answer = hook.ContainerResourceHookResponse(
            container_annotations={"koordrp.test/big": "x" * BIG_ANNOTATION, "koordrp.test/small": "1"},
            container_resources=hook.LinuxContainerResources(cpu_shares=512),
        )
        sent = self.create(nri_container(), answer)
        self.assertEqual(sent.status.code, 0, sent.status.message)
        adjust = nri.CreateContainerResponse.FromString(sent.payload).adjust
        self.assertEqual((dict(adjust.annotations), adjust.linux.resources.cpu.shares.value), ({"koordrp.test/small": "1"}, 512))
        line = self.line()
        self.assertIn(
            f"refused annotations[koordrp.test/big]: {BIG_ANNOTATION + 16} bytes, beyond the 262144 one answer may change in a map", line
        )
        self.assertLess(len(line), 1000)

    def test_with_the_fail_policy_containerds_create_fails_naming_the_server_and_the_field(self) -> None:
        self.policy = FailurePolicy.FAIL
        answer = hook.ContainerResourceHookResponse(container_resources=hook.LinuxContainerResources(cpuset_cpus="abc"))
        sent = self.create(nri_container(), answer)
        self.assertEqual(sent.status.code, UNKNOWN)
        self.assertEqual(
            sent.status.message,
            f'koordrp: hook server tuner.json ({self.TUNER}) failed PreCreateContainer: refused resources.cpuset_cpus "abc": not a cpu list',
        )

    def test_an_adjustment_that_would_not_leave_the_container_within_ttrpcs_limit_is_not_sent(self) -> None:
        """A container whose arguments (which hooks are not shown) fill most of a message: an answer within every
        rule would still take containerd's messages about it past 4 MiB."""
        container = bulky_container(MAX_TTRPC_MESSAGE - 300_000)
        answer = hook.ContainerResourceHookResponse(
            container_annotations={"koordrp.test/big": "x" * 200_000},
            container_envs={"GROWN": "y" * 100_000},
            container_resources=hook.LinuxContainerResources(cpu_shares=512),
        )
        sent = self.create(container, answer)
        self.assertEqual(sent.status.code, 0, sent.status.message)
        adjust = nri.CreateContainerResponse.FromString(sent.payload).adjust
        self.assertEqual((dict(adjust.annotations), list(adjust.env), adjust.linux.resources.cpu.shares.value), ({}, [], 512))
        line = self.line()
        self.assertIn(f"changed resources.cpu_shares 2→512, left alone ({translate.NOT_CARRIED}) annotations +koordrp.test/big, envs +GROWN", line)
        stored = self.store.container("c-1")
        assert stored is not None
        self.assertNotIn("GROWN", stored.given.container_envs)  # the store has what containerd was given

    def test_the_rule_weighs_the_container_as_containerd_would_make_it(self) -> None:
        """The adjustment containerd 2.1 took, then could not start (4195702 bytes), as the translation alone sees it:
        a container as containerd tells of one carries some 3.7 KB besides (mounts, arguments, its own annotations)."""
        create = translate.CreateContainer(nri_pod(), bulky_container(3700))
        before = create.hook_request()
        after = hook.ContainerResourceHookRequest()
        after.CopyFrom(before)
        after.container_annotations["koordrp.test/big"] = "x" * BIG_ANNOTATION
        after.container_envs["SMALL"] = "1"
        after.container_resources.cpu_shares = 512
        written = create.rewritten(before, after)
        assert written.request is not None
        adjust = nri.CreateContainerResponse.FromString(written.request).adjust
        self.assertEqual((dict(adjust.annotations), list(adjust.env), adjust.linux.resources.cpu.shares.value), ({}, [], 512))
        self.assertEqual(
            written.left_alone[-2:],
            (adapters.LeftAlone("container_annotations", translate.NOT_CARRIED), adapters.LeftAlone("container_envs", translate.NOT_CARRIED)),
        )
        self.assertEqual(create.envs_sent(), {"A": "1"})
        # Just within: sent, and every message about the container as made stays within ttrpc's limit.
        create = translate.CreateContainer(nri_pod(), nri_container())
        grown = nri_container()
        room = MAX_TTRPC_MESSAGE - translate.told_size(nri_pod(), grown) - 64
        after.container_annotations["koordrp.test/big"] = "x" * room
        written = create.rewritten(before, after)
        assert written.request is not None
        adjust = nri.CreateContainerResponse.FromString(written.request).adjust
        self.assertEqual((len(adjust.annotations["koordrp.test/big"]), written.left_alone), (room, ()))
        grown.annotations.update(adjust.annotations)
        grown.env.append("SMALL=1")
        grown.linux.resources.cpu.shares.value = 512
        self.assertLessEqual(translate.told_size(nri_pod(), grown), MAX_TTRPC_MESSAGE)
        self.assertLessEqual(nri.StateChangeEvent(event=nri.POST_CREATE_CONTAINER, pod=nri_pod(), container=grown).ByteSize(), MAX_TTRPC_MESSAGE)


class KeptFirstTests(LogCapture):
    """What kubelet asked is kept under the id containerd gives, before containerd is answered: a koordrp killed
    just after its answer still has it, and nothing goes through a pending file."""

    def setUp(self) -> None:
        super().setUp()
        self.clock = Clock()
        self.directory = self.mktemp()
        self.kept_when: list[tuple[str, str, int]] = []
        """Each state file written: its kind, its id, and how many bytes koordrp had sent containerd then."""
        kept_when = self.kept_when
        sent = self.sent_bytes

        class Watched(DirectoryCheckpoint):
            def write(self, kind: Kind, identifier: str, data: bytes | None) -> bool:
                kept_when.append((kind, identifier, sent()))
                return super().write(kind, identifier, data)

        checkpoint = Watched(self.directory)
        checkpoint.open()
        self.store = Store(checkpoint)
        parts = Parts(self.store, ScriptedStages(), HookServers, SKIP, self.clock)
        self.containerd = FakeContainerd(NRIConnection(NRIPlugin(parts, PluginIdentity("koordrp", "10")), self.clock))
        self.containerd.answers()  # the registration

    def sent_bytes(self) -> int:
        return len(self.containerd.transport.value())

    def test_the_pods_and_containers_files_are_written_once_before_containerd_is_answered(self) -> None:
        before_run = self.sent_bytes()
        self.containerd.call("StateChange", event(nri.RUN_POD_SANDBOX))
        before_create = self.sent_bytes()
        self.containerd.call("CreateContainer", nri.CreateContainerRequest(pod=nri_pod(), container=nri_container()))
        self.containerd.call("StateChange", event(nri.POST_CREATE_CONTAINER, nri_container(nri.CONTAINER_CREATED)))
        written = [write for write in self.kept_when if write[0] != "pending"]
        self.assertEqual(written, [("pods", "s-1", before_run), ("containers", "c-1", before_create)])
        self.assertEqual(os.listdir(os.path.join(self.directory, "pending")), [])
        self.assertTrue(self.store.container("c-1").hooked)  # type: ignore[union-attr]

    def test_a_create_containerd_undid_leaves_nothing_kept(self) -> None:
        self.containerd.call("StateChange", event(nri.RUN_POD_SANDBOX))
        self.containerd.call("CreateContainer", nri.CreateContainerRequest(pod=nri_pod(), container=nri_container()))
        self.containerd.call("StopContainer", nri.StopContainerRequest(pod=nri_pod(), container=nri_container(nri.CONTAINER_CREATED)))
        self.assertIsNone(self.store.container("c-1"))
        self.assertEqual(os.listdir(os.path.join(self.directory, "containers")), [])
