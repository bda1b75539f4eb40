"""The call log line: each hook server with its outcome and what its answer changed, env values never."""

import json
from typing import Any, cast

from twisted.trial.unittest import SynchronousTestCase

from koordrp.calllog import MAX_LISTED, CallRecord, call_text, field_name
from koordrp.hooks.messages import Change, ContainerHookRequest
from koordrp.hooks.types import ERROR, HOOK_OK, LATE, SENT, SKIPPED, TIMEOUT, FailurePolicy, HookCall, HookServerConfig, HookType

KOORDLET = HookServerConfig("koordlet.json", "/run/k.sock", FailurePolicy.IGNORE, frozenset(HookType), 2.0)
STRICT = HookServerConfig("strict.json", "/run/s.sock", FailurePolicy.FAIL, frozenset(HookType), 2.0)
CREATE = HookType.PRE_CREATE_CONTAINER


class CallTextTests(SynchronousTestCase):
    def test_an_answer_that_changed_things(self) -> None:
        changes = (
            Change("pod_cgroup_parent", "/kubepods/burstable/pod1", "/kubepods/besteffort/pod1"),
            Change("container_resources.cpuset_cpus", "0-3", "2-3"),
            Change("container_resources.cpu_shares", 2, 512),
            Change("container_envs[KOORDLET_SEEN]", added=True),
            Change("container_envs[PATH]"),
            Change("container_annotations[note]", added=True),
        )
        self.assertEqual(
            call_text(HookCall(KOORDLET, CREATE, HOOK_OK, 0.00061, changes)),
            'PreCreateContainer@koordlet.json: ok 0.6 ms, changed cgroup_parent "/kubepods/burstable/pod1"→'
            '"/kubepods/besteffort/pod1", resources.cpuset_cpus "0-3"→"2-3", resources.cpu_shares 2→512, '
            "envs +KOORDLET_SEEN, envs ~PATH, annotations +note",
        )

    def test_failures_say_what_the_policy_made_of_them(self) -> None:
        self.assertEqual(
            call_text(HookCall(STRICT, HookType.PRE_RUN_POD_SANDBOX, TIMEOUT, 2.0004, reason="no answer within 2s")),
            "PreRunPodSandbox@strict.json: timeout 2000.4 ms (no answer within 2s; Fail policy: the call failed)",
        )
        self.assertEqual(
            call_text(HookCall(KOORDLET, CREATE, ERROR, 0.0012, reason="UNAVAILABLE: connection refused")),
            "PreCreateContainer@koordlet.json: error 1.2 ms (UNAVAILABLE: connection refused; went on without it)",
        )

    def test_what_the_front_end_could_not_write_is_named_with_why_and_the_rest_stays_changed(self) -> None:
        record = CallRecord("CreateContainer")
        changes = (
            Change("container_resources.cpuset_cpus", "0-1", ""),
            Change("container_resources.oom_score_adj", 0, 5),
            Change("container_envs[SEEN]", added=True),
        )
        record.add([HookCall(KOORDLET, CREATE, HOOK_OK, 0.001, changes), HookCall(KOORDLET, HookType.POST_STOP_CONTAINER, SENT)])
        record.leave_alone(CREATE, "container_resources.cpuset", "NRI can set a cpuset but not clear it")
        record.leave_alone(CREATE, "container_resources.oom", "NRI cannot set a container's OOM score")
        self.assertEqual(
            call_text(record.calls[0]),
            "PreCreateContainer@koordlet.json: ok 1.0 ms, changed envs +SEEN, "
            'left alone (NRI can set a cpuset but not clear it) resources.cpuset_cpus "0-1"→"", '
            "left alone (NRI cannot set a container's OOM score) resources.oom_score_adj 0→5",
        )
        self.assertEqual([field_name(change) for _, change in record.left_alone()], ["resources.cpuset_cpus", "resources.oom_score_adj"])
        self.assertEqual(
            record.fields("OK", 0.01)["hook_calls"][0]["left_alone"],  # type: ignore[index]
            ['resources.cpuset_cpus "0-1"→"" (NRI can set a cpuset but not clear it)',
             "resources.oom_score_adj 0→5 (NRI cannot set a container's OOM score)"],
        )

    def test_a_trial_and_a_late_answer_say_so(self) -> None:
        self.assertEqual(
            call_text(HookCall(KOORDLET, CREATE, TIMEOUT, 1.9, reason="no answer within 1.9s", trial=True)),
            "PreCreateContainer@koordlet.json: timeout 1900.0 ms (trial; no answer within 1.9s; went on without it)",
        )
        self.assertEqual(
            call_text(HookCall(KOORDLET, CREATE, HOOK_OK, 0.5, trial=True)),
            "PreCreateContainer@koordlet.json: ok 500.0 ms (trial: it answers in time again)",
        )
        changes = (
            Change("container_resources.cpu_shares", 2, 512),
            Change("container_envs[LATE]", added=True, applied=False, why="late"),
        )
        self.assertEqual(
            call_text(HookCall(KOORDLET, CREATE, LATE, 2.5, changes, reason="no answer within 1.9s")),
            "PreCreateContainer@koordlet.json: late 2500.0 ms (no answer within 1.9s: went on without it, then applied "
            "what could change), changed resources.cpu_shares 2→512, left alone (late) envs +LATE",
        )

    def test_calls_not_waited_for_or_not_made(self) -> None:
        self.assertEqual(call_text(HookCall(KOORDLET, HookType.POST_STOP_CONTAINER, SENT)), "PostStopContainer@koordlet.json: sent")
        self.assertEqual(call_text(HookCall(KOORDLET, CREATE, "skipped")), "PreCreateContainer@koordlet.json: skipped")


