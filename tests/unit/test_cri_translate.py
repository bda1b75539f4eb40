"""CRI v1 requests ⇄ hook requests (koordrp.cri.translate)."""

import copy

from twisted.trial.unittest import SynchronousTestCase

from koordrp import flows, sdk
from koordrp.api.cri.v1 import api_pb2 as cri
from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from koordrp.cri import translate
from koordrp.hooks import messages


def run_pod_request() -> cri.RunPodSandboxRequest:
    return cri.RunPodSandboxRequest(
        runtime_handler="runc",
        config=cri.PodSandboxConfig(
            metadata=cri.PodSandboxMetadata(name="web", uid="u-1", namespace="prod", attempt=2),
            labels={"app": "web"},
            annotations={"note": "a"},
            linux=cri.LinuxPodSandboxConfig(
                cgroup_parent="/kubepods/pod-u-1",
                overhead=cri.LinuxContainerResources(cpu_shares=10),
                resources=cri.LinuxContainerResources(cpu_shares=1024, memory_limit_in_bytes=1 << 30),
            ),
        ),
    )


def create_request() -> cri.CreateContainerRequest:
    return cri.CreateContainerRequest(
        pod_sandbox_id="sandbox-1",
        config=cri.ContainerConfig(
            metadata=cri.ContainerMetadata(name="app", attempt=1),
            envs=[
                cri.KeyValue(key="B", value=b"1"),
                cri.KeyValue(key="A", value=b"x=y"),
                cri.KeyValue(key="B", value=b"2"),
            ],
            annotations={"c": "1"},
            linux=cri.LinuxContainerConfig(
                resources=cri.LinuxContainerResources(
                    cpu_shares=2, cpu_quota=-1, oom_score_adj=500, cpuset_cpus="0-1", unified={"memory.high": "max"}
                )
            ),
        ),
        sandbox_config=run_pod_request().config,
    )


def placed(
    request: cri.CreateContainerRequest, pod: hook.PodSandboxHookRequest
) -> tuple[hook.ContainerResourceHookRequest, hook.ContainerResourceHookRequest]:
    """``sent`` (the container as kubelet's request has it) and the PreCreateContainer request built
    from it and the stored pod, as ``flows.create_container`` builds them."""
    sent = translate.container_hook_request(request)
    return sent, messages.placed_in_pod(copy.deepcopy(sent), pod)


class BuildTests(SynchronousTestCase):
    def test_pod_hook_request_carries_everything_the_sandbox_config_says(self) -> None:
        pod = translate.pod_hook_request(run_pod_request())
        self.assertEqual(
            (pod.pod_meta.name, pod.pod_meta.uid, pod.pod_meta.namespace, pod.pod_meta.attempt),
            ("web", "u-1", "prod", 2),
        )
        self.assertEqual(pod.runtime_handler, "runc")
        self.assertEqual(dict(pod.labels), {"app": "web"})
        self.assertEqual(dict(pod.annotations), {"note": "a"})
        self.assertEqual(pod.cgroup_parent, "/kubepods/pod-u-1")
        self.assertEqual(pod.overhead.cpu_shares, 10)
        self.assertEqual((pod.resources.cpu_shares, pod.resources.memory_limit_in_bytes), (1024, 1 << 30))

    def test_container_hook_request_places_the_container_where_kubelets_request_does(self) -> None:
        sent = translate.container_hook_request(create_request())
        self.assertEqual(sent.pod_cgroup_parent, "/kubepods/pod-u-1")
        self.assertEqual((sent.container_meta.name, sent.container_meta.attempt), ("app", 1))
        self.assertEqual(dict(sent.container_envs), {"B": "2", "A": "x=y"})

    def test_container_hook_request_takes_the_pod_from_the_store_not_from_kubelet(self) -> None:
        stored_pod = translate.pod_hook_request(run_pod_request())
        stored_pod.cgroup_parent = "/set/by/a/hook"
        _, container = placed(create_request(), stored_pod)
        self.assertEqual(container.pod_cgroup_parent, "/set/by/a/hook")
        self.assertEqual(container.pod_meta.uid, "u-1")
        self.assertEqual(dict(container.pod_labels), {"app": "web"})
        self.assertEqual((container.container_meta.name, container.container_meta.attempt), ("app", 1))
        self.assertEqual(dict(container.container_envs), {"B": "2", "A": "x=y"})
        self.assertEqual(container.container_resources.cpuset_cpus, "0-1")
        self.assertEqual(container.pod_resources.cpu_shares, 1024)


