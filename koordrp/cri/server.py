"""The CRI proxy as a Twisted service: a threaded grpcio server that lives between start and stop."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
from twisted.application import service
from twisted.internet.defer import Deferred, fail
from twisted.internet.interfaces import IReactorThreads, IReactorTime
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from zope.interface import implementer

from koordrp.bounds import OWN_DESCRIPTORS, connection_cap, descriptor_limit, reserve_unkept
from koordrp.call import Parts
from koordrp.cri.backend import CHANNEL_OPTIONS, Answer, BackendChannel, call_unary
from koordrp.cri.handoff import Later
from koordrp.cri.intercept import Interceptor
from koordrp.cri.methods import BackendRole
from koordrp.cri.passthrough import PassThroughHandler
from koordrp.cri.reachability import Reachability
from koordrp.cri.runtime_lookup import RuntimeLookup
from koordrp.frontend import IFrontEnd
from koordrp.resync import StoreSync
from koordrp.unix import SOCKET_MODE, grpc_target, prepare_listening_path, remove_socket, restrict_socket, umask

_REBUILD_TIMEOUT = 30.0
_PROBE_TIMEOUT = 2.0
# How long after a CRI call's answer its end (store, post hooks, line) may wait for the reactor: long
# enough for kubelet to take the answer on a busy two-core node (~0.1 ms), too short to matter to anyone.
_END_AFTER_ANSWER_SECONDS = 0.001

MOST_CONNECTIONS = 256
"""The CRI socket's cap: kubelet holds two connections (runtime and image), crictl and koordrp check one each
while they run."""


@dataclass(frozen=True)
class CRIConnectionBounds:
    """What one client connection to the CRI socket may hold, enforced by grpc core (each verified with grpcio 1.85
    in ``tests.unit.test_service``).

    A connection must send HTTP/2's preface and SETTINGS within ``handshake_seconds``, however dripped; one
    without a call in flight is sent GOAWAY after ``idle_seconds`` (a call in flight, a stream such as
    GetContainerEvents included, keeps it; grpc clients open a new one for their next call unseen); one with a
    call is pinged every ``keepalive_seconds`` and closed if the ping is not acknowledged within
    ``ping_timeout_seconds`` (a client that sent half a request and went silent). At most ``connections`` are
    open: one more is closed as it comes (kubelet's own stays open and keeps serving), fewer under a descriptor
    limit too low for them all (``connection_cap``).
    """

    handshake_seconds: float = 10.0
    idle_seconds: float = 60.0
    keepalive_seconds: float = 60.0
    ping_timeout_seconds: float = 20.0
    connections: int = MOST_CONNECTIONS


def server_options(bounds: CRIConnectionBounds, connections: int) -> list[tuple[str, int]]:
    """grpc's options for the CRI server: the channel's (message sizes left to the runtime), and the bounds."""
    return [
        *CHANNEL_OPTIONS,
        ("grpc.server_handshake_timeout_ms", round(bounds.handshake_seconds * 1000)),
        ("grpc.max_connection_idle_ms", round(bounds.idle_seconds * 1000)),
        ("grpc.keepalive_time_ms", round(bounds.keepalive_seconds * 1000)),
        # grpc 1.85 times a keepalive ping out after the ping timeout, not keepalive_timeout_ms: both are set.
        ("grpc.keepalive_timeout_ms", round(bounds.ping_timeout_seconds * 1000)),
        ("grpc.http2.ping_timeout_ms", round(bounds.ping_timeout_seconds * 1000)),
        ("grpc.max_allowed_incoming_connections", connections),
    ]


_REACHABILITY_MESSAGES = {
    Reachability.FIRST_CONNECTED: "backend unix://{endpoint} is reachable",
    Reachability.UNREACHABLE: "backend unix://{endpoint} is unreachable; CRI calls answer UNAVAILABLE until it is back",
    Reachability.RECOVERED: "backend unix://{endpoint} is reachable again",
}


@dataclass(frozen=True)
class CRIProxySettings:
    listen_path: str
    runtime_path: str
    image_path: str
    grace_period: float
    max_workers: int
    socket_gid: int | None = None
    """The group that may use the socket (mode 0660); None: koordrp's own group."""
    reconcile_interval: float = 0.0
    """Seconds between readings of the runtime for the store (0: at start and after an outage only)."""
    bounds: CRIConnectionBounds = field(default_factory=CRIConnectionBounds)


@implementer(IFrontEnd)
class CRIProxyService(service.Service):
    """Serves CRI v1 (and anything else) on a unix socket, forwarding to containerd.

    grpcio does not survive fork(), and twistd daemonizes after makeService(): every grpc object is
    made here in startService.
    """

    log = Logger()

    def __init__(self, settings: CRIProxySettings, reactor: IReactorThreads, parts: Parts) -> None:
        """``reactor`` also provides IReactorTime."""
        self.settings = settings
        self._parts = parts
        self._reactor = reactor
        self._server: grpc.Server | None = None
        self._handler: PassThroughHandler | None = None
        self._backends: list[BackendChannel] = []
        self._later: Later | None = None
        self._sync: StoreSync | None = None
        self.connections = 0
        """The most client connections the socket holds (``CRIConnectionBounds.connections``), once started."""

    def startService(self) -> None:
        settings = self.settings
        prepare_listening_path(settings.listen_path)
        runtime = BackendChannel(settings.runtime_path, self._report_reachability)
        image = runtime
        if settings.image_path != settings.runtime_path:
            image = BackendChannel(settings.image_path, self._report_reachability)
        self._backends = list({id(b): b for b in (runtime, image)}.values())
        lookup = RuntimeLookup(self._reactor, runtime.channel)
        self._later = Later.on(self._reactor, _END_AFTER_ANSWER_SECONDS)
        interceptor = Interceptor(self._reactor, runtime, self._parts, lookup, self._later.queue)
        backends = {BackendRole.RUNTIME: runtime, BackendRole.IMAGE: image}
        self._handler = PassThroughHandler(backends, interceptor.handlers, self._parts.metrics)
        limit = descriptor_limit()
        self.connections = connection_cap(settings.bounds.connections, 1, limit)
        server = grpc.server(
            ThreadPoolExecutor(max_workers=settings.max_workers, thread_name_prefix="koordrp-cri"),
            handlers=[self._handler],
            options=server_options(settings.bounds, self.connections),
        )
        with umask(0o777 & ~SOCKET_MODE):
            server.add_insecure_port(grpc_target(settings.listen_path))
            server.start()
        restrict_socket(settings.listen_path, settings.socket_gid)
        self._server = server
        super().startService()  # type: ignore[no-untyped-call]
        self.log.info(
            "serving CRI on unix://{listen}, runtime unix://{runtime}, image unix://{image}",
            listen=settings.listen_path,
            runtime=settings.runtime_path,
            image=settings.image_path,
        )
        self.log.info(
            "CRI connections: at most {connections} open, {own} of {limit} file descriptors kept for koordrp's own",
            connections=self.connections,
            own=OWN_DESCRIPTORS,
            limit=limit,
        )
        if reserve_unkept(limit, self.connections, 1):
            self.log.warn(
                "only {limit} file descriptors: clients may take those koordrp keeps for its runtime and hook calls; "
                "raise its hard limit (LimitNOFILE=)",
                limit=limit,
            )
        # CRI calls are served throughout: a call about something not learnt yet reads it back itself.
        self._sync = StoreSync(
            self._parts.store,
            lookup,
            IReactorTime(self._reactor),
            "the runtime",
            settings.reconcile_interval,
            _REBUILD_TIMEOUT,
            metrics=self._parts.metrics,
        )
        self._sync.start()

    def stopService(self) -> "Deferred[None]":
        super().stopService()  # type: ignore[no-untyped-call]
        if self._sync is not None:
            self._sync.stop()
        server, handler = self._server, self._handler
        assert server is not None and handler is not None
        self._server = None
        clock = IReactorTime(self._reactor)
        deadline = clock.seconds() + self.settings.grace_period
        self.log.info(
            "stopping: no new CRI calls; in-flight ones and post hooks get {grace:g}s", grace=self.settings.grace_period
        )
        handler.streams.end_all()
        stopped = server.stop(self.settings.grace_period)
        waited: Deferred[bool] = deferToThreadPool(self._reactor, self._reactor.getThreadPool(), stopped.wait)
        # Post hooks of calls that finished are still owed to their servers, within the same bound.
        drained = waited.addCallback(lambda _: self._parts.dispatcher.drain(deadline - clock.seconds()))
        return drained.addCallback(lambda _: self._release())

    def _release(self) -> None:
        for backend in self._backends:
            backend.close()
        self._backends = []
        if self._later is not None:
            self._later.close()
            self._later = None
        remove_socket(self.settings.listen_path)
        self.log.info("stopped; removed unix://{listen}", listen=self.settings.listen_path)

    def probe(self) -> "Deferred[object]":
        """Whether the runtime answers Version now (for /healthz)."""
        backends = self._backends
        if not backends:
            return fail(RuntimeError("koordrp is not serving"))
        backend = backends[0]
        version = backend.channel.unary_unary("/runtime.v1.RuntimeService/Version", None, None)
        asked = call_unary(self._reactor, version, b"", _PROBE_TIMEOUT)

        def answered(answer: Answer) -> object:
            if not answer.ok:
                raise RuntimeError(f"backend unix://{backend.path}: {answer.code.name}: {answer.details}")
            return None

        return asked.addCallback(answered)

    def _report_reachability(self, change: Reachability, endpoint: str) -> None:
        metrics = self._parts.metrics
        if metrics is not None:
            metrics.backend_up.labels(endpoint).set(0 if change is Reachability.UNREACHABLE else 1)
        # Connectivity callbacks arrive on a grpc thread; logs are written from the reactor.
        level = self.log.warn if change is Reachability.UNREACHABLE else self.log.info
        self._reactor.callFromThread(level, _REACHABILITY_MESSAGES[change], endpoint=endpoint)
        if change is Reachability.RECOVERED and endpoint == self.settings.runtime_path and self._sync is not None:
            # Pods may have been removed (or created) behind koordrp's back while it could not see.
            self._reactor.callFromThread(self._sync.sync)
