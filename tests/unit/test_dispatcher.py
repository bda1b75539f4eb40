"""Hook stages against real hook servers on unix sockets: chaining, policies, timeouts."""

import os

import grpc
from twisted.internet import reactor
from twisted.internet.defer import Deferred, fail, inlineCallbacks
from twisted.internet.interfaces import IReactorTime, IReactorUNIX
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import Clock
from twisted.logger import LogLevel, formatEvent
from twisted.trial.unittest import SynchronousTestCase, TestCase

from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from koordrp.hooks.client import HookCallError, HookClients
from koordrp.hooks.dispatcher import Dispatcher
from koordrp.hooks.messages import HookRequest, HookResponse
from koordrp.hooks.types import FailurePolicy, HookServerConfig, HookType, PostStage, StageOutcome
from koordrp.calllog import call_text
from koordrp.metrics import Metrics
from tests.fake.hook_clients import PendingCall, ScriptedHookClient, calls_to, scripted_clients
from tests.fake.hook_server import FakeHookServer
from tests.fake.reactor import InlineThreadsReactor
from tests.support.logs import logged_events
from tests.support.tempdirs import short_tempdir
from tests.support.waiting import until

CREATE = HookType.PRE_CREATE_CONTAINER


def add_env(key: str, value: str):  # type: ignore[no-untyped-def]
    def behaviour(request: hook.ContainerResourceHookRequest) -> hook.ContainerResourceHookResponse:
        return hook.ContainerResourceHookResponse(container_envs={key: value + "|saw:" + ",".join(sorted(request.container_envs))})

    return behaviour


