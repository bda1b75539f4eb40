"""A private containerd instance for integration tests, driven through CRI v1.

Each ``Containerd`` owns one base directory: its config, root, state, log,
CNI dirs and (when the path is short enough) its sockets live under it, so
several instances can run side by side and nothing touches the system
containerd's /var/lib/containerd or /run/containerd (except the shim sockets,
which containerd 1.6 always puts in /run/containerd/s; see ``_shim_socket_paths``).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
from cri_api.v1 import api_pb2, api_pb2_grpc

from .images import BUSYBOX_PATH, PAUSE_REF, BuiltImage

CRI_NAMESPACE = "k8s.io"

REQUIRED_BINARIES: tuple[str, ...] = ("containerd", "containerd-shim-runc-v2", "runc", "ctr")

# Plugins that either cannot work here (no btrfs/zfs/aufs/devmapper on an ext4
# disk), would write outside our tree (opt writes /opt/containerd), or only add
# noise to the log (tracing). The legacy io.containerd.runtime.v1.linux must
# stay: tasks-service, and through it CRI, refuse to load without it.
DISABLED_PLUGINS: tuple[str, ...] = (
    "io.containerd.internal.v1.opt",
    "io.containerd.internal.v1.tracing",
    "io.containerd.snapshotter.v1.aufs",
    "io.containerd.snapshotter.v1.btrfs",
    "io.containerd.snapshotter.v1.devmapper",
    "io.containerd.snapshotter.v1.zfs",
    "io.containerd.tracing.processor.v1.otlp",
)

# Leave room for the ".ttrpc" suffix under the kernel's 108-byte sun_path.
MAX_SOCKET_PATH = 100

# containerd 1.6 hard-codes the shim socket directory, whatever `state` says.
SHIM_SOCKET_DIR = Path("/run/containerd/s")

MNT_DETACH = 2

# Pods and images may need a few seconds each on a loaded 2-core machine.
CRI_CALL_TIMEOUT = 30.0


class ContainerdError(RuntimeError):
    """The private containerd could not be started, used or cleaned up."""


class MissingBinariesError(ContainerdError):
    pass


class CleanupError(ContainerdError):
    """stop() could not remove everything; the message lists what is left."""


def require_binaries() -> None:
    """Raise MissingBinariesError naming every tool the harness needs but lacks."""
    # The shims find runc through PATH, so check the same PATH they will get.
    path = _daemon_env()["PATH"]
    missing = [name for name in REQUIRED_BINARIES if shutil.which(name, path=path) is None]
    if not os.access(BUSYBOX_PATH, os.X_OK):
        missing.append(str(BUSYBOX_PATH))
    if missing:
        raise MissingBinariesError(
            "integration tests need these binaries, which were not found: "
            + ", ".join(missing)
            + " (Debian: apt-get install containerd runc busybox-static)"
        )


def channel_options() -> list[tuple[str, int]]:
    """gRPC options for talking to a containerd that tests kill and restart.

    gRPC's default reconnect backoff grows to minutes; capping it keeps a
    channel usable within half a second of a restarted daemon listening again.
    """
    return [
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 500),
    ]


@dataclass(frozen=True)
class ContainerdPaths:
    base: Path
    config: Path
    log: Path
    root: Path
    state: Path
    runc_root: Path
    cni_conf_dir: Path
    cni_bin_dir: Path
    pod_logs: Path  # a convenient parent for tests' PodSandboxConfig.log_directory
    socket_dir: Path  # == base unless base is too deep for a unix socket path
    socket: Path
    ttrpc_socket: Path

    @classmethod
    def under(cls, base: Path) -> ContainerdPaths:
        socket_dir = base
        if len(str(base / "c.sock.ttrpc")) > MAX_SOCKET_PATH:
            socket_dir = Path(tempfile.mkdtemp(prefix="kcd-", dir="/tmp"))
        return cls(
            base=base,
            config=base / "config.toml",
            log=base / "containerd.log",
            root=base / "root",
            state=base / "state",
            runc_root=base / "state" / "runc",
            cni_conf_dir=base / "cni" / "net.d",
            cni_bin_dir=base / "cni" / "bin",
            pod_logs=base / "pod-logs",
            socket_dir=socket_dir,
            socket=socket_dir / "c.sock",
            ttrpc_socket=socket_dir / "c.sock.ttrpc",
        )


def _toml_str(value: str | Path) -> str:
    # A JSON string literal is a valid TOML basic string.
    return json.dumps(str(value))


def render_config(paths: ContainerdPaths, sandbox_image: str, log_level: str) -> str:
    """Return a version 2 containerd config.toml for a private CRI instance."""
    cri = '[plugins."io.containerd.grpc.v1.cri"]'
    disabled = ", ".join(_toml_str(p) for p in DISABLED_PLUGINS)
    return f"""\
