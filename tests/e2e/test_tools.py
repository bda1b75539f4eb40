"""The README's demo and the benchmark keep working (short runs; the figures are not judged here)."""

import re
from pathlib import Path

import pytest

from tests.e2e.conftest import require, require_runtime
from tests.support.containerd import RELEASES
from tests.support.modules import ROOT, run_python_module


@pytest.fixture(autouse=True)
def runtime_available() -> None:
    require_runtime()


def run_module(module: str, *args: str, status: int = 0) -> str:
    return run_python_module(module, *args, status=status).stdout


def kubepods_cgroups() -> list[Path]:
    return [path for path in Path("/sys/fs/cgroup").glob("*/kubepods") if path.is_dir()]


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


def test_demo_in_nri_mode_calls_containerd_which_calls_koordrp() -> None:
    require(RELEASES["1.7"].require, "containerd 1.7")
    before = kubepods_cgroups()
    output = run_module("scripts.demo", "--mode", "nri", "--repeat-stops")
    assert "private containerd 1.7 on unix://" in output and "--backend-runtime-mode=NRI" in output
    assert "POD_QOS_CLASS=LS" in output and "cpuset.cpus = 0" in output
    log = output.split("koordrp's log, one line per lifecycle call a hook server was called for or spared", 1)[1]
    # The removal called no hook server: counted (the demo waited for that), and no line.
    assert "  RemovePodSandbox pod" not in log and 'koordrp_cri_calls_total{code="OK",method="RemovePodSandbox"}' in output
    assert 'CreateContainer pod default/demo' in log and 'changed resources.cpuset_cpus ""→"0", envs +POD_QOS_CLASS' in log
    stops = [line for line in log.splitlines() if line.startswith(("  StopContainer pod", "  StopPodSandbox pod"))]
    # containerd tells its plugins of a stop once, and of the sidecar its pod's stop took along.
    assert "".join(stops).count("PostStopContainer@cpuset-qos.json: sent") == 2, stops
    assert "cleaned up" in output and kubepods_cgroups() == before


def test_the_demos_pod_is_where_kubelet_puts_one_of_its_qos_class_and_its_cgroups_go_with_it() -> None:
    before = kubepods_cgroups()
    output = run_module("scripts.demo", "--qos", "besteffort")
    [parent] = re.findall(r"pod cgroup parent   (\S+)", output)
    assert re.fullmatch(r"/kubepods/besteffort/pod[0-9a-f-]{36}", parent), parent
    assert f"cgroups path        {parent}/" in output  # the container is placed under it
    assert kubepods_cgroups() == before
    assert re.search(r"pod cgroup parent   /kubepods/burstable/pod", run_module("scripts.demo"))  # the default
    custom = run_module("scripts.demo", "--pod-cgroup-parent", "/koordrp-demo/mine")
    assert "pod cgroup parent   /koordrp-demo/mine" in custom
    assert not [path for path in Path("/sys/fs/cgroup").glob("*/koordrp-demo") if path.is_dir()]


def test_repeated_stops_and_a_pod_stopped_with_a_running_container_each_fire_post_stop_container_once() -> None:
    output = run_module("scripts.demo", "--repeat-stops")
    log = output.split("koordrp's log, one line per lifecycle call", 1)[1]
    calls = [line for line in log.splitlines() if line.startswith(("  StopContainer pod", "  StopPodSandbox pod"))]
    assert [line.split("; hooks: ")[1] for line in calls] == [
        "PostStopContainer@cpuset-qos.json: sent",
        "none",
        "PostStopContainer@cpuset-qos.json: sent",
    ], calls
    assert calls[2].startswith("  StopPodSandbox")
    assert "container app of pod default/demo stopped" in output and "container sidecar of pod default/demo stopped" in output
    assert 'koordrp_hook_calls_total{hook="PostStopContainer",result="ok",server="cpuset-qos.json"} 2.0' in output