class ImageTests(SynchronousTestCase):
    """Hooks are shown the image under containerd's own annotation, and nothing of it reaches the runtime."""

    def kubelets(self) -> cri.CreateContainerRequest:
        request = create_request()
        # As kubelet sends it: the image's id, and the pod spec's image as written.
        request.config.image.CopyFrom(cri.ImageSpec(image="sha256:" + "4f" * 32, user_specified_image="nginx:1.27"))
        return request

    def test_the_image_as_the_pod_spec_names_it_else_as_the_request_does(self) -> None:
        sent = translate.container_hook_request(self.kubelets())
        self.assertEqual(dict(sent.container_annotations), {"c": "1", messages.IMAGE_NAME_ANNOTATION: "nginx:1.27"})
        crictl = create_request()
        crictl.config.image.image = "docker.io/library/busybox:1.36"
        shown = translate.container_hook_request(crictl).container_annotations
        self.assertEqual(shown[messages.IMAGE_NAME_ANNOTATION], "docker.io/library/busybox:1.36")
        self.assertNotIn(messages.IMAGE_NAME_ANNOTATION, translate.container_hook_request(create_request()).container_annotations)

    def test_an_echoed_image_leaves_the_request_as_kubelet_sent_it(self) -> None:
        request = self.kubelets()
        original = request.SerializeToString()
        sent, container = placed(request, translate.pod_hook_request(run_pod_request()))
        changes = messages.merge_container_response(container, sdk.reply(container))
        self.assertEqual(changes, [])
        self.assertIsNone(translate.CreateContainer(request).rewritten(sent, container).request)
        self.assertEqual(request.SerializeToString(), original)

    def test_an_image_a_hook_names_otherwise_is_left_alone_and_never_sent(self) -> None:
        request = self.kubelets()
        sent, container = placed(request, translate.pod_hook_request(run_pod_request()))
        answer = sdk.reply(container)
        answer.container_annotations[messages.IMAGE_NAME_ANNOTATION] = "forbidden/app:1"
        answer.container_annotations["d"] = "4"
        changes = messages.merge_container_response(container, answer)
        self.assertEqual(
            [(change.path, change.applied, change.why) for change in changes],
            [
                ("container_annotations[d]", True, ""),
                (f"container_annotations[{messages.IMAGE_NAME_ANNOTATION}]", False, messages.RUNTIME_OWNS_IMAGE_NAME),
            ],
        )
        self.assertEqual(container.container_annotations[messages.IMAGE_NAME_ANNOTATION], "nginx:1.27")
        written = translate.CreateContainer(request).rewritten(sent, container).request
        assert written is not None
        self.assertEqual(dict(cri.CreateContainerRequest.FromString(written).config.annotations), {"c": "1", "d": "4"})


