"""The lifecycle flows (koordrp.flows), rule by rule.

Rules about what is written into a request run once per front end, with CRI mode's requests
(koordrp.cri.translate) and Docker mode's (koordrp.docker.translate): both must behave the same.
Rules that only involve ids run once. The stages and the runtime are fakes that answer at once
(tests/fake/flows.py), unless a test makes them wait, so a flow runs to its end within ``drive``.
"""

import json
from dataclasses import replace
from typing import Any, Callable, Coroutine, Sequence

from twisted.internet.defer import CancelledError, Deferred, ensureDeferred
from twisted.internet.task import Clock
from twisted.logger import LogEvent, LogLevel, formatEvent
from twisted.trial.unittest import SynchronousTestCase

from koordrp import adapters
from koordrp.call import Call, Parts, SETTLE_SECONDS, SkipLabel
from koordrp import resync
from koordrp import flows
from koordrp.api.cri.v1 import api_pb2 as cri
from koordrp.api.nri.v1alpha1 import api_pb2 as nri
from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from koordrp.cri import translate as cri_translate
from koordrp.docker import translate as docker_translate
from koordrp.nri import translate as nri_translate
from koordrp.hooks.client import HookClients
from koordrp.hooks.dispatcher import Dispatcher
from koordrp.hooks.messages import ContainerHookRequest, HookRequest, PodHookRequest, copied, placed_in_pod
from koordrp.metrics import Metrics
from koordrp.hooks.types import NOT_ANSWERING, NOT_MADE, SKIPPED, UNREADABLE, FailurePolicy, HookServerConfig, HookServers, HookType, PostStage
from koordrp.checkpoint import Kind, NoCheckpoint, Parsed, StateUnreadable
from koordrp.store import ContainerState, Store, StoredContainer, StoredPod
from tests.fake.flows import RecordingRuntime, Reply, ScriptedStages
from tests.support.logs import logged_events

SKIP = SkipLabel("runtimeproxy.koordinator.sh/skip-hookserver", "true")
POD_PARENT = "/kubepods/pod-1"

PRE_RUN = HookType.PRE_RUN_POD_SANDBOX
PRE_CREATE = HookType.PRE_CREATE_CONTAINER
PRE_START = HookType.PRE_START_CONTAINER
POST_START = HookType.POST_START_CONTAINER
PRE_UPDATE = HookType.PRE_UPDATE_CONTAINER_RESOURCES
POST_STOP = HookType.POST_STOP_CONTAINER
POST_STOP_POD = HookType.POST_STOP_POD_SANDBOX


def container_request(request: HookRequest | None) -> ContainerHookRequest:
    """``request``, which the test knows to be a container's."""
    assert isinstance(request, ContainerHookRequest), request
    return request


class CRIWire:
    """kubelet's requests, as CRI mode reads them, and what reached the runtime."""

    def sandbox(self, labels: dict[str, str]) -> adapters.RunPodSandbox:
        config = cri.PodSandboxConfig(
            metadata=cri.PodSandboxMetadata(name="web", namespace="default", uid="uid-1"),
            labels=labels,
            linux=cri.LinuxPodSandboxConfig(cgroup_parent=POD_PARENT),
        )
        return cri_translate.RunPodSandbox(cri.RunPodSandboxRequest(config=config))

    def container(self, sandbox_id: str, envs: Sequence[tuple[str, str]]) -> adapters.CreateContainer:
        config = cri.ContainerConfig(
            metadata=cri.ContainerMetadata(name="app"),
            envs=[cri.KeyValue(key=key, value=value.encode()) for key, value in envs],
            linux=cri.LinuxContainerConfig(
                resources=cri.LinuxContainerResources(cpu_shares=2, cpu_quota=100000, cpuset_cpus="0-3")
            ),
        )
        sandbox = cri.PodSandboxConfig(linux=cri.LinuxPodSandboxConfig(cgroup_parent=POD_PARENT))
        request = cri.CreateContainerRequest(pod_sandbox_id=sandbox_id, config=config, sandbox_config=sandbox)
        return cri_translate.CreateContainer(request)

    def update(self, container_id: str, cpu_shares: int = 0, cpuset: str = "") -> adapters.UpdateContainerResources:
        request = cri.UpdateContainerResourcesRequest(
            container_id=container_id, linux=cri.LinuxContainerResources(cpu_shares=cpu_shares, cpuset_cpus=cpuset)
        )
        return cri_translate.UpdateContainerResources(request)

    def resize(self, sandbox_id: str, cpu_quota: int) -> adapters.UpdatePodSandboxResources:
        request = cri.UpdatePodSandboxResourcesRequest(
            pod_sandbox_id=sandbox_id, resources=cri.LinuxContainerResources(cpu_quota=cpu_quota)
        )
        return cri_translate.UpdatePodSandboxResources(request)

    def sandbox_parent(self, sent: bytes) -> str:
        return cri.RunPodSandboxRequest.FromString(sent).config.linux.cgroup_parent

    def container_sent(self, sent: bytes) -> tuple[list[tuple[str, str]], str, str]:
        """Environment, cpuset and the cgroup parent the container is placed under."""
        request = cri.CreateContainerRequest.FromString(sent)
        envs = [(env.key, env.value.decode()) for env in request.config.envs]
        return envs, request.config.linux.resources.cpuset_cpus, request.sandbox_config.linux.cgroup_parent

    def update_sent(self, sent: bytes) -> tuple[int, str]:
        request = cri.UpdateContainerResourcesRequest.FromString(sent)
        return request.linux.cpu_shares, request.linux.cpuset_cpus

    def quota_sent(self, sent: bytes, create: bool = False) -> int:
        if create:
            return cri.CreateContainerRequest.FromString(sent).config.linux.resources.cpu_quota
        return cri.UpdateContainerResourcesRequest.FromString(sent).linux.cpu_quota


class DockerWire:
    """cri-dockerd's requests, as Docker mode reads them, and what reached dockerd."""

    DRIVER = "cgroupfs"

    def sandbox(self, labels: dict[str, str]) -> adapters.RunPodSandbox:
        body = {
            "Labels": {docker_translate.TYPE_LABEL: docker_translate.SANDBOX_TYPE, **labels},
            "HostConfig": {"CgroupParent": POD_PARENT},
        }
        return docker_translate.SandboxCreate("k8s_POD_web_default_uid-1_0", body, self.DRIVER)

    def container(self, sandbox_id: str, envs: Sequence[tuple[str, str]]) -> adapters.CreateContainer:
        body = {
            "Env": [f"{key}={value}" for key, value in envs],
            "Labels": {
                docker_translate.TYPE_LABEL: docker_translate.CONTAINER_TYPE,
                docker_translate.SANDBOX_ID_LABEL: sandbox_id,
            },
            "HostConfig": {"CgroupParent": POD_PARENT, "CpuShares": 2, "CpuQuota": 100000, "CpusetCpus": "0-3"},
        }
        return docker_translate.ContainerCreate("k8s_app_web_default_uid-1_0", body, self.DRIVER)

    def update(self, container_id: str, cpu_shares: int = 0, cpuset: str = "") -> adapters.UpdateContainerResources:
        body: dict[str, object] = {"CpuShares": cpu_shares} if cpu_shares else {}
        if cpuset:
            body["CpusetCpus"] = cpuset
        return docker_translate.ContainerUpdate(container_id, body)

    def sandbox_parent(self, sent: bytes) -> str:
        return str(json.loads(sent)["HostConfig"]["CgroupParent"])

    def container_sent(self, sent: bytes) -> tuple[list[tuple[str, str]], str, str]:
        body = json.loads(sent)
        envs = [tuple(entry.split("=", 1)) for entry in body["Env"]]
        host = body["HostConfig"]
        return envs, host["CpusetCpus"], host["CgroupParent"]

    def update_sent(self, sent: bytes) -> tuple[int, str]:
        body = json.loads(sent)
        return body["CpuShares"], body["CpusetCpus"]

    def quota_sent(self, sent: bytes, create: bool = False) -> int:
        body = json.loads(sent)
        return int((body["HostConfig"] if create else body)["CpuQuota"])


