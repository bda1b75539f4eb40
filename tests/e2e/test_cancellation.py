"""kubelet giving up on an intercepted call, against a real containerd: the runtime hears of it at once."""

import re
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
from cri_api.v1 import api_pb2

from tests.e2e.conftest import hook_server, wait_registered
from tests.fake.hook_server import FakeHookServer
from tests.support.containerd import Containerd
from tests.support.hook_registration import register
from tests.support.koordrp_process import KoordrpProcess
from tests.support.pods import running_container

POST_STOP = "PostStopContainerHook"


def logged_at(containerd: Containerd, message: str, timeout: float = 5.0) -> float:
    """When (epoch seconds) containerd logged a line whose message starts with ``message``, once it has."""
    pattern = re.compile(r'^time="([^"]+)" level=\w+ msg="' + re.escape(message.replace('"', '\\"')))
    deadline = time.monotonic() + timeout
    while True:
        for line in containerd.paths.log.read_text(errors="replace").splitlines():
            found = pattern.match(line)
            if found:
                # RFC 3339 with nanoseconds: Python's parser takes microseconds.
                stamp = re.sub(r"(\.\d{6})\d+", r"\1", found.group(1)).replace("Z", "+00:00")
                return datetime.fromisoformat(stamp).timestamp()
        if time.monotonic() > deadline:
            raise AssertionError(f"containerd did not log {message!r} within {timeout}s")
        time.sleep(0.02)


def stop_failed_at(containerd: Containerd, container_id: str) -> float:
    """When containerd logged that its StopContainer failed; well before the 30 s stops here would take."""
    return logged_at(containerd, f'StopContainer for "{container_id}" failed', timeout=20)


def test_a_stop_kubelet_gives_up_on_ends_in_containerd_at_once_and_owes_no_post_stop(
    containerd: Containerd,
    koordrp: KoordrpProcess,
    runtime: Any,
    servers: dict[str, FakeHookServer],
    workdir: Path,
    hooks_dir: Path,
) -> None:
    server = hook_server(servers, workdir, "watcher")
    register(hooks_dir, "watcher", server.path, ["PostStopContainer"])
    wait_registered(koordrp, 1)
    # A bare sleep as PID 1 ignores SIGTERM: containerd waits the whole timeout before SIGKILL.
    with running_container(runtime, "stubborn", workdir) as pod:
        stop = api_pb2.StopContainerRequest(container_id=pod.container_id, timeout=30)
        stopping = runtime.StopContainer.future(stop, timeout=60)
        logged_at(containerd, f'StopContainer for "{pod.container_id}" with timeout 30 (s)')
        stopping.cancel()
        assert stopping.cancelled()
        # containerd's own stop would take its 30 s, then succeed: failing means koordrp's cancel reached it.
        stop_failed_at(containerd, pod.container_id)
        [line] = koordrp.log_lines(f"] StopContainer pod default/stubborn ({pod.pod_config.metadata.uid}) container stubborn: CANCELLED")
        assert "hooks: none" in line, line
        status = runtime.ContainerStatus(api_pb2.ContainerStatusRequest(container_id=pod.container_id)).status
        assert status.state == api_pb2.CONTAINER_RUNNING
        assert server.rpcs() == []
        # kubelet tries again; this one stops it, and it is the one that owes PostStopContainer.
        runtime.StopContainer(api_pb2.StopContainerRequest(container_id=pod.container_id, timeout=0), timeout=30)
        runtime.StopContainer(api_pb2.StopContainerRequest(container_id=pod.container_id, timeout=0), timeout=30)
        assert server.rpcs_once(1) == [POST_STOP]
        assert koordrp.log_lines("] StopContainer pod default/stubborn", count=3)[-1].count(": OK in ") == 1
    assert server.rpcs_once(1) == [POST_STOP]


def test_a_deadline_kubelet_set_reaches_containerd(
    containerd: Containerd, koordrp: KoordrpProcess, runtime: Any, workdir: Path
) -> None:
    with running_container(runtime, "late", workdir) as pod:
        try:
            runtime.StopContainer(api_pb2.StopContainerRequest(container_id=pod.container_id, timeout=30), timeout=0.5)
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        else:
            raise AssertionError("a 30 s stop answered within its 0.5 s deadline")
        # containerd's own stop would take its 30 s, then succeed: failing means kubelet's deadline reached it.
        stop_failed_at(containerd, pod.container_id)
