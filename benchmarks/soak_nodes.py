"""The node a soak runs on, one per mode: a runtime, koordrp beside it, and kubelet's way to them.

Each node makes and removes pods (a sandbox and CONTAINERS_PER_POD ``sleep`` containers) the way
kubelet does, through kubelet's path (koordrp's CRI socket in proxy mode, containerd's in NRI mode,
koordrp's Docker socket as cri-dockerd would in Docker mode), removes pods behind koordrp's back
(on the runtime directly, as an operator's ``crictl rmp -f`` or ``docker rm -f`` does), replays
kubelet's relisting, and counts what the runtime itself holds.

    proxy   containerd 2.1, koordrp in front of it (Containerd mode)
    nri     containerd 2.1 with NRI, koordrp its plugin: kubelet's calls go to containerd, and so
            does a removal "behind koordrp's back" (containerd tells koordrp of it all the same:
            what differs is its shape, a running pod removed whole, never stopped container by container)
    docker  a private dockerd, koordrp in front of it (Docker mode)
"""

import contextlib
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence

import grpc
from cri_api.v1 import api_pb2

from benchmarks.soak import CONTAINERS_PER_POD, Calls, remove_pod, start_pod
from koordrp.docker.translate import CONTAINER_TYPE, SANDBOX_TYPE, TYPE_LABEL
from tests.support import cri_dockerd
from tests.support.containerd import Containerd
from tests.support.dockerd import Dockerd
from tests.support.images import build_test_images
from tests.support.koordrp_process import KoordrpProcess
from tests.support.pods import TIMEOUT
from tests.support.stack import containerd_and_koordrp

MODES = ("proxy", "nri", "docker")
CONTAINERD_RELEASE = "2.1"
COMMAND = ["sleep", "3600"]


@dataclass(frozen=True)
class Pod:
    name: str
    sandbox: str
    containers: tuple[str, ...]


class Node(Protocol):
    proxy: KoordrpProcess
    runtime_name: str
    """What runs the pods, for the report (``containerd 2.1``)."""
    failures: tuple[type[Exception], ...]
    """What its calls raise when they fail (``Calls(failures)``)."""

    def make_pod(self, name: str, calls: Calls) -> Pod | None:
        """A pod made and started through kubelet's path; None if a call failed (what was made is removed)."""

    def remove_pod(self, pod: Pod, calls: Calls) -> None:
        """Containers stopped and removed, then the sandbox, through kubelet's path, as kubelet does."""

    def remove_behind(self, pod: Pod, calls: Calls) -> None:
        """The running pod removed whole on the runtime directly."""

    def relist(self, calls: Calls) -> None:
        """kubelet's relisting (PLEG): every pod and container, through kubelet's path."""

    def held(self) -> tuple[int, int]:
        """The pods and containers the runtime holds, asked directly."""


class CRINode:
    """A containerd, pods made through ``kubelet`` (koordrp's socket or containerd's)."""

    def __init__(self, proxy: KoordrpProcess, containerd: Containerd, kubelet: Any, logs: Path) -> None:
        self.proxy = proxy
        self.runtime_name = f"containerd {containerd.release}"
        self.failures: tuple[type[Exception], ...] = (grpc.RpcError,)
        self._containerd = containerd
        self._kubelet = kubelet
        self._logs = logs

    def make_pod(self, name: str, calls: Calls) -> Pod | None:
        started = start_pod(self._kubelet, calls, name, self._logs)
        if started is None:
            self._forget_logs(name)
            return None
        sandbox, containers = started
        return Pod(name, sandbox, tuple(containers))

    def remove_pod(self, pod: Pod, calls: Calls) -> None:
        remove_pod(self._kubelet, calls, pod.sandbox, list(pod.containers))
        self._forget_logs(pod.name)

    def remove_behind(self, pod: Pod, calls: Calls) -> None:
        # crictl rmp -f: the pod stopped (its containers with it), then removed.
        direct = self._containerd.runtime()
        stop = api_pb2.StopPodSandboxRequest(pod_sandbox_id=pod.sandbox)
        calls.make("StopPodSandbox directly", lambda: direct.StopPodSandbox(stop, timeout=TIMEOUT))
        remove = api_pb2.RemovePodSandboxRequest(pod_sandbox_id=pod.sandbox)
        calls.make("RemovePodSandbox directly", lambda: direct.RemovePodSandbox(remove, timeout=TIMEOUT))
        self._forget_logs(pod.name)

    def relist(self, calls: Calls) -> None:
        kubelet = self._kubelet
        calls.make("ListPodSandbox", lambda: kubelet.ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=TIMEOUT))
        calls.make("ListContainers", lambda: kubelet.ListContainers(api_pb2.ListContainersRequest(), timeout=TIMEOUT))

    def held(self) -> tuple[int, int]:
        sandboxes, containers = self._containerd.listed_ids()
        return len(sandboxes), len(containers)

    def _forget_logs(self, name: str) -> None:
        # kubelet removes a pod's log directory with the pod; thousands of pods would leave thousands.
        shutil.rmtree(self._logs / name, ignore_errors=True)