class NRIWire:
    """containerd's NRI requests, as NRI mode reads them, and what the container gets from koordrp's answers
    (applied as containerd applies an adjustment or an update over the request)."""

    def __init__(self) -> None:
        self._container = nri.Container()
        self._update = nri.LinuxResources()

    def pod(self) -> nri.PodSandbox:
        return nri.PodSandbox(
            id="s-1", name="web", namespace="default", uid="uid-1", linux=nri.LinuxPodSandbox(cgroup_parent=POD_PARENT)
        )

    def sandbox(self, labels: dict[str, str]) -> adapters.RunPodSandbox:
        pod = self.pod()
        pod.labels.update(labels)
        return nri_translate.RunPodSandbox(pod)

    def container(self, sandbox_id: str, envs: Sequence[tuple[str, str]]) -> adapters.CreateContainer:
        resources = nri.LinuxResources()
        resources.cpu.shares.value, resources.cpu.quota.value, resources.cpu.cpus = 2, 100000, "0-3"
        self._container = nri.Container(
            id="c-new",
            pod_sandbox_id=sandbox_id,
            name="app",
            env=[f"{key}={value}" for key, value in envs],
            linux=nri.LinuxContainer(resources=resources, cgroups_path=f"{POD_PARENT}/c-new"),
        )
        return nri_translate.CreateContainer(self.pod(), self._container)

    def update(self, container_id: str, cpu_shares: int = 0, cpuset: str = "") -> adapters.UpdateContainerResources:
        self._update = nri.LinuxResources()
        self._update.cpu.shares.value, self._update.cpu.cpus = cpu_shares, cpuset
        return nri_translate.UpdateContainer(nri.Container(id=container_id), self._update)

    def sandbox_parent(self, sent: bytes | None) -> str:
        assert sent is None  # NRI cannot change a sandbox
        return POD_PARENT

    def container_sent(self, sent: bytes | None) -> tuple[list[tuple[str, str]], str, str]:
        adjust = nri.CreateContainerResponse.FromString(sent or b"").adjust
        adjusted = {entry.key: entry.value for entry in adjust.env}
        sent_envs = [entry.split("=", 1) for entry in self._container.env]
        envs = [(key, adjusted.pop(key, value)) for key, value in sent_envs] + list(adjusted.items())
        cpuset = adjust.linux.resources.cpu.cpus or self._container.linux.resources.cpu.cpus
        path = adjust.linux.cgroups_path or self._container.linux.cgroups_path
        return envs, cpuset, path.rsplit("/", 1)[0]

    def update_sent(self, sent: bytes | None) -> tuple[int, str]:
        [update] = nri.UpdateContainerResponse.FromString(sent or b"").update
        cpu = update.linux.resources.cpu
        shares = cpu.shares.value if cpu.HasField("shares") else self._update.cpu.shares.value
        return shares, cpu.cpus or self._update.cpu.cpus

    def quota_sent(self, sent: bytes | None, create: bool = False) -> int:
        if create:
            quota = nri.CreateContainerResponse.FromString(sent or b"").adjust.linux.resources.cpu.quota
        else:
            [update] = nri.UpdateContainerResponse.FromString(sent or b"").update
            quota = update.linux.resources.cpu.quota
        return quota.value


class FlowTestCase(SynchronousTestCase):
    def setUp(self) -> None:
        self.store = Store()
        self.stages = ScriptedStages()
        self.runtime = RecordingRuntime()
        self.servers = HookServers()
        self.clock = Clock()
        self.parts = Parts(self.store, self.stages, lambda: self.servers, SKIP, self.clock)
        self.calls: list[Call[Reply]] = []
        self.events = logged_events(self)

    def call_lines(self) -> list[LogEvent]:
        return [event for event in self.events if event.get("log_namespace") == "koordrp.calls"]

    def subscribe(self, *hooks: HookType) -> None:
        self.servers = HookServers(
            (HookServerConfig("a.json", "/run/a.sock", FailurePolicy.FAIL, frozenset(hooks), 2.0),)
        )

    def call(self, method: str = "Method", timeout: float | None = None) -> "Call[Reply]":
        call = Call(self.parts, method, self.runtime, timeout)
        self.calls.append(call)
        return call

    @property
    def announced(self) -> list[PostStage]:
        """The post stages the calls made so far owe, in order."""
        return [post for call in self.calls for post in call.posts]

    @property
    def not_made(self) -> list[tuple[HookType, str, str]]:
        """The hook calls the calls made so far spared: hook, server and why."""
        return [(c.hook, c.server.name, c.result) for call in self.calls for c in call.record.calls if c.result in NOT_MADE]

    def start(self, flow: Callable[..., Coroutine[Any, Any, Reply]], *args: Any) -> "Deferred[adapters.Outcome[Reply]]":
        """Start ``flow`` with a new call and ``args``; the call is ``self.calls[-1]``."""
        call = self.call()
        return call.run(flow(call, *args))

    def drive(self, flow: Callable[..., Coroutine[Any, Any, Reply]], *args: Any) -> "adapters.Outcome[Reply]":
        """Run ``flow`` to its end with a new call and ``args``; its outcome."""
        return self.successResultOf(self.start(flow, *args))

    def put_pod(self, sandbox_id: str = "s-1", labels: dict[str, str] | None = None, parent: str = POD_PARENT) -> PodHookRequest:
        pod = PodHookRequest(pod_meta=hook.PodSandboxMetadata(name="web", uid="uid-1"), labels=labels or {}, cgroup_parent=parent)
        self.store.put_pod(sandbox_id, pod, pod)
        return pod

    def put_container(self, container_id: str = "c-1", labels: dict[str, str] | None = None) -> ContainerHookRequest:
        container = ContainerHookRequest(
            pod_meta=hook.PodSandboxMetadata(name="web", uid="uid-1"),
            container_meta=hook.ContainerMetadata(name="app", id=container_id),
            pod_labels=labels or {},
            container_envs={"A": "1"},
            container_resources=hook.LinuxContainerResources(cpu_shares=2, cpuset_cpus="0-3"),
        )
        self.store.put_container(container_id, "s-1", container, container)
        return container


