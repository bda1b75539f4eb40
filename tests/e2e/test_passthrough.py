"""koordrp in front of a real containerd: every answer is the one containerd gives directly."""

import os
import signal
import socket
import stat
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import pytest
from cri_api.v1 import api_pb2, api_pb2_grpc

from tests.support.compare import normalized
from tests.support.containerd import Containerd
from tests.support.cri_objects import container_config, linux_resources, pod_sandbox_config
from tests.support.images import BUSYBOX_REF, ImageSet
from tests.support.koordrp_process import KoordrpProcess, twistd_path
from tests.support.pods import running_container
from tests.support.streaming import stream

TIMEOUT = 30


class Clients:
    def __init__(self, channel: grpc.Channel) -> None:
        self.runtime = api_pb2_grpc.RuntimeServiceStub(channel)
        self.images = api_pb2_grpc.ImageServiceStub(channel)


@pytest.fixture
def direct(containerd: Containerd) -> Clients:
    return Clients(containerd.channel())


@pytest.fixture
def proxied(koordrp: KoordrpProcess) -> Iterator[Clients]:
    channel = koordrp.channel()
    yield Clients(channel)
    channel.close()


def outcome(call: Callable[[], Any]) -> Any:
    """A call's answer, or its error as (code, details): both must match between the two paths."""
    try:
        return call()
    except grpc.RpcError as error:
        return (error.code(), error.details())


def by_id(images: Any) -> Any:
    """containerd lists images in no fixed order: compare them sorted."""
    return api_pb2.ListImagesResponse(images=sorted(images.images, key=lambda image: image.id))


def test_runtime_and_image_queries_match_direct(direct: Clients, proxied: Clients) -> None:
    queries: list[tuple[str, Callable[[Clients], Any]]] = [
        ("Version", lambda c: c.runtime.Version(api_pb2.VersionRequest(version="v1"), timeout=TIMEOUT)),
        ("Status", lambda c: c.runtime.Status(api_pb2.StatusRequest(verbose=True), timeout=TIMEOUT)),
        ("ImageFsInfo", lambda c: c.images.ImageFsInfo(api_pb2.ImageFsInfoRequest(), timeout=TIMEOUT)),
        ("ListImages", lambda c: by_id(c.images.ListImages(api_pb2.ListImagesRequest(), timeout=TIMEOUT))),
        (
            "ImageStatus",
            lambda c: c.images.ImageStatus(
                api_pb2.ImageStatusRequest(image=api_pb2.ImageSpec(image=BUSYBOX_REF), verbose=True), timeout=TIMEOUT
            ),
        ),
        (
            "PullImage",
            lambda c: c.images.PullImage(
                api_pb2.PullImageRequest(image=api_pb2.ImageSpec(image="127.0.0.1:9/koordrp/none:1")), timeout=TIMEOUT
            ),
        ),
        ("RuntimeConfig", lambda c: c.runtime.RuntimeConfig(api_pb2.RuntimeConfigRequest(), timeout=TIMEOUT)),
        ("GetContainerEvents", lambda c: list(c.runtime.GetContainerEvents(api_pb2.GetEventsRequest(), timeout=5))),
        ("ListMetricDescriptors", lambda c: c.runtime.ListMetricDescriptors(api_pb2.ListMetricDescriptorsRequest())),
    ]
    for name, query in queries:
        expected = outcome(lambda: query(direct))
        got = outcome(lambda: query(proxied))
        if isinstance(expected, tuple):
            assert got == expected, name
        else:
            assert normalized(got) == normalized(expected), name
    assert outcome(lambda: list(proxied.runtime.GetContainerEvents(api_pb2.GetEventsRequest(), timeout=5)))[0] == (
        grpc.StatusCode.UNIMPLEMENTED
    )


