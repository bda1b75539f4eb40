"""``--metrics-endpoint``: Prometheus metrics at /metrics, a health check at /healthz (koordrp serves
calls: the runtime answers, or koordrp is containerd's NRI plugin) and /livez (koordrp's reactor turns)."""

from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from twisted.application import service, strports
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorCore, IReactorTime
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from koordrp.metrics import Metrics

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


class HealthResource(Resource):
    """200 while the backend answers, 503 with the reason when it does not."""

    isLeaf = True

    def __init__(self, probe: Probe, reactor: IReactorTime) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._probe = probe
        self._reactor = reactor
        self._last_answer: float | None = None

    def render_GET(self, request: Request) -> bytes | int:
        now = self._reactor.seconds()
        if self._last_answer is not None and now - self._last_answer < FRESH_SECONDS:
            return b"ok: the backend answered %.1fs ago\n" % (now - self._last_answer)
        asking = self._probe()

        def answered(_: object) -> None:
            self._last_answer = self._reactor.seconds()
            request.write(b"ok: the backend answers\n")  # type: ignore[no-untyped-call]
            request.finish()  # type: ignore[no-untyped-call]

        def failed(failure: Failure) -> None:
            request.setResponseCode(503)
            request.write(f"unhealthy: {failure.getErrorMessage()}\n".encode())  # type: ignore[no-untyped-call]
            request.finish()  # type: ignore[no-untyped-call]

        asking.addCallbacks(answered, failed)
        return NOT_DONE_YET


class LiveResource(Resource):
    """200 from the reactor: a koordrp whose reactor stalls (a deadlock) answers nothing, which restarts it.

    Nothing else is asked: a koordrp whose runtime is away is alive, retrying by itself, and a
    restart would not bring the runtime back (that is /healthz's to say).
    """

    isLeaf = True

    def render_GET(self, request: Request) -> bytes:
        return b"ok: koordrp's reactor answers\n"


def metrics_service(endpoint: str, metrics: Metrics, probe: Probe, reactor: IReactorTime) -> service.Service:
    root = Resource()  # type: ignore[no-untyped-call]
    root.putChild(b"metrics", MetricsResource(metrics.registry))
    root.putChild(b"healthz", HealthResource(probe, reactor))
    root.putChild(b"livez", LiveResource())  # type: ignore[no-untyped-call]
    site = Site(root)  # type: ignore[no-untyped-call]
    site.noisy = False
    served: service.Service = strports.service(endpoint, site, reactor=IReactorCore(reactor))
    return served
