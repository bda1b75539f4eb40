"""Hook messages and the rules that merge hook answers, whichever front end a call came through.

A stage's hook request is changed in place by each server's answer, so the next server in the chain
sees it (``merge_response``), once ``koordrp.hooks.validation`` has checked the answer; what the chain
changed is later written back into the front end's own request (``koordrp.cri.translate``,
``koordrp.docker.translate``). Nothing here knows about threads, grpc, the reactor or a wire format
other than the hook API's.
"""

from dataclasses import dataclass, replace
from typing import Callable, Iterable, Mapping, MutableMapping, Sequence, TypeAlias, TypeVar

from google.protobuf.message import Message

from koordrp.api.runtime.v1alpha1 import api_pb2 as hook

PodHookRequest: TypeAlias = hook.PodSandboxHookRequest
ContainerHookRequest: TypeAlias = hook.ContainerResourceHookRequest
HookRequest: TypeAlias = PodHookRequest | ContainerHookRequest
HookResponse: TypeAlias = hook.PodSandboxHookResponse | hook.ContainerResourceHookResponse
Resources: TypeAlias = hook.LinuxContainerResources

# Numbers a hook may set: a zero means "not mentioned", except for the CFS quota, where -1 means
# unlimited. oom_score_adj 0 is also taken as "not mentioned" (Koordinator would apply it): a
# plugin answering with only the fields it cares about must not reset the container's OOM score.
POSITIVE_FIELDS = ("cpu_period", "cpu_shares", "memory_limit_in_bytes", "memory_swap_limit_in_bytes")
NON_ZERO_FIELDS = ("cpu_quota", "oom_score_adj")
CPUSET_FIELDS = ("cpuset_cpus", "cpuset_mems")
"""The resource fields an empty value in an answer clears (elsewhere an unset field keeps the request's)."""


AnyRequest = TypeVar("AnyRequest", bound=Message)


def subject_text(request: HookRequest) -> str:
    """The pod (and container) a hook request is about, as log lines name them."""
    meta = request.pod_meta
    text = f"pod {meta.namespace}/{meta.name}"
    if isinstance(request, ContainerHookRequest):
        text += f" container {request.container_meta.name}"
    return text


def copied(request: AnyRequest) -> AnyRequest:
    """A copy of a hook request that no change to the original reaches."""
    copy = type(request)()
    copy.CopyFrom(request)
    return copy


@dataclass(frozen=True)
class Change:
    """One thing a hook's answer changed in the request, as a call's log line tells it.

    ``path`` names the field (a map entry by its key, ``container_envs[KEY]``). ``before`` and
    ``after`` are kept only for values that are safe to log: resources and cgroup parents; never
    for environment variables, labels or annotations, which may hold secrets.
    """

    path: str
    before: object = None
    after: object = None
    added: bool = False
    """A map key the request did not have."""
    applied: bool = True
    """False: what the answer asked for, left alone (the log names it all the same, with ``why``)."""
    why: str = ""
    """Why a change was left alone."""
    refused: bool = False
    """What the answer asked for breaks a rule of ``koordrp.hooks.validation`` (``why`` says which): never applied,
    named ``refused`` in the call's line."""


Changes = list[Change]

NOT_APPLYING_POD_RESOURCES = "the registration does not set apply-pod-resources"

IMAGE_NAME_ANNOTATION = "io.kubernetes.cri.image-name"
"""containerd's annotation naming a container's image. In NRI mode hooks are shown containerd's own; the
proxy and Docker mode show the image their request names under the same key, so that a hook reads the
image one way in every mode. The runtime sets it, not the request: hooks cannot change it."""

RUNTIME_OWNS_IMAGE_NAME = "the runtime names the image itself: hooks are shown it and cannot change it"


CATCH_UP_ANNOTATION = "koordrp.io/catch-up"
"""Set ("true") in the annotations of a hook request about something that happened while koordrp was away: a
pre hook it missed, called late (NRI mode's catch-up), or a post stop it owes for a pod or container gone
meanwhile. Koordinator's protocol has no field for it; a live call never carries it."""


def marked_catch_up(request: HookRequest) -> HookRequest:
    """``request`` (changed in place) marked as a catch-up call's."""
    annotations = request.annotations if isinstance(request, PodHookRequest) else request.container_annotations
    annotations[CATCH_UP_ANNOTATION] = "true"
    return request


def unmarked_catch_up(request: HookRequest) -> None:
    """Take the catch-up mark (and a server's echo of it) out of ``request``: nothing else keeps it."""
    annotations = request.annotations if isinstance(request, PodHookRequest) else request.container_annotations
    annotations.pop(CATCH_UP_ANNOTATION, None)


def with_image_name(annotations: Mapping[str, str], image: str) -> dict[str, str]:
    """A container's annotations as hooks are shown them: with its image under IMAGE_NAME_ANNOTATION, if it names one."""
    shown = dict(annotations)
    if image:
        shown[IMAGE_NAME_ANNOTATION] = image
    return shown


