"""What koordrp remembers stays true, in every mode: its store follows pods removed behind its back
(``--reconcile-interval``), its size is on /metrics, and a state file it cannot read is said.

CRI mode on containerd, NRI mode on containerd 1.7 and 2.1, Docker mode on dockerd. Each test waits
for what it expects (with a generous timeout), never for a time.
"""

import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from cri_api.v1 import api_pb2

from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from tests.e2e.conftest import hook_server, wait_registered
from tests.e2e.test_docker import kubernetes_pod, post
from tests.support.scrape import free_port, get, sample
from tests.fake.hook_server import FakeHookServer
from tests.support.containerd import Containerd
from tests.support.dockerd import Dockerd
from tests.support.hook_registration import register
from tests.support.koordrp_process import KoordrpProcess
from tests.support.pods import TIMEOUT, remove_pod, running_container, start_container
from tests.support.cri_objects import container_config, pod_sandbox_config
from tests.support.images import BUSYBOX_REF

INTERVAL = "--reconcile-interval=5"
WAIT = 120.0
"""How long a test waits for what it expects before it fails: generous, for a loaded machine."""

CREATE = "PreCreateContainerHook"


def until(found: Callable[[], Any], what: str, log: Callable[[], str]) -> Any:
    """``found()``, once it is true; a failure naming ``what`` (with koordrp's log) if it never is."""
    deadline = time.monotonic() + WAIT
    while not (result := found()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {WAIT:g}s:\n{log()}")
        time.sleep(0.1)
    return result


class Observed:
    """koordrp as a real process, with its /metrics."""

    def __init__(self, workdir: Path, runtime_endpoint: str, *args: str, nri_socket: Path | None = None) -> None:
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        self.process = KoordrpProcess(
            workdir, runtime_endpoint, [f"--metrics-endpoint=tcp:{port}:interface=127.0.0.1", *args], nri_socket=nri_socket
        )

    def start(self, rebuilt: str) -> None:
        """Start it, and wait until its store agrees with the runtime (``rebuilt``: the line that says so)."""
        earlier = len(self.process.log())
        self.process.start()
        until(lambda: rebuilt in self.process.log()[earlier:], f"{rebuilt!r}", self.process.log)

    def metric(self, name: str) -> float:
        status, text = get(f"{self.base}/metrics")
        assert status == 200, text
        return sample(text, name)

    def store(self) -> tuple[float, float]:
        return self.metric("koordrp_store_pods"), self.metric("koordrp_store_containers")

    def store_becomes(self, expected: tuple[float, float]) -> None:
        until(lambda: self.store() == expected, f"the store gauges becoming {expected} (now {self.store()})", self.process.log)


@pytest.fixture
def cri_proxy(containerd: Containerd, workdir: Path) -> Iterator[Observed]:
    observed = Observed(workdir, containerd.endpoint, INTERVAL)
    observed.start("store rebuilt from the runtime")
    yield observed
    observed.process.stop()


@pytest.fixture
def nri_plugin(nri_containerd: Containerd, workdir: Path) -> Iterator[Observed]:
    observed = Observed(workdir, nri_containerd.endpoint, INTERVAL, nri_socket=nri_containerd.paths.nri_socket)
    observed.start("store rebuilt from containerd's NRI")
    yield observed
    observed.process.stop()


@pytest.fixture
def docker_proxy(dockerd: Dockerd, workdir: Path) -> Iterator[Observed]:
    observed = Observed(workdir, dockerd.host, "--backend-runtime-mode=Docker", INTERVAL)
    observed.start("store rebuilt from dockerd")
    yield observed
    observed.process.stop()


def forgotten(observed: Observed, lines: str) -> int:
    """How many pods and containers the log ``lines`` say the store forgot."""
    told = observed.process.log_lines(lines)
    return sum(int(line.rsplit(" learnt, ", 1)[1].split(" forgotten", 1)[0]) for line in told)


def pods(runtime: Any, workdir: Path, name: str, count: int = 5) -> list[str]:
    """``count`` pods with a started container each, made through ``runtime``; their sandbox ids."""
    sandbox_ids = []
    for index in range(count):
        pod = pod_sandbox_config(f"{name}-{index}", log_directory=workdir / f"{name}-{index}")
        sandbox_id = runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=pod), timeout=TIMEOUT).pod_sandbox_id
        sandbox_ids.append(sandbox_id)
        start_container(runtime, sandbox_id, pod, container_config("app", image=BUSYBOX_REF, command=["sleep", "3600"]))
    return sandbox_ids


