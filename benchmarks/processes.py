"""The benchmarks' stand-ins run as processes of their own, so that they do not share koordrp's or the
measuring process's GIL."""

import contextlib
import subprocess
import sys
from typing import Iterator, Sequence


@contextlib.contextmanager
def running(argv: Sequence[str]) -> Iterator["subprocess.Popen[bytes]"]:
    """``argv`` until the block ends; entered once it printed ``ready``."""
    process = subprocess.Popen(list(argv), stdout=subprocess.PIPE)
    try:
        assert process.stdout is not None and process.stdout.readline().strip() == b"ready"
        yield process
    finally:
        process.terminate()
        process.wait(10)


def running_module(module: str, *args: str) -> contextlib.AbstractContextManager["subprocess.Popen[bytes]"]:
    """``python -m module args`` until the block ends; entered once it printed ``ready``."""
    return running([sys.executable, "-m", module, *args])
