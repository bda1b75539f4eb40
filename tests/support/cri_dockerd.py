"""The Docker Engine API calls cri-dockerd makes for a pod's life, against any Docker socket.

cri-dockerd lays a pod out as a pause container (the sandbox) and one container per Kubernetes
container, each named ``k8s_<container>_<pod>_<namespace>_<uid>_<attempt>`` and labelled so that
koordrp (and cri-dockerd itself, when it lists) can tell which is which (``koordrp/docker/translate.py``).
"""

import http.client
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from koordrp.docker.translate import (
    CONTAINER_NAME_LABEL,
    CONTAINER_TYPE,
    SANDBOX_ID_LABEL,
    SANDBOX_TYPE,
    TYPE_LABEL,
)
from tests.support.dockerd import unix_http
from tests.support.images import BUSYBOX_REF, PAUSE_REF

API = "/v1.41"
NAMESPACE = "default"
CALL_TIMEOUT = 120.0
"""Longer than a hook's longest wait (60 s): cri-dockerd's calls to dockerd carry no deadline."""


class DockerCallFailed(Exception):
    """dockerd (or koordrp in front of it) answered with a status the call does not expect."""


FAILURES: tuple[type[Exception], ...] = (DockerCallFailed, OSError, http.client.HTTPException)
"""What a call here raises when it fails: an unexpected status, the socket, or HTTP itself."""


@dataclass(frozen=True)
class KubernetesPod:
    """Who a pod is, as cri-dockerd names its containers."""

    name: str
    uid: str

    def labels(self, kind: str) -> dict[str, str]:
        return {
            TYPE_LABEL: kind,
            "io.kubernetes.pod.name": self.name,
            "io.kubernetes.pod.namespace": NAMESPACE,
            "io.kubernetes.pod.uid": self.uid,
        }

    def docker_name(self, container: str) -> str:
        return f"k8s_{container}_{self.name}_{NAMESPACE}_{self.uid}_0"


def sandbox_body(pod: KubernetesPod) -> dict[str, Any]:
    return {
        "Image": PAUSE_REF,
        "Labels": {**pod.labels(SANDBOX_TYPE), CONTAINER_NAME_LABEL: "POD"},
        "HostConfig": {"NetworkMode": "none"},
    }


def container_body(pod: KubernetesPod, sandbox_id: str, container: str, command: list[str]) -> dict[str, Any]:
    return {
        "Image": BUSYBOX_REF,
        "Cmd": command,
        "Env": [f"POD_NAME={pod.name}"],
        "Labels": {
            **pod.labels(CONTAINER_TYPE),
            SANDBOX_ID_LABEL: sandbox_id,
            CONTAINER_NAME_LABEL: container,
        },
        "HostConfig": {"NetworkMode": f"container:{sandbox_id}"},
    }


def call(socket: Path, method: str, path: str, expected: tuple[int, ...], body: Any = None) -> tuple[int, Any]:
    """One Engine API call on a fresh connection: its status and JSON answer (None if empty).

    DockerCallFailed: the status is not one of ``expected``."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if body is not None else {}
    status, _, answer = unix_http(socket, method, f"{API}{path}", data, headers, timeout=CALL_TIMEOUT)
    if status not in expected:
        raise DockerCallFailed(f"{method} {path}: {status} {answer.decode(errors='replace').strip()}")
    return status, json.loads(answer) if answer else None


def create(socket: Path, name: str, body: dict[str, Any]) -> str:
    """POST /containers/create; the new container's id."""
    return str(call(socket, "POST", f"/containers/create?name={name}", (201,), body)[1]["Id"])


def start(socket: Path, container_id: str) -> int:
    return call(socket, "POST", f"/containers/{container_id}/start", (204, 304))[0]


def stop(socket: Path, container_id: str) -> int:
    """At once (t=0): a bare ``sleep`` as PID 1 ignores SIGTERM and would hold the stop for 10 s."""
    return call(socket, "POST", f"/containers/{container_id}/stop?t=0", (204, 304))[0]


def remove(socket: Path, container_id: str) -> int:
    """As cri-dockerd removes (its volumes too, and running or not), and as ``docker rm -f`` does."""
    return call(socket, "DELETE", f"/containers/{container_id}?v=1&force=1", (204, 404))[0]


def kubernetes_containers(socket: Path) -> list[dict[str, Any]]:
    """Every container dockerd has that cri-dockerd made (sandboxes and containers), as GET /containers/json lists them."""
    listed: list[dict[str, Any]] = call(
        socket, "GET", '/containers/json?all=1&filters={"label":["io.kubernetes.docker.type"]}', (200,)
    )[1]
    return listed
