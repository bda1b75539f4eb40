"""dockerd as koordrp itself talks to it: one exchange per request, on the reactor, always bounded.

Each exchange is one connection carrying one whole request with ``Connection: close``; it fires with
the raw response once dockerd closes. Cancelling it (the client that asked went away) or its timeout
aborts the connection at once, so no file descriptor outlives the question. The questions koordrp
asks for itself (inspect, info, listings, /_ping) are bounded in time; a call forwarded for a client is
bounded by that client, who may wait as long as dockerd takes (a stop with a long grace period).
Every answer is bounded in size (``MAX_ANSWER_BYTES``, a listing ``MAX_LISTING_BYTES``).

dockerd's cgroup driver (``CgroupDriver``) is asked of ``GET /info`` at start, and again after
every failure (``koordrp.trouble``'s rule: backing off, said when it starts and when it ends), until
dockerd names it; meanwhile creates are read without it and leave hooks' cgroup parents alone.
"""

from typing import TYPE_CHECKING, Any, Callable

from twisted.internet import protocol
from twisted.internet.defer import CancelledError, Deferred, ensureDeferred, maybeDeferred, succeed
from twisted.internet.interfaces import IAddress, IConnector, IReactorTime, IReactorUNIX, ITCPTransport
from twisted.logger import Logger
from twisted.python.failure import Failure

from koordrp.docker import translate
from koordrp.docker.inspect import (
    kind_of_inspect,
    sandbox_id_of_inspect,
    state_of_inspect,
    stored_container_from_inspect,
    stored_sandbox_from_inspect,
)
from koordrp.docker.http import HTTPError, Response, in_units, json_response, parse_response
from koordrp.adapters import LookupFailed, PodSource, Unreadable
from koordrp.store import ContainerState, StoredContainer, StoredPod
from koordrp.text import shortened
from koordrp.trouble import RETRY_CAP_SECONDS, RETRY_SECONDS, Backoff, Retrying, Trouble

if TYPE_CHECKING:
    # Only --metrics-endpoint loads prometheus_client: it costs a node daemon ~6 MB of RSS.
    from koordrp.metrics import Metrics

CONNECT_SECONDS = 10.0
QUESTION_SECONDS = 10.0
"""How long dockerd may take to answer a question koordrp asks for itself (inspect, info, listings)."""
PROBE_SECONDS = 2.0
"""How long /_ping may take before /healthz says dockerd does not answer (as CRI mode's probe)."""

MAX_ANSWER_BYTES = 4 << 20
"""The most koordrp reads of one answer about one thing (an inspect, /info, an intercepted call's
answer): a pod's whole object in Kubernetes is at most ~1.5 MiB (etcd's request limit)."""
MAX_LISTING_BYTES = 64 << 20
"""The most koordrp reads of a listing of containers, whose labels carry their pods' annotations
(Kubernetes allows 256 KiB a pod): ~250 pods with the largest annotations allowed."""


class NoAnswer(Exception):
    """dockerd accepted the question and did not answer it in time."""


class AnswerTooLarge(Exception):
    """dockerd's answer is longer than koordrp reads."""


_LISTING = '/containers/json?all=1&filters={"label":["io.kubernetes.docker.type"]}'


class _Collect(protocol.Protocol):
    def __init__(self, request: bytes, done: "Deferred[bytes]", limit: int) -> None:
        self.request = request
        self.done = done
        self.limit = limit
        self.received: list[bytes] = []
        self.length = 0

    def connectionMade(self) -> None:
        self.transport.write(self.request)  # type: ignore[union-attr]

    def dataReceived(self, data: bytes) -> None:
        if self.done.called:
            return
        self.length += len(data)
        if self.length > self.limit:
            self.received = []
            self.transport.abortConnection()  # type: ignore[union-attr]
            self.done.errback(AnswerTooLarge(f"dockerd's answer is larger than {in_units(self.limit)}"))
            return
        self.received.append(data)

    def connectionLost(self, reason: Failure = protocol.connectionDone) -> None:
        if not self.done.called:
            self.done.callback(b"".join(self.received))


