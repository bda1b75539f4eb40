"""``--metrics-endpoint``: Prometheus metrics at /metrics, a health check at /healthz (koordrp serves
calls: the runtime answers, or koordrp is containerd's NRI plugin) and /livez (koordrp's reactor turns, and
it has file descriptors left).

The endpoint's connections are bounded (``METRICS_BOUNDS``, ``koordrp.bounds``): whoever may connect
cannot hold koordrp's descriptors. A ``unix:`` endpoint's socket is made as koordrp makes its CRI
socket (``koordrp.unix``: its directory checked, a stale socket replaced), 0660 unless the endpoint
says ``mode=``, and the lock Twisted keeps beside it (``<path>.lock``, the pid of the koordrp
serving it) is taken over when that pid is not a live koordrp (gone, a zombie, or reused).
"""

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from twisted.application import service
from twisted.internet import endpoints
from twisted.internet.defer import CancelledError, Deferred, maybeDeferred
from twisted.internet.interfaces import IListeningPort, IReactorTime, IReactorUNIX
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web.http import HTTPChannel
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from koordrp import bounds
from koordrp.bounds import Bounds, BoundedFactory
from koordrp.metrics import Metrics
from koordrp.unix import CannotListen, SocketInUse, prepare_listening_path, umask

# "The backend answered within the last few seconds": a success this recent is not asked again.
FRESH_SECONDS = 5.0

Probe = Callable[[], "Deferred[object]"]


class MetricsResource(Resource):
    """The registry in Prometheus' text format, rendered on the reactor.

    prometheus_client's own resource is a WSGI application, which reads the client's address as a
    host and port: on a unix endpoint it fails every scrape.
    """

    isLeaf = True

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._registry = registry

    def render_GET(self, request: Request) -> bytes:
        request.setHeader(b"Content-Type", CONTENT_TYPE_LATEST.encode())  # type: ignore[no-untyped-call]
        return generate_latest(self._registry)


class Readiness:
    """Whether koordrp serves calls, as /healthz answers and ``koordrp_ready`` reports it: the front end's probe
    (the runtime answers; NRI mode: koordrp is containerd's plugin, synchronized), a success trusted for
    FRESH_SECONDS.

    At most one probe is in flight: the /healthz requests and the scrapes that come meanwhile share it, so
    that probes and scrapes, however many, ask the runtime once at a time.
    """

    def __init__(self, probe: Probe, reactor: IReactorTime) -> None:
        self._probe = probe
        self._reactor = reactor
        self._last_answer: float | None = None
        self._probing = False
        self._waiting: list[Deferred[str | None]] = []
        self.ready: bool | None = None
        """What the last probe that ended found; None until one has."""

    def answered_ago(self) -> float | None:
        """Seconds since the backend answered, while that is recent enough not to ask it again."""
        if self._last_answer is None:
            return None
        ago = self._reactor.seconds() - self._last_answer
        return ago if ago < FRESH_SECONDS else None

    def ask(self) -> Deferred[str | None]:
        """Fires once the probe in flight, or one begun now, ends: None if the backend answered, else why not.

        Cancelling it ends this wait alone: the probe goes on for whoever else waits, and is remembered.
        """
        waiting: Deferred[str | None] = Deferred(self._waiting.remove)
        self._waiting.append(waiting)
        self._begin()
        return waiting

    def refresh(self) -> None:
        """Probe, unless the last answer is recent enough or a probe is in flight; nobody waits for it."""
        if self.answered_ago() is None:
            self._begin()

    def _begin(self) -> None:
        if not self._probing:
            self._probing = True
            maybeDeferred(self._probe).addBoth(self._ended)

    def _ended(self, result: object) -> None:
        self._probing = False
        why_not = None
        if isinstance(result, Failure):
            # A failure ends the trust in an earlier success: /healthz and koordrp_ready say the same from now on.
            self._last_answer, self.ready, why_not = None, False, result.getErrorMessage()
        else:
            self._last_answer, self.ready = self._reactor.seconds(), True
        waiting, self._waiting = self._waiting, []
        for each in waiting:
            each.callback(why_not)


