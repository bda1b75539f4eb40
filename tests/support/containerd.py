"""A private containerd instance for integration tests, driven through CRI v1.

Each ``Containerd`` owns one base directory: its config, root, state, log,
CNI dirs, NRI dirs and (when the path is short enough) its sockets live under
it, so several instances can run side by side and nothing touches the system
containerd's /var/lib/containerd or /run/containerd (except the shim sockets,
which containerd 1.6 and 1.7 always put in /run/containerd/s; ``stop()``
removes those of shims it had to SIGKILL).

Three releases run (``RELEASES``): the machine's own containerd 1.6 (Debian 12),
found on PATH; Debian 13's containerd 1.7 and Debian sid's containerd 2.1, which
have NRI built in, unpacked but never installed under .deps/trixie and .deps/sid
by ``scripts/debian-unpack`` (``scripts/bootstrap`` runs it). Each runs its own
shim and ctr; all use the machine's runc. containerd 2.1 takes the same version 2
config as 1.7 (it migrates it at start, as it does a node's that was never migrated).
"""

from __future__ import annotations

import functools
import json
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from cri_api.v1 import api_pb2, api_pb2_grpc

from koordrp.cri.runtime_lookup import listed_ids

# CleanupError is re-exported: it used to be defined here.
from .daemons import (
    CleanupError as CleanupError,
    Daemon,
    DaemonError,
    DaemonPaths,
    check_binaries,
    daemon_env,
    find_containerd,
    socket_dir_for,
)
from .images import BUSYBOX_PATH, PAUSE_REF, BuiltImage

CRI_NAMESPACE = "k8s.io"

REQUIRED_BINARIES: tuple[str, ...] = ("containerd", "containerd-shim-runc-v2", "runc", "ctr")

# Raises MissingBinariesError naming every tool the harness needs but lacks.
require_binaries = functools.partial(
    check_binaries,
    REQUIRED_BINARIES,
    files=[BUSYBOX_PATH],
    tests="integration tests",
    packages="containerd runc busybox-static",
)

# The project's root (this file is tests/support/containerd.py): .deps/ sits there.
PROJECT_ROOT = Path(__file__).resolve().parents[2]

# What an unpacked containerd brings of its own; runc is the machine's (a newer Debian's does not run on Debian 12).
UNPACKED_BINARIES: tuple[str, ...] = ("containerd", "containerd-shim-runc-v2", "ctr")


def unpacked_bin(suite: str) -> Path:
    """Where scripts/debian-unpack puts a Debian suite's containerd (containerd, its shims, ctr)."""
    return PROJECT_ROOT / ".deps" / suite / "root" / "usr" / "bin"


def require_unpacked(release: str, suite: str) -> Callable[[], None]:
    """Raises MissingBinariesError naming every tool the containerd ``release`` unpacked from ``suite`` lacks."""
    return functools.partial(
        check_binaries,
        ("runc",),
        files=[unpacked_bin(suite) / name for name in UNPACKED_BINARIES] + [BUSYBOX_PATH],
        tests=f"containerd {release} tests",
        packages="",
        remedy=f"run scripts/bootstrap, or scripts/debian-unpack {suite} containerd, to unpack it there",
    )

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

# containerd 1.7 has one more plugin that cannot load here: the blockfile snapshotter, which is
# skipped without a scratch file configured. Nothing else of 1.7's writes outside our tree.
DISABLED_PLUGINS_1_7: tuple[str, ...] = DISABLED_PLUGINS + ("io.containerd.snapshotter.v1.blockfile",)

# containerd 2.1 adds the erofs snapshotter and differ (no mkfs.erofs here) to 1.7's.
DISABLED_PLUGINS_2_1: tuple[str, ...] = DISABLED_PLUGINS_1_7 + (
    "io.containerd.snapshotter.v1.erofs",
    "io.containerd.differ.v1.erofs",
)

NRI_PLUGIN = "io.containerd.nri.v1.nri"


@dataclass(frozen=True)
class Release:
    """A containerd release the harness runs."""

    name: str
    bin_dir: Path | None  # where its containerd, shims and ctr are; None: the machine's, on PATH
    disabled_plugins: tuple[str, ...]
    require: Callable[[], None]  # raises MissingBinariesError if it cannot run here
    nri: bool  # whether it has NRI built in
    cri_options: str = "    systemd_cgroup = false\n"  # what its CRI section takes beyond the common ones

    def binary(self, name: str) -> str:
        """What to run for one of its binaries."""
        return name if self.bin_dir is None else str(self.bin_dir / name)

    def path_first(self) -> tuple[Path, ...]:
        """Ahead of everything on its daemon's PATH: containerd finds its shims on PATH."""
        return () if self.bin_dir is None else (self.bin_dir,)


