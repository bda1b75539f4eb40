"""Which servers answer in time (koordrp.hooks.answering), and the dispatcher's stages on the test's clock: a
server silenced by its budget, tried again by a real call after a pause that doubles, never asked twice;
its post hooks, skipped only once it let its own timeout pass; a call kept past the budget for a late answer."""


from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.logger import LogEvent, LogLevel
from twisted.trial.unittest import SynchronousTestCase

from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from koordrp.hooks.answering import FIRST_PAUSE_SECONDS, LONGEST_PAUSE_SECONDS, Admitted, Answering, Silence
from koordrp.hooks.client import HookCallError, HookTimedOut
from koordrp.hooks.dispatcher import Dispatcher
from koordrp.hooks.types import ERROR, HOOK_OK, LATE, NOT_ANSWERING, TIMEOUT, FailurePolicy, HookServerConfig, HookType, PostStage, StageOutcome
from koordrp.metrics import Metrics
from tests.fake.hook_clients import calls_to, scripted_clients
from tests.support.logs import logged_events

CREATE = HookType.PRE_CREATE_CONTAINER
SLOW = HookServerConfig("slow.json", "/run/slow.sock", FailurePolicy.IGNORE, frozenset(HookType), 10.0)
STRICT = HookServerConfig("strict.json", "/run/strict.sock", FailurePolicy.FAIL, frozenset(HookType), 10.0)
BUDGET = 1.9  # containerd's 2 s less koordrp's margin


class Logged(SynchronousTestCase):
    def setUp(self) -> None:
        self.events = logged_events(self)

    def lines(self, level: LogLevel, text: str) -> list[LogEvent]:
        return [e for e in self.events if e.get("log_level") is level and text in e.get("log_format", "")]


PRE = Admitted(BUDGET)  # a pre hook call in NRI mode: containerd's budget, shorter than the server's timeout
OWN = Admitted(SLOW.timeout)  # a post hook call: the server's own timeout