class HealthResource(Resource):
    """200 while the backend answers, 503 with the reason when it does not."""

    isLeaf = True

    def __init__(self, probe: Probe, reactor: IReactorTime) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.readiness = Readiness(probe, reactor)

    def render_GET(self, request: Request) -> bytes | int:
        ago = self.readiness.answered_ago()
        if ago is not None:
            return b"ok: the backend answered %.1fs ago\n" % ago
        waiting = self.readiness.ask()
        # Asked before the answer may finish the request: a client that went away is not answered (twisted.web
        # refuses to finish a request whose connection is lost), and its wait ends.
        request.notifyFinish().addErrback(lambda _: waiting.cancel())
        waiting.addCallbacks(_answer_health, _wait_cancelled, callbackArgs=(request,))
        return NOT_DONE_YET


def _answer_health(why_not: str | None, request: Request) -> None:
    if why_not is None:
        request.write(b"ok: the backend answers\n")  # type: ignore[no-untyped-call]
    else:
        request.setResponseCode(503)
        request.write(f"unhealthy: {why_not}\n".encode())  # type: ignore[no-untyped-call]
    request.finish()  # type: ignore[no-untyped-call]


def _wait_cancelled(failure: Failure) -> None:
    failure.trap(CancelledError)  # type: ignore[no-untyped-call]


class _ReadinessCollector(Collector):
    """``koordrp_ready``: 1 while /healthz would answer 200, 0 while it would answer 503.

    Asked at each scrape, as /healthz asks, so that the gauge needs no probe to have come (a node
    without kubelet's probes has it too). NRI mode's probe only looks at koordrp's connection to
    containerd and has its answer at once: the gauge is what /healthz would answer at that moment. The
    proxies' probe asks the runtime on its socket (up to 2 s), which a scrape, rendered at once on the
    reactor, does not wait for: the gauge then says what the last probe that ended found (the previous
    scrape's, or /healthz's), and this scrape's probe, or the one in flight it leaves alone, is the next
    one's; before any has ended there is no sample.
    """

    def __init__(self, readiness: Readiness) -> None:
        self._readiness = readiness

    def collect(self) -> Iterable[Metric]:
        self._readiness.refresh()
        if self._readiness.ready is not None:
            yield GaugeMetricFamily(
                "koordrp_ready",
                "1 while /healthz answers 200 (the runtime answers; NRI mode: koordrp is containerd's plugin), 0 while it "
                "answers 503",
                value=int(self._readiness.ready),
            )


class LiveResource(Resource):
    """200 from the reactor: a koordrp whose reactor stalls (a deadlock) answers nothing, which restarts it;
    503 when koordrp has (almost) no file descriptor left, where it can open no socket or file and a restart
    gives it back those it leaked.

    Nothing else is asked: a koordrp whose runtime is away is alive, retrying by itself, and a
    restart would not bring the runtime back (that is /healthz's to say).
    """

    isLeaf = True

    def __init__(self, descriptors: Callable[[], tuple[int, int]] = bounds.descriptors_in_use) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._descriptors = descriptors

    def render_GET(self, request: Request) -> bytes:
        shortage = bounds.descriptor_shortage(self._descriptors)
        if shortage is not None:
            request.setResponseCode(503)
            return f"unhealthy: {shortage}\n".encode()
        return b"ok: koordrp's reactor answers\n"


METRICS_BOUNDS = Bounds(connections=64, arrival_seconds=10.0, idle_seconds=30.0, arrival_bytes=64 * 1024)
"""A scraper or a probe sends its request at once and reads the answer; 64 connections are far more than
a node's scrapers and probes hold, and far fewer than koordrp's descriptors (1024 at the least)."""
UNIX_SOCKET_MODE = 0o660
"""A ``unix:`` metrics socket's mode unless the endpoint says ``mode=``: root and koordrp's group."""


class BoundedHTTPChannel(HTTPChannel):
    """twisted.web's channel, telling ``koordrp.bounds`` where each request is whole and when it is done.

    twisted.web's own timeout restarts with every byte that comes, so it never closes a client that
    drips its request: the bounds do that instead (the site has no timeout of its own).
    """

    def allContentReceived(self) -> None:
        bounds.arrived(self.transport)
        super().allContentReceived()  # type: ignore[no-untyped-call]

    def requestDone(self, request: Request) -> None:
        # First: a pipelined request already here is read by the channel's own requestDone.
        bounds.waiting(self.transport)
        super().requestDone(request)  # type: ignore[no-untyped-call]