RELEASES: dict[str, Release] = {
    "1.6": Release("1.6", None, DISABLED_PLUGINS, require_binaries, nri=False),
    "1.7": Release("1.7", unpacked_bin("trixie"), DISABLED_PLUGINS_1_7, require_unpacked("1.7", "trixie"), nri=True),
    # 2.x dropped systemd_cgroup (the runtime's SystemdCgroup option below says it).
    "2.1": Release("2.1", unpacked_bin("sid"), DISABLED_PLUGINS_2_1, require_unpacked("2.1", "sid"), True, ""),
}

# The releases with NRI, as tests name them.
NRI_RELEASES: tuple[str, ...] = tuple(name for name, release in RELEASES.items() if release.nri)

# Pods and images may need a few seconds each on a loaded 2-core machine.
CRI_CALL_TIMEOUT = 30.0


class ContainerdError(DaemonError):
    """The private containerd could not be started or used."""


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
class ContainerdPaths(DaemonPaths):
    config: Path
    root: Path
    state: Path
    cni_conf_dir: Path
    cni_bin_dir: Path
    pod_logs: Path  # a convenient parent for tests' PodSandboxConfig.log_directory
    ttrpc_socket: Path
    nri_socket: Path  # where containerd ≥ 1.7 listens for NRI plugins, when NRI is enabled
    nri_plugins: Path  # NRI's plugin_path (plugins it would start itself): kept empty
    nri_plugin_config: Path  # NRI's plugin_config_path: kept empty

    @classmethod
    def under(cls, base: Path) -> ContainerdPaths:
        # c.sock.ttrpc is the longest of the sockets (c.sock, c.sock.ttrpc, nri.sock).
        socket_dir = socket_dir_for(base, "c.sock.ttrpc", prefix="kcd-")
        return cls(
            base=base,
            log=base / "containerd.log",
            socket=socket_dir / "c.sock",
            socket_dir=socket_dir,
            runc_root=base / "state" / "runc",
            config=base / "config.toml",
            root=base / "root",
            state=base / "state",
            cni_conf_dir=base / "cni" / "net.d",
            cni_bin_dir=base / "cni" / "bin",
            pod_logs=base / "pod-logs",
            ttrpc_socket=socket_dir / "c.sock.ttrpc",
            nri_socket=socket_dir / "nri.sock",
            nri_plugins=base / "nri" / "plugins",
            nri_plugin_config=base / "nri" / "conf.d",
        )


def _toml_str(value: str | Path) -> str:
    # A JSON string literal is a valid TOML basic string.
    return json.dumps(str(value))


def render_nri(paths: ContainerdPaths, enabled: bool, request_timeout: str = "2s") -> str:
    """NRI's section (containerd ≥ 1.7): NRI on our own socket, with no plugins of its own to start; or off.
    ``request_timeout``: what it gives each call to a plugin (NRI's default)."""
    section = f'[plugins."{NRI_PLUGIN}"]'
    if not enabled:
        return f"""\
  {section}
    disable = true
"""
    return f"""\
  {section}
    disable = false
    socket_path = {_toml_str(paths.nri_socket)}
    plugin_path = {_toml_str(paths.nri_plugins)}
    plugin_config_path = {_toml_str(paths.nri_plugin_config)}
    plugin_registration_timeout = "5s"
    plugin_request_timeout = {_toml_str(request_timeout)}
    disable_connections = false
"""


