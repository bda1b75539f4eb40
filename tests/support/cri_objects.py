"""Builders for the CRI v1 request objects tests send, shaped like kubelet's.

Pods are host-network only: the test machine has no CNI plugins, and a
host-network sandbox is the one kind containerd can run without them.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cri_api.v1 import api_pb2

from .images import BUSYBOX_REF


def pod_sandbox_config(
    name: str,
    *,
    namespace: str = "default",
    uid: str | None = None,
    attempt: int = 0,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
    log_directory: Path | None = None,
    cgroup_parent: str | None = None,
    hostname: str = "",
    share_pid: bool = False,
) -> Any:
    """Return a host-network PodSandboxConfig.

    PID namespaces default to per-container as kubelet's do; the protobuf
    default (POD) would silently share one across the pod.

    `log_directory` is created here because kubelet, not containerd, makes it,
    and CreateContainer fails if its log file's directory is missing.
    """
    if log_directory is not None:
        log_directory.mkdir(parents=True, exist_ok=True)
    linux = api_pb2.LinuxPodSandboxConfig(
        security_context=api_pb2.LinuxSandboxSecurityContext(
            namespace_options=_namespace_options(share_pid),
        ),
    )
    if cgroup_parent is not None:
        linux.cgroup_parent = cgroup_parent
    return api_pb2.PodSandboxConfig(
        metadata=api_pb2.PodSandboxMetadata(
            name=name,
            namespace=namespace,
            uid=uid if uid is not None else str(uuid.uuid4()),
            attempt=attempt,
        ),
        hostname=hostname,
        log_directory=str(log_directory) if log_directory is not None else "",
        labels=dict(labels or {}),
        annotations=dict(annotations or {}),
        linux=linux,
    )


def _namespace_options(share_pid: bool) -> Any:
    return api_pb2.NamespaceOption(
        network=api_pb2.NODE,
        pid=api_pb2.POD if share_pid else api_pb2.CONTAINER,
        ipc=api_pb2.POD,
    )


def linux_resources(
    *,
    cpu_period: int = 0,
    cpu_quota: int = 0,
    cpu_shares: int = 0,
    memory_limit_in_bytes: int = 0,
    oom_score_adj: int = 0,
    cpuset_cpus: str = "",
    cpuset_mems: str = "",
    unified: Mapping[str, str] | None = None,
) -> Any:
    """Return LinuxContainerResources; zero/empty fields mean "not set" in CRI."""
    return api_pb2.LinuxContainerResources(
        cpu_period=cpu_period,
        cpu_quota=cpu_quota,
        cpu_shares=cpu_shares,
        memory_limit_in_bytes=memory_limit_in_bytes,
        oom_score_adj=oom_score_adj,
        cpuset_cpus=cpuset_cpus,
        cpuset_mems=cpuset_mems,
        unified=dict(unified or {}),
    )


def container_config(
    name: str,
    *,
    image: str = BUSYBOX_REF,
    user_specified_image: str = "",
    command: Sequence[str] = (),
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
    log_path: str = "",
    resources: Any | None = None,
    attempt: int = 0,
    share_pid: bool = False,
) -> Any:
    """Return a ContainerConfig; `log_path` is relative to the pod's log_directory.

    The namespace options mirror those of `pod_sandbox_config` (pass the same
    `share_pid`), as kubelet sends the pod's options with each container. kubelet names the image by its
    id in `image` and as the pod spec writes it in `user_specified_image`.
    """
    linux = api_pb2.LinuxContainerConfig()
    if resources is not None:
        linux.resources.CopyFrom(resources)
    linux.security_context.namespace_options.CopyFrom(_namespace_options(share_pid))
    return api_pb2.ContainerConfig(
        metadata=api_pb2.ContainerMetadata(name=name, attempt=attempt),
        image=api_pb2.ImageSpec(image=image, user_specified_image=user_specified_image),
        command=list(command),
        args=list(args),
        envs=[api_pb2.KeyValue(key=k, value=v) for k, v in (env or {}).items()],
        labels=dict(labels or {}),
        annotations=dict(annotations or {}),
        log_path=log_path,
        linux=linux,
    )
