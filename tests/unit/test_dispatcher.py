"""Hook stages against real hook servers on unix sockets: chaining, policies, timeouts."""

import os
import socket

import grpc
from twisted.internet import reactor
from twisted.internet.defer import Deferred, fail, inlineCallbacks
from twisted.logger import LogLevel
from twisted.trial.unittest import TestCase

from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from koordrp.hooks.client import HookClients
from koordrp.hooks.dispatcher import Dispatcher
from koordrp.hooks.types import FailurePolicy, HookServerConfig, HookType, PostStage
from koordrp.metrics import Metrics
from tests.fake.hook_server import FakeHookServer
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

    def test_a_registered_servers_channel_connects_before_its_first_call(self) -> None:
        # The first call then pays no connection set-up inside its caller's deadline (containerd's, in NRI mode).
        path = os.path.join(self.dir, "listening.sock")
        listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.addCleanup(listening.close)
        listening.bind(path)
        listening.listen(1)
        listening.settimeout(30)  # a bound, not a measure: the connection comes at once, or the test fails
        self.dispatcher.retain(frozenset({path}))
        connection, _ = listening.accept()
        connection.close()

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
        self.dispatcher.announce([PostStage(HookType.POST_STOP_CONTAINER, servers, request)])
        yield self.dispatcher.drain(0.2)
        [cut] = [event for event in self.events if "cut at the stop's bound" in event["log_format"]]
        self.assertEqual((cut["server"], cut["hook"], cut["subject"]), ("wedged.json", "PostStopContainer", "pod default/web container app"))
        self.assertEqual(cut["rest"], "; 1 more post hook call of the same call not made")
        self.assertEqual(other.rpcs(), [])
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
