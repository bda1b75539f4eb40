"""Intercepted lifecycle calls on real grpc servers: a stand-in CRI backend and a real hook server."""

import os
import threading
from concurrent import futures
from typing import Any, Callable, cast

import grpc
from cri_api.v1 import api_pb2 as kubelets
from twisted.internet import reactor
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.interfaces import IReactorFromThreads
from twisted.internet.threads import deferToThread
from twisted.logger import ILogObserver, LogEvent, globalLogPublisher
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase, TestCase

from koordrp.api.cri.v1 import api_pb2 as cri
from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from koordrp.cri import translate
from koordrp.cri.backend import Answer, BackendChannel
from koordrp import adapters, flows
from koordrp.cri.handoff import Later
from koordrp.cri.intercept import _METHODS, CRIReply, Interceptor, _Exchange
from koordrp.cri.methods import BackendRole
from koordrp.cri.passthrough import PassThroughHandler
from koordrp.cri.runtime_lookup import RuntimeLookup
from koordrp.call import Call, Parts, SkipLabel
from koordrp.hooks.client import HookClients
from koordrp.hooks.dispatcher import Dispatcher
from koordrp.hooks.messages import ContainerHookRequest, PodHookRequest
from koordrp.hooks.types import FailurePolicy, HookServerConfig, HookServers, HookType
from koordrp.store import ContainerState, Store
from koordrp.unix import grpc_target
from tests.fake.cri_backend import FakeCRIBackend
from tests.fake.flows import RecordingRuntime, Reply, ScriptedStages
from tests.fake.hook_server import FakeHookServer
from tests.support.tempdirs import short_tempdir
from tests.support.waiting import until

CREATE = "/runtime.v1.RuntimeService/CreateContainer"
STOP = "/runtime.v1.RuntimeService/StopContainer"
# Field 111 (varint 1): in no CRI stub, as a field newer than koordrp's would be.
UNKNOWN_FIELD = b"\xf8\x06\x01"


def create_request_bytes() -> bytes:
    config = cri.ContainerConfig(
        metadata=cri.ContainerMetadata(name="app"), envs=[cri.KeyValue(key="A", value=b"1")]
    ).SerializeToString()
    config += UNKNOWN_FIELD
    prefix = cri.CreateContainerRequest(pod_sandbox_id="sandbox-1").SerializeToString()
    return prefix + b"\x12" + bytes([len(config)]) + config


def call_lines(case: SynchronousTestCase) -> list[LogEvent]:
    """The call lines logged from now until ``case`` ends."""
    lines: list[LogEvent] = []

    def observe(event: LogEvent) -> None:
        if event.get("log_namespace") == "koordrp.calls":
            lines.append(event)

    observer = cast(ILogObserver, observe)
    globalLogPublisher.addObserver(observer)
    case.addCleanup(globalLogPublisher.removeObserver, observer)
    return lines