class RequestRules:
    """Rules about what a flow writes into the request; a subclass per front end gives ``wire``."""

    wire: Any

    def test_with_nobody_subscribed_the_request_goes_as_received_and_is_remembered(self: Any) -> None:
        self.drive(flows.run_pod_sandbox, self.wire.sandbox({"app": "web"}))
        self.assertEqual((self.stages.ran, self.runtime.forwarded), ([], [None]))
        stored = self.store.pod("created-1")
        self.assertEqual((dict(stored.given.labels), stored.given.cgroup_parent), ({"app": "web"}, POD_PARENT))
        self.assertEqual(stored.asked, stored.given)

    def test_pre_hook_changes_reach_the_runtime_and_the_store(self: Any) -> None:
        self.subscribe(PRE_RUN, PRE_CREATE)
        self.stages.answers[PRE_RUN] = hook.PodSandboxHookResponse(cgroup_parent="/moved")
        self.stages.answers[PRE_CREATE] = hook.ContainerResourceHookResponse(
            container_envs={"ADDED": "1"}, container_resources=hook.LinuxContainerResources(cpuset_cpus="2-3")
        )
        self.drive(flows.run_pod_sandbox, self.wire.sandbox({"app": "web"}))
        self.assertEqual(self.wire.sandbox_parent(self.runtime.forwarded[0]), "/moved")
        pod = self.store.pod("created-1")
        self.assertEqual((pod.asked.cgroup_parent, pod.given.cgroup_parent), (POD_PARENT, "/moved"))
        self.runtime.created_id = "c-1"
        self.drive(flows.create_container, self.wire.container("created-1", [("A", "1"), ("B", "2")]))
        envs, cpuset, parent = self.wire.container_sent(self.runtime.forwarded[1])
        self.assertEqual((envs, cpuset, parent), ([("A", "1"), ("B", "2"), ("ADDED", "1")], "2-3", "/moved"))
        self.assertEqual(self.stages.ran[1].request.pod_cgroup_parent, "/moved")
        stored = self.store.container("c-1")
        self.assertEqual((stored.sandbox_id, stored.asked.container_meta.id, stored.given.container_meta.id), ("created-1", "c-1", "c-1"))
        # What kubelet asked, apart from what the runtime was given.
        self.assertEqual(dict(stored.asked.container_envs), {"A": "1", "B": "2"})
        self.assertEqual(dict(stored.given.container_envs), {"A": "1", "B": "2", "ADDED": "1"})
        self.assertEqual((stored.asked.container_resources.cpuset_cpus, stored.given.container_resources.cpuset_cpus), ("0-3", "2-3"))

    def test_the_pods_cgroup_parent_from_the_store_reaches_create_without_a_hook(self: Any) -> None:
        self.put_pod(parent="/moved/by/PreRunPodSandbox")
        self.drive(flows.create_container, self.wire.container("s-1", [("A", "1")]))
        self.assertEqual(self.stages.ran, [])
        self.assertEqual(self.wire.container_sent(self.runtime.forwarded[0])[2], "/moved/by/PreRunPodSandbox")

    def test_the_skip_label_spares_every_hook_and_counts_each(self: Any) -> None:
        self.subscribe(*HookType)
        self.drive(flows.run_pod_sandbox, self.wire.sandbox({SKIP.key: SKIP.value}))
        self.runtime.created_id = "c-1"
        self.drive(flows.create_container, self.wire.container("created-1", [("A", "1")]))
        self.drive(flows.start_container, "c-1")
        self.drive(flows.update_container_resources, self.wire.update("c-1", 512))
        self.drive(flows.stop_container, "c-1")
        self.drive(flows.stop_pod_sandbox, "created-1")
        self.assertEqual((self.stages.ran, self.announced), ([], []))
        self.assertEqual(
            self.not_made,
            [(hook, "a.json", SKIPPED) for hook in (PRE_RUN, PRE_CREATE, PRE_START, POST_START, PRE_UPDATE, POST_STOP, POST_STOP_POD)],
        )
        self.assertEqual(self.runtime.forwarded, [None] * 6)

    def test_a_failing_fail_policy_hook_stops_the_call_before_the_runtime(self: Any) -> None:
        self.subscribe(PRE_CREATE)
        self.stages.failures[PRE_CREATE] = "no answer within 2s"
        self.put_pod()
        refusal = self.drive(flows.create_container, self.wire.container("s-1", [("A", "1")]))
        self.assertEqual(refusal.kind, adapters.RefusalKind.HOOK_FAILED)
        self.assertIn("a.json", refusal.message)
        self.assertIn("PreCreateContainer: no answer within 2s", refusal.message)
        self.assertEqual((self.runtime.forwarded, self.store.sizes()), ([], (1, 0)))

    def test_what_the_runtime_refuses_is_not_remembered(self: Any) -> None:
        self.runtime.ok = False
        self.drive(flows.run_pod_sandbox, self.wire.sandbox({}))
        self.put_pod()
        self.drive(flows.create_container, self.wire.container("s-1", [("A", "1")]))
        self.assertEqual(self.store.sizes(), (1, 0))
        self.put_container()
        self.drive(flows.update_container_resources, self.wire.update("c-1", 512))
        self.assertEqual(self.store.container("c-1").asked.container_resources.cpu_shares, 2)

    def test_an_update_folds_in_kubelets_values_writes_back_the_hooks_and_is_remembered(self: Any) -> None:
        self.put_container()
        self.subscribe(PRE_UPDATE)
        self.stages.answers[PRE_UPDATE] = hook.ContainerResourceHookResponse(
            container_resources=hook.LinuxContainerResources(cpuset_cpus="1")
        )
        self.drive(flows.update_container_resources, self.wire.update("c-1", 512))
        seen = self.stages.ran[0].request.container_resources
        self.assertEqual((seen.cpu_shares, seen.cpuset_cpus), (512, "0-3"))
        self.assertEqual(self.wire.update_sent(self.runtime.forwarded[0]), (512, "1"))
        stored = self.store.container("c-1")
        asked, given = stored.asked.container_resources, stored.given.container_resources
        self.assertEqual((asked.cpu_shares, asked.cpuset_cpus, given.cpu_shares, given.cpuset_cpus), (512, "0-3", 512, "1"))

    def test_an_updates_env_or_cgroup_parent_change_is_named_left_alone(self: Any) -> None:
        self.put_container()
        self.subscribe(PRE_UPDATE)
        self.stages.behaviours[PRE_UPDATE] = lambda request: hook.ContainerResourceHookResponse(
            container_envs={"A": "1", "ADDED": "1"}, pod_cgroup_parent="/moved"
        )
        self.drive(flows.update_container_resources, self.wire.update("c-1", 512))
        [update] = self.calls[0].record.calls
        self.assertEqual(
            sorted((change.path, change.applied, change.why) for change in update.changes),
            [
                ("container_envs[ADDED]", False, "a container's update cannot change it"),
                ("pod_cgroup_parent", False, "a container's update cannot change it"),
            ],
        )
        self.assertEqual(self.store.container("c-1").given.container_envs, {"A": "1"})

    def test_a_hook_that_scales_a_value_scales_kubelets_once_however_often_kubelet_updates(self: Any) -> None:
        """kubelet's static CPU manager sends cpuset-only updates; a quota-halving hook must not compound."""
        self.put_pod("s-1")
        self.subscribe(PRE_CREATE, PRE_UPDATE)

        def halve(request: HookRequest) -> hook.ContainerResourceHookResponse:
            answer = hook.ContainerResourceHookResponse()
            assert isinstance(request, ContainerHookRequest)
            answer.container_resources.CopyFrom(request.container_resources)
            answer.container_resources.cpu_quota = request.container_resources.cpu_quota // 2
            return answer

        self.stages.behaviours[PRE_CREATE] = self.stages.behaviours[PRE_UPDATE] = halve
        self.runtime.created_id = "c-1"
        self.drive(flows.create_container, self.wire.container("s-1", [("A", "1")]))
        self.assertEqual(self.wire.quota_sent(self.runtime.forwarded[0], create=True), 50000)
        for cpuset in ("1", "0-1", "1"):
            self.drive(flows.update_container_resources, self.wire.update("c-1", cpuset=cpuset))
            self.assertEqual(self.wire.quota_sent(self.runtime.forwarded[-1]), 50000)
        self.assertEqual([record.request.container_resources.cpu_quota for record in self.stages.ran], [100000] * 4)
        stored = self.store.container("c-1")
        self.assertEqual((stored.asked.container_resources.cpu_quota, stored.given.container_resources.cpu_quota), (100000, 50000))

    def test_a_container_of_a_sandbox_nobody_knows_goes_unchanged_without_hooks(self: Any) -> None:
        self.subscribe(PRE_CREATE)
        self.drive(flows.create_container, self.wire.container("no-such-sandbox", [("A", "1")]))
        self.assertEqual((self.stages.ran, self.runtime.forwarded), ([], [None]))
        self.assertEqual((self.runtime.read_back, self.store.sizes()), (["no-such-sandbox"], (0, 0)))


class CRIRequestRules(RequestRules, FlowTestCase):
    wire = CRIWire()


class DockerRequestRules(RequestRules, FlowTestCase):
    wire = DockerWire()


