"""A private dockerd for integration tests, driven through the Engine API and CLI.

Each ``Dockerd`` owns one base directory: its daemon.json, trust key, data
root, log and (when the path is short enough) its exec root and API socket
live under it. dockerd starts and supervises its own containerd, whose config,
sockets, state and runc root all sit inside the exec root, so instances run
side by side with each other and with the CRI tests' containerds. What still
escapes the tree, and cannot be configured away in docker.io 20.10:

- /run/docker/plugins (plugin discovery) and /opt/containerd/{bin,lib}
  (containerd's "opt" plugin): empty directories created once, shared, left alone;
- the shim sockets in /run/containerd/s (hard-coded by containerd 1.6): removed
  by the shims, or by ``stop()`` after it had to SIGKILL them;
- cgroups: every container gets ``<cgroup parent>/<id>`` in each v1 hierarchy.
  The daemon default parent is a name unique to this instance (not the shared
  "/docker"), and ``stop()`` removes it; tests wanting an explicit
  ``--cgroup-parent`` should prefer a path below ``Dockerd.cgroup_parent``.
"""

from __future__ import annotations

import functools
import http.client
import json
import os
import secrets
import shutil
import socket
import subprocess
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

# CleanupError and remove_cgroup are re-exported: they used to be defined
# here, and tests import remove_cgroup from here.
from .daemons import (
    CleanupError as CleanupError,
    Daemon,
    DaemonError,
    DaemonPaths,
    cgroup_dirs,
    check_binaries,
    daemon_env,
    find_containerd,
    flag_value,
    pid_alive,
    pids_matching,
    remove_cgroup as remove_cgroup,
    socket_dir_for,
    wait_gone,
)
from .images import BuiltImage

# dockerd 20.10 runs containers through the io.containerd.runc.v2 shim.
REQUIRED_BINARIES: tuple[str, ...] = ("dockerd", "docker", "containerd", "containerd-shim-runc-v2", "runc")

# Raises MissingBinariesError naming every tool the harness needs but lacks.
require_binaries = functools.partial(
    check_binaries,
    REQUIRED_BINARIES,
    tests="Docker-mode integration tests",
    packages="docker.io containerd runc",
)

# The longest socket dockerd's containerd creates below the exec root; the
# libnetwork key socket (libnetwork/<12 hex>.sock) and docker.sock are shorter.
LONGEST_SOCKET_SUFFIX = "exec/containerd/containerd-debug.sock"

# dockerd's own namespace in its containerd (the --containerd-namespace default).
CONTAINERD_NAMESPACE = "moby"

# Without live-restore, dockerd stops running containers both on SIGTERM and
# when it restarts after a crash, giving each its stop timeout (10s unless
# `--stop-timeout`) before SIGKILL: a PID 1 ignoring SIGTERM (a bare `sleep`)
# costs ~10s per restart, and --shutdown-timeout does not shorten that.
TERMINATE_TIMEOUT = 30.0

# A docker load or a container removal can take several seconds on a loaded 2-core VM.
API_TIMEOUT = 60.0
CLI_TIMEOUT = 60.0


class DockerdError(DaemonError):
    """The private dockerd could not be started or used."""


# -- HTTP over a unix socket -----------------------------------------------------


class UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over a unix stream socket, e.g. the Docker Engine API socket.

    Usable directly for streaming endpoints (logs?follow=1, events, attach):
    ``request()``, then ``getresponse()`` and read the response incrementally.
    """

    def __init__(self, socket_path: str | Path, timeout: float = API_TIMEOUT) -> None:
        # The host only fills the Host header, which dockerd ignores on a unix socket.
        super().__init__("localhost", timeout=timeout)
        self.socket_path = str(socket_path)

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self.socket_path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def unix_http(
    socket_path: str | Path,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
    *,
    timeout: float = API_TIMEOUT,
) -> tuple[int, http.client.HTTPMessage, bytes]:
    """One request on a fresh connection; return (status, headers, whole body).

    The headers object looks names up case-insensitively (``headers["Api-Version"]``).
    """
    conn = UnixHTTPConnection(socket_path, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=dict(headers or {}))
        response = conn.getresponse()
        data = response.read()
        return response.status, response.headers, data
    finally:
        conn.close()


# -- paths ------------------------------------------------------------------------


@dataclass(frozen=True)
class DockerdPaths(DaemonPaths):
    daemon_json: Path
    trust_key: Path
    pidfile: Path
    data_root: Path
    cli_config: Path  # DOCKER_CONFIG for the CLI, so ~/.docker is never read or written
    exec_root: Path
    containerd_dir: Path
    containerd_config: Path
    containerd_socket: Path
    containerd_pidfile: Path
    containerd_state: Path

    @classmethod
    def under(cls, base: Path) -> DockerdPaths:
        # The socket dir holds the exec root, where most of dockerd's sockets are.
        socket_dir = socket_dir_for(base, LONGEST_SOCKET_SUFFIX, prefix="kdd-")
        exec_root = socket_dir / "exec"
        containerd_dir = exec_root / "containerd"
        return cls(
            base=base,
            log=base / "dockerd.log",
            socket=socket_dir / "docker.sock",
            socket_dir=socket_dir,
            # dockerd sets the runc v2 shim's Root option to <exec-root>/runtime-runc.
            runc_root=exec_root / "runtime-runc",
            daemon_json=base / "daemon.json",
            trust_key=base / "key.json",
            pidfile=base / "dockerd.pid",
            data_root=base / "data",
            cli_config=base / "cli",
            exec_root=exec_root,
            # Fixed by dockerd 20.10's containerd supervisor (libcontainerd/supervisor).
            containerd_dir=containerd_dir,
            containerd_config=containerd_dir / "containerd.toml",
            containerd_socket=containerd_dir / "containerd.sock",
            containerd_pidfile=containerd_dir / "containerd.pid",
            containerd_state=containerd_dir / "daemon",
        )


def render_daemon_json(paths: DockerdPaths) -> str:
    """daemon.json: only what has no command-line flag (the rest is in argv).

    dockerd refuses to start when a setting is given both as a flag and in
    the file, so the two must stay disjoint.
    """
    # Without this dockerd 20.10 creates /etc/docker/key.json; the key has no
    # flag, only this (deprecated, but still honoured) config-file setting.
    return json.dumps({"deprecated-key-path": str(paths.trust_key)}, indent=2) + "\n"


def dockerd_argv(
    paths: DockerdPaths,
    *,
    cgroup_parent: str,
    live_restore: bool,
    log_level: str,
    extra_args: Iterable[str] = (),
) -> list[str]:
    argv = [
        "dockerd",
        # Our own file, so /etc/docker/daemon.json is never read.
        f"--config-file={paths.daemon_json}",
        f"--data-root={paths.data_root}",
        f"--exec-root={paths.exec_root}",
        f"--pidfile={paths.pidfile}",
        f"--host=unix://{paths.socket}",
        # No --containerd: dockerd runs a private containerd under the exec root
        # (it dies with dockerd through PDEATHSIG; shims and containers survive).
        # Leave the host's network alone: no iptables rules, no NAT, no docker0,
        # no net.ipv4.ip_forward write; tests run containers with --network none.
        "--iptables=false",
        "--ip6tables=false",
        "--ip-masq=false",
        "--ip-forward=false",
        "--bridge=none",
        "--userland-proxy=false",
        # The VM lacks CAP_SYS_RESOURCE: dockerd's default -500 cannot be set.
        "--oom-score-adjust=0",
        # overlay2 works on the ext4 disk; naming it skips probing other drivers.
        "--storage-driver=overlay2",
        # Explicit, as tests read CgroupDriver from /info.
        "--exec-opt=native.cgroupdriver=cgroupfs",
        # Not the shared "/docker": stop() can remove a parent nobody else uses.
        f"--cgroup-parent={cgroup_parent}",
        f"--log-level={log_level}",
    ]
    if live_restore:
        argv.append("--live-restore")
    argv.extend(extra_args)
    return argv


def _cli_env(host: str, cli_config: Path, extra: Mapping[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in daemon_env().items() if not k.startswith("DOCKER_")}
    # A stray DOCKER_CONTEXT, DOCKER_TLS_VERIFY or DOCKER_API_VERSION from the
    # developer's shell would change what the CLI sends; only ours remain.
    env["DOCKER_HOST"] = host
    env["DOCKER_CONFIG"] = str(cli_config)
    env.update(extra or {})
    return env


# -- the daemon ---------------------------------------------------------------------


class Dockerd(Daemon[DockerdPaths]):
    """One private dockerd (and its containerd), owning `base_dir` entirely.

    ``stop()`` deletes everything, including the base dir. kill() is a crash:
    its containerd dies with it (PDEATHSIG), shims and containers survive, and
    a later start() without live_restore stops those containers. terminate()
    makes dockerd stop its containerd and, unless live_restore, its containers.
    """

    name = "dockerd"
    error = DockerdError
    probe_name = "/_ping"
    terminate_timeout = TERMINATE_TIMEOUT

    def __init__(
        self,
        base_dir: Path,
        *,
        docker_cli: str | None = None,
        cgroup_parent: str | None = None,
        live_restore: bool = False,
        log_level: str = "info",
        start_timeout: float = 60.0,
        extra_args: Iterable[str] = (),
    ) -> None:
        """`docker_cli`: the client binary; default the first `docker` on PATH.

        That is /usr/local/bin/docker (28.x, API 1.50, negotiates down) ahead of
        Debian's /usr/bin/docker (20.10, API 1.41) on this machine; pass one
        explicitly to pin the client's API version behaviour.
        `live_restore`: containers survive a dockerd stop, kill or restart.
        """
        base_dir.mkdir(parents=True, exist_ok=True)
        paths = DockerdPaths.under(base_dir.resolve())
        super().__init__(
            paths,
            start_timeout,
            containerd_socket=paths.containerd_socket,
            containerd_state=paths.containerd_state,
            cwd=paths.base,
        )
        self.docker_cli = docker_cli or shutil.which("docker", path=daemon_env()["PATH"]) or "docker"
        # Unique per instance, stable across its restarts. A parent passed in
        # may be shared, so stop() then only removes it if it is empty.
        self._owns_cgroup_parent = cgroup_parent is None
        self.cgroup_parent = cgroup_parent or f"/koordrp-dockerd-{secrets.token_hex(4)}"
        self.live_restore = live_restore
        self.log_level = log_level
        self.extra_args = tuple(extra_args)
        # One Engine API call straight to dockerd (not through any proxy).
        self.request = functools.partial(unix_http, self.paths.socket)

    # -- addresses and clients ----------------------------------------------------

    @property
    def socket(self) -> Path:
        """Filesystem path of the Engine API socket."""
        return self.paths.socket

    @property
    def host(self) -> str:
        """The socket as a DOCKER_HOST value."""
        return f"unix://{self.paths.socket}"

    def get_json(self, path: str, *, timeout: float = API_TIMEOUT) -> Any:
        status, _, body = self.request("GET", path, timeout=timeout)
        if status != 200:
            raise DockerdError(f"GET {path} -> {status}: {body.decode(errors='replace').strip()}")
        return json.loads(body)

    def ping(self, timeout: float = 2.0) -> bool:
        try:
            status, _, body = self.request("GET", "/_ping", timeout=timeout)
        except OSError:  # socket missing, refused, or timed out
            return False
        return status == 200 and body == b"OK"

    def info(self) -> dict[str, Any]:
        """GET /info, parsed (CgroupDriver, CgroupVersion, Driver, ...)."""
        info: dict[str, Any] = self.get_json("/info")
        return info

    def version(self) -> dict[str, Any]:
        version: dict[str, Any] = self.get_json("/version")
        return version

    def cli_env(self, host: str | None = None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for a docker CLI talking to `host` (default: this dockerd)."""
        return _cli_env(host or self.host, self.paths.cli_config, extra)

    def docker(
        self,
        *args: str,
        host: str | None = None,
        input: str | None = None,
        timeout: float = CLI_TIMEOUT,
        check: bool = False,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run the docker CLI against `host` (e.g. a proxy's "unix://..."), default us.

        With `check`, a non-zero exit raises DockerdError carrying stderr.
        A timeout raises subprocess.TimeoutExpired (the CLI is killed).
        """
        argv = [self.docker_cli, *args]
        result = subprocess.run(
            argv,
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.cli_env(host, env),
            # Without input, the CLI must not inherit (and wait on) our stdin.
            stdin=subprocess.DEVNULL if input is None else None,
        )
        if check and result.returncode != 0:
            raise DockerdError(
                f"{' '.join(argv)} exited {result.returncode}: "
                f"{result.stderr.strip() or result.stdout.strip()}"
            )
        return result

    def docker_popen(
        self,
        *args: str,
        host: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: int | None = subprocess.DEVNULL,
    ) -> subprocess.Popen[str]:
        """Start a long-running CLI command (logs -f, attach, events); pipes are text.

        Pass ``stdin=subprocess.PIPE`` to write to it. The caller must end it.
        """
        return subprocess.Popen(
            [self.docker_cli, *args],
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=self.cli_env(host, env),
        )

    # -- lifecycle ----------------------------------------------------------------

    def argv(self) -> list[str]:
        return dockerd_argv(
            self.paths,
            cgroup_parent=self.cgroup_parent,
            live_restore=self.live_restore,
            log_level=self.log_level,
            extra_args=self.extra_args,
        )

    def write_config(self) -> Path:
        for directory in (self.paths.data_root, self.paths.exec_root, self.paths.cli_config):
            directory.mkdir(parents=True, exist_ok=True)
        self.paths.daemon_json.write_text(render_daemon_json(self.paths))
        return self.paths.daemon_json

    def prepare(self) -> None:
        require_binaries()
        self.write_config()
        self._drop_stale_pidfiles()

    def _drop_stale_pidfiles(self) -> None:
        # After a kill(), dockerd's containerd (PDEATHSIG) can linger as a
        # zombie until PID 1 reaps it. dockerd's liveness check is kill(pid, 0),
        # which succeeds on a zombie, so it would adopt the corpse and only
        # replace it after several failed connects. Likewise dockerd refuses to
        # start over a pidfile naming a process that still has a /proc entry.
        checks: list[tuple[Path, Callable[[], list[int]]]] = [
            (self.paths.containerd_pidfile, self.containerd_pids),
            (self.paths.pidfile, self.daemon_pids),
        ]
        for pidfile, ours in checks:
            try:
                pid = int(pidfile.read_text().strip() or "0")
            except (OSError, ValueError):
                continue
            if not (pid_alive(pid) and pid in ours()):
                pidfile.unlink(missing_ok=True)

    def probe(self) -> str | None:
        try:
            status, _, body = self.request("GET", "/_ping", timeout=2.0)
        except OSError as exc:
            return f"/_ping: {exc}"
        return None if status == 200 else f"/_ping -> {status} {body[:200]!r}"

    def exited(self) -> None:
        # Its containerd dies with it (PDEATHSIG), but not instantly; a start()
        # right after would find it still there.
        wait_gone(self.containerd_pids(), 5.0)

    # -- images -----------------------------------------------------------------

    def load(self, archive: Path, *, timeout: float = CLI_TIMEOUT) -> str:
        """`docker load` one docker-archive tar; return the CLI's output."""
        return self.docker("load", "-i", str(archive), timeout=timeout, check=True).stdout

    def load_images(self, images: Iterable[BuiltImage], *, timeout: float = CLI_TIMEOUT) -> None:
        """Load each image and check dockerd reports the id images.py computed."""
        for image in images:
            self.load(image.archive, timeout=timeout)
            found = self.get_json(f"/images/{quote(image.ref, safe='/:')}/json")["Id"]
            if found != image.image_id:
                raise DockerdError(f"{image.ref} loaded as {found}, expected {image.image_id}")

    # -- teardown ---------------------------------------------------------------

    def container_ids(self) -> list[str]:
        """Ids of every container in the data root, whether or not dockerd runs."""
        containers = self.paths.data_root / "containers"
        return sorted(p.name for p in containers.iterdir() if p.is_dir()) if containers.is_dir() else []

    def container_cgroups(self) -> dict[str, str]:
        """Container id -> its cgroup path (parent/id), read from disk."""
        cgroups = {}
        for cid in self.container_ids():
            parent = ""
            try:
                hostconfig = json.loads((self.paths.data_root / "containers" / cid / "hostconfig.json").read_text())
                parent = hostconfig.get("CgroupParent") or ""
            except (OSError, ValueError):
                pass  # created but never configured: it then has no cgroup either
            cgroups[cid] = f"{parent or self.cgroup_parent}/{cid}"
        return cgroups

    def remove_all_containers(self) -> list[str]:
        """docker rm -f every container (through the API); return error strings."""
        errors: list[str] = []
        try:
            containers = self.get_json("/containers/json?all=1")
        except (OSError, DockerdError) as exc:
            return [f"listing containers: {exc}"]
        for container in containers:
            cid = container["Id"]
            try:
                status, _, body = self.request("DELETE", f"/containers/{cid}?force=1&v=1")
            except OSError as exc:
                errors.append(f"rm -f {cid}: {exc}")
                continue
            # 404: it went away by itself meanwhile (e.g. --rm).
            if status not in (204, 404):
                errors.append(f"rm -f {cid}: {status} {body.decode(errors='replace').strip()}")
        return errors

    def daemon_pids(self) -> list[int]:
        """Every dockerd process using our exec root (ours or orphaned)."""
        exec_root = str(self.paths.exec_root)
        return pids_matching(
            lambda argv: os.path.basename(argv[0]) == "dockerd" and flag_value(argv, "exec-root") == exec_root
        )

    def containerd_pids(self) -> list[int]:
        """The containerd that dockerd started for us (or its orphan)."""
        return find_containerd(self.paths.containerd_config)

    def daemons(self) -> list[tuple[str, list[int]]]:
        # dockerd first, or it would restart the containerd we kill next.
        return [("dockerd", self.daemon_pids()), ("containerd", self.containerd_pids())]

    def stop(self) -> None:
        # Read before removal: rm deletes the very files that say where they were.
        cgroups = self.container_cgroups()
        notes = self.stop_daemon(self.remove_all_containers, shim_grace=5.0)
        # Among the mounts: dockerd leaves its data root bind-mounted on itself
        # even after a clean exit; containers add overlay rootfs and netns mounts.
        notes += self.clean_up_leftovers()
        notes += self._remove_cgroups(cgroups)
        leftovers = self.leftover_pids()
        mounts = self.mounts()
        owned = [*cgroups.values(), *([self.cgroup_parent] if self._owns_cgroup_parent else [])]
        cgroup_leftovers = [str(d) for path in owned for d in cgroup_dirs(path)]
        if leftovers or mounts or cgroup_leftovers:
            # Never rmtree over a live mount: it would delete through it.
            raise CleanupError(
                f"dockerd cleanup incomplete: processes {leftovers}, mounts {mounts}, "
                f"cgroups {cgroup_leftovers}; notes: {notes}; log tail:\n{self.log_tail(15)}"
            )
        if self.remove_dirs():
            raise CleanupError(f"could not delete {self.paths.base} / {self.paths.socket_dir}")

    def _remove_cgroups(self, cgroups: Mapping[str, str]) -> list[str]:
        notes: list[str] = []
        # Leftover container cgroups (dockerd and runc delete normally remove them).
        for path in cgroups.values():
            notes += remove_cgroup(path)
        # Our private default parent goes entirely.
        if self._owns_cgroup_parent:
            notes += remove_cgroup(self.cgroup_parent)
        # Other parents (chosen by tests, or passed in), with their ancestors:
        # only if now empty, and quietly, since another instance may be using
        # the same parent (rmdir then fails with EBUSY).
        parents: set[str] = set()
        for path in cgroups.values():
            parts = path.strip("/").split("/")[:-1]
            parents.update("/" + "/".join(parts[:i]) for i in range(1, len(parts) + 1))
        for parent in sorted(parents, key=len, reverse=True):
            for directory in cgroup_dirs(parent):
                try:
                    directory.rmdir()
                except OSError:
                    pass
        return notes
