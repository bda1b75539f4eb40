"""``twistd koordrp``: command-line options and the service tree they build."""

from __future__ import annotations

import os

# grpc's core writes INFO lines of its own to stderr, past koordrp's log (a hook server that goes away
# mid-call: "Got goaway ... Cancelling all calls"); what matters of them koordrp says in its own lines.
# Set before grpc is imported; a GRPC_VERBOSITY the operator gives koordrp wins.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import grp
from typing import TYPE_CHECKING

from twisted.application import service, strports
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.interfaces import IReactorCore, IReactorThreads, IReactorTime, IReactorUNIX
from twisted.internet.protocol import Factory
from twisted.logger import Logger
from twisted.python import usage

from koordrp import flows, koordrp_version
from koordrp.checkpoint import CheckpointError, DirectoryCheckpoint
from koordrp.cri.server import CRIProxyService, CRIProxySettings
from koordrp.docker.service import DockerProxyService, DockerProxySettings
from koordrp.bounds import raise_descriptor_limit
from koordrp.call import Parts, SkipLabel
from koordrp.frontend import IFrontEnd
from koordrp.hooks.client import HookClients
from koordrp.hooks.config import DEFAULT_HOOK_TIMEOUT
from koordrp.hooks.dispatcher import Dispatcher
from koordrp.hooks.registry import HookRegistry
from koordrp.hooks.types import HookServers
from koordrp.nri.listing import NRIListingService
from koordrp.nri.plugin import PluginIdentity
from koordrp.nri.service import NRIService, NRISettings
from koordrp.resync import DEFAULT_INTERVAL
from koordrp.shutdown import OrderlyStopOnSIGTERM
from koordrp.store import Store
from koordrp.systemd import SystemdNotifier
from koordrp.unix import CannotListen, EndpointError, parse_unix_endpoint

if TYPE_CHECKING:
    from koordrp.metrics import Metrics

# Flag names and defaults are koord-runtime-proxy's, so that a node's unit files carry over.
DEFAULT_PROXY_ENDPOINT = "/var/run/koord-runtimeproxy/runtimeproxy.sock"
DEFAULT_RUNTIME_ENDPOINT = "/var/run/containerd/containerd.sock"
DEFAULT_DOCKER_ENDPOINT = "/var/run/docker.sock"
DEFAULT_SKIP_HOOK_KEY = "runtimeproxy.koordinator.sh/skip-hookserver"
DEFAULT_SKIP_HOOK_VALUE = "true"
DEFAULT_HOOK_CONFIG_DIR = "/etc/runtime/hookserver.d"
DEFAULT_STATE_DIR = "/var/run/koord-runtimeproxy/state"
DEFAULT_NRI_SOCKET = "/var/run/nri/nri.sock"
DEFAULT_NRI_PLUGIN_NAME = "koordrp"
DEFAULT_NRI_PLUGIN_INDEX = "10"
RUNTIME_MODES = ("Containerd", "Docker", "NRI")

log = Logger()