class PodRun:
    """One pod with one container taken through its whole life, recording every answer."""

    def __init__(self, clients: Clients, tag: str, logs: Path) -> None:
        self.clients = clients
        self.tag = tag
        self.logs = logs
        self.answers: dict[str, Any] = {}
        self.replacements: dict[str, str] = {}

    def record(self, step: str, answer: Any) -> Any:
        self.answers[step] = answer
        return answer

    def run(self) -> None:
        runtime = self.clients.runtime
        uid = str(uuid.uuid4())
        name = f"pod-{self.tag}"
        labels = {"koordrp-test": self.tag}
        pod_config = pod_sandbox_config(name, uid=uid, labels=labels, log_directory=self.logs / self.tag)
        sandbox = self.record(
            "RunPodSandbox", runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=pod_config), timeout=TIMEOUT)
        )
        self.replacements.update({sandbox.pod_sandbox_id: "<sandbox>", uid: "<uid>", self.tag: "<tag>"})
        self.record(
            "PodSandboxStatus",
            runtime.PodSandboxStatus(api_pb2.PodSandboxStatusRequest(pod_sandbox_id=sandbox.pod_sandbox_id)),
        )
        config = container_config(
            "app", image=BUSYBOX_REF, command=["sleep", "3600"], env={"MODE": "test"}, labels=labels, log_path="app.log"
        )
        created = self.record(
            "CreateContainer",
            runtime.CreateContainer(
                api_pb2.CreateContainerRequest(
                    pod_sandbox_id=sandbox.pod_sandbox_id, config=config, sandbox_config=pod_config
                ),
                timeout=TIMEOUT,
            ),
        )
        cid = created.container_id
        self.replacements[cid] = "<container>"
        self.record("StartContainer", runtime.StartContainer(api_pb2.StartContainerRequest(container_id=cid)))
        self.record(
            "ExecSync",
            runtime.ExecSync(api_pb2.ExecSyncRequest(container_id=cid, cmd=["sh", "-c", "echo $MODE"], timeout=10)),
        )
        exec_url = runtime.Exec(api_pb2.ExecRequest(container_id=cid, cmd=["echo", "hi"], stdout=True)).url
        self.record("Exec", stream(exec_url).stdout)
        self.record("ContainerStatus", runtime.ContainerStatus(api_pb2.ContainerStatusRequest(container_id=cid)))
        selector = {"koordrp-test": self.tag}
        self.record(
            "ListContainers",
            runtime.ListContainers(
                api_pb2.ListContainersRequest(filter=api_pb2.ContainerFilter(label_selector=selector))
            ),
        )
        self.record(
            "ListPodSandbox",
            runtime.ListPodSandbox(
                api_pb2.ListPodSandboxRequest(filter=api_pb2.PodSandboxFilter(label_selector=selector))
            ),
        )
        self.record("ContainerStats", runtime.ContainerStats(api_pb2.ContainerStatsRequest(container_id=cid)))
        self.record(
            "UpdateContainerResources",
            runtime.UpdateContainerResources(
                api_pb2.UpdateContainerResourcesRequest(
                    container_id=cid, linux=linux_resources(cpu_shares=256, memory_limit_in_bytes=64 << 20)
                )
            ),
        )
        updated = runtime.ContainerStatus(api_pb2.ContainerStatusRequest(container_id=cid))
        self.record("ContainerStatus after update", updated.status.resources)
        self.record("StopContainer", runtime.StopContainer(api_pb2.StopContainerRequest(container_id=cid, timeout=0)))
        self.record("RemoveContainer", runtime.RemoveContainer(api_pb2.RemoveContainerRequest(container_id=cid)))
        sid = sandbox.pod_sandbox_id
        self.record("StopPodSandbox", runtime.StopPodSandbox(api_pb2.StopPodSandboxRequest(pod_sandbox_id=sid)))
        self.record("RemovePodSandbox", runtime.RemovePodSandbox(api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sid)))

    def normalized(self, step: str) -> Any:
        answer = self.answers[step]
        return answer if isinstance(answer, bytes) else normalized(answer, self.replacements)


def test_pod_lifecycle_matches_direct(direct: Clients, proxied: Clients, workdir: Path) -> None:
    through_direct = PodRun(direct, "direct", workdir)
    through_proxy = PodRun(proxied, "proxied", workdir)
    through_direct.run()
    through_proxy.run()
    assert list(through_proxy.answers) == list(through_direct.answers)
    for step in through_direct.answers:
        assert through_proxy.normalized(step) == through_direct.normalized(step), step
    assert through_proxy.answers["Exec"] == b"hi\n"
    assert through_proxy.answers["ExecSync"].stdout == b"test\n"
    resources = through_proxy.answers["ContainerStatus after update"].linux
    assert (resources.cpu_shares, resources.memory_limit_in_bytes) == (256, 64 << 20)


def test_errors_match_direct(direct: Clients, proxied: Clients, workdir: Path) -> None:
    pod = pod_sandbox_config("orphan", log_directory=workdir / "orphan")
    calls: list[Callable[[Clients], Any]] = [
        lambda c: c.runtime.ContainerStatus(api_pb2.ContainerStatusRequest(container_id="no-such-container")),
        lambda c: c.runtime.StartContainer(api_pb2.StartContainerRequest(container_id="")),
        lambda c: c.runtime.StopContainer(api_pb2.StopContainerRequest(container_id="no-such-container")),
        lambda c: c.runtime.PodSandboxStatus(api_pb2.PodSandboxStatusRequest(pod_sandbox_id="no-such-pod")),
        lambda c: c.runtime.RemovePodSandbox(api_pb2.RemovePodSandboxRequest(pod_sandbox_id="")),
        lambda c: c.runtime.CreateContainer(
            api_pb2.CreateContainerRequest(
                pod_sandbox_id="no-such-pod", config=container_config("x", image=BUSYBOX_REF), sandbox_config=pod
            )
        ),
        lambda c: c.images.ImageStatus(api_pb2.ImageStatusRequest(image=api_pb2.ImageSpec(image="no/such:image"))),
    ]
    for index, call in enumerate(calls):
        assert outcome(lambda: call(proxied)) == outcome(lambda: call(direct)), index


