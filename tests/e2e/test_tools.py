"""The README's demo and the benchmark keep working (short runs; the figures are not judged here)."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import require_runtime

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def runtime_available() -> None:
    require_runtime()


def run_module(module: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_demo_walks_a_pod_through_koordrp_and_cleans_up() -> None:
    output = run_module("scripts.demo")
    for method in ("RunPodSandbox", "CreateContainer", "StartContainer", "RemovePodSandbox"):
        assert method in output
    assert "GREETING=hello" in output
    assert "POD_QOS_CLASS=LS" in output
    assert "cpuset.cpus = 0" in output
    assert "CreateContainer pod default/demo" in output and "PreCreateContainer@cpuset-qos.json" in output
    assert 'koordrp_hook_calls_total{hook="PreCreateContainer",result="ok",server="cpuset-qos.json"} 1.0' in output
    assert "/healthz: 200" in output
    assert "cleaned up" in output


def test_demo_runs_an_authors_own_server_the_one_in_the_docs(tmp_path: Path) -> None:
    docs = (ROOT / "docs" / "hook-server.md").read_text()
    server = tmp_path / "pin_me.py"
    server.write_text(docs.split("```python\n", 1)[1].split("```", 1)[0])
    output = run_module(
        "scripts.demo", "--hook-server", str(server), "--pod-label", "pin-me=true", "--cpuset", "0-1", "--env", "A=1"
    )
    assert "registered by" in output and "pin-me.json" in output
    assert "pod annotations     {}" in output  # the example's pod is not the author's
    assert "container env       A=1 PINNED_TO=0" in output
    assert 'container resources {"cpuset_cpus": "0"}' in output  # pinned at create, kubelet asked "0-1"
    # The example has no PreUpdateContainerResources handler: kubelet's update puts its cpuset back.
    assert 'runtime spec cpu    {"cpus": "0-1"}' in output and "cpuset.cpus = 0-1" in output
    assert "PreCreateContainer@pin-me.json: ok" in output and 'resources.cpuset_cpus "0-1"→"0"' in output
    assert "serving PreCreateContainer from" in output


def test_passthrough_benchmark_prints_its_table() -> None:
    output = run_module("benchmarks.passthrough", "--calls", "50", "--pods", "2", "--throughput-calls", "100")
    for figure in ("Version", "ListPodSandbox", "ListContainers", "ContainerStatus", "concurrency", "RSS"):
        assert figure in output


def test_hooks_benchmark_prints_its_figures() -> None:
    output = run_module("benchmarks.hooks", "--pods", "2", "--rounds", "5", "--servers", "1", "2", "--pod-pause", "0.1")
    for figure in ("update hooked", "start skipped", "servers alone", "share of a hook stage", "CPU per hook stage"):
        assert figure in output
    assert output.count("ratio of the p50 sums") == 4  # one echo server, then two chained; back to back, then paused
