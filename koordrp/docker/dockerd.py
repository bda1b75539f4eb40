"""dockerd as koordrp itself talks to it: one exchange per request, on the reactor, always bounded.

Each exchange is one connection carrying one whole request with ``Connection: close``; it fires with
the raw response once dockerd closes. Cancelling it (the client that asked went away) or its timeout
aborts the connection at once, so no file descriptor outlives the question. The questions koordrp
asks for itself (inspect, info, listings, /_ping) are bounded; a call forwarded for a client is
bounded by that client, who may wait as long as dockerd takes (a stop with a long grace period).
"""

from typing import Any

from twisted.internet import protocol
from twisted.internet.defer import CancelledError, Deferred, ensureDeferred
from twisted.internet.interfaces import IAddress, IConnector, IReactorTime, IReactorUNIX, ITCPTransport
from twisted.python.failure import Failure

from koordrp.docker import translate
from koordrp.docker.http import HTTPError, parse_response
from koordrp.adapters import LookupFailed, PodSource, Unreadable
from koordrp.store import ContainerState, StoredContainer, StoredPod, runtime_state

CONNECT_SECONDS = 10.0
QUESTION_SECONDS = 10.0
"""How long dockerd may take to answer a question koordrp asks for itself (inspect, info, listings)."""
PROBE_SECONDS = 2.0
"""How long /_ping may take before /healthz says dockerd does not answer (as CRI mode's probe)."""

class NoAnswer(Exception):
    """dockerd accepted the question and did not answer it in time."""


_LISTING = '/containers/json?all=1&filters={"label":["io.kubernetes.docker.type"]}'


class _Collect(protocol.Protocol):
    def __init__(self, request: bytes, done: "Deferred[bytes]") -> None:
        self.request = request
        self.done = done
        self.received: list[bytes] = []

    def connectionMade(self) -> None:
        self.transport.write(self.request)  # type: ignore[union-attr]

    def dataReceived(self, data: bytes) -> None:
        self.received.append(data)

    def connectionLost(self, reason: Failure = protocol.connectionDone) -> None:
        if not self.done.called:
            self.done.callback(b"".join(self.received))


class _CollectFactory(protocol.ClientFactory):
    noisy = False  # one per exchange: "Starting factory" lines would drown the log

    def __init__(self, request: bytes, done: "Deferred[bytes]") -> None:
        self.request = request
        self.done = done

    def buildProtocol(self, addr: IAddress | None) -> _Collect:
        return _Collect(self.request, self.done)

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


def exchange(reactor: IReactorUNIX, path: str, request: bytes, timeout: float | None = None) -> "Deferred[bytes]":
    """Send one whole request to the unix socket ``path``; fires with the raw response once it closes."""
    connector: list[IConnector] = []
    done: Deferred[bytes] = Deferred(lambda _: _abort(connector[0]))
    connector.append(reactor.connectUNIX(path, _CollectFactory(request, done), timeout=CONNECT_SECONDS))
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
    ) -> None:
        self._reactor = reactor
        self.path = path
        self._question_seconds = question_seconds
        self._probe_seconds = probe_seconds
        self._cgroup_driver: str | None = None

    def exchange(self, request: bytes, timeout: float | None = None) -> "Deferred[bytes]":
        return exchange(self._reactor, self.path, request, timeout)

    async def get_json(self, path: str, timeout: float | None = None) -> Any:
        """The JSON dockerd answers ``GET path`` with, None unless it answers 200; LookupFailed if it cannot say.

        Bounded by koordrp's own bound for its questions, or ``timeout`` if that is shorter.
        """
        bound = self._question_seconds if timeout is None else min(timeout, self._question_seconds)
        try:
            response = parse_response(await self.exchange(_get(path), bound))
            return response.json() if response.status == 200 else None
        except (HTTPError, ValueError) as error:
            raise LookupFailed(f"GET {path}: dockerd's answer cannot be read: {error}") from None
        except CancelledError:
            raise
        except Exception as error:
            raise LookupFailed(f"GET {path}: {_reason(error)}") from None

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

    async def cgroup_driver(self) -> str:
        if self._cgroup_driver is None:
            info = await self.get_json("/info")
            self._cgroup_driver = str((info or {}).get("CgroupDriver") or "cgroupfs")
        return self._cgroup_driver

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
        listing = await self.get_json(_LISTING, timeout)
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
        if inspect is None or translate.kind_of_inspect(inspect) != "sandbox":
            return None
        try:
            info = translate.stored_sandbox_from_inspect(inspect, await self.cgroup_driver())
        except translate.DockerShapeError as error:
            raise Unreadable(str(error)) from None
        return StoredPod.read_back(info, _state(inspect) is ContainerState.STOPPED)

    async def container_from(self, inspect: dict[str, Any] | None, pods: PodSource) -> StoredContainer | None:
        if inspect is None or translate.kind_of_inspect(inspect) != "container":
            return None
        try:
            sandbox_id = translate.sandbox_id_of_inspect(inspect)
            pod = await pods(sandbox_id)
            info = translate.stored_container_from_inspect(inspect, pod, await self.cgroup_driver())
            return StoredContainer.read_back(sandbox_id, info, _state(inspect))
        except translate.DockerShapeError as error:
            raise Unreadable(str(error)) from None


def _state(inspect: dict[str, Any]) -> ContainerState:
    state = inspect.get("State")
    status = state.get("Status") if isinstance(state, dict) else None
    return runtime_state(status if isinstance(status, str) else "")


def _reason(error: BaseException) -> str:
    return str(error) or type(error).__name__
