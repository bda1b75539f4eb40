"""A short soak: pods, kubelet's polling and hook config reloads at once lose no hook call and leave nothing."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import require_runtime

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def runtime_available() -> None:
    require_runtime()


def test_short_soak_loses_nothing_and_leaves_nothing() -> None:
    # 40 pods take about 15 s on 8 workers; 30 s bounds a slow machine, and the script still
    # finishes and checks whatever it started.
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.soak", "--seconds", "30", "--pods", "40"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "hook calls: nothing lost" in result.stdout, output
    assert "\nerrors: 0\n" in result.stdout, output
    assert "left behind: 0 pods, 0 containers listed through koordrp; 0 pods, 0 containers" in result.stdout, output
    assert "result: passed" in result.stdout, output