class InterceptTests(TestCase):
    def setUp(self) -> None:
        directory = short_tempdir(self)
        self.backend = FakeCRIBackend(os.path.join(directory, "cri.sock")).start()
        self.addCleanup(self.backend.stop)
        self.hook_server = FakeHookServer(os.path.join(directory, "hook.sock")).start()
        self.addCleanup(self.hook_server.stop)
        self.hook_server.behaviours["PreCreateContainerHook"] = lambda request: hook.ContainerResourceHookResponse(
            container_envs={"HOOKED": "1"}
        )
        self.store = Store()
        pod = translate.pod_hook_request(
            cri.RunPodSandboxRequest(config=cri.PodSandboxConfig(metadata=cri.PodSandboxMetadata(name="p", uid="u")))
        )
        self.store.put_pod("sandbox-1", pod, pod)
        servers = HookServers(
            (HookServerConfig("hook.json", self.hook_server.path, FailurePolicy.FAIL, frozenset(HookType), 2.0),)
        )
        clients = HookClients(reactor)
        self.addCleanup(clients.close_all)
        dispatcher = Dispatcher(clients, reactor)
        parts = Parts(self.store, dispatcher, lambda: servers, SkipLabel("skip", "true"), reactor)
        channel = BackendChannel(self.backend.path, lambda change, path: None)
        self.addCleanup(channel.close)
        threads = IReactorFromThreads(reactor)
        later = Later.on(threads, 0.001)
        self.addCleanup(later.close)
        lookup = RuntimeLookup(threads, channel.channel)
        interceptor = Interceptor(threads, channel, parts, lookup, later.queue)
        handler = PassThroughHandler({BackendRole.RUNTIME: channel, BackendRole.IMAGE: channel}, interceptor.handlers)
        # One worker: a call that held it after its caller gave up would keep every other call waiting.
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=1), handlers=[handler])
        listen = os.path.join(directory, "proxy.sock")
        server.add_insecure_port(grpc_target(listen))
        server.start()
        self.addCleanup(lambda: server.stop(0).wait())
        self.client = grpc.insecure_channel(grpc_target(listen))
        self.addCleanup(self.client.close)

    def call(self, method: str, request: bytes) -> bytes:
        return bytes(self.client.unary_unary(method, request_serializer=None, response_deserializer=None)(request, timeout=10))

    @inlineCallbacks
    def test_hook_changes_reach_the_runtime_with_fields_newer_than_the_stubs(self):  # type: ignore[no-untyped-def]
        response = yield self.call_to_its_end(CREATE, create_request_bytes())
        self.assertEqual(cri.CreateContainerResponse.FromString(response).container_id, "created-1")
        received = [c for c in self.backend.calls if c.method == CREATE][-1].request
        config = cri.CreateContainerRequest.FromString(received).config
        self.assertEqual([(e.key, e.value) for e in config.envs], [("A", b"1"), ("HOOKED", b"1")])
        self.assertIn(UNKNOWN_FIELD, config.SerializeToString())
        stored = self.store.container("created-1")
        assert stored is not None
        self.assertEqual((stored.sandbox_id, dict(stored.given.container_envs)), ("sandbox-1", {"A": "1", "HOOKED": "1"}))
        self.assertEqual(dict(stored.asked.container_envs), {"A": "1"})
        self.assertEqual(self.hook_server.calls("PreCreateContainerHook")[0].pod_meta.uid, "u")

    @inlineCallbacks
    def test_kubelet_has_the_runtimes_answer_while_the_reactor_is_busy(self):  # type: ignore[no-untyped-def]
        # The runtime's answer to the forward is kubelet's: the worker has it from grpc's thread and hands it
        # to the reactor (its bookkeeping follows), not once the reactor got round to it.
        answered = threading.Event()
        held: list[bool] = []

        def hold_the_reactor() -> None:
            held.append(answered.wait(timeout=30))

        def runtime_answers(method: str) -> None:
            if method == CREATE:
                cast(IReactorFromThreads, reactor).callFromThread(hold_the_reactor)

        self.backend.before_answering = runtime_answers

        def create() -> bytes:
            try:
                return self.call(CREATE, create_request_bytes())
            finally:
                answered.set()

        lines = call_lines(self)
        response = yield deferToThread(create)
        self.assertEqual(cri.CreateContainerResponse.FromString(response).container_id, "created-1")
        self.assertEqual(held, [True])
        yield self.wait_for(lines, 1)  # then the reactor did the rest, once the RPC had ended
        self.assertIsNotNone(self.store.container("created-1"))

    @inlineCallbacks
    def test_bytes_a_fail_policy_pre_hook_must_see_but_cannot_be_read_are_invalid_argument(self):  # type: ignore[no-untyped-def]
        for method in ("CreateContainer", "RunPodSandbox", "StartContainer"):
            with self.assertRaises(grpc.RpcError) as error:
                yield deferToThread(self.call, "/runtime.v1.RuntimeService/" + method, b"\xff\xff\xff")
            self.assertEqual(error.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn(f"cannot read the {method} request", error.exception.details())
            self.assertIn("hook.json (Fail policy)", error.exception.details())
        self.assertEqual((self.hook_server.rpcs(), self.backend.calls), ([], []))

    @inlineCallbacks
    def test_bytes_that_cannot_be_read_otherwise_reach_the_runtime_as_they_came(self):  # type: ignore[no-untyped-def]
        stop = "/runtime.v1.RuntimeService/StopPodSandbox"  # post hooks only: no Fail policy applies
        answer = yield deferToThread(self.call, stop, b"\xff\xff\xff")
        self.assertEqual(answer, b"\xff\xff\xff")  # the stand-in runtime echoes what it does not know
        self.assertEqual([(call.method, call.request) for call in self.backend.calls], [(stop, b"\xff\xff\xff")])
        self.assertEqual(self.hook_server.rpcs(), [])

    @inlineCallbacks
    def call_to_its_end(self, method: str, request: bytes):  # type: ignore[no-untyped-def]
        """The call's answer, once its flow has ended too (its line is written): the reactor does its part after
        the RPC has ended."""
        lines = call_lines(self)
        answer = yield deferToThread(self.call, method, request)
        yield self.wait_for(lines, 1)
        return answer

    @inlineCallbacks
    def test_remove_forgets_the_pod_and_its_containers(self):  # type: ignore[no-untyped-def]
        yield self.call_to_its_end(CREATE, create_request_bytes())
        request = cri.RemovePodSandboxRequest(pod_sandbox_id="sandbox-1").SerializeToString()
        yield self.call_to_its_end("/runtime.v1.RuntimeService/RemovePodSandbox", request)
        self.assertEqual(self.store.sizes(), (0, 0))

    @inlineCallbacks
    def test_a_pod_resized_in_place_is_resized_in_the_store(self):  # type: ignore[no-untyped-def]
        # The bytes a kubelet of 1.33 or later sends, from cri-api's own message.
        resize = kubelets.UpdatePodSandboxResourcesRequest(
            pod_sandbox_id="sandbox-1", resources=kubelets.LinuxContainerResources(cpu_quota=200000, cpu_period=100000)
        ).SerializeToString()
        yield self.call_to_its_end("/runtime.v1.RuntimeService/UpdatePodSandboxResources", resize)
        stored = self.store.pod("sandbox-1")
        assert stored is not None
        self.assertEqual((stored.asked.resources.cpu_quota, stored.given.resources.cpu_quota), (200000, 200000))

    @inlineCallbacks
    def wait_for(self, lines: "list[LogEvent]", count: int):  # type: ignore[no-untyped-def]
        yield Deferred.fromCoroutine(until(lambda: len(lines) >= count))
        self.assertEqual(len(lines), count)

    def stored_container(self) -> None:
        container = ContainerHookRequest(container_meta=hook.ContainerMetadata(name="app", id="c-1"))
        self.store.put_container("c-1", "sandbox-1", container, container)
        self.store.started("c-1")

    @inlineCallbacks
    def test_a_call_its_flow_forwards_as_it_came_goes_ahead_of_a_busy_reactor(self):  # type: ignore[no-untyped-def]
        # A stop of a container the store knows calls no pre hook: the worker sends it without waiting for the
        # reactor, which then runs the flow with the runtime's answer.
        self.stored_container()
        self.backend.slow_call_seconds = 0.0
        holding, answered = threading.Event(), threading.Event()
        held: list[bool] = []

        def hold_the_reactor() -> None:
            holding.set()
            held.append(answered.wait(timeout=30))

        def stop() -> bytes:
            cast(IReactorFromThreads, reactor).callFromThread(hold_the_reactor)
            holding.wait(timeout=30)
            try:
                return self.call(STOP, cri.StopContainerRequest(container_id="c-1").SerializeToString())
            finally:
                answered.set()

        yield deferToThread(stop)
        self.assertEqual(held, [True])  # kubelet had its answer while the reactor was held
        # Then the flow did the rest, once the RPC had ended.
        yield Deferred.fromCoroutine(until(lambda: self.hook_server.rpcs()))
        self.assertEqual(self.hook_server.rpcs(), ["PostStopContainerHook"])
        stored = self.store.container("c-1")
        assert stored is not None
        self.assertEqual(stored.state, ContainerState.STOPPED)

    @inlineCallbacks
    def cancel_a_stop(self):  # type: ignore[no-untyped-def]
        self.backend.slow_call_seconds = 30.0
        lines = call_lines(self)
        request = cri.StopContainerRequest(container_id="c-1", timeout=30).SerializeToString()
        stopping = self.client.unary_unary(STOP, request_serializer=None, response_deserializer=None).future(request, timeout=60)
        arrived = yield deferToThread(self.backend.stop_arrived.wait, 5)
        self.assertTrue(arrived)
        stopping.cancel()
        # The runtime's 30 s stop heard its caller go.
        given_up = yield deferToThread(self.backend.stop_given_up.wait, 20)
        self.assertTrue(given_up)
        # The proxy's only worker answers the next call within its 10 s deadline: the given-up stop holds none.
        yield deferToThread(self.call, "/runtime.v1.RuntimeService/Version", b"")
        yield self.wait_for(lines, 1)
        self.assertEqual(lines[0]["outcome"], "CANCELLED")
        # The runtime did not stop it (it does not even know it): no PostStopContainer.
        self.assertEqual(self.hook_server.rpcs(), [])

    @inlineCallbacks
    def test_a_stop_its_caller_cancels_ends_upstream_at_once_frees_its_worker_and_owes_no_post_stop(self):  # type: ignore[no-untyped-def]
        self.stored_container()  # the stop goes ahead of its flow
        yield self.cancel_a_stop()
        stored = self.store.container("c-1")
        assert stored is not None
        self.assertEqual(stored.state, ContainerState.RUNNING)

    @inlineCallbacks
    def test_a_stop_its_flow_forwards_ends_upstream_when_its_caller_cancels(self):  # type: ignore[no-untyped-def]
        # A container the store does not know is read back by the flow first, which then forwards the stop itself.
        yield self.cancel_a_stop()
        self.assertIsNone(self.store.container("c-1"))

    @inlineCallbacks
    def test_a_stop_past_its_callers_deadline_ends_upstream_at_the_deadline(self):  # type: ignore[no-untyped-def]
        self.stored_container()
        self.backend.slow_call_seconds = 30.0
        request = cri.StopContainerRequest(container_id="c-1", timeout=30).SerializeToString()
        with self.assertRaises(grpc.RpcError) as error:
            stop = self.client.unary_unary(STOP, request_serializer=None, response_deserializer=None)
            yield deferToThread(stop, request, timeout=0.5)
        self.assertEqual(error.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        # The runtime's 30 s stop heard the deadline pass: it reached the runtime.
        given_up = yield deferToThread(self.backend.stop_given_up.wait, 20)
        self.assertTrue(given_up)


class QueueingReactor:
    """The reactor's queue of calls from threads, and the wakes asked for it: at once (``callFromThread``), a
    moment later (``later``), or none (``queue``). What is queued runs when the test turns the reactor."""

    def __init__(self) -> None:
        self.queued: list[tuple[Callable[..., object], tuple[object, ...]]] = []
        self.woken = False
        self.wake_coming = False

    def queue(self, f: Callable[..., object], *args: object) -> None:
        self.queued.append((f, args))

    def later(self, f: Callable[..., object], *args: object) -> None:
        self.queue(f, *args)
        self.wake_coming = True

    def callFromThread(self, f: Callable[..., object], *args: object) -> None:
        self.queue(f, *args)
        self.woken = True

    def turn(self) -> None:
        """The reactor runs everything queued, in order."""
        self.woken = self.wake_coming = False
        while self.queued:
            queued, queued_args = self.queued.pop(0)
            queued(*queued_args)


class EndReportedOnRelease:
    """An exchange's lock, whose first release has grpc's thread report the RPC's end just then."""

    def __init__(self, exchange: _Exchange) -> None:
        self._lock = threading.Lock()
        self._exchange: _Exchange | None = exchange

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exception: object) -> None:
        self._lock.release()
        exchange, self._exchange = self._exchange, None
        if exchange is not None:
            exchange.end_reported()


class ExchangeTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.reactor = QueueingReactor()
        self.clock = Clock()
        self.answer = Answer(grpc.StatusCode.OK, b"answered")

    def exchange(self) -> _Exchange:
        return _Exchange(cast(IReactorFromThreads, self.reactor), self.reactor.queue, self.reactor.later, self.clock)

    def test_an_rpc_over_before_its_flow_started_ends_the_call_as_it_starts(self) -> None:
        # grpc may say the RPC is over (kubelet gone) before the reactor started its flow.
        runtime = RecordingRuntime(answering=Deferred())
        parts = Parts(Store(), ScriptedStages(), HookServers, SkipLabel("skip", "true"), Clock())
        call: Call[Reply] = Call(parts, "StopContainer", runtime)
        exchange = self.exchange()
        exchange.rpc_ended()
        exchange.start(cast(Any, call), cast(Any, flows.stop_container(call, "c-1")))
        self.assertIs(exchange.outcome, adapters.CALLER_GONE)
        self.assertTrue(exchange.wait(0))
        self.assertEqual(runtime.cancelled, 1)  # the runtime's call, made as the flow started, is given up

    def test_the_worker_queues_the_runtimes_answer_for_the_reactor_woken_a_moment_after_the_rpcs_end(self) -> None:
        exchange, settled = self.exchange(), cast(list[str], [])
        exchange.runtime_answered(self.answer, lambda: settled.append("settled"))
        self.assertEqual(self.reactor.queued, [])  # grpc's thread leaves it to the worker it woke
        self.assertTrue(exchange.wait(0))
        self.assertEqual(exchange.outcome, CRIReply(self.answer))
        self.assertEqual((len(self.reactor.queued), self.reactor.woken), (1, False))  # queued, the reactor not woken
        exchange.end_reported()
        # After the answer, and no wake yet: kubelet takes its answer meanwhile.
        self.assertEqual((len(self.reactor.queued), self.reactor.woken, self.reactor.wake_coming), (2, False, True))
        self.reactor.turn()
        self.assertEqual(settled, ["settled"])

    def test_an_end_reported_as_the_worker_lets_go_comes_after_the_runtimes_answer(self) -> None:
        exchange = self.exchange()

        def settle() -> None:
            pass

        exchange.runtime_answered(self.answer, settle)
        offered = EndReportedOnRelease(exchange)
        exchange._offered = offered  # type: ignore[assignment]
        self.assertTrue(exchange.wait(0))  # grpc's thread reports the end as soon as the worker lets go
        self.assertEqual([work for work, _ in self.reactor.queued], [settle, exchange.rpc_ended])

    def test_an_end_reported_before_the_worker_took_the_answer_has_it_handed_over_with_a_wake(self) -> None:
        exchange, settled = self.exchange(), cast(list[str], [])
        exchange.end_reported()  # kubelet went as the runtime answered
        self.reactor.turn()
        exchange.runtime_answered(self.answer, lambda: settled.append("settled"))
        self.assertTrue(exchange.wait(0))
        self.assertEqual((self.reactor.woken, self.reactor.wake_coming), (True, False))
        self.reactor.turn()
        self.assertEqual(settled, ["settled"])

    def test_an_end_reported_while_the_worker_waits_wakes_the_reactor_at_once_to_give_the_flow_up(self) -> None:
        runtime = RecordingRuntime(answering=Deferred())
        parts = Parts(Store(), ScriptedStages(), HookServers, SkipLabel("skip", "true"), Clock())
        call: Call[Reply] = Call(parts, "StopContainer", runtime)
        exchange = self.exchange()
        exchange.start(cast(Any, call), cast(Any, flows.stop_container(call, "c-1")))
        exchange.end_reported()  # kubelet went while the runtime stops it
        self.assertEqual((self.reactor.woken, self.reactor.wake_coming), (True, False))
        self.reactor.turn()
        self.assertEqual(runtime.cancelled, 1)
        self.assertTrue(exchange.wait(0))
        self.assertIs(exchange.outcome, adapters.CALLER_GONE)

    def test_an_answer_nobody_waits_for_goes_to_the_reactor_where_it_comes(self) -> None:
        waited_too_long, settled = self.exchange(), cast(list[str], [])
        self.assertFalse(waited_too_long.wait(0))
        waited_too_long.runtime_answered(self.answer, lambda: settled.append("after the worker gave up"))
        answered_already = self.exchange()
        answered_already.offer(adapters.CALLER_GONE)
        answered_already.runtime_answered(self.answer, lambda: settled.append("after the flow's outcome"))
        self.assertTrue(self.reactor.woken)
        self.reactor.turn()
        self.assertEqual(settled, ["after the worker gave up", "after the flow's outcome"])
        self.assertIs(answered_already.outcome, adapters.CALLER_GONE)

    def test_a_calls_duration_ends_when_the_worker_had_the_runtimes_answer_not_when_the_reactor_woke(self) -> None:
        store = self.store_with_a_container()
        runtime = RecordingRuntime(answering=Deferred())
        parts = Parts(store, ScriptedStages(), HookServers, SkipLabel("skip", "true"), self.clock)
        call: Call[Reply] = Call(parts, "UpdateContainerResources", runtime, went_ahead=True)
        update = cri.UpdateContainerResourcesRequest(container_id="c-1", linux=cri.LinuxContainerResources(cpu_shares=512))
        exchange = self.exchange()
        exchange.start(cast(Any, call), cast(Any, flows.update_container_resources(call, translate.UpdateContainerResources(update))))
        answering = runtime.answering
        assert answering is not None
        lines = call_lines(self)
        self.clock.advance(0.012)  # the runtime updates the container
        exchange.runtime_answered(self.answer, lambda: answering.callback(None))
        self.assertTrue(exchange.wait(0))
        exchange.end_reported()
        self.clock.advance(0.001)  # the reactor's wake comes a moment later
        self.reactor.turn()
        self.assertEqual([(line["outcome"], line["duration_ms"]) for line in lines], [("OK", 12.0)])

    def store_with_a_container(self) -> Store:
        store = Store()
        pod = PodHookRequest(pod_meta=hook.PodSandboxMetadata(name="p", uid="u"))
        store.put_pod("sandbox-1", pod, pod)
        container = ContainerHookRequest(container_meta=hook.ContainerMetadata(name="app", id="c-1"))
        store.put_container("c-1", "sandbox-1", container, container)
        return store

    def test_a_flow_the_runtime_answered_is_not_given_up_when_the_rpc_ends_first(self) -> None:
        # kubelet went just as the runtime answered an update: the runtime did it, so the store learns it.
        store = self.store_with_a_container()
        runtime = RecordingRuntime(answering=Deferred())
        parts = Parts(store, ScriptedStages(), HookServers, SkipLabel("skip", "true"), Clock())
        call: Call[Reply] = Call(parts, "UpdateContainerResources", runtime)
        update = cri.UpdateContainerResourcesRequest(container_id="c-1", linux=cri.LinuxContainerResources(cpu_shares=512))
        exchange = self.exchange()
        exchange.start(cast(Any, call), cast(Any, flows.update_container_resources(call, translate.UpdateContainerResources(update))))
        answering = runtime.answering
        assert answering is not None
        exchange.runtime_answered(self.answer, lambda: answering.callback(None))
        lines = call_lines(self)
        exchange.end_reported()
        self.assertTrue(exchange.wait(0))
        self.reactor.turn()  # the RPC's end, then the runtime's answer
        self.assertEqual(runtime.cancelled, 0)
        stored = store.container("c-1")
        assert stored is not None
        self.assertEqual(stored.asked.container_resources.cpu_shares, 512)
        # The call's end came first, and the flow was over after it: the call still ends, once.
        self.assertEqual([line["outcome"] for line in lines], ["OK"])


class MethodTableTests(SynchronousTestCase):
    def test_every_method_that_may_go_ahead_names_what_it_is_about(self) -> None:
        named = {name for name, method in _METHODS.items() if method.subject is not None}
        self.assertEqual(named, set(flows._SENT_AS_IT_CAME))