class DispatcherTests(TestCase):
    def setUp(self) -> None:
        self.dir = short_tempdir(self)
        self.clients = HookClients(reactor)
        self.addCleanup(self.clients.close_all)
        self.dispatcher = Dispatcher(self.clients, reactor)
        self.addCleanup(self.dispatcher.close)  # ends the questions to servers that stopped answering
        self.events = logged_events(self)

    def server(self, name: str) -> FakeHookServer:
        fake = FakeHookServer(os.path.join(self.dir, name + ".sock")).start()
        self.addCleanup(fake.stop)
        return fake

    def config(
        self, name: str, fake: FakeHookServer | None = None, policy: FailurePolicy = FailurePolicy.IGNORE, timeout: float = 2.0
    ) -> HookServerConfig:
        endpoint = fake.path if fake is not None else os.path.join(self.dir, name + ".sock")
        return HookServerConfig(name + ".json", endpoint, policy, frozenset(HookType), timeout)

    def test_the_channels_of_servers_no_longer_registered_are_let_go(self) -> None:
        kept, gone = (os.path.join(self.dir, name) for name in ("kept.sock", "gone.sock"))
        kept_client, gone_client = self.clients.get(kept), self.clients.get(gone)
        self.dispatcher.retain(frozenset({kept}))
        self.assertIs(self.clients.get(kept), kept_client)
        self.assertIsNot(self.clients.get(gone), gone_client)

    @inlineCallbacks
    def test_a_registered_servers_channel_connects_before_its_first_call(self):  # type: ignore[no-untyped-def]
        # The first call then pays no connection set-up inside its caller's deadline (containerd's, in NRI mode).
        path = os.path.join(self.dir, "listening.sock")
        connected: Deferred[None] = Deferred()

        class Accepted(Protocol):
            def connectionMade(self) -> None:
                connected.callback(None)

        port = IReactorUNIX(reactor).listenUNIX(path, Factory.forProtocol(Accepted))
        self.addCleanup(port.stopListening)
        self.dispatcher.retain(frozenset({path}))
        yield connected

    @inlineCallbacks
    def test_post_stages_are_not_waited_for_and_drain_waits_for_them(self):  # type: ignore[no-untyped-def]
        slow = self.server("slow")
        slow.delays["PostStopContainerHook"] = 3600
        # announce returns while the server has not answered: nothing waits for it.
        self.dispatcher.announce([PostStage(HookType.POST_STOP_CONTAINER, (self.config("slow", slow, timeout=3600),), hook.ContainerResourceHookRequest())])
        drained = self.dispatcher.drain(3600)
        yield Deferred.fromCoroutine(until(lambda: slow.rpcs() == ["PostStopContainerHook"]))
        self.assertFalse(drained.called)  # the drain waits for it
        slow.unwedge()
        yield drained

    @inlineCallbacks
    def test_a_drain_cuts_what_still_runs_at_its_bound_and_names_each_cut_call(self):  # type: ignore[no-untyped-def]
        wedged, other = self.server("wedged"), self.server("other")
        wedged.delays["PostStopContainerHook"] = 30
        request = hook.ContainerResourceHookRequest(
            pod_meta=hook.PodSandboxMetadata(name="web", namespace="default"), container_meta=hook.ContainerMetadata(name="app")
        )
        servers = (self.config("wedged", wedged, timeout=60), self.config("other", other))
        pod = hook.PodSandboxHookRequest(pod_meta=hook.PodSandboxMetadata(name="web", namespace="default"))
        self.dispatcher.announce(
            [PostStage(HookType.POST_STOP_CONTAINER, servers, request), PostStage(HookType.POST_STOP_POD_SANDBOX, servers, pod)]
        )
        # The other server has a sequence of its own: the wedged one does not hold it (its answers are awaited
        # before the bound, a generous one: it is not cut).
        yield Deferred.fromCoroutine(until(lambda: len(other.rpcs()) == 2))
        yield self.dispatcher.drain(1.0)
        [cut] = [event for event in self.events if "cut at the stop's bound" in event["log_format"]]
        self.assertEqual((cut["server"], cut["hook"], cut["subject"]), ("wedged.json", "PostStopContainer", "pod default/web container app"))
        self.assertEqual(cut["rest"], "; 1 more post hook call of the same call not made")
        self.assertEqual(other.rpcs(), ["PostStopContainerHook", "PostStopPodSandboxHook"])
        self.assertEqual(wedged.rpcs(), ["PostStopContainerHook"])
        self.assertEqual(self.flushLoggedErrors(), [])

    @inlineCallbacks
    def test_a_drain_waits_for_post_stages_announced_while_it_waits(self):  # type: ignore[no-untyped-def]
        server = self.server("post")
        server.delays["PostStopContainerHook"] = 0.2
        subscribers = (self.config("post", server),)
        self.dispatcher.announce([PostStage(HookType.POST_STOP_CONTAINER, subscribers, hook.ContainerResourceHookRequest())])
        drained = self.dispatcher.drain(30)
        self.dispatcher.announce([PostStage(HookType.POST_STOP_POD_SANDBOX, subscribers, hook.PodSandboxHookRequest())])
        yield drained
        # Two calls' post stages, which may overlap: the server hears of both, in either order.
        self.assertEqual(sorted(server.rpcs()), ["PostStopContainerHook", "PostStopPodSandboxHook"])

    def test_a_post_stage_that_fails_inside_koordrp_is_logged(self) -> None:
        def broken(*args: object) -> "Deferred[object]":
            return fail(ZeroDivisionError("a bug"))

        self.patch(self.dispatcher, "run", broken)
        self.dispatcher.announce([PostStage(HookType.POST_STOP_CONTAINER, (self.config("a"),), hook.ContainerResourceHookRequest())])
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)
        self.assertTrue(self.dispatcher.drain(30).called)

    def test_closing_lets_every_channel_go(self) -> None:
        client = self.clients.get(os.path.join(self.dir, "a.sock"))
        self.dispatcher.close()
        self.assertIsNot(self.clients.get(os.path.join(self.dir, "a.sock")), client)

    @inlineCallbacks
    def test_one_calls_post_stages_reach_a_server_one_after_another(self):  # type: ignore[no-untyped-def]
        server = self.server("post")
        server.delays["PostStopContainerHook"] = 3600
        subscribers = (self.config("post", server, timeout=3600),)
        self.dispatcher.announce(
            [
                PostStage(HookType.POST_STOP_CONTAINER, subscribers, hook.ContainerResourceHookRequest()),
                PostStage(HookType.POST_STOP_POD_SANDBOX, subscribers, hook.PodSandboxHookRequest()),
            ]
        )
        yield Deferred.fromCoroutine(until(lambda: server.rpcs()))
        self.assertEqual(server.rpcs(), ["PostStopContainerHook"])  # the pod's waits for its containers' answer
        server.unwedge()
        yield self.dispatcher.drain(30)
        self.assertEqual(server.rpcs(), ["PostStopContainerHook", "PostStopPodSandboxHook"])

    @inlineCallbacks
    def test_each_server_sees_the_request_as_changed_before_it(self):  # type: ignore[no-untyped-def]
        first, second = self.server("a"), self.server("b")
        first.behaviours["PreCreateContainerHook"] = add_env("FIRST", "1")
        second.behaviours["PreCreateContainerHook"] = add_env("SECOND", "2")
        request = hook.ContainerResourceHookRequest(container_envs={"KUBELET": "0"})
        outcome = yield self.dispatcher.run(CREATE, (self.config("a", first), self.config("b", second)), request, None)
        self.assertIsNone(outcome.failure)
        self.assertEqual(
            dict(outcome.request.container_envs),
            {"KUBELET": "0", "FIRST": "1|saw:KUBELET", "SECOND": "2|saw:FIRST,KUBELET"},
        )
        self.assertEqual([(call.server.name, call.result) for call in outcome.calls], [("a.json", "ok"), ("b.json", "ok")])
        self.assertEqual([change.path for change in outcome.calls[1].changes], ["container_envs[SECOND]"])

    @inlineCallbacks
    def test_fail_policy_fails_the_stage_naming_server_and_hook(self):  # type: ignore[no-untyped-def]
        broken, after = self.server("broken"), self.server("after")
        broken.failures["PreCreateContainerHook"] = grpc.StatusCode.INTERNAL
        servers = (self.config("broken", broken, FailurePolicy.FAIL), self.config("after", after))
        outcome = yield self.dispatcher.run(CREATE, servers, hook.ContainerResourceHookRequest(), None)
        self.assertIsNotNone(outcome.failure)
        self.assertIn("broken.json", outcome.failure.message)
        self.assertIn("PreCreateContainer", outcome.failure.message)
        self.assertIn("INTERNAL", outcome.failure.message)
        self.assertEqual(after.calls(), [])

    @inlineCallbacks
    def test_ignore_policy_logs_and_goes_on(self):  # type: ignore[no-untyped-def]
        broken, after = self.server("broken"), self.server("after")
        broken.failures["PreCreateContainerHook"] = grpc.StatusCode.INTERNAL
        after.behaviours["PreCreateContainerHook"] = add_env("AFTER", "1")
        servers = (self.config("broken", broken), self.config("after", after))
        outcome = yield self.dispatcher.run(CREATE, servers, hook.ContainerResourceHookRequest(), None)
        self.assertIsNone(outcome.failure)
        self.assertIn("AFTER", outcome.request.container_envs)
        warnings = [e for e in self.events if e.get("log_level") is LogLevel.warn and e.get("server") == "broken.json"]
        self.assertEqual(len(warnings), 1)

    @inlineCallbacks
    def test_a_slow_server_is_cut_off_at_its_timeout(self):  # type: ignore[no-untyped-def]
        for policy in (FailurePolicy.IGNORE, FailurePolicy.FAIL):
            slow = self.server(f"slow-{policy.value}")
            slow.delays["PreCreateContainerHook"] = 3600
            outcome = yield self.dispatcher.run(
                CREATE, (self.config(f"slow-{policy.value}", slow, policy, timeout=0.3),), hook.ContainerResourceHookRequest(), None
            )
            self.assertEqual([call.result for call in outcome.calls], ["timeout"])
            if policy is FailurePolicy.FAIL:
                self.assertIn("no answer within 0.3s", outcome.failure.message)
            else:
                self.assertIsNone(outcome.failure)

    @inlineCallbacks
    def test_the_cri_deadline_bounds_the_hook(self):  # type: ignore[no-untyped-def]
        slow = self.server("slow")
        slow.delays["PreCreateContainerHook"] = 3600
        outcome = yield self.dispatcher.run(
            CREATE, (self.config("slow", slow, FailurePolicy.FAIL, timeout=3600),), hook.ContainerResourceHookRequest(), 0.2
        )
        # Cut at the call's 0.2 s, not the server's hour.
        self.assertIn("no answer within 0.2s", outcome.failure.message)

    @inlineCallbacks
    def test_a_missing_socket_fails_at_once(self):  # type: ignore[no-untyped-def]
        outcome = yield self.dispatcher.run(
            CREATE, (self.config("absent", None, FailurePolicy.FAIL, timeout=3600),), hook.ContainerResourceHookRequest(), None
        )
        # Said at once, not an hour's timeout waited out.
        self.assertIn("does not exist", outcome.failure.message)

    @inlineCallbacks
    def test_post_hook_answers_and_failures_change_nothing(self):  # type: ignore[no-untyped-def]
        answering, broken = self.server("answering"), self.server("broken")
        answering.behaviours["PostStopContainerHook"] = add_env("IGNORED", "1")
        broken.failures["PostStopContainerHook"] = grpc.StatusCode.INTERNAL
        servers = (self.config("answering", answering), self.config("broken", broken, FailurePolicy.FAIL))
        request = hook.ContainerResourceHookRequest(container_envs={"A": "1"})
        outcome = yield self.dispatcher.run(HookType.POST_STOP_CONTAINER, servers, request, None)
        self.assertIsNone(outcome.failure)
        self.assertEqual(dict(outcome.request.container_envs), {"A": "1"})
        self.assertEqual(len(broken.calls("PostStopContainerHook")), 1)

    @inlineCallbacks
    def test_two_servers_changing_one_field_is_logged_at_debug(self):  # type: ignore[no-untyped-def]
        first, second = self.server("a"), self.server("b")
        first.behaviours["PreCreateContainerHook"] = add_env("SAME", "1")
        second.behaviours["PreCreateContainerHook"] = add_env("SAME", "2")
        yield self.dispatcher.run(
            CREATE, (self.config("a", first), self.config("b", second)), hook.ContainerResourceHookRequest(), None
        )
        conflicts = [e for e in self.events if e.get("log_level") is LogLevel.debug and e.get("field") == "container_envs[SAME]"]
        self.assertEqual([(e["earlier"], e["server"]) for e in conflicts], [("a.json", "b.json")])

    @inlineCallbacks
    def test_a_restarted_server_is_heard_again_on_the_same_client(self):  # type: ignore[no-untyped-def]
        fake = self.server("flaky")
        fake.behaviours["PreCreateContainerHook"] = add_env("UP", "1")
        servers = (self.config("flaky", fake, FailurePolicy.FAIL),)
        outcome = yield self.dispatcher.run(CREATE, servers, hook.ContainerResourceHookRequest(), None)
        self.assertIsNone(outcome.failure)
        fake.stop()
        outcome = yield self.dispatcher.run(CREATE, servers, hook.ContainerResourceHookRequest(), None)
        self.assertIsNotNone(outcome.failure)
        fake.start()
        outcome = yield self.dispatcher.run(CREATE, servers, hook.ContainerResourceHookRequest(), 5)
        self.assertIsNone(outcome.failure, outcome.failure and outcome.failure.message)
        self.assertIn("UP", outcome.request.container_envs)

    def policy_server(self, name: str, policy: FailurePolicy, timeout: float) -> tuple[FakeHookServer, HookServerConfig]:
        fake = self.server(name)
        return fake, self.config(name, fake, policy, timeout)

    @inlineCallbacks
    def test_a_slow_server_within_its_time_is_heard(self):  # type: ignore[no-untyped-def]
        slow, config = self.policy_server("slow", FailurePolicy.IGNORE, timeout=5.0)
        slow.delays["PreCreateContainerHook"] = 1.0
        slow.behaviours["PreCreateContainerHook"] = add_env("LATE", "1")
        outcome = yield self.dispatcher.run(CREATE, (config,), hook.ContainerResourceHookRequest(), 30.0)
        self.assertEqual([call.result for call in outcome.calls], ["ok"])
        self.assertIn("LATE", outcome.request.container_envs)

    @inlineCallbacks
    def test_a_server_that_let_a_call_time_out_is_skipped_without_a_call(self):  # type: ignore[no-untyped-def]
        """Its trial, later, is in tests/unit/test_answering.py, on the test's clock."""
        metrics = Metrics()
        self.dispatcher = Dispatcher(self.clients, reactor, metrics)
        self.addCleanup(self.dispatcher.close)
        for policy in (FailurePolicy.IGNORE, FailurePolicy.FAIL):
            wedged, config = self.policy_server(f"wedged-{policy.value}", policy, timeout=0.3)
            wedged.delays["PreCreateContainerHook"] = 30
            first = yield self.dispatcher.run(CREATE, (config,), hook.ContainerResourceHookRequest(), None)
            self.assertEqual([call.result for call in first.calls], ["timeout"])
            later = yield self.dispatcher.run(CREATE, (config,), hook.ContainerResourceHookRequest(), None)
            [skipped] = later.calls
            self.assertEqual(skipped.result, "not-answering")
            self.assertEqual(len(wedged.calls("PreCreateContainerHook")), 1)  # asked once, never again
            labels = {"server": f"wedged-{policy.value}.json", "hook": CREATE.value, "result": "not-answering"}
            self.assertEqual(metrics.registry.get_sample_value("koordrp_hook_calls_total", labels), 1)
            timed = {"server": f"wedged-{policy.value}.json", "hook": CREATE.value}
            self.assertEqual(metrics.registry.get_sample_value("koordrp_hook_call_seconds_count", timed), 1)  # the timeout
            self.assertIn("no answer within 0.3s", skipped.reason)
            if policy is FailurePolicy.FAIL:
                self.assertIn(f"wedged-{policy.value}.json", later.failure.message)
                self.assertIn("not answering", later.failure.message)
            else:
                self.assertIsNone(later.failure)
            wedged.unwedge()


