"""The rules that merge hook answers into hook requests (koordrp.hooks.messages)."""

import copy
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from koordrp.cri import translate
from koordrp import text
from koordrp.hooks import messages, validation
from koordrp.nri.wire import MAX_TTRPC_MESSAGE
from koordrp.sdk import reply as sdk_reply
from tests.unit.test_cri_translate import run_pod_request


class MergeTests(SynchronousTestCase):
    def test_numbers_keep_what_the_answer_leaves_unset_and_the_cpuset_is_the_answers(self) -> None:
        target = hook.LinuxContainerResources(
            cpu_period=100000, cpu_quota=50000, cpu_shares=2, memory_limit_in_bytes=10, oom_score_adj=500,
            cpuset_cpus="0-1", cpuset_mems="0", unified={"a": "1"},
            hugepage_limits=[hook.HugepageLimit(page_size="2MB", limit=1)],
        )
        messages.merge_resources(target, hook.LinuxContainerResources())
        self.assertEqual(target.cpu_quota, 50000)
        self.assertEqual(target.oom_score_adj, 500)
        self.assertEqual((target.cpuset_cpus, target.cpuset_mems), ("", ""))  # koordlet clears a cpuset so
        self.assertEqual(len(target.hugepage_limits), 1)
        messages.merge_resources(
            target,
            hook.LinuxContainerResources(
                cpu_quota=-1, cpu_shares=512, oom_score_adj=-5, cpuset_cpus="3", unified={"b": "2"},
                hugepage_limits=[hook.HugepageLimit(page_size="1GB", limit=2)],
            ),
        )
        self.assertEqual((target.cpu_quota, target.cpu_shares, target.oom_score_adj), (-1, 512, -5))
        self.assertEqual((target.cpuset_cpus, target.cpuset_mems), ("3", ""))
        self.assertEqual(dict(target.unified), {"a": "1", "b": "2"})
        self.assertEqual([h.page_size for h in target.hugepage_limits], ["1GB"])
        self.assertEqual((target.cpu_period, target.memory_limit_in_bytes), (100000, 10))

    def test_copy_changed_sets_only_the_fields_of_the_changes_applied(self) -> None:
        sent = hook.ContainerResourceHookRequest(container_resources=hook.LinuxContainerResources(cpu_shares=2, cpuset_cpus="0-3"))
        answered = messages.copied(sent)
        changes = messages.merge_container_response(
            answered,
            hook.ContainerResourceHookResponse(
                container_resources=hook.LinuxContainerResources(
                    cpu_shares=512, cpuset_cpus="", unified={"cpu.idle": "1"}, hugepage_limits=[hook.HugepageLimit(page_size="2MB", limit=4)]
                ),
                container_envs={"LATE": "1"},
            ),
        )
        target = hook.ContainerResourceHookRequest(
            container_resources=hook.LinuxContainerResources(cpu_shares=2, cpuset_cpus="0-3", memory_limit_in_bytes=1 << 30),
            container_envs={"A": "1"},
        )
        kept = messages.left_alone(messages.left_alone(changes, "container_envs", "late"), "container_resources.cpuset", "no")
        messages.copy_changed(target, answered, kept)
        resources = target.container_resources
        self.assertEqual((resources.cpu_shares, resources.cpuset_cpus, resources.memory_limit_in_bytes), (512, "0-3", 1 << 30))
        self.assertEqual((dict(resources.unified), [(h.page_size, h.limit) for h in resources.hugepage_limits]), ({"cpu.idle": "1"}, [("2MB", 4)]))
        self.assertEqual(dict(target.container_envs), {"A": "1"})

    def test_a_kubelet_update_folds_in_only_the_cpuset_it_sets(self) -> None:
        stored = hook.ContainerResourceHookRequest(
            container_resources=hook.LinuxContainerResources(cpu_shares=2, cpuset_cpus="0-1", cpuset_mems="0")
        )
        folded = messages.folded_update(stored, "c-1", hook.LinuxContainerResources(cpu_shares=512), {})
        target = folded.container_resources
        self.assertEqual((target.cpu_shares, target.cpuset_cpus, target.cpuset_mems), (512, "0-1", "0"))
        folded = messages.folded_update(folded, "c-1", hook.LinuxContainerResources(cpuset_cpus="3"), {})
        target = folded.container_resources
        self.assertEqual((target.cpu_shares, target.cpuset_cpus), (512, "3"))

    def test_a_folded_update_is_the_stored_container_with_its_id_and_the_updates_annotations(self) -> None:
        stored = hook.ContainerResourceHookRequest(
            container_meta=hook.ContainerMetadata(name="app"),
            container_annotations={"a": "1"},
            container_resources=hook.LinuxContainerResources(cpu_shares=2),
            pod_cgroup_parent="/p",
        )
        original = copy.deepcopy(stored)
        folded = messages.folded_update(stored, "c-1", None, {"b": "2"})
        self.assertEqual(stored, original)  # the stored copy is untouched
        self.assertEqual((folded.container_meta.name, folded.container_meta.id), ("app", "c-1"))
        self.assertEqual(dict(folded.container_annotations), {"a": "1", "b": "2"})
        self.assertEqual(folded.container_resources, stored.container_resources)  # no resources named: all kept
        self.assertEqual(folded.pod_cgroup_parent, "/p")

    def test_placed_in_pod_takes_the_stored_pods_parent_and_kubelets_when_it_has_none(self) -> None:
        pod = translate.pod_hook_request(run_pod_request())
        pod.cgroup_parent = "/moved/by/a/hook"
        container = hook.ContainerResourceHookRequest(
            pod_cgroup_parent="/kubepods/pod-u-1", pod_labels={"stale": "1"},
            pod_resources=hook.LinuxContainerResources(cpu_shares=7),
        )
        placed = messages.placed_in_pod(container, pod)
        self.assertIs(placed, container)
        self.assertEqual(placed.pod_cgroup_parent, "/moved/by/a/hook")
        self.assertEqual(placed.pod_meta, pod.pod_meta)
        self.assertEqual(dict(placed.pod_labels), {"app": "web"})
        self.assertEqual(dict(placed.pod_annotations), {"note": "a"})
        self.assertEqual(placed.pod_resources, pod.resources)
        pod.cgroup_parent = ""
        pod.ClearField("resources")
        container = hook.ContainerResourceHookRequest(
            pod_cgroup_parent="/kubepods/pod-u-1", pod_resources=hook.LinuxContainerResources(cpu_shares=7)
        )
        placed = messages.placed_in_pod(container, pod)
        self.assertEqual(placed.pod_cgroup_parent, "/kubepods/pod-u-1")
        self.assertFalse(placed.HasField("pod_resources"))

    def test_negative_numbers_where_only_positive_make_sense_are_ignored(self) -> None:
        target = hook.LinuxContainerResources(cpu_shares=2, memory_limit_in_bytes=10)
        messages.merge_resources(target, hook.LinuxContainerResources(cpu_shares=-1, memory_limit_in_bytes=-1))
        self.assertEqual((target.cpu_shares, target.memory_limit_in_bytes), (2, 10))

    def test_container_response_merges_maps_and_replaces_cgroup_parent(self) -> None:
        request = hook.ContainerResourceHookRequest(
            container_annotations={"a": "1"}, container_envs={"X": "1"}, pod_cgroup_parent="/p"
        )
        messages.merge_container_response(
            request, hook.ContainerResourceHookResponse(container_annotations={"b": "2"}, container_envs={"Y": "2"})
        )
        self.assertEqual(dict(request.container_annotations), {"a": "1", "b": "2"})
        self.assertEqual(dict(request.container_envs), {"X": "1", "Y": "2"})
        self.assertEqual(request.pod_cgroup_parent, "/p")
        self.assertFalse(request.HasField("container_resources"))
        messages.merge_container_response(request, hook.ContainerResourceHookResponse(pod_cgroup_parent="/q"))
        self.assertEqual(request.pod_cgroup_parent, "/q")

    def test_pod_response(self) -> None:
        answer = hook.PodSandboxHookResponse(
            labels={"tier": "gold"}, cgroup_parent="/kubepods/besteffort", resources=hook.LinuxContainerResources(cpu_shares=2)
        )
        pod = translate.pod_hook_request(run_pod_request())
        changes = messages.merge_pod_response(pod, answer)
        self.assertEqual(dict(pod.labels), {"app": "web", "tier": "gold"})
        self.assertEqual(pod.cgroup_parent, "/kubepods/besteffort")
        # koordlet echoes pod-level resources it does not mean to set: named, left alone.
        self.assertEqual((pod.resources.cpu_shares, pod.resources.memory_limit_in_bytes), (1024, 1 << 30))
        self.assertEqual([(change.path, change.applied) for change in changes][-1], ("resources.cpu_shares", False))
        pod = translate.pod_hook_request(run_pod_request())
        messages.merge_pod_response(pod, answer, apply_resources=True)
        self.assertEqual((pod.resources.cpu_shares, pod.resources.memory_limit_in_bytes), (2, 1 << 30))

    def test_a_merge_says_what_it_changed_without_env_values(self) -> None:
        request = hook.ContainerResourceHookRequest(
            container_envs={"A": "1", "SECRET": "old"},
            container_resources=hook.LinuxContainerResources(cpu_shares=2, cpuset_cpus="0-3", unified={"a": "1"}),
            pod_cgroup_parent="/p",
        )
        answer = sdk_reply(request)
        self.assertEqual(messages.merge_response(copy.deepcopy(request), answer), [])  # a copy changes nothing
        answer.container_envs.update({"B": "2", "SECRET": "new"})
        answer.container_resources.cpuset_cpus = "2-3"
        answer.container_resources.unified["b"] = "2"
        answer.pod_cgroup_parent = "/q"
        changes = messages.merge_response(request, answer)
        self.assertEqual(
            sorted(changes, key=lambda change: change.path),
            [
                messages.Change("container_envs[B]", added=True),
                messages.Change("container_envs[SECRET]"),
                messages.Change("container_resources.cpuset_cpus", "0-3", "2-3"),
                messages.Change("container_resources.unified[b]", None, "2", added=True),
                messages.Change("pod_cgroup_parent", "/p", "/q"),
            ],
        )