def render_config(
    paths: ContainerdPaths,
    sandbox_image: str,
    log_level: str,
    *,
    release: str = "1.6",
    nri: bool = False,
    nri_request_timeout: str = "2s",
) -> str:
    """Return a version 2 containerd config.toml for a private CRI instance of `release` (with NRI if `nri`)."""
    of = RELEASES[release]
    if nri and not of.nri:
        raise ValueError(f"containerd {release} has no NRI")
    cri = '[plugins."io.containerd.grpc.v1.cri"]'
    disabled = ", ".join(_toml_str(p) for p in of.disabled_plugins)
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
{of.cri_options}
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
""" + ("\n" + render_nri(paths, nri, nri_request_timeout) if of.nri else "")


class Containerd(Daemon[ContainerdPaths]):
    """One private containerd, owning `base_dir` entirely (stop() deletes it).

    kill(), terminate() and restart() stop the daemon only: shims and pods survive.
    """

    name = "containerd"
    error = ContainerdError
    probe_name = "CRI Version"

    def __init__(
        self,
        base_dir: Path,
        *,
        release: str = "1.6",
        nri: bool = False,
        sandbox_image: str = PAUSE_REF,
        log_level: str = "info",
        start_timeout: float = 30.0,
        nri_request_timeout: str = "2s",
    ) -> None:
        """`release`: a key of RELEASES; `nri`: NRI enabled on `paths.nri_socket` (a release with NRI), giving each
        call to a plugin `nri_request_timeout` (a Go duration)."""
        if release not in RELEASES:
            raise ValueError(f"no containerd release {release!r}; the harness runs {', '.join(RELEASES)}")
        if nri and not RELEASES[release].nri:
            raise ValueError(f"containerd {release} has no NRI: nri=True needs one of {', '.join(NRI_RELEASES)}")
        base_dir.mkdir(parents=True, exist_ok=True)
        paths = ContainerdPaths.under(base_dir.resolve())
        super().__init__(paths, start_timeout, containerd_socket=paths.socket, containerd_state=paths.state)
        self.release = release
        self.nri = nri
        self.sandbox_image = sandbox_image
        self.log_level = log_level
        self.nri_request_timeout = nri_request_timeout
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

    # -- lifecycle --------------------------------------------------------------

    def write_config(self) -> Path:
        for directory in (
            self.paths.root,
            self.paths.state,
            self.paths.cni_conf_dir,
            self.paths.cni_bin_dir,
            self.paths.pod_logs,
            self.paths.nri_plugins,
            self.paths.nri_plugin_config,
        ):
            directory.mkdir(parents=True, exist_ok=True)
        config = render_config(
            self.paths, self.sandbox_image, self.log_level, release=self.release, nri=self.nri, nri_request_timeout=self.nri_request_timeout
        )
        self.paths.config.write_text(config)
        return self.paths.config

    def argv(self) -> list[str]:
        return [self._release.binary("containerd"), "--config", str(self.paths.config)]

    def env(self) -> dict[str, str]:
        # containerd finds its shim on PATH: the release's own first.
        return daemon_env(self._release.path_first())

    def prepare(self) -> None:
        self._release.require()
        self.write_config()

    @property
    def _release(self) -> Release:
        return RELEASES[self.release]

    def probe(self) -> str | None:
        try:
            self.runtime().Version(api_pb2.VersionRequest(), timeout=1.0)
        except grpc.RpcError as exc:
            return f"{exc.code()}: {exc.details()}"
        return None

    # -- images -----------------------------------------------------------------

    def import_images(self, images: Iterable[BuiltImage], timeout: float = 60.0) -> None:
        """Import docker-archive tars with ctr, then wait until CRI lists them."""
        images = list(images)
        for image in images:
            ctr = self._release.binary("ctr")
            cmd = [ctr, "--address", self.address, "-n", CRI_NAMESPACE, "images", "import", str(image.archive)]
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self.env())
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
            sandboxes, containers = self.listed_ids()
        except grpc.RpcError as exc:
            return [f"listing pods: {exc.code()}: {exc.details()}"]
        # Containers first, with timeout 0 (straight SIGKILL): tests' workloads
        # often run as PID 1 without a TERM handler and would burn the grace period.
        for container_id in containers:
            attempt(
                f"StopContainer {container_id}",
                lambda: runtime.StopContainer(
                    api_pb2.StopContainerRequest(container_id=container_id, timeout=0), timeout=CRI_CALL_TIMEOUT
                ),
            )
            attempt(
                f"RemoveContainer {container_id}",
                lambda: runtime.RemoveContainer(
                    api_pb2.RemoveContainerRequest(container_id=container_id), timeout=CRI_CALL_TIMEOUT
                ),
            )
        for sandbox_id in sandboxes:
            attempt(
                f"StopPodSandbox {sandbox_id}",
                lambda: runtime.StopPodSandbox(
                    api_pb2.StopPodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=CRI_CALL_TIMEOUT
                ),
            )
            attempt(
                f"RemovePodSandbox {sandbox_id}",
                lambda: runtime.RemovePodSandbox(
                    api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=CRI_CALL_TIMEOUT
                ),
            )
        return errors

    def listed_ids(self) -> tuple[list[str], list[str]]:
        """The ids of every pod sandbox and container, read the lenient way koordrp reads them: a pod
        made with text that is not UTF-8 (containerd takes it) cannot be parsed whole in Python."""
        channel = self.channel()
        # No serializers: the answers stay bytes.
        list_sandboxes = channel.unary_unary(
            "/runtime.v1.RuntimeService/ListPodSandbox", request_serializer=None, response_deserializer=None
        )
        list_containers = channel.unary_unary(
            "/runtime.v1.RuntimeService/ListContainers", request_serializer=None, response_deserializer=None
        )
        sandboxes = list_sandboxes(b"", timeout=CRI_CALL_TIMEOUT)
        containers = list_containers(b"", timeout=CRI_CALL_TIMEOUT)
        return listed_ids(sandboxes), listed_ids(containers)

    def daemon_pids(self) -> list[int]:
        """Every containerd process running with our config (ours or orphaned)."""
        return find_containerd(self.paths.config)

    def stop(self) -> None:
        notes = self.stop_daemon(self.remove_all_pods, shim_grace=3.0)
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        notes += self.clean_up_leftovers()
        leftovers = self.leftover_pids()
        mounts = self.mounts()
        if leftovers or mounts:
            # Never rmtree over a live mount: it would delete through it.
            raise CleanupError(
                f"containerd cleanup incomplete: processes {leftovers}, mounts {mounts}; notes: {notes}"
            )
        self.remove_dirs()
