"""Docker Engine API JSON ⇄ hook requests, the way cri-dockerd lays Kubernetes pods out in dockerd.

cri-dockerd (dockershim before it) turns each CRI call into plain Docker calls, and what the hooks
need survives only in conventions:

- the label ``io.kubernetes.docker.type`` says ``podsandbox`` (the pause container standing for
  the pod) or ``container``; a container also carries its sandbox's docker id in
  ``io.kubernetes.sandbox.id`` and its log path in ``io.kubernetes.container.logpath``;
- the name is ``k8s_<container>_<pod>_<namespace>_<uid>_<attempt>`` (``POD`` as the container for
  a sandbox, an ``_<random>`` suffix after a name conflict, a leading ``/`` in inspect output);
- annotations travel as labels prefixed ``annotation.``; every other label is a CRI label, except
  the shim's own (the three above, and ``io.kubernetes.container.name=POD`` on sandboxes);
- resources are HostConfig fields, the pod's cgroup is HostConfig.CgroupParent in dockerd's
  syntax: a path with the cgroupfs driver, a bare slice name with the systemd driver. While
  dockerd's driver is not known (``None``: /info did not say), a slice name is read as systemd's,
  and hooks' cgroup parents are not written (``LeftAlone``).

Hooks are given what they would get through CRI for the same pod; what they change is written back
into the JSON body, and only that: every other field (unknown ones included) goes to dockerd as the
client sent it. The merging itself is ``koordrp.hooks.messages``'; this module only translates.
Reading what dockerd has back into the store is ``koordrp.docker.inspect``, with the readers here.

Nothing here does I/O. Bad shapes raise ``DockerShapeError`` with a one-line reason.
"""

import json
import re
from typing import Any, Literal, Mapping, MutableMapping

from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from koordrp.adapters import LeftAlone, Written
from koordrp.hooks.messages import (
    ContainerHookRequest,
    PodHookRequest,
    merged_envs,
    oci_env_map,
    oci_env_variable,
    with_image_name,
)
from koordrp.text import json_type

Kind = Literal["sandbox", "container"]
JSONObject = dict[str, Any]

TYPE_LABEL = "io.kubernetes.docker.type"
SANDBOX_TYPE = "podsandbox"
CONTAINER_TYPE = "container"
SANDBOX_ID_LABEL = "io.kubernetes.sandbox.id"
LOG_PATH_LABEL = "io.kubernetes.container.logpath"
CONTAINER_NAME_LABEL = "io.kubernetes.container.name"
ANNOTATION_PREFIX = "annotation."

# cri-dockerd serves exactly one runtime handler and calls it "docker" (it refuses any other);
# kubelet's request may have said "" for it, which the Docker body does not keep.
RUNTIME_HANDLER = "docker"

SYSTEMD = "systemd"

# Labels cri-dockerd adds for itself: not CRI labels, and never overwritten by a hook's answer.
_SHIM_LABELS = frozenset({TYPE_LABEL, SANDBOX_ID_LABEL, LOG_PATH_LABEL})
_SANDBOX_SHIM_LABELS = _SHIM_LABELS | {CONTAINER_NAME_LABEL}

# Hook resource field → Docker field, in HostConfig for create/inspect and at the top level of
# POST /containers/{id}/update. Docker has no home for ``unified`` or ``hugepage_limits``: hook
# changes to those cannot reach dockerd and are left out. An update cannot change OomScoreAdj.
_RESOURCE_KEYS: tuple[tuple[str, str], ...] = (
    ("cpu_shares", "CpuShares"),
    ("cpu_quota", "CpuQuota"),
    ("cpu_period", "CpuPeriod"),
    ("memory_limit_in_bytes", "Memory"),
    ("memory_swap_limit_in_bytes", "MemorySwap"),
    ("cpuset_cpus", "CpusetCpus"),
    ("cpuset_mems", "CpusetMems"),
    ("oom_score_adj", "OomScoreAdj"),
)
_UPDATE_KEYS = tuple(pair for pair in _RESOURCE_KEYS if pair[0] != "oom_score_adj")
_STRING_FIELDS = frozenset({"cpuset_cpus", "cpuset_mems"})

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_UINT32_MAX = (1 << 32) - 1
_DIGITS = re.compile(r"[0-9]+")