version = 2
root = {_toml_str(paths.root)}
state = {_toml_str(paths.state)}
oom_score = 0
disabled_plugins = [{disabled}]
# Fail at startup, not at the first CRI call, if CRI cannot load.
required_plugins = ["io.containerd.grpc.v1.cri"]

[grpc]
  address = {_toml_str(paths.socket)}

[ttrpc]
  address = {_toml_str(paths.ttrpc_socket)}

[debug]
  level = {_toml_str(log_level)}

[metrics]
  address = ""

[plugins]
  {cri}
    sandbox_image = {_toml_str(sandbox_image)}
    # The VM lacks CAP_SYS_RESOURCE: nothing may get a lower oom_score_adj
    # than containerd itself has, or runc fails to start the container.
    restrict_oom_score_adj = true
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
    disable_tcp_service = true
    # apparmor_parser is not installed; never try to load a profile.
    disable_apparmor = true
    enable_selinux = false
    systemd_cgroup = false

    {cri[:-1]}.cni]
      # Empty on purpose: host-network pods need no CNI plugin.
      bin_dir = {_toml_str(paths.cni_bin_dir)}
      conf_dir = {_toml_str(paths.cni_conf_dir)}

    {cri[:-1]}.containerd]
      snapshotter = "overlayfs"
      default_runtime_name = "runc"

      {cri[:-1]}.containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"

        {cri[:-1]}.containerd.runtimes.runc.options]
          # runc's default state dir /run/containerd/runc is shared with any
          # other containerd; keeping it private lets stop() find our leftovers.
          Root = {_toml_str(paths.runc_root)}
          SystemdCgroup = false