POD_PARENT = "/kubepods/besteffort/pod1"
BESTEFFORT_SLICE = "kubepods-besteffort-pod1.slice"


def container_request(**fields: object) -> hook.ContainerResourceHookRequest:
    request = hook.ContainerResourceHookRequest(
        pod_cgroup_parent=POD_PARENT,
        container_envs={"A": "1"},
        container_resources=hook.LinuxContainerResources(cpu_shares=2, cpuset_cpus="0-3", memory_limit_in_bytes=1 << 30),
    )
    for name, value in fields.items():
        setattr(request, name, value)
    return request


def resources_answer(**fields: Any) -> hook.ContainerResourceHookResponse:
    """An answer built from the request (as reply() builds one) with ``fields`` of its resources changed."""
    answer = sdk_reply(container_request())
    for name, value in fields.items():
        if name == "hugepage_limits":
            answer.container_resources.hugepage_limits.extend(value)
        elif name == "unified":
            answer.container_resources.unified.update(value)
        else:
            setattr(answer.container_resources, name, value)
    return answer


class ValidationTests(SynchronousTestCase):
    """Each rule of koordrp.hooks.validation at its edges: what an answer may change, and what is refused, with why."""

    def refused(self, answer: messages.HookResponse, request: messages.HookRequest | None = None, **options: bool) -> list[tuple[str, str]]:
        checked = validation.check(request if request is not None else container_request(), answer, **options)
        return [(refused.path, refused.why) for refused in checked.refused]

    def assert_resource(self, name: str, good: list[object], bad: list[object]) -> None:
        for value in good:
            self.assertEqual(self.refused(resources_answer(**{name: value})), [], (name, value))
        for value in bad:
            [(path, _)] = self.refused(resources_answer(**{name: value}))
            self.assertEqual(path, f"container_resources.{name}", (name, value))

    def test_cgroup_parents_are_absolute_normalised_and_within_the_root_of_the_requests_own(self) -> None:
        cases = [
            # the request's own parent, the answer's, and why it is refused ("" if it is not)
            (POD_PARENT, "/kubepods/burstable/pod1", ""),
            (POD_PARENT, "/kubepods", ""),
            (POD_PARENT, "/kubepods/../../escape", "has a .. part"),
            (POD_PARENT, "../../escape2", "neither an absolute path nor a systemd slice name"),
            (POD_PARENT, "kubepods/burstable", "neither an absolute path nor a systemd slice name"),
            (POD_PARENT, "/escape", f"outside /kubepods, where the request's own parent \"{POD_PARENT}\" lives"),
            (POD_PARENT, "/kubepods-other/pod1", f"outside /kubepods, where the request's own parent \"{POD_PARENT}\" lives"),
            (POD_PARENT, "/kubepods//pod1", "not normalised (an empty or . part)"),
            (POD_PARENT, "/kubepods/pod1/", "not normalised (an empty or . part)"),
            (POD_PARENT, "/kubepods/./pod1", "not normalised (an empty or . part)"),
            (POD_PARENT, "//kubepods/pod1", "not normalised (an empty or . part)"),
            (POD_PARENT, "/kubepods/pod\n1", "has a control character"),
            (POD_PARENT, "/kubepods/pod\x001", "has a control character"),
            (POD_PARENT, "/kubepods/" + "p" * 4086, ""),
            (POD_PARENT, "/kubepods/" + "p" * 4087, "4097 characters, beyond PATH_MAX (4096)"),
            (POD_PARENT, "kubepods-burstable.slice", f"a systemd slice name, where the request's own parent \"{POD_PARENT}\" is a path"),
            # systemd's slice names: the same top slice
            (BESTEFFORT_SLICE, "kubepods-burstable-pod1.slice", ""),
            (BESTEFFORT_SLICE, "kubepods.slice", ""),
            (BESTEFFORT_SLICE, "system-escape.slice", f"outside the top slice kubepods.slice, where the request's own parent \"{BESTEFFORT_SLICE}\" lives"),
            (BESTEFFORT_SLICE, "kubepods--x.slice", "neither an absolute path nor a systemd slice name"),
            (BESTEFFORT_SLICE, "/kubepods/x", f"a path, where the request's own parent \"{BESTEFFORT_SLICE}\" is a systemd slice name"),
            # a path of slices, as Docker mode shows dockerd's: its first component
            ("/kubepods.slice/kubepods-besteffort.slice/" + BESTEFFORT_SLICE, "/kubepods.slice/kubepods-burstable.slice/moved.slice", ""),
            ("/kubepods.slice/kubepods-besteffort.slice/" + BESTEFFORT_SLICE, "/system.slice/moved.slice", "outside /kubepods.slice, where the request's own parent \"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1.slice\" lives"),
            # a request with no parent of its own: any well-formed one
            ("", "/koordrp-e2e", ""),
            ("", "kubepods.slice", ""),
            ("", "/", "the hierarchy's root, no cgroup of its own"),
            ("", "../x", "neither an absolute path nor a systemd slice name"),
            ("/", "/anywhere", ""),
        ]
        for own, value, why in cases:
            self.assertEqual(validation.cgroup_parent_error(value, own), why or None, (own, value[:50]))
            pod = hook.PodSandboxHookRequest(cgroup_parent=own)
            self.assertEqual(self.refused(hook.PodSandboxHookResponse(cgroup_parent=value), pod), [("cgroup_parent", why)] if why else [])
            container = container_request(pod_cgroup_parent=own)
            answer = hook.ContainerResourceHookResponse(pod_cgroup_parent=value)
            self.assertEqual(self.refused(answer, container), [("pod_cgroup_parent", why)] if why else [])

    def test_cpusets_are_cpu_lists_and_the_empty_one_clears(self) -> None:
        for good in ("", "0", "0-3,5", "7,1", "0-8191", "3-3"):
            self.assertIsNone(validation.cpu_list_error(good), good)
        for bad, why in (
            ("abc", "not a cpu list"),
            ("0-", "not a cpu list"),
            ("-1", "not a cpu list"),
            ("0,,1", "not a cpu list"),
            (" 0", "not a cpu list"),
            ("0\n", "not a cpu list"),
            ("0x1", "not a cpu list"),
            ("\u0661", "not a cpu list"),  # a digit, but not one the kernel reads
            ("3-1", "not a cpu list: 3-1 runs backwards"),
            ("0-8192", "cpu 8192 is beyond the kernel's 8191"),
        ):
            self.assertEqual(validation.cpu_list_error(bad), why, bad)
        self.assert_resource("cpuset_cpus", ["", "1", "0-1,3"], ["abc", "0-8192"])
        self.assert_resource("cpuset_mems", ["", "0", "0-1023"], ["1024", "0;1"])
        self.assertEqual(self.refused(resources_answer(cpuset_mems="1024")), [("container_resources.cpuset_mems", "memory node 1024 is beyond the kernel's 1023")])

    def test_numbers_within_what_the_kernel_takes(self) -> None:
        # -1 is koordlet's "unset" (a best-effort container's memory): the merge takes none of it, nor is it refused.
        self.assert_resource("cpu_shares", [0, -1, 2, 262144], [1, 262145, 1 << 62, -2])
        self.assert_resource("cpu_quota", [0, -1, 1000, (1 << 44) - 1], [-2, 1, 999, 1 << 44])
        self.assert_resource("cpu_period", [0, -1, 1000, 1000000], [-2, 999, 1000001])
        self.assert_resource("memory_limit_in_bytes", [0, -1, 4096, 1 << 40], [-2, 4095])
        self.assert_resource("memory_swap_limit_in_bytes", [0, -1, 4096], [-2, 1])
        self.assert_resource("oom_score_adj", [0, -1000, 1000], [-1001, 1001])
        self.assertEqual(self.refused(resources_answer(cpu_shares=-2)), [("container_resources.cpu_shares", "outside the kernel's 2..262144")])
        self.assertEqual(self.refused(resources_answer(memory_limit_in_bytes=-2)), [("container_resources.memory_limit_in_bytes", "a negative limit")])

    def test_koordlets_answer_for_a_best_effort_container_is_taken_as_koordinator_takes_it(self) -> None:
        """koordlet answers with a copy of the request and its changes: cpu quota -1, memory -1 (unset), the cpuset
        cleared."""
        answer = resources_answer(cpu_quota=-1, memory_limit_in_bytes=-1, cpuset_cpus="")
        self.assertEqual(self.refused(answer), [])

    def test_hugepage_limits_name_page_sizes_the_kernel_names_once_each(self) -> None:
        limit = hook.HugepageLimit
        self.assert_resource(
            "hugepage_limits",
            [[limit(page_size="2MB", limit=1 << 21)], [limit(page_size="1GB", limit=0), limit(page_size="64KB", limit=1)]],
            [[limit(page_size="2M", limit=1)], [limit(page_size="0MB", limit=1)], [limit(page_size="2MB"), limit(page_size="2MB")],
             [limit(page_size=f"{size}MB") for size in range(1, 18)]],
        )

    def test_unified_keys_are_cgroup_file_names_and_values_one_line(self) -> None:
        self.assertEqual(self.refused(resources_answer(unified={"cpu.max": "max 100000", "memory.high": "1G"})), [])
        for key, value, why in (
            ("../cpu.max", "1", "not a cgroup file name"),
            ("a/b", "1", "not a cgroup file name"),
            ("", "1", "not a cgroup file name"),
            ("..", "1", "not a cgroup file name"),
            ("cpu.max\n", "1", "not a cgroup file name"),
            ("cpu.max", "1\n2", "a value with a NUL byte or a newline"),
            ("cpu.max", "1\x00", "a value with a NUL byte or a newline"),
            ("x" * 256, "1", "a file name beyond NAME_MAX (255)"),
            ("cpu.max", "1" * 4097, "4097 bytes, beyond the 4096 a cgroup file takes"),
        ):
            self.assertEqual(self.refused(resources_answer(unified={key: value})), [(f"container_resources.unified[{key}]", why)])

    def test_environment_names_and_values_the_kernel_can_give_a_process(self) -> None:
        big = "v" * (validation.MAX_ENV_ENTRY - 3)  # "K=" + value + NUL: the kernel's bound exactly
        self.assertEqual(self.refused(hook.ContainerResourceHookResponse(container_envs={"B": "2", "K": big})), [])
        for key, value, why in (
            ("", "1", "an empty name"),
            ("A=B", "1", "a name with ="),
            ("A\x00B", "1", "a name with a NUL byte"),
            ("B", "a\x00b", "a value with a NUL byte"),
            ("K", big + "v", f"{validation.MAX_ENV_ENTRY + 1} bytes, beyond the kernel's {validation.MAX_ENV_ENTRY} for one variable"),
        ):
            answer = hook.ContainerResourceHookResponse(container_envs={key: value, "GOOD": "1"})
            self.assertEqual(self.refused(answer), [(f"container_envs[{key}]", why)])

    def test_labels_and_annotations_are_bounded(self) -> None:
        pod = hook.PodSandboxHookRequest(cgroup_parent=POD_PARENT)
        self.assertEqual(self.refused(hook.PodSandboxHookResponse(labels={"k": "v" * 4095}), pod), [])
        self.assertEqual(
            sorted(self.refused(hook.PodSandboxHookResponse(labels={"k": "v" * 4096, "": "1"}), pod)),
            [("labels[]", "an empty key"), ("labels[k]", "4097 bytes, beyond containerd's 4096 for a label")],
        )
        limit = validation.MAX_MAP_CHANGES
        self.assertEqual(self.refused(hook.ContainerResourceHookResponse(container_annotations={"k": "v" * (limit - 1)})), [])
        self.assertEqual(
            self.refused(hook.ContainerResourceHookResponse(container_annotations={"big": "v" * 4_192_000, "small": "1"})),
            [("container_annotations[big]", f"4192003 bytes, beyond the {limit} one answer may change in a map")],
        )
        # Entries each within the bound, together beyond it: the map's changes are refused as one.
        many = {f"k{index}": "v" * (limit // 4) for index in range(4)}
        self.assertEqual(
            self.refused(hook.PodSandboxHookResponse(annotations=many), pod),
            [("annotations", f"its changes come to {4 * (limit // 4) + 8} bytes, beyond the {limit} one answer may change in a map")],
        )

    def test_the_request_as_answered_stays_within_what_the_runtimes_transport_carries(self) -> None:
        """ttrpc's 4 MiB, less room for what containerd's message holds beside what hooks are shown."""
        self.assertEqual(validation.TRANSPORT_LIMIT, MAX_TTRPC_MESSAGE)
        request = container_request()
        for index in range(15):  # kubelet's own: 3.75 MB
            request.container_annotations[f"kubelet{index}"] = "k" * 250_000
        grown = hook.ContainerResourceHookResponse(container_annotations={"a": "v" * 200_000}, container_envs={"E": "v" * 100_000})
        self.assertEqual(validation.check(request, hook.ContainerResourceHookResponse(container_envs={"E": "1"})).refused, ())
        checked = validation.check(request, grown)
        assert isinstance(checked.response, hook.ContainerResourceHookResponse)
        self.assertEqual([refused.path for refused in checked.refused], ["container_annotations"])  # the larger goes first
        self.assertIn(f"beyond the {validation.MAX_REQUEST} that leave room for the rest of the runtime's message", checked.refused[0].why)
        self.assertEqual((dict(checked.response.container_annotations), dict(checked.response.container_envs)), ({}, {"E": "v" * 100_000}))

    def test_only_what_the_answer_would_change_is_checked(self) -> None:
        """kubelet's own values, echoed by reply(request), go to the runtime as kubelet sent them."""
        request = container_request(pod_cgroup_parent="odd/parent")
        request.container_resources.cpu_shares = 1
        request.container_resources.cpuset_cpus = "whatever kubelet sent"
        request.container_envs["A=B"] = "\x00"
        answer = sdk_reply(request)
        checked = validation.check(request, answer)
        self.assertEqual(checked.refused, ())
        self.assertIs(checked.response, answer)  # nothing refused: no copy

    def test_a_refused_field_is_left_out_and_the_rest_of_the_answer_merges(self) -> None:
        request = container_request()
        answer = resources_answer(cpuset_cpus="abc", cpu_shares=1 << 62, cpu_quota=50000)
        answer.container_envs.update({"GOOD": "1", "BAD\x00": "1"})
        answer.pod_cgroup_parent = "/kubepods/../../escape"
        checked = validation.check(request, answer)
        self.assertEqual(
            checked.reason,
            'refused envs[BAD\\x00]: a name with a NUL byte; refused resources.cpu_shares 4611686018427387904: outside the kernel\'s '
            '2..262144; refused resources.cpuset_cpus "abc": not a cpu list; … and 1 more',
        )
        self.assertEqual(answer.container_resources.cpuset_cpus, "abc")  # the answer itself is not changed
        changes = messages.merge_response(request, checked.response) + checked.changes()
        resources = request.container_resources
        self.assertEqual((resources.cpuset_cpus, resources.cpu_shares, resources.cpu_quota), ("0-3", 2, 50000))  # kept, not cleared
        self.assertEqual((request.pod_cgroup_parent, dict(request.container_envs)), (POD_PARENT, {"A": "1", "GOOD": "1"}))
        self.assertEqual(
            [(change.path, change.applied, change.refused) for change in changes],
            [
                ("container_resources.cpu_quota", True, False),
                ("container_envs[GOOD]", True, False),
                ("container_envs[BAD\x00]", False, True),
                ("container_resources.cpu_shares", False, True),
                ("container_resources.cpuset_cpus", False, True),
                ("pod_cgroup_parent", False, True),
            ],
        )
        # Pod-level resources are checked only where they apply.
        pod = hook.PodSandboxHookRequest(cgroup_parent=POD_PARENT)
        pod_answer = hook.PodSandboxHookResponse(resources=hook.LinuxContainerResources(cpuset_cpus="abc"))
        self.assertEqual(self.refused(pod_answer, pod), [])
        self.assertEqual(self.refused(pod_answer, pod, apply_pod_resources=True), [("resources.cpuset_cpus", "not a cpu list")])

    def test_what_was_refused_is_named_escaped_and_short(self) -> None:
        self.assertEqual(validation.refused_text("container_resources.cpuset_cpus", "abc", "not a cpu list"), 'refused resources.cpuset_cpus "abc": not a cpu list')
        self.assertEqual(validation.refused_text("container_envs[A\x00B]", None, "a name with a NUL byte"), "refused envs[A\\x00B]: a name with a NUL byte")
        self.assertEqual(validation.refused_text("pod_cgroup_parent", 'a"\\\n', "x"), 'refused cgroup_parent "a\\"\\\\\\n": x')
        self.assertEqual(text.quoted("x" * 100, 10), '"xxxxxxxxxx"…')
        self.assertEqual(text.escaped("\u2028\x7f\x1b[31m"), "\\u2028\\x7f\\x1b[31m")
        self.assertEqual(text.listed(["a", "b", "c"], 2), "a, b, … and 1 more")
        # What a peer says (a hook server's error, a request's name) reaches a log line with nothing unprintable in it.
        self.assertEqual(text.shortened("refused: \x1b[31mred\x00"), "refused: \\x1b[31mred\\x00")
