"""Rebuild stored hook requests from what containerd itself knows (verbose CRI status).

When the store misses (a pod created before koordrp started) or at start-up, the pod and container
information hooks need is rebuilt from containerd's ``PodSandboxStatus`` / ``ContainerStatus`` with
``verbose=True``.  Pure functions: no grpc calls, no threads.

What containerd 1.6 returns (seen on a live instance, see tests/fixtures/):

* ``response.info`` is a map with one key, ``"info"``: a compact JSON object.  Without ``verbose``
  the map is empty.
* Pod sandbox info: ``config`` is the PodSandboxConfig containerd received, in Go-JSON form
  (proto field names in snake_case, enums as integers, int64 as numbers, zero/empty fields
  omitted), ``runtimeHandler`` is RunPodSandboxRequest.runtime_handler ("" for the default; 1.6.20
  also reports it in ``status.runtime_handler``), ``runtimeSpec`` is the pause container's OCI spec.  The cgroup parent is only in ``config.linux.cgroup_parent`` (the spec's
  ``linux.cgroupsPath`` is "<parent>/<id>", or "/k8s.io/<id>" with no parent: never derive it).
* Container info: ``sandboxID``, ``config`` (the ContainerConfig: ``envs`` as a list of
  ``{"key", "value"}``, in order, duplicates kept, ``value`` omitted when empty; ``annotations``;
  ``linux.resources``) and ``runtimeSpec`` (``process.env`` as "K=V" strings including the image's
  environment, ``process.oomScoreAdj``, ``linux.resources`` in OCI form, ``annotations`` with
  ``io.kubernetes.cri.sandbox-{name,namespace,uid}``).
* Since koordrp forwards hook-modified requests, ``config`` already carries the hooks' changes.
  It is *not* updated by UpdateContainerResources; ``status.resources.linux`` (a typed CRI field,
  present with or without verbose, kept across containerd restarts and after the container
  exits) and the runtime spec are.  containerd fills ``memory_swap_limit_in_bytes`` with the memory
  limit when the request left swap unset, and drops hugepage limits the host cannot honour.
"""

from __future__ import annotations

import base64
import functools
import json
import re
from typing import Any, Callable, TypeVar, overload

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor
from google.protobuf.message import Message

from koordrp.api.cri.v1 import api_pb2 as cri
from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from koordrp.cri.translate import as_hook_resources, image_name, pod_hook_request
from koordrp.hooks.messages import IMAGE_NAME_ANNOTATION, placed_in_pod, with_image_name
from koordrp.text import json_type

__all__ = [
    "RuntimeInfoError",
    "container_info_from_status",
    "container_sandbox_id",
    "pod_info_from_status",
]

# Annotations containerd's CRI plugin puts on every container's OCI spec.
SANDBOX_NAME_ANNOTATION = "io.kubernetes.cri.sandbox-name"
SANDBOX_NAMESPACE_ANNOTATION = "io.kubernetes.cri.sandbox-namespace"
SANDBOX_UID_ANNOTATION = "io.kubernetes.cri.sandbox-uid"

INT64_MIN, INT64_MAX, UINT64_MAX = -(2**63), 2**63 - 1, 2**64 - 1

# How kubelet names an image by its id (what ImageStatus answered).
_IMAGE_ID = re.compile(r"sha256:[0-9a-f]{64}")


