"""What an operator sees: metrics, the health check, one log line per lifecycle call, JSON logs."""

import json
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from cri_api.v1 import api_pb2

from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from tests.e2e.conftest import hook_server, wait_registered
from tests.fake.hook_server import FakeHookServer
from tests.support.containerd import Containerd
from tests.support.hook_registration import register
from tests.support.koordrp_process import KoordrpProcess, twistd_path
from tests.support.pods import running_container
from tests.support.relay import UnixRelay
from tests.support.scrape import free_port, get, sample


@pytest.fixture
def observed(containerd: Containerd, workdir: Path) -> Iterator[tuple[KoordrpProcess, str, UnixRelay]]:
    relay = UnixRelay(str(workdir / "runtime.sock"), containerd.address).start()
    port = free_port()
    proxy = KoordrpProcess(workdir, f"unix://{relay.listen_path}", [f"--metrics-endpoint=tcp:{port}:interface=127.0.0.1"])
    proxy.start()
    yield proxy, f"http://127.0.0.1:{port}", relay
    proxy.stop()
    relay.cut()


def test_metrics_health_and_call_log(
    observed: tuple[KoordrpProcess, str, UnixRelay], servers: dict[str, FakeHookServer], workdir: Path
) -> None:
    proxy, base, relay = observed
    server = hook_server(servers, workdir, "tuner")
    server.behaviours["PreCreateContainerHook"] = lambda request: hook.ContainerResourceHookResponse(
        container_envs={"TUNED": "1"}
    )
    register(workdir / "hookserver.d", "tuner", server.path, ["PreCreateContainer", "PostStopContainer"])
    wait_registered(proxy, 1)
    with proxy.channel() as channel:
        runtime = proxy.runtime(channel)
        for _ in range(3):
            runtime.Version(api_pb2.VersionRequest())
        with running_container(runtime, "observed", workdir, labels={"runtimeproxy.koordinator.sh/skip-hookserver": "true"}):
            pass
        with running_container(runtime, "watched", workdir) as pod:
            status, metrics = get(f"{base}/metrics")
            assert status == 200
            assert sample(metrics, "koordrp_cri_calls_total", method="Version", code="OK") == 3
            assert sample(metrics, "koordrp_cri_calls_total", method="RunPodSandbox", code="OK") == 2
            assert sample(metrics, "koordrp_cri_call_seconds_count", method="CreateContainer") == 2
            assert sample(metrics, "koordrp_hook_calls_total", server="tuner.json", hook="PreCreateContainer", result="ok") == 1
            assert sample(metrics, "koordrp_hook_calls_total", server="tuner.json", hook="PreCreateContainer", result="skipped") == 1
            assert sample(metrics, "koordrp_hook_call_seconds_count", server="tuner.json", hook="PreCreateContainer") == 1
            assert sample(metrics, "koordrp_hook_servers") == 1
            assert sample(metrics, "koordrp_store_pods") == 1
            assert sample(metrics, "koordrp_store_containers") == 1
            assert sample(metrics, "koordrp_state_files") == 2  # the pod and the container koordrp saw made
            assert sample(metrics, "koordrp_backend_reachable", endpoint=relay.listen_path) == 1
            assert get(f"{base}/healthz")[0] == 200
            runtime.StopContainer(api_pb2.StopContainerRequest(container_id=pod.container_id, timeout=0))
    proxy.log_lines("[koordrp.calls#info] RemovePodSandbox pod default/watched")  # the last call's line
    lines = [line for line in proxy.log().splitlines() if "[koordrp.calls#info]" in line]
    assert not [line for line in lines if " Version " in line]  # pass-through calls log nothing
    created = [line for line in lines if "CreateContainer pod default/watched" in line]
    assert len(created) == 1 and "container watched: OK in" in created[0]
    assert "hooks: PreCreateContainer@tuner.json: ok " in created[0] and created[0].endswith("ms, changed envs +TUNED")
    assert any("StopContainer pod default/watched" in line and "PostStopContainer@tuner.json: sent" in line for line in lines)
    assert any("CreateContainer pod default/observed" in line and "PreCreateContainer@tuner.json: skipped" in line for line in lines)
    relay.cut()
    # A success younger than 5 s is trusted without asking again: then the probe finds the backend gone.
    deadline = time.monotonic() + 10
    while (answer := get(f"{base}/healthz"))[0] == 200:
        assert time.monotonic() < deadline, answer
        time.sleep(0.1)
    status, text = answer
    assert status == 503 and relay.listen_path in text


def test_json_lines_logging(containerd: Containerd, workdir: Path) -> None:
    listen = workdir / "j" / "koordrp.sock"
    output = (workdir / "koordrp.jsonl").open("w")
    process = subprocess.Popen(
        [
            twistd_path(), "-n", "--pidfile=", "--logger=koordrp.jsonlogs.to_stdout", "koordrp",
            f"--koord-runtimeproxy-endpoint={listen}", f"--remote-runtime-service-endpoint={containerd.endpoint}",
            f"--hook-config-dir={workdir / 'hooks'}", f"--state-dir={workdir / 'state'}",
        ],
        stdout=output, stderr=subprocess.STDOUT, cwd=workdir,
    )
    log = workdir / "koordrp.jsonl"

    def serving() -> list[dict[str, Any]]:
        # Whole lines only: the last one may be half written. The event itself is waited for: the socket
        # exists a moment before it is logged.
        lines = log.read_text().split("\n")[:-1]
        events: list[dict[str, Any]] = [json.loads(line) for line in lines if line.strip()]
        return [event for event in events if event.get("log_format", "").startswith("serving CRI on")]

    try:
        deadline = time.monotonic() + 20
        while not serving():
            assert time.monotonic() < deadline and process.poll() is None, log.read_text()
            time.sleep(0.05)
    finally:
        process.terminate()
        process.wait(20)
        output.close()
    [first, *_] = serving()
    assert first["listen"] == str(listen)
    assert first["log_level"]["name"] == "info"