class Options(usage.Options):
    synopsis = "[options]"
    longdesc = (
        "Serve CRI v1 on a unix socket in front of the container runtime, calling Koordinator runtime "
        "hook servers around the pod and container lifecycle."
    )

    optParameters = [
        ["koord-runtimeproxy-endpoint", None, DEFAULT_PROXY_ENDPOINT, "unix socket koordrp serves CRI on"],
        [
            "remote-runtime-service-endpoint",
            None,
            None,
            "backend runtime socket (not used in NRI mode) "
            f"[default: {DEFAULT_RUNTIME_ENDPOINT}, or {DEFAULT_DOCKER_ENDPOINT} in Docker mode]",
        ],
        [
            "remote-image-service-endpoint",
            None,
            None,
            "backend image service socket (not used in NRI mode) [default: the runtime service endpoint]",
        ],
        [
            "backend-runtime-mode",
            None,
            "Containerd",
            "backend runtime: Containerd or Docker (koordrp serves kubelet's calls on its socket), "
            "or NRI (koordrp is a plugin of containerd ≥ 1.7, which kubelet calls directly)",
        ],
        ["nri-socket", None, DEFAULT_NRI_SOCKET, "NRI mode: containerd's NRI socket"],
        ["nri-plugin-name", None, DEFAULT_NRI_PLUGIN_NAME, "NRI mode: the plugin name koordrp registers"],
        [
            "nri-plugin-index",
            None,
            DEFAULT_NRI_PLUGIN_INDEX,
            "NRI mode: the plugin's index, two digits: containerd calls plugins in ascending index order",
        ],
        ["runtime-hook-server-key", None, DEFAULT_SKIP_HOOK_KEY, "pod label key that skips all hooks"],
        ["runtime-hook-server-val", None, DEFAULT_SKIP_HOOK_VALUE, "pod label value that skips all hooks"],
        ["hook-config-dir", None, DEFAULT_HOOK_CONFIG_DIR, "directory of hook server registrations (*.json)"],
        [
            "state-dir",
            None,
            DEFAULT_STATE_DIR,
            "directory (0700) where koordrp keeps what kubelet asked, where hooks changed it, across restarts",
        ],
        [
            "metrics-endpoint",
            None,
            None,
            "Twisted endpoint for /metrics, /healthz and /livez, e.g. tcp:9316:interface=127.0.0.1 [default: off]",
        ],
        ["socket-group", None, None, "group (name or id) given access to the CRI socket [default: koordrp's group]"],
        [
            "hook-timeout",
            None,
            DEFAULT_HOOK_TIMEOUT,
            "seconds a hook call may take at most, unless its file sets timeout-seconds; within that, "
            "hooks may use half of what is left of the CRI call's own deadline",
            float,
        ],
        [
            "grace-period",
            None,
            10.0,
            "seconds a stop (SIGTERM) may take: calls in flight and post hooks still running get this long, then are cut "
            "(NRI mode: koordrp stays containerd's plugin meanwhile); keep it below the unit's TimeoutStopSec",
            float,
        ],
        [
            "reconcile-interval",
            None,
            DEFAULT_INTERVAL,
            "seconds between readings of the runtime that make koordrp forget the pods and containers removed "
            "behind its back (and learn those made behind it); NRI mode: between synchronizations, of the pods "
            "containerd does not tell of, while there are any; 0: only at start (CRI mode: and when the runtime is "
            "back after an outage; NRI mode: and at each synchronization)",
            float,
        ],
        ["max-workers", None, 64, "CRI worker threads (streams hold one each)", int],
    ]

    def opt_version(self) -> None:
        """Print koordrp's version and exit."""
        print(f"koordrp {koordrp_version()}")
        raise SystemExit(0)

    def _endpoint(self, flag: str, value: str) -> None:
        try:
            self[flag] = parse_unix_endpoint(value)
        except EndpointError as error:
            raise usage.UsageError(f"--{flag}: {error}") from None

    def opt_koord_runtimeproxy_endpoint(self, value: str) -> None:
        self._endpoint("koord-runtimeproxy-endpoint", value)

    def opt_remote_runtime_service_endpoint(self, value: str) -> None:
        self._endpoint("remote-runtime-service-endpoint", value)

    def opt_remote_image_service_endpoint(self, value: str) -> None:
        self._endpoint("remote-image-service-endpoint", value)

    def opt_backend_runtime_mode(self, value: str) -> None:
        if value not in RUNTIME_MODES:
            raise usage.UsageError(f"--backend-runtime-mode: {value!r} is not one of {', '.join(RUNTIME_MODES)}")
        self["backend-runtime-mode"] = value

    def opt_nri_socket(self, value: str) -> None:
        self._absolute("nri-socket", value)

    def opt_nri_plugin_index(self, value: str) -> None:
        if len(value) != 2 or not value.isdigit():
            raise usage.UsageError(f"--nri-plugin-index: {value!r} is not two digits (NRI's plugin index)")
        self["nri-plugin-index"] = value

    def opt_nri_plugin_name(self, value: str) -> None:
        if not value or "/" in value:
            raise usage.UsageError(f"--nri-plugin-name: {value!r} is not a plugin name")
        self["nri-plugin-name"] = value

    def opt_socket_group(self, value: str) -> None:
        try:
            self["socket-group"] = int(value) if value.isdigit() else grp.getgrnam(value).gr_gid
        except KeyError:
            raise usage.UsageError(f"--socket-group: no group named {value!r}") from None

    def opt_metrics_endpoint(self, value: str) -> None:
        from koordrp.web import unix_listening  # only with the flag: twisted.web and prometheus_client cost ~6 MB

        try:
            strports.service(value, Factory())
            unix_listening(value)
        except (ValueError, KeyError, TypeError) as error:
            raise usage.UsageError(f"--metrics-endpoint: {value!r} is not a Twisted endpoint: {error}") from None
        self["metrics-endpoint"] = value

    def _absolute(self, flag: str, value: str) -> None:
        if not value.startswith("/"):
            raise usage.UsageError(f"--{flag}: {value!r} is not an absolute path")
        self[flag] = value

    def opt_hook_config_dir(self, value: str) -> None:
        self._absolute("hook-config-dir", value)

    def opt_state_dir(self, value: str) -> None:
        self._absolute("state-dir", value)

    def unused(self) -> list[str]:
        """The options given that the mode does not use: NRI mode reaches containerd by its NRI socket alone."""
        if self["backend-runtime-mode"] != "NRI":
            return []
        return [f"--{flag}" for flag in ("remote-runtime-service-endpoint", "remote-image-service-endpoint") if flag in self._given]

    def postOptions(self) -> None:
        self._given = {flag for flag in ("remote-runtime-service-endpoint", "remote-image-service-endpoint") if self[flag] is not None}
        docker = self["backend-runtime-mode"] == "Docker"
        if self["remote-runtime-service-endpoint"] is None:
            self["remote-runtime-service-endpoint"] = DEFAULT_DOCKER_ENDPOINT if docker else DEFAULT_RUNTIME_ENDPOINT
        if docker and self["remote-image-service-endpoint"] is not None:
            raise usage.UsageError(
                "--remote-image-service-endpoint: not used in Docker mode (dockerd serves images itself)"
            )
        if self["remote-image-service-endpoint"] is None:
            self["remote-image-service-endpoint"] = self["remote-runtime-service-endpoint"]
        if not 0 < self["hook-timeout"] < float("inf"):
            raise usage.UsageError("--hook-timeout: must be a number of seconds > 0")
        if not 0 <= self["reconcile-interval"] < float("inf"):
            raise usage.UsageError("--reconcile-interval: must be a number of seconds >= 0 (0: off)")
        if not self["grace-period"] >= 0:
            raise usage.UsageError("--grace-period: must be a number of seconds >= 0")
        if self["max-workers"] < 2:
            raise usage.UsageError("--max-workers: must be at least 2")
        if not self["runtime-hook-server-key"]:
            raise usage.UsageError("--runtime-hook-server-key: must not be empty")