def test_a_hook_server_that_cannot_start_ends_the_demo_at_once_with_its_error_first(tmp_path: Path) -> None:
    server = tmp_path / "misspelt.py"
    server.write_text(
        "from koordrp.sdk import HookServer\n\n\nclass Misspelt(HookServer):\n"
        "    def pre_create_container(self, request):\n        return None\n"
    )
    output = run_module("scripts.demo", "--hook-server", str(server), status=1)
    assert "did not see its registration" not in output  # not koordrp's 30 s wait for a registration that never comes
    summary = output.index("summary: the hook server")
    assert summary < output.index("the hook server's own output")
    assert "did not start: it exited with status 1: TypeError: Misspelt.pre_create_container looks like a handler" in output
    assert "CRI calls made through koordrp" not in output


def test_what_the_sdk_warns_of_is_in_the_summary(tmp_path: Path) -> None:
    server = tmp_path / "fresh.py"
    server.write_text(
        "from koordrp.sdk import ContainerResourceHookResponse, HookServer, LinuxContainerResources\n\n\n"
        "class Fresh(HookServer):\n    def PreCreateContainer(self, request):\n"
        "        return ContainerResourceHookResponse(container_resources=LinuxContainerResources(cpu_shares=1024))\n\n"
        "    def PostStopContainers(self, request):\n        pass\n"
    )
    output = run_module("scripts.demo", "--hook-server", str(server), "--cpuset", "1", "--cpu-shares", "512")
    summary = output.index("\nsummary:\n")
    assert summary < output.index("koordrp's log, one line per lifecycle call")
    lines = output[summary:].splitlines()
    assert lines[3] == "  the hook server warned (koordrp.sdk):", lines
    warned = lines[4:6]
    assert "Fresh.PostStopContainers looks like a handler but is no hook" in warned[0]
    assert 'the PreCreateContainer answer clears cpuset_cpus "1" that the request had' in warned[1]
    assert 'resources.cpuset_cpus "1"→""' in output  # koordrp's line still says what changed


def test_demo_runs_an_authors_own_server_the_one_in_the_docs(tmp_path: Path) -> None:
    docs = (ROOT / "docs" / "hook-server.md").read_text()
    server = tmp_path / "pin_me.py"
    server.write_text(docs.split("```python\n", 1)[1].split("```", 1)[0])
    output = run_module(
        "scripts.demo", "--hook-server", str(server), "--pod-label", "pin-me=true", "--cpuset", "1", "--env", "A=1"
    )
    assert "registered by" in output and "pin-me.json" in output
    assert "pod annotations     {}" in output  # the example's pod is not the author's
    assert "container env       A=1 PINNED_TO=0" in output
    assert 'container resources {"cpuset_cpus": "0"}' in output  # pinned at create, kubelet asked "1"
    # Its PreUpdateContainerResources pins again: kubelet's update does not put its cpuset back.
    assert 'runtime spec cpu    {"cpus": "0"}' in output and "cpuset.cpus = 0" in output, output
    assert "PreCreateContainer@pin-me.json: ok" in output and 'resources.cpuset_cpus "1"→"0"' in output
    assert "serving PreCreateContainer, PreUpdateContainerResources from" in output


def test_passthrough_benchmark_prints_its_table() -> None:
    output = run_module("benchmarks.passthrough", "--calls", "50", "--pods", "2", "--throughput-calls", "100")
    for figure in ("Version", "ListPodSandbox", "ListContainers", "ContainerStatus", "concurrency", "RSS"):
        assert figure in output


def test_hooks_benchmark_prints_its_figures() -> None:
    require(RELEASES["2.1"].require, "containerd 2.1")
    output = run_module(
        "benchmarks.hooks", "--pods", "2", "--rounds", "5", "--servers", "1", "2", "--pod-pause", "0.1", "--nri-pods", "2"
    )
    for figure in ("update hooked", "start skipped", "servers alone", "share of a hook stage", "CPU per hook stage"):
        assert figure in output
    assert output.count("ratio of the p50 sums") == 4  # one echo server, then two chained; back to back, then paused
    for way in ("minimal plugin", "koordrp", "koordrp, hooks", "proxy"):  # benchmarks/nri_starts.py's
        assert re.search(rf"^    {re.escape(way)} +[+-][0-9.]+ ms \(CI ", output, re.M), output
    assert "first hook call after koordrp" in output, output
