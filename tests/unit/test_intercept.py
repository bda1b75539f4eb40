"""Intercepted lifecycle calls on real grpc servers (a stand-in CRI backend and a real hook server), with the fast
paths on and off; the exchange between a call's threads, in every order; the store the workers read."""

import os
import threading
from concurrent import futures
from itertools import permutations
from typing import Any, Callable, Sequence, TypeVar, cast

import grpc
from cri_api.v1 import api_pb2 as kubelets
from twisted.internet import reactor
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.interfaces import IReactorFromThreads
from twisted.internet.threads import deferToThread
from twisted.logger import LogEvent
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase, TestCase

from koordrp.api.cri.v1 import api_pb2 as cri
from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from koordrp.cri import translate
from koordrp.cri.backend import Answer, BackendChannel
from koordrp import adapters, flows
from koordrp.cri.handoff import Later
from koordrp.cri.intercept import _METHODS, CRIReply, Flow, Interceptor, _Exchange
from koordrp.cri.methods import BackendRole
from koordrp.cri.passthrough import PassThroughHandler
from koordrp.cri.runtime_lookup import RuntimeLookup
from koordrp.call import Call, Parts, SkipLabel
from koordrp.fastpaths import ENVIRONMENT, FastPaths
from koordrp.hooks.client import HookClients
from koordrp.hooks.dispatcher import Dispatcher
from koordrp.hooks.messages import ContainerHookRequest, PodHookRequest
from koordrp.hooks.types import FailurePolicy, HookServerConfig, HookServers, HookType
from koordrp.store import ContainerState, StoredContainer, StoredPod, Store
from koordrp.unix import grpc_target
from tests.fake.cri_backend import FakeCRIBackend
from tests.fake.flows import RecordingRuntime, Reply, ScriptedStages
from tests.fake.hook_server import FakeHookServer
from tests.support.logs import logged_events
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
    return logged_events(case, "koordrp.calls")


class InterceptTests(TestCase):
    paths = FastPaths({})

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
        later = Later.on(threads, 0.001, self.paths)
        self.addCleanup(later.close)
        lookup = RuntimeLookup(threads, channel.channel)
        interceptor = Interceptor(threads, channel, parts, lookup, later.queue, self.paths)
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


class InterceptWithoutFastPathsTests(InterceptTests):
    """The same calls, the same answers and ends, with every hand-off woken at once."""

    paths = FastPaths({ENVIRONMENT: "0"})


def store_with_a_container() -> Store:
    store = Store()
    pod = PodHookRequest(pod_meta=hook.PodSandboxMetadata(name="p", uid="u"))
    store.put_pod("sandbox-1", pod, pod)
    container = ContainerHookRequest(container_meta=hook.ContainerMetadata(name="app", id="c-1"))
    store.put_container("c-1", "sandbox-1", container, container)
    return store


class QueueingReactor:
    """The reactor's queue of calls from threads, and the wakes asked for it: at once (``callFromThread``), a
    moment later (``later``), or none (``queue``). What is queued runs when the test turns the reactor."""

    def __init__(self) -> None:
        self.queued: list[tuple[Callable[..., object], tuple[object, ...]]] = []
        self.handed: list[tuple[Callable[..., object], str]] = []
        """Everything ever queued, and how: ``unwoken``, ``later`` or ``woken``."""
        self.woken = False
        self.wake_coming = False

    def _hand(self, f: Callable[..., object], args: tuple[object, ...], how: str) -> None:
        self.queued.append((f, args))
        self.handed.append((f, how))

    def queue(self, f: Callable[..., object], *args: object) -> None:
        self._hand(f, args, "unwoken")

    def later(self, f: Callable[..., object], *args: object) -> None:
        self._hand(f, args, "later")
        self.wake_coming = True

    def callFromThread(self, f: Callable[..., object], *args: object) -> None:
        self._hand(f, args, "woken")
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
        exchange._lock = EndReportedOnRelease(exchange)  # type: ignore[assignment]
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
        store = store_with_a_container()
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

    def test_a_flow_the_runtime_answered_is_not_given_up_when_the_rpc_ends_first(self) -> None:
        # kubelet went just as the runtime answered an update: the runtime did it, so the store learns it.
        store = store_with_a_container()
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


