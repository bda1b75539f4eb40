"""A short soak: pods, kubelet's polling and hook config reloads at once lose no hook call and leave nothing."""

import pytest

from tests.e2e.conftest import require_runtime
from tests.support.modules import run_python_module


@pytest.fixture(autouse=True)
def runtime_available() -> None:
    require_runtime()


def test_short_soak_loses_nothing_and_leaves_nothing() -> None:
    # 40 pods take about 15 s on 8 workers; 30 s bounds a slow machine, and the script still
    # finishes and checks whatever it started.
    result = run_python_module("benchmarks.soak", "--seconds", "30", "--pods", "40")
    output = result.stdout + result.stderr
    assert "hook calls: nothing lost" in result.stdout, output
    assert "\nerrors: 0\n" in result.stdout, output
    assert "left behind: 0 pods, 0 containers listed through koordrp; 0 pods, 0 containers" in result.stdout, output
    assert "result: passed" in result.stdout, output


def cells(output: str, figure: str) -> list[str]:
    """The cells of ``figure``'s row in a node soak's tables: start, middle, end (and for a judged
    figure the change and the judgement)."""
    rows = [line[len(figure):].split() for line in output.splitlines() if line.startswith(figure + " ")]
    assert len(rows) == 1, (figure, output)
    return rows[0]


def test_a_short_node_soak_leaks_no_descriptor_and_its_store_comes_back() -> None:
    # Proxy mode: a node of 6 pods churned for 3 s, then 2 x 6 s between the checkpoints, every 4th
    # removal behind koordrp's back, a hook server restarted every 3 s, another wedged in each stretch.
    result = run_python_module(
        "benchmarks.node_soak", "--mode", "proxy", "--pods", "6", "--workers", "3", "--minutes", "0.2",
        "--warmup-minutes", "0.05", "--behind-every", "4", "--restart-every", "3", "--wedge-seconds", "3",
        "--reconcile-interval", "1",
        status=None,
    )
    output = result.stdout + result.stderr
    assert "\nverdict (proxy: " in result.stdout, output
    assert "\nerrors: 0\n" in result.stdout, output
    assert cells(result.stdout, "open file descriptors")[-1] == "flat", output
    # Each disturbance happened between the start and the end.
    for figure in ("  of them behind koordrp", "hook server restarts", "hook server wedges"):
        start, _, end = map(int, cells(result.stdout, figure))
        assert end > start, (figure, output)
    for figure in ("koordrp_store_pods", "koordrp_store_containers", "koordrp_state_files", "state files on disk"):
        assert cells(result.stdout, figure)[-1] == "flat", (figure, output)