def front_end(
    config: Options, reactor: IReactorCore, parts: Parts, metrics: Metrics | None, registry: HookRegistry
) -> IFrontEnd:
    """The service of the chosen mode (koordrp's socket, or containerd's NRI), on the parts every mode shares."""
    if config["backend-runtime-mode"] == "NRI":
        identity = PluginIdentity(config["nri-plugin-name"], config["nri-plugin-index"])
        nri = NRISettings(config["nri-socket"], identity, config["state-dir"], config["grace-period"])
        return NRIService(nri, IReactorUNIX(reactor), parts, on_configured=registry.limit_known)
    if config["backend-runtime-mode"] == "Docker":
        docker = DockerProxySettings(
            listen_path=config["koord-runtimeproxy-endpoint"],
            backend_path=config["remote-runtime-service-endpoint"],
            socket_gid=config["socket-group"],
            grace_period=config["grace-period"],
            reconcile_interval=config["reconcile-interval"],
        )
        return DockerProxyService(docker, IReactorUNIX(reactor), parts)
    settings = CRIProxySettings(
        listen_path=config["koord-runtimeproxy-endpoint"],
        runtime_path=config["remote-runtime-service-endpoint"],
        image_path=config["remote-image-service-endpoint"],
        grace_period=config["grace-period"],
        max_workers=config["max-workers"],
        socket_gid=config["socket-group"],
        reconcile_interval=config["reconcile-interval"],
    )
    return CRIProxyService(settings, IReactorThreads(reactor), parts, metrics)