class _CollectFactory(protocol.ClientFactory):
    noisy = False  # one per exchange: "Starting factory" lines would drown the log

    def __init__(self, request: bytes, done: "Deferred[bytes]", limit: int) -> None:
        self.request = request
        self.done = done
        self.limit = limit

    def buildProtocol(self, addr: IAddress | None) -> _Collect:
        return _Collect(self.request, self.done, self.limit)

    def clientConnectionFailed(self, connector: IConnector, reason: Failure) -> None:
        if not self.done.called:
            self.done.errback(reason)


def _abort(connector: IConnector) -> None:
    """Drop the exchange now: stop connecting, or close without waiting to flush what dockerd never read."""
    transport = getattr(connector, "transport", None)
    if transport is not None:
        ITCPTransport(transport).abortConnection()
    else:
        connector.stopConnecting()


def exchange(
    reactor: IReactorUNIX, path: str, request: bytes, timeout: float | None = None, limit: int = MAX_ANSWER_BYTES
) -> "Deferred[bytes]":
    """Send one whole request to the unix socket ``path``; fires with the raw response once it closes.

    AnswerTooLarge as soon as more than ``limit`` bytes arrived (the connection is dropped).
    """
    connector: list[IConnector] = []
    done: Deferred[bytes] = Deferred(lambda _: _abort(connector[0]))
    connector.append(reactor.connectUNIX(path, _CollectFactory(request, done, limit), timeout=CONNECT_SECONDS))
    if timeout is not None:
        done.addTimeout(timeout, IReactorTime(reactor), onTimeoutCancel=_no_answer)
    return done


def _no_answer(result: object, timeout: float) -> object:
    raise NoAnswer(f"no answer within {timeout:g}s")


def _get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: docker\r\nConnection: close\r\n\r\n".encode()


