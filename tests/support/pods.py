"""Pods with a running container, made and removed through any CRI endpoint."""

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from cri_api.v1 import api_pb2, api_pb2_grpc

from tests.support.cri_objects import container_config, pod_sandbox_config
from tests.support.images import BUSYBOX_REF

TIMEOUT = 60.0


def runtime_spec(runtime: api_pb2_grpc.RuntimeServiceStub, container_id: str) -> dict[str, Any]:
    """The OCI spec the runtime made the container with (containerd's verbose status)."""
    status = runtime.ContainerStatus(api_pb2.ContainerStatusRequest(container_id=container_id, verbose=True))
    spec: dict[str, Any] = json.loads(status.info["info"])["runtimeSpec"]
    return spec


@dataclass(frozen=True)
class RunningContainer:
    sandbox_id: str
    container_id: str
    pod_config: Any


def start_container(
    runtime: api_pb2_grpc.RuntimeServiceStub, sandbox_id: str, pod_config: Any, container: Any
) -> str:
    container_id: str = runtime.CreateContainer(
        api_pb2.CreateContainerRequest(pod_sandbox_id=sandbox_id, config=container, sandbox_config=pod_config),
        timeout=TIMEOUT,
    ).container_id
    runtime.StartContainer(api_pb2.StartContainerRequest(container_id=container_id), timeout=TIMEOUT)
    return container_id


def remove_pod(runtime: api_pb2_grpc.RuntimeServiceStub, sandbox_id: str, container_ids: Sequence[str] = ()) -> None:
    """Stop and remove the pod; ``container_ids`` first, one by one, as kubelet does (each stop then has a call of its own)."""
    for container_id in container_ids:
        runtime.StopContainer(api_pb2.StopContainerRequest(container_id=container_id, timeout=0), timeout=TIMEOUT)
        runtime.RemoveContainer(api_pb2.RemoveContainerRequest(container_id=container_id), timeout=TIMEOUT)
    runtime.StopPodSandbox(api_pb2.StopPodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=TIMEOUT)
    runtime.RemovePodSandbox(api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=TIMEOUT)


@contextlib.contextmanager
def running_container(
    runtime: api_pb2_grpc.RuntimeServiceStub,
    name: str,
    logs: Path,
    command: Sequence[str] = ("sleep", "3600"),
    container_options: dict[str, Any] | None = None,
    **pod_options: Any,
) -> Iterator[RunningContainer]:
    """A pod named ``name`` with one started busybox container, removed on exit."""
    pod = pod_sandbox_config(name, log_directory=logs / name, **pod_options)
    sandbox_id = runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=pod), timeout=TIMEOUT).pod_sandbox_id
    try:
        options = {"image": BUSYBOX_REF, **(container_options or {})}
        container = container_config(name, command=list(command), log_path=f"{name}.log", **options)
        yield RunningContainer(sandbox_id, start_container(runtime, sandbox_id, pod, container), pod)
    finally:
        remove_pod(runtime, sandbox_id)
