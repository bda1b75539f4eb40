"""NRI messages ⇄ hook requests: what the flows need from containerd's NRI events, and the answers built
from what the hooks changed. Nothing here does I/O.

NRI tells a plugin about a pod or container as containerd has it, and lets it answer with what to
change, no more: a ``ContainerAdjustment`` for a container being created, a ``ContainerUpdate`` for
one being updated, nothing for a sandbox. What a hook's answer changes that NRI cannot express is
named, field by field, with why (``adapters.LeftAlone``): the call's log line and metrics show it.
"""

from typing import Mapping, Sequence

from koordrp.api.nri.v1alpha1 import api_pb2 as nri
from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from koordrp.adapters import LeftAlone, Written
from koordrp.hooks.messages import (
    ContainerHookRequest,
    PodHookRequest,
    Resources,
    merged_envs,
    oci_env_map,
    oci_env_variable,
)
from koordrp.nri.wire import MAX_TTRPC_MESSAGE
from koordrp.store import ContainerState, runtime_state

# kubelet's annotation with a container's restart count (CRI's ContainerMetadata.attempt): NRI has no field for it.
RESTART_COUNT_ANNOTATION = "io.kubernetes.container.restartCount"

NO_SANDBOX_CHANGES = "NRI cannot change a pod's sandbox; later hooks see it as answered"
NO_CLEARING = "NRI can set a cpuset but not clear it"
NO_OOM_SCORE = "NRI cannot set a container's OOM score"
NO_SWAP = "containerd 1.7's NRI sets no swap limit (a new memory limit sets swap to the same value)"
NOT_IN_AN_UPDATE = "an NRI update has no annotations"
NOT_UNDER_ITS_POD = "the container's cgroups path is not under its pod's cgroup parent"
NOT_CARRIED = (
    f"containerd's messages about the container so changed would pass the {MAX_TTRPC_MESSAGE >> 20} MiB ttrpc carries: "
    "it could neither start it nor tell plugins of it"
)
TTRPC_ENVELOPE = 1024
"""Bytes of ttrpc's Request around an NRI message (service, method, timeout, metadata), kept for it."""
LATE = "late"
"""Why a late answer's change to what is fixed once a container is created was left alone."""
FIXED_AT_CREATE = ("container_envs", "container_annotations", "pod_cgroup_parent")


# ---------------------------------------------------------------------------------------------
# NRI → hook requests


def hook_resources(resources: nri.LinuxResources) -> Resources:
    """NRI's resources as the hook API has them (what NRI leaves unset is 0 or empty, as in CRI)."""
    cpu, memory = resources.cpu, resources.memory
    converted = Resources(
        cpu_period=cpu.period.value,
        cpu_quota=cpu.quota.value,
        cpu_shares=cpu.shares.value,
        memory_limit_in_bytes=memory.limit.value,
        memory_swap_limit_in_bytes=memory.swap.value,
        cpuset_cpus=cpu.cpus,
        cpuset_mems=cpu.mems,
        unified=dict(resources.unified),
    )
    converted.hugepage_limits.extend(
        hook.HugepageLimit(page_size=limit.page_size, limit=limit.limit) for limit in resources.hugepage_limits
    )
    return converted


def pod_hook_request(pod: nri.PodSandbox) -> PodHookRequest:
    request = PodHookRequest(
        pod_meta=hook.PodSandboxMetadata(name=pod.name, uid=pod.uid, namespace=pod.namespace),
        runtime_handler=pod.runtime_handler,
        labels=dict(pod.labels),
        annotations=dict(pod.annotations),
        cgroup_parent=pod.linux.cgroup_parent,
    )
    if pod.linux.HasField("pod_overhead"):
        request.overhead.CopyFrom(hook_resources(pod.linux.pod_overhead))
    if pod.linux.HasField("pod_resources"):
        request.resources.CopyFrom(hook_resources(pod.linux.pod_resources))
    return request


def synchronization(parts: Sequence[nri.SynchronizeRequest]) -> nri.SynchronizeRequest:
    """Every pod and container containerd told of at Synchronize, as one request.

    containerd ≥ 2.0 (NRI 0.8) splits a synchronization that does not fit one ttrpc message (4 MiB)
    into parts, each but the last marked ``more``; before, it is one part.
    """
    if len(parts) == 1:
        return parts[0]
    whole = nri.SynchronizeRequest()
    for part in parts:
        whole.pods.extend(part.pods)
        whole.containers.extend(part.containers)
    return whole


def _attempt(annotations: Mapping[str, str]) -> int:
    count = annotations.get(RESTART_COUNT_ANNOTATION, "")
    return int(count) if count.isdigit() and int(count) < 1 << 32 else 0


