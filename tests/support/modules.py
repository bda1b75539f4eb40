"""The repository's own commands (``python -m scripts.demo``, ``python -m benchmarks.soak``), run as the README runs them."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_python_module(module: str, *args: str, status: int | None = 0) -> "subprocess.CompletedProcess[str]":
    """``python -m module args`` from the repository's root; it must exit ``status`` (None: any), else its
    whole output is the failure's message."""
    result = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    if status is not None:
        assert result.returncode == status, result.stdout + result.stderr
    return result