class RuntimeInfoError(ValueError):
    """The runtime's status lacks the information needed, or it is malformed; ``reason`` says which."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


Result = TypeVar("Result")


def _only_runtime_info_errors(read: Callable[..., Result]) -> Callable[..., Result]:
    """Whatever a broken or hostile runtime writes, callers see a RuntimeInfoError and nothing else.

    The readers check what they expect, but JSON can spell things protobuf refuses deep inside
    its own code (a lone surrogate raises SystemError or UnicodeEncodeError there).
    """

    @functools.wraps(read)
    def guarded(*args: Any) -> Result:
        try:
            return read(*args)
        except RuntimeInfoError:
            raise
        except (ValueError, TypeError, SystemError, RecursionError, KeyError, AttributeError) as error:
            raise RuntimeInfoError(f"unreadable status: {type(error).__name__}: {_one_line(error)}") from None

    return guarded


# ---------------------------------------------------------------------------------------------
# Public API


@_only_runtime_info_errors
def pod_info_from_status(response: cri.PodSandboxStatusResponse) -> hook.PodSandboxHookRequest:
    """The PodSandboxHookRequest koordrp would have stored for this sandbox, from a verbose status."""
    status = response.status
    what = f"pod sandbox {status.id or '<no id>'}"
    info = _verbose_info(response, what)
    config = _parse(cri.PodSandboxConfig, _object(info, "config", f"{what} info", required=True), f"{what} config")
    config.metadata.CopyFrom(_metadata(config, status, what))
    handler = status.runtime_handler or _string(info, "runtimeHandler", f"{what} info")
    # The same request koordrp builds when the sandbox runs through it.
    return pod_hook_request(cri.RunPodSandboxRequest(config=config, runtime_handler=handler))


@_only_runtime_info_errors
def container_info_from_status(
    response: cri.ContainerStatusResponse, pod: hook.PodSandboxHookRequest | None
) -> hook.ContainerResourceHookRequest:
    """The ContainerResourceHookRequest koordrp would have stored for this container.

    The pod fields come from ``pod`` when given (see ``pod_info_from_status``); without it only
    ``pod_meta`` name/namespace/uid are filled, from the annotations containerd puts on the spec.

    ``container_resources`` are the current ones: ``status.resources.linux`` when the runtime
    reports any, else the config's ``linux.resources``, else the runtime spec's.  Two corrections
    keep them equal to what the hooks saw before: a swap limit equal to the memory limit is
    containerd's own default and is reported as 0 when the config did not ask for swap, and
    hugepage limits the runtime dropped are taken from the config.
    """
    status = response.status
    if not status.id:
        raise RuntimeInfoError("container status has no container id")
    what = f"container {status.id}"
    info = _verbose_info(response, what)
    written = _object(info, "config", f"{what} info", required=True)
    without_envs = {key: value for key, value in written.items() if key != "envs"}
    config = _parse(cri.ContainerConfig, without_envs, f"{what} config")
    metadata = _metadata(config, status, what)
    container = hook.ContainerResourceHookRequest(
        container_meta=hook.ContainerMetadata(name=metadata.name, attempt=metadata.attempt, id=status.id),
        container_annotations=with_image_name(config.annotations, _image_read_back(config, info, what)),
        container_envs=_envs(written.get("envs"), _spec_env(info, what), f"{what} config"),
    )
    container.container_resources.CopyFrom(_container_resources(status, config, info, what))
    if pod is not None:
        placed_in_pod(container, pod)
    else:
        annotations = _spec_annotations(info, what)
        container.pod_meta.name = annotations.get(SANDBOX_NAME_ANNOTATION, "")
        container.pod_meta.namespace = annotations.get(SANDBOX_NAMESPACE_ANNOTATION, "")
        container.pod_meta.uid = annotations.get(SANDBOX_UID_ANNOTATION, "")
    return container


def _image_read_back(config: cri.ContainerConfig, info: dict[str, Any], what: str) -> str:
    """The image as hooks were shown it at create (``translate.image_name``), as far as containerd kept it.

    containerd 2 keeps ``user_specified_image``; 1.6 and 1.7 drop it (their CRI schema predates it) and
    keep only ``image``, which from kubelet is the image's id: then the name containerd gave the image
    itself (its own annotation, as NRI mode on 1.7 shows it) is told rather than an id.
    """
    if config.image.user_specified_image or not _IMAGE_ID.fullmatch(config.image.image):
        return image_name(config.image)
    return _spec_annotations(info, what).get(IMAGE_NAME_ANNOTATION) or config.image.image


@_only_runtime_info_errors
def container_sandbox_id(response: cri.ContainerStatusResponse) -> str:
    """The id of the container's pod sandbox (only the verbose info carries it)."""
    what = f"container {response.status.id or '<no id>'}"
    sandbox_id = _string(_verbose_info(response, what), "sandboxID", f"{what} info")
    if not sandbox_id:
        raise RuntimeInfoError(f"{what} info has no sandboxID")
    return sandbox_id


# ---------------------------------------------------------------------------------------------
# Reading the verbose info


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def _verbose_info(response: cri.PodSandboxStatusResponse | cri.ContainerStatusResponse, what: str) -> dict[str, Any]:
    raw = response.info.get("info")
    if raw is None:
        raise RuntimeInfoError(f"{what} status has no verbose info (was it requested with verbose=True?)")
    try:
        info = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise RuntimeInfoError(f"{what} verbose info is not JSON: {_one_line(exc)}") from None
    if not isinstance(info, dict):
        raise RuntimeInfoError(f"{what} verbose info is a JSON {json_type(info)}, not an object")
    return info


def _object(parent: dict[str, Any], key: str, where: str, *, required: bool = False) -> dict[str, Any]:
    """``parent[key]`` as a JSON object; absent or null is {} unless ``required``."""
    value = parent.get(key)
    if value is None:
        if required:
            raise RuntimeInfoError(f"{where} has no {key!r}")
        return {}
    if not isinstance(value, dict):
        raise RuntimeInfoError(f"{where}: {key!r} is a JSON {json_type(value)}, not an object")
    return value


def _string(parent: dict[str, Any], key: str, where: str) -> str:
    """``parent[key]`` as a string; absent or null (Go omitted it) is ""."""
    value = parent.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise RuntimeInfoError(f"{where}: {key!r} is a JSON {json_type(value)}, not a string")
    return value


def _integer(parent: dict[str, Any], key: str, where: str, *, low: int = INT64_MIN, high: int = INT64_MAX) -> int:
    """``parent[key]`` as an integer in [low, high]; absent or null (Go omitted it) is 0."""
    value = parent.get(key)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise RuntimeInfoError(f"{where}: {key!r} is a JSON {json_type(value)}, not an integer")
    if not low <= value <= high:
        raise RuntimeInfoError(f"{where}: {key!r} is {value}, out of range [{low}, {high}]")
    return value


def _check_shape(value: object, descriptor: Descriptor, where: str) -> None:
    """Reject a JSON array or string where ``descriptor`` wants an object, anywhere below ``value``.

    ParseDict with ignore_unknown_fields reads such a value as an object whose keys are all unknown,
    that is, as an empty message: a malformed config would silently lose its metadata or resources.
    """
    if not isinstance(value, dict):
        raise RuntimeInfoError(f"{where} is a JSON {json_type(value)}, not an object")
    for key, item in value.items():
        field = next((f for f in descriptor.fields if key in (f.name, f.json_name)), None)
        if field is None or item is None or field.message_type is None:
            continue  # unknown (ignored), null (unset) or a scalar (ParseDict checks those)
        inner = f"{where}.{key}"
        if field.message_type.GetOptions().map_entry:
            if not isinstance(item, dict):
                raise RuntimeInfoError(f"{inner} is a JSON {json_type(item)}, not an object")
            entry_value = field.message_type.fields_by_name["value"].message_type
            if entry_value is not None:
                for entry_key, entry in item.items():
                    _check_shape(entry, entry_value, f"{inner}[{entry_key!r}]")
        elif field.is_repeated:
            if not isinstance(item, list):
                raise RuntimeInfoError(f"{inner} is a JSON {json_type(item)}, not an array")
            for index, element in enumerate(item):
                _check_shape(element, field.message_type, f"{inner}[{index}]")
        else:
            _check_shape(item, field.message_type, inner)


Parsed = TypeVar("Parsed", bound=Message)


def _parse(message_class: type[Parsed], value: dict[str, Any], where: str) -> Parsed:
    """A CRI message from its Go-JSON form (snake_case names, integer enums, omitted zeros)."""
    message = message_class()
    # The stubs type it as the pure-Python or the upb descriptor class: one API either way.
    _check_shape(value, message.DESCRIPTOR, where)  # type: ignore[arg-type]
    try:
        return json_format.ParseDict(value, message, ignore_unknown_fields=True)
    except (json_format.Error, ValueError, TypeError, AttributeError, RecursionError) as exc:
        raise RuntimeInfoError(f"{where} is malformed: {_one_line(exc)}") from None


@overload
def _metadata(config: cri.PodSandboxConfig, status: cri.PodSandboxStatus, what: str) -> cri.PodSandboxMetadata: ...


@overload
def _metadata(config: cri.ContainerConfig, status: cri.ContainerStatus, what: str) -> cri.ContainerMetadata: ...


def _metadata(
    config: cri.PodSandboxConfig | cri.ContainerConfig, status: cri.PodSandboxStatus | cri.ContainerStatus, what: str
) -> cri.PodSandboxMetadata | cri.ContainerMetadata:
    # Both hold the metadata kubelet sent; the config is what the rest is read from.
    if config.HasField("metadata"):
        return config.metadata
    if status.HasField("metadata"):
        return status.metadata
    raise RuntimeInfoError(f"{what} has no metadata in its status or config")


def _envs(written: object, spec_env: frozenset[str], where: str) -> dict[str, str]:
    """The config's environment as hooks saw it: a map (the last value of a repeated key wins, as in the
    container), without values that are not UTF-8.

    The runtime writes each value as its own CRI schema has it: a string, or (where ``KeyValue.value``
    is bytes, cri-api v0.35.6 and later) base64. Its runtime spec holds the environment as text,
    which tells the two apart.
    """
    if written is None:
        return {}
    if not isinstance(written, list):
        raise RuntimeInfoError(f"{where}: 'envs' is a JSON {json_type(written)}, not an array")
    envs: dict[str, str] = {}
    for index, entry in enumerate(written):
        if not isinstance(entry, dict):
            raise RuntimeInfoError(f"{where}.envs[{index}] is a JSON {json_type(entry)}, not an object")
        key = _string(entry, "key", f"{where}.envs[{index}]")
        value = _env_value(key, _string(entry, "value", f"{where}.envs[{index}]"), spec_env)
        if value is not None:
            envs[key] = value
    return envs