class Koordrp(service.MultiService):
    """The whole daemon; a start-up it cannot survive ends the process with one clear line."""

    log = Logger()

    def __init__(self, checkpoint: DirectoryCheckpoint, dispatcher: Dispatcher) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._checkpoint = checkpoint
        self._dispatcher = dispatcher

    def startService(self) -> None:
        soft, limit = raise_descriptor_limit()
        self.log.info(
            "file descriptors: at most {limit} open{raised}", limit=limit, raised=f" (raised from {soft})" if soft != limit else ""
        )
        try:
            # Before the store is rebuilt from the runtime: what kubelet asked comes back from it.
            self._checkpoint.open()
            super().startService()  # type: ignore[no-untyped-call]
        except (CannotListen, CheckpointError) as error:
            self.log.critical("cannot start: {error}", error=str(error))
            raise SystemExit(f"koordrp cannot start: {error}") from None

    def stopService(self) -> Deferred[None]:
        stopped: Deferred[None] = maybeDeferred(super().stopService)
        # Once every front end has drained: the hook servers' channels go with the daemon.
        return stopped.addBoth(self._close_hooks)

    def _close_hooks(self, result: object) -> object:
        self._dispatcher.close()
        return result


def makeService(config: Options, reactor: IReactorCore | None = None) -> service.MultiService:
    """The daemon's service tree. ``reactor`` (default: the global one) provides every reactor interface."""
    if reactor is None:
        from twisted.internet import reactor as global_reactor

        reactor = IReactorCore(global_reactor)
    clock = IReactorTime(reactor)
    metrics = None
    if config["metrics-endpoint"]:
        # Imported only when asked for: prometheus_client and twisted.web cost ~6 MB of RSS.
        from koordrp.metrics import Metrics

        metrics = Metrics()
    clients = HookClients(clock)

    def registered(servers: HookServers) -> None:
        dispatcher.retain(servers.endpoints)
        if metrics is not None:
            metrics.hook_servers.set(len(servers.servers))

    dispatcher = Dispatcher(clients, clock, metrics)
    registry = HookRegistry(config["hook-config-dir"], config["hook-timeout"], clock, on_change=registered)
    checkpoint = DirectoryCheckpoint(config["state-dir"])
    parts: Parts = Parts(
        # What stopped or went unseen is told on the reactor's next turn, apart from the reading or call that found
        # it (parts is complete by then).
        store=Store(checkpoint, owed=lambda stopped: clock.callLater(0, flows.tell_owed_stops, parts, stopped)),
        dispatcher=dispatcher,
        registrations=lambda: registry.current,
        skip=SkipLabel(config["runtime-hook-server-key"], config["runtime-hook-server-val"]),
        clock=clock,
        metrics=metrics,
    )
    proxy = front_end(config, reactor, parts, metrics, registry)
    top = Koordrp(checkpoint, dispatcher)
    # Started in this order, stopped in the reverse: systemd hears READY once the front end serves,
    # and STOPPING before it drains.
    children: list[service.IService] = [registry, proxy, SystemdNotifier(clock), OrderlyStopOnSIGTERM(reactor)]
    if isinstance(proxy, NRIService) and config["reconcile-interval"] > 0:
        # Between containerd's synchronizations, what NRI does not tell of (the pods of an earlier containerd).
        settings = proxy.settings
        listing = NRIListingService(
            IReactorUNIX(reactor), settings.socket_path, settings.identity, parts.store, proxy.going_untold,
            config["reconcile-interval"], metrics,
        )
        children.insert(2, listing)
    for flag in config.unused():
        log.warn(
            "{flag} is not used in NRI mode: koordrp reaches containerd by its NRI socket alone; drop it, and any mount "
            "of containerd's socket in koordrp's container (koordrp check names them)",
            flag=flag,
        )
    if metrics is not None:
        from koordrp.web import metrics_service

        metrics.watch_store(parts.store)
        metrics.watch_checkpoint(checkpoint)
        children.append(metrics_service(config["metrics-endpoint"], metrics, proxy.probe, clock))
    # The registry starts first, so the first call already sees every registered server.
    for child in children:
        child.setServiceParent(top)  # type: ignore[no-untyped-call]
    return top
