"""Docker mode against a real private dockerd: the docker CLI and cri-dockerd-style creates through koordrp."""

import hashlib
import io
import json
import os
import socket
import tarfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest

from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from koordrp.hooks.messages import IMAGE_NAME_ANNOTATION
from koordrp.trouble import RETRY_CAP_SECONDS
from tests.e2e.conftest import hook_server, wait_registered
from tests.fake.hook_server import FakeHookServer, koordlet_cpuset_rule
from tests.support.dockerd import Dockerd, remove_cgroup, unix_http
from tests.support.hook_registration import register
from tests.support.images import BUSYBOX_REF, ImageSet
from tests.support.koordrp_process import KoordrpProcess, peak_rss_bytes, reset_peak_rss, rss_bytes
from tests.support.relay import UnixRelay
from tests.support.wedged import WedgedServer

API = "/v1.41"


@pytest.fixture
def proxy(dockerd: Dockerd, workdir: Path) -> Iterator[KoordrpProcess]:
    process = KoordrpProcess(workdir, dockerd.host, ["--backend-runtime-mode=Docker"])
    process.start()
    yield process
    process.stop()


def docker(dockerd: Dockerd, *args: str, host: str | None = None, input: str | None = None) -> tuple[int, str]:
    result = dockerd.docker(*args, host=host, input=input)
    return result.returncode, result.stdout


def test_cli_through_koordrp_matches_dockerd(dockerd: Dockerd, proxy: KoordrpProcess) -> None:
    through = proxy.endpoint
    same_answers = [
        ("version", "--format", "{{.Server.Version}} {{.Server.APIVersion}}"),
        ("info", "--format", "{{.CgroupDriver}} {{.Driver}} {{.Images}}"),
        ("images", "--format", "{{.Repository}}:{{.Tag}} {{.ID}}"),
        ("run", "--rm", "--network", "none", BUSYBOX_REF, "echo", "hi"),
        ("run", "--rm", "--network", "none", BUSYBOX_REF, "sh", "-c", "exit 7"),
    ]
    for command in same_answers:
        # Listings of things made in the same second come in no fixed order.
        through_code, through_out = docker(dockerd, *command, host=through)
        direct_code, direct_out = docker(dockerd, *command)
        assert (through_code, sorted(through_out.splitlines())) == (direct_code, sorted(direct_out.splitlines())), command
    assert docker(dockerd, "run", "--rm", "-i", "--network", "none", BUSYBOX_REF, "cat", host=through, input="echoed\n") == (
        0,
        "echoed\n",
    )


def test_long_running_container_through_koordrp(dockerd: Dockerd, proxy: KoordrpProcess) -> None:
    through = proxy.endpoint
    code, out = docker(
        dockerd, "run", "-d", "--network", "none", BUSYBOX_REF, "sh", "-c", "sleep 1; echo late; sleep 3600", host=through
    )
    assert code == 0
    container = out.strip()
    try:
        follow = dockerd.docker_popen("logs", "-f", container, host=through)
        assert follow.stdout is not None
        assert follow.stdout.readline() == "late\n"  # written after `logs -f` started
        follow.terminate()
        follow.wait(10)
        assert docker(dockerd, "exec", "-i", container, "cat", host=through, input="stdin\n") == (0, "stdin\n")
        assert docker(dockerd, "exec", container, "sh", "-c", "exit 5", host=through)[0] == 5
        stats = ("stats", "--no-stream", "--format", "{{.Name}} {{.ID}}", container)
        assert docker(dockerd, *stats, host=through) == docker(dockerd, *stats)
        assert docker(dockerd, *stats, host=through)[1].split()[1] == container[:12]
        inspect = ("inspect", "--format", "{{.State.Running}} {{.Config.Image}}", container)
        assert docker(dockerd, *inspect, host=through) == docker(dockerd, *inspect) == (0, f"true {BUSYBOX_REF}\n")
        assert docker(dockerd, "stop", "-t", "1", container, host=through) == (0, container + "\n")
        assert docker(dockerd, "rm", container, host=through) == (0, container + "\n")
    finally:
        dockerd.docker("rm", "-f", container)