class _Site(Site):
    protocol = BoundedHTTPChannel  # type: ignore[assignment]

    def log(self, request: http.Request) -> None:
        """No access log: every client of the endpoint would write koordrp's log (probes and scrapes every few
        seconds, and whoever else reaches the port), drowning its own lines."""


@dataclass(frozen=True)
class UnixListening:
    """A ``unix:`` endpoint as koordrp listens on it (Twisted's syntax: ``unix:PATH[:mode=660][:backlog=50][:lockfile=1]``)."""

    path: str
    mode: int = UNIX_SOCKET_MODE
    backlog: int = 50
    lock: bool = True


def _fields(description: str) -> tuple[list[str], dict[str, str]]:
    """Twisted's endpoint syntax: ``:``-separated fields, ``key=value`` keywords, ``\\`` escaping the next character."""
    fields: list[list[str]] = [[""]]
    characters = iter(description)
    for character in characters:
        if character == "\\":
            fields[-1][-1] += next(characters, "")
        elif character == ":":
            fields.append([""])
        elif character == "=" and len(fields[-1]) == 1:
            fields[-1].append("")
        else:
            fields[-1][-1] += character
    positional = [field[0] for field in fields if len(field) == 1]
    keywords = {field[0]: field[1] for field in fields if len(field) == 2}
    return positional, keywords


def unix_listening(description: str) -> UnixListening | None:
    """The unix socket a ``unix:`` endpoint names; None for any other endpoint. ValueError: not one koordrp takes."""
    positional, keywords = _fields(description)
    if positional[0] != "unix":
        return None
    unknown = set(keywords) - {"address", "mode", "backlog", "lockfile"}
    if unknown:
        raise ValueError(f"unknown parameters {', '.join(sorted(unknown))}")
    addresses = positional[1:] + ([keywords["address"]] if "address" in keywords else [])
    if len(addresses) != 1 or not addresses[0].startswith("/"):
        raise ValueError("a unix endpoint names one absolute path, e.g. unix:/var/run/koord-runtimeproxy/metrics.sock")
    try:
        mode = int(keywords.get("mode", f"{UNIX_SOCKET_MODE:o}"), 8)
        backlog = int(keywords.get("backlog", "50"))
        lock = bool(int(keywords.get("lockfile", "1")))
    except ValueError as error:
        raise ValueError(f"mode (octal), backlog and lockfile (0 or 1) are numbers: {error}") from None
    if not 0 <= mode <= 0o777:
        raise ValueError(f"mode {mode:o} is not a file mode")
    return UnixListening(os.path.normpath(addresses[0]), mode, backlog, lock)


def _holds_lock(pid: int) -> str | None:
    """What the live koordrp ``pid`` is (its command line), or None: gone, a zombie, this very process (an earlier
    koordrp's pid, which a container's koordrp has again), or another program (the pid reused)."""
    if pid == os.getpid() or pid <= 0:
        return None
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except PermissionError:
        return f"pid {pid} (koordrp may not read its /proc entry)"
    states = [line.split()[1] for line in status.splitlines() if line.startswith("State:") and len(line.split()) > 1]
    if not states or states[0] in ("Z", "X"):
        return None
    arguments = [os.path.basename(argument.decode(errors="replace")) for argument in command.split(b"\0") if argument]
    if any("koordrp" in argument or argument.startswith("twistd") for argument in arguments):
        return f"pid {pid} ({' '.join(arguments)[:200]})"
    return None


def take_over_stale_lock(path: str) -> int | None:
    """Remove ``path``'s lock (``<path>.lock``, Twisted's) unless a live koordrp holds it; the pid it named, if removed.

    Twisted refuses a lock whose pid is alive, which after an unclean exit may be a zombie or another
    program that got the pid (in a container, koordrp's next start has the same one): koordrp reads
    ``/proc/<pid>`` instead.
    """
    lock = path + ".lock"
    try:
        named = os.readlink(lock)
    except FileNotFoundError:
        return None
    except OSError:
        raise CannotListen(f"{lock} is in the way of {path}'s lock and is not one (not a symbolic link); remove it") from None
    pid = int(named) if named.isdigit() else -1
    holder = _holds_lock(pid)
    if holder is not None:
        raise SocketInUse(f"{path} is locked ({lock}) by a live koordrp, {holder}")
    os.unlink(lock)
    return pid