def container_hook_request(container: nri.Container, pod_cgroup_parent: str) -> ContainerHookRequest:
    """The container as NRI tells of it, placed under ``pod_cgroup_parent`` (its pod's, as NRI has it)."""
    request = ContainerHookRequest(
        container_meta=hook.ContainerMetadata(
            name=container.name, attempt=_attempt(container.annotations), id=container.id
        ),
        container_annotations=dict(container.annotations),
        container_envs=oci_env_map(container.env),
        pod_cgroup_parent=pod_cgroup_parent,
    )
    linux = container.linux
    if linux.HasField("resources"):
        request.container_resources.CopyFrom(hook_resources(linux.resources))
    if linux.HasField("oom_score_adj"):
        request.container_resources.oom_score_adj = linux.oom_score_adj.value
    return request


def container_state(state: int) -> ContainerState:
    """The state the store keeps for a container in NRI's ``state``."""
    return runtime_state(nri.ContainerState.Name(state)) if state in nri.ContainerState.values() else ContainerState.RUNNING


# ---------------------------------------------------------------------------------------------
# What the hooks changed → NRI's answers


def _changed_resources(before: Resources, after: Resources, prefix: str) -> tuple[nri.LinuxResources, list[LeftAlone]]:
    """NRI resources naming only what differs between ``before`` and ``after``; what NRI cannot set, left alone."""
    changed = nri.LinuxResources()
    left: list[LeftAlone] = []
    if before == after:  # as when no hook answered: one comparison in protobuf's C, not one per field here
        return changed, left

    def differs(name: str) -> bool:
        return bool(getattr(before, name) != getattr(after, name))

    if differs("cpu_period"):
        changed.cpu.period.value = after.cpu_period
    if differs("cpu_quota"):
        changed.cpu.quota.value = after.cpu_quota
    if differs("cpu_shares"):
        changed.cpu.shares.value = after.cpu_shares
    if differs("memory_limit_in_bytes"):
        changed.memory.limit.value = after.memory_limit_in_bytes
    if differs("memory_swap_limit_in_bytes"):
        left.append(LeftAlone(prefix + "memory_swap_limit_in_bytes", NO_SWAP))
    for name, target in (("cpuset_cpus", "cpus"), ("cpuset_mems", "mems")):
        if differs(name):
            value = getattr(after, name)
            if value:
                setattr(changed.cpu, target, value)
            else:
                left.append(LeftAlone(prefix + name, NO_CLEARING))
    if differs("hugepage_limits"):
        changed.hugepage_limits.extend(
            nri.HugepageLimit(page_size=limit.page_size, limit=limit.limit) for limit in after.hugepage_limits
        )
    for key, value in after.unified.items():
        if before.unified.get(key) != value:
            changed.unified[key] = value
    if differs("oom_score_adj"):
        left.append(LeftAlone(prefix + "oom_score_adj", NO_OOM_SCORE))
    return changed, left


def moved_cgroups_path(path: str, parent: str, new_parent: str) -> str | None:
    """The container's cgroups ``path`` under ``new_parent`` instead of ``parent``; None: it is not under ``parent``.

    containerd names it ``<parent>/<id>`` with cgroupfs, ``<parent slice>:cri-containerd:<id>`` with systemd.
    """
    for separator in ("/", ":"):
        if parent and path.startswith(parent + separator):
            return new_parent + path[len(parent) :]
    return None


def _env_list(env: list[str], before: Mapping[str, str], after: Mapping[str, str]) -> list[str]:
    return merged_envs(env, oci_env_variable, lambda key, value: f"{key}={value}", before, after)


class RunPodSandbox:
    """NRI's RunPodSandbox event (adapters.RunPodSandbox): the sandbox is made already; nothing is written back."""

    def __init__(self, pod: nri.PodSandbox) -> None:
        self.pod = pod

    def hook_request(self) -> PodHookRequest:
        return pod_hook_request(self.pod)

    def rewritten(self, before: PodHookRequest, after: PodHookRequest) -> Written:
        return Written(None, (LeftAlone("", NO_SANDBOX_CHANGES),))


class CaughtUpPod(RunPodSandbox):
    """A pod that ran while koordrp was away, caught up at Synchronize (adapters.RunPodSandbox): nothing of a
    running sandbox can change."""

    def rewritten(self, before: PodHookRequest, after: PodHookRequest) -> Written:
        return Written(None, (LeftAlone("", LATE),))