def sandbox_body(pod: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "Image": "localhost/koordrp/pause:1",
        "Labels": {
            "io.kubernetes.docker.type": "podsandbox",
            "io.kubernetes.pod.name": pod,
            "io.kubernetes.pod.namespace": "default",
            "io.kubernetes.pod.uid": f"uid-{pod}",
            "annotation.kubernetes.io/config.source": "api",
            **(labels or {}),
        },
        "HostConfig": {"NetworkMode": "none", "CpuShares": 2},
        "SomethingNewer": {"kept": True},
    }


def container_body(pod: str, sandbox_id: str) -> dict[str, Any]:
    return {
        "Image": BUSYBOX_REF,
        "Cmd": ["sleep", "3600"],
        "Env": ["FROM_KUBELET=a=b"],
        "Labels": {
            "io.kubernetes.docker.type": "container",
            "io.kubernetes.sandbox.id": sandbox_id,
            "io.kubernetes.container.name": "app",
            "io.kubernetes.pod.name": pod,
            "io.kubernetes.pod.namespace": "default",
            "io.kubernetes.pod.uid": f"uid-{pod}",
            "annotation.io.kubernetes.container.hash": "1234",
        },
        "HostConfig": {"NetworkMode": f"container:{sandbox_id}"},
    }


def create(socket: Path, name: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    status, _, data = unix_http(
        socket, "POST", f"{API}/containers/create?name={name}", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    return status, json.loads(data or b"{}")


def post(socket: Path, path: str) -> int:
    return unix_http(socket, "POST", f"{API}{path}")[0]


def kubernetes_pod(socket: Path, pod: str, labels: dict[str, str] | None = None) -> tuple[str, str]:
    """A sandbox and one started container, made as cri-dockerd makes them."""
    status, sandbox = create(socket, f"k8s_POD_{pod}_default_uid-{pod}_0", sandbox_body(pod, labels))
    assert status == 201, sandbox
    assert post(socket, f"/containers/{sandbox['Id']}/start") == 204
    status, container = create(socket, f"k8s_app_{pod}_default_uid-{pod}_0", container_body(pod, sandbox["Id"]))
    assert status == 201, container
    assert post(socket, f"/containers/{container['Id']}/start") == 204
    return sandbox["Id"], container["Id"]


def test_kubernetes_creates_go_through_the_hooks(
    dockerd: Dockerd, proxy: KoordrpProcess, servers: dict[str, FakeHookServer], workdir: Path
) -> None:
    server = hook_server(servers, workdir, "tuner")
    server.behaviours["PreRunPodSandboxHook"] = lambda request: hook.PodSandboxHookResponse(cgroup_parent="/koordrp-docker-e2e")
    server.behaviours["PreCreateContainerHook"] = lambda request: hook.ContainerResourceHookResponse(
        container_envs={"KOORDRP_TEST": "1"},
        container_resources=hook.LinuxContainerResources(cpu_shares=512, cpuset_cpus="0"),
        container_annotations={IMAGE_NAME_ANNOTATION: "registry.example/other:1"},  # not the hook's to change
    )
    register(workdir / "hookserver.d", "tuner", server.path,
             ["PreRunPodSandbox", "PreCreateContainer", "PreStartContainer", "PostStopContainer"])
    wait_registered(proxy, 1)
    sandbox_id, container_id = kubernetes_pod(proxy.socket, "tuned")
    try:
        inspect = json.loads(dockerd.docker("inspect", container_id, check=True).stdout)[0]
        assert inspect["HostConfig"]["CpuShares"] == 512
        assert inspect["HostConfig"]["CpusetCpus"] == "0"
        assert inspect["HostConfig"]["CgroupParent"] == "/koordrp-docker-e2e"
        assert "KOORDRP_TEST=1" in inspect["Config"]["Env"]
        assert inspect["Config"]["Env"].index("FROM_KUBELET=a=b") < inspect["Config"]["Env"].index("KOORDRP_TEST=1")
        # The hooks are shown the body's image under containerd's key; dockerd is given nothing of it.
        assert server.calls("PreCreateContainerHook")[-1].container_annotations[IMAGE_NAME_ANNOTATION] == BUSYBOX_REF
        assert (inspect["Config"]["Image"], inspect["Config"]["Labels"].get(f"annotation.{IMAGE_NAME_ANNOTATION}")) == (BUSYBOX_REF, None)
        sandbox = json.loads(dockerd.docker("inspect", sandbox_id, check=True).stdout)[0]
        assert sandbox["HostConfig"]["CgroupParent"] == "/koordrp-docker-e2e"
        env = dockerd.docker("exec", container_id, "env", check=True).stdout.split()
        assert "KOORDRP_TEST=1" in env
        cpus = dockerd.docker("exec", container_id, "cat", "/sys/fs/cgroup/cpuset/cpuset.cpus", check=True).stdout
        assert cpus.strip() == "0"
        started = server.calls("PreStartContainerHook")[-1]
        assert (started.pod_meta.name, started.container_meta.name) == ("tuned", "app")
        assert started.container_annotations[IMAGE_NAME_ANNOTATION] == BUSYBOX_REF
        # Hooks are shown what kubelet asked (no CPU shares), not what PreCreateContainer made of it.
        assert started.container_resources.cpu_shares == 0 and "KOORDRP_TEST" not in started.container_envs
        assert post(proxy.socket, f"/containers/{container_id}/stop?t=1") == 204
        server.rpcs_once(4)
        stopped = server.calls("PostStopContainerHook")[-1]
        assert stopped.container_meta.id == container_id and stopped.pod_cgroup_parent == "/koordrp-docker-e2e"
        calls = [line for line in proxy.log().splitlines() if "[koordrp.calls#info]" in line]
        assert any(f"POST {API}/containers/create pod default/tuned" in line and "container app: 201" in line
                   and "PreCreateContainer@tuner.json" in line for line in calls), calls
    finally:
        dockerd.docker("rm", "-f", container_id, sandbox_id)
        remove_cgroup("/koordrp-docker-e2e")


def test_a_koordlet_like_answer_clears_the_cpuset_and_a_repeated_stop_calls_no_hook(
    dockerd: Dockerd, proxy: KoordrpProcess, servers: dict[str, FakeHookServer], workdir: Path
) -> None:
    server = hook_server(servers, workdir, "koordlet")
    server.behaviours["PreCreateContainerHook"] = koordlet_cpuset_rule
    register(workdir / "hookserver.d", "koordlet", server.path, ["PreCreateContainer", "PostStopContainer"])
    wait_registered(proxy, 1)
    parent = "/koordrp-docker-besteffort"
    sandbox = sandbox_body("be")
    sandbox["HostConfig"]["CgroupParent"] = parent
    status, created = create(proxy.socket, "k8s_POD_be_default_uid-be_0", sandbox)
    assert status == 201, created
    sandbox_id = created["Id"]
    container_id = ""
    try:
        assert post(proxy.socket, f"/containers/{sandbox_id}/start") == 204
        body = container_body("be", sandbox_id)
        body["HostConfig"].update({"CgroupParent": parent, "CpusetCpus": "0"})
        status, created = create(proxy.socket, "k8s_app_be_default_uid-be_0", body)
        assert status == 201, created
        container_id = created["Id"]
        inspect = json.loads(dockerd.docker("inspect", container_id, check=True).stdout)[0]
        assert inspect["HostConfig"]["CpusetCpus"] == ""
        assert [request.container_resources.cpuset_cpus for request in server.calls()] == ["0"]
        assert post(proxy.socket, f"/containers/{container_id}/start") == 204
        assert post(proxy.socket, f"/containers/{container_id}/stop?t=0") == 204
        assert post(proxy.socket, f"/containers/{container_id}/stop?t=0") == 304
        [first, repeated] = proxy.log_lines(f"/containers/{container_id}/stop pod default/be", count=2)
        assert "PostStopContainer@koordlet.json: sent" in first and repeated.endswith("hooks: none"), (first, repeated)
        assert server.rpcs_once(2) == ["PreCreateContainerHook", "PostStopContainerHook"]
    finally:
        dockerd.docker("rm", "-f", *[identifier for identifier in (container_id, sandbox_id) if identifier])
        remove_cgroup(parent)


def test_non_kubernetes_containers_and_skipped_pods_get_no_hooks(
    dockerd: Dockerd, proxy: KoordrpProcess, servers: dict[str, FakeHookServer], workdir: Path
) -> None:
    server = hook_server(servers, workdir, "watcher")
    register(workdir / "hookserver.d", "watcher", server.path,
             ["PreRunPodSandbox", "PreCreateContainer", "PreStartContainer", "PostStopContainer"])
    wait_registered(proxy, 1)
    assert docker(dockerd, "run", "--rm", "--network", "none", BUSYBOX_REF, "true", host=proxy.endpoint)[0] == 0
    ids = kubernetes_pod(proxy.socket, "skipped", {"runtimeproxy.koordinator.sh/skip-hookserver": "true"})
    dockerd.docker("rm", "-f", *ids)
    assert server.rpcs() == []


@pytest.mark.parametrize("policy", ["Fail", "Ignore"])
def test_failure_policies(
    policy: str, dockerd: Dockerd, proxy: KoordrpProcess, servers: dict[str, FakeHookServer], workdir: Path
) -> None:
    broken = hook_server(servers, workdir, "broken")
    broken.failures["PreCreateContainerHook"] = grpc.StatusCode.INTERNAL
    register(workdir / "hookserver.d", "broken", broken.path, ["PreCreateContainer"], policy=policy)
    wait_registered(proxy, 1)
    status, sandbox = create(proxy.socket, "k8s_POD_p_default_uid-p_0", sandbox_body("p"))
    try:
        status, container = create(proxy.socket, "k8s_app_p_default_uid-p_0", container_body("p", sandbox["Id"]))
        if policy == "Fail":
            assert status == 500 and "broken.json" in container["message"]
        else:
            assert status == 201
    finally:
        dockerd.docker("rm", "-f", "k8s_app_p_default_uid-p_0", sandbox["Id"])


def test_restarted_koordrp_knows_the_pods(
    dockerd: Dockerd, servers: dict[str, FakeHookServer], workdir: Path
) -> None:
    server = hook_server(servers, workdir, "memory")
    server.behaviours["PreCreateContainerHook"] = lambda request: hook.ContainerResourceHookResponse(
        container_envs={"TUNED": "1"}
    )
    register(workdir / "hookserver.d", "memory", server.path, ["PreCreateContainer", "PreStartContainer", "PostStopContainer"])
    first = KoordrpProcess(workdir, dockerd.host, ["--backend-runtime-mode=Docker"])
    first.start()
    try:
        first.wait_for_servers(1)
        sandbox_id, container_id = kubernetes_pod(first.socket, "remembered")
        before = server.calls("PreStartContainerHook")[-1]
        assert first.terminate() == 0
        second = KoordrpProcess(workdir, dockerd.host, ["--backend-runtime-mode=Docker"])
        second.start()
        try:
            deadline = time.monotonic() + 5
            while "store rebuilt from dockerd" not in second.log():
                assert time.monotonic() < deadline, second.log()
                time.sleep(0.05)
            assert post(second.socket, f"/containers/{container_id}/stop?t=1") == 204
            server.rpcs_once(3)
        finally:
            second.stop()
    finally:
        first.stop()
        dockerd.docker("rm", "-f", container_id, sandbox_id)
    after = server.calls("PostStopContainerHook")[-1]
    assert (after.pod_meta.name, after.pod_meta.uid, after.container_meta.name) == (
        before.pod_meta.name, before.pod_meta.uid, before.container_meta.name
    )
    # What kubelet asked came back from koordrp's state directory: not the hook's TUNED, nor the
    # image's environment dockerd's inspect would add.
    assert dict(after.container_envs) == dict(before.container_envs) == {"FROM_KUBELET": "a=b"}
    # dockerd's inspect merges the image's own labels into the container's: read back, they show up too.
    assert dict(after.pod_labels).items() >= dict(before.pod_labels).items()


def big_image_archive(directory: Path, megabytes: int) -> Path:
    """A docker-archive whose one layer is ``megabytes`` of incompressible data."""
    payload = os.urandom(megabytes << 20)
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        info = tarfile.TarInfo("blob")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    layer_bytes = layer.getvalue()
    diff_id = "sha256:" + hashlib.sha256(layer_bytes).hexdigest()
    config = json.dumps(
        {"architecture": "amd64", "os": "linux", "config": {}, "rootfs": {"type": "layers", "diff_ids": [diff_id]}}
    ).encode()
    archive = directory / "big.tar"
    with tarfile.open(archive, mode="w") as tar:
        for name, data in (
            ("layer.tar", layer_bytes),
            ("config.json", config),
            ("manifest.json", json.dumps([{"Config": "config.json", "RepoTags": ["localhost/koordrp/big:1"], "Layers": ["layer.tar"]}]).encode()),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return archive


def test_big_transfers_stream_through_without_growing_koordrp(
    dockerd: Dockerd, proxy: KoordrpProcess, workdir: Path
) -> None:
    before = rss_bytes(proxy.pid)
    archive = big_image_archive(workdir, 200)
    loaded = dockerd.docker("load", "-i", str(archive), host=proxy.endpoint, timeout=300)
    assert loaded.returncode == 0, loaded.stderr
    archive.unlink()
    after_load = rss_bytes(proxy.pid)
    code, out = docker(
        dockerd, "run", "-d", "--network", "none", BUSYBOX_REF, "sh", "-c",
        "head -c 52428800 /dev/zero | tr '\\0' 'x' | fold -w 1023; sleep 3600",
        host=proxy.endpoint,
    )
    container = out.strip()
    try:
        follow = dockerd.docker_popen("logs", "-f", container, host=proxy.endpoint)
        assert follow.stdout is not None
        received = 0
        while received < 50 << 20:
            line = follow.stdout.readline()
            assert line, "the log stream ended early"
            received += len(line)
        follow.terminate()
        follow.wait(10)
        after_logs = rss_bytes(proxy.pid)
    finally:
        dockerd.docker("rm", "-f", container)
        dockerd.docker("rmi", "localhost/koordrp/big:1")
    assert after_load - before < 20 << 20, (before, after_load)
    assert after_logs - before < 20 << 20, (before, after_logs)


def test_a_48_mb_chunk_in_a_create_is_refused_without_growing_koordrp(dockerd: Dockerd, proxy: KoordrpProcess) -> None:
    """A client that writes its whole chunked body before reading gets koordrp's 413 all the same."""
    size = 48_000_000
    reset_peak_rss(proxy.pid)
    before = rss_bytes(proxy.pid)
    client = socket.socket(socket.AF_UNIX)
    client.connect(str(proxy.socket))
    try:
        client.sendall(
            f"POST {API}/containers/create?name=huge HTTP/1.1\r\nHost: docker\r\nContent-Type: application/json\r\n"
            f"Transfer-Encoding: chunked\r\n\r\n{size:x}\r\n".encode()
        )
        part = b"x" * 1_000_000
        for _ in range(size // len(part)):
            client.sendall(part)
        client.sendall(b"\r\n0\r\n\r\n")
        received = b""
        while data := client.recv(65536):
            received += data
    finally:
        client.close()
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 "), received[:300]
    assert json.loads(body) == {"message": "koordrp: body larger than 1 MiB"}
    grown = peak_rss_bytes(proxy.pid) - before
    assert grown < 16 << 20, grown
    assert docker(dockerd, "ps", "-a", "--filter", "name=huge", "--format", "{{.ID}}") == (0, "")


INFO_FAILS = (
    b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\nContent-Length: 30\r\n\r\n"
    b'{"message": "info is broken"}\n'
)


def test_a_failing_info_leaves_cgroup_parents_alone_until_dockerd_names_its_driver(
    dockerd: Dockerd, servers: dict[str, FakeHookServer], workdir: Path
) -> None:
    info_fails = [True]
    relay = UnixRelay(str(workdir / "dockerd.sock"), str(dockerd.socket))
    relay.answer = lambda first: INFO_FAILS if info_fails[0] and first.startswith(b"GET /info ") else None
    relay.start()
    proxy = KoordrpProcess(workdir, f"unix://{relay.listen_path}", ["--backend-runtime-mode=Docker"])
    parent = dockerd.cgroup_parent + "/moved"
    ids: list[str] = []
    try:
        proxy.start()
        server = hook_server(servers, workdir, "mover")
        server.behaviours["PreRunPodSandboxHook"] = lambda request: hook.PodSandboxHookResponse(
            cgroup_parent=parent, labels={"moved": "yes"}
        )
        register(workdir / "hookserver.d", "mover", server.path, ["PreRunPodSandbox"])
        wait_registered(proxy, 1)
        [warning] = proxy.log_lines("cannot read dockerd's cgroup driver")
        assert "GET /info: dockerd answered 500: info is broken" in warning, warning

        status, created = create(proxy.socket, "k8s_POD_first_default_uid-first_0", sandbox_body("first"))
        assert status == 201, created
        ids.append(created["Id"])
        inspect = json.loads(dockerd.docker("inspect", created["Id"], check=True).stdout)[0]
        # dockerd's own path for the cgroup parent (the client sent none), every other change made.
        assert (inspect["HostConfig"]["CgroupParent"], inspect["Config"]["Labels"]["moved"]) == ("", "yes")
        [line] = proxy.log_lines("/containers/create pod default/first")
        assert (
            "left alone (dockerd's cgroup driver is not known: GET /info failed) "
            f'cgroup_parent ""→"{parent}"' in line
        ), line

        info_fails[0] = False
        # Asked again as the back-off says: within its cap.
        assert proxy.log_lines("dockerd's cgroup driver is cgroupfs again", timeout=RETRY_CAP_SECONDS + 10)
        status, created = create(proxy.socket, "k8s_POD_second_default_uid-second_0", sandbox_body("second"))
        assert status == 201, created
        ids.append(created["Id"])
        inspect = json.loads(dockerd.docker("inspect", created["Id"], check=True).stdout)[0]
        assert inspect["HostConfig"]["CgroupParent"] == parent
        assert "Traceback" not in proxy.log()
        assert len(proxy.log_lines("cannot read dockerd's cgroup driver")) == 1
    finally:
        proxy.stop()
        relay.cut()
        if ids:
            dockerd.docker("rm", "-f", *ids)
        remove_cgroup(parent)


def test_dockerd_away_then_back(images: ImageSet, workdir: Path) -> None:
    late = Dockerd(workdir / "late")
    proxy = KoordrpProcess(workdir, late.host, ["--backend-runtime-mode=Docker"])
    proxy.start()
    try:
        result = late.docker("version", "--format", "{{.Server.Version}}", host=proxy.endpoint)
        assert result.returncode != 0
        assert f"backend {late.host} is unavailable" in result.stderr
        late.start()
        assert late.docker("version", "--format", "{{.Server.Version}}", host=proxy.endpoint).returncode == 0
        deadline = time.monotonic() + 5
        while "store rebuilt from dockerd" not in proxy.log():
            assert time.monotonic() < deadline, proxy.log()
            time.sleep(0.05)
    finally:
        proxy.stop()
        late.stop()


def test_attach_through_koordrp_matches_dockerd(dockerd: Dockerd, proxy: KoordrpProcess) -> None:
    outputs = []
    for host in (proxy.endpoint, None):
        code, out = docker(
            dockerd, "run", "-d", "--network", "none", BUSYBOX_REF, "sh", "-c", "sleep 1; echo attached; exit 3"
        )
        container = out.strip()
        try:
            attached = dockerd.docker("attach", container, host=host)
            outputs.append((attached.returncode, attached.stdout))
        finally:
            dockerd.docker("rm", "-f", container)
    assert outputs[0] == outputs[1] == (3, "attached\n")


@dataclass
class WatchedPod:
    """koordrp in front of dockerd through a relay, a PostStopContainer watcher registered, one pod made."""

    relay: UnixRelay
    proxy: KoordrpProcess
    watcher: FakeHookServer
    container_id: str


@contextmanager
def watched_pod(dockerd: Dockerd, servers: dict[str, FakeHookServer], workdir: Path, pod: str) -> Iterator[WatchedPod]:
    relay = UnixRelay(str(workdir / "dockerd.sock"), str(dockerd.socket)).start()
    proxy = KoordrpProcess(workdir, f"unix://{relay.listen_path}", ["--backend-runtime-mode=Docker"])
    proxy.start()
    ids: tuple[str, ...] = ()
    try:
        watcher = hook_server(servers, workdir, "watcher")
        register(workdir / "hookserver.d", "watcher", watcher.path, ["PostStopContainer"])
        wait_registered(proxy, 1)
        ids = _, container_id = kubernetes_pod(proxy.socket, pod)
        yield WatchedPod(relay, proxy, watcher, container_id)
    finally:
        proxy.stop()
        relay.cut()
        if ids:
            dockerd.docker("rm", "-f", *ids)


def test_a_stop_the_client_gives_up_on_drops_koordrps_exchange_with_dockerd_and_owes_no_post_stop(
    dockerd: Dockerd, servers: dict[str, FakeHookServer], workdir: Path
) -> None:
    with watched_pod(dockerd, servers, workdir, "stubborn") as watched:
        proxy, container_id = watched.proxy, watched.container_id
        # A bare sleep as PID 1 ignores SIGTERM: dockerd waits 3 s before SIGKILL.
        client = socket.socket(socket.AF_UNIX)
        client.connect(str(proxy.socket))
        client.sendall(f"POST {API}/containers/{container_id}/stop?t=3 HTTP/1.1\r\nHost: docker\r\n\r\n".encode())
        stopping = watched.relay.relayed_with(f"/containers/{container_id}/stop".encode())
        client.close()
        # Closed before dockerd answered: dockerd takes its 3 s over the stop.
        assert stopping.closed.wait(30)
        assert stopping.answer_when_closed == b""
        [line] = proxy.log_lines(f"/containers/{container_id}/stop pod default/stubborn (uid-stubborn) container app: CANCELLED")
        assert "hooks: none" in line, line
        # dockerd 20.10 stops it all the same, after its 3 s; koordrp's question came before: nothing owed yet.
        assert watched.watcher.rpcs() == []
        dockerd.docker("wait", container_id, check=True)
        # cri-dockerd's next stop finds it stopped (304): that one owes the PostStopContainer, once.
        assert post(proxy.socket, f"/containers/{container_id}/stop?t=0") == 304
        assert post(proxy.socket, f"/containers/{container_id}/stop?t=0") == 304
        assert watched.watcher.rpcs_once(1) == ["PostStopContainerHook"]


def read_to_the_end(client: socket.socket) -> bytes:
    received = b""
    while data := client.recv(65536):
        received += data
    return received


def test_sigterm_answers_a_stop_in_flight_and_its_post_stop_then_closes_streams(
    dockerd: Dockerd, servers: dict[str, FakeHookServer], workdir: Path
) -> None:
    clients = socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)
    with watched_pod(dockerd, servers, workdir, "draining") as watched, clients[0] as events, clients[1] as stop:
        proxy, container_id = watched.proxy, watched.container_id
        for client in (events, stop):
            client.settimeout(60)  # a hang fails the test instead of holding it
            client.connect(str(proxy.socket))
        # A stream dockerd begins at once and never ends.
        events.sendall(f"GET {API}/events HTTP/1.1\r\nHost: docker\r\n\r\n".encode())
        assert events.recv(65536).startswith(b"HTTP/1.1 200 OK")
        # A bare sleep as PID 1 ignores SIGTERM: dockerd takes the stop's 3 s, within koordrp's grace of 10 s.
        stop.sendall(f"POST {API}/containers/{container_id}/stop?t=3 HTTP/1.1\r\nHost: docker\r\n\r\n".encode())
        watched.relay.relayed_with(f"/containers/{container_id}/stop".encode(), timeout=30)
        assert proxy.terminate() == 0
        assert read_to_the_end(stop).startswith(b"HTTP/1.1 204")
        # Drained before koordrp exited.
        assert watched.watcher.rpcs() == ["PostStopContainerHook"]
        [waited] = proxy.log_lines("Docker call(s) in flight")
        assert "stopping: 1 Docker call(s) in flight get up to" in waited, waited  # the stream is none
        assert "cut at the stop's bound" not in proxy.log()
        read_to_the_end(events)  # closed once the stop was over


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_clients_that_go_away_take_their_connections_to_a_wedged_dockerd_along(workdir: Path) -> None:
    """cri-dockerd retrying against a wedged dockerd must not exhaust koordrp's file descriptors."""
    wedged = WedgedServer(str(workdir / "wedged.sock"))
    proxy = KoordrpProcess(workdir, f"unix://{wedged.path}", ["--backend-runtime-mode=Docker"])
    proxy.start()
    try:
        # koordrp's own questions, at most: its listing and /info (each bounded, then asked again).
        assert wedged.wait_for(lambda: wedged.open_connections <= 2, 5)
        before = open_fds(proxy.pid)
        requests = [
            f"GET {API}/containers/json HTTP/1.1\r\nHost: docker\r\n\r\n",  # passed through
            f"POST {API}/exec/abc/start HTTP/1.1\r\nHost: docker\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n"
            "Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",  # hijacked
            f"POST {API}/containers/abc/start HTTP/1.1\r\nHost: docker\r\nContent-Length: 0\r\n\r\n",  # intercepted
        ]
        clients = []
        for index in range(40):
            client = socket.socket(socket.AF_UNIX)
            client.connect(str(proxy.socket))
            client.sendall(requests[index % len(requests)].encode())
            clients.append(client)
        assert wedged.wait_for(lambda: wedged.accepted >= 40, 10), wedged.accepted
        for client in clients:
            client.close()
        assert wedged.wait_for(lambda: wedged.open_connections <= 2 and open_fds(proxy.pid) <= before + 2, 30), (
            wedged.open_connections,
            open_fds(proxy.pid) - before,
        )
    finally:
        proxy.stop()
        wedged.stop()