CHECKING_STRICT = HookServerConfig("strict.json", "/run/koordrp-test/checked-strict.sock", FailurePolicy.FAIL, frozenset(HookType), 10.0)
CHECKING_LAX = HookServerConfig("lax.json", "/run/koordrp-test/checked-lax.sock", FailurePolicy.IGNORE, frozenset(HookType), 10.0)
CHECKING_AFTER = HookServerConfig("after.json", "/run/koordrp-test/checked-after.sock", FailurePolicy.IGNORE, frozenset(HookType), 10.0)
KUBELETS_PARENT = "/kubepods/besteffort/pod1"
ESCAPING = hook.PodSandboxHookResponse(cgroup_parent="/kubepods/../../escape", labels={"seen": "1"})
ESCAPE_REFUSED = 'refused cgroup_parent "/kubepods/../../escape": has a .. part'


def checked_container() -> hook.ContainerResourceHookRequest:
    return hook.ContainerResourceHookRequest(
        pod_meta=hook.PodSandboxMetadata(name="web", namespace="default"),
        container_meta=hook.ContainerMetadata(name="app"),
        pod_cgroup_parent=KUBELETS_PARENT,
        container_resources=hook.LinuxContainerResources(cpu_shares=2, cpuset_cpus="0-3"),
    )