def test_deadline_shorter_than_the_answer_expires(proxied: Clients, workdir: Path) -> None:
    with running_container(proxied.runtime, "slow", workdir) as pod:
        with pytest.raises(grpc.RpcError) as error:
            request = api_pb2.ExecSyncRequest(container_id=pod.container_id, cmd=["sleep", "3"])
            proxied.runtime.ExecSync(request, timeout=0.5)
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_socket_is_0660_in_a_0755_directory(koordrp: KoordrpProcess) -> None:
    assert stat.S_ISSOCK(os.stat(koordrp.socket).st_mode)
    assert stat.S_IMODE(os.stat(koordrp.socket).st_mode) == 0o660
    assert stat.S_IMODE(os.stat(koordrp.socket.parent).st_mode) == 0o755


def test_stale_socket_is_replaced(containerd: Containerd, workdir: Path) -> None:
    proxy = KoordrpProcess(workdir, containerd.endpoint)
    proxy.socket.parent.mkdir(parents=True)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(proxy.socket))
    stale.close()
    proxy.start()
    try:
        with proxy.channel() as channel:
            assert proxy.answers(channel)
    finally:
        proxy.stop()


def test_bad_option_is_a_usage_error_naming_the_flag(workdir: Path) -> None:
    result = subprocess.run(
        [twistd_path(), "-n", "--pidfile=", "koordrp", "--remote-runtime-service-endpoint=tcp://127.0.0.1:1"],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "--remote-runtime-service-endpoint" in result.stdout + result.stderr


def test_daemonized_twistd_serves_and_stops(containerd: Containerd, workdir: Path) -> None:
    pidfile = workdir / "koordrp.pid"
    listen = workdir / "d" / "koordrp.sock"
    subprocess.run(
        [
            twistd_path(),
            f"--pidfile={pidfile}",
            f"--logfile={workdir / 'daemon.log'}",
            "koordrp",
            f"--koord-runtimeproxy-endpoint={listen}",
            f"--state-dir={workdir / 'state'}",
            f"--hook-config-dir={workdir / 'hookserver.d'}",
            f"--remote-runtime-service-endpoint={containerd.endpoint}",
        ],
        cwd=workdir,
        check=True,
        timeout=60,
    )
    deadline = time.monotonic() + 20
    while not (listen.exists() and pidfile.exists()) and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int(pidfile.read_text())
    try:
        with grpc.insecure_channel(f"unix://{listen}") as channel:
            version = api_pb2_grpc.RuntimeServiceStub(channel).Version(api_pb2.VersionRequest(), timeout=10)
        assert version.runtime_name == "containerd"
    finally:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}")
    assert not listen.exists()


def test_started_before_containerd_serves_once_it_is_up(images: ImageSet, workdir: Path) -> None:
    late_base = Path(workdir) / "late"
    runtime = Containerd(late_base)
    proxy = KoordrpProcess(workdir, runtime.endpoint)
    proxy.start()
    try:
        with proxy.channel() as channel:
            stub = proxy.runtime(channel)
            for _ in range(3):
                with pytest.raises(grpc.RpcError) as error:
                    stub.Version(api_pb2.VersionRequest(), timeout=5)
                assert error.value.code() == grpc.StatusCode.UNAVAILABLE
                assert runtime.endpoint in (error.value.details() or "")
            runtime.start()
            proxy.wait_answering(channel)

            runtime.kill()
            with pytest.raises(grpc.RpcError) as error:
                stub.Version(api_pb2.VersionRequest(), timeout=5)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
            for _ in range(3):
                with pytest.raises(grpc.RpcError):
                    stub.Version(api_pb2.VersionRequest(), timeout=5)
            runtime.start()
            proxy.wait_answering(channel)
        log = proxy.log()
        assert log.count("is unreachable") == 2, log
        assert log.count("is reachable again") == 2, log
    finally:
        proxy.stop()
        runtime.stop()


def test_sigterm_drains_in_flight_calls_and_exits_zero(
    koordrp: KoordrpProcess, direct: Clients, workdir: Path
) -> None:
    with running_container(direct.runtime, "drain", workdir) as pod:
        results: list[Any] = []
        with koordrp.channel() as channel:
            stub = koordrp.runtime(channel)
            script = "touch /tmp/exec-started; sleep 1; echo done"
            request = api_pb2.ExecSyncRequest(container_id=pod.container_id, cmd=["sh", "-c", script])

            def slow_exec() -> None:
                results.append(outcome(lambda: stub.ExecSync(request, timeout=20)))

            worker = threading.Thread(target=slow_exec)
            worker.start()
            started = api_pb2.ExecSyncRequest(container_id=pod.container_id, cmd=["test", "-e", "/tmp/exec-started"])
            deadline = time.monotonic() + 10
            while direct.runtime.ExecSync(started, timeout=10).exit_code != 0:  # the exec is in flight
                assert time.monotonic() < deadline
                time.sleep(0.02)
            assert koordrp.terminate(timeout=30) == 0
            worker.join(20)
        assert [getattr(r, "stdout", r) for r in results] == [b"done\n"]
        assert not koordrp.socket.exists()
        assert "stopped; removed" in koordrp.log()
