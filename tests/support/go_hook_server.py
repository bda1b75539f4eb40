"""The grpc-go hook server (tests/go_hook_server/main.go, built by scripts/build-go) as a test's child process,
and the answers it gives."""

import os
import select
import signal
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Sequence

from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from koordrp.hooks.messages import HookRequest, HookResponse
from koordrp.hooks.types import HookType
from koordrp.sdk import reply
from tests.support.daemons import MissingBinariesError

BINARY = Path(__file__).resolve().parents[2] / ".deps" / "go-hook-server"
CGROUP_PARENT = "/koordrp-go-hook"
"""The cgroup_parent its PreRunPodSandboxHook answers (its --cgroup-parent's default)."""
CPUSET = "0"
"""The container_resources.cpuset_cpus its PreCreateContainerHook and PreUpdateContainerResourcesHook answer."""
CPUSET_HOOKS = (HookType.PRE_CREATE_CONTAINER, HookType.PRE_UPDATE_CONTAINER_RESOURCES)


def require_binary() -> None:
    """MissingBinariesError (the tests skip, or fail in CI) unless the server is built."""
    if not os.access(BINARY, os.X_OK):
        raise MissingBinariesError(f"{BINARY} is missing: scripts/build-go builds it (scripts/test runs it first)")


def echo_answer(hook_type: HookType, request: HookRequest) -> HookResponse:
    """What the server answers ``request`` with (``--answer echo``): the request's fields koordlet copies into its
    response (``koordrp.sdk.reply``'s answer), with the cgroup parent or the cpuset its default plugins set."""
    if isinstance(request, hook.PodSandboxHookRequest):
        pod = reply(request)
        if hook_type is HookType.PRE_RUN_POD_SANDBOX:
            pod.cgroup_parent = CGROUP_PARENT
        return pod
    container = reply(request)
    if hook_type in CPUSET_HOOKS:
        container.container_resources.cpuset_cpus = CPUSET
    return container


class GoHookServer:
    """``go-hook-server --socket SOCKET ARGS`` until stopped; ``start`` returns once it printed ``ready``."""

    def __init__(self, socket: Path, args: Sequence[str] = ()) -> None:
        self.socket = socket
        self.args = list(args)
        self.errors = socket.with_name(socket.name + ".stderr")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """How a hookserver.d file, and koordrp's HookClient, name it: the socket's path."""
        return str(self.socket)

    def start(self, timeout: float = 30.0) -> "GoHookServer":
        with open(self.errors, "ab") as errors:
            self.process = subprocess.Popen(
                [str(BINARY), "--socket", str(self.socket), *self.args], stdout=subprocess.PIPE, stderr=errors
            )
        assert self.process.stdout is not None
        line = self._line(self.process.stdout.fileno(), time.monotonic() + timeout)
        if line != b"ready\n":
            self.kill()
            raise AssertionError(f"go-hook-server printed {line!r}, not ready; its stderr: {self.stderr()!r}")
        return self

    def _line(self, fd: int, deadline: float) -> bytes:
        """Its first line of output (b"" if it exits first); read byte by byte, so that nothing after it is taken."""
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return line
            byte = os.read(fd, 1)
            if not byte:
                return line
            line += byte
        return line

    def stderr(self) -> str:
        return self.errors.read_text(errors="replace") if self.errors.exists() else ""

    def stop(self) -> None:
        """SIGTERM: grpc-go's GracefulStop (a GOAWAY); it removes its socket."""
        self._end(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL, as a crash: the connection drops with no GOAWAY, and the socket file stays."""
        self._end(signal.SIGKILL)

    def _end(self, how: signal.Signals) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(how)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        assert process.stdout is not None
        process.stdout.close()

    def __enter__(self) -> "GoHookServer":
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, trace: TracebackType | None) -> None:
        self.stop()