class RecordTests(SynchronousTestCase):
    def test_the_same_facts_as_fields_for_json_logs_and_no_env_value_anywhere(self) -> None:
        record = CallRecord("CreateContainer", ContainerHookRequest(container_envs={"TOKEN": "s3cr3t"}))
        record.add([HookCall(KOORDLET, CREATE, HOOK_OK, 0.0005, (Change("container_envs[TOKEN]"),))])
        fields = record.fields("OK", 0.0142)
        self.assertEqual(fields["hooks"], "PreCreateContainer@koordlet.json: ok 0.5 ms, changed envs ~TOKEN")
        self.assertEqual(
            fields["hook_calls"],
            [{"hook": "PreCreateContainer", "server": "koordlet.json", "result": "ok", "duration_ms": 0.5,
              "changed": ["envs ~TOKEN"], "left_alone": [], "reason": "", "trial": False}],
        )
        self.assertNotIn("s3cr3t", json.dumps({key: value for key, value in fields.items()}))
        self.assertEqual(CallRecord("RunPodSandbox").fields("OK", 0.01)["hooks"], "none")

    def test_a_call_is_uneventful_only_if_it_called_or_spared_no_server_and_ended_ok_with_nothing_to_say(self) -> None:
        self.assertTrue(CallRecord("StartContainer").uneventful("OK"))
        self.assertFalse(CallRecord("StartContainer").uneventful("NOT-CONFIRMED"))
        spared = CallRecord("StartContainer", calls=[HookCall(KOORDLET, HookType.PRE_START_CONTAINER, SKIPPED)])
        self.assertFalse(spared.uneventful("OK"))
        self.assertFalse(CallRecord("StartContainer", why="containerd told of a stop first").uneventful("OK"))
        self.assertFalse(CallRecord("StartContainer", asked_lost=True).uneventful("OK"))


class BoundedLineTests(SynchronousTestCase):
    """Whatever an answer sent, its line is safe to read and of bounded size."""

    def test_keys_values_and_reasons_are_escaped_never_written_raw(self) -> None:
        changes = (
            Change("container_envs[A\x00B]", added=True),
            Change("container_annotations[line\nbreak]", added=True),
            Change("container_resources.unified[cpu.max]", None, "max\x00\x1b[31m", added=True),
            Change("pod_cgroup_parent", "/kubepods/p", '/kubepods/"q"\u2028'),
        )
        text = call_text(HookCall(KOORDLET, CREATE, HOOK_OK, 0.001, changes))
        self.assertEqual(
            text,
            "PreCreateContainer@koordlet.json: ok 1.0 ms, changed envs +A\\x00B, annotations +line\\nbreak, "
            'resources.unified[cpu.max] None→"max\\x00\\x1b[31m", cgroup_parent "/kubepods/p"→"/kubepods/\\"q\\"\\u2028"',
        )
        failed = call_text(HookCall(STRICT, CREATE, ERROR, 0.001, reason="FAILED_PRECONDITION: no\x00pe\nreally"))
        self.assertEqual(failed, "PreCreateContainer@strict.json: error 1.0 ms (FAILED_PRECONDITION: no\\x00pe really; Fail policy: the call failed)")
        for line in (text, failed):
            self.assertTrue(line.isprintable(), line)

    def test_a_call_names_at_most_so_many_changes_of_each_kind(self) -> None:
        changes = tuple(Change(f"container_envs[VAR_{index:05}]", added=True) for index in range(10_000))
        refused = tuple(
            Change(f"container_envs[BAD{index}=]", applied=False, why="a name with =", refused=True) for index in range(50)
        )
        call = HookCall(KOORDLET, CREATE, HOOK_OK, 0.001, changes + refused)
        text = call_text(call)
        self.assertLess(len(text), 1000)
        self.assertIn(", envs +VAR_00009, … and 9990 more, refused envs[BAD0=]: a name with =", text)
        self.assertTrue(text.endswith(", … and 40 more"), text)
        record = CallRecord("CreateContainer", calls=[call])
        fields = record.fields("OK", 0.01)
        [hook_call] = cast(list[dict[str, Any]], fields["hook_calls"])
        self.assertEqual(len(hook_call["changed"]), MAX_LISTED + 1)
        self.assertEqual(hook_call["changed"][-1], "… and 9990 more")
        self.assertEqual(hook_call["left_alone"][:2], ["refused envs[BAD0=]: a name with =", "refused envs[BAD1=]: a name with ="])
        self.assertLess(len(json.dumps(fields)), 3000)

    def test_a_refused_field_is_named_with_its_value_where_values_are_shown_and_why(self) -> None:
        changes = (
            Change("container_resources.cpu_shares", 2, 512),
            Change("container_resources.cpuset_cpus", None, "abc", applied=False, why="not a cpu list", refused=True),
            Change("container_annotations[big]", applied=False, why="4192003 bytes, beyond the 262144 one answer may change in a map", refused=True),
        )
        record = CallRecord("CreateContainer", calls=[HookCall(KOORDLET, CREATE, HOOK_OK, 0.001, changes)])
        record.leave_alone(CREATE, "container_resources.cpu", "NRI cannot")  # what is refused keeps its reason
        self.assertEqual(
            call_text(record.calls[0]),
            'PreCreateContainer@koordlet.json: ok 1.0 ms, left alone (NRI cannot) resources.cpu_shares 2→512, refused '
            'resources.cpuset_cpus "abc": not a cpu list, refused annotations[big]: 4192003 bytes, beyond the 262144 one '
            "answer may change in a map",
        )