# ---------------------------------------------------------------------------------------------
# The store follows the runtime


def test_cri_mode_forgets_pods_removed_on_containerd_itself(
    cri_proxy: Observed, containerd: Containerd, workdir: Path
) -> None:
    known_pods, known_containers = cri_proxy.store()
    direct = containerd.runtime()
    with cri_proxy.process.channel() as channel:
        sandbox_ids = pods(cri_proxy.process.runtime(channel), workdir, "counted")
    try:
        assert cri_proxy.store() == (known_pods + 5, known_containers + 5)
        for sandbox_id in sandbox_ids[:3]:  # an operator's crictl rmp, on containerd's own socket
            remove_pod(direct, sandbox_id)
        cri_proxy.store_becomes((known_pods + 2, known_containers + 2))
        assert forgotten(cri_proxy, "store reconciled with the runtime: ") == 6
    finally:
        for sandbox_id in sandbox_ids[3:]:
            remove_pod(direct, sandbox_id)
    cri_proxy.store_becomes((known_pods, known_containers))


def test_nri_mode_forgets_a_pod_containerd_removes_by_nri_alone(
    nri_plugin: Observed, nri_containerd: Containerd, workdir: Path
) -> None:
    """koordrp is given no socket of containerd's but NRI's: containerd's events tell of the removal."""
    assert not any(arg.startswith("--remote-runtime-service-endpoint") for arg in nri_plugin.process.argv())
    runtime = nri_containerd.runtime()
    known_pods, known_containers = nri_plugin.store()
    sandbox_ids = pods(runtime, workdir, "removed", count=2)
    nri_plugin.store_becomes((known_pods + 2, known_containers + 2))
    for sandbox_id in sandbox_ids:
        remove_pod(runtime, sandbox_id)
    nri_plugin.store_becomes((known_pods, known_containers))
    assert "is not used in NRI mode" not in nri_plugin.process.log()


def test_nri_mode_forgets_what_containerd_removes_without_telling_its_plugins(
    nri_plugin: Observed, nri_containerd: Containerd, workdir: Path
) -> None:
    """containerd (1.7 and 2.1) does not tell its plugins of the removal of a pod it made before it
    restarted: koordrp's listing by NRI does."""
    runtime = nri_containerd.runtime()
    known_pods, known_containers = nri_plugin.store()
    sandbox_ids = pods(runtime, workdir, "counted")
    try:
        nri_plugin.store_becomes((known_pods + 5, known_containers + 5))
        log = nri_plugin.process.log
        synchronized = log().count("store rebuilt from containerd's NRI")
        nri_containerd.restart()
        until(lambda: log().count("store rebuilt from containerd's NRI") > synchronized, "a new synchronization", log)
        runtime = nri_containerd.runtime()
        for sandbox_id in sandbox_ids[:3]:
            remove_pod(runtime, sandbox_id)
        nri_plugin.store_becomes((known_pods + 2, known_containers + 2))
        assert forgotten(nri_plugin, "store reconciled with containerd's NRI: ") == 3  # the pods; NRI told of their containers
    finally:
        for sandbox_id in sandbox_ids[3:]:
            remove_pod(runtime, sandbox_id)
    nri_plugin.store_becomes((known_pods, known_containers))


def test_docker_mode_forgets_pods_removed_on_dockerd_itself(docker_proxy: Observed, dockerd: Dockerd) -> None:
    known_pods, known_containers = docker_proxy.store()
    made = [kubernetes_pod(docker_proxy.process.socket, f"counted-{index}") for index in range(5)]
    try:
        assert docker_proxy.store() == (known_pods + 5, known_containers + 5)
        for sandbox_id, container_id in made[:3]:
            dockerd.docker("rm", "-f", container_id, sandbox_id, check=True)
        docker_proxy.store_becomes((known_pods + 2, known_containers + 2))
        assert forgotten(docker_proxy, "store reconciled with dockerd: ") == 6
    finally:
        dockerd.docker("rm", "-f", *[identifier for pod in made[3:] for identifier in pod])
    docker_proxy.store_becomes((known_pods, known_containers))


# ---------------------------------------------------------------------------------------------
# A state file koordrp cannot read


def tuner(servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path) -> FakeHookServer:
    """A server that changes each container's environment (so its state file is kept) and hears of stops."""
    server = hook_server(servers, workdir, "tuner")
    server.behaviours[CREATE] = lambda request: hook.ContainerResourceHookResponse(container_envs={"TUNED": "1"})
    register(hooks_dir, "tuner", server.path, ["PreCreateContainer", "PostStopContainer"])
    return server