def _set(target: Message, name: str, value: object, prefix: str, changes: Changes) -> None:
    before = getattr(target, name)
    if before != value:
        setattr(target, name, value)
        changes.append(Change(prefix + name, before, value))


def _merge_map(
    target: MutableMapping[str, str], answer: Mapping[str, str], path: str, changes: Changes, shown: bool = False
) -> None:
    for key, value in answer.items():
        before = target.get(key)
        if before != value:
            target[key] = value
            if shown:
                changes.append(Change(f"{path}[{key}]", before, value, added=before is None))
            else:
                changes.append(Change(f"{path}[{key}]", added=before is None))


def _merge_numbers_and_maps(target: Resources, source: Resources, prefix: str, changes: Changes) -> None:
    for name in POSITIVE_FIELDS:
        value = getattr(source, name)
        if value > 0:
            _set(target, name, value, prefix, changes)
    for name in NON_ZERO_FIELDS:
        value = getattr(source, name)
        if value != 0:
            _set(target, name, value, prefix, changes)
    _merge_map(target.unified, source.unified, prefix + "unified", changes, shown=True)
    if source.hugepage_limits and list(source.hugepage_limits) != list(target.hugepage_limits):
        before = [f"{limit.page_size}:{limit.limit}" for limit in target.hugepage_limits]
        del target.hugepage_limits[:]
        target.hugepage_limits.extend(source.hugepage_limits)
        after = [f"{limit.page_size}:{limit.limit}" for limit in target.hugepage_limits]
        changes.append(Change(prefix + "hugepage_limits", before, after))


def merge_resources(target: Resources, answer: Resources, prefix: str = "") -> Changes:
    """Merge a hook's resources into ``target``, as Koordinator's proxy does; say what changed.

    Plugins answer a copy of the request with their changes, so the cpuset they send is the one
    they want, the empty string included (koordlet clears kubelet's cpuset that way for best-effort
    pods). Numbers keep their "unset" values: a zero (or, where only positive makes sense, a
    negative) number leaves ``target``'s as it was.
    """
    changes: Changes = []
    _merge_numbers_and_maps(target, answer, prefix, changes)
    for name in CPUSET_FIELDS:
        _set(target, name, getattr(answer, name), prefix, changes)
    return changes


def _fold_resources(target: Resources, update: Resources) -> None:
    """Fold kubelet's new resources into the stored ones: what it leaves unset, the empty cpuset included, stays."""
    _merge_numbers_and_maps(target, update, "", [])
    for name in CPUSET_FIELDS:
        value = getattr(update, name)
        if value:
            setattr(target, name, value)


def folded_update(
    stored: ContainerHookRequest, container_id: str, resources: Resources | None, annotations: Mapping[str, str]
) -> ContainerHookRequest:
    """The PreUpdateContainerResources request: the stored container with an update folded in.

    An update names only what it changes (a zero or an empty string means "keep"), whichever front
    end it came through; its annotations are added to the container's.
    """
    folded = copied(stored)
    folded.container_meta.id = container_id
    if resources is not None:
        _fold_resources(folded.container_resources, resources)
    folded.container_annotations.update(annotations)
    return folded


def merge_pod_response(
    request: PodHookRequest, response: hook.PodSandboxHookResponse, apply_resources: bool = False
) -> Changes:
    """Merge a pod hook's answer; its ``resources`` only when the server asks for it (``apply_resources``).

    koordlet answers with a copy of the request whose pod-level resources it sets for its own
    bookkeeping (a CPU quota of -1 for cpuset pods); Koordinator's proxy never applies them, and the
    sandbox must not be sized by them unless a server means it. What is left alone is still named.
    """
    changes: Changes = []
    _merge_map(request.labels, response.labels, "labels", changes)
    _merge_map(request.annotations, response.annotations, "annotations", changes)
    if response.cgroup_parent:
        _set(request, "cgroup_parent", response.cgroup_parent, "", changes)
    if response.HasField("resources"):
        if apply_resources:
            changes += merge_resources(request.resources, response.resources, "resources.")
        else:
            changes += left_alone(
                merge_resources(copied(request.resources), response.resources, "resources."), "", NOT_APPLYING_POD_RESOURCES
            )
    return changes


def merge_container_response(request: ContainerHookRequest, response: hook.ContainerResourceHookResponse) -> Changes:
    changes: Changes = []
    answered: Mapping[str, str] = response.container_annotations
    shown = request.container_annotations.get(IMAGE_NAME_ANNOTATION)
    image = answered.get(IMAGE_NAME_ANNOTATION)
    other_image = image is not None and image != shown  # an echo (reply()) changes nothing, and costs no copy
    if other_image:
        answered = {key: value for key, value in answered.items() if key != IMAGE_NAME_ANNOTATION}
    _merge_map(request.container_annotations, answered, "container_annotations", changes)
    if other_image:  # named in the call's line, not taken
        path = f"container_annotations[{IMAGE_NAME_ANNOTATION}]"
        changes.append(Change(path, added=shown is None, applied=False, why=RUNTIME_OWNS_IMAGE_NAME))
    if response.HasField("container_resources"):
        changes += merge_resources(request.container_resources, response.container_resources, "container_resources.")
    if response.pod_cgroup_parent:
        _set(request, "pod_cgroup_parent", response.pod_cgroup_parent, "", changes)
    _merge_map(request.container_envs, response.container_envs, "container_envs", changes)
    return changes