class AnsweringTests(Logged):
    def setUp(self) -> None:
        super().setUp()
        self.clock = Clock()
        self.answering = Answering(self.clock)

    def test_a_timeout_silences_until_a_trial_after_the_pause_and_only_one_call_is_the_trial(self) -> None:
        self.assertEqual(self.answering.admit(SLOW, BUDGET), PRE)
        self.answering.timed_out(SLOW, CREATE, "no answer within 1.9s", PRE)
        self.assertIsInstance(self.answering.admit(SLOW, BUDGET), Silence)
        self.clock.advance(FIRST_PAUSE_SECONDS)
        trial = self.answering.admit(SLOW, BUDGET)
        self.assertEqual(trial, Admitted(BUDGET, trial=True))
        skipped = self.answering.admit(SLOW, BUDGET)  # another call while the trial is under way
        assert isinstance(skipped, Silence)
        self.assertIn("a call is trying it now", skipped.describe(self.clock.seconds()))
        assert isinstance(trial, Admitted)
        self.answering.answered(SLOW, CREATE, trial)
        self.assertEqual(self.answering.admit(SLOW, BUDGET), PRE)
        self.assertEqual(len(self.lines(LogLevel.warn, "did not answer {hook} in time")), 1)
        [back] = self.lines(LogLevel.info, "calls reach it again")
        self.assertEqual((back["budget"], back["seconds"]), (BUDGET, FIRST_PAUSE_SECONDS))

    def test_a_wedged_server_on_the_proxys_default_timeout_is_wedged_not_slow(self) -> None:
        """kubelet's two minutes give a pre hook a hair under the default 60 s: missing that is missing its own."""
        koordlet = HookServerConfig("koordlet.json", "/run/koordlet.sock", FailurePolicy.IGNORE, frozenset(HookType), 60.0)
        self.answering.timed_out(koordlet, CREATE, "no answer within 59.99s", Admitted(59.99))
        [warning] = self.lines(LogLevel.warn, "did not answer {hook} in time")
        self.assertEqual(warning["skipping"], "later calls skip it, its post hooks included")
        self.assertIsInstance(self.answering.admit(koordlet, koordlet.timeout), Silence)  # a post hook too

    def test_each_trial_that_times_out_doubles_the_pause_up_to_the_longest(self) -> None:
        self.answering.timed_out(SLOW, CREATE, "no answer within 1.9s", PRE)
        pauses = []
        for _ in range(8):
            silence = self.answering.admit(SLOW, BUDGET)
            assert isinstance(silence, Silence)
            pauses.append(silence.trial_after - self.clock.seconds())
            self.clock.advance(silence.trial_after - self.clock.seconds())
            trial = self.answering.admit(SLOW, BUDGET)
            assert isinstance(trial, Admitted)
            self.assertTrue(trial.trial)
            self.answering.timed_out(SLOW, CREATE, "no answer within 1.9s", trial)
        self.assertEqual(pauses, [5, 10, 20, 40, 80, 160, LONGEST_PAUSE_SECONDS, LONGEST_PAUSE_SECONDS])
        self.assertEqual(len(self.lines(LogLevel.warn, "did not answer")), 1)  # said once, when it began

    def test_a_trial_that_ends_without_waiting_leaves_the_next_call_a_trial(self) -> None:
        self.answering.timed_out(SLOW, CREATE, "no answer within 1.9s", PRE)
        self.clock.advance(FIRST_PAUSE_SECONDS)
        trial = self.answering.admit(SLOW, BUDGET)
        assert isinstance(trial, Admitted)
        self.answering.unheard(SLOW, trial)  # its socket was gone, or the call was given up
        self.assertEqual(self.answering.admit(SLOW, BUDGET), Admitted(BUDGET, trial=True))

    def test_a_call_made_before_the_silence_that_times_out_too_is_no_trial(self) -> None:
        first, second = self.answering.admit(SLOW, BUDGET), self.answering.admit(SLOW, BUDGET)
        assert isinstance(first, Admitted) and isinstance(second, Admitted)
        self.answering.timed_out(SLOW, CREATE, "no answer within 1.9s", first)
        self.answering.timed_out(SLOW, CREATE, "no answer within 1.9s", second)
        silence = self.answering.admit(SLOW, BUDGET)
        assert isinstance(silence, Silence)
        self.assertEqual(silence.pause, FIRST_PAUSE_SECONDS)

    def test_a_server_that_restarted_gets_the_next_call_as_its_trial_pause_or_not(self) -> None:
        sockets = {SLOW.endpoint: (1, 100)}
        answering = Answering(self.clock, sockets.get)
        answering.timed_out(SLOW, CREATE, "no answer within 1.9s", PRE)
        self.assertIsInstance(answering.admit(SLOW, BUDGET), Silence)
        del sockets[SLOW.endpoint]  # it went away: one trial finds it gone (at once), then calls skip it again
        trial = answering.admit(SLOW, BUDGET)
        assert isinstance(trial, Admitted)
        self.assertTrue(trial.trial)
        answering.unheard(SLOW, trial)
        self.assertIsInstance(answering.admit(SLOW, BUDGET), Silence)
        sockets[SLOW.endpoint] = (1, 101)  # and it is back, on a new socket
        self.assertEqual(answering.admit(SLOW, BUDGET), Admitted(BUDGET, trial=True))

    def test_unregistered_servers_are_forgotten(self) -> None:
        self.answering.timed_out(SLOW, CREATE, "no answer within 1.9s", PRE)
        self.answering.retain([STRICT.endpoint])
        self.assertEqual(self.answering.admit(SLOW, BUDGET), PRE)

    def test_a_budget_shorter_than_its_own_timeout_silences_only_the_calls_that_give_it_no_more(self) -> None:
        """The issue's rule: silenced by the budget calls give it, brought back only by an answer within that
        budget. A post hook may wait the server's own timeout: it still goes to the server, and its answer
        within that timeout (or a late answer) does not end the silence."""
        self.answering.timed_out(SLOW, CREATE, "no answer within 1.9s", PRE)
        [warning] = self.lines(LogLevel.warn, "did not answer {hook} in time")
        self.assertEqual(warning["skipping"], "later pre hook calls with less than its own 10s to give skip it")
        self.assertEqual(warning["posts"], "; its post hooks, which nobody waits for, still get those 10s")
        self.assertEqual(self.answering.admit(SLOW, SLOW.timeout), OWN)
        self.assertIsNone(self.answering.skipping(SLOW, SLOW.timeout))
        self.answering.answered(SLOW, HookType.POST_STOP_CONTAINER, OWN)
        self.assertIsInstance(self.answering.admit(SLOW, BUDGET), Silence)
        self.assertEqual(self.lines(LogLevel.info, "calls reach it again"), [])
        self.clock.advance(FIRST_PAUSE_SECONDS)
        self.assertEqual(self.answering.admit(SLOW, SLOW.timeout), OWN)  # a post hook is never the trial
        self.assertIsNone(self.answering.skipping(SLOW, BUDGET))  # the next pre hook would be
        self.assertEqual(self.answering.admit(SLOW, BUDGET), Admitted(BUDGET, trial=True))

    def test_no_answer_within_its_own_timeout_silences_every_call(self) -> None:
        self.answering.timed_out(SLOW, CREATE, "no answer within 1.9s", PRE)
        self.answering.timed_out(SLOW, HookType.POST_STOP_CONTAINER, "no answer within 10s", OWN)  # a post hook
        silence = self.answering.admit(SLOW, SLOW.timeout)
        assert isinstance(silence, Silence)
        self.assertIs(self.answering.skipping(SLOW, SLOW.timeout), silence)
        self.assertEqual((silence.missed, silence.pause, silence.reason), (SLOW.timeout, FIRST_PAUSE_SECONDS, "no answer within 10s"))
        [deeper] = self.lines(LogLevel.warn, "within its own {timeout:g}s either")
        self.assertEqual(deeper["hook"], HookType.POST_STOP_CONTAINER.value)
        self.clock.advance(FIRST_PAUSE_SECONDS)
        trial = self.answering.admit(SLOW, SLOW.timeout)  # now a post hook can be its trial
        self.assertEqual(trial, Admitted(SLOW.timeout, trial=True))
        assert isinstance(trial, Admitted)
        self.answering.answered(SLOW, HookType.POST_STOP_CONTAINER, trial)
        self.assertEqual(self.answering.admit(SLOW, BUDGET), PRE)

    def test_a_server_that_lets_its_own_timeout_pass_first_is_silenced_for_every_call(self) -> None:
        self.answering.timed_out(SLOW, HookType.POST_STOP_CONTAINER, "no answer within 10s", OWN)
        [warning] = self.lines(LogLevel.warn, "did not answer {hook} in time")
        self.assertEqual((warning["skipping"], warning["posts"]), ("later calls skip it, its post hooks included", ""))
        self.assertIsInstance(self.answering.admit(SLOW, SLOW.timeout), Silence)
        self.assertIsInstance(self.answering.admit(SLOW, BUDGET), Silence)


