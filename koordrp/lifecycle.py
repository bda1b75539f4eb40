"""Pure rules between CRI requests and hook messages.

Hook requests are built from CRI requests (and from what the store remembers), each hook response is
merged into the hook request so the next server in the chain sees it, and at the end only what the
hooks changed is written back into the CRI request: every other byte kubelet sent, unknown fields
included, reaches the runtime untouched.

Nothing here knows about threads, grpc or the reactor.
"""

from typing import Iterable, MutableMapping, TypeVar

from cri_api.v1 import api_pb2 as cri
from google.protobuf.message import Message

from koordrp.api.runtime.v1alpha1 import api_pb2 as hook

PodHookRequest = hook.PodSandboxHookRequest
ContainerHookRequest = hook.ContainerResourceHookRequest
HookRequest = PodHookRequest | ContainerHookRequest
HookResponse = hook.PodSandboxHookResponse | hook.ContainerResourceHookResponse

# Numbers a hook may set: a zero means "not mentioned", except for the CFS quota, where -1 means
# unlimited. oom_score_adj 0 is also taken as "not mentioned" (Koordinator would apply it): a
# plugin answering with only the fields it cares about must not reset the container's OOM score.
_POSITIVE_FIELDS = ("cpu_period", "cpu_shares", "memory_limit_in_bytes", "memory_swap_limit_in_bytes")
_NON_ZERO_FIELDS = ("cpu_quota", "oom_score_adj")
_NON_EMPTY_FIELDS = ("cpuset_cpus", "cpuset_mems")

Resources = TypeVar("Resources", hook.LinuxContainerResources, cri.LinuxContainerResources)


def as_hook_resources(resources: cri.LinuxContainerResources) -> hook.LinuxContainerResources:
    # The hook API's LinuxContainerResources is CRI's, field for field, so the wire form converts exactly.
    return hook.LinuxContainerResources.FromString(resources.SerializeToString())


def as_cri_resources(resources: hook.LinuxContainerResources) -> cri.LinuxContainerResources:
    return cri.LinuxContainerResources.FromString(resources.SerializeToString())


def as_pod_request(request: HookRequest) -> PodHookRequest:
    """A pod hook stage gives back the pod request it was given, changed: say so to the type checker."""
    assert isinstance(request, PodHookRequest)
    return request


def as_container_request(request: HookRequest) -> ContainerHookRequest:
    assert isinstance(request, ContainerHookRequest)
    return request


# ---------------------------------------------------------------------------------------------
# Building hook requests


def pod_hook_request(request: cri.RunPodSandboxRequest) -> PodHookRequest:
    config = request.config
    pod = PodHookRequest(
        pod_meta=hook.PodSandboxMetadata(
            name=config.metadata.name,
            uid=config.metadata.uid,
            namespace=config.metadata.namespace,
            attempt=config.metadata.attempt,
        ),
        runtime_handler=request.runtime_handler,
        labels=dict(config.labels),
        annotations=dict(config.annotations),
        cgroup_parent=config.linux.cgroup_parent,
    )
    if config.linux.HasField("overhead"):
        pod.overhead.CopyFrom(as_hook_resources(config.linux.overhead))
    if config.linux.HasField("resources"):
        pod.resources.CopyFrom(as_hook_resources(config.linux.resources))
    return pod


def container_hook_request(pod: PodHookRequest, request: cri.CreateContainerRequest) -> ContainerHookRequest:
    """The PreCreateContainer request: the container from the CRI request, its pod from ``pod``.

    ``pod`` is what koordrp stored when the sandbox ran, so it carries the hooks' changes (its
    cgroup parent above all), which kubelet's copy in ``request.sandbox_config`` does not.
    """
    config = request.config
    container = ContainerHookRequest(
        container_meta=hook.ContainerMetadata(name=config.metadata.name, attempt=config.metadata.attempt),
        container_annotations=dict(config.annotations),
        container_envs={env.key: env.value for env in config.envs},
    )
    if config.linux.HasField("resources"):
        container.container_resources.CopyFrom(as_hook_resources(config.linux.resources))
    with_pod(container, pod)
    return container