class NRIRequestRules(RequestRules, FlowTestCase):
    wire = NRIWire()

    def test_pre_hook_changes_reach_the_runtime_and_the_store(self) -> None:
        """NRI cannot change a sandbox: its hooks' answer is named as left alone, and recorded for later hooks."""
        self.subscribe(PRE_RUN, PRE_CREATE)
        self.stages.answers[PRE_RUN] = hook.PodSandboxHookResponse(cgroup_parent="/moved", labels={"seen": "1"})
        self.stages.answers[PRE_CREATE] = hook.ContainerResourceHookResponse(
            container_envs={"ADDED": "1"}, container_resources=hook.LinuxContainerResources(cpuset_cpus="2-3")
        )
        self.drive(flows.run_pod_sandbox, self.wire.sandbox({"app": "web"}))
        self.assertEqual(self.runtime.forwarded, [None])
        [run] = self.calls[0].record.calls
        self.assertEqual(
            [(change.path, change.applied, change.why) for change in run.changes],
            [("labels[seen]", False, nri_translate.NO_SANDBOX_CHANGES), ("cgroup_parent", False, nri_translate.NO_SANDBOX_CHANGES)],
        )
        pod = self.store.pod("created-1")
        assert pod is not None
        self.assertEqual((pod.asked.cgroup_parent, pod.given.cgroup_parent), (POD_PARENT, "/moved"))
        self.runtime.created_id = "c-1"
        self.drive(flows.create_container, self.wire.container("created-1", [("A", "1"), ("B", "2")]))
        # The container is placed under the parent the pod's hooks chose: its cgroups path moves.
        envs, cpuset, parent = self.wire.container_sent(self.runtime.forwarded[1])
        self.assertEqual((envs, cpuset, parent), ([("A", "1"), ("B", "2"), ("ADDED", "1")], "2-3", "/moved"))
        stored = self.store.container("c-1")
        assert stored is not None
        self.assertEqual(dict(stored.given.container_envs), {"A": "1", "B": "2", "ADDED": "1"})
        self.assertEqual((stored.asked.container_resources.cpuset_cpus, stored.given.container_resources.cpuset_cpus), ("0-3", "2-3"))

    def test_what_nri_cannot_set_is_left_alone_named_and_counted(self) -> None:
        metrics = Metrics()
        self.parts = Parts(self.store, self.stages, lambda: self.servers, SKIP, self.clock, metrics)
        self.put_pod()
        self.subscribe(PRE_CREATE)
        # koordlet's answer for a best-effort pod: a copy of the request whose cpuset is cleared.
        self.stages.behaviours[PRE_CREATE] = lambda request: hook.ContainerResourceHookResponse(
            container_resources=hook.LinuxContainerResources(cpu_shares=2, cpuset_cpus="", oom_score_adj=5)
        )
        self.drive(flows.create_container, self.wire.container("s-1", [("A", "1")]))
        self.assertEqual(self.runtime.forwarded, [None])  # nothing NRI can express changed
        [create] = self.calls[0].record.calls
        self.assertEqual(
            [(change.path, change.applied, change.why) for change in create.changes],
            [
                ("container_resources.oom_score_adj", False, nri_translate.NO_OOM_SCORE),
                ("container_resources.cpuset_cpus", False, nri_translate.NO_CLEARING),
            ],
        )
        self.calls[0].ended()
        counted = {
            field: metrics.registry.get_sample_value(
                "koordrp_hook_changes_left_alone_total", {"server": "a.json", "hook": "PreCreateContainer", "field": field}
            )
            for field in ("resources.cpuset_cpus", "resources.oom_score_adj")
        }
        self.assertEqual(counted, {"resources.cpuset_cpus": 1.0, "resources.oom_score_adj": 1.0})