class DrivenCall:
    """A call as an exchange drives it: its outcome offered when the test says, what the reactor does to it recorded."""

    def __init__(self) -> None:
        self.outcome: Deferred[adapters.Outcome[CRIReply]] = Deferred()
        self.cancelled = 0
        self.ends: list[float | None] = []

    def run(self, flow: Flow) -> "Deferred[adapters.Outcome[CRIReply]]":
        flow.close()
        return self.outcome

    def cancel(self) -> None:
        self.cancelled += 1
        if not self.outcome.called:
            self.outcome.callback(adapters.CALLER_GONE)

    def ended(self, decided_at: float | None = None) -> None:
        self.ends.append(decided_at)


async def a_flow() -> CRIReply:
    raise AssertionError("the exchange's call runs it")


OFFERED, ANSWERED, WORKER_DONE, RPC_OVER = "offered", "answered", "worker done", "rpc over"


class ExchangeOrderTests(SynchronousTestCase):
    """The events of one exchange come from three threads (the reactor offers the flow's outcome, grpc's threads
    the runtime's answer and the RPC's end, the worker is done waiting) in any order: each order ends as the rules
    say, with nothing lost or handed over twice."""

    flows_outcome = CRIReply(Answer(grpc.StatusCode.OK, b"the flow's"))
    runtimes = Answer(grpc.StatusCode.OK, b"the runtime's")

    def test_every_order_of_the_events_that_race_ends_as_the_rules_say(self) -> None:
        # The flow always ends, the worker always stops waiting and grpc always says the RPC is over; the runtime
        # answers the call's forward only where there is one, and it was not cancelled first.
        always = (OFFERED, WORKER_DONE, RPC_OVER)
        orders = [*permutations((*always, ANSWERED)), *permutations(always)]
        self.assertEqual(len(orders), 30)
        for order in orders:
            self.delivered(order)

    def delivered(self, order: Sequence[str]) -> None:
        reactor, clock, call = QueueingReactor(), Clock(), DrivenCall()
        exchange = _Exchange(cast(IReactorFromThreads, reactor), reactor.queue, reactor.later, clock)
        exchange.start(call, a_flow())  # on the reactor, first (an end before the start: ExchangeTests)
        settled: list[float] = []

        def settle() -> None:
            settled.append(clock.seconds())

        waited: list[bool] = []
        for event in order:
            clock.advance(1)
            if event == OFFERED:
                call.outcome.callback(self.flows_outcome)
            elif event == ANSWERED:
                exchange.runtime_answered(self.runtimes, settle)
            elif event == WORKER_DONE:
                waited.append(exchange.wait(0))
            else:
                exchange.end_reported()
        handed = list(reactor.handed)
        reactor.turn()

        at = {event: index + 1 for index, event in enumerate(order)}  # the clock as each came
        done, over = at[WORKER_DONE], at[RPC_OVER]
        offered_before = sorted((at[event], event) for event in (OFFERED, ANSWERED) if event in at and at[event] < done)
        first = offered_before[0][1] if offered_before else None
        outcome = {None: adapters.CALLER_GONE, OFFERED: self.flows_outcome, ANSWERED: CRIReply(self.runtimes)}[first]
        took_the_runtimes = first == ANSWERED
        said = f"in the order {order}"
        # The worker: the first outcome offered before it was done, or none.
        self.assertEqual(waited, [first is not None], said)
        self.assertEqual(exchange.outcome, outcome, said)
        # The reactor: the RPC's end once, a moment later once the worker is done, at once before; the runtime's
        # answer once, unwoken only where the worker took it and the RPC's end was still to wake the reactor.
        expected = [(over, exchange.rpc_ended, "later" if done < over else "woken")]
        if ANSWERED in at:
            how = "unwoken" if took_the_runtimes and done < over else "woken"
            expected.append((done if took_the_runtimes else at[ANSWERED], settle, how))
        self.assertEqual(handed, [(work, how) for _, work, how in sorted(expected, key=lambda handed: handed[0])], said)
        self.assertEqual(len(settled), 1 if ANSWERED in at else 0, said)
        # The call: given up unless the runtime's answer was the caller's; ended once, its duration up to the worker's
        # outcome.
        self.assertEqual(call.cancelled, 0 if took_the_runtimes else 1, said)
        self.assertEqual(call.ends, [float(done) if first is not None else None], said)

    def test_an_event_the_rules_say_comes_once_is_refused_loudly_the_second_time(self) -> None:
        reactor = QueueingReactor()
        exchange = _Exchange(cast(IReactorFromThreads, reactor), reactor.queue, reactor.later, Clock())
        exchange.end_reported()
        self.assertRaises(RuntimeError, exchange.end_reported)
        self.assertEqual(len(reactor.handed), 1)