class EnvValuesThatAreNotTextTests(SynchronousTestCase):
    """kubelet 1.35 may send env values that are not UTF-8 (KeyValue.value is bytes since cri-api v0.35.6)."""

    BINARY = b"\xff\xfe\x00abc"

    def envs(self) -> list[cri.KeyValue]:
        return [
            cri.KeyValue(key="A", value=b"1"),
            cri.KeyValue(key="BIN", value=self.BINARY),
            cri.KeyValue(key="B", value=b"2"),
        ]

    def test_hooks_see_the_other_variables(self) -> None:
        config = cri.ContainerConfig(envs=self.envs())
        self.assertEqual(translate.envs_of(config), {"A": "1", "B": "2"})

    def test_no_answer_can_change_remove_or_move_them(self) -> None:
        before = {"A": "1", "B": "2"}
        after = {"A": "9", "BIN": "text", "C": "3"}  # a map cannot remove B; BIN is new to the hooks
        result = [(env.key, env.value) for env in translate.apply_envs(self.envs(), before, after)]
        self.assertEqual(
            result, [("A", b"9"), ("BIN", self.BINARY), ("B", b"2"), ("BIN", b"text"), ("C", b"3")]
        )

    def test_they_reach_the_runtime_as_kubelet_sent_them(self) -> None:
        request = create_request()
        del request.config.envs[:]
        request.config.envs.extend(self.envs())
        pod = translate.pod_hook_request(run_pod_request())
        sent, before = placed(request, pod)
        after = copy.deepcopy(before)
        after.container_envs["ADDED"] = "1"
        self.assertTrue(translate.apply_to_create_container(request, sent, after))
        forwarded = cri.CreateContainerRequest.FromString(request.SerializeToString())
        self.assertEqual([env.value for env in forwarded.config.envs], [b"1", self.BINARY, b"2", b"1"])


