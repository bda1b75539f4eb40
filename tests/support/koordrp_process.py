"""``twistd -n koordrp`` as a real child process, the way an operator runs it."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

import grpc
from cri_api.v1 import api_pb2, api_pb2_grpc


def twistd_path() -> str:
    """The twistd of the interpreter running the tests, so the installed koordrp is the one tested."""
    beside = Path(sys.executable).with_name("twistd")
    found = str(beside) if beside.exists() else shutil.which("twistd")
    if found is None:
        raise RuntimeError("twistd is not installed next to the test interpreter")
    return found


# What koordrp logs once it serves: its socket in proxy mode; in NRI mode, once containerd has synchronized it.
_SERVING = "] serving "
_SYNCHRONIZED = "] store rebuilt from containerd's NRI"


class KoordrpProcess:
    def __init__(
        self,
        base: Path,
        runtime_endpoint: str,
        extra_args: Sequence[str] = (),
        environ: Mapping[str, str] | None = None,
        nri_socket: Path | None = None,
        twistd: str | None = None,
    ) -> None:
        """``nri_socket``: koordrp runs as a plugin of the containerd NRI listens there (NRI mode); ``twistd``: the
        twistd that runs it (default: the one beside the test interpreter), e.g. an older checkout's, to compare."""
        self.base = base
        self.twistd = twistd
        self.nri_socket = nri_socket
        self.environ = {**os.environ, **(environ or {})}
        self.socket = base / "koordrp" / "koordrp.sock"
        self.logfile = base / "koordrp.log"
        self.runtime_endpoint = runtime_endpoint
        self.extra_args = list(extra_args)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"unix://{self.socket}"

    def argv(self) -> list[str]:
        return [
            self.twistd or twistd_path(),
            "-n",
            "--pidfile=",
            f"--logfile={self.logfile}",
            "koordrp",
            f"--koord-runtimeproxy-endpoint={self.endpoint}",
            f"--hook-config-dir={self.base / 'hookserver.d'}",
            f"--state-dir={self.base / 'state'}",
            *self.mode_args(),
            *self.extra_args,
        ]

    def mode_args(self) -> list[str]:
        """The runtime's socket for a proxy; NRI mode reaches containerd by its NRI socket alone."""
        if self.nri_socket is None:
            return [f"--remote-runtime-service-endpoint={self.runtime_endpoint}"]
        return ["--backend-runtime-mode=NRI", f"--nri-socket={self.nri_socket}"]

    @property
    def ready_line(self) -> str:
        return _SERVING if self.nri_socket is None else _SYNCHRONIZED

    def start(self, timeout: float = 20.0, ready: str | None = None) -> None:
        """Until koordrp serves (NRI mode: is containerd's plugin), or has logged ``ready`` if given."""
        earlier = len(self.log())
        awaited = self.ready_line if ready is None else ready
        self.process = subprocess.Popen(self.argv(), cwd=self.base, stdin=subprocess.DEVNULL, env=self.environ)
        deadline = time.monotonic() + timeout
        # The log line, not the socket file: a stale socket may already be there.
        while awaited not in self.log()[earlier:]:
            if self.process.poll() is not None:
                raise RuntimeError(f"koordrp exited with {self.process.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"koordrp did not log {awaited!r} within {timeout}s:\n{self.log()}")
            time.sleep(0.05)

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.endpoint)

    def runtime(self, channel: grpc.Channel) -> api_pb2_grpc.RuntimeServiceStub:
        return api_pb2_grpc.RuntimeServiceStub(channel)

    def answers(self, channel: grpc.Channel) -> bool:
        try:
            self.runtime(channel).Version(api_pb2.VersionRequest(), timeout=2)
        except grpc.RpcError:
            return False
        return True

    def wait_answering(self, channel: grpc.Channel, timeout: float = 60.0) -> None:
        """Once koordrp answers a CRI call on ``channel`` (its runtime back): a generous bound, not a measure."""
        deadline = time.monotonic() + timeout
        while not self.answers(channel):
            if time.monotonic() > deadline:
                raise AssertionError(f"koordrp did not answer within {timeout:g}s:\n{self.log()}")
            time.sleep(0.05)

    def log(self) -> str:
        """Everything koordrp has logged so far (since twistd last rotated the file: see ``whole_log``)."""
        return self.logfile.read_text(errors="replace") if self.logfile.exists() else ""

    def warnings(self) -> list[str]:
        """Every warn, error and critical line koordrp has logged so far."""
        return [line for line in self.log().splitlines() if re.search(r"#(warn|error|critical)\] ", line)]

    def whole_log(self) -> str:
        """Everything koordrp has logged, what twistd rotated out included."""
        return "".join(path.read_text(errors="replace") for path in log_files(self.logfile))

    def log_lines(self, containing: str, count: int = 1, timeout: float = 30.0) -> list[str]:
        """The whole log lines with ``containing`` in them, once there are ``count`` (or ``timeout``, a generous
        bound, is up).

        A CRI call's line is written just after the call has answered, so it may not be there yet
        when the caller has its answer, or be there only in part: a line still being written is not read.
        """
        deadline = time.monotonic() + timeout
        while True:
            written = self.log()
            whole = written[: written.rfind("\n") + 1]
            lines = [line for line in whole.splitlines() if containing in line]
            if len(lines) >= count or time.monotonic() > deadline:
                return lines
            time.sleep(0.02)

    def registered_servers(self) -> int | None:
        """How many hook servers koordrp's last "hook servers:" log line names (None before the first)."""
        lines = [line for line in self.log().splitlines() if "] hook servers: " in line]
        if not lines:
            return None
        listed = lines[-1].split("] hook servers: ", 1)[1]
        return 0 if listed == "none" else listed.count(".json (")

    def wait_for_registrations(self, *texts: str, timeout: float = 5.0) -> str:
        """Until koordrp's last "hook servers:" line has every one of ``texts`` in it; that line."""
        deadline = time.monotonic() + timeout
        while True:
            lines = [line for line in self.log().splitlines() if "] hook servers: " in line]
            if lines and all(text in lines[-1] for text in texts):
                return lines[-1]
            if time.monotonic() > deadline:
                raise AssertionError(f"koordrp's hook servers did not come to name {texts} within {timeout}s:\n{self.log()}")
            time.sleep(0.02)

    def wait_for_servers(self, count: int, timeout: float = 5.0) -> None:
        """Until koordrp's log says exactly ``count`` hook servers are registered."""
        deadline = time.monotonic() + timeout
        while self.registered_servers() != count:
            if time.monotonic() > deadline:
                raise AssertionError(f"koordrp did not register {count} hook servers within {timeout}s:\n{self.log()}")
            time.sleep(0.02)

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM, as systemd stops it; returns the exit status."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                self.terminate(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


def log_files(logfile: Path) -> list[Path]:
    """``logfile`` and the files twistd rotated it to, oldest first: twistd rotates it every megabyte
    (``.1`` is the latest rotated out, the highest number the oldest)."""
    rotated = [path for path in logfile.parent.glob(logfile.name + ".*") if path.suffix[1:].isdigit()]
    rotated.sort(key=lambda path: int(path.suffix[1:]), reverse=True)
    return [*rotated, *([logfile] if logfile.exists() else [])]


def _status_bytes(pid: int, name: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(f"{name}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {name} for {pid}")


def rss_bytes(pid: int) -> int:
    return _status_bytes(pid, "VmRSS")


def peak_rss_bytes(pid: int) -> int:
    """The most ``pid`` has held in memory since it started, or since ``reset_peak_rss``."""
    return _status_bytes(pid, "VmHWM")


def reset_peak_rss(pid: int) -> None:
    """Bring ``pid``'s peak RSS down to its RSS now (Linux ≥ 4.0; the process's owner or root), if we may."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        pass  # the peak stays: growth measured against it is only overstated


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of ``pid`` and its threads, from /proc."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks
