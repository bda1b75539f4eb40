"""The Docker API on a unix socket: each request's head is read, then the connection is spliced to
dockerd byte for byte (streams, chunked bodies, hijacked attach/exec, half-closes), or, for the few
calls with hooks, handed whole to an interceptor.

dockerd is asked to close each connection after its answer, so a splice ends when the exchange
does and the next request on a client's keep-alive connection never slips past the head parser:
the client reconnects for it, as HTTP/1.1 clients do when told ``Connection: close``.
"""

import select
from dataclasses import dataclass
from typing import Callable

from twisted.internet import protocol
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IAddress, IConnector, IHalfCloseableProtocol, IReactorUNIX, ITransport
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import Interface, implementer

from koordrp.docker.http import (
    HEAD_END,
    MAX_BODY_BYTES,
    MAX_HEAD_BYTES,
    HTTPError,
    RequestHead,
    dechunk,
    json_response,
    parse_request_head,
)


@dataclass(frozen=True)
class Intercepted:
    """An intercepted call's answer: the whole response (None: the client is gone), and what follows it."""

    response: bytes | None
    delivered: Callable[[], None]
    """Called once the response has been handed to the client's connection (or the client is gone)."""


class IDockerInterceptor(Interface):
    def wants(head: RequestHead) -> bool:
        """Whether this request goes through hooks (its body is then read whole)."""

    def handle(head: RequestHead, body: bytes) -> Deferred:  # type: ignore[type-arg]
        """Fires with the call's ``Intercepted`` answer; cancelling it is the client going away."""


class _Upstream(protocol.Protocol):
    """dockerd's side of one spliced exchange."""

    def __init__(self, client: "DockerClientConnection") -> None:
        self.client = client

    def connectionMade(self) -> None:
        self.client.upstream_ready(self)

    def dataReceived(self, data: bytes) -> None:
        self.client.transport.write(data)  # type: ignore[union-attr]

    def connectionLost(self, reason: Failure = protocol.connectionDone) -> None:
        self.client.upstream_gone()


class _UpstreamFactory(protocol.ClientFactory):
    noisy = False  # one per request: "Starting factory" lines would drown the log

    def __init__(self, client: "DockerClientConnection") -> None:
        self.client = client

    def buildProtocol(self, addr: IAddress | None) -> _Upstream:
        return _Upstream(self.client)

    def clientConnectionFailed(self, connector: IConnector, reason: Failure) -> None:
        self.client.upstream_failed(reason)


