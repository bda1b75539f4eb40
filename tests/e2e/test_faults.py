"""Faults an operator will meet: broken hook servers, a dying runtime, koordrp itself restarted."""

import re
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import pytest
from cri_api.v1 import api_pb2

from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from koordrp.hooks.messages import CATCH_UP_ANNOTATION
from koordrp.unix import grpc_target
from tests.support.compare import changed_fields
from tests.e2e.conftest import hook_server, wait_registered
from tests.fake import BytesHandler
from tests.fake.hook_server import FakeHookServer
from tests.support.containerd import Containerd
from tests.support.cri_objects import container_config, pod_sandbox_config
from tests.support.hook_registration import register
from tests.support.images import BUSYBOX_REF, ImageSet
from tests.support.koordrp_process import KoordrpProcess
from tests.support.pods import TIMEOUT, remove_pod, start_container
from tests.support.relay import UnixRelay
from tests.support.stack import start_containerd

CREATE = "PreCreateContainerHook"
HOOK_TIMEOUT = 0.5
# What containerd 1.6 and 1.7 answer a CRI call between their socket opening and their CRI service being ready
# (2.x answers UNAVAILABLE).
CONTAINERD_STARTING = (grpc.StatusCode.UNKNOWN, "server is not initialized yet")


@pytest.fixture
def sandbox(containerd: Containerd, workdir: Path) -> Iterator[tuple[str, Any]]:
    """A pod made directly in containerd: koordrp reads it back from the runtime when asked."""
    pod = pod_sandbox_config("faults", log_directory=workdir / "faults")
    runtime = containerd.runtime()
    sandbox_id = runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=pod), timeout=TIMEOUT).pod_sandbox_id
    yield sandbox_id, pod
    remove_pod(runtime, sandbox_id)


def create(runtime: Any, sandbox: tuple[str, Any], name: str) -> Any:
    sandbox_id, pod = sandbox
    config = container_config(name, image=BUSYBOX_REF, command=["sleep", "3600"])
    return runtime.CreateContainer(
        api_pb2.CreateContainerRequest(pod_sandbox_id=sandbox_id, config=config, sandbox_config=pod), timeout=TIMEOUT
    )


def healthy_again(koordrp: KoordrpProcess, runtime: Any, sandbox: tuple[str, Any], path: str) -> FakeHookServer:
    """Put a working server on the same socket: the very next call must get the hook."""
    server = FakeHookServer(path)
    server.behaviours[CREATE] = lambda request: hook.ContainerResourceHookResponse(container_annotations={"back": "1"})
    server.start()
    created = create(runtime, sandbox, "after-the-fault")
    status = runtime.ContainerStatus(api_pb2.ContainerStatusRequest(container_id=created.container_id)).status
    assert status.annotations["back"] == "1", koordrp.log()
    return server


def garbage_server(path: str) -> grpc.Server:
    """Answers every hook with bytes that are no valid message."""

    class Garbage(BytesHandler):
        def service(self, details: Any) -> Any:
            return grpc.unary_unary_rpc_method_handler(lambda request, context: b"\xff\xff\xff\xff")

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[Garbage()])
    server.add_insecure_port(grpc_target(path))
    server.start()
    return server


def refusing_socket(path: str) -> socket.socket:
    """A socket file nobody accepts on: connections are refused."""
    bound = socket.socket(socket.AF_UNIX)
    bound.bind(path)
    return bound


def crashing_process(path: str) -> subprocess.Popen[bytes]:
    process = subprocess.Popen([sys.executable, "-m", "tests.fake.crashing_hook_server", path], stdout=subprocess.PIPE)
    assert process.stdout is not None and process.stdout.readline().strip() == b"ready"
    return process


def hanging_server(path: str) -> FakeHookServer:
    server = FakeHookServer(path)
    server.delays[CREATE] = 3600
    return server.start()


def regular_file(path: str) -> Callable[[], None]:
    Path(path).write_text("not a socket")
    return lambda: None


# Each fault is set up on the hook server's socket path and gives back how to clear it.
FAULTS: dict[str, Callable[[str], Callable[[], object]]] = {
    "refuses connections": lambda path: refusing_socket(path).close,
    "crashes mid-call": lambda path: crashing_process(path).kill,
    "hangs forever": lambda path: hanging_server(path).stop,
    "answers garbage": lambda path: garbage_server(path).stop(0).wait,
    "socket replaced by a regular file": regular_file,
}


