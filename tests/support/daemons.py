"""What the private containerd and dockerd test harnesses share.

Both run one daemon in its own session, logging to a file under the
harness's base directory, and find their processes (and orphans of an earlier
run) through /proc. Both end up with a containerd whose shims and runc
containers outlive it, so stopping either means undoing the same leftovers:
shims and containers, shim sockets in the shared /run/containerd/s, mounts
and cgroups. ``Daemon`` holds the lifecycle; the functions hold the rest.
"""

from __future__ import annotations

import abc
import ctypes
import errno
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
from typing import ClassVar, Generic, Self, TypeVar

# Leave room for the ".ttrpc" suffix under the kernel's 108-byte sun_path.
MAX_SOCKET_PATH = 100

# containerd 1.6 and 1.7 hard-code the shim socket directory, whatever `state` says.
SHIM_SOCKET_DIR = Path("/run/containerd/s")

MNT_DETACH = 2


class DaemonError(RuntimeError):
    """A private daemon could not be started, used or cleaned up."""


class MissingBinariesError(DaemonError):
    """This machine lacks a binary a harness needs: its tests skip, or fail in CI."""


class CleanupError(DaemonError):
    """stop() could not remove everything; the message lists what is left."""


# -- environment and binaries ----------------------------------------------------


def daemon_env(path_first: Iterable[Path] = ()) -> dict[str, str]:
    """Our environment, with a PATH on which daemons and shims find their helpers.

    `path_first`: directories searched before anything else, e.g. an unpacked containerd release's
    bin dir, so that its containerd finds its own shim (containerd looks its shims up on PATH).
    """
    env = dict(os.environ)
    first = [str(directory) for directory in path_first]
    # runc lives in /usr/sbin, which a non-login PATH may lack.
    parts = first + [p for p in env.get("PATH", "").split(os.pathsep) if p not in first]
    for extra in ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"):
        if extra not in parts:
            parts.append(extra)
    env["PATH"] = os.pathsep.join(p for p in parts if p)
    return env


def missing_binaries(names: Iterable[str]) -> list[str]:
    """Those of `names` that are not on the PATH the daemons get."""
    # Daemons find containerd, the shims and runc through PATH, so check the
    # same PATH they will get, not ours.
    path = daemon_env()["PATH"]
    return [name for name in names if shutil.which(name, path=path) is None]


def check_binaries(
    names: Iterable[str],
    *,
    files: Iterable[Path] = (),
    tests: str,
    packages: str,
    remedy: str | None = None,
) -> None:
    """Raise MissingBinariesError naming every one of `names` (on PATH) and `files` this machine lacks.

    `tests` and `packages` complete the message: who needs them, what to install; `remedy`, if
    given, says how to get them instead of "Debian: apt-get install `packages`".
    """
    missing = missing_binaries(names) + [str(f) for f in files if not os.access(f, os.X_OK)]
    if missing:
        raise MissingBinariesError(
            f"{tests} need these binaries, which were not found: "
            + ", ".join(missing)
            + f" ({remedy or f'Debian: apt-get install {packages}'})"
        )


def socket_dir_for(base: Path, longest_socket: str, prefix: str) -> Path:
    """`base`, unless `base`/`longest_socket` is too long a unix socket path: then a new dir in /tmp."""
    if len(str(base / longest_socket)) > MAX_SOCKET_PATH:
        return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    return base


def tail(path: Path, lines: int) -> str:
    """The last `lines` lines of a log, or why there is none (for error messages)."""
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"<no log: {exc}>"
    return "\n".join(text.splitlines()[-lines:])


# -- processes ---------------------------------------------------------------------


