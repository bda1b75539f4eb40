"""``twistd koordrp``: the service tree its options (``koordrp.defaults.Options``) build."""

from __future__ import annotations

import os
from collections.abc import Sequence

# grpc's core writes INFO lines of its own to stderr, past koordrp's log (a hook server that goes away
# mid-call: "Got goaway ... Cancelling all calls"); what matters of them koordrp says in its own lines.
# Set before grpc is imported; a GRPC_VERBOSITY the operator gives koordrp wins.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from twisted.application import service
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.interfaces import IReactorCore, IReactorThreads, IReactorTime, IReactorUNIX
from twisted.logger import Logger

from koordrp import fastpaths, flows
from koordrp.checkpoint import CheckpointError, DirectoryCheckpoint
from koordrp.cri.server import CRIProxyService, CRIProxySettings
from koordrp.defaults import RUNTIME_MODES, Options
from koordrp.docker.service import DockerProxyService, DockerProxySettings
from koordrp.bounds import raise_descriptor_limit
from koordrp.call import Parts, SkipLabel
from koordrp.frontend import IFrontEnd
from koordrp.hooks.client import HookClients
from koordrp.hooks.dispatcher import Dispatcher
from koordrp.hooks.registry import HookRegistry
from koordrp.hooks.types import HookServers
from koordrp.nri.listing import NRIListingService
from koordrp.nri.plugin import PluginIdentity
from koordrp.nri.service import NRIService, NRISettings
from koordrp.shutdown import OrderlyStopOnSIGTERM
from koordrp.store import Store
from koordrp.systemd import SystemdNotifier
from koordrp.unix import CannotListen

__all__ = ["Options", "makeService"]
"""What twistd's serviceMaker takes of this module."""

log = Logger()


def front_end(config: Options, reactor: IReactorCore, parts: Parts, registry: HookRegistry) -> IFrontEnd:
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
    return CRIProxyService(settings, IReactorThreads(reactor), parts)


FAST_PATHS: dict[str, Sequence[fastpaths.Path]] = {
    # grpc's workers hand a call's stages to the reactor
    "Containerd": (fastpaths.UNWOKEN, fastpaths.TIMER, fastpaths.AT_ONCE),
    "NRI": (fastpaths.AT_ONCE,),  # the reactor answers containerd on its socket
    "Docker": (fastpaths.AT_ONCE,),  # the reactor does the rest through its transports
}
"""The fast paths each mode may take; hook calls are written at once in every mode (``hooks.channel``)."""


class Koordrp(service.MultiService):
    """The whole daemon; a start-up it cannot survive ends the process with one clear line."""

    log = Logger()

    def __init__(
        self, checkpoint: DirectoryCheckpoint, dispatcher: Dispatcher, fast_paths: Sequence[fastpaths.Path] = ()
    ) -> None:
        """``fast_paths``: those its front end may take, said at start."""
        super().__init__()  # type: ignore[no-untyped-call]
        self._checkpoint = checkpoint
        self._dispatcher = dispatcher
        self._fast_paths = fast_paths

    def startService(self) -> None:
        soft, limit = raise_descriptor_limit()
        self.log.info(
            "file descriptors: at most {limit} open{raised}", limit=limit, raised=f" (raised from {soft})" if soft != limit else ""
        )
        fastpaths.announce(used=self._fast_paths)
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
    proxy = front_end(config, reactor, parts, registry)
    top = Koordrp(checkpoint, dispatcher, FAST_PATHS[config["backend-runtime-mode"]])
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