@implementer(IHalfCloseableProtocol)
class DockerClientConnection(protocol.Protocol):
    log = Logger()

    def __init__(self, proxy: "DockerProxyFactory") -> None:
        self.proxy = proxy
        self._buffer = b""
        self._head: RequestHead | None = None
        self._upstream: _Upstream | None = None
        self._client_done_writing = False
        self._intercepting = False
        self._handling: Deferred[Intercepted] | None = None
        self._connecting: IConnector | None = None
        self._gone = False

    def dataReceived(self, data: bytes) -> None:
        if self._upstream is not None:
            self._upstream.transport.write(data)  # type: ignore[union-attr]
            return
        self._buffer += data
        if self._head is None:
            self._read_head()
        elif self._intercepting:
            self._read_body()

    def _read_head(self) -> None:
        end = self._buffer.find(HEAD_END)
        if end < 0:
            if len(self._buffer) > MAX_HEAD_BYTES:
                self._answer(json_response(431, "Request Header Fields Too Large", "koordrp: request head too large"))
            return
        try:
            self._head = parse_request_head(self._buffer[:end])
        except HTTPError as error:
            self._answer(json_response(400, "Bad Request", f"koordrp: {error}"))
            return
        self._buffer = self._buffer[end + len(HEAD_END) :]
        interceptor = self.proxy.interceptor
        if interceptor is not None and interceptor.wants(self._head):
            self._intercepting = True
            self._read_body()
        else:
            self._connecting = self.proxy.connect_upstream(_UpstreamFactory(self))

    def _read_body(self) -> None:
        head = self._head
        assert head is not None
        try:
            if head.chunked:
                whole = dechunk(self._buffer)
                if whole is None:
                    return
                body = whole[0]
            else:
                length = head.content_length() or 0
                if length > MAX_BODY_BYTES:
                    raise HTTPError("body larger than 1 MiB")
                if len(self._buffer) < length:
                    return
                body = self._buffer[:length]
        except HTTPError as error:
            self._answer(json_response(400, "Bad Request", f"koordrp: {error}"))
            return
        self._intercepting = False
        self._buffer = b""
        interceptor = self.proxy.interceptor
        assert interceptor is not None
        handled: Deferred[Intercepted] = interceptor.handle(head, body)
        self._handling = handled
        handled.addCallbacks(self._deliver, self._interceptor_failed)

    def _deliver(self, intercepted: Intercepted) -> None:
        self._handling = None
        if intercepted.response is not None:
            self._answer(intercepted.response)
        intercepted.delivered()

    def _interceptor_failed(self, failure: Failure) -> None:
        self._handling = None
        head = self._head
        assert head is not None
        self.log.failure("intercepting {method} {path} failed", failure, method=head.method, path=head.path)
        self._answer(json_response(500, "Internal Server Error", f"koordrp: {failure.getErrorMessage()}"))

    def _answer(self, response: bytes) -> None:
        if self._gone:
            return
        transport: ITransport = self.transport  # type: ignore[assignment]
        transport.write(response)
        transport.loseConnection()

    # The splice

    def upstream_ready(self, upstream: _Upstream) -> None:
        assert self._head is not None
        self._connecting = None
        if self._gone:
            upstream.transport.abortConnection()  # type: ignore[union-attr]
            return
        self._upstream = upstream
        upstream.transport.write(self._head.serialize() + self._buffer)  # type: ignore[union-attr]
        self._buffer = b""
        # Each side only reads as fast as the other writes: a 200 MB image load or an endless log
        # stream passes through without piling up in koordrp.
        upstream.transport.registerProducer(self.transport, True)  # type: ignore[union-attr]
        self.transport.registerProducer(upstream.transport, True)  # type: ignore[union-attr]
        if self._client_done_writing:
            upstream.transport.loseWriteConnection()  # type: ignore[union-attr]

    def upstream_failed(self, reason: Failure) -> None:
        self._connecting = None
        self._answer(self.proxy.unavailable(reason.getErrorMessage()))

    def upstream_gone(self) -> None:
        self._upstream = None
        if self.transport is not None:
            self.transport.unregisterProducer()  # type: ignore[attr-defined]
            self.transport.loseConnection()

    def readConnectionLost(self) -> None:
        self._client_done_writing = True
        if _hung_up(self.transport):
            # The client closed its end whole (cri-dockerd gave up): nobody is left to answer, and
            # whatever koordrp holds for it goes now (dockerd's own Go HTTP server cancels such a
            # request too), even while dockerd does not answer.
            self.transport.abortConnection()  # type: ignore[union-attr]
        elif self._upstream is not None:
            # The client finished writing (an exec whose stdin ended): dockerd must see it too.
            self._upstream.transport.loseWriteConnection()  # type: ignore[union-attr]
        elif self._handling is not None or self._head is None or self._intercepting:
            # A request the client stopped sending, or an intercepted call it stopped waiting for.
            self.transport.loseConnection()  # type: ignore[union-attr]

    def writeConnectionLost(self) -> None:
        pass

    def connectionLost(self, reason: Failure = protocol.connectionDone) -> None:
        self._gone = True
        if self._handling is not None:
            # Whatever the call still waits for (dockerd, a hook) is dropped with it.
            self._handling.cancel()
        if self._upstream is not None:
            # Nobody is left to read what dockerd sends: nothing to wait for.
            self._upstream.transport.unregisterProducer()  # type: ignore[union-attr]
            self._upstream.transport.abortConnection()  # type: ignore[union-attr]
            self._upstream = None
        elif self._connecting is not None:
            self._connecting.stopConnecting()


class DockerProxyFactory(protocol.Factory):
    noisy = False

    def __init__(
        self,
        backend_path: str,
        reactor: IReactorUNIX,
        interceptor: IDockerInterceptor | None,
        unavailable: Callable[[str], bytes],
    ) -> None:
        self.backend_path = backend_path
        self.reactor = reactor
        self.interceptor = interceptor
        self.unavailable = unavailable

    def buildProtocol(self, addr: IAddress | None) -> DockerClientConnection:
        return DockerClientConnection(self)

    def connect_upstream(self, factory: protocol.ClientFactory) -> IConnector:
        return self.reactor.connectUNIX(self.backend_path, factory, timeout=10)


def _hung_up(transport: object) -> bool:
    """Whether the other end of a unix socket closed it whole, not only its writing side.

    Both read as the end of the data; only a whole close leaves the socket hung up (POLLHUP), which
    is how a client that gave up differs from one that only finished sending (an exec's stdin).
    """
    handle = getattr(transport, "getHandle", None)
    if handle is None:
        return False
    poller = select.poll()
    poller.register(handle(), select.POLLHUP)
    return any(events & select.POLLHUP for _, events in poller.poll(0))