def with_pod(container: ContainerHookRequest, pod: PodHookRequest) -> ContainerHookRequest:
    """Fill the pod fields of a container hook request from the pod's stored information."""
    container.pod_meta.CopyFrom(pod.pod_meta)
    container.pod_labels.clear()
    container.pod_labels.update(pod.labels)
    container.pod_annotations.clear()
    container.pod_annotations.update(pod.annotations)
    container.pod_cgroup_parent = pod.cgroup_parent
    if pod.HasField("resources"):
        container.pod_resources.CopyFrom(pod.resources)
    else:
        container.ClearField("pod_resources")
    return container


def fold_update_request(stored: ContainerHookRequest, request: cri.UpdateContainerResourcesRequest) -> ContainerHookRequest:
    """The PreUpdateContainerResources request: what is stored, with kubelet's new values on top."""
    folded = ContainerHookRequest()
    folded.CopyFrom(stored)
    folded.container_meta.id = request.container_id
    if request.HasField("linux"):
        merge_resources(folded.container_resources, as_hook_resources(request.linux))
    folded.container_annotations.update(request.annotations)
    return folded


# ---------------------------------------------------------------------------------------------
# Merging hook responses into hook requests (the chain)


def merge_resources(target: Resources, response: Resources) -> None:
    """Merge the fields ``response`` sets into ``target``; fields it leaves unset stay as they were."""
    for name in _POSITIVE_FIELDS:
        value = getattr(response, name)
        if value > 0:
            setattr(target, name, value)
    for name in _NON_ZERO_FIELDS:
        value = getattr(response, name)
        if value != 0:
            setattr(target, name, value)
    for name in _NON_EMPTY_FIELDS:
        value = getattr(response, name)
        if value:
            setattr(target, name, value)
    target.unified.update(response.unified)
    if response.hugepage_limits:
        del target.hugepage_limits[:]
        target.hugepage_limits.extend(response.hugepage_limits)


def merge_pod_response(request: PodHookRequest, response: hook.PodSandboxHookResponse) -> None:
    request.labels.update(response.labels)
    request.annotations.update(response.annotations)
    if response.cgroup_parent:
        request.cgroup_parent = response.cgroup_parent
    if response.HasField("resources"):
        merge_resources(request.resources, response.resources)


def merge_container_response(request: ContainerHookRequest, response: hook.ContainerResourceHookResponse) -> None:
    request.container_annotations.update(response.container_annotations)
    if response.HasField("container_resources"):
        merge_resources(request.container_resources, response.container_resources)
    if response.pod_cgroup_parent:
        request.pod_cgroup_parent = response.pod_cgroup_parent
    request.container_envs.update(response.container_envs)


def merge_response(request: HookRequest, response: HookResponse) -> None:
    if isinstance(request, PodHookRequest):
        assert isinstance(response, hook.PodSandboxHookResponse)
        merge_pod_response(request, response)
    else:
        assert isinstance(response, hook.ContainerResourceHookResponse)
        merge_container_response(request, response)


