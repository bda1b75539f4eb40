"""A hook server that answers PreCreateContainer late, as a slow koordlet on a loaded node does, in a process of its own.

    python -m benchmarks.slow_hook_server SOCKET SECONDS

Each PreCreateContainer is answered after SECONDS (``inf``: never, a wedged server) with cpu shares 512
and an environment variable. Prints ``ready`` once it listens, and serves until SIGTERM.
"""

import signal
import subprocess
import sys
import threading
from typing import Any, ContextManager

from benchmarks.processes import running_module
from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from tests.fake.hook_server import FakeHookServer

SHARES = 512
"""The cpu shares its answer gives a container."""


def answer(request: Any) -> hook.ContainerResourceHookResponse:
    return hook.ContainerResourceHookResponse(
        container_resources=hook.LinuxContainerResources(cpu_shares=SHARES), container_envs={"SLOW": "1"}
    )


def main() -> None:
    seconds = float(sys.argv[2])
    server = FakeHookServer(sys.argv[1])
    server.behaviours["PreCreateContainerHook"] = answer
    server.delays["PreCreateContainerHook"] = 10**6 if seconds == float("inf") else seconds
    server.start()
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda received, frame: stopping.set())
    print("ready", flush=True)
    stopping.wait()
    server.stop()


def running(socket: str, seconds: float) -> ContextManager["subprocess.Popen[bytes]"]:
    """This server as a process of its own on ``socket`` until the block ends."""
    return running_module("benchmarks.slow_hook_server", socket, repr(seconds) if seconds != float("inf") else "inf")


if __name__ == "__main__":
    main()