def _env_value(key: str, written: str, spec_env: frozenset[str]) -> str | None:
    """The value as the container has it: ``written`` when the spec shows it (or shows nothing), else its base64."""
    if not spec_env or f"{key}={written}" in spec_env:
        return written
    try:
        text = base64.b64decode(written, validate=True).decode("utf-8")
    except UnicodeDecodeError:
        return None  # bytes that are no text: hooks never saw them
    except ValueError:
        return written
    return text if f"{key}={text}" in spec_env else written


def _spec_env(info: dict[str, Any], what: str) -> frozenset[str]:
    where = f"{what} runtimeSpec.process"
    env = _object(_object(info, "runtimeSpec", f"{what} info"), "process", f"{what} runtimeSpec").get("env")
    if env is None:
        return frozenset()
    if not isinstance(env, list) or not all(isinstance(entry, str) for entry in env):
        raise RuntimeInfoError(f"{where}: 'env' is not an array of strings")
    return frozenset(env)


def _spec_annotations(info: dict[str, Any], what: str) -> dict[str, str]:
    where = f"{what} runtimeSpec"
    annotations = _object(_object(info, "runtimeSpec", f"{what} info"), "annotations", where)
    for key, value in annotations.items():
        if not isinstance(value, str):
            raise RuntimeInfoError(f"{where}: annotation {key!r} is a JSON {json_type(value)}, not a string")
    return annotations


# ---------------------------------------------------------------------------------------------
# Resources


def _container_resources(
    status: cri.ContainerStatus, config: cri.ContainerConfig, info: dict[str, Any], what: str
) -> hook.LinuxContainerResources:
    requested = as_hook_resources(config.linux.resources) if config.linux.HasField("resources") else None
    if status.resources.linux.ByteSize() > 0:
        current = as_hook_resources(status.resources.linux)
    elif requested is not None:
        return requested
    else:
        current = _resources_from_spec(info, what)
    requested_swap = requested.memory_swap_limit_in_bytes if requested is not None else 0
    if requested_swap == 0 and current.memory_swap_limit_in_bytes == current.memory_limit_in_bytes:
        current.memory_swap_limit_in_bytes = 0
    if requested is not None and not current.hugepage_limits:
        current.hugepage_limits.extend(requested.hugepage_limits)
    return current


def _resources_from_spec(info: dict[str, Any], what: str) -> hook.LinuxContainerResources:
    """LinuxContainerResources from the OCI runtime spec (``linux.resources``, ``process.oomScoreAdj``)."""
    where = f"{what} runtimeSpec"
    spec = _object(info, "runtimeSpec", f"{what} info")
    resources = _object(_object(spec, "linux", where), "resources", f"{where}.linux")
    where = f"{where}.linux.resources"
    cpu = _object(resources, "cpu", where)
    memory = _object(resources, "memory", where)
    converted = hook.LinuxContainerResources(
        cpu_period=_integer(cpu, "period", f"{where}.cpu"),
        cpu_quota=_integer(cpu, "quota", f"{where}.cpu"),
        cpu_shares=_integer(cpu, "shares", f"{where}.cpu"),
        memory_limit_in_bytes=_integer(memory, "limit", f"{where}.memory"),
        oom_score_adj=_integer(_object(spec, "process", where), "oomScoreAdj", f"{what} runtimeSpec.process"),
        cpuset_cpus=_string(cpu, "cpus", f"{where}.cpu"),
        cpuset_mems=_string(cpu, "mems", f"{where}.cpu"),
        memory_swap_limit_in_bytes=_integer(memory, "swap", f"{where}.memory"),
    )
    limits = resources.get("hugepageLimits")
    if limits is not None:
        if not isinstance(limits, list):
            raise RuntimeInfoError(f"{where}: 'hugepageLimits' is a JSON {json_type(limits)}, not an array")
        for index, limit in enumerate(limits):
            if not isinstance(limit, dict):
                raise RuntimeInfoError(f"{where}.hugepageLimits[{index}] is a JSON {json_type(limit)}, not an object")
            converted.hugepage_limits.add(
                page_size=_string(limit, "pageSize", f"{where}.hugepageLimits[{index}]"),
                limit=_integer(limit, "limit", f"{where}.hugepageLimits[{index}]", low=0, high=UINT64_MAX),
            )
    for key, value in _object(resources, "unified", where).items():
        if not isinstance(value, str):
            raise RuntimeInfoError(f"{where}.unified: {key!r} is a JSON {json_type(value)}, not a string")
        converted.unified[key] = value
    return converted