Entry = TypeVar("Entry")


class Guarded(dict[str, Entry]):
    """A store's table that counts its changes and fails one made without the store's lock."""

    def __init__(self, lock: "threading.Lock") -> None:
        super().__init__()
        self._lock = lock
        self.changes = 0

    def _changing(self) -> None:
        assert self._lock.locked(), "the store changed without its lock"
        self.changes += 1

    def __setitem__(self, key: str, value: Entry) -> None:
        self._changing()
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        self._changing()
        super().__delitem__(key)

    def pop(self, key: str, *default: Any) -> Any:
        self._changing()
        return super().pop(key, *default)


class StoreSharedWithWorkersTests(SynchronousTestCase):
    """A worker reads the store (``flows.goes_ahead``) while the reactor changes it: under the store's lock."""

    def store(self) -> tuple[Store, Guarded[StoredPod], Guarded[StoredContainer]]:
        store = Store()
        pods: Guarded[StoredPod] = Guarded(store.changing)
        containers: Guarded[StoredContainer] = Guarded(store.changing)
        store._pods, store._containers = pods, containers
        return store, pods, containers

    def test_every_change_the_reactor_makes_holds_the_lock(self) -> None:
        store, pods, containers = self.store()
        pod = PodHookRequest(pod_meta=hook.PodSandboxMetadata(name="p", uid="u"))
        container = ContainerHookRequest(container_meta=hook.ContainerMetadata(name="app", id="c-1"))
        store.put_pod("sandbox-1", pod, pod)
        store.resize_pod("sandbox-1", None, None)
        store.put_container("c-1", "sandbox-1", container, container)
        store.revise_container("c-1", container, container)
        store.started("c-1")
        store.stopped("c-1")
        store.started("c-1")
        store.pod_stopped("sandbox-1")
        store.unhook("c-1")
        store.forget_container("c-1")
        store.put_container("c-1", "sandbox-1", container, container)
        store.forget_pod("sandbox-1")
        store.learn(
            [("sandbox-2", StoredPod.read_back(pod, False))],
            [("c-2", StoredContainer.read_back("sandbox-2", container, ContainerState.RUNNING))],
        )
        store.reconcile((set(), set()), [], [], ({"sandbox-2"}, {"c-2"}))
        self.assertEqual(store.sizes(), (0, 0))
        self.assertEqual((pods.changes, containers.changes), (6, 12))

    def test_a_worker_deciding_whether_a_call_goes_ahead_reads_the_store_under_its_lock(self) -> None:
        store = store_with_a_container()
        parts = Parts(store, ScriptedStages(), HookServers, SkipLabel("skip", "true"), Clock())
        read_locked: list[bool] = []

        class Read(dict[str, StoredContainer]):
            """The store's containers, noting whether the lock is held at each read."""

            def get(self, key: str, default: Any = None) -> Any:
                read_locked.append(store.changing.locked())
                return super().get(key, default)

            def __getitem__(self, key: str) -> StoredContainer:
                read_locked.append(store.changing.locked())
                return super().__getitem__(key)

        store._containers = Read(store._containers)
        self.assertTrue(flows.goes_ahead(parts, HookServers(), "StopContainer", "c-1"))
        self.assertTrue(read_locked)
        self.assertTrue(all(read_locked), read_locked)
        self.assertFalse(store.changing.locked())
