"""The rules that merge hook answers into hook requests (koordrp.hooks.messages)."""

import copy

from twisted.trial.unittest import SynchronousTestCase

from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from koordrp.cri import translate
from koordrp.hooks import messages
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