class ApplyTests(SynchronousTestCase):
    def test_envs_keep_order_duplicates_and_equals_signs(self) -> None:
        envs = create_request().config.envs
        result = translate.apply_envs(envs, {"B": "2", "A": "x=y"}, {"B": "2", "A": "x=y", "Z": "1", "C": "3"})
        self.assertEqual([(e.key, e.value.decode()) for e in result], [("B", "1"), ("A", "x=y"), ("B", "2"), ("C", "3"), ("Z", "1")])
        result = translate.apply_envs(envs, {"B": "2", "A": "x=y"}, {"B": "9", "A": "x=y"})
        self.assertEqual([(e.key, e.value.decode()) for e in result], [("B", "9"), ("A", "x=y"), ("B", "9")])

    def test_unchanged_hook_request_leaves_the_cri_request_alone(self) -> None:
        request = create_request()
        original = request.SerializeToString()
        pod = translate.pod_hook_request(run_pod_request())
        sent, container = placed(request, pod)
        self.assertFalse(translate.apply_to_create_container(request, sent, copy.deepcopy(container)))
        self.assertEqual(request.SerializeToString(), original)
        self.assertIsNone(translate.CreateContainer(request).rewritten(sent, container).request)

    def test_create_container_gets_the_hooks_changes_and_nothing_else(self) -> None:
        request = create_request()
        pod = translate.pod_hook_request(run_pod_request())
        sent, before = placed(request, pod)
        after = copy.deepcopy(before)
        messages.merge_container_response(
            after,
            hook.ContainerResourceHookResponse(
                container_annotations={"d": "4"},
                container_envs={"KOORDRP": "1"},
                container_resources=hook.LinuxContainerResources(cpu_shares=512, cpuset_cpus="0"),
                pod_cgroup_parent="/kubepods/besteffort",
            ),
        )
        self.assertTrue(translate.apply_to_create_container(request, sent, after))
        config = request.config
        self.assertEqual(dict(config.annotations), {"c": "1", "d": "4"})
        self.assertEqual([(e.key, e.value.decode()) for e in config.envs][-1], ("KOORDRP", "1"))
        self.assertEqual(len(config.envs), 4)
        resources = config.linux.resources
        self.assertEqual((resources.cpu_shares, resources.cpuset_cpus, resources.cpu_quota), (512, "0", -1))
        self.assertEqual((resources.oom_score_adj, dict(resources.unified)), (500, {"memory.high": "max"}))
        self.assertEqual(request.sandbox_config.linux.cgroup_parent, "/kubepods/besteffort")

    def test_the_pods_real_cgroup_parent_reaches_create_container_without_a_container_hook(self) -> None:
        # As flows.create_container does it: no PreCreateContainer hook, the request as the store places it.
        request = create_request()
        pod = translate.pod_hook_request(run_pod_request())
        pod.cgroup_parent = "/moved/by/PreRunPodSandbox"
        create = translate.CreateContainer(request)
        sent = create.hook_request()
        final = messages.placed_in_pod(copy.deepcopy(sent), pod)
        rewritten = create.rewritten(sent, final).request
        assert rewritten is not None
        self.assertEqual(
            cri.CreateContainerRequest.FromString(rewritten).sandbox_config.linux.cgroup_parent,
            "/moved/by/PreRunPodSandbox",
        )
        self.assertEqual(request.sandbox_config.linux.cgroup_parent, "/moved/by/PreRunPodSandbox")

    def test_fields_newer_than_the_stubs_survive(self) -> None:
        unknown = b"\xf8\x06\x01"  # field 111, varint 1: not in any stub
        config = cri.ContainerConfig(metadata=cri.ContainerMetadata(name="app")).SerializeToString() + unknown
        raw = cri.CreateContainerRequest(pod_sandbox_id="s").SerializeToString() + b"\x12" + bytes([len(config)]) + config
        request = cri.CreateContainerRequest.FromString(raw)
        pod = translate.pod_hook_request(run_pod_request())
        sent, before = placed(request, pod)
        after = copy.deepcopy(before)
        after.container_envs["NEW"] = "1"
        translate.apply_to_create_container(request, sent, after)
        self.assertIn(unknown, request.config.SerializeToString())

    def test_pod_resources_go_to_the_sandbox_linux_resources(self) -> None:
        request = run_pod_request()
        before = translate.pod_hook_request(request)
        after = copy.deepcopy(before)
        messages.merge_pod_response(
            after, hook.PodSandboxHookResponse(resources=hook.LinuxContainerResources(cpu_quota=20000)), apply_resources=True
        )
        self.assertTrue(translate.apply_to_run_pod_sandbox(request, before, after))
        self.assertEqual(request.config.linux.resources.cpu_quota, 20000)
        self.assertEqual(request.config.linux.resources.cpu_shares, 1024)

    def test_update_folds_kubelets_values_then_applies_the_hooks(self) -> None:
        pod = translate.pod_hook_request(run_pod_request())
        create = create_request()
        stored = flows.created_container(placed(create, pod)[1], "c-1", translate.envs_of(create.config))
        request = cri.UpdateContainerResourcesRequest(
            container_id="c-1", linux=cri.LinuxContainerResources(cpu_shares=100), annotations={"u": "1"}
        )
        update = translate.UpdateContainerResources(request)
        folded = messages.folded_update(stored, update.container_id, update.resources(), update.annotations())
        self.assertEqual(folded.container_meta.id, "c-1")
        self.assertEqual(folded.container_resources.cpu_shares, 100)
        self.assertEqual(folded.container_resources.cpuset_cpus, "0-1")
        self.assertEqual(dict(folded.container_annotations), {"c": "1", "u": "1"})
        after = copy.deepcopy(folded)
        after.container_resources.cpuset_mems = "0"
        self.assertTrue(translate.apply_to_update_container_resources(request, folded, after))
        self.assertEqual((request.linux.cpu_shares, request.linux.cpuset_mems), (100, "0"))
        self.assertEqual(request.linux.cpuset_cpus, "")

    def test_an_update_without_linux_resources_names_none(self) -> None:
        update = translate.UpdateContainerResources(
            cri.UpdateContainerResourcesRequest(container_id="c-1", annotations={"u": "1"})
        )
        self.assertIsNone(update.resources())
        self.assertEqual(dict(update.annotations()), {"u": "1"})

    def test_created_container_info_keeps_the_envs_the_runtime_got(self) -> None:
        request = create_request()
        pod = translate.pod_hook_request(run_pod_request())
        _, hook_request = placed(request, pod)
        hook_request.container_envs["ONLY_IN_THE_HOOK_REQUEST"] = "1"
        info = flows.created_container(hook_request, "c-9", translate.envs_of(request.config))
        self.assertEqual(info.container_meta.id, "c-9")
        self.assertEqual(dict(info.container_envs), {"B": "2", "A": "x=y"})