class DockerShapeError(ValueError):
    """A Docker API body that does not have the shape cri-dockerd gives it (one-line reason)."""


def _show(value: str, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 4] + "…" + text[-1]


# ---------------------------------------------------------------------------------------------
# Reading JSON, create bodies and inspect output alike: ``what`` says where a value is, as a DockerShapeError names it


def require_object(value: object, what: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise DockerShapeError(f"{what} is {json_type(value)}, not an object")
    return value


def optional_object(holder: Mapping[str, Any], key: str, what: str) -> Mapping[str, Any] | None:
    value = holder.get(key)
    if value is None:
        return None
    return require_object(value, f"{what}.{key}")


def labels_in(holder: Mapping[str, Any], what: str) -> dict[str, str]:
    value = holder.get("Labels")
    if value is None:
        return {}
    labels = require_object(value, f"{what}.Labels")
    for key, label in labels.items():
        if not isinstance(label, str):
            raise DockerShapeError(f"{what}.Labels[{_show(key)}] is {json_type(label)}, not a string")
    return dict(labels)


def env_in(holder: Mapping[str, Any], what: str) -> list[str]:
    value = holder.get("Env")
    if value is None:
        return []
    if not isinstance(value, list):
        raise DockerShapeError(f"{what}.Env is {json_type(value)}, not an array")
    for index, entry in enumerate(value):
        if not isinstance(entry, str):
            raise DockerShapeError(f"{what}.Env[{index}] is {json_type(entry)}, not a string")
    return list(value)


def image_in(holder: Mapping[str, Any], what: str) -> str:
    """The image a create body (or inspect's Config, which keeps it as created) names: cri-dockerd's copy of
    kubelet's ``image`` (cri-dockerd passes on no ``user_specified_image``)."""
    value = holder.get("Image")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DockerShapeError(f"{what}.Image is {json_type(value)}, not a string")
    return value


def _resources(holder: Mapping[str, Any], what: str, keys: tuple[tuple[str, str], ...]) -> hook.LinuxContainerResources:
    resources = hook.LinuxContainerResources()
    for field, key in keys:
        value = holder.get(key)
        if value is None:
            continue
        if field in _STRING_FIELDS:
            if not isinstance(value, str):
                raise DockerShapeError(f"{what}.{key} is {json_type(value)}, not a string")
        elif isinstance(value, bool) or not isinstance(value, int):
            raise DockerShapeError(f"{what}.{key} is {json_type(value)}, not an integer")
        elif not _INT64_MIN <= value <= _INT64_MAX:
            raise DockerShapeError(f"{what}.{key} is {value}, out of the int64 range")
        setattr(resources, field, value)
    return resources


class ContainerName:
    """The parts of a ``k8s_<container>_<pod>_<namespace>_<uid>_<attempt>`` container name."""

    def __init__(self, name: object, what: str) -> None:
        if not isinstance(name, str):
            raise DockerShapeError(f"{what} name is {json_type(name)}, not a string")
        parts = name.removeprefix("/").split("_")
        # Seven parts: cri-dockerd appended a random suffix after a name conflict.
        if len(parts) not in (6, 7) or parts[0] != "k8s" or not all(parts[1:5]):
            raise DockerShapeError(
                f"{what} name {_show(name)} is not k8s_<container>_<pod>_<namespace>_<uid>_<attempt>"
            )
        if not _DIGITS.fullmatch(parts[5]) or int(parts[5]) > _UINT32_MAX:
            raise DockerShapeError(f"{what} name {_show(name)} has attempt {_show(parts[5])}, not a uint32")
        self.container, self.pod, self.namespace, self.uid = parts[1:5]
        self.attempt = int(parts[5])


def kind_of_labels(labels: object) -> Kind | None:
    """What cri-dockerd's labels say it made: ``sandbox``, ``container``, or None (not a Kubernetes one)."""
    if not isinstance(labels, dict):
        return None
    value = labels.get(TYPE_LABEL)
    if value == SANDBOX_TYPE:
        return "sandbox"
    if value == CONTAINER_TYPE:
        return "container"
    return None


def require_kind(labels: Mapping[str, str], kind: Kind, what: str) -> None:
    if kind_of_labels(labels) != kind:
        found = labels.get(TYPE_LABEL)
        shown = "absent" if found is None else _show(found)
        expected = SANDBOX_TYPE if kind == "sandbox" else CONTAINER_TYPE
        raise DockerShapeError(f"{what}: label {TYPE_LABEL} is {shown}, not {expected!r}")


def _split_labels(labels: Mapping[str, str], kind: Kind) -> tuple[dict[str, str], dict[str, str]]:
    """CRI labels and annotations, as dockershim splits them back (its own labels dropped)."""
    shim = _SANDBOX_SHIM_LABELS if kind == "sandbox" else _SHIM_LABELS
    plain: dict[str, str] = {}
    annotations: dict[str, str] = {}
    for key, value in labels.items():
        if key.startswith(ANNOTATION_PREFIX):
            annotations[key[len(ANNOTATION_PREFIX) :]] = value
        elif key not in shim:
            plain[key] = value
    return plain, annotations


# ---------------------------------------------------------------------------------------------
# Which creates are Kubernetes ones


def kind_of(create_body: object) -> Kind | None:
    """``sandbox`` or ``container`` for cri-dockerd's creates; None for anything else (pass it through)."""
    if not isinstance(create_body, dict):
        return None
    return kind_of_labels(create_body.get("Labels"))


def sandbox_id_in(labels: Mapping[str, str], what: str) -> str:
    """The docker id of the sandbox a container's labels name."""
    value = labels.get(SANDBOX_ID_LABEL)
    if not value:
        raise DockerShapeError(f"{what}: label {SANDBOX_ID_LABEL} is missing")
    return value


def sandbox_id_of(create_body: object) -> str:
    """The docker id of a container's sandbox (where the store keeps its pod)."""
    body = require_object(create_body, "create body")
    return sandbox_id_in(labels_in(body, "create body"), "create body")


# ---------------------------------------------------------------------------------------------
# Cgroup parents: hooks speak paths, dockerd with the systemd driver wants a slice name


def _is_slice_name(value: str) -> bool:
    if "/" in value or not value.endswith(".slice"):
        return False
    units = value[: -len(".slice")].split("-")
    return all(units)  # systemd refuses empty units: "-a.slice", "a--b.slice", "a-.slice", "-.slice"


def to_hook_cgroup_parent(value: str, cgroup_driver: str | None) -> str:
    """HostConfig.CgroupParent as hooks (and kubelet, through CRI) write it.

    With systemd a slice name stands for its whole path, each ``-`` opening one level down:
    ``kubepods-besteffort-pod1.slice`` is
    ``/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1.slice``, the cgroup parent
    kubelet gives a CRI runtime (cri-dockerd kept its last part). Anything that is not a valid slice
    name, and every value with another driver, is returned unchanged. With the driver not known, a
    slice name is read as systemd's: kubelet names cgroupfs parents as paths, never so.
    """
    if cgroup_driver not in (SYSTEMD, None) or not _is_slice_name(value):
        return value
    units = value[: -len(".slice")].split("-")
    return "".join("/" + "-".join(units[: depth + 1]) + ".slice" for depth in range(len(units)))


def to_docker_cgroup_parent(path: str, cgroup_driver: str) -> str:
    """A hook's cgroup parent in the syntax dockerd's cgroup driver accepts.

    With systemd: the last part of a path of slices (what cri-dockerd does with kubelet's value),
    or, for a cgroupfs-style path such as ``/kubepods/besteffort/pod1``, the slice kubelet would
    name for it (``kubepods-besteffort-pod1.slice``, ``-`` inside a part written ``_``). Other
    drivers take the path as it is.
    """
    if cgroup_driver != SYSTEMD:
        return path
    parts = [part for part in path.split("/") if part]
    if not parts:
        return ""
    if parts[-1].endswith(".slice"):
        return parts[-1]
    return "-".join(part.replace("-", "_") for part in parts) + ".slice"


# ---------------------------------------------------------------------------------------------
# Building hook requests


def pod_request(
    name: ContainerName, labels: Mapping[str, str], host: Mapping[str, Any] | None, what: str, cgroup_driver: str | None
) -> PodHookRequest:
    pod_labels, annotations = _split_labels(labels, "sandbox")
    pod = PodHookRequest(
        pod_meta=hook.PodSandboxMetadata(name=name.pod, uid=name.uid, namespace=name.namespace, attempt=name.attempt),
        runtime_handler=RUNTIME_HANDLER,
        labels=pod_labels,
        annotations=annotations,
    )
    if host is not None:
        parent = host.get("CgroupParent")
        if parent is not None and not isinstance(parent, str):
            raise DockerShapeError(f"{what}.HostConfig.CgroupParent is {json_type(parent)}, not a string")
        pod.cgroup_parent = to_hook_cgroup_parent(parent or "", cgroup_driver)
        pod.resources.CopyFrom(_resources(host, f"{what}.HostConfig", _RESOURCE_KEYS))
    return pod


def container_request(
    name: ContainerName,
    labels: Mapping[str, str],
    env: list[str],
    image: str,
    host: Mapping[str, Any] | None,
    what: str,
    cgroup_driver: str | None,
) -> ContainerHookRequest:
    """The container as its own JSON says, pod fields included (its pod's attempt is not in its name)."""
    _, annotations = _split_labels(labels, "container")
    container = ContainerHookRequest(
        container_meta=hook.ContainerMetadata(name=name.container, attempt=name.attempt),
        container_annotations=with_image_name(annotations, image),
        container_envs=oci_env_map(env),
    )
    own_parent = ""
    if host is not None:
        parent = host.get("CgroupParent")
        if parent is not None and not isinstance(parent, str):
            raise DockerShapeError(f"{what}.HostConfig.CgroupParent is {json_type(parent)}, not a string")
        own_parent = to_hook_cgroup_parent(parent or "", cgroup_driver)
        container.container_resources.CopyFrom(_resources(host, f"{what}.HostConfig", _RESOURCE_KEYS))
    container.pod_meta.CopyFrom(hook.PodSandboxMetadata(name=name.pod, uid=name.uid, namespace=name.namespace))
    container.pod_cgroup_parent = own_parent
    return container


def sandbox_hook_request(name: str, body: object, cgroup_driver: str | None) -> PodHookRequest:
    """The PreRunPodSandbox request for ``POST /containers/create?name=<name>`` of a sandbox."""
    create = require_object(body, "create body")
    labels = labels_in(create, "create body")
    require_kind(labels, "sandbox", "create body")
    host = optional_object(create, "HostConfig", "create body")
    return pod_request(ContainerName(name, "sandbox"), labels, host, "create body", cgroup_driver)


def _container_create(name: str, body: object, cgroup_driver: str | None) -> ContainerHookRequest:
    create = require_object(body, "create body")
    labels = labels_in(create, "create body")
    require_kind(labels, "container", "create body")
    host = optional_object(create, "HostConfig", "create body")
    env = env_in(create, "create body")
    image = image_in(create, "create body")
    return container_request(ContainerName(name, "container"), labels, env, image, host, "create body", cgroup_driver)


def update_resources(body: object) -> hook.LinuxContainerResources:
    """The resources ``POST /containers/{id}/update`` names; it names only what it changes (zero or empty: keep)."""
    return _resources(require_object(body, "update body"), "update body", _UPDATE_KEYS)


# ---------------------------------------------------------------------------------------------
# Writing what the hooks changed back into the JSON body


def _section(body: MutableMapping[str, Any], key: str, what: str) -> MutableMapping[str, Any]:
    """``body[key]`` as an object to write into, created when absent or null."""
    value = body.get(key)
    if value is None:
        value = body[key] = {}
    elif not isinstance(value, dict):
        raise DockerShapeError(f"{what}.{key} is {json_type(value)}, not an object")
    return value


def _set(target: MutableMapping[str, Any], key: str, value: object) -> bool:
    if key in target and type(target[key]) is type(value) and target[key] == value:
        return False
    target[key] = value
    return True


def _write_labels(
    body: MutableMapping[str, Any],
    before: Mapping[str, str],
    after: Mapping[str, str],
    prefix: str,
    reserved: frozenset[str],
) -> bool:
    changed = False
    for key, value in after.items():
        label = prefix + key
        if before.get(key) != value and label not in reserved:
            changed |= _set(_section(body, "Labels", "body"), label, value)
    return changed


def _write_resources(
    body: MutableMapping[str, Any],
    section: str | None,
    before: hook.LinuxContainerResources,
    after: hook.LinuxContainerResources,
    keys: tuple[tuple[str, str], ...],
) -> bool:
    changed = False
    for field, key in keys:
        value = getattr(after, field)
        if getattr(before, field) != value:
            target = body if section is None else _section(body, section, "body")
            changed |= _set(target, key, value)
    return changed


def _write_env(body: MutableMapping[str, Any], before: Mapping[str, str], after: Mapping[str, str]) -> bool:
    if dict(before) == dict(after):
        return False
    env = env_in(body, "body")
    # Entries without "=" name no value: hooks never saw them, and they keep their place.
    result = merged_envs(env, oci_env_variable, lambda key, value: f"{key}={value}", before, after)
    if result == env:
        return False
    body["Env"] = result
    return True


def apply_to_sandbox_create(
    body: JSONObject, before: PodHookRequest, after: PodHookRequest, cgroup_driver: str | None
) -> bool:
    """Write into a sandbox's create body what the hooks changed; True if the body changed.

    Labels and annotations (as ``annotation.`` labels; cri-dockerd's own labels are never
    overwritten), HostConfig resources (the pod's resources: the sandbox is the pod's container
    in Docker), HostConfig.CgroupParent in dockerd's syntax (not while the driver is not known).
    """
    changed = _write_labels(body, before.labels, after.labels, "", _SANDBOX_SHIM_LABELS)
    changed |= _write_labels(body, before.annotations, after.annotations, ANNOTATION_PREFIX, _SANDBOX_SHIM_LABELS)
    changed |= _write_resources(body, "HostConfig", before.resources, after.resources, _RESOURCE_KEYS)
    if cgroup_driver is not None and after.cgroup_parent != before.cgroup_parent:
        host = _section(body, "HostConfig", "body")
        changed |= _set(host, "CgroupParent", to_docker_cgroup_parent(after.cgroup_parent, cgroup_driver))
    return changed


def apply_to_container_create(
    body: JSONObject,
    before: ContainerHookRequest,
    after: ContainerHookRequest,
    cgroup_driver: str | None,
) -> bool:
    """Write into a container's create body what the hooks changed; True if the body changed.

    Annotations (as ``annotation.`` labels), HostConfig resources, Env (order kept), and the pod's
    cgroup parent (not while the driver is not known): the container's cgroup is
    HostConfig.CgroupParent, which cri-dockerd filled from kubelet's sandbox config.
    """
    changed = _write_labels(
        body, before.container_annotations, after.container_annotations, ANNOTATION_PREFIX, _SHIM_LABELS
    )
    changed |= _write_resources(
        body, "HostConfig", before.container_resources, after.container_resources, _RESOURCE_KEYS
    )
    changed |= _write_env(body, before.container_envs, after.container_envs)
    if cgroup_driver is not None and after.pod_cgroup_parent != before.pod_cgroup_parent:
        wanted = to_docker_cgroup_parent(after.pod_cgroup_parent, cgroup_driver)
        changed |= _set(_section(body, "HostConfig", "body"), "CgroupParent", wanted)
    return changed


def apply_to_update(
    body: JSONObject, before: ContainerHookRequest, after: ContainerHookRequest
) -> bool:
    """Write into ``POST /containers/{id}/update``'s body the resources the hooks changed.

    Its resource fields are at the top level; it has no OomScoreAdj, labels or cgroup parent, so
    hook changes to those cannot be applied by an update.
    """
    require_object(body, "update body")
    return _write_resources(body, None, before.container_resources, after.container_resources, _UPDATE_KEYS)


# ---------------------------------------------------------------------------------------------
# The requests as the flows see them (koordrp.flows): built from the JSON body, written back into it


def _written(body: JSONObject, changed: bool, left_alone: tuple[LeftAlone, ...] = ()) -> Written:
    return Written(json.dumps(body).encode() if changed else None, left_alone)


def _left_alone(why: str, *paths: str) -> tuple[LeftAlone, ...]:
    return tuple(LeftAlone(path, why) for path in paths)


_NO_DOCKER_FIELD = "Docker has no field for it"
_NOT_IN_A_SANDBOX = _left_alone(_NO_DOCKER_FIELD, "resources.unified", "resources.hugepage_limits")
_NOT_IN_A_CONTAINER = _left_alone(_NO_DOCKER_FIELD, "container_resources.unified", "container_resources.hugepage_limits")
_DRIVER_UNKNOWN = "dockerd's cgroup driver is not known: GET /info failed"
_NOT_IN_AN_UPDATE = _NOT_IN_A_CONTAINER + _left_alone(
    "a Docker update cannot change it",
    "container_annotations",
    "container_resources.oom_score_adj",
)


def _left_alone_without(cgroup_driver: str | None, path: str) -> tuple[LeftAlone, ...]:
    """The cgroup parent, while dockerd's driver is not known: what the client sent goes to dockerd."""
    return _left_alone(_DRIVER_UNKNOWN, path) if cgroup_driver is None else ()


class SandboxCreate:
    """``POST /containers/create`` of a pod's sandbox (adapters.RunPodSandbox)."""

    def __init__(self, name: str, body: JSONObject, cgroup_driver: str | None) -> None:
        """DockerShapeError: a body koordrp cannot read. ``cgroup_driver`` None: dockerd has not said."""
        self._body = body
        self._driver = cgroup_driver
        self._pod = sandbox_hook_request(name, body, cgroup_driver)
        self._left_alone = _NOT_IN_A_SANDBOX + _left_alone_without(cgroup_driver, "cgroup_parent")

    def hook_request(self) -> PodHookRequest:
        return self._pod

    def rewritten(self, before: PodHookRequest, after: PodHookRequest) -> Written:
        """The body with what the hooks changed. While dockerd's cgroup driver is not known, ``after`` (the pod as
        koordrp keeps it) gets back the cgroup parent dockerd is given: the pod is kept where its sandbox is, so
        its containers join it once the driver is known (NRI mode, which cannot change a sandbox at all, keeps
        the pod as answered)."""
        written = _written(self._body, apply_to_sandbox_create(self._body, before, after, self._driver), self._left_alone)
        if self._driver is None:
            after.cgroup_parent = before.cgroup_parent
        return written


class ContainerCreate:
    """``POST /containers/create`` of a pod's container (adapters.CreateContainer)."""

    def __init__(self, name: str, body: JSONObject, cgroup_driver: str | None) -> None:
        """DockerShapeError: a body koordrp cannot read. ``cgroup_driver`` None: dockerd has not said."""
        self._body = body
        self._driver = cgroup_driver
        self.sandbox_id = sandbox_id_of(body)
        self._container = _container_create(name, body, cgroup_driver)
        self._left_alone = _NOT_IN_A_CONTAINER + _left_alone_without(cgroup_driver, "pod_cgroup_parent")

    def hook_request(self) -> ContainerHookRequest:
        return self._container

    def rewritten(self, before: ContainerHookRequest, after: ContainerHookRequest) -> Written:
        changed = apply_to_container_create(self._body, before, after, self._driver)
        return _written(self._body, changed, self._left_alone)

    def envs_sent(self) -> dict[str, str]:
        return oci_env_map(env_in(self._body, "create body"))


class ContainerUpdate:
    """``POST /containers/{id}/update`` (adapters.UpdateContainerResources)."""

    def __init__(self, container_id: str, body: object) -> None:
        """DockerShapeError: a body koordrp cannot read."""
        self.container_id = container_id
        self._update = update_resources(body)
        assert isinstance(body, dict)
        self._body: JSONObject = body

    def resources(self) -> hook.LinuxContainerResources:
        return self._update

    def annotations(self) -> Mapping[str, str]:
        return {}  # an update has no labels

    def rewritten(self, before: ContainerHookRequest, after: ContainerHookRequest) -> Written:
        return _written(self._body, apply_to_update(self._body, before, after), _NOT_IN_AN_UPDATE)
