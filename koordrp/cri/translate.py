"""CRI v1 requests ⇄ hook requests: what the flows need from kubelet's requests, and what they write back.

Hook requests are built from CRI requests (and from what the store remembers); once a stage has run,
only what its hooks changed is written back into the CRI request: every other byte kubelet sent,
unknown fields included, reaches the runtime untouched, and a request no hook changed is forwarded
as the very bytes kubelet sent. Nothing here does I/O.
"""

from typing import Iterable, Mapping, MutableMapping

from google.protobuf.message import Message

from koordrp.api.cri.v1 import api_pb2 as cri
from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from koordrp.adapters import Written
from koordrp.hooks.messages import ContainerHookRequest, PodHookRequest, merged_envs, with_image_name


def as_hook_resources(resources: cri.LinuxContainerResources) -> hook.LinuxContainerResources:
    # The hook API's LinuxContainerResources is CRI's, field for field, so the wire form converts exactly.
    return hook.LinuxContainerResources.FromString(resources.SerializeToString())


def as_cri_resources(resources: hook.LinuxContainerResources) -> cri.LinuxContainerResources:
    return cri.LinuxContainerResources.FromString(resources.SerializeToString())


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


def _env_variable(env: cri.KeyValue) -> tuple[str, str] | None:
    """The variable as hooks see it; None for a value that is not UTF-8, which their string map cannot hold."""
    try:
        return env.key, env.value.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _env_entry(key: str, value: str) -> cri.KeyValue:
    return cri.KeyValue(key=key, value=value.encode("utf-8"))


def envs_of(config: cri.ContainerConfig) -> dict[str, str]:
    """The container's environment as hooks see it: a map (the last value of a repeated key wins, as in
    the container), without the values that are not UTF-8."""
    variables = (_env_variable(env) for env in config.envs)
    return dict(variable for variable in variables if variable is not None)


def image_name(image: cri.ImageSpec) -> str:
    """The container's image as hooks are shown it (``io.kubernetes.cri.image-name``): the image as the pod spec
    names it, which kubelet sends as ``user_specified_image``, else the reference the request names.

    It is the name containerd 2 gives the container itself, where NRI mode's hooks read it (containerd
    1.6 and 1.7 give the name they resolved the reference to instead). kubelet's ``image`` is the
    image's id (``sha256:…``), which names nothing a rule could match; the name is read from the
    request, without asking the runtime, which would cost every create a call.
    """
    return image.user_specified_image or image.image


def container_hook_request(request: cri.CreateContainerRequest) -> ContainerHookRequest:
    """The container of a CreateContainer request, placed under the pod's cgroup parent its sandbox config names."""
    config = request.config
    container = ContainerHookRequest(
        container_meta=hook.ContainerMetadata(name=config.metadata.name, attempt=config.metadata.attempt),
        container_annotations=with_image_name(config.annotations, image_name(config.image)),
        container_envs=envs_of(config),
        pod_cgroup_parent=request.sandbox_config.linux.cgroup_parent,
    )
    if config.linux.HasField("resources"):
        container.container_resources.CopyFrom(as_hook_resources(config.linux.resources))
    return container


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
    """kubelet's env list with the hooks' changes (``merged_envs``: order kept, new keys appended sorted;
    a value that is not UTF-8 stays untouched in its place)."""
    return merged_envs(list(envs), _env_variable, _env_entry, before, after)


# Each apply_to_* writes into a CRI request every field where ``after`` (the stage's hook request as
# it came out) differs from ``before`` (as the CRI request has it), and says whether it changed anything.


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
    # containerd places the container's cgroup under the parent this sandbox config names.
    if after.pod_cgroup_parent != before.pod_cgroup_parent:
        request.sandbox_config.linux.cgroup_parent = after.pod_cgroup_parent
        changed = True
    return changed


def apply_to_update_container_resources(
    request: cri.UpdateContainerResourcesRequest, before: ContainerHookRequest, after: ContainerHookRequest
) -> bool:
    changed = _apply_map(request.annotations, before.container_annotations, after.container_annotations)
    return _apply_resources(request.linux, before.container_resources, after.container_resources) or changed


# ---------------------------------------------------------------------------------------------
# The requests as the flows see them (koordrp.flows): built from kubelet's, written back in place


def _written(request: Message, changed: bool) -> Written:
    return Written(request.SerializeToString() if changed else None)


class RunPodSandbox:
    def __init__(self, request: cri.RunPodSandboxRequest) -> None:
        self.request = request

    def hook_request(self) -> PodHookRequest:
        return pod_hook_request(self.request)

    def rewritten(self, before: PodHookRequest, after: PodHookRequest) -> Written:
        return _written(self.request, apply_to_run_pod_sandbox(self.request, before, after))


class CreateContainer:
    def __init__(self, request: cri.CreateContainerRequest) -> None:
        self.request = request
        self.sandbox_id = request.pod_sandbox_id

    def hook_request(self) -> ContainerHookRequest:
        return container_hook_request(self.request)

    def rewritten(self, before: ContainerHookRequest, after: ContainerHookRequest) -> Written:
        return _written(self.request, apply_to_create_container(self.request, before, after))

    def envs_sent(self) -> dict[str, str]:
        return envs_of(self.request.config)


class UpdateContainerResources:
    def __init__(self, request: cri.UpdateContainerResourcesRequest) -> None:
        self.request = request
        self.container_id = request.container_id

    def resources(self) -> hook.LinuxContainerResources | None:
        return as_hook_resources(self.request.linux) if self.request.HasField("linux") else None

    def annotations(self) -> Mapping[str, str]:
        return self.request.annotations

    def rewritten(self, before: ContainerHookRequest, after: ContainerHookRequest) -> Written:
        changed = apply_to_update_container_resources(self.request, before, after)
        return _written(self.request, changed)


class UpdatePodSandboxResources:
    def __init__(self, request: cri.UpdatePodSandboxResourcesRequest) -> None:
        self.request = request
        self.sandbox_id = request.pod_sandbox_id

    def resources(self) -> hook.LinuxContainerResources | None:
        return as_hook_resources(self.request.resources) if self.request.HasField("resources") else None

    def overhead(self) -> hook.LinuxContainerResources | None:
        return as_hook_resources(self.request.overhead) if self.request.HasField("overhead") else None