class StageTests(Logged):
    """The dispatcher's stages against servers the test answers, on its clock."""

    def setUp(self) -> None:
        super().setUp()
        self.clock = Clock()
        self.clients = scripted_clients(self.clock)
        self.metrics = Metrics()
        self.dispatcher = Dispatcher(self.clients, self.clock, self.metrics)

    def stage(self, server: HookServerConfig = SLOW, keep_late: bool = False, budget: float = BUDGET) -> "Deferred[StageOutcome]":
        request = hook.ContainerResourceHookRequest(container_envs={"A": "1"})
        return Deferred.fromCoroutine(self.dispatcher.run(CREATE, (server,), request, budget, keep_late))

    def counted(self, result: str) -> float | None:
        return self.metrics.registry.get_sample_value(
            "koordrp_hook_calls_total", {"server": SLOW.name, "hook": CREATE.value, "result": result}
        )

    def test_eight_creates_two_seconds_apart_with_a_server_answering_in_2_5s_wait_twice_and_it_sees_each_once(self) -> None:
        """The issue's node: a server answering in 2.5 s, containerd's 2 s, a create 2 s after the last. The
        first create waits and silences it; the first after the pause is its trial and waits too; the pause
        doubles, and every other create skips it at once. No request reaches it twice, and each late answer
        ends its call."""
        results, late = [], []
        for _ in range(8):
            before = len(calls_to(self.clients, SLOW.endpoint))
            running = self.stage(keep_late=True)
            calls = calls_to(self.clients, SLOW.endpoint)
            if len(calls) > before:  # it was asked: it answers 2.5 s later
                self.clock.callLater(2.5, calls[-1].answer, hook.ContainerResourceHookResponse(container_envs={"LATE": "1"}))
                self.clock.advance(BUDGET)
            outcome = self.successResultOf(running)
            [call] = outcome.calls
            results.append(f"{call.result} (trial)" if call.trial else call.result)
            if outcome.late is not None:
                late.append(outcome.late.ended)
            self.clock.advance(2.0)
        self.assertEqual(results, [TIMEOUT, NOT_ANSWERING, NOT_ANSWERING, f"{TIMEOUT} (trial)"] + [NOT_ANSWERING] * 4)
        self.assertEqual(len(calls_to(self.clients, SLOW.endpoint)), 2)
        self.assertEqual([self.successResultOf(ended).call.result for ended in late], [LATE, LATE])
        self.assertEqual((self.counted(LATE), self.counted(TIMEOUT), self.counted(NOT_ANSWERING)), (2, None, 6))

    def test_a_trial_answered_within_the_budget_brings_the_server_back_and_its_answer_is_used(self) -> None:
        first = self.stage()
        self.clock.advance(BUDGET)
        self.assertEqual(self.successResultOf(first).calls[0].result, TIMEOUT)
        self.clock.advance(FIRST_PAUSE_SECONDS)
        trial = self.stage()
        calls_to(self.clients, SLOW.endpoint)[-1].answer(hook.ContainerResourceHookResponse(container_envs={"B": "2"}))
        outcome = self.successResultOf(trial)
        [call] = outcome.calls
        assert isinstance(outcome.request, hook.ContainerResourceHookRequest)
        self.assertEqual((call.result, call.trial, dict(outcome.request.container_envs)), (HOOK_OK, True, {"A": "1", "B": "2"}))
        self.assertEqual(len(self.lines(LogLevel.info, "calls reach it again")), 1)
        self.stage()  # and the next call reaches it as any call would
        self.assertEqual(len(calls_to(self.clients, SLOW.endpoint)), 3)

    def test_an_error_the_server_sends_back_within_the_budget_is_an_answer_in_time(self) -> None:
        self.stage()
        self.clock.advance(BUDGET)
        self.clock.advance(FIRST_PAUSE_SECONDS)
        trial = self.stage()
        calls_to(self.clients, SLOW.endpoint)[-1].answered.errback(HookCallError("INTERNAL: oops", sent_back=True))
        self.assertEqual(self.successResultOf(trial).calls[0].result, ERROR)
        self.assertEqual(len(self.lines(LogLevel.info, "calls reach it again")), 1)

    def test_a_kept_call_is_not_cancelled_at_the_budget_and_its_late_answer_ends_it(self) -> None:
        running = self.stage(keep_late=True)
        [pending] = calls_to(self.clients, SLOW.endpoint)
        self.assertEqual(pending.timeout, SLOW.timeout)  # the server's own, not the budget
        self.clock.advance(BUDGET)
        outcome = self.successResultOf(running)
        assert outcome.late is not None
        self.assertEqual((outcome.calls, pending.cancelled), ([outcome.late.call], []))
        self.assertEqual((outcome.late.call.result, outcome.late.call.reason), (TIMEOUT, "no answer within 1.9s"))
        self.assertNoResult(outcome.late.ended)
        self.clock.advance(0.6)
        pending.answer(hook.ContainerResourceHookResponse(container_envs={"LATE": "1"}))
        ended = self.successResultOf(outcome.late.ended)
        self.assertEqual((ended.call.result, round(ended.call.seconds or 0, 3)), (LATE, 2.5))
        assert isinstance(ended.response, hook.ContainerResourceHookResponse)
        self.assertEqual(dict(ended.response.container_envs), {"LATE": "1"})
        assert isinstance(outcome.late.request, hook.ContainerResourceHookRequest)
        self.assertEqual(dict(outcome.late.request.container_envs), {"A": "1"})  # as it was sent
        [warning] = self.lines(LogLevel.warn, "going on without it")
        self.assertIn("is applied later", warning["later"])

    def test_a_kept_call_the_server_never_answers_ends_at_its_own_timeout(self) -> None:
        outcome = self.successResultOf(self.run_past_budget())
        assert outcome.late is not None
        self.clock.advance(SLOW.timeout - BUDGET)
        ended = self.successResultOf(outcome.late.ended)
        self.assertEqual((ended.call.result, ended.response), (TIMEOUT, None))
        self.assertEqual(ended.call.reason, "no answer within 1.9s, nor later: no answer within 10s")
        self.assertEqual(self.counted(TIMEOUT), 1)

    def run_past_budget(self) -> "Deferred[StageOutcome]":
        running = self.stage(keep_late=True)
        self.clock.advance(BUDGET)
        return running

    def test_cancelling_a_late_call_cancels_the_servers_call(self) -> None:
        outcome = self.successResultOf(self.run_past_budget())
        assert outcome.late is not None
        outcome.late.ended.cancel()
        self.assertEqual(len(calls_to(self.clients, SLOW.endpoint)[0].cancelled), 1)
        self.failureResultOf(outcome.late.ended)
        self.assertEqual((self.counted(TIMEOUT), self.counted(LATE)), (1, None))  # as the stage recorded it, once

    def test_a_kept_call_the_server_itself_ends_with_deadline_exceeded_is_a_timeout_not_a_late_answer(self) -> None:
        running = self.stage(keep_late=True)
        self.clock.advance(0.5)
        calls_to(self.clients, SLOW.endpoint)[0].answered.errback(HookTimedOut("no answer within 10s"))  # its own status
        outcome = self.successResultOf(running)
        self.assertIsNone(outcome.late)
        self.assertEqual([call.result for call in outcome.calls], [TIMEOUT])
        self.assertEqual((self.counted(TIMEOUT), self.counted(LATE)), (1, None))

    def test_a_fail_policy_server_is_cut_at_the_budget_as_ever(self) -> None:
        running = self.stage(STRICT, keep_late=True)
        self.clock.advance(BUDGET)
        outcome = self.successResultOf(running)
        self.assertIsNone(outcome.late)
        self.assertIsNotNone(outcome.failure)
        self.assertEqual(len(calls_to(self.clients, STRICT.endpoint)[0].cancelled), 1)

    def test_without_keep_late_the_call_is_cut_at_the_budget(self) -> None:
        running = self.stage()
        [pending] = calls_to(self.clients, SLOW.endpoint)
        self.assertEqual(pending.timeout, BUDGET)
        self.clock.advance(BUDGET)
        self.assertIsNone(self.successResultOf(running).late)
        self.assertEqual(self.counted(TIMEOUT), 1)

    def post(self, hook_type: HookType) -> None:
        """A post hook stage, as a call announces it once it has answered (nobody waits for it)."""
        self.dispatcher.announce([PostStage(hook_type, (SLOW,), hook.ContainerResourceHookRequest())])

    def test_a_server_silenced_by_the_pre_hook_budget_still_gets_its_post_hooks_and_only_a_pre_hook_brings_it_back(self) -> None:
        """The issue's koordlet, slower than containerd's 1.9 s and subscribed to pre and post hooks. Its post
        hooks, which may wait its own 10 s, still reach it while its pre hooks skip it; their answers (2.5 s)
        do not bring it back, so the first create after the pause is its trial, and the pause doubles."""
        answers_in = 2.5
        creates: list[str] = []

        def create() -> None:
            running = self.stage(keep_late=True)
            if not running.called:
                self.clock.callLater(answers_in, calls_to(self.clients, SLOW.endpoint)[-1].answer, hook.ContainerResourceHookResponse())
                self.clock.advance(BUDGET)
            [call] = self.successResultOf(running).calls
            creates.append(f"{call.result} (trial)" if call.trial else call.result)

        def post(hook_type: HookType) -> None:
            self.post(hook_type)
            [made] = [call for call in calls_to(self.clients, SLOW.endpoint) if call.hook is hook_type]
            self.assertEqual(made.timeout, SLOW.timeout)  # its own timeout: nobody waits for it
            self.clock.callLater(answers_in, made.answer, hook.ContainerResourceHookResponse())

        create()  # t=0: waits 1.9 s, silenced until 6.9
        self.clock.advance(0.1)
        post(HookType.POST_STOP_CONTAINER)  # t=2: made, answered at 4.5
        self.clock.advance(1.0)
        create()  # t=3: skipped
        self.clock.advance(4.0)
        post(HookType.POST_START_CONTAINER)  # t=7, after the pause: made, but no trial; answered at 9.5
        self.clock.advance(3.0)
        create()  # t=10: the trial; waits 1.9 s, silenced for 10 s
        self.clock.advance(5.0)
        create()  # t=16.9: skipped
        self.assertEqual(creates, [TIMEOUT, NOT_ANSWERING, f"{TIMEOUT} (trial)", NOT_ANSWERING])
        self.assertEqual(
            [call.hook for call in calls_to(self.clients, SLOW.endpoint)],
            [CREATE, HookType.POST_STOP_CONTAINER, HookType.POST_START_CONTAINER, CREATE],
        )
        self.assertEqual(self.lines(LogLevel.info, "calls reach it again"), [])
        posts = {"server": SLOW.name, "hook": HookType.POST_START_CONTAINER.value, "result": HOOK_OK}
        self.assertEqual(self.metrics.registry.get_sample_value("koordrp_hook_calls_total", posts), 1)
        self.clock.advance(SLOW.timeout)
        self.assertTrue(self.dispatcher.drain(0).called)

    def test_a_server_that_let_its_own_timeout_pass_gets_no_post_hooks_until_a_trial_answers(self) -> None:
        self.post(HookType.POST_STOP_CONTAINER)
        self.clock.advance(SLOW.timeout)  # no answer within its own timeout: wedged
        skipped = self.dispatcher.skips_post(SLOW)
        assert skipped is not None
        self.assertIn("(last: no answer within 10s)", skipped)
        self.post(HookType.POST_STOP_POD_SANDBOX)
        self.assertEqual(self.successResultOf(self.stage()).calls[0].result, NOT_ANSWERING)
        self.assertEqual(len(calls_to(self.clients, SLOW.endpoint)), 1)
        labels = {"server": SLOW.name, "hook": HookType.POST_STOP_POD_SANDBOX.value, "result": NOT_ANSWERING}
        self.assertEqual(self.metrics.registry.get_sample_value("koordrp_hook_calls_total", labels), 1)
        self.clock.advance(FIRST_PAUSE_SECONDS)
        self.assertIsNone(self.dispatcher.skips_post(SLOW))
        self.post(HookType.POST_START_CONTAINER)  # the trial
        calls_to(self.clients, SLOW.endpoint)[-1].answer(hook.ContainerResourceHookResponse())
        self.assertEqual(len(self.lines(LogLevel.info, "calls reach it again")), 1)
        self.stage()  # and a pre hook reaches it again
        self.assertEqual([call.hook for call in calls_to(self.clients, SLOW.endpoint)][-1], CREATE)

    def test_a_kept_call_without_an_answer_within_the_servers_own_timeout_silences_its_post_hooks_too(self) -> None:
        outcome = self.successResultOf(self.run_past_budget())
        assert outcome.late is not None
        self.assertIsNone(self.dispatcher.skips_post(SLOW))  # silenced by the budget: post hooks still reach it
        self.clock.advance(SLOW.timeout - BUDGET)
        self.assertEqual(len(self.lines(LogLevel.warn, "within its own {timeout:g}s either")), 1)
        # Wedged: post hooks skip it too, for a whole pause from now, as the warning says.
        self.post(HookType.POST_STOP_CONTAINER)
        self.assertEqual([call.hook for call in calls_to(self.clients, SLOW.endpoint)], [CREATE])
        self.clock.advance(FIRST_PAUSE_SECONDS)
        # The pause is over: the next post hook is its trial, and others skip it while the trial is under way.
        self.post(HookType.POST_START_CONTAINER)
        self.post(HookType.POST_STOP_CONTAINER)
        self.assertEqual([call.hook for call in calls_to(self.clients, SLOW.endpoint)], [CREATE, HookType.POST_START_CONTAINER])

    def test_a_late_answer_does_not_bring_the_server_back(self) -> None:
        outcome = self.successResultOf(self.run_past_budget())
        assert outcome.late is not None
        self.clock.advance(0.6)
        calls_to(self.clients, SLOW.endpoint)[0].answer(hook.ContainerResourceHookResponse())
        self.assertEqual(self.successResultOf(outcome.late.ended).call.result, LATE)
        self.assertEqual(self.successResultOf(self.stage()).calls[0].result, NOT_ANSWERING)