class AnswerCheckTests(SynchronousTestCase):
    """Answers are checked before they are merged (koordrp.hooks.validation), through the real dispatcher with
    scripted servers on the test's clock: a Fail-policy server's refused field fails the call naming the server
    and the field; an Ignore-policy server's is left out and the rest of its answer applies."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.clients = scripted_clients(self.clock)
        self.metrics = Metrics()
        self.dispatcher = Dispatcher(self.clients, self.clock, self.metrics)
        self.events = logged_events(self)

    def stage(
        self, hook_type: HookType, servers: tuple[HookServerConfig, ...], request: HookRequest, answers: dict[str, HookResponse]
    ) -> StageOutcome:
        running = Deferred.fromCoroutine(self.dispatcher.run(hook_type, servers, request, None))
        for server in servers:  # each is called once the one before it has answered
            for pending in calls_to(self.clients, server.endpoint):
                pending.answer(answers[server.name])
        outcome: StageOutcome = self.successResultOf(running)
        return outcome

    def warnings(self) -> list[str]:
        return [formatEvent(event) for event in self.events if event.get("log_level") is LogLevel.warn]

    def test_a_fail_policy_servers_refused_field_fails_the_call_naming_the_server_and_the_field(self) -> None:
        pod = hook.PodSandboxHookRequest(pod_meta=hook.PodSandboxMetadata(name="web", namespace="default"), cgroup_parent=KUBELETS_PARENT)
        outcome = self.stage(HookType.PRE_RUN_POD_SANDBOX, (CHECKING_STRICT, CHECKING_AFTER), pod, {"strict.json": ESCAPING})
        assert outcome.failure is not None
        self.assertEqual(
            outcome.failure.message,
            f"koordrp: hook server strict.json (/run/koordrp-test/checked-strict.sock) failed PreRunPodSandbox: {ESCAPE_REFUSED}",
        )
        # Nothing of the answer is applied, and the server after it is not called.
        self.assertEqual((pod.cgroup_parent, dict(pod.labels)), (KUBELETS_PARENT, {}))
        self.assertEqual(calls_to(self.clients, CHECKING_AFTER.endpoint), [])
        [call] = outcome.calls
        self.assertEqual((call.result, call.reason), ("error", ESCAPE_REFUSED))
        self.assertEqual(
            call_text(call), f"PreRunPodSandbox@strict.json: error 0.0 ms ({ESCAPE_REFUSED}; Fail policy: the call failed)"
        )
        self.assertEqual(
            self.warnings(),
            [f"hook PreRunPodSandbox on strict.json for pod default/web: {ESCAPE_REFUSED}; policy Fail, the CRI call fails"],
        )
        labels = {"server": "strict.json", "hook": "PreRunPodSandbox", "result": "error"}
        self.assertEqual(self.metrics.registry.get_sample_value("koordrp_hook_calls_total", labels), 1)
        # It answered: a refusal does not silence it.
        again = Deferred.fromCoroutine(self.dispatcher.run(HookType.PRE_RUN_POD_SANDBOX, (CHECKING_STRICT,), hook.PodSandboxHookRequest(), None))
        self.assertEqual(len(calls_to(self.clients, CHECKING_STRICT.endpoint)), 2)
        calls_to(self.clients, CHECKING_STRICT.endpoint)[1].answer(hook.PodSandboxHookResponse())
        self.assertIsNone(self.successResultOf(again).failure)

    def test_an_ignore_policy_servers_refused_field_is_left_out_and_the_rest_applies(self) -> None:
        pod = hook.PodSandboxHookRequest(pod_meta=hook.PodSandboxMetadata(name="web", namespace="default"), cgroup_parent=KUBELETS_PARENT)
        answers: dict[str, HookResponse] = {"lax.json": ESCAPING, "after.json": hook.PodSandboxHookResponse()}
        outcome = self.stage(HookType.PRE_RUN_POD_SANDBOX, (CHECKING_LAX, CHECKING_AFTER), pod, answers)
        self.assertIsNone(outcome.failure)
        self.assertEqual((pod.cgroup_parent, dict(pod.labels)), (KUBELETS_PARENT, {"seen": "1"}))
        [seen] = calls_to(self.clients, CHECKING_AFTER.endpoint)  # the next server sees the request without it
        assert isinstance(seen.request, hook.PodSandboxHookRequest)
        self.assertEqual((seen.request.cgroup_parent, dict(seen.request.labels)), (KUBELETS_PARENT, {"seen": "1"}))
        self.assertEqual(call_text(outcome.calls[0]), f"PreRunPodSandbox@lax.json: ok 0.0 ms, changed labels +seen, {ESCAPE_REFUSED}")
        self.assertEqual(
            self.warnings(),
            [f"hook PreRunPodSandbox on lax.json for pod default/web: {ESCAPE_REFUSED}; policy Ignore, the rest of its answer applies"],
        )

    def test_what_the_runtime_would_refuse_never_reaches_the_request(self) -> None:
        container = checked_container()
        answer = hook.ContainerResourceHookResponse(
            container_resources=hook.LinuxContainerResources(cpu_shares=1 << 62, cpuset_cpus="abc", memory_limit_in_bytes=-2, cpu_quota=50000),
            container_envs={"GOOD": "1", "BAD\x00KEY": "1"},
        )
        outcome = self.stage(HookType.PRE_CREATE_CONTAINER, (CHECKING_LAX,), container, {"lax.json": answer})
        assert isinstance(outcome.request, hook.ContainerResourceHookRequest)
        resources = outcome.request.container_resources
        self.assertEqual((resources.cpu_shares, resources.cpuset_cpus, resources.memory_limit_in_bytes, resources.cpu_quota), (2, "0-3", 0, 50000))
        self.assertEqual(dict(outcome.request.container_envs), {"GOOD": "1"})
        text = call_text(outcome.calls[0])
        for refused in (
            'refused resources.cpuset_cpus "abc": not a cpu list',
            "refused resources.cpu_shares 4611686018427387904: outside the kernel's 2..262144",
            "refused resources.memory_limit_in_bytes -2: a negative limit",
            "refused envs[BAD\\x00KEY]: a name with a NUL byte",
        ):
            self.assertIn(refused, text)
        self.assertNotIn("\x00", text)
        [warning] = self.warnings()
        self.assertIn("… and 1 more; policy Ignore, the rest of its answer applies", warning)

    def test_a_late_answer_is_checked_before_it_is_applied(self) -> None:
        running = Deferred.fromCoroutine(self.dispatcher.run(HookType.PRE_CREATE_CONTAINER, (CHECKING_LAX,), checked_container(), 1.0, keep_late=True))
        self.clock.advance(1.0)
        outcome: StageOutcome = self.successResultOf(running)
        assert outcome.late is not None
        [pending] = calls_to(self.clients, CHECKING_LAX.endpoint)
        pending.answer(
            hook.ContainerResourceHookResponse(container_resources=hook.LinuxContainerResources(cpu_shares=512, cpuset_cpus="abc"))
        )
        late = self.successResultOf(outcome.late.ended)
        assert isinstance(late.response, hook.ContainerResourceHookResponse)
        self.assertEqual((late.response.container_resources.cpu_shares, late.response.container_resources.cpuset_cpus), (512, "0-3"))
        self.assertEqual(late.call.reason, 'no answer within 1s; refused resources.cpuset_cpus "abc": not a cpu list')
        self.assertEqual(
            self.warnings()[-1],  # after those for the budget it missed
            'hook PreCreateContainer on lax.json for pod default/web container app: refused resources.cpuset_cpus "abc": '
            "not a cpu list; policy Ignore, the rest of its answer applies",
        )

    def test_post_hook_answers_are_not_used_so_not_checked(self) -> None:
        outcome = self.stage(HookType.POST_STOP_POD_SANDBOX, (CHECKING_STRICT,), hook.PodSandboxHookRequest(), {"strict.json": ESCAPING})
        self.assertEqual(([call.result for call in outcome.calls], outcome.failure, self.warnings()), (["ok"], None, []))


POST_STOP_CONTAINER, POST_STOP_POD = HookType.POST_STOP_CONTAINER, HookType.POST_STOP_POD_SANDBOX
WEDGED = HookServerConfig("wedged.json", "/run/koordrp-test/wedged.sock", FailurePolicy.IGNORE, frozenset(HookType), 60.0)
OTHER = HookServerConfig("other.json", "/run/koordrp-test/other.sock", FailurePolicy.IGNORE, frozenset(HookType), 60.0)
STRICT = HookServerConfig("strict.json", "/run/koordrp-test/strict.sock", FailurePolicy.FAIL, frozenset(HookType), 60.0)
CONTAINER_ANSWER, POD_ANSWER = hook.ContainerResourceHookResponse(), hook.PodSandboxHookResponse()


class ClosedScriptedClient(ScriptedHookClient):
    """A scripted client that counts its calls in flight as a real one does, and says whether it was closed."""

    def __init__(self, endpoint: str, reactor: IReactorTime) -> None:
        super().__init__(endpoint, reactor)
        self.closed = False

    def call(self, hook: HookType, request: HookRequest, timeout: float) -> "Deferred[HookResponse]":
        return self._counted(super().call(hook, request, timeout))

    def close(self) -> None:
        self.closed = True


def pod_stop(pod: str, containers: tuple[str, ...], *servers: HookServerConfig) -> list[PostStage]:
    """The post stages of a StopPodSandbox that stopped ``containers`` too: each container's, then the pod's."""
    meta = hook.PodSandboxMetadata(name=pod, namespace="default")
    stages = [
        PostStage(POST_STOP_CONTAINER, servers, hook.ContainerResourceHookRequest(pod_meta=meta, container_meta=hook.ContainerMetadata(name=name)))
        for name in containers
    ]
    return [*stages, PostStage(POST_STOP_POD, servers, hook.PodSandboxHookRequest(pod_meta=meta))]


def heard(calls: list[PendingCall]) -> list[tuple[str, str]]:
    """What a server was told, in order: (hook, container or pod)."""
    return [
        (call.hook.value, call.request.container_meta.name if isinstance(call.request, hook.ContainerResourceHookRequest) else call.request.pod_meta.name)
        for call in calls
    ]


class PostSequenceTests(SynchronousTestCase):
    """Post stages on the test's clock with scripted servers: each server has a sequence of its own."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.clients = HookClients(self.clock, make_client=ClosedScriptedClient)
        self.dispatcher = Dispatcher(self.clients, self.clock)
        self.events = logged_events(self)

    def calls(self, server: HookServerConfig) -> list[PendingCall]:
        return calls_to(self.clients, server.endpoint)

    def test_a_wedged_server_does_not_delay_another_servers_post_hooks(self) -> None:
        self.dispatcher.announce(pod_stop("web", ("app",), WEDGED, OTHER))
        drained = self.dispatcher.drain(120)
        # No time passes: the other server is told at once, and of the pod once it answered for the container.
        self.assertEqual(heard(self.calls(OTHER)), [("PostStopContainer", "app")])
        self.calls(OTHER)[0].answer(CONTAINER_ANSWER)
        self.assertEqual(heard(self.calls(OTHER)), [("PostStopContainer", "app"), ("PostStopPodSandbox", "web")])
        self.calls(OTHER)[1].answer(POD_ANSWER)
        self.assertEqual(heard(self.calls(WEDGED)), [("PostStopContainer", "app")])  # still waiting for its answer
        self.assertNoResult(drained)  # the drain waits for the wedged server's sequence
        self.clock.advance(59)
        self.calls(WEDGED)[0].answer(CONTAINER_ANSWER)
        self.assertEqual(heard(self.calls(WEDGED)), [("PostStopContainer", "app"), ("PostStopPodSandbox", "web")])
        self.calls(WEDGED)[1].answer(POD_ANSWER)
        self.successResultOf(drained)

    def test_a_server_that_lets_its_timeout_pass_delays_only_its_own_later_post_hooks(self) -> None:
        self.dispatcher.announce(pod_stop("web", ("app", "sidecar"), WEDGED, OTHER))
        for answer in (CONTAINER_ANSWER, CONTAINER_ANSWER, POD_ANSWER):
            self.calls(OTHER)[-1].answer(answer)
        self.assertEqual(len(self.calls(OTHER)), 3)
        self.clock.advance(WEDGED.timeout)  # its own timeout: it is silenced, and its later post hooks skip it
        self.assertEqual(heard(self.calls(WEDGED)), [("PostStopContainer", "app")])
        self.successResultOf(self.dispatcher.drain(30))

    def test_each_server_hears_of_a_pods_containers_before_the_pod_whatever_the_others_do(self) -> None:
        self.dispatcher.announce(pod_stop("web", ("app", "sidecar"), WEDGED, OTHER))
        expected = [("PostStopContainer", "app"), ("PostStopContainer", "sidecar"), ("PostStopPodSandbox", "web")]
        # The other server goes all the way through while the first has not answered its first call.
        for told in range(1, 4):
            self.assertEqual(heard(self.calls(OTHER)), expected[:told])
            self.calls(OTHER)[-1].answer(POD_ANSWER if told == 3 else CONTAINER_ANSWER)
        for told in range(1, 4):
            self.assertEqual(heard(self.calls(WEDGED)), expected[:told])  # one at a time, in the call's order
            self.calls(WEDGED)[-1].answer(POD_ANSWER if told == 3 else CONTAINER_ANSWER)
        self.assertEqual(heard(self.calls(WEDGED)), expected)

    def test_a_failing_servers_post_hooks_go_on_in_order_and_the_others_are_not_affected(self) -> None:
        self.dispatcher.announce(pod_stop("web", ("app",), STRICT, OTHER))
        self.calls(STRICT)[0].answered.errback(RuntimeError("the server's error"))
        self.assertEqual(heard(self.calls(STRICT)), [("PostStopContainer", "app"), ("PostStopPodSandbox", "web")])
        self.assertEqual(heard(self.calls(OTHER)), [("PostStopContainer", "app")])

    def test_the_cut_names_each_call_it_cuts_in_one_warning(self) -> None:
        self.dispatcher.announce(pod_stop("web", ("app", "sidecar"), WEDGED, OTHER))
        self.dispatcher.announce(pod_stop("db", ("pg",), WEDGED))
        self.calls(OTHER)[0].answer(CONTAINER_ANSWER)  # the other server is on its second call of the first
        drained = self.dispatcher.drain(10)
        [running] = [event for event in self.events if "post hooks are still running" in event["log_format"]]
        self.assertEqual(running["count"], 2)  # calls, not sequences
        self.clock.advance(10)
        self.successResultOf(drained)
        cuts = [event for event in self.events if "cut at the stop's bound" in event["log_format"]]
        self.assertEqual(
            sorted((cut["server"], cut["hook"], cut["subject"], cut["rest"]) for cut in cuts),
            [
                ("other.json", "PostStopContainer", "pod default/web container sidecar", "; 1 more post hook call of the same call not made"),
                ("wedged.json", "PostStopContainer", "pod default/db container pg", "; 1 more post hook call of the same call not made"),
                ("wedged.json", "PostStopContainer", "pod default/web container app", "; 2 more post hook calls of the same call not made"),
            ],
        )
        self.assertTrue(all(cut["log_level"] is LogLevel.warn for cut in cuts))
        self.assertTrue(all(pending.answered.called for server in (WEDGED, OTHER) for pending in self.calls(server)))
        self.assertEqual([len(self.calls(server)) for server in (WEDGED, OTHER)], [2, 2])  # nothing made after the cut

    def test_a_retain_of_a_smaller_set_closes_the_channels_of_the_servers_gone(self) -> None:
        self.dispatcher.retain([WEDGED.endpoint, OTHER.endpoint])
        wedged, other = self.clients.get(WEDGED.endpoint), self.clients.get(OTHER.endpoint)
        assert isinstance(wedged, ClosedScriptedClient) and isinstance(other, ClosedScriptedClient)
        self.dispatcher.retain([OTHER.endpoint])
        self.assertEqual((wedged.closed, other.closed), (True, False))
        self.assertIs(self.clients.get(OTHER.endpoint), other)
        self.dispatcher.close()
        self.assertTrue(other.closed)

    def test_a_call_to_a_server_unregistered_meanwhile_closes_its_channel_once_it_ends(self) -> None:
        """A stage under way when a registration goes still calls its server: the channel made for that is
        closed once its calls end, not kept in the clients' dict until some later registration change."""
        self.dispatcher.retain([WEDGED.endpoint])
        registered = self.clients.get(WEDGED.endpoint)
        assert isinstance(registered, ClosedScriptedClient)
        self.dispatcher.announce(pod_stop("web", ("app",), WEDGED))
        self.dispatcher.retain([])  # the registration goes while its server is told of the container
        self.assertFalse(registered.closed)  # its call in flight is not cut
        registered.calls[0].answer(CONTAINER_ANSWER)
        self.assertTrue(registered.closed)  # once its call ended
        client = self.clients.get(WEDGED.endpoint)  # made for the pod's call, which the stage still makes
        assert isinstance(client, ClosedScriptedClient)
        [pending] = client.calls
        self.assertEqual((pending.hook, client.closed), (POST_STOP_POD, False))
        pending.answer(POD_ANSWER)
        self.assertTrue(client.closed)
        self.assertIsNot(self.clients.get(WEDGED.endpoint), client)

    def test_a_call_to_a_server_gone_with_its_registration_fails_at_once_and_lets_its_channel_go(self) -> None:
        clients = HookClients(InlineThreadsReactor())  # real clients: the socket is missing, nothing is dialled
        clients.retain([])
        client = clients.get(WEDGED.endpoint)
        self.failureResultOf(client.call(POST_STOP_CONTAINER, hook.ContainerResourceHookRequest(), 60), HookCallError)
        self.assertIsNot(clients.get(WEDGED.endpoint), client)

    def test_a_server_registered_again_keeps_the_client_its_call_was_made_on(self) -> None:
        self.dispatcher.retain([])
        self.dispatcher.announce(pod_stop("web", ("app",), WEDGED))
        client = self.clients.get(WEDGED.endpoint)
        assert isinstance(client, ClosedScriptedClient)
        self.dispatcher.retain([WEDGED.endpoint])
        self.calls(WEDGED)[0].answer(CONTAINER_ANSWER)
        self.calls(WEDGED)[1].answer(POD_ANSWER)
        self.assertFalse(client.closed)
        self.assertIs(self.clients.get(WEDGED.endpoint), client)