def listen_unix(reactor: IReactorUNIX, listening: UnixListening, factory: BoundedFactory) -> IListeningPort:
    """Listen as ``listening`` says, koordrp's way (``koordrp.unix``); CannotListen says why not."""
    path = listening.path
    prepare_listening_path(path)
    if listening.lock:
        take_over_stale_lock(path)
    try:
        # Under a umask: the socket is never, even briefly, wider than its mode.
        with umask(0o777 & ~listening.mode):
            return reactor.listenUNIX(
                path, factory, backlog=listening.backlog, mode=listening.mode, wantPID=listening.lock  # type: ignore[arg-type]
            )
    except Exception as error:
        raise CannotListen(f"cannot listen on {path}: {error}") from None


class MetricsServer(service.Service):
    """The endpoint's listening port. One it cannot take is one error line, and koordrp serves calls without it."""

    log = Logger()

    def __init__(self, endpoint: str, factory: BoundedFactory, reactor: object) -> None:
        """``reactor`` provides IReactorTCP, IReactorUNIX, whatever ``endpoint`` takes."""
        self.endpoint = endpoint
        self.factory = factory
        self._reactor = reactor
        self.port: IListeningPort | None = None
        self._started = False

    def privilegedStartService(self) -> None:
        # twistd calls this as root, before it drops privileges (--uid): a port under 1024 can be had.
        super().privilegedStartService()  # type: ignore[no-untyped-call]
        self._listen()

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        if not self._started:
            self._listen()

    def _listen(self) -> None:
        self._started = True
        try:
            listening = unix_listening(self.endpoint)
            if listening is not None:
                self.port = listen_unix(IReactorUNIX(self._reactor), listening, self.factory)
                return
            outcome: list[object] = []
            endpoint = endpoints.serverFromString(self._reactor, self.endpoint)  # type: ignore[no-untyped-call]
            endpoint.listen(self.factory).addBoth(outcome.append)
            if outcome and isinstance(outcome[0], Failure):
                raise CannotListen(outcome[0].getErrorMessage())
            if outcome:
                self.port = IListeningPort(outcome[0])
        except (CannotListen, OSError, ValueError) as error:
            self.log.error(
                "cannot serve /metrics, /healthz and /livez on {endpoint}: {error}; koordrp goes on without them",
                endpoint=self.endpoint,
                error=str(error),
            )

    def stopService(self) -> "Deferred[None] | None":
        super().stopService()  # type: ignore[no-untyped-call]
        self._started = False
        port, self.port = self.port, None
        return None if port is None else port.stopListening()


class _ConnectionsCollector(Collector):
    def __init__(self, factory: BoundedFactory) -> None:
        self._factory = factory

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily("koordrp_metrics_connections", "connections open to --metrics-endpoint", value=self._factory.open)
        closed = CounterMetricFamily(
            "koordrp_metrics_connections_closed",
            "connections to --metrics-endpoint koordrp closed, by reason: idle, slow (no whole request within its "
            "bound), oversized, evicted (aborted for a newer one, at the cap), refused (closed at once, at the cap)",
            labels=["reason"],
        )
        for reason, count in self._factory.closed.items():
            closed.add_metric([reason], count)
        yield closed


def metrics_service(endpoint: str, metrics: Metrics, probe: Probe, reactor: IReactorTime) -> MetricsServer:
    root = Resource()  # type: ignore[no-untyped-call]
    root.putChild(b"metrics", MetricsResource(metrics.registry))
    health = HealthResource(probe, reactor)
    root.putChild(b"healthz", health)
    root.putChild(b"livez", LiveResource())
    # No timeout of its own (twisted.web's restarts with each byte): the bounds close idle and slow clients.
    site = _Site(root, timeout=None, reactor=reactor)  # type: ignore[no-untyped-call]
    site.noisy = False
    factory = BoundedFactory(site, METRICS_BOUNDS, reactor, "the metrics endpoint")
    factory.noisy = False
    metrics.registry.register(_ConnectionsCollector(factory))
    metrics.registry.register(_ReadinessCollector(health.readiness))
    return MetricsServer(endpoint, factory, reactor)
