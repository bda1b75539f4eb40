"""A plugin author's second hour: servers written from docs/hook-server.md alone, run by the demo in proxy
mode, as the author runs them. A refusal shows its reason and the demo goes on to its summary with no
traceback anywhere; hooks see the container's image; the cpuset advice warns of a fresh answer and
never of one reply() built.

The servers are the docs' own examples where the docs have one (so the docs stay true), and otherwise
what the docs' sentences say to write.
"""

import re
from pathlib import Path

import pytest

from tests.e2e.conftest import require_runtime
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


def demo(tmp_path: Path, server: str, *args: str) -> str:
    """``scripts/demo --hook-server`` with ``server`` as its file; its whole output, stderr included (it must exit 0)."""
    path = tmp_path / "author_server.py"
    path.write_text(server)
    result = run_python_module("scripts.demo", "--hook-server", str(path), *args)
    output = result.stdout + result.stderr
    assert "cleaned up" in output
    return output


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