class Dockerd:
    """The questions koordrp asks dockerd; its answers about Kubernetes containers, as the store keeps them."""

    def __init__(
        self,
        reactor: IReactorUNIX,
        path: str,
        question_seconds: float = QUESTION_SECONDS,
        probe_seconds: float = PROBE_SECONDS,
        *,
        metrics: "Metrics | None" = None,
        driver_backoff: Backoff | None = None,
    ) -> None:
        """``reactor`` also provides IReactorTime; ``driver_backoff`` spaces the questions for the cgroup driver
        while they fail (CgroupDriver's default if None)."""
        self._reactor = reactor
        self.path = path
        self._question_seconds = question_seconds
        self._probe_seconds = probe_seconds
        self.cgroup_driver = CgroupDriver(
            lambda: ensureDeferred(self._read_cgroup_driver()), IReactorTime(reactor), driver_backoff, metrics
        )

    def exchange(self, request: bytes, timeout: float | None = None, limit: int = MAX_ANSWER_BYTES) -> "Deferred[bytes]":
        return exchange(self._reactor, self.path, request, timeout, limit)

    def unavailable(self, reason: str) -> bytes:
        """The answer to a client when dockerd cannot be reached."""
        message = f"koordrp: backend unix://{self.path} is unavailable: {reason}"
        return json_response(503, "Service Unavailable", message)

    async def _get(self, path: str, timeout: float | None = None, limit: int = MAX_ANSWER_BYTES) -> Response:
        """dockerd's answer to ``GET path``; LookupFailed if there is none koordrp can read.

        Bounded by koordrp's own bound for its questions, or ``timeout`` if that is shorter.
        """
        bound = self._question_seconds if timeout is None else min(timeout, self._question_seconds)
        try:
            return parse_response(await self.exchange(_get(path), bound, limit))
        except HTTPError as error:
            raise LookupFailed(f"GET {path}: dockerd's answer cannot be read: {error}") from None
        except CancelledError:
            raise
        except Exception as error:
            raise LookupFailed(f"GET {path}: {_reason(error)}") from None

    async def get_json(self, path: str, timeout: float | None = None, limit: int = MAX_ANSWER_BYTES) -> Any:
        """The JSON dockerd answers ``GET path`` with, None unless it answers 200; LookupFailed if it cannot say."""
        response = await self._get(path, timeout, limit)
        return _json(path, response) if response.status == 200 else None

    def probe(self) -> "Deferred[object]":
        """Whether dockerd answers /_ping now (for /healthz); the failure names dockerd and why."""
        return ensureDeferred(self._ping())

    async def _ping(self) -> object:
        try:
            response = parse_response(await self.exchange(_get("/_ping"), self._probe_seconds))
        except Exception as error:
            raise RuntimeError(f"backend unix://{self.path} (dockerd): {_reason(error)}") from None
        if response.status != 200:
            raise RuntimeError(f"backend unix://{self.path} (dockerd) answered /_ping with {response.status}")
        return None

    async def _read_cgroup_driver(self) -> str:
        response = await self._get("/info")
        if response.status != 200:
            raise LookupFailed(f"GET /info: dockerd answered {response.status}{_message(response)}")
        info = _json("/info", response)
        driver = info.get("CgroupDriver") if isinstance(info, dict) else None
        if not isinstance(driver, str) or not driver:
            raise LookupFailed("GET /info: dockerd's answer names no CgroupDriver")
        return driver

    async def inspect(self, identifier: str, timeout: float | None = None) -> dict[str, Any] | None:
        """``GET /containers/{id}/json``: None when dockerd does not know ``identifier`` (an id or a name)."""
        found = await self.get_json(f"/containers/{identifier}/json", timeout)
        return found if isinstance(found, dict) else None

    # adapters.RuntimeInventory

    async def read_pod(self, sandbox_id: str, timeout: float | None) -> StoredPod | None:
        return await self.pod_from(await self.inspect(sandbox_id, timeout))

    async def read_container(self, container_id: str, pods: PodSource, timeout: float | None) -> StoredContainer | None:
        return await self.container_from(await self.inspect(container_id, timeout), pods)

    async def listed(self, timeout: float | None) -> tuple[list[str], list[str]]:
        listing = await self.get_json(_LISTING, timeout, MAX_LISTING_BYTES)
        if not isinstance(listing, list):
            raise LookupFailed("dockerd did not list its containers")
        kinds = {
            str(entry.get("Id", "")): translate.kind_of(entry) for entry in listing if isinstance(entry, dict)
        }
        return (
            [identifier for identifier, kind in kinds.items() if kind == "sandbox"],
            [identifier for identifier, kind in kinds.items() if kind == "container"],
        )

    async def pod_from(self, inspect: dict[str, Any] | None) -> StoredPod | None:
        if inspect is None or kind_of_inspect(inspect) != "sandbox":
            return None
        try:
            info = stored_sandbox_from_inspect(inspect, await self.cgroup_driver.current())
        except translate.DockerShapeError as error:
            raise Unreadable(str(error)) from None
        return StoredPod.read_back(info, state_of_inspect(inspect) is ContainerState.STOPPED)

    async def container_from(self, inspect: dict[str, Any] | None, pods: PodSource) -> StoredContainer | None:
        if inspect is None or kind_of_inspect(inspect) != "container":
            return None
        try:
            sandbox_id = sandbox_id_of_inspect(inspect)
            pod = await pods(sandbox_id)
            info = stored_container_from_inspect(inspect, pod, await self.cgroup_driver.current())
            return StoredContainer.read_back(sandbox_id, info, state_of_inspect(inspect))
        except translate.DockerShapeError as error:
            raise Unreadable(str(error)) from None


def _reason(error: BaseException) -> str:
    return str(error) or type(error).__name__