class IdentityRules(FlowTestCase):
    """Rules of the flows that take only an id: the same in both modes by construction."""

    def test_start_runs_its_pre_stage_then_the_runtime_then_its_post_stage(self) -> None:
        self.put_container()
        self.subscribe(PRE_START, POST_START)
        self.stages.answers[PRE_START] = hook.ContainerResourceHookResponse(container_envs={"STARTED": "1"})
        self.drive(flows.start_container, "c-1")
        self.assertEqual(self.stages.hooks_run(), [PRE_START])
        self.assertEqual(self.runtime.forwarded, [None])
        [post] = self.announced
        # The post hook is told what kubelet asked, not what the pre hook made of it.
        self.assertEqual((post.hook, dict(container_request(post.request).container_envs)), (POST_START, {"A": "1"}))

    def test_no_post_stage_when_the_runtime_refused(self) -> None:
        self.put_container()
        self.put_pod()
        self.subscribe(POST_START, POST_STOP, POST_STOP_POD)
        self.runtime.ok = False
        for flow in (flows.start_container, flows.stop_container):
            self.drive(flow, "c-1")
        self.drive(flows.stop_pod_sandbox, "s-1")
        self.assertEqual(self.announced, [])

    def test_stops_announce_their_post_stage_with_what_is_stored(self) -> None:
        stored = self.put_container()
        pod = self.put_pod()
        self.subscribe(POST_STOP, POST_STOP_POD)
        self.drive(flows.stop_container, "c-1")
        self.drive(flows.stop_pod_sandbox, "s-1")
        in_pod = placed_in_pod(copied(stored), pod)
        self.assertEqual(
            [(post.hook, post.request) for post in self.announced], [(POST_STOP, in_pod), (POST_STOP_POD, pod)]
        )

    def posts_by_name(self) -> list[tuple[HookType, str]]:
        def name(request: HookRequest) -> str:
            if isinstance(request, ContainerHookRequest) and request.container_meta.name:
                return request.container_meta.name
            return request.pod_meta.name

        return [(post.hook, name(post.request)) for post in self.announced]

    def test_post_stop_fires_once_per_stop_and_a_start_arms_it_again(self) -> None:
        self.put_container()
        self.subscribe(POST_START, POST_STOP)
        for flow in (flows.start_container, flows.start_container, flows.stop_container, flows.stop_container):
            self.drive(flow, "c-1")
        self.assertEqual(self.posts_by_name(), [(POST_START, "app"), (POST_STOP, "app")])
        self.drive(flows.start_container, "c-1")
        self.drive(flows.stop_container, "c-1")
        self.assertEqual(self.posts_by_name()[2:], [(POST_START, "app"), (POST_STOP, "app")])
        self.assertEqual(self.runtime.forwarded, [None] * 6)

    def test_stopping_a_pod_stops_its_containers_first_and_once(self) -> None:
        self.put_pod()
        for container_id in ("c-1", "c-2"):
            self.put_container(container_id)
            self.drive(flows.start_container, container_id)
        self.subscribe(POST_STOP, POST_STOP_POD)
        self.drive(flows.stop_pod_sandbox, "s-1")
        self.drive(flows.stop_pod_sandbox, "s-1")
        self.drive(flows.stop_container, "c-1")
        self.assertEqual([post.hook for post in self.announced], [POST_STOP, POST_STOP, POST_STOP_POD])
        self.assertEqual([container_request(post.request).container_meta.id for post in self.announced[:2]], ["c-1", "c-2"])

    def test_a_container_the_runtime_says_has_exited_owes_no_post_stop(self) -> None:
        self.runtime.containers["c-1"] = StoredContainer.read_back("s-1", ContainerHookRequest(), ContainerState.STOPPED)
        self.subscribe(POST_STOP)
        self.drive(flows.stop_container, "c-1")
        self.assertEqual((self.announced, self.runtime.read_back), ([], ["c-1", "s-1"]))

    def test_stopping_what_nobody_knows_calls_no_hook(self) -> None:
        self.subscribe(POST_STOP, POST_STOP_POD)
        self.drive(flows.stop_container, "no-such-container")
        self.drive(flows.stop_pod_sandbox, "no-such-pod")
        self.assertEqual((self.announced, self.runtime.forwarded), ([], [None, None]))

    def test_removes_forget_a_container_and_a_pod_with_its_containers(self) -> None:
        self.put_pod()
        self.put_container("c-1")
        self.put_container("c-2")
        self.drive(flows.remove_container, "c-1")
        self.assertEqual(self.store.sizes(), (1, 1))
        self.drive(flows.remove_pod_sandbox, "s-1")
        self.assertEqual(self.store.sizes(), (0, 0))

    def test_a_container_the_store_lacks_is_read_back_with_its_pod_and_remembered(self) -> None:
        self.runtime.pods["s-1"] = PodHookRequest(labels={"app": "web"}, cgroup_parent="/from/the/runtime")
        self.runtime.containers["c-1"] = StoredContainer.read_back("s-1", ContainerHookRequest(container_envs={"A": "1"}), ContainerState.CREATED)
        self.subscribe(PRE_START)
        self.drive(flows.start_container, "c-1")
        self.assertEqual(self.runtime.read_back, ["c-1", "s-1"])
        seen = container_request(self.stages.ran[0].request)
        self.assertEqual((dict(seen.pod_labels), seen.pod_cgroup_parent), ({"app": "web"}, "/from/the/runtime"))
        self.assertEqual(self.store.sizes(), (1, 1))
        self.drive(flows.start_container, "c-1")
        self.assertEqual(self.runtime.read_back, ["c-1", "s-1"])

    def test_a_runtime_that_cannot_say_costs_a_warning_and_the_call_goes_on_without_hooks(self) -> None:
        self.runtime.broken = "UNAVAILABLE: connection refused"
        self.subscribe(PRE_START, POST_START)
        self.drive(flows.start_container, "c-1")
        self.assertEqual((self.stages.ran, self.announced, self.runtime.forwarded), ([], [], [None]))
        [warning] = [event for event in self.events if "could not be read from the runtime" in event["log_format"]]
        self.assertEqual((warning["kind"], warning["id"], warning["error"]), ("container", "c-1", "UNAVAILABLE: connection refused"))

    def test_the_call_record_names_the_subject_and_every_hook_called(self) -> None:
        stored = self.put_container()
        self.subscribe(PRE_START, POST_START)
        self.drive(flows.start_container, "c-1")
        call = self.calls[-1]
        self.assertEqual(container_request(call.record.subject).container_meta, stored.container_meta)
        self.assertEqual(
            [(c.hook, c.server.name, c.result) for c in call.record.calls], [(PRE_START, "a.json", "ok"), (POST_START, "a.json", "sent")]
        )

    def test_the_call_record_names_the_post_hooks_of_a_server_that_skips_them_not_answering(self) -> None:
        self.put_container()
        self.subscribe(POST_STOP)
        self.stages.posts_skipped["a.json"] = "not answering in time for 3s (last: no answer within 2s); …"
        self.drive(flows.stop_container, "c-1")
        [post] = self.calls[-1].record.calls
        self.assertEqual((post.hook, post.result, post.reason), (POST_STOP, NOT_ANSWERING, self.stages.posts_skipped["a.json"]))
        self.assertEqual([stage.hook for stage in self.announced], [POST_STOP])  # the dispatcher decides, when it runs

    def test_a_request_that_cannot_be_read_goes_as_it_came_without_hooks(self) -> None:
        self.servers = HookServers(
            (HookServerConfig("a.json", "/run/a.sock", FailurePolicy.IGNORE, frozenset({PRE_CREATE}), 2.0),)
        )
        self.drive(flows.unreadable, "CreateContainer", "truncated message")
        self.assertEqual((self.runtime.forwarded, self.stages.ran), ([None], []))
        self.assertEqual(self.not_made, [(PRE_CREATE, "a.json", UNREADABLE)])
        [warning] = [event for event in self.events if "cannot read the {method} request" in event["log_format"]]
        self.assertEqual((warning["method"], warning["reason"]), ("CreateContainer", "truncated message"))

    def test_a_fail_policy_pre_hook_refuses_a_request_it_cannot_be_shown(self) -> None:
        self.subscribe(PRE_CREATE)
        refusal = self.drive(flows.unreadable, "CreateContainer", "truncated message")
        assert isinstance(refusal, adapters.Refusal), refusal
        self.assertEqual(refusal.kind, adapters.RefusalKind.UNREADABLE)
        self.assertIn("a.json (Fail policy) must see at PreCreateContainer: truncated message", refusal.message)
        self.assertEqual(self.runtime.forwarded, [])

    def test_post_hooks_never_refuse_a_request(self) -> None:
        self.subscribe(POST_STOP)
        self.drive(flows.unreadable, "StopContainer", "truncated message")
        self.assertEqual(self.runtime.forwarded, [None])
        self.assertEqual(self.not_made, [(POST_STOP, "a.json", UNREADABLE)])

    def test_what_a_call_owes_waits_until_it_has_answered(self) -> None:
        metrics = Metrics()
        clock = Clock()
        self.parts = Parts(self.store, Dispatcher(HookClients(clock), clock, metrics), lambda: self.servers, SKIP, clock, metrics)
        self.put_container("c-1", labels={SKIP.key: SKIP.value})
        self.put_container("c-2")
        self.subscribe(PRE_START, POST_START, POST_STOP)
        self.drive(flows.start_container, "c-1")
        self.drive(flows.stop_container, "c-2")
        start, stop = self.calls

        def counted(name: str, **labels: str) -> float | None:
            return metrics.registry.get_sample_value(name, labels)

        def hook_calls(hook: HookType, result: str) -> float | None:
            return counted("koordrp_hook_calls_total", server="a.json", hook=hook.value, result=result)

        self.assertEqual([hook_calls(PRE_START, SKIPPED), hook_calls(POST_STOP, "error")], [None, None])
        self.assertEqual(self.call_lines(), [])
        start.ended()
        stop.ended()
        stop.ended()  # once is all a call ends
        # The skipped ones are counted; the post stage was made (a.json has no socket here: it failed).
        self.assertEqual([hook_calls(PRE_START, SKIPPED), hook_calls(POST_START, SKIPPED), hook_calls(POST_STOP, "error")], [1, 1, 1])
        self.assertEqual([(line["method"], line["outcome"]) for line in self.call_lines()], [("Method", "OK")] * 2)
        self.assertEqual(
            [counted("koordrp_cri_calls_total", method=method, code="OK") for method in ("StartContainer", "StopContainer")], [1, 1]
        )

    def test_hooks_shown_the_runtimes_values_for_want_of_kubelets_say_so_in_the_calls_line(self) -> None:
        class Garbled(NoCheckpoint):
            def read(self, kind: Kind, identifier: str, parse: Callable[[bytes], Parsed]) -> Parsed | None:
                raise StateUnreadable(f"/state/{kind}/{identifier}: garbled")

        self.store = Store(Garbled())
        self.parts = replace(self.parts, store=self.store)
        self.runtime.pods["s-1"] = PodHookRequest(pod_meta=hook.PodSandboxMetadata(name="web", uid="uid-1"))
        self.runtime.containers["c-1"] = StoredContainer.read_back("s-1", ContainerHookRequest(), ContainerState.CREATED)
        self.subscribe(PRE_START, POST_STOP, POST_STOP_POD)
        self.drive(flows.start_container, "c-1")  # read back, with its pod: what kubelet asked for both is lost
        self.runtime.created_id = "c-2"
        self.drive(flows.create_container, CRIWire().container("s-1", []))  # shown its pod as given: nothing lost
        self.drive(flows.stop_container, "c-1")
        self.drive(flows.stop_pod_sandbox, "s-1")  # c-2's PostStopContainer, and the pod's as kubelet asked it
        for call in self.calls:
            call.ended()
        lost = [line["asked_lost"] for line in self.call_lines()]
        self.assertEqual(lost, [True, False, True, True])
        self.assertIn(
            "hooks: PreStartContainer@a.json: ok 1.0 ms; kubelet's values not available (its state file could not be read)",
            formatEvent(self.call_lines()[0]),
        )

    def test_every_flow_calls_the_hooks_its_method_has(self) -> None:
        """flows.METHOD_HOOKS (what an unreadable request of a method spares, and the docs' table) is what the flows do."""
        called: dict[str, set[HookType]] = {}
        for method, flow, args in (
            ("RunPodSandbox", flows.run_pod_sandbox, (CRIWire().sandbox({}),)),
            ("CreateContainer", flows.create_container, (CRIWire().container("s-1", []),)),
            ("StartContainer", flows.start_container, ("c-1",)),
            ("UpdateContainerResources", flows.update_container_resources, (CRIWire().update("c-1", 512),)),
            ("StopContainer", flows.stop_container, ("c-1",)),
            ("StopPodSandbox", flows.stop_pod_sandbox, ("s-1",)),
            ("RemoveContainer", flows.remove_container, ("c-1",)),
            ("RemovePodSandbox", flows.remove_pod_sandbox, ("s-1",)),
            ("UpdatePodSandboxResources", flows.update_pod_sandbox_resources, (CRIWire().resize("s-1", 2000),)),
        ):
            self.store = Store()
            self.parts = Parts(self.store, self.stages, lambda: self.servers, SKIP, self.clock)
            self.put_pod()
            self.put_container()
            self.stages.ran.clear()
            self.calls.clear()
            self.subscribe(*HookType)
            self.drive(flow, *args)
            called[method] = set(self.stages.hooks_run()) | {post.hook for post in self.announced}
        self.assertEqual(called, {method: set(hooks) for method, hooks in flows.METHOD_HOOKS.items()})

    def test_no_flow_changes_a_store_entry_it_reads(self) -> None:
        """The store hands out its entries themselves (no copy on every call's way): flows only read them."""
        changes = hook.ContainerResourceHookResponse(
            container_envs={"HOOKED": "1"},
            container_annotations={"hooked": "1"},
            container_resources=hook.LinuxContainerResources(cpu_shares=7, cpuset_cpus="1"),
            pod_cgroup_parent="/moved",
        )
        for hook_type in HookType:
            self.stages.answers[hook_type] = (
                hook.PodSandboxHookResponse(labels={"hooked": "1"}, cgroup_parent="/moved")
                if hook_type in (PRE_RUN, POST_STOP_POD)
                else changes
            )
        for flow, args in (
            (flows.run_pod_sandbox, (CRIWire().sandbox({}),)),
            (flows.create_container, (CRIWire().container("s-1", []),)),
            (flows.start_container, ("c-1",)),
            (flows.update_container_resources, (CRIWire().update("c-1", 512),)),
            (flows.stop_container, ("c-1",)),
            (flows.stop_pod_sandbox, ("s-1",)),
            (flows.update_pod_sandbox_resources, (CRIWire().resize("s-1", 2000),)),
        ):
            self.store = Store()
            self.parts = replace(self.parts, store=self.store)
            self.put_pod()
            self.put_container()
            self.subscribe(*HookType)
            pod, container = self.store.pod("s-1"), self.store.container("c-1")
            assert pod is not None and container is not None
            before = [entry.SerializeToString() for entry in (pod.asked, pod.given, container.asked, container.given)]
            self.drive(flow, *args)
            after = [entry.SerializeToString() for entry in (pod.asked, pod.given, container.asked, container.given)]
            self.assertEqual(after, before, flow.__name__)