class DockerNode:
    """A dockerd, pods made through koordrp's Docker socket with cri-dockerd's calls."""

    def __init__(self, proxy: KoordrpProcess, dockerd: Dockerd) -> None:
        self.proxy = proxy
        self.runtime_name = "dockerd"
        self.failures = cri_dockerd.FAILURES
        self._dockerd = dockerd

    def make_pod(self, name: str, calls: Calls) -> Pod | None:
        through = self.proxy.socket
        pod = cri_dockerd.KubernetesPod(name, str(uuid.uuid4()))
        sandbox = calls.make("RunPodSandbox", lambda: _run_sandbox(through, pod))
        if sandbox is None:
            return None
        containers: list[str] = []
        for index in range(CONTAINERS_PER_POD):
            body = cri_dockerd.container_body(pod, sandbox, f"c{index}", COMMAND)
            created = calls.make(
                "CreateContainer", lambda: cri_dockerd.create(through, pod.docker_name(f"c{index}"), body)
            )
            if created is None:
                break
            containers.append(created)
            if calls.make("StartContainer", lambda: cri_dockerd.start(through, created)) is None:
                break
        else:
            return Pod(name, sandbox, tuple(containers))
        self.remove_pod(Pod(name, sandbox, tuple(containers)), calls)
        return None

    def remove_pod(self, pod: Pod, calls: Calls) -> None:
        through = self.proxy.socket
        for container in pod.containers:
            calls.make("StopContainer", lambda: cri_dockerd.stop(through, container))
        for container in pod.containers:
            calls.make("RemoveContainer", lambda: cri_dockerd.remove(through, container))
        calls.make("StopPodSandbox", lambda: cri_dockerd.stop(through, pod.sandbox))
        calls.make("RemovePodSandbox", lambda: cri_dockerd.remove(through, pod.sandbox))

    def remove_behind(self, pod: Pod, calls: Calls) -> None:
        # docker rm -f of each, the sandbox last, on dockerd's own socket.
        direct = self._dockerd.socket
        for container in (*pod.containers, pod.sandbox):
            calls.make("docker rm -f directly", lambda: cri_dockerd.remove(direct, container))

    def relist(self, calls: Calls) -> None:
        # cri-dockerd answers kubelet's ListPodSandbox and ListContainers from one listing each.
        through = self.proxy.socket
        calls.make("ListPodSandbox", lambda: cri_dockerd.kubernetes_containers(through))
        calls.make("ListContainers", lambda: cri_dockerd.kubernetes_containers(through))

    def held(self) -> tuple[int, int]:
        listed = cri_dockerd.kubernetes_containers(self._dockerd.socket)
        kinds = [container["Labels"][TYPE_LABEL] for container in listed]
        return kinds.count(SANDBOX_TYPE), kinds.count(CONTAINER_TYPE)


def _run_sandbox(socket: Path, pod: cri_dockerd.KubernetesPod) -> str:
    """cri-dockerd's RunPodSandbox: the pause container created, then started."""
    sandbox = cri_dockerd.create(socket, pod.docker_name("POD"), cri_dockerd.sandbox_body(pod))
    cri_dockerd.start(socket, sandbox)
    return sandbox


@contextlib.contextmanager
def proxy_node(base: Path, koordrp_args: Sequence[str]) -> Iterator[Node]:
    with containerd_and_koordrp(base, koordrp_args, release=CONTAINERD_RELEASE) as (containerd, proxy):
        with proxy.channel() as channel:
            yield CRINode(proxy, containerd, proxy.runtime(channel), base / "logs")


@contextlib.contextmanager
def nri_node(base: Path, koordrp_args: Sequence[str]) -> Iterator[Node]:
    with containerd_and_koordrp(base, koordrp_args, nri=True, release=CONTAINERD_RELEASE) as (containerd, proxy):
        yield CRINode(proxy, containerd, containerd.runtime(), base / "logs")


@contextlib.contextmanager
def docker_node(base: Path, koordrp_args: Sequence[str]) -> Iterator[Node]:
    dockerd = Dockerd(base / "dockerd")
    dockerd.start()
    proxy = KoordrpProcess(base, dockerd.host, ["--backend-runtime-mode=Docker", *koordrp_args])
    try:
        dockerd.load_images(build_test_images(base / "images"))
        proxy.start()
        yield DockerNode(proxy, dockerd)
    finally:
        proxy.stop()
        dockerd.stop()


NODES: dict[str, Callable[[Path, Sequence[str]], contextlib.AbstractContextManager[Node]]] = {
    "proxy": proxy_node,
    "nri": nri_node,
    "docker": docker_node,
}