def iter_processes() -> Iterator[tuple[int, list[str]]]:
    """(pid, argv) of every process with a command line."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            raw = Path(entry.path, "cmdline").read_bytes()
        except OSError:
            continue  # exited while we looked
        if raw:
            yield int(entry.name), raw.rstrip(b"\0").decode(errors="replace").split("\0")


def flag_value(argv: list[str], flag: str) -> str | None:
    """Value of a Go-style flag (`-f v`, `--f v`, `-f=v`), given its bare name."""
    for i, arg in enumerate(argv[1:], start=1):
        name, sep, value = arg.lstrip("-").partition("=")
        if not arg.startswith("-") or name != flag:
            continue
        if sep:
            return value
        return argv[i + 1] if i + 1 < len(argv) else None
    return None


def pids_matching(predicate: Callable[[list[str]], bool]) -> list[int]:
    return [pid for pid, argv in iter_processes() if predicate(argv)]


def find_containerd(config: str | Path) -> list[int]:
    """Every containerd process running with `config` (a harness's own, or its orphan)."""
    # Matching on the config, not on a pid we remember, also finds a
    # containerd left by an earlier run or restarted behind our back.
    config = str(config)
    return pids_matching(
        lambda argv: os.path.basename(argv[0]) == "containerd" and flag_value(argv, "config") == config
    )


def find_shims(address: str | Path) -> list[int]:
    """containerd-shim-runc-v2 processes that report to the containerd socket at `address`."""
    address = str(address)
    return pids_matching(
        lambda argv: os.path.basename(argv[0]).startswith("containerd-shim") and flag_value(argv, "address") == address
    )


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # A zombie is dead for our purposes; its parent (not us) must reap it.
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def kill_and_wait(pids: Iterable[int], timeout: float = 5.0) -> list[int]:
    """SIGKILL `pids`; return those still alive after `timeout`."""
    pids = list(pids)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return wait_gone(pids, timeout)


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait up to `timeout` for `pids` to exit; return those still alive."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [pid for pid in pids if pid_alive(pid)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


def kill_noting(what: str, pids: Iterable[int]) -> list[str]:
    """SIGKILL `pids` (`what` names them); a note for stop()'s report if any survive."""
    alive = kill_and_wait(pids)
    return [f"{what} pids survived SIGKILL: {alive}"] if alive else []


# -- mounts ------------------------------------------------------------------------


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


def umount_detach(point: str) -> None:
    # Lazy (MNT_DETACH): a mount still busy, e.g. a dying container's rootfs,
    # goes from our namespace now instead of failing with EBUSY.
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.umount2(point.encode(), MNT_DETACH) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), point)


def unmount_all(mounts: Callable[[], list[str]]) -> list[str]:
    """Unmount everything `mounts()` lists until it lists nothing; return notes on failures."""
    notes: list[str] = []
    # Deepest first, and several passes, since unmounting a parent can
    # reveal mounts that were stacked below it.
    for _ in range(5):
        points = mounts()
        if not points:
            break
        for point in sorted(set(points), key=len, reverse=True):
            try:
                umount_detach(point)
            except OSError as exc:
                # EINVAL/ENOENT: already gone, e.g. detached along with its parent.
                if exc.errno not in (errno.EINVAL, errno.ENOENT):
                    notes.append(f"umount {point}: {exc}")
    return notes


# -- containerd's leftovers --------------------------------------------------------


def delete_runc_containers(runc_root: Path) -> list[str]:
    """`runc delete --force` every container under `runc_root`/<namespace>; return notes on failures."""
    # Killing a shim does not kill its container (the init is reparented),
    # so containers still known to runc are force-deleted through runc,
    # which also removes their cgroups.
    notes: list[str] = []
    if not runc_root.is_dir():
        return notes
    for ns_root in sorted(p for p in runc_root.iterdir() if p.is_dir()):
        for container in sorted(p.name for p in ns_root.iterdir() if p.is_dir()):
            cmd = ["runc", "--root", str(ns_root), "delete", "--force", container]
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=daemon_env())
            if result.returncode != 0:
                notes.append(f"{' '.join(cmd)}: {result.stderr.strip()}")
    return notes


def shim_socket_paths(containerd_state: Path) -> list[Path]:
    """The shim sockets in SHIM_SOCKET_DIR of the tasks under a containerd's state dir."""
    # Each task bundle records its shim's socket address; a SIGKILLed shim
    # never removes that socket from the shared /run/containerd/s.
    sockets = []
    for address_file in containerd_state.glob("io.containerd.runtime.v2.task/*/*/address"):
        try:
            address = address_file.read_text().strip()
        except OSError:
            continue
        path = Path(address.removeprefix("unix://"))
        if path.parent == SHIM_SOCKET_DIR:
            sockets.append(path)
    return sockets