def garble(workdir: Path, container_id: str) -> Path:
    kept = workdir / "state" / "containers" / container_id
    assert kept.exists(), sorted((workdir / "state").rglob("*"))
    kept.write_bytes(b"garbled by the test: \xff\xfe not what koordrp wrote")
    return kept


def restarted_with_a_garbled_state_file(observed: Observed, container_id: str, workdir: Path, rebuilt: str) -> Path:
    """koordrp restarted after its state file for the container was garbled; the file."""
    assert observed.process.terminate() == 0
    kept = garble(workdir, container_id)
    observed.start(rebuilt)
    warning = observed.process.log_lines("cannot read what kubelet asked")
    assert len(warning) == 1 and str(kept) in warning[0], observed.process.log()
    assert f"for container {container_id}" in warning[0]
    assert observed.metric("koordrp_state_files_unreadable_total") == 1
    return kept


def stop_line_says_kubelets_values_were_lost(observed: Observed, server: FakeHookServer, text: str) -> None:
    [line] = observed.process.log_lines(text)
    assert "PostStopContainer@tuner.json: sent" in line
    lost = "kubelet's values not available (its state file could not be read): hooks were shown the runtime's"
    assert line.endswith(lost), observed.process.log()
    until(lambda: server.calls("PostStopContainerHook"), "PostStopContainer", observed.process.log)


def test_cri_mode_says_a_state_file_it_cannot_read(
    cri_proxy: Observed, containerd: Containerd, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    server = tuner(servers, workdir, hooks_dir)
    wait_registered(cri_proxy.process, 1)
    with cri_proxy.process.channel() as channel:
        [sandbox_id] = pods(cri_proxy.process.runtime(channel), workdir, "garbled", count=1)
    direct = containerd.runtime()
    try:
        [container] = direct.ListContainers(
            api_pb2.ListContainersRequest(filter=api_pb2.ContainerFilter(pod_sandbox_id=sandbox_id))
        ).containers
        restarted_with_a_garbled_state_file(cri_proxy, container.id, workdir, "store rebuilt from the runtime")
        with cri_proxy.process.channel() as channel:
            runtime = cri_proxy.process.runtime(channel)
            runtime.StopContainer(api_pb2.StopContainerRequest(container_id=container.id, timeout=0), timeout=TIMEOUT)
        stop_line_says_kubelets_values_were_lost(cri_proxy, server, "StopContainer pod default/garbled-0")
        # The hook is shown what containerd has, its own earlier answer included: the line said so.
        assert server.calls("PostStopContainerHook")[0].container_envs["TUNED"] == "1"
    finally:
        for pod in direct.ListPodSandbox(api_pb2.ListPodSandboxRequest()).items:
            if pod.metadata.name.startswith("garbled-"):
                remove_pod(direct, pod.id)


def test_nri_mode_says_a_state_file_it_cannot_read(
    nri_plugin: Observed, nri_containerd: Containerd, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    server = tuner(servers, workdir, hooks_dir)
    wait_registered(nri_plugin.process, 1)
    runtime = nri_containerd.runtime()
    with running_container(runtime, "garbled", workdir) as pod:
        restarted_with_a_garbled_state_file(nri_plugin, pod.container_id, workdir, "store rebuilt from containerd's NRI")
        wait_registered(nri_plugin.process, 1)
        runtime.StopContainer(api_pb2.StopContainerRequest(container_id=pod.container_id, timeout=0), timeout=TIMEOUT)
        stop_line_says_kubelets_values_were_lost(nri_plugin, server, "StopContainer pod default/garbled")


def test_docker_mode_says_a_state_file_it_cannot_read(
    docker_proxy: Observed, dockerd: Dockerd, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    server = tuner(servers, workdir, hooks_dir)
    wait_registered(docker_proxy.process, 1)
    sandbox_id, container_id = kubernetes_pod(docker_proxy.process.socket, "garbled")
    try:
        restarted_with_a_garbled_state_file(docker_proxy, container_id, workdir, "store rebuilt from dockerd")
        wait_registered(docker_proxy.process, 1)
        assert post(docker_proxy.process.socket, f"/containers/{container_id}/stop?t=0") == 204
        stop_line_says_kubelets_values_were_lost(docker_proxy, server, f"/containers/{container_id}/stop pod default/garbled")
    finally:
        dockerd.docker("rm", "-f", container_id, sandbox_id)
