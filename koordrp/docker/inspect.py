"""What dockerd says of a container it has (``GET /containers/{id}/json``), read back as the store keeps it.

Docker mode's counterpart of CRI mode's ``koordrp.cri.runtime_info``: when the store lacks a pod or a
container (one made before koordrp started, or at start-up), its hook request is rebuilt from dockerd's
inspect output, read with the same rules as a create body (``koordrp.docker.translate``): the labels,
environment, image and resources are under ``Config`` and ``HostConfig`` there, as created, hooks'
changes included. Nothing here does I/O; bad shapes raise ``DockerShapeError``.
"""

from typing import Any, Mapping

from koordrp.docker.translate import (
    ContainerName,
    DockerShapeError,
    Kind,
    container_request,
    env_in,
    image_in,
    kind_of_labels,
    labels_in,
    optional_object,
    pod_request,
    require_kind,
    require_object,
    sandbox_id_in,
)
from koordrp.hooks.messages import ContainerHookRequest, PodHookRequest, placed_in_pod
from koordrp.store import ContainerState, runtime_state
from koordrp.text import json_type


def kind_of_inspect(inspect: object) -> Kind | None:
    """``sandbox`` or ``container`` for what cri-dockerd made (labels under ``Config``); None for anything else."""
    if not isinstance(inspect, dict) or not isinstance(inspect.get("Config"), dict):
        return None
    return kind_of_labels(inspect["Config"].get("Labels"))


def sandbox_id_of_inspect(inspect: object) -> str:
    """The docker id of a container's sandbox (where the store keeps its pod)."""
    config = _inspect_config(require_object(inspect, "inspect"))
    return sandbox_id_in(labels_in(config, "inspect.Config"), "inspect")


def state_of_inspect(inspect: Mapping[str, Any]) -> ContainerState:
    """The state the store keeps for the container, from dockerd's ``State.Status``."""
    state = inspect.get("State")
    status = state.get("Status") if isinstance(state, dict) else None
    return runtime_state(status if isinstance(status, str) else "")


def _inspect_config(inspect: Mapping[str, Any]) -> Mapping[str, Any]:
    config = optional_object(inspect, "Config", "inspect")
    if config is None:
        raise DockerShapeError("inspect.Config is missing")
    return config


def stored_sandbox_from_inspect(inspect: object, cgroup_driver: str | None) -> PodHookRequest:
    """The pod as koordrp stored it at create, read back from dockerd (hooks' changes included)."""
    found = require_object(inspect, "inspect")
    labels = labels_in(_inspect_config(found), "inspect.Config")
    require_kind(labels, "sandbox", "inspect")
    host = optional_object(found, "HostConfig", "inspect")
    return pod_request(ContainerName(found.get("Name"), "sandbox"), labels, host, "inspect", cgroup_driver)


def stored_container_from_inspect(
    inspect: object, pod: PodHookRequest | None, cgroup_driver: str | None
) -> ContainerHookRequest:
    """The container as koordrp stored it at create, read back from dockerd, with its id.

    ``pod`` is its sandbox from the store; without it the pod's name, namespace and uid come from
    the container's name and its cgroup parent from its HostConfig. Config.Env is the environment
    dockerd runs, so it includes the image's ENV besides what kubelet and hooks set.
    """
    found = require_object(inspect, "inspect")
    config = _inspect_config(found)
    labels = labels_in(config, "inspect.Config")
    require_kind(labels, "container", "inspect")
    container_id = found.get("Id")
    if not isinstance(container_id, str) or not container_id:
        raise DockerShapeError(f"inspect.Id is {json_type(container_id)}, not a container id")
    host = optional_object(found, "HostConfig", "inspect")
    env = env_in(config, "inspect.Config")
    image = image_in(config, "inspect.Config")
    name = ContainerName(found.get("Name"), "container")
    container = container_request(name, labels, env, image, host, "inspect", cgroup_driver)
    container.container_meta.id = container_id
    return container if pod is None else placed_in_pod(container, pod)