class GoingAheadTests(FlowTestCase):
    """A call its front end may send to the runtime before its flow runs (``flows.goes_ahead``)."""

    # method: its flow, the flow's arguments, the id of what it is about
    AHEAD: dict[str, tuple[Callable[..., Coroutine[Any, Any, Reply]], tuple[Any, ...], str]] = {
        "StartContainer": (flows.start_container, ("c-1",), "c-1"),
        "UpdateContainerResources": (flows.update_container_resources, (CRIWire().update("c-1", 512),), "c-1"),
        "StopContainer": (flows.stop_container, ("c-1",), "c-1"),
        "RemoveContainer": (flows.remove_container, ("c-1",), "c-1"),
        "StopPodSandbox": (flows.stop_pod_sandbox, ("s-1",), "s-1"),
        "RemovePodSandbox": (flows.remove_pod_sandbox, ("s-1",), "s-1"),
        "UpdatePodSandboxResources": (flows.update_pod_sandbox_resources, (CRIWire().resize("s-1", 2000),), "s-1"),
    }

    def ahead(self) -> set[str]:
        subjects = {method: subject for method, (_, _, subject) in self.AHEAD.items()}
        subjects.update(RunPodSandbox="", CreateContainer="s-1")
        return {method for method, subject in subjects.items() if flows.goes_ahead(self.parts, self.servers, method, subject)}

    def test_only_calls_about_what_the_store_knows_whose_pre_hook_calls_nobody(self) -> None:
        self.subscribe(*HookType)
        self.assertEqual(self.ahead(), set())  # the store knows nothing: the flows read back first
        self.put_pod()
        self.put_container()
        without_pre_hooks = {"StopContainer", "RemoveContainer", "StopPodSandbox", "RemovePodSandbox", "UpdatePodSandboxResources"}
        self.assertEqual(self.ahead(), without_pre_hooks)
        self.subscribe(POST_START, POST_STOP, POST_STOP_POD)
        self.assertEqual(self.ahead(), set(self.AHEAD))
        self.subscribe(*HookType)
        skipped = {SKIP.key: SKIP.value}
        self.put_pod(labels=skipped)
        self.put_container(labels=skipped)
        self.assertEqual(self.ahead(), set(self.AHEAD))  # never RunPodSandbox or CreateContainer: they write their own

    def test_the_pods_labels_are_the_stored_pods_as_its_containers_hooks_are_shown_them(self) -> None:
        self.subscribe(*HookType)
        skipped = {SKIP.key: SKIP.value}
        self.put_pod(labels=skipped)
        self.put_container(labels={})  # the container's own copy of its pod's labels is not what is shown
        self.assertIn("StartContainer", self.ahead())
        self.put_pod(labels={})
        self.put_container(labels=skipped)
        self.assertNotIn("StartContainer", self.ahead())
        self.store.forget_pod("s-1")
        self.put_container(labels=skipped)  # a pod the store does not know: the container's copy is all there is
        self.assertIn("StartContainer", self.ahead())

    def test_a_flow_that_went_ahead_forwards_as_it_came_and_calls_no_pre_hook(self) -> None:
        changes = hook.ContainerResourceHookResponse(
            container_annotations={"hooked": "1"}, container_resources=hook.LinuxContainerResources(cpu_shares=7)
        )
        for hook_type in HookType:
            self.stages.answers[hook_type] = changes
        self.subscribe(*HookType)
        went_ahead: set[str] = set()
        for method, (flow, args, subject) in self.AHEAD.items():
            for labels in ({SKIP.key: SKIP.value}, {}):
                self.store = Store()
                self.parts = replace(self.parts, store=self.store)
                self.runtime.forwarded.clear()
                self.stages.ran.clear()
                self.put_pod(labels=labels)
                self.put_container(labels=labels)
                if not flows.goes_ahead(self.parts, self.servers, method, subject):
                    continue
                went_ahead.add(method)
                call: Call[Reply] = Call(self.parts, method, self.runtime, servers=self.servers, went_ahead=True)
                self.successResultOf(call.run(flow(call, *args)))
                self.assertEqual(self.runtime.forwarded, [None], method)
                self.assertEqual([ran.hook for ran in self.stages.ran if ran.hook.is_pre], [], method)
        self.assertEqual(went_ahead, set(self.AHEAD))
        self.assertEqual([event for event in self.events if event.get("log_level") is LogLevel.error], [])

    def test_a_change_made_after_the_call_went_ahead_is_said_not_sent(self) -> None:
        # flows.goes_ahead and the flows agree (above); were they ever not to, koordrp says so.
        self.subscribe(PRE_UPDATE)
        self.stages.answers[PRE_UPDATE] = hook.ContainerResourceHookResponse(
            container_resources=hook.LinuxContainerResources(cpu_shares=7)
        )
        self.put_pod()
        self.put_container()
        call: Call[Reply] = Call(self.parts, "UpdateContainerResources", self.runtime, went_ahead=True)
        self.successResultOf(call.run(flows.update_container_resources(call, CRIWire().update("c-1", 512))))
        [error] = [event for event in self.events if event.get("log_level") is LogLevel.error]
        self.assertIn("the change was not sent", formatEvent(error))