def _json(path: str, response: Response) -> Any:
    try:
        return response.json()
    except ValueError as error:
        raise LookupFailed(f"GET {path}: dockerd's answer cannot be read: {error}") from None


def _message(response: Response) -> str:
    """dockerd's own words in an error answer (``{"message": …}``), after a colon; "" if it has none."""
    try:
        document = response.json()
    except ValueError:
        return ""
    message = document.get("message") if isinstance(document, dict) else None
    return f": {shortened(message)}" if isinstance(message, str) and message else ""


class CgroupDriver:
    """dockerd's cgroup driver, as ``GET /info`` names it.

    Asked at start; kept once dockerd named it (it changes only when dockerd restarts with other
    settings, and kubelet's must change with it). A question that fails is never taken for an answer:
    it is asked again in the background, by ``koordrp.trouble``'s rule (RETRY_SECONDS, doubled
    after each failure up to RETRY_CAP_SECONDS; one warning when it starts and one for each new
    reason, one info line when dockerd names it, each failure counted as ``docker-cgroup-driver`` on
    /metrics). Until then creates go on without it at once, except while a question is out: they
    wait for its answer (itself bounded).
    """

    log = Logger()

    def __init__(
        self,
        read: Callable[[], "Deferred[str]"],
        clock: IReactorTime,
        backoff: Backoff | None = None,
        metrics: "Metrics | None" = None,
    ) -> None:
        """``read`` asks dockerd; LookupFailed says why it could not."""
        self._read = read
        self._driver: str | None = None
        self._asking: Deferred[None] | None = None
        self._waiting: list[Deferred[str | None]] = []
        self._running = False
        self._retrying = Retrying(
            clock,
            self.log,
            Trouble(
                "dockerd's cgroup driver is {driver} again, after {failures} failed attempts to read it",
                started="cannot read dockerd's cgroup driver: {problem}; until it can, creates leave hooks' cgroup "
                "parents alone; asking again in {retry:g}s, then less often (at most every {cap:g}s)",
            ),
            backoff if backoff is not None else Backoff(RETRY_SECONDS, RETRY_CAP_SECONDS),
            "docker-cgroup-driver",
            metrics,
        )

    def start(self) -> None:
        self._running = True
        if self._driver is None and self._asking is None:
            self._ask()

    def stop(self) -> None:
        self._running = False
        self._retrying.cancel()
        if self._asking is not None:
            self._asking.cancel()

    def current(self) -> "Deferred[str | None]":
        """The driver; while koordrp asks, once dockerd answers; None while the questions fail.

        Cancelling it cancels only this wait, not the question.
        """
        if self._driver is not None or (self._asking is None and self._retrying.failing is not None):
            return succeed(self._driver)
        if self._asking is None:
            self._ask()
            if self._asking is None:  # answered at once
                return succeed(self._driver)
        waiting: Deferred[str | None] = Deferred()
        self._waiting.append(waiting)
        return waiting

    def _ask(self) -> None:
        asking = maybeDeferred(self._read).addCallbacks(self._named, self._failed)
        if not asking.called:
            self._asking = asking
            asking.addBoth(self._answered)

    def _answered(self, _: object) -> None:
        self._asking = None
        waiting, self._waiting = self._waiting, []
        for each in waiting:
            if not each.called:
                each.callback(self._driver)

    def _named(self, driver: str) -> None:
        self._driver = driver
        if self._retrying.failing is None:
            self.log.info("dockerd's cgroup driver is {driver}", driver=driver)
        self._retrying.succeeded(driver=driver)

    def _failed(self, failure: Failure) -> None:
        if isinstance(failure.value, CancelledError) and not self._running:
            return
        if isinstance(failure.value, LookupFailed):
            reason = shortened(str(failure.value))
        else:
            reason = f"{type(failure.value).__name__}: {shortened(str(failure.value))}"
            self.log.failure("reading dockerd's cgroup driver failed unexpectedly", failure)
        if self._running:
            self._retrying.failed(reason, self._ask)
