"""A plugin author's second hour: servers written from docs/hook-server.md alone, run by the demo, as the
author runs them. A refusal shows its reason and the demo goes on to its summary with no traceback
anywhere; hooks see the container's image; the cpuset advice warns of a fresh answer and never of one
reply() built; the docs' first example keeps its cpuset through kubelet's update, and the summary names
a change an update undid and koordrp's warnings rather than saying all went well.

The servers are the docs' own examples where the docs have one (so the docs stay true), and otherwise
what the docs' sentences say to write.
"""

import re
import subprocess
from pathlib import Path

import pytest

from tests.e2e.conftest import require, require_runtime
from tests.support.containerd import RELEASES
from tests.support.modules import ROOT, run_python_module

DOCS = (ROOT / "docs" / "hook-server.md").read_text()

ADVICE = "not built from the request"


@pytest.fixture(autouse=True)
def runtime_available() -> None:
    require_runtime()


def docs_example(defining: str) -> str:
    """The docs' ```python block that defines ``defining``."""
    blocks: list[str] = re.findall(r"^```python\n(.*?)^```", DOCS, re.MULTILINE | re.DOTALL)
    [source] = [block for block in blocks if defining in block]
    return source


def demo(tmp_path: Path, server: str, *args: str, file: str = "author_server.py") -> str:
    """``scripts/demo --hook-server`` with ``server`` as its ``file``; its whole output, stderr included (it must exit 0)."""
    path = tmp_path / file
    path.write_text(server)
    result = run_python_module("scripts.demo", "--hook-server", str(path), *args)
    output = result.stdout + result.stderr
    assert "cleaned up" in output
    return output


def summary_of(output: str) -> str:
    """The demo's summary, up to koordrp's call lines."""
    return output.split("\nsummary:\n", 1)[1].split("\nkoordrp's log, ", 1)[0]


def test_a_refusal_under_fail_shows_its_reason_then_the_summary_and_no_traceback(tmp_path: Path) -> None:
    output = demo(tmp_path, docs_example("class NoForbiddenImages"), "--image", "registry.example/forbidden/app:1")
    reason = "image registry.example/forbidden/app:1 is not allowed on this node"
    failed = output.index(f"FAILED: UNKNOWN: koordrp: hook server author-server.json (")
    assert f"PreCreateContainer: FAILED_PRECONDITION: {reason}" in output[failed:].splitlines()[0]
    summary = output.index("\nsummary:\n")
    assert failed < summary
    assert f"  CreateContainer FAILED: UNKNOWN: " in output[summary:]
    assert "Traceback" not in output and "_InactiveRpcError" not in output
    # The failure policy is the server's own, declared in its class.
    assert '"failure-policy": "Fail"' in output
    # The rest of the demo: the pod is stopped and removed, koordrp's lines, the server's one line.
    assert re.search(r"  StopPodSandbox +[0-9.]+ ms  ok", output) and re.search(r"  RemovePodSandbox +[0-9.]+ ms  ok", output)
    log = output.split("koordrp's log, one line per lifecycle call:", 1)[1]
    assert "PreCreateContainer@author-server.json: error" in log and "Fail policy: the call failed" in log
    assert f"koordrp.sdk INFO PreCreateContainer refused for pod default/demo container app: {reason}" in output


def test_under_ignore_a_refusal_is_a_warning_and_the_container_is_made(tmp_path: Path) -> None:
    output = demo(
        tmp_path, docs_example("class NoForbiddenImages"), "--image", "forbidden", "--failure-policy", "Ignore"
    )
    assert "FAILED:" not in output  # no CRI call failed
    assert re.search(r"summary:\n  all \d+ CRI calls answered", output)
    assert '"failure-policy": "Ignore"' in output  # the command line over the class
    [create] = [line for line in output.splitlines() if line.startswith("  CreateContainer pod default/demo")]
    assert ": OK in " in create and "PreCreateContainer@author-server.json: error" in create
    assert "FAILED_PRECONDITION: image forbidden is not allowed on this node" in create
    # koordrp's warning of it is in the summary, not only in its call line.
    warned = summary_of(output).split("  koordrp warned (the warn and error lines of its log):\n", 1)[1].splitlines()
    assert any(
        "#warn] hook PreCreateContainer on author-server.json failed: FAILED_PRECONDITION: image forbidden is not allowed" in line
        for line in warned
    ), warned


def test_a_server_copying_the_image_annotation_shows_the_image_in_the_container(tmp_path: Path) -> None:
    output = demo(tmp_path, docs_example("class ImageEnv"))
    [env] = [line for line in output.splitlines() if line.startswith("  ExecSync env")]
    assert "IMAGE=localhost/koordrp/busybox:1" in env.split()
    # Shown to the hook, not sent to containerd.
    assert "container annotations {}" in output