@pytest.mark.parametrize("policy", ["Fail", "Ignore"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_hook_server_faults(
    fault: str, policy: str, koordrp: KoordrpProcess, sandbox: tuple[str, Any], workdir: Path
) -> None:
    path = str(workdir / "faulty.sock")
    undo = FAULTS[fault](path)
    register(workdir / "hookserver.d", "faulty", path, ["PreCreateContainer"], policy=policy, **{"timeout-seconds": HOOK_TIMEOUT})
    wait_registered(koordrp, 1)
    replacement = None
    with koordrp.channel() as channel:
        runtime = koordrp.runtime(channel)
        if policy == "Fail":
            with pytest.raises(grpc.RpcError) as error:
                create(runtime, sandbox, "during-the-fault")
            assert error.value.code() == grpc.StatusCode.UNKNOWN
            details = error.value.details() or ""
            assert "faulty.json" in details and "PreCreateContainer" in details
        else:
            create(runtime, sandbox, "during-the-fault")
        # Whatever the fault, the hook call ended as an error or as its own timeout: nothing waits longer.
        [line] = koordrp.log_lines(" container during-the-fault: ")
        assert re.search(rf"PreCreateContainer@faulty\.json: (error|timeout) [0-9.]+ ms \((no answer within {HOOK_TIMEOUT:g}s|[^;]+); ", line), line
        assert koordrp.answers(channel)
        undo()
        Path(path).unlink(missing_ok=True)
        try:
            replacement = healthy_again(koordrp, runtime, sandbox, path)
        finally:
            if replacement is not None:
                replacement.stop()
    assert koordrp.process is not None and koordrp.process.poll() is None


def test_runtime_killed_during_a_burst(images: ImageSet, workdir: Path) -> None:
    runtime_process = start_containerd(images, workdir / "cd")
    proxy = KoordrpProcess(workdir, runtime_process.endpoint)
    proxy.start()
    try:
        with proxy.channel() as channel:
            stub = proxy.runtime(channel)
            codes: list[grpc.StatusCode] = []
            refusals: set[tuple[grpc.StatusCode, str | None]] = set()
            stop = threading.Event()

            def burst() -> None:
                while not stop.is_set():
                    try:
                        stub.ListContainers(api_pb2.ListContainersRequest(), timeout=5)
                        codes.append(grpc.StatusCode.OK)
                    except grpc.RpcError as error:
                        codes.append(error.code())
                        if error.code() is not grpc.StatusCode.UNAVAILABLE:
                            refusals.add((error.code(), error.details()))

            def seen(code: grpc.StatusCode) -> None:
                deadline = time.monotonic() + 10
                while code not in codes[-8:]:
                    assert time.monotonic() < deadline, f"no {code.name} in the burst"
                    time.sleep(0.01)

            workers = [threading.Thread(target=burst) for _ in range(4)]
            for worker in workers:
                worker.start()
            seen(grpc.StatusCode.OK)
            runtime_process.kill()
            seen(grpc.StatusCode.UNAVAILABLE)
            runtime_process.start()
            proxy.wait_answering(channel)
            stop.set()
            for worker in workers:
                worker.join(10)
        # Besides UNAVAILABLE while it is away, the only refusal is containerd's own while its CRI
        # service starts, relayed as it answered it.
        assert refusals <= {CONTAINERD_STARTING}, refusals
        assert grpc.StatusCode.UNAVAILABLE in codes and codes[-1] == grpc.StatusCode.OK
        assert proxy.process is not None and proxy.process.poll() is None
    finally:
        proxy.stop()
        runtime_process.stop()


def test_store_agrees_with_the_runtime_after_an_outage(
    containerd: Containerd, servers: dict[str, FakeHookServer], workdir: Path
) -> None:
    """koordrp reaches containerd through a relay that is cut for a while; meanwhile pods come and go."""
    link = workdir / "runtime.sock"
    relay = UnixRelay(str(link), containerd.address).start()
    server = hook_server(servers, workdir, "watch")
    register(workdir / "hookserver.d", "watch", server.path, ["PostStopPodSandbox"])
    proxy = KoordrpProcess(workdir, f"unix://{link}")
    proxy.start()
    direct = containerd.runtime()
    made: list[str] = []
    try:
        with proxy.channel() as channel:
            runtime = proxy.runtime(channel)
            wait_registered(proxy, 1)
            gone_pod = pod_sandbox_config("gone", log_directory=workdir / "gone", labels={"who": "gone"})
            gone = runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=gone_pod), timeout=TIMEOUT).pod_sandbox_id
            made.append(gone)
            relay.cut()
            with pytest.raises(grpc.RpcError):
                runtime.Version(api_pb2.VersionRequest(), timeout=5)
            remove_pod(direct, gone)
            came_pod = pod_sandbox_config("came", log_directory=workdir / "came", labels={"who": "came"})
            came = direct.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=came_pod), timeout=TIMEOUT).pod_sandbox_id
            made.append(came)
            relay.start()
            deadline = time.monotonic() + 5
            while "1 learnt, 1 forgotten" not in proxy.log():
                assert time.monotonic() < deadline, proxy.log()
                time.sleep(0.05)
            runtime.StopPodSandbox(api_pb2.StopPodSandboxRequest(pod_sandbox_id=came), timeout=TIMEOUT)
            # The pod koordrp never saw made owes no post stop: its line names no hook call.
            [line] = proxy.log_lines("StopPodSandbox pod default/came")
            assert line.endswith("hooks: none"), line
        # The pod removed during the outage gets its post stop once, marked as late.
        server.rpcs_once(1)
        stopped = server.calls("PostStopPodSandboxHook")
        assert [(r.pod_meta.name, r.labels["who"], r.annotations[CATCH_UP_ANNOTATION]) for r in stopped] == [
            ("gone", "gone", "true")
        ]
    finally:
        proxy.stop()
        relay.cut()
        for sandbox_id in made:
            try:
                remove_pod(direct, sandbox_id)
            except grpc.RpcError:
                pass


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGKILL"])
def test_restart_during_churn_keeps_every_containers_hooks(
    signal_name: str, containerd: Containerd, servers: dict[str, FakeHookServer], workdir: Path
) -> None:
    server = hook_server(servers, workdir, "memory")
    server.behaviours["PreRunPodSandboxHook"] = lambda request: hook.PodSandboxHookResponse(
        annotations={"koordrp.test/tier": "gold"}
    )
    server.behaviours[CREATE] = lambda request: hook.ContainerResourceHookResponse(container_envs={"TUNED": "1"})
    register(
        workdir / "hookserver.d", "memory", server.path,
        ["PreRunPodSandbox", "PreCreateContainer", "PreStartContainer", "PostStopContainer"],
    )
    direct = containerd.runtime()
    sandboxes: list[str] = []
    containers: dict[str, str] = {}

    def start_pods(proxy: KoordrpProcess, names: list[str]) -> None:
        with proxy.channel() as channel:
            runtime = proxy.runtime(channel)
            for name in names:
                pod = pod_sandbox_config(name, labels={"pod": name}, log_directory=workdir / name)
                sandbox_id = runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=pod), timeout=TIMEOUT).pod_sandbox_id
                sandboxes.append(sandbox_id)
                container = container_config(name, image=BUSYBOX_REF, command=["sleep", "3600"], env={"POD": name})
                containers[name] = start_container(runtime, sandbox_id, pod, container)

    def stop_containers(proxy: KoordrpProcess, names: list[str]) -> None:
        with proxy.channel() as channel:
            runtime = proxy.runtime(channel)
            for name in names:
                runtime.StopContainer(api_pb2.StopContainerRequest(container_id=containers[name], timeout=0))
        # Post hooks leave after the CRI answer: a SIGKILL in that moment would lose them (as it
        # would lose anything in flight), which is not what this test is about.
        wanted = {containers[name] for name in names}
        deadline = time.monotonic() + 5
        while not wanted <= {r.container_meta.id for r in server.calls("PostStopContainerHook")}:
            assert time.monotonic() < deadline, f"no PostStopContainer for {wanted}"
            time.sleep(0.01)

    def restart(proxy: KoordrpProcess) -> KoordrpProcess:
        if signal_name == "SIGTERM":
            assert proxy.terminate() == 0
        else:
            proxy.kill()
        again = KoordrpProcess(workdir, containerd.endpoint)
        again.start()
        return again

    proxy = KoordrpProcess(workdir, containerd.endpoint)
    proxy.start()
    try:
        wait_registered(proxy, 1)
        start_pods(proxy, ["a1", "a2", "a3"])
        proxy = restart(proxy)
        start_pods(proxy, ["b1", "b2", "b3"])
        stop_containers(proxy, ["a1", "b1"])
        proxy = restart(proxy)
        stop_containers(proxy, ["a2", "a3", "b2", "b3"])
        proxy.stop()
    finally:
        proxy.stop()
        for sandbox_id in sandboxes:
            remove_pod(direct, sandbox_id)
    started = {r.container_meta.id: r for r in server.calls("PreStartContainerHook")}
    stopped = {r.container_meta.id: r for r in server.calls("PostStopContainerHook")}
    assert set(started) == set(stopped) == set(containers.values())
    for name, container_id in containers.items():
        assert changed_fields(started[container_id], stopped[container_id]) == set(), name
        assert stopped[container_id].pod_labels["pod"] == name
        assert stopped[container_id].pod_annotations["koordrp.test/tier"] == "gold"
        # What kubelet asked, not what PreCreateContainer made of it, across the restart too.
        assert dict(stopped[container_id].container_envs) == {"POD": name}
