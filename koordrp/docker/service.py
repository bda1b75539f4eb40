"""Docker mode as a Twisted service: the Docker API proxy on koordrp's socket, on the reactor."""

from dataclasses import dataclass, replace

from twisted.application import service
from twisted.internet.defer import Deferred, ensureDeferred, maybeDeferred
from twisted.internet.interfaces import IListeningPort, IReactorTime, IReactorUNIX
from twisted.logger import Logger
from zope.interface import implementer

from koordrp.bounds import OWN_DESCRIPTORS, Bounds, BoundedFactory, connection_cap, descriptor_limit, reserve_unkept
from koordrp.call import Parts
from koordrp.docker.dockerd import Dockerd
from koordrp.docker.intercept import DockerInterceptor
from koordrp.docker.proxy import DOCKER_BOUNDS, DockerProxyFactory
from koordrp.frontend import IFrontEnd
from koordrp.resync import StoreSync
from koordrp.unix import SOCKET_MODE, prepare_listening_path, remove_socket, restrict_socket


@dataclass(frozen=True)
class DockerProxySettings:
    listen_path: str
    backend_path: str
    socket_gid: int | None = None
    grace_period: float = 10.0
    """The stop's bound: how long calls in flight and post hooks still running get, in all."""
    reconcile_interval: float = 0.0
    """Seconds between readings of dockerd for the store (0: at start only)."""
    bounds: Bounds = DOCKER_BOUNDS
    """Each client connection's bounds; its ``connections`` lowered at start under a low descriptor limit."""


@implementer(IFrontEnd)
class DockerProxyService(service.Service):
    log = Logger()

    def __init__(
        self, settings: DockerProxySettings, reactor: IReactorUNIX, parts: Parts, dockerd: Dockerd | None = None
    ) -> None:
        """``reactor`` also provides IReactorTime; ``dockerd`` is how koordrp asks dockerd (its own bounds)."""
        self.settings = settings
        self._reactor = reactor
        self._parts = parts
        self._dockerd = dockerd if dockerd is not None else Dockerd(reactor, settings.backend_path, metrics=parts.metrics)
        clock = IReactorTime(reactor)
        self._interceptor = DockerInterceptor(self._dockerd, parts)
        # Each question to dockerd has koordrp's own bound (koordrp.docker.dockerd).
        self._sync = StoreSync(
            parts.store, self._dockerd, clock, "dockerd", settings.reconcile_interval, metrics=parts.metrics
        )
        self._port: IListeningPort | None = None
        self._factory: DockerProxyFactory | None = None
        self.bounded: BoundedFactory | None = None
        """The client connections as ``koordrp.bounds`` holds them (how many are open, how many it closed, why)."""

    def probe(self) -> "Deferred[object]":
        return self._dockerd.probe()

    def startService(self) -> None:
        settings = self.settings
        prepare_listening_path(settings.listen_path)
        self._factory = factory = DockerProxyFactory(
            settings.backend_path, self._reactor, self._interceptor, self._dockerd.unavailable
        )
        # Each client connection holds a second descriptor while it is spliced to dockerd.
        limit = descriptor_limit()
        connections = connection_cap(settings.bounds.connections, 2, limit)
        self.bounded = BoundedFactory(
            factory, replace(settings.bounds, connections=connections), IReactorTime(self._reactor), "the Docker API socket"
        )
        self.bounded.noisy = False
        self._port = self._reactor.listenUNIX(
            settings.listen_path, self.bounded, mode=SOCKET_MODE, wantPID=False  # type: ignore[arg-type]
        )
        restrict_socket(settings.listen_path, settings.socket_gid)
        super().startService()  # type: ignore[no-untyped-call]
        self.log.info(
            "serving the Docker API on unix://{listen}, backend unix://{backend}",
            listen=settings.listen_path,
            backend=settings.backend_path,
        )
        self.log.info(
            "Docker API connections: at most {connections} open, {own} of {limit} file descriptors kept for koordrp's own",
            connections=connections,
            own=OWN_DESCRIPTORS,
            limit=limit,
        )
        if reserve_unkept(limit, connections, 2):
            self.log.warn(
                "only {limit} file descriptors: clients may take those koordrp keeps for its own calls to dockerd "
                "and hook servers; raise its hard limit (LimitNOFILE=)",
                limit=limit,
            )
        self._dockerd.cgroup_driver.start()
        self._sync.start()

    def stopService(self) -> "Deferred[None] | None":
        super().stopService()  # type: ignore[no-untyped-call]
        self._sync.stop()
        self._dockerd.cgroup_driver.stop()
        port, self._port = self._port, None
        factory = self._factory
        if port is None or factory is None:
            return None
        return ensureDeferred(self._drain(port, factory))

    async def _drain(self, port: IListeningPort, factory: DockerProxyFactory) -> None:
        """No new connections; calls in flight, then post hooks, within the stop's bound; then whatever is still
        open (streams, lingering refusals) is closed."""
        clock = IReactorTime(self._reactor)
        deadline = clock.seconds() + self.settings.grace_period
        await maybeDeferred(port.stopListening)
        await factory.quiet(deadline - clock.seconds())
        await self._parts.dispatcher.drain(deadline - clock.seconds())
        await factory.let_go()
        remove_socket(self.settings.listen_path)
        self.log.info("stopped; removed unix://{listen}", listen=self.settings.listen_path)