class CancellationTests(FlowTestCase):
    """The caller gives up: what the call waits for is cancelled, and the store and post hooks say what happened."""

    def test_a_hook_stage_in_flight_is_cancelled_and_the_runtime_never_called(self) -> None:
        self.put_container()
        self.subscribe(PRE_START)
        waiting: Deferred[None] = Deferred()
        self.stages.pending[PRE_START] = waiting
        answer = self.start(flows.start_container, "c-1")
        self.assertNoResult(answer)
        answer.cancel()
        self.assertIs(self.successResultOf(answer), adapters.CALLER_GONE)
        self.assertTrue(waiting.called)  # by its cancellation: nothing else fires it
        self.assertEqual(self.runtime.forwarded, [])

    def test_the_runtime_call_in_flight_is_cancelled(self) -> None:
        self.runtime.answering = Deferred()
        answer = self.start(flows.run_pod_sandbox, CRIWire().sandbox({}))
        self.calls[-1].cancel()
        self.assertIs(self.successResultOf(answer), adapters.CALLER_GONE)
        self.assertEqual((self.runtime.cancelled, self.store.sizes()), (1, (0, 0)))

    def test_a_failure_inside_koordrp_after_the_caller_went_away_is_still_said(self) -> None:
        """What a flow does once its caller is gone (settling a stop, say) fails loudly, not silently."""
        going_on: Deferred[None] = Deferred()

        async def settles_then_fails(call: Call[Reply]) -> Reply:
            try:
                await Deferred()  # the runtime's call, cancelled with the caller
            except CancelledError:
                await going_on  # asking the runtime what happened, on koordrp's own account
                raise KeyError("c-1")
            raise AssertionError("not cancelled")

        answer = self.start(settles_then_fails)
        self.calls[-1].cancel()
        self.assertIs(self.successResultOf(answer), adapters.CALLER_GONE)
        going_on.callback(None)
        self.assertEqual(len(self.flushLoggedErrors(KeyError)), 1)

    def test_a_failure_after_the_forward_is_said_and_the_runtimes_answer_stands(self) -> None:
        # The runtime made the pod: kubelet must hear so, even if koordrp's own bookkeeping then fails.
        class Broken(NoCheckpoint):
            def write(self, kind: Kind, identifier: str, data: bytes | None) -> bool:
                if kind != "pending":  # what is kept before the forward
                    raise KeyError(identifier)
                return True

        self.store = Store(Broken())
        self.parts = replace(self.parts, store=self.store)
        outcome = self.drive(flows.run_pod_sandbox, CRIWire().sandbox({}))
        self.assertEqual(outcome, Reply(True, "created-1"))
        self.assertEqual(len(self.flushLoggedErrors(KeyError)), 1)
        self.calls[-1].ended()
        self.assertEqual([line["outcome"] for line in self.call_lines()], ["OK"])

    def test_a_failure_before_the_forward_refuses_the_call(self) -> None:
        async def fails(call: Call[Reply]) -> Reply:
            raise KeyError("c-1")

        outcome = self.drive(fails)
        assert isinstance(outcome, adapters.Refusal)
        self.assertEqual(outcome.kind, adapters.RefusalKind.INTERNAL)
        self.assertEqual(len(self.flushLoggedErrors(KeyError)), 1)

    def stop_cancelled(self, runtime_state: ContainerState) -> None:
        self.put_container()
        self.subscribe(POST_STOP)
        self.runtime.containers["c-1"] = StoredContainer.read_back("s-1", ContainerHookRequest(), runtime_state)
        self.runtime.answering = Deferred()
        answer = self.start(flows.stop_container, "c-1")
        self.calls[-1].cancel()
        self.assertIs(self.successResultOf(answer), adapters.CALLER_GONE)
        self.assertEqual(self.runtime.cancelled, 1)
        # Asked on koordrp's own bound: the caller's deadline is of no use once it is gone.
        self.assertEqual(self.runtime.timeouts[-1], SETTLE_SECONDS)
        self.runtime.answering = None

    def test_a_cancelled_stop_the_runtime_did_not_do_owes_no_post_stop_until_a_stop_succeeds(self) -> None:
        self.stop_cancelled(ContainerState.RUNNING)
        stored = self.store.container("c-1")
        assert stored is not None
        self.assertEqual((self.announced, stored.state), ([], ContainerState.CREATED))
        self.drive(flows.stop_container, "c-1")
        self.drive(flows.stop_container, "c-1")
        self.assertEqual([post.hook for post in self.announced], [POST_STOP])

    def test_a_cancelled_stop_the_runtime_did_all_the_same_owes_its_post_stop_once(self) -> None:
        self.stop_cancelled(ContainerState.STOPPED)
        stored = self.store.container("c-1")
        assert stored is not None
        self.assertEqual(stored.state, ContainerState.STOPPED)
        self.drive(flows.stop_container, "c-1")
        self.assertEqual([post.hook for post in self.announced], [POST_STOP])

    def test_a_cancelled_pod_stop_owes_its_post_stops_only_if_the_runtime_stopped_it(self) -> None:
        self.put_pod()
        self.put_container()
        self.subscribe(POST_STOP, POST_STOP_POD)
        self.runtime.pods["s-1"] = PodHookRequest()
        self.runtime.answering = Deferred()
        self.calls.clear()
        answer = self.start(flows.stop_pod_sandbox, "s-1")
        self.calls[-1].cancel()
        self.assertIs(self.successResultOf(answer), adapters.CALLER_GONE)
        self.assertEqual(self.announced, [])  # the runtime says the pod is still up
        self.runtime.answering = None
        self.drive(flows.stop_pod_sandbox, "s-1")
        self.assertEqual([post.hook for post in self.announced], [POST_STOP, POST_STOP_POD])

    def remove_cancelled(self, flow: Callable[..., Coroutine[Any, Any, Reply]], identifier: str) -> None:
        self.runtime.answering = Deferred()
        cancelled = self.runtime.cancelled
        answer = self.start(flow, identifier)
        self.calls[-1].cancel()
        self.assertIs(self.successResultOf(answer), adapters.CALLER_GONE)
        self.assertEqual((self.runtime.cancelled - cancelled, self.runtime.timeouts[-1]), (1, SETTLE_SECONDS))
        self.runtime.answering = None

    def test_a_cancelled_removal_forgets_only_what_the_runtime_no_longer_has(self) -> None:
        self.put_pod()
        self.put_container()
        self.runtime.pods["s-1"] = PodHookRequest()
        self.runtime.containers["c-1"] = StoredContainer.read_back("s-1", ContainerHookRequest(), ContainerState.STOPPED)
        self.remove_cancelled(flows.remove_container, "c-1")  # the runtime still has it
        self.remove_cancelled(flows.remove_pod_sandbox, "s-1")
        self.assertEqual(self.store.sizes(), (1, 1))
        del self.runtime.containers["c-1"]
        self.remove_cancelled(flows.remove_container, "c-1")  # the runtime removed it all the same
        self.assertEqual(self.store.sizes(), (1, 0))
        del self.runtime.pods["s-1"]
        self.remove_cancelled(flows.remove_pod_sandbox, "s-1")
        self.assertEqual(self.store.sizes(), (0, 0))

    def test_a_cancelled_removal_the_runtime_cannot_be_asked_about_forgets_nothing(self) -> None:
        self.put_pod()
        self.runtime.broken = "UNAVAILABLE"
        self.remove_cancelled(flows.remove_pod_sandbox, "s-1")
        self.assertEqual(self.store.sizes(), (1, 0))

    def test_the_end_of_a_cancelled_call_waits_for_what_it_asks_the_runtime(self) -> None:
        class SlowReader(RecordingRuntime):
            async def read_container(self, container_id: str, pods: adapters.PodSource, timeout: float | None) -> StoredContainer | None:
                await reading
                return StoredContainer.read_back("s-1", ContainerHookRequest(), ContainerState.STOPPED)

        reading: Deferred[None] = Deferred()
        self.runtime = SlowReader(answering=Deferred())
        self.put_container()
        self.subscribe(POST_STOP)
        answer = self.start(flows.stop_container, "c-1")
        call = self.calls[-1]
        call.cancel()
        call.ended()
        self.assertIs(self.successResultOf(answer), adapters.CALLER_GONE)  # the caller is not kept waiting
        self.assertEqual((self.stages.announced, self.call_lines()), ([], []))
        reading.callback(None)
        self.assertEqual([stage.hook for stage in self.stages.announced], [POST_STOP])
        [line] = self.call_lines()
        self.assertEqual(line["outcome"], "CANCELLED")

    def test_a_call_ended_as_its_answer_arrives_has_announced_what_it_owes(self) -> None:
        # Docker mode ends a call as it answers; a stop that waited for the call drains its post stages next.
        self.put_container()
        self.subscribe(POST_STOP)
        self.runtime.answering = Deferred()
        announced_when_answered: list[list[HookType]] = []

        def answered(outcome: object) -> None:
            self.calls[-1].ended()
            announced_when_answered.append([stage.hook for stage in self.stages.announced])

        self.start(flows.stop_container, "c-1").addCallback(answered)
        self.runtime.answering.callback(None)
        self.assertEqual(announced_when_answered, [[POST_STOP]])

    def test_each_question_gets_what_is_left_of_the_callers_deadline(self) -> None:
        self.runtime.containers["c-1"] = StoredContainer.read_back("s-1", ContainerHookRequest(), ContainerState.CREATED)
        self.runtime.pods["s-1"] = PodHookRequest()
        self.runtime.answering = Deferred()
        call = self.call(timeout=10.0)
        answer = call.run(flows.start_container(call, "c-1"))
        self.clock.advance(4)
        self.runtime.answering.callback(None)
        self.successResultOf(answer)
        self.assertEqual(self.runtime.timeouts, [10.0, 10.0, 10.0])
        self.runtime.answering = Deferred()
        self.runtime.timeouts.clear()
        call = self.call(timeout=10.0)
        self.clock.advance(3)
        call.run(flows.stop_container(call, "c-1"))
        self.assertEqual(self.runtime.timeouts, [7.0])


class ReadEverythingTests(FlowTestCase):
    def test_everything_with_each_container_given_its_pod(self) -> None:
        self.runtime.pods["s-1"] = PodHookRequest(cgroup_parent="/p")
        self.runtime.containers["c-1"] = StoredContainer.read_back("s-1", ContainerHookRequest(), ContainerState.CREATED)
        self.runtime.containers["c-2"] = StoredContainer.read_back("s-gone", ContainerHookRequest(), ContainerState.CREATED)
        found = self.successResultOf(ensureDeferred(resync.read_everything(self.runtime, None)))
        self.assertEqual([sandbox_id for sandbox_id, _ in found.pods], ["s-1"])
        given = [(cid, stored.given.pod_cgroup_parent) for cid, stored in found.containers]
        self.assertEqual(given, [("c-1", "/p"), ("c-2", "")])
        self.assertEqual((found.pod_ids, found.container_ids), ({"s-1"}, {"c-1", "c-2"}))

    def test_what_the_store_has_is_listed_but_not_read_again(self) -> None:
        self.runtime.pods["s-1"] = PodHookRequest(cgroup_parent="/p")
        self.runtime.containers["c-1"] = StoredContainer.read_back("s-1", ContainerHookRequest(), ContainerState.CREATED)
        self.runtime.containers["c-2"] = StoredContainer.read_back("s-1", ContainerHookRequest(), ContainerState.CREATED)
        self.put_pod("s-1")
        self.store.put_container("c-1", "s-1", ContainerHookRequest(), ContainerHookRequest())
        found = self.successResultOf(ensureDeferred(resync.read_everything(self.runtime, None, self.store)))
        self.assertEqual(self.runtime.read_back, ["c-2"])
        self.assertEqual((found.pod_ids, [cid for cid, _ in found.containers]), ({"s-1"}, ["c-2"]))

    def test_an_entry_that_cannot_be_read_is_left_out_with_a_warning(self) -> None:
        class HalfReadable(RecordingRuntime):
            async def read_pod(self, sandbox_id: str, timeout: float | None) -> StoredPod | None:
                if sandbox_id == "s-bad":
                    raise adapters.Unreadable("verbose info is not JSON")
                return await super().read_pod(sandbox_id, timeout)

        runtime = HalfReadable(pods={"s-bad": PodHookRequest(), "s-good": PodHookRequest()})
        found = self.successResultOf(ensureDeferred(resync.read_everything(runtime, None)))
        self.assertEqual([sandbox_id for sandbox_id, _ in found.pods], ["s-good"])
        self.assertEqual((found.pod_ids, found.unreadable), ({"s-bad", "s-good"}, {"s-bad"}))
        [warning] = [event for event in self.events if "left out" in event["log_format"]]
        self.assertEqual((warning["id"], warning["error"]), ("s-bad", "verbose info is not JSON"))

    def test_a_runtime_that_cannot_be_asked_fails_the_whole_reading(self) -> None:
        self.runtime.broken = "UNAVAILABLE"
        self.failureResultOf(ensureDeferred(resync.read_everything(self.runtime, None)), adapters.LookupFailed)


class PodRulesTests(FlowTestCase):
    def test_a_pod_resized_in_place_shows_its_new_resources_to_later_container_hooks(self) -> None:
        self.put_pod("s-1")
        self.put_container("c-1")
        self.subscribe(PRE_START)
        self.drive(flows.update_pod_sandbox_resources, CRIWire().resize("s-1", 200000))
        self.drive(flows.start_container, "c-1")
        self.assertEqual(container_request(self.stages.ran[0].request).pod_resources.cpu_quota, 200000)
        stored = self.store.pod("s-1")
        assert stored is not None
        self.assertEqual((stored.asked.resources.cpu_quota, stored.given.resources.cpu_quota), (200000, 200000))

    def test_a_resize_the_runtime_refuses_changes_nothing(self) -> None:
        self.put_pod("s-1")
        self.runtime.ok = False
        self.drive(flows.update_pod_sandbox_resources, CRIWire().resize("s-1", 200000))
        stored = self.store.pod("s-1")
        assert stored is not None
        self.assertFalse(stored.given.HasField("resources"))

    def koordlet_like_pod_answer(self, apply_pod_resources: bool) -> None:
        self.servers = HookServers(
            (HookServerConfig("k.json", "/run/k.sock", FailurePolicy.IGNORE, frozenset({PRE_RUN}), 2.0, apply_pod_resources=apply_pod_resources),)
        )
        answer = hook.PodSandboxHookResponse(resources=hook.LinuxContainerResources(cpu_quota=-1, cpu_shares=2))
        self.stages.answers[PRE_RUN] = answer
        self.drive(flows.run_pod_sandbox, CRIWire().sandbox({}))

    def test_a_pod_answers_resources_leave_the_sandbox_alone_unless_its_server_asks(self) -> None:
        self.koordlet_like_pod_answer(apply_pod_resources=False)
        sent = self.runtime.forwarded[0]
        self.assertIsNone(sent)  # kubelet's bytes, unchanged
        [call] = self.calls[-1].record.calls
        self.assertEqual([(change.path, change.applied) for change in call.changes], [
            ("resources.cpu_shares", False), ("resources.cpu_quota", False)
        ])
        self.koordlet_like_pod_answer(apply_pod_resources=True)
        sent = self.runtime.forwarded[1]
        assert sent is not None
        applied = cri.RunPodSandboxRequest.FromString(sent).config.linux.resources
        self.assertEqual((applied.cpu_quota, applied.cpu_shares), (-1, 2))

    def test_hooks_get_half_of_what_is_left_of_the_callers_deadline(self) -> None:
        self.put_container()
        self.subscribe(PRE_START)
        call = self.call(timeout=10.0)
        self.clock.advance(2)
        call.run(flows.start_container(call, "c-1"))
        self.assertEqual(self.stages.budgets, [4.0])
