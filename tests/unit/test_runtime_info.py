"""Rebuilding hook requests from containerd's verbose status (koordrp.cri.runtime_info).

The fixtures are real containerd 1.6.20 answers (MessageToJson of the CRI responses, the OCI spec
trimmed of mounts, capabilities and namespaces, the temp dir renamed /var/lib/koordrp-fixture):

* pod_sandbox_status.json: pod ri-ns/ri-pod, attempt 1, handler "runc", labels, annotations,
  cgroup parent /koordrp-test/pod-ri, overhead and resources.
* pod_sandbox_status_bare.json: pod default/ri-bare with nothing optional set.
* container_status_created.json: container ri-ctr (attempt 2) of ri-pod, running, with envs
  FOO=1, EQ=a=b=c, FOO=2, EMPTY= and resources shares 512, quota 50000/100000, 64 MiB, cpuset 0,
  oom 500.
* container_status_updated.json: the same after UpdateContainerResources to shares 1024, quota
  80000/100000, 128 MiB (the config inside the info still says 512 and 64 MiB).
* container_status_not_verbose.json: the same, asked without verbose.
* container_status_hugepages.json: container ri-hugepages, created only, with hugepage limits
  (2MB:0, 1GB:1GiB; dropped by containerd on this host) and unified memory.high.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from google.protobuf import json_format
from twisted.trial.unittest import SynchronousTestCase

from koordrp.api.cri.v1 import api_pb2 as cri
from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from koordrp.cri.runtime_info import (
    RuntimeInfoError,
    container_info_from_status,
    container_sandbox_id,
    pod_info_from_status,
)
from koordrp.hooks.messages import IMAGE_NAME_ANNOTATION

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

POD_ID = "14aa822d9144c82359e361d4984172c8ac68e7809ad1d2ea5d29a032797c5c37"
CONTAINER_ID = "13910a9595b7bda74909a358df2f354f047d61deb38af37fab3d1d7f2246735c"
HUGEPAGES_CONTAINER_ID = "e986bf806b228e2f557f0e6ed2316f50317db7eb96807ae88b3409bb73029277"
MIB = 1024 * 1024


def pod_status(name: str = "pod_sandbox_status.json") -> Any:
    return json_format.Parse((FIXTURES / name).read_text(), cri.PodSandboxStatusResponse())


def container_status(name: str = "container_status_created.json") -> Any:
    return json_format.Parse((FIXTURES / name).read_text(), cri.ContainerStatusResponse())


def edit_info(response: Any, change: Callable[[dict[str, Any]], object]) -> Any:
    """``response`` with its verbose info JSON changed in place by ``change``."""
    info = json.loads(response.info["info"])
    change(info)
    response.info["info"] = json.dumps(info)
    return response


def expected_pod() -> hook.PodSandboxHookRequest:
    return hook.PodSandboxHookRequest(
        pod_meta=hook.PodSandboxMetadata(
            name="ri-pod", uid="11111111-2222-3333-4444-555555555555", namespace="ri-ns", attempt=1
        ),
        runtime_handler="runc",
        labels={"app": "demo", "io.kubernetes.pod.name": "ri-pod"},
        annotations={"koordinator.sh/qos": "LS", "note": "a=b"},
        cgroup_parent="/koordrp-test/pod-ri",
        overhead=hook.LinuxContainerResources(cpu_shares=10, memory_limit_in_bytes=1000000),
        resources=hook.LinuxContainerResources(cpu_shares=1536, cpu_quota=-1, memory_limit_in_bytes=192 * MIB),
    )


def expected_container(resources: hook.LinuxContainerResources) -> hook.ContainerResourceHookRequest:
    pod = expected_pod()
    return hook.ContainerResourceHookRequest(
        pod_meta=pod.pod_meta,
        container_meta=hook.ContainerMetadata(name="ri-ctr", attempt=2, id=CONTAINER_ID),
        # The image as the request containerd kept names it, as hooks were shown it at create.
        container_annotations={"ctr-anno": "x", "eq": "k=v=w", IMAGE_NAME_ANNOTATION: "localhost/koordrp/busybox:1"},
        container_resources=resources,
        pod_resources=pod.resources,
        pod_annotations=pod.annotations,
        pod_labels=pod.labels,
        pod_cgroup_parent="/koordrp-test/pod-ri",
        container_envs={"FOO": "2", "EQ": "a=b=c", "EMPTY": ""},
    )


CREATED_RESOURCES = hook.LinuxContainerResources(
    cpu_period=100000,
    cpu_quota=50000,
    cpu_shares=512,
    memory_limit_in_bytes=64 * MIB,
    oom_score_adj=500,
    cpuset_cpus="0",
    cpuset_mems="0",
)

UPDATED_RESOURCES = hook.LinuxContainerResources(
    cpu_period=100000,
    cpu_quota=80000,
    cpu_shares=1024,
    memory_limit_in_bytes=128 * MIB,
    oom_score_adj=500,
    cpuset_cpus="0",
    cpuset_mems="0",
)


class PodInfoTests(SynchronousTestCase):
    def test_every_field(self) -> None:
        pod = pod_info_from_status(pod_status())
        self.assertEqual(pod, expected_pod())
        self.assertEqual(pod.pod_meta.attempt, 1)
        self.assertEqual(pod.cgroup_parent, "/koordrp-test/pod-ri")
        self.assertEqual(pod.annotations["note"], "a=b")
        self.assertEqual(pod.resources.cpu_quota, -1)

    def test_bare_pod_omitted_fields_are_empty(self) -> None:
        pod = pod_info_from_status(pod_status("pod_sandbox_status_bare.json"))
        self.assertEqual(
            pod,
            hook.PodSandboxHookRequest(
                pod_meta=hook.PodSandboxMetadata(
                    name="ri-bare", uid="99999999-8888-7777-6666-555555555555", namespace="default"
                ),
            ),
        )
        self.assertFalse(pod.HasField("overhead"))
        self.assertFalse(pod.HasField("resources"))
        # containerd puts such a sandbox under /k8s.io: the parent must not be guessed from the spec.
        self.assertEqual(pod.cgroup_parent, "")

    def test_runtime_handler_from_info_when_status_lacks_it(self) -> None:
        response = pod_status()
        response.status.runtime_handler = ""
        self.assertEqual(pod_info_from_status(response).runtime_handler, "runc")

    def test_metadata_from_status_when_config_lacks_it(self) -> None:
        response = edit_info(pod_status(), lambda info: info["config"].pop("metadata"))
        self.assertEqual(pod_info_from_status(response).pod_meta, expected_pod().pod_meta)

    def test_unknown_fields_are_ignored(self) -> None:
        def add(info: dict[str, Any]) -> None:
            info["config"]["from_the_future"] = {"x": 1}
            info["config"]["linux"]["resources"]["new_knob"] = 7

        self.assertEqual(pod_info_from_status(edit_info(pod_status(), add)), expected_pod())


class ContainerInfoTests(SynchronousTestCase):
    def test_every_field_with_pod(self) -> None:
        info = container_info_from_status(container_status(), expected_pod())
        self.assertEqual(info, expected_container(CREATED_RESOURCES))

    def test_envs_last_duplicate_wins_and_values_keep_equals(self) -> None:
        envs = container_info_from_status(container_status(), None).container_envs
        self.assertEqual(dict(envs), {"FOO": "2", "EQ": "a=b=c", "EMPTY": ""})

    def test_env_values_a_runtime_writes_as_bytes_are_read_back_as_text(self) -> None:
        # A runtime whose KeyValue.value is bytes (cri-api v0.35.6 and later) writes base64 into its
        # verbose info; its runtime spec has the text, which tells the two apart.
        def as_bytes(info: dict[str, Any]) -> None:
            for entry in info["config"]["envs"]:
                entry["value"] = base64.b64encode(entry.get("value", "").encode()).decode()
            info["config"]["envs"].append({"key": "BINARY", "value": base64.b64encode(b"\xff\xfe").decode()})
            info["runtimeSpec"]["process"]["env"].append("BINARY=\ufffd\ufffd")

        envs = container_info_from_status(edit_info(container_status(), as_bytes), None).container_envs
        self.assertEqual(dict(envs), {"FOO": "2", "EQ": "a=b=c", "EMPTY": ""})

    def test_env_values_that_look_like_base64_are_text_when_the_spec_says_so(self) -> None:
        def plain(info: dict[str, Any]) -> None:
            info["config"]["envs"] = [{"key": "WORD", "value": "abcd"}]
            info["runtimeSpec"]["process"]["env"] = ["WORD=abcd"]

        envs = container_info_from_status(edit_info(container_status(), plain), None).container_envs
        self.assertEqual(dict(envs), {"WORD": "abcd"})

    def test_updated_resources_come_from_the_status(self) -> None:
        # The config in the info still holds the creation values; the CRI status has the update.
        response = container_status("container_status_updated.json")
        config = json.loads(response.info["info"])["config"]
        self.assertEqual(config["linux"]["resources"]["cpu_shares"], 512)
        info = container_info_from_status(response, expected_pod())
        self.assertEqual(info, expected_container(UPDATED_RESOURCES))

    def test_swap_filled_in_by_containerd_is_not_reported(self) -> None:
        response = container_status("container_status_updated.json")
        self.assertEqual(response.status.resources.linux.memory_swap_limit_in_bytes, 128 * MIB)
        info = container_info_from_status(response, None)
        self.assertEqual(info.container_resources.memory_swap_limit_in_bytes, 0)

    def test_swap_the_config_asked_for_is_kept(self) -> None:
        def ask_swap(info: dict[str, Any]) -> None:
            info["config"]["linux"]["resources"]["memory_swap_limit_in_bytes"] = 64 * MIB

        response = edit_info(container_status("container_status_updated.json"), ask_swap)
        info = container_info_from_status(response, None)
        self.assertEqual(info.container_resources.memory_swap_limit_in_bytes, 128 * MIB)

    def test_without_pod_pod_meta_from_spec_annotations(self) -> None:
        info = container_info_from_status(container_status(), None)
        expected = expected_container(CREATED_RESOURCES)
        expected.pod_meta.attempt = 0  # not in the container's spec
        for field in ("pod_resources", "pod_annotations", "pod_labels", "pod_cgroup_parent"):
            expected.ClearField(field)
        self.assertEqual(info, expected)
        self.assertFalse(info.HasField("pod_resources"))

    def test_without_pod_and_without_spec(self) -> None:
        response = edit_info(container_status(), lambda info: info.pop("runtimeSpec"))
        self.assertEqual(container_info_from_status(response, None).pod_meta, hook.PodSandboxMetadata())

    def test_pod_without_resources(self) -> None:
        pod = pod_info_from_status(pod_status("pod_sandbox_status_bare.json"))
        info = container_info_from_status(container_status(), pod)
        self.assertFalse(info.HasField("pod_resources"))
        self.assertEqual(info.pod_meta.name, "ri-bare")
        self.assertEqual(info.pod_cgroup_parent, "")
        self.assertEqual(dict(info.pod_labels), {})

    def test_hugepages_dropped_by_the_runtime_come_from_the_config(self) -> None:
        info = container_info_from_status(container_status("container_status_hugepages.json"), None)
        self.assertEqual(
            info,
            hook.ContainerResourceHookRequest(
                pod_meta=hook.PodSandboxMetadata(
                    name="ri-pod", uid="11111111-2222-3333-4444-555555555555", namespace="ri-ns"
                ),
                container_meta=hook.ContainerMetadata(name="ri-hugepages", id=HUGEPAGES_CONTAINER_ID),
                container_annotations={IMAGE_NAME_ANNOTATION: "localhost/koordrp/busybox:1"},
                container_resources=hook.LinuxContainerResources(
                    cpu_shares=2,
                    hugepage_limits=[
                        hook.HugepageLimit(page_size="2MB", limit=0),
                        hook.HugepageLimit(page_size="1GB", limit=1024 * MIB),
                    ],
                    unified={"memory.high": "1000000"},
                ),
            ),
        )

    def test_config_resources_when_status_has_none(self) -> None:
        response = container_status("container_status_updated.json")
        response.status.ClearField("resources")
        info = container_info_from_status(response, None)
        self.assertEqual(info.container_resources, CREATED_RESOURCES)

    def test_config_resources_when_status_resources_are_empty(self) -> None:
        response = container_status()
        response.status.resources.linux.Clear()
        self.assertTrue(response.status.resources.HasField("linux"))
        self.assertEqual(container_info_from_status(response, None).container_resources, CREATED_RESOURCES)

    def test_spec_resources_when_status_and_config_have_none(self) -> None:
        response = edit_info(
            container_status("container_status_updated.json"),
            lambda info: info["config"]["linux"].pop("resources"),
        )
        response.status.ClearField("resources")
        info = container_info_from_status(response, None)
        self.assertEqual(info.container_resources, UPDATED_RESOURCES)

    def test_spec_hugepages_and_unified(self) -> None:
        def spec(info: dict[str, Any]) -> None:
            info["config"]["linux"].pop("resources")
            resources = info["runtimeSpec"]["linux"]["resources"]
            resources["hugepageLimits"] = [{"pageSize": "2MB", "limit": 4 * MIB}, {"pageSize": "1GB"}]
            resources["unified"] = {"memory.high": "5"}
            resources["memory"]["swap"] = 256 * MIB

        response = edit_info(container_status("container_status_updated.json"), spec)
        response.status.ClearField("resources")
        resources = container_info_from_status(response, None).container_resources
        expected = hook.LinuxContainerResources()
        expected.CopyFrom(UPDATED_RESOURCES)
        expected.hugepage_limits.add(page_size="2MB", limit=4 * MIB)
        expected.hugepage_limits.add(page_size="1GB")
        expected.unified["memory.high"] = "5"
        expected.memory_swap_limit_in_bytes = 256 * MIB
        self.assertEqual(resources, expected)

    def test_no_resources_anywhere(self) -> None:
        def strip(info: dict[str, Any]) -> None:
            info["config"]["linux"].pop("resources")
            info.pop("runtimeSpec")

        response = edit_info(container_status(), strip)
        response.status.ClearField("resources")
        self.assertEqual(container_info_from_status(response, None).container_resources, hook.LinuxContainerResources())

    def test_config_without_optional_fields(self) -> None:
        def strip(info: dict[str, Any]) -> None:
            for key in ("envs", "annotations", "linux", "image"):
                info["config"].pop(key)

        info = container_info_from_status(edit_info(container_status(), strip), None)
        self.assertEqual(dict(info.container_envs), {})
        self.assertEqual(dict(info.container_annotations), {})
        self.assertEqual(info.container_resources, CREATED_RESOURCES)  # from the status

    def test_the_image_is_the_one_kubelet_named_as_far_as_containerd_kept_it(self) -> None:
        image_id = "sha256:" + "0" * 64

        def image(spec: dict[str, str], annotation: str | None = None) -> dict[str, str]:
            def edit(info: dict[str, Any]) -> None:
                info["config"]["image"] = spec
                if annotation is None:
                    info["runtimeSpec"]["annotations"].pop(IMAGE_NAME_ANNOTATION)
                else:
                    info["runtimeSpec"]["annotations"][IMAGE_NAME_ANNOTATION] = annotation

            return dict(container_info_from_status(edit_info(container_status(), edit), None).container_annotations)

        # containerd 2 keeps the pod spec's name kubelet sent.
        shown = image({"image": image_id, "user_specified_image": "busybox"}, "busybox")
        self.assertEqual(shown[IMAGE_NAME_ANNOTATION], "busybox")
        # 1.6 and 1.7 keep only the id: the name containerd gave the image, not the id.
        shown = image({"image": image_id}, "docker.io/library/busybox:latest")
        self.assertEqual(shown[IMAGE_NAME_ANNOTATION], "docker.io/library/busybox:latest")
        self.assertEqual(image({"image": image_id})[IMAGE_NAME_ANNOTATION], image_id)
        # A name in the request (crictl) is what hooks were shown at create.
        shown = image({"image": "busybox"}, "docker.io/library/busybox:latest")
        self.assertEqual(shown[IMAGE_NAME_ANNOTATION], "busybox")

    def test_sandbox_id(self) -> None:
        self.assertEqual(container_sandbox_id(container_status()), POD_ID)


class MalformedInputTests(SynchronousTestCase):
    def assertPodFails(self, response: Any, *words: str) -> None:
        self.assertReason(lambda: pod_info_from_status(response), words)

    def assertContainerFails(self, response: Any, *words: str) -> None:
        self.assertReason(lambda: container_info_from_status(response, None), words)
        self.assertReason(lambda: container_info_from_status(response, expected_pod()), words)

    def assertReason(self, call: Callable[[], object], words: tuple[str, ...]) -> None:
        error = self.assertRaises(RuntimeInfoError, call)
        self.assertIsInstance(error, ValueError)
        self.assertEqual(error.reason, str(error))
        self.assertNotIn("\n", error.reason)
        for word in words:
            self.assertIn(word, error.reason)

    def test_not_verbose(self) -> None:
        self.assertContainerFails(container_status("container_status_not_verbose.json"), "verbose")
        response = pod_status()
        response.ClearField("info")
        self.assertPodFails(response, "verbose", POD_ID)

    def test_other_info_keys_only(self) -> None:
        response = pod_status()
        del response.info["info"]
        response.info["something"] = "{}"
        self.assertPodFails(response, "verbose")

    def test_info_not_json(self) -> None:
        for text in ("{not json", "", '{"config": {}'):
            pod, container = pod_status(), container_status()
            pod.info["info"] = text
            container.info["info"] = text
            self.assertPodFails(pod, "not JSON")
            self.assertContainerFails(container, "not JSON", CONTAINER_ID)

    def test_info_too_deep(self) -> None:
        response = pod_status()
        response.info["info"] = "[" * 100000 + "]" * 100000
        self.assertPodFails(response, "not JSON")

    def test_info_not_an_object(self) -> None:
        for text in ("[]", "null", "3", '"config"'):
            response = container_status()
            response.info["info"] = text
            self.assertContainerFails(response, "not an object")

    def test_config_missing(self) -> None:
        self.assertPodFails(edit_info(pod_status(), lambda info: info.pop("config")), "no 'config'")
        self.assertContainerFails(edit_info(container_status(), lambda info: info.pop("config")), "no 'config'")

    def test_config_null(self) -> None:
        self.assertPodFails(edit_info(pod_status(), lambda info: info.update(config=None)), "no 'config'")

    def test_config_wrong_type(self) -> None:
        values: tuple[object, ...] = ("x", [], 1, True)
        for value in values:
            self.assertPodFails(edit_info(pod_status(), lambda info: info.update(config=value)), "'config'")
            self.assertContainerFails(edit_info(container_status(), lambda info: info.update(config=value)), "'config'")

    def test_config_fields_of_wrong_type(self) -> None:
        pod_edits: list[Callable[[dict[str, Any]], object]] = [
            lambda info: info["config"].update(labels=["app", "demo"]),
            lambda info: info["config"].update(labels={"app": 1}),
            lambda info: info["config"].update(annotations="note=a=b"),
            lambda info: info["config"].update(metadata="ri-pod"),
            lambda info: info["config"]["metadata"].update(attempt="one"),
            lambda info: info["config"]["metadata"].update(attempt=-1),
            lambda info: info["config"]["metadata"].update(attempt=1.5),
            lambda info: info["config"]["linux"].update(cgroup_parent=["/a"]),
            lambda info: info["config"]["linux"]["resources"].update(cpu_shares="lots"),
            lambda info: info["config"]["linux"]["resources"].update(cpu_shares=2**64),
            lambda info: info["config"]["linux"]["overhead"].update(hugepage_limits={"2MB": 1}),
            lambda info: info["config"]["linux"]["security_context"]["namespace_options"].update(network=[2]),
            lambda info: info.update(runtimeHandler=5),
        ]
        for number, edit in enumerate(pod_edits):
            response = edit_info(pod_status(), edit)
            if number == len(pod_edits) - 1:
                response.status.runtime_handler = ""
            self.assertPodFails(response, POD_ID)

        container_edits: list[Callable[[dict[str, Any]], object]] = [
            lambda info: info["config"].update(envs={"FOO": "1"}),
            lambda info: info["config"].update(envs=["FOO=1"]),
            lambda info: info["config"]["envs"].append({"key": "N", "value": 1}),
            lambda info: info["config"]["envs"].append({"key": None, "value": {}}),
            lambda info: info["config"].update(annotations=[]),
            lambda info: info["config"].update(linux=[]),
            lambda info: info["config"]["linux"]["resources"].update(unified={"memory.high": 5}),
            lambda info: info["config"]["linux"]["resources"].update(cpuset_cpus=0),
        ]
        for edit in container_edits:
            self.assertContainerFails(edit_info(container_status(), edit), CONTAINER_ID)

    def test_runtime_spec_of_wrong_type_when_used(self) -> None:
        edits: list[Callable[[dict[str, Any]], object]] = [
            lambda info: info.update(runtimeSpec=[]),
            lambda info: info["runtimeSpec"].update(linux="x"),
            lambda info: info["runtimeSpec"]["linux"].update(resources=1),
            lambda info: info["runtimeSpec"]["linux"]["resources"].update(cpu=[]),
            lambda info: info["runtimeSpec"]["linux"]["resources"]["cpu"].update(shares="1024"),
            lambda info: info["runtimeSpec"]["linux"]["resources"]["cpu"].update(quota=True),
            lambda info: info["runtimeSpec"]["linux"]["resources"]["cpu"].update(period=1.5),
            lambda info: info["runtimeSpec"]["linux"]["resources"]["cpu"].update(shares=2**63),
            lambda info: info["runtimeSpec"]["linux"]["resources"]["cpu"].update(cpus=0),
            lambda info: info["runtimeSpec"]["linux"]["resources"]["memory"].update(limit=[1]),
            lambda info: info["runtimeSpec"]["linux"]["resources"].update(hugepageLimits={}),
            lambda info: info["runtimeSpec"]["linux"]["resources"].update(hugepageLimits=[1]),
            lambda info: info["runtimeSpec"]["linux"]["resources"].update(hugepageLimits=[{"limit": -1}]),
            lambda info: info["runtimeSpec"]["linux"]["resources"].update(hugepageLimits=[{"pageSize": 2}]),
            lambda info: info["runtimeSpec"]["linux"]["resources"].update(unified=[]),
            lambda info: info["runtimeSpec"]["linux"]["resources"].update(unified={"a": 1}),
            lambda info: info["runtimeSpec"].update(process="x"),
            lambda info: info["runtimeSpec"]["process"].update(oomScoreAdj="500"),
        ]
        for edit in edits:

            def without_other_sources(info: dict[str, Any], edit: Callable[[dict[str, Any]], object] = edit) -> None:
                info["config"]["linux"].pop("resources")
                edit(info)

            response = edit_info(container_status("container_status_updated.json"), without_other_sources)
            response.status.ClearField("resources")
            self.assertContainerFails(response, CONTAINER_ID, "runtimeSpec")

    def test_runtime_spec_annotations_of_wrong_type_without_pod(self) -> None:
        values: tuple[object, ...] = ([], {"io.kubernetes.cri.sandbox-name": 1})
        for value in values:
            response = edit_info(
                container_status(), lambda info: info["runtimeSpec"].update(annotations=value)
            )
            self.assertReason(lambda: container_info_from_status(response, None), ("annotation",))
            # With the pod given, the spec's annotations are not needed.
            container_info_from_status(response, expected_pod())

    def test_container_without_id(self) -> None:
        response = container_status()
        response.status.id = ""
        self.assertContainerFails(response, "no container id")

    def test_no_metadata_anywhere(self) -> None:
        response = edit_info(pod_status(), lambda info: info["config"].pop("metadata"))
        response.status.ClearField("metadata")
        self.assertPodFails(response, "no metadata")

    def test_sandbox_id_missing_or_wrong(self) -> None:
        self.assertReason(lambda: container_sandbox_id(container_status("container_status_not_verbose.json")), ("verbose",))
        for edit in (lambda info: info.pop("sandboxID"), lambda info: info.update(sandboxID=7)):
            response = edit_info(container_status(), edit)
            self.assertReason(lambda: container_sandbox_id(response), ("sandboxID",))