"""


def _daemon_env() -> dict[str, str]:
    env = dict(os.environ)
    # runc lives in /usr/sbin, which a non-login PATH may lack.
    parts = env.get("PATH", "").split(os.pathsep)
    for extra in ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"):
        if extra not in parts:
            parts.append(extra)
    env["PATH"] = os.pathsep.join(p for p in parts if p)
    return env


def _iter_processes() -> Iterator[tuple[int, list[str]]]:
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            raw = Path(entry.path, "cmdline").read_bytes()
        except OSError:
            continue  # exited while we looked
        if raw:
            yield int(entry.name), raw.rstrip(b"\0").decode(errors="replace").split("\0")


def _flag_value(argv: list[str], flag: str) -> str | None:
    """Value of a Go-style flag (`-f v`, `--f v`, `-f=v`), given its bare name."""
    for i, arg in enumerate(argv[1:], start=1):
        name, sep, value = arg.lstrip("-").partition("=")
        if not arg.startswith("-") or name != flag:
            continue
        if sep:
            return value
        return argv[i + 1] if i + 1 < len(argv) else None
    return None


def _pids_matching(predicate: Callable[[list[str]], bool]) -> list[int]:
    return [pid for pid, argv in _iter_processes() if predicate(argv)]


def _pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # A zombie is dead for our purposes; its parent (not us) must reap it.
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _kill_and_wait(pids: Iterable[int], timeout: float = 5.0) -> list[int]:
    """SIGKILL `pids`; return those still alive after `timeout`."""
    pids = list(pids)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return _wait_gone(pids, timeout)


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        alive = [pid for pid in pids if _pid_alive(pid)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


def _unescape_mountinfo(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal.
    out, i = [], 0
    while i < len(field):
        code = field[i + 1 : i + 4]
        if field[i] == "\\" and len(code) == 3 and code.isdigit():
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounts_under(prefixes: Iterable[Path]) -> list[str]:
    """Mount points in our mount namespace at or below any of `prefixes`."""
    roots = [str(p) for p in prefixes]
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = _unescape_mountinfo(line.split()[4])
        if any(point == r or point.startswith(r + "/") for r in roots):
            found.append(point)
    return found


def _umount_detach(point: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.umount2(point.encode(), MNT_DETACH) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno), point)


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"<no log: {exc}>"
    return "\n".join(text.splitlines()[-lines:])


class Containerd:
    """One private containerd, owning `base_dir` entirely (stop() deletes it)."""

    def __init__(
        self,
        base_dir: Path,
        *,
        sandbox_image: str = PAUSE_REF,
        log_level: str = "info",
        start_timeout: float = 30.0,
    ) -> None:
        base_dir.mkdir(parents=True, exist_ok=True)
        self.paths = ContainerdPaths.under(base_dir.resolve())
        self.sandbox_image = sandbox_image
        self.log_level = log_level
        self.start_timeout = start_timeout
        self._process: subprocess.Popen[bytes] | None = None
        self._channel: grpc.Channel | None = None

    # -- addresses and clients ------------------------------------------------

    @property
    def address(self) -> str:
        """Filesystem path of containerd's gRPC socket (what ctr --address takes)."""
        return str(self.paths.socket)

    @property
    def endpoint(self) -> str:
        """gRPC target for the CRI socket, e.g. for a proxy's backend setting."""
        return f"unix://{self.paths.socket}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self.is_running() and self._process else None

    def channel(self) -> grpc.Channel:
        # One channel for the instance's lifetime: it reconnects across restarts.
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.endpoint, options=channel_options())
        return self._channel

    def runtime(self) -> Any:
        """A CRI v1 RuntimeServiceStub bound to this containerd."""
        return api_pb2_grpc.RuntimeServiceStub(self.channel())

    def images(self) -> Any:
        """A CRI v1 ImageServiceStub bound to this containerd."""
        return api_pb2_grpc.ImageServiceStub(self.channel())

    def log_tail(self, lines: int = 40) -> str:
        return _tail(self.paths.log, lines)

    # -- lifecycle --------------------------------------------------------------

    def write_config(self) -> Path:
        for directory in (
            self.paths.root,
            self.paths.state,
            self.paths.cni_conf_dir,
            self.paths.cni_bin_dir,
            self.paths.pod_logs,
        ):
            directory.mkdir(parents=True, exist_ok=True)
        self.paths.config.write_text(render_config(self.paths, self.sandbox_image, self.log_level))
        return self.paths.config

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self, timeout: float | None = None) -> None:
        """Spawn containerd (reusing root/state if present) and wait for CRI."""
        if self.is_running():
            raise ContainerdError(f"containerd already running as pid {self.pid}")
        require_binaries()
        self.write_config()
        with self.paths.log.open("ab") as log:
            log.write(f"=== koordrp test harness: starting containerd at {time.ctime()} ===\n".encode())
            log.flush()
            # A new session keeps a Ctrl-C in the test terminal from killing
            # containerd before the test's own cleanup runs.
            self._process = subprocess.Popen(
                ["containerd", "--config", str(self.paths.config)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_daemon_env(),
                start_new_session=True,
            )
        self._wait_for_cri(self.start_timeout if timeout is None else timeout)

    def _wait_for_cri(self, timeout: float) -> None:
        assert self._process is not None
        deadline = time.monotonic() + timeout
        last_error = "socket not created yet"
        runtime = self.runtime()
        while True:
            code = self._process.poll()
            if code is not None:
                raise ContainerdError(
                    f"containerd exited with status {code} during startup; log tail:\n{self.log_tail()}"
                )
            if self.paths.socket.exists():
                try:
                    runtime.Version(api_pb2.VersionRequest(), timeout=1.0)
                    return
                except grpc.RpcError as exc:
                    last_error = f"{exc.code()}: {exc.details()}"
            if time.monotonic() >= deadline:
                self.kill()
                raise ContainerdError(
                    f"containerd did not answer CRI Version within {timeout:.0f}s "
                    f"(last error: {last_error}); log tail:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the daemon only, as a crash would: shims and pods survive."""
        if self._process is None:
            return
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()

    def terminate(self, timeout: float = 10.0) -> None:
        """Stop the daemon gracefully (SIGTERM, then SIGKILL); pods survive."""
        if self._process is None:
            return
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def restart(self, *, crash: bool = False, timeout: float | None = None) -> None:
        """Stop the daemon (SIGKILL if `crash`) and start it on the same root/state."""
        if crash:
            self.kill()
        else:
            self.terminate()
        self.start(timeout)

    # -- images -----------------------------------------------------------------

    def import_images(self, images: Iterable[BuiltImage], timeout: float = 60.0) -> None:
        """Import docker-archive tars with ctr, then wait until CRI lists them."""
        images = list(images)
        for image in images:
            cmd = ["ctr", "--address", self.address, "-n", CRI_NAMESPACE, "images", "import", str(image.archive)]
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_daemon_env())
            if result.returncode != 0:
                raise ContainerdError(
                    f"{' '.join(cmd)} failed ({result.returncode}): {result.stderr.strip() or result.stdout.strip()}"
                )
        self._wait_for_images(images, timeout)

    def _wait_for_images(self, images: list[BuiltImage], timeout: float) -> None:
        # CRI learns about images from containerd events, so they can show up
        # a moment after ctr has returned.
        deadline = time.monotonic() + timeout
        while True:
            listed = self.images().ListImages(api_pb2.ListImagesRequest(), timeout=CRI_CALL_TIMEOUT).images
            by_tag = {tag: img.id for img in listed for tag in img.repo_tags}
            missing = [i.ref for i in images if by_tag.get(i.ref) != i.image_id]
            if not missing:
                return
            if time.monotonic() >= deadline:
                raise ContainerdError(f"images not visible via CRI ListImages after import: {missing}; saw {by_tag}")
            time.sleep(0.1)

    # -- teardown ---------------------------------------------------------------

    def remove_all_pods(self) -> list[str]:
        """Stop and remove every container and pod sandbox; return error strings."""
        errors: list[str] = []
        runtime = self.runtime()

        def attempt(what: str, call: Callable[[], object]) -> None:
            try:
                call()
            except grpc.RpcError as exc:
                errors.append(f"{what}: {exc.code()}: {exc.details()}")

        try:
            sandboxes = runtime.ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=CRI_CALL_TIMEOUT).items
            containers = runtime.ListContainers(api_pb2.ListContainersRequest(), timeout=CRI_CALL_TIMEOUT).containers
        except grpc.RpcError as exc:
            return [f"listing pods: {exc.code()}: {exc.details()}"]
        # Containers first, with timeout 0 (straight SIGKILL): tests' workloads
        # often run as PID 1 without a TERM handler and would burn the grace period.
        for ctr in containers:
            attempt(
                f"StopContainer {ctr.id}",
                lambda: runtime.StopContainer(
                    api_pb2.StopContainerRequest(container_id=ctr.id, timeout=0), timeout=CRI_CALL_TIMEOUT
                ),
            )
            attempt(
                f"RemoveContainer {ctr.id}",
                lambda: runtime.RemoveContainer(
                    api_pb2.RemoveContainerRequest(container_id=ctr.id), timeout=CRI_CALL_TIMEOUT
                ),
            )
        for sb in sandboxes:
            attempt(
                f"StopPodSandbox {sb.id}",
                lambda: runtime.StopPodSandbox(
                    api_pb2.StopPodSandboxRequest(pod_sandbox_id=sb.id), timeout=CRI_CALL_TIMEOUT
                ),
            )
            attempt(
                f"RemovePodSandbox {sb.id}",
                lambda: runtime.RemovePodSandbox(
                    api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sb.id), timeout=CRI_CALL_TIMEOUT
                ),
            )
        return errors

    def daemon_pids(self) -> list[int]:
        """Every containerd process running with our config (ours or orphaned)."""
        config = str(self.paths.config)
        return _pids_matching(
            lambda argv: os.path.basename(argv[0]) == "containerd" and _flag_value(argv, "config") == config
        )

    def shim_pids(self) -> list[int]:
        """containerd-shim-runc-v2 processes that report to our socket."""
        address = self.address
        return _pids_matching(
            lambda argv: os.path.basename(argv[0]).startswith("containerd-shim")
            and _flag_value(argv, "address") == address
        )

    def mounts(self) -> list[str]:
        return mounts_under({self.paths.base, self.paths.socket_dir})

    def stop(self) -> None:
        """Tear everything down and delete the base dir; raise CleanupError on leaks.

        Every step is best effort so that one failure does not leave the rest
        behind; what could not be removed is reported at the end.
        """
        notes: list[str] = []
        if self.is_running():
            notes += self.remove_all_pods()
            # Shims exit by themselves once CRI deleted their tasks, but not
            # instantly. Waiting while containerd is still up lets it reap
            # them; orphaned, they would linger as zombies until PID 1 reaps.
            _wait_gone(self.shim_pids(), 3.0)
        self.terminate()
        self._process = None
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        notes += self._kill_leftovers()
        shim_sockets = self._shim_socket_paths()
        notes += self._unmount_all()
        for sock in shim_sockets:
            sock.unlink(missing_ok=True)
        leftovers = self.daemon_pids() + self.shim_pids()
        mounts = self.mounts()
        if leftovers or mounts:
            # Never rmtree over a live mount: it would delete through it.
            raise CleanupError(
                f"containerd cleanup incomplete: processes {leftovers}, mounts {mounts}; notes: {notes}"
            )
        shutil.rmtree(self.paths.base, ignore_errors=True)
        if self.paths.socket_dir != self.paths.base:
            shutil.rmtree(self.paths.socket_dir, ignore_errors=True)

    def _kill_leftovers(self) -> list[str]:
        notes: list[str] = []
        alive = _kill_and_wait(self.daemon_pids())
        if alive:
            notes.append(f"containerd pids survived SIGKILL: {alive}")
        notes += self._delete_runc_containers()
        alive = _kill_and_wait(self.shim_pids())
        if alive:
            notes.append(f"shim pids survived SIGKILL: {alive}")
        return notes

    def _delete_runc_containers(self) -> list[str]:
        # Killing a shim does not kill its container (the init is reparented),
        # so containers still known to runc are force-deleted through runc.
        notes: list[str] = []
        if not self.paths.runc_root.is_dir():
            return notes
        for ns_root in sorted(self.paths.runc_root.iterdir()):
            for container in sorted(p.name for p in ns_root.iterdir() if p.is_dir()):
                cmd = ["runc", "--root", str(ns_root), "delete", "--force", container]
                result = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=_daemon_env())
                if result.returncode != 0:
                    notes.append(f"{' '.join(cmd)}: {result.stderr.strip()}")
        return notes

    def _shim_socket_paths(self) -> list[Path]:
        # Each task bundle records its shim's socket address; a SIGKILLed shim
        # never removes that socket from the shared /run/containerd/s.
        sockets = []
        for address_file in self.paths.state.glob("io.containerd.runtime.v2.task/*/*/address"):
            try:
                address = address_file.read_text().strip()
            except OSError:
                continue
            path = Path(address.removeprefix("unix://"))
            if path.parent == SHIM_SOCKET_DIR:
                sockets.append(path)
        return sockets

    def _unmount_all(self) -> list[str]:
        notes: list[str] = []
        # Deepest first, and several passes, since unmounting a parent can
        # reveal mounts that were stacked below it.
        for _ in range(5):
            points = self.mounts()
            if not points:
                break
            for point in sorted(set(points), key=len, reverse=True):
                try:
                    _umount_detach(point)
                except OSError as exc:
                    notes.append(f"umount {point}: {exc}")
        return notes

    def __enter__(self) -> Containerd:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