class CreateContainer:
    """NRI's CreateContainer request (adapters.CreateContainer), answered with a ContainerAdjustment."""

    def __init__(self, pod: nri.PodSandbox, container: nri.Container) -> None:
        self.pod = pod
        self.container = container
        self.sandbox_id = container.pod_sandbox_id
        self._env = list(container.env)

    def hook_request(self) -> ContainerHookRequest:
        return container_hook_request(self.container, self.pod.linux.cgroup_parent)

    def rewritten(self, before: ContainerHookRequest, after: ContainerHookRequest) -> Written:
        adjust = nri.ContainerAdjustment()
        for key, value in after.container_annotations.items():
            if before.container_annotations.get(key) != value:
                adjust.annotations[key] = value
        if after.container_envs != before.container_envs:
            adjust.env.extend(
                nri.KeyValue(key=key, value=value)
                for key, value in sorted(after.container_envs.items())
                if before.container_envs.get(key) != value
            )
            self._env = _env_list(self._env, before.container_envs, after.container_envs)
        resources, left = _changed_resources(before.container_resources, after.container_resources, "container_resources.")
        if resources.ByteSize():
            adjust.linux.resources.CopyFrom(resources)
        if after.pod_cgroup_parent != before.pod_cgroup_parent:
            moved = moved_cgroups_path(
                self.container.linux.cgroups_path, before.pod_cgroup_parent, after.pod_cgroup_parent
            )
            if moved is None:
                left.append(LeftAlone("pod_cgroup_parent", NOT_UNDER_ITS_POD))
            else:
                adjust.linux.cgroups_path = moved
        if (adjust.annotations or adjust.env) and not self._carried(adjust):
            # What grows the container is left out: the rest of the answer (its resources, its place) still applies.
            adjust.ClearField("annotations")
            adjust.ClearField("env")
            self._env = list(self.container.env)
            left += [LeftAlone("container_annotations", NOT_CARRIED), LeftAlone("container_envs", NOT_CARRIED)]
        changed = adjust.ByteSize() > 0
        return Written(nri.CreateContainerResponse(adjust=adjust).SerializeToString() if changed else None, tuple(left))

    def _carried(self, adjust: nri.ContainerAdjustment) -> bool:
        """Whether every message containerd sends about the container as ``adjust`` makes it stays within ttrpc's
        limit. containerd takes an adjustment just under it, then cannot start the container (its next event
        about it is too large) nor synchronize a plugin while the container exists."""
        grows = adjust.ByteSize()
        if self.pod.ByteSize() + 2 * (self.container.ByteSize() + grows) + TTRPC_ENVELOPE <= MAX_TTRPC_MESSAGE:
            return True  # as it always is: not worth weighing the container as adjusted
        grown = nri.Container()
        grown.CopyFrom(self.container)
        grown.annotations.update(adjust.annotations)
        del grown.env[:]
        grown.env.extend(self._env)
        grown.linux.resources.MergeFrom(adjust.linux.resources)
        return told_size(self.pod, grown) <= MAX_TTRPC_MESSAGE

    def envs_sent(self) -> dict[str, str]:
        return oci_env_map(self._env)


def told_size(pod: nri.PodSandbox, container: nri.Container) -> int:
    """Bytes of the largest message containerd sends a plugin about ``container``, in ttrpc's envelope: an
    UpdateContainerRequest, which carries the pod, the container and its resources once more (an event carries
    the pod and the container; a synchronization's part at least as much)."""
    request = nri.UpdateContainerRequest(pod=pod, container=container, linux_resources=container.linux.resources)
    return request.ByteSize() + TTRPC_ENVELOPE


def _container_update(
    container_id: str, before: ContainerHookRequest, after: ContainerHookRequest
) -> tuple[nri.ContainerUpdate | None, list[LeftAlone]]:
    """The ContainerUpdate of what the hooks changed in the container's resources (None: nothing NRI can set)."""
    resources, left = _changed_resources(before.container_resources, after.container_resources, "container_resources.")
    if not resources.ByteSize():
        return None, left
    update = nri.ContainerUpdate(container_id=container_id)
    update.linux.resources.CopyFrom(resources)
    return update, left


class UpdateContainer:
    """NRI's UpdateContainer request (adapters.UpdateContainerResources), answered with a ContainerUpdate of it."""

    def __init__(self, container: nri.Container, resources: nri.LinuxResources | None) -> None:
        self.container_id = container.id
        self._resources = resources

    def resources(self) -> Resources | None:
        return None if self._resources is None else hook_resources(self._resources)

    def annotations(self) -> Mapping[str, str]:
        return {}  # NRI's update carries none

    def rewritten(self, before: ContainerHookRequest, after: ContainerHookRequest) -> Written:
        update, left = _container_update(self.container_id, before, after)
        left.append(LeftAlone("container_annotations", NOT_IN_AN_UPDATE))
        if update is None:
            return Written(None, tuple(left))
        return Written(nri.UpdateContainerResponse(update=[update]).SerializeToString(), tuple(left))


def late_update(container_id: str, before: ContainerHookRequest, after: ContainerHookRequest) -> Written:
    """A created container's UpdateContainersRequest (a plugin's own call) with the resources a pre-create answer
    that came late changed; what a created container cannot change, left alone as ``LATE``."""
    update, left = _container_update(container_id, before, after)
    left.extend(LeftAlone(path, LATE) for path in FIXED_AT_CREATE)
    if update is None:
        return Written(None, tuple(left))
    return Written(nri.UpdateContainersRequest(update=[update]).SerializeToString(), tuple(left))


class CaughtUpContainer(CreateContainer):
    """A container created while koordrp was away, caught up at Synchronize (adapters.CreateContainer): what its
    pre hooks changed goes to containerd as an update of the created container (``late_update``: an
    UpdateContainersRequest), what cannot change once it is created left alone as ``LATE``."""

    def rewritten(self, before: ContainerHookRequest, after: ContainerHookRequest) -> Written:
        return late_update(self.container.id, before, after)