def changed_fields(before: Message, after: Message, prefix: str = "") -> set[str]:
    """Dotted paths of the fields (map entries by key) whose value differs between two messages."""
    changed: set[str] = set()
    for field in after.DESCRIPTOR.fields:
        path = prefix + field.name
        old, new = getattr(before, field.name), getattr(after, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            changed.update(f"{path}[{key}]" for key in set(old) | set(new) if old.get(key) != new.get(key))
        elif field.message_type is not None and not field.is_repeated:
            changed.update(changed_fields(old, new, path + "."))
        elif old != new:
            changed.add(path)
    return changed


# ---------------------------------------------------------------------------------------------
# Writing what the hooks changed back into CRI requests


def _apply_map(target: MutableMapping[str, str], before: MutableMapping[str, str], after: MutableMapping[str, str]) -> bool:
    changed = False
    for key, value in after.items():
        if before.get(key) != value:
            target[key] = value
            changed = True
    return changed


def _apply_resources(
    target: cri.LinuxContainerResources, before: hook.LinuxContainerResources, after: hook.LinuxContainerResources
) -> bool:
    if before == after:
        return False
    for field in hook.LinuxContainerResources.DESCRIPTOR.fields:
        name = field.name
        if getattr(before, name) == getattr(after, name):
            continue
        if name == "unified":
            _apply_map(target.unified, before.unified, after.unified)
        elif name == "hugepage_limits":
            del target.hugepage_limits[:]
            target.hugepage_limits.extend(as_cri_resources(after).hugepage_limits)
        else:
            setattr(target, name, getattr(after, name))
    return True


def apply_envs(
    envs: Iterable[cri.KeyValue], before: MutableMapping[str, str], after: MutableMapping[str, str]
) -> list[cri.KeyValue]:
    """kubelet's env list with the hooks' changes: order kept, values replaced in place, new keys appended sorted.

    A map cannot say where a key stood or that it stood twice, so only the keys the hooks changed
    are touched, every occurrence of them, and everything else stays exactly as kubelet sent it.
    """
    changed = {key: value for key, value in after.items() if before.get(key) != value}
    result = [cri.KeyValue(key=env.key, value=changed.get(env.key, env.value)) for env in envs]
    present = {env.key for env in result}
    result.extend(cri.KeyValue(key=key, value=changed[key]) for key in sorted(changed) if key not in present)
    return result


# Each apply_to_* writes into a CRI request what the hooks changed between ``before`` and ``after``
# (the stage's hook request as it went in and as it came out), and says whether it changed anything:
# an unchanged request is forwarded as the very bytes kubelet sent.


def apply_to_run_pod_sandbox(request: cri.RunPodSandboxRequest, before: PodHookRequest, after: PodHookRequest) -> bool:
    config = request.config
    changed = _apply_map(config.labels, before.labels, after.labels)
    changed |= _apply_map(config.annotations, before.annotations, after.annotations)
    if after.cgroup_parent != before.cgroup_parent:
        config.linux.cgroup_parent = after.cgroup_parent
        changed = True
    return _apply_resources(config.linux.resources, before.resources, after.resources) or changed


def apply_to_create_container(
    request: cri.CreateContainerRequest, before: ContainerHookRequest, after: ContainerHookRequest
) -> bool:
    config = request.config
    changed = _apply_map(config.annotations, before.container_annotations, after.container_annotations)
    changed |= _apply_resources(config.linux.resources, before.container_resources, after.container_resources)
    if after.container_envs != before.container_envs:
        envs = apply_envs(config.envs, before.container_envs, after.container_envs)
        del config.envs[:]
        config.envs.extend(envs)
        changed = True
    # containerd derives the container's cgroup from the sandbox config in this request, which is
    # kubelet's original: the pod's actual parent (as hooks set it) must win even when no
    # container hook touched it.
    if after.pod_cgroup_parent and after.pod_cgroup_parent != request.sandbox_config.linux.cgroup_parent:
        request.sandbox_config.linux.cgroup_parent = after.pod_cgroup_parent
        changed = True
    return changed


def apply_to_update_container_resources(
    request: cri.UpdateContainerResourcesRequest, before: ContainerHookRequest, after: ContainerHookRequest
) -> bool:
    changed = _apply_map(request.annotations, before.container_annotations, after.container_annotations)
    return _apply_resources(request.linux, before.container_resources, after.container_resources) or changed


# ---------------------------------------------------------------------------------------------
# What to remember after the runtime said yes


def created_container_info(
    request: cri.CreateContainerRequest, final: ContainerHookRequest, container_id: str
) -> ContainerHookRequest:
    """The container as the runtime now has it: the final hook request, with its id and its real envs."""
    stored = ContainerHookRequest()
    stored.CopyFrom(final)
    stored.container_meta.id = container_id
    stored.container_envs.clear()
    stored.container_envs.update({env.key: env.value for env in request.config.envs})
    return stored