def left_alone(changes: Sequence[Change], path_prefix: str, why: str) -> tuple[Change, ...]:
    """``changes`` with those whose path starts with ``path_prefix`` marked as left alone for ``why`` (a
    change left alone already keeps its reason)."""
    return tuple(
        replace(change, applied=False, why=why) if change.applied and change.path.startswith(path_prefix) else change
        for change in changes
    )


def copy_changed(target: AnyRequest, source: AnyRequest, changes: Iterable[Change]) -> AnyRequest:
    """``target`` (changed in place) with the fields ``changes`` applied set as ``source`` has them; the fields
    changes left alone, and every other, stay ``target``'s."""
    for change in changes:
        if not change.applied:
            continue
        path, _, key = change.path.partition("[")
        *outer, name = path.split(".")
        into: Message = target
        out_of: Message = source
        for part in outer:
            into, out_of = getattr(into, part), getattr(out_of, part)
        value = getattr(out_of, name)
        if key:  # a map entry, by its key
            getattr(into, name)[key[:-1]] = value[key[:-1]]
        elif isinstance(value, (bool, int, float, str)):
            setattr(into, name, value)
        else:  # a repeated field, as a whole (hugepage limits)
            del getattr(into, name)[:]
            getattr(into, name).extend(value)
    return target


def merge_response(request: HookRequest, response: HookResponse, apply_pod_resources: bool = False) -> Changes:
    """Merge ``response`` into ``request``, which the next server in the chain then sees; say what changed."""
    if isinstance(request, PodHookRequest):
        assert isinstance(response, hook.PodSandboxHookResponse)
        return merge_pod_response(request, response, apply_pod_resources)
    assert isinstance(response, hook.ContainerResourceHookResponse)
    return merge_container_response(request, response)


def placed_in_pod(container: ContainerHookRequest, pod: PodHookRequest) -> ContainerHookRequest:
    """``container`` (changed in place) with its pod's fields from ``pod``, as the store keeps it.

    ``container.pod_cgroup_parent`` comes in as the container's own request (or the runtime) places
    the container: that is kubelet's copy of the pod's parent. The pod's parent as the store has it
    wins (hooks may have moved the pod at RunPodSandbox, and the runtime puts the container's cgroup
    under the parent its request names); kubelet's stands in when the store has none.
    """
    own_parent = container.pod_cgroup_parent
    container.pod_meta.CopyFrom(pod.pod_meta)
    container.pod_labels.clear()
    container.pod_labels.update(pod.labels)
    container.pod_annotations.clear()
    container.pod_annotations.update(pod.annotations)
    container.pod_cgroup_parent = pod.cgroup_parent or own_parent
    if pod.HasField("resources"):
        container.pod_resources.CopyFrom(pod.resources)
    else:
        container.ClearField("pod_resources")
    return container


Entry = TypeVar("Entry")


def merged_envs(
    entries: Sequence[Entry],
    read: Callable[[Entry], tuple[str, str] | None],
    write: Callable[[str, str], Entry],
    before: Mapping[str, str],
    after: Mapping[str, str],
) -> list[Entry]:
    """An environment list with the hooks' changes: order kept, values replaced in place, new keys appended sorted.

    ``before`` and ``after`` are the hook request's environment as it went in and came out. A map
    cannot say where a key stood or that it stood twice, so only the keys the hooks changed are
    touched, every occurrence of them; every other entry stays exactly as it was sent. An entry
    ``read`` cannot see as a variable (None: a value hooks cannot be shown) never was in the map,
    and stays as and where it is, whatever the hooks answer.
    """
    changed = {key: value for key, value in after.items() if before.get(key) != value}
    result: list[Entry] = []
    present: set[str] = set()
    for entry in entries:
        variable = read(entry)
        if variable is None:
            result.append(entry)
            continue
        key = variable[0]
        present.add(key)
        result.append(write(key, changed[key]) if key in changed else entry)
    result.extend(write(key, changed[key]) for key in sorted(changed) if key not in present)
    return result


def oci_env_variable(entry: str) -> tuple[str, str] | None:
    """An OCI (and Docker) environment entry ``K=V`` as a variable; None: an entry without ``=`` names no value."""
    key, sep, value = entry.partition("=")
    return (key, value) if sep else None


def oci_env_map(env: Sequence[str]) -> dict[str, str]:
    """``K=V`` entries as hooks see them: a map (the last of a repeated key wins, as in the container)."""
    variables = (oci_env_variable(entry) for entry in env)
    return dict(variable for variable in variables if variable is not None)