def test_an_answer_reply_built_draws_no_advice_even_as_it_clears_the_cpuset(tmp_path: Path) -> None:
    # As the docs say to answer: reply(request), changed where you mean to.
    server = (
        "from koordrp.sdk import HookServer, reply\n\n\n"
        "class Batch(HookServer):\n"
        "    def PreCreateContainer(self, request):\n"
        "        response = reply(request)\n"
        "        response.container_resources.cpu_shares = 256\n"
        '        response.container_resources.cpuset_cpus = ""\n'
        "        return response\n"
    )
    output = demo(tmp_path, server, "--cpuset", "1", "--cpu-shares", "512")
    assert ADVICE not in output
    assert 'resources.cpu_shares 512→256, resources.cpuset_cpus "1"→""' in output


def test_a_fresh_answer_setting_only_cpu_shares_draws_the_advice(tmp_path: Path) -> None:
    # What the docs warn of: an answer built from scratch, with nothing in the request but the cpuset.
    server = (
        "from koordrp.sdk import ContainerResourceHookResponse, HookServer, LinuxContainerResources\n\n\n"
        "class Fresh(HookServer):\n"
        "    def PreCreateContainer(self, request):\n"
        "        return ContainerResourceHookResponse(container_resources=LinuxContainerResources(cpu_shares=256))\n"
    )
    output = demo(tmp_path, server, "--cpuset", "1")
    summary = output.split("\nsummary:\n", 1)[1]
    assert "the hook server warned (koordrp.sdk):" in summary
    assert f'the PreCreateContainer answer clears cpuset_cpus "1" that the request had: its resources were {ADVICE}' in summary


def test_the_docs_first_server_keeps_its_cpuset_through_kubelets_update(tmp_path: Path) -> None:
    output = demo(tmp_path, docs_example("class PinMe"), "--pod-label", "pin-me=true", "--cpuset", "1", "--env", "A=1", file="pin_me.py")
    assert "container env       A=1 PINNED_TO=0" in output
    assert 'container resources {"cpuset_cpus": "0"}' in output  # pinned at create, kubelet asked "1"
    assert 'runtime spec cpu    {"cpus": "0"}' in output and "cpuset.cpus = 0" in output  # and after kubelet's update
    [update] = [line for line in output.splitlines() if line.startswith("  UpdateContainerResources pod default/demo")]
    assert 'PreUpdateContainerResources@pin-me.json: ok' in update and 'resources.cpuset_cpus "1"→"0"' in update
    summary = summary_of(output)
    assert 'the runtime still has at the end: resources.cpuset_cpus "0" (kubelet asked "1")' in summary
    assert "undid" not in summary
    assert "koordrp.sdk INFO serving PreCreateContainer, PreUpdateContainerResources from " in output


def test_a_change_made_only_at_create_is_named_undone_by_kubelets_update_and_the_servers_lines_by_its_module(
    tmp_path: Path,
) -> None:
    # What the docs' first example was: it pinned at create only.
    server = (
        "import logging\n\n"
        "from koordrp.sdk import HookServer, reply\n\n"
        "log = logging.getLogger(__name__)\n\n\n"
        "class PinAtCreate(HookServer):\n"
        "    def PreCreateContainer(self, request):\n"
        "        response = reply(request)\n"
        '        response.container_resources.cpuset_cpus = "0"\n'
        '        log.info("pinned %s", request.container_meta.name)\n'
        "        return response\n"
    )
    output = demo(tmp_path, server, "--cpuset", "1")
    assert "cpuset.cpus = 1" in output  # what kubelet's update put back
    summary = summary_of(output).splitlines()
    assert re.fullmatch(r"  all \d+ CRI calls answered", summary[0]), summary
    assert summary[1:4] == [
        "  UpdateContainerResources undid what the hooks changed at CreateContainer (kubelet sends its values again):",
        '    resources.cpuset_cpus: the hooks made it "0" (kubelet asked "1"); the runtime has "1" at the end',
        "    (answer PreUpdateContainerResources too, with the same change: docs/hook-server/messages.md)",
    ], summary
    # As docs/hook-server.md says: the file is loaded as a module named after it.
    assert re.search(r"^  \S+ \S+ author_server INFO pinned app$", output, re.M), output


def test_in_nri_mode_the_docs_first_server_keeps_its_cpuset_and_koordrps_warning_of_its_timeout_is_shown(tmp_path: Path) -> None:
    require(RELEASES["1.7"].require, "containerd 1.7")
    output = demo(
        tmp_path, docs_example("class PinMe"), "--mode", "nri", "--pod-label", "pin-me=true", "--cpuset", "1", file="pin_me.py"
    )
    assert 'runtime spec cpu    {"cpus": "0"}' in output and "cpuset.cpus = 0" in output
    summary = summary_of(output)
    assert "undid" not in summary
    # Served by python -m koordrp.sdk, its __main__ block and its timeout_seconds=1 do not run: koordrp's --hook-timeout.
    warned = summary.split("  koordrp warned (the warn and error lines of its log):\n", 1)[1].splitlines()
    assert any(
        "#warn] hook server pin-me.json (" in line and "may take 60s to answer" in line and "but its pre hooks get 1.9s" in line
        for line in warned
    ), warned


def test_help_is_answered_without_the_bootstrap() -> None:
    result = subprocess.run([str(ROOT / "scripts" / "demo"), "--help"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("usage: scripts/demo ") and "--hook-server" in result.stdout
    assert "bootstrap:" not in result.stderr, result.stderr