def force_cleanup(
    daemons: Iterable[tuple[str, list[int]]],
    shims: Callable[[], list[int]],
    runc_root: Path,
    containerd_state: Path,
    mounts: Callable[[], list[str]],
) -> list[str]:
    """Kill whatever survived a daemon's stop and undo what that leaves; return notes on failures.

    `daemons`: (name, pids) pairs, killed in that order, before anything else.
    `shims`, `mounts`: list what is left right now, as each step changes that.
    """
    notes: list[str] = []
    for what, pids in daemons:
        notes += kill_noting(what, pids)
    notes += delete_runc_containers(runc_root)
    notes += kill_noting("shim", shims())
    sockets = shim_socket_paths(containerd_state)
    notes += unmount_all(mounts)
    for sock in sockets:
        sock.unlink(missing_ok=True)
    return notes


def remove_trees(*dirs: Path) -> list[Path]:
    """rmtree each of `dirs`, best effort; return those still there."""
    # The same directory may be passed twice (a harness's base and its socket
    # dir coincide unless the base is too deep); the second rmtree is a no-op.
    for directory in dirs:
        shutil.rmtree(directory, ignore_errors=True)
    return [directory for directory in dirs if directory.exists()]


# -- cgroups -----------------------------------------------------------------------


def cgroup_mounts() -> list[Path]:
    """Mount points of every cgroup hierarchy (v1 controllers, named, and v2)."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        fstype = fields[fields.index("-") + 1]
        if fstype in ("cgroup", "cgroup2"):
            points.append(Path(fields[4]))
    return points


def cgroup_dirs(cgroup_path: str) -> list[Path]:
    """The existing directories of one cgroupfs-driver path in every hierarchy."""
    relative = cgroup_path.strip("/")
    if not relative:
        return []  # never the root cgroup
    return [d for d in (m / relative for m in cgroup_mounts()) if d.is_dir()]


def remove_cgroup(cgroup_path: str) -> list[str]:
    """Remove one cgroupfs-driver path (and its children) from every hierarchy; says what stayed."""
    return [note for directory in cgroup_dirs(cgroup_path) for note in rmdir_tree(directory)]


def rmdir_tree(top: Path) -> list[str]:
    """rmdir a cgroup directory and its children, deepest first."""
    notes: list[str] = []
    # A cgroup directory cannot be rmtree'd (its control files cannot be
    # unlinked); rmdir of each directory, children first, is the only way.
    dirs = [Path(root) for root, _, _ in os.walk(top)]
    for directory in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
        try:
            directory.rmdir()
        except FileNotFoundError:
            pass
        except OSError as exc:
            notes.append(f"rmdir {directory}: {exc.strerror}")
    return notes


# -- the daemon process ------------------------------------------------------------


@dataclass(frozen=True)
class DaemonPaths:
    """The paths every harness has, and Daemon works with."""

    base: Path
    log: Path
    socket: Path  # the daemon's API socket: start() probes it once it exists
    socket_dir: Path  # == base unless base is too deep for unix socket paths
    runc_root: Path  # runc's --root for the containers of the harness's containerd


PathsT = TypeVar("PathsT", bound=DaemonPaths)


class Daemon(abc.ABC, Generic[PathsT]):
    """One private daemon, owning `paths.base` (and `paths.socket_dir`) entirely.

    Runs the daemon, and tears down what it and its containerd leave behind.
    A subclass says what to run (``argv``), what to do first (``prepare``),
    how to tell it answers (``probe``), which processes are its daemons
    (``daemon_pids``) and what ``stop`` checks and reports.
    """

    # The binary's name, for the log and for error messages.
    name: ClassVar[str]
    # What start() raises, e.g. ContainerdError.
    error: ClassVar[type[DaemonError]]
    # What the daemon answers once ready, for the start-up timeout message.
    probe_name: ClassVar[str]
    # terminate()'s grace period before SIGKILL.
    terminate_timeout: ClassVar[float] = 10.0

    def __init__(
        self,
        paths: PathsT,
        start_timeout: float,
        *,
        containerd_socket: Path,
        containerd_state: Path,
        cwd: Path | None = None,
    ) -> None:
        """`containerd_socket`, `containerd_state`: of the containerd running the containers (ours, or dockerd's)."""
        self.paths = paths
        self.start_timeout = start_timeout
        self._containerd_socket = containerd_socket
        self._containerd_state = containerd_state
        self._cwd = cwd
        self._process: subprocess.Popen[bytes] | None = None

    @abc.abstractmethod
    def argv(self) -> list[str]:
        """The daemon's command line."""

    @abc.abstractmethod
    def prepare(self) -> None:
        """Check binaries and write config before each start()."""

    @abc.abstractmethod
    def probe(self) -> str | None:
        """Ask the daemon, once its socket exists, whether it is ready: None if so, else why not."""

    @abc.abstractmethod
    def daemon_pids(self) -> list[int]:
        """Every process of this daemon (ours or orphaned), found by what its command line names of our tree."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Tear everything down and delete the base dir; raise CleanupError on leaks.

        Every step is best effort so that one failure does not leave the rest
        behind; what could not be removed is reported at the end.
        """

    def exited(self) -> None:
        """Called once the daemon process is gone (killed or terminated), to wait for what dies with it."""

    def env(self) -> dict[str, str]:
        """The daemon's environment (its shims inherit it)."""
        return daemon_env()

    # -- the process ----------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._process.pid if self.is_running() and self._process else None

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.paths.log, lines)

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self, timeout: float | None = None) -> None:
        """Spawn the daemon (reusing its state if present) and wait until it answers."""
        if self.is_running():
            raise self.error(f"{self.name} already running as pid {self.pid}")
        self.prepare()
        with self.paths.log.open("ab") as log:
            log.write(f"=== koordrp test harness: starting {self.name} at {time.ctime()} ===\n".encode())
            log.flush()
            # A new session keeps a Ctrl-C in the test terminal from killing
            # the daemon before the test's own cleanup runs.
            self._process = subprocess.Popen(
                self.argv(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env(),
                cwd=self._cwd,
                start_new_session=True,
            )
        self._wait_until_ready(self.start_timeout if timeout is None else timeout)

    def _wait_until_ready(self, timeout: float) -> None:
        assert self._process is not None
        deadline = time.monotonic() + timeout
        last_error: str | None = "socket not created yet"
        while True:
            code = self._process.poll()
            if code is not None:
                raise self.error(
                    f"{self.name} exited with status {code} during startup; log tail:\n{self.log_tail()}"
                )
            if self.paths.socket.exists():
                last_error = self.probe()
                if last_error is None:
                    return
            if time.monotonic() >= deadline:
                self.kill()
                raise self.error(
                    f"{self.name} did not answer {self.probe_name} within {timeout:.0f}s "
                    f"(last error: {last_error}); log tail:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the daemon only, as a crash would."""
        if self._process is None:
            return
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        self.exited()

    def terminate(self, timeout: float | None = None) -> None:
        """Stop the daemon gracefully: SIGTERM, then SIGKILL after `timeout` (default terminate_timeout)."""
        if self._process is None:
            return
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(self.terminate_timeout if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self.exited()

    def restart(self, *, crash: bool = False, timeout: float | None = None) -> None:
        """Stop the daemon (SIGKILL if `crash`) and start it on the same state."""
        if crash:
            self.kill()
        else:
            self.terminate()
        self.start(timeout)

    # -- teardown -------------------------------------------------------------------

    def shim_pids(self) -> list[int]:
        """containerd-shim-runc-v2 processes that report to our containerd."""
        return find_shims(self._containerd_socket)

    def mounts(self) -> list[str]:
        return mounts_under({self.paths.base, self.paths.socket_dir})

    def daemons(self) -> list[tuple[str, list[int]]]:
        """(name, pids) of each of our daemons, in the order stop() must kill them."""
        return [(self.name, self.daemon_pids())]

    def leftover_pids(self) -> list[int]:
        """Our daemons and shims that are still alive."""
        return [pid for _, pids in self.daemons() for pid in pids] + self.shim_pids()

    def stop_daemon(self, remove_workloads: Callable[[], list[str]], shim_grace: float) -> list[str]:
        """Remove the containers while the daemon still runs, then stop it; return notes on failures."""
        notes: list[str] = []
        if self.is_running():
            notes += remove_workloads()
            # Shims exit by themselves once their tasks are deleted, but not
            # instantly. Waiting while containerd is still up lets it reap
            # them; orphaned, they would linger as zombies until PID 1 reaps.
            wait_gone(self.shim_pids(), shim_grace)
        self.terminate()
        self._process = None
        return notes

    def clean_up_leftovers(self) -> list[str]:
        """Kill whatever survived stop_daemon() and undo what that leaves behind; return notes on failures."""
        return force_cleanup(
            self.daemons(),
            self.shim_pids,
            runc_root=self.paths.runc_root,
            containerd_state=self._containerd_state,
            mounts=self.mounts,
        )

    def remove_dirs(self) -> list[Path]:
        """Delete the base dir and the socket dir; return those still there."""
        return remove_trees(self.paths.base, self.paths.socket_dir)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
