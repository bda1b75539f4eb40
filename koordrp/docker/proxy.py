"""The Docker API on a unix socket: each request's head is read, then the connection is spliced to
dockerd byte for byte (streams, chunked bodies, hijacked attach/exec, half-closes), or, for the few
calls with hooks, handed whole to an interceptor.

dockerd is asked to close each connection after its answer, so a splice ends when the exchange
does and the next request on a client's keep-alive connection never slips past the head parser:
the client reconnects for it, as HTTP/1.1 clients do when told ``Connection: close``.

A stop waits, within its bound, for the calls in flight (``DockerProxyFactory.quiet``): each
intercepted call until it is answered and its post stages are announced, each request passed to
dockerd until dockerd begins its answer. Once an answer has begun koordrp cannot tell one that is
about to end from a stream that never does (events, a followed log, stats, an attach, an exec, a
wait: dockerd begins each at once), so those are closed at the end of the stop (``let_go``).

Each client connection is bounded (``DOCKER_BOUNDS``, ``koordrp.bounds``): one that sends nothing is
closed after ``idle_seconds``, one whose request (its head, and an intercepted call's body) has not
come whole ``arrival_seconds`` after its first byte is closed, and at most ``connections`` are open.
Once the request is whole (``bounds.arrived``) nothing bounds the exchange's time: a followed log, an
attach or events may last for days. A connection serves one request, so there is no idle keep-alive
phase to bound: koordrp closes it after the exchange.
"""

import select
from dataclasses import dataclass
from typing import Callable

from twisted.internet import protocol
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import (
    IAddress,
    IConnector,
    IDelayedCall,
    IHalfCloseableProtocol,
    IReactorTime,
    IReactorUNIX,
    ITCPTransport,
    ITransport,
)
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import Interface, implementer

from koordrp import bounds
from koordrp.bounds import Bounds
from koordrp.drain import Drain
from koordrp.docker.http import (
    MAX_BODY_BYTES,
    MAX_HEAD_BYTES,
    BodyTooLarge,
    ChunkedBody,
    HeadReader,
    HeadTooLarge,
    HTTPError,
    LengthBody,
    RequestHead,
    body_reader,
    json_response,
    parse_request_head,
)

CLOSE_SECONDS = 1.0
"""How long a stop lets the client connections it closes flush what they were sent; those still open then are
dropped."""

LINGER_SECONDS = 10.0
"""How long koordrp reads (and drops) what a client still sends after answering its request early."""

DOCKER_BOUNDS = Bounds(
    connections=1024,
    arrival_seconds=10.0,
    idle_seconds=30.0,
    arrival_bytes=MAX_HEAD_BYTES + 2 * MAX_BODY_BYTES,
)
"""What one client connection may hold before its request is whole. cri-dockerd writes a request as it
connects; it may hold a few hundred connections at once on a full node (a stats request per container,
exec probes, followed logs, events), each with one to dockerd beside it (``connection_cap`` gives each
two descriptors, and lowers ``connections`` under a low descriptor limit). The head's and body's own
limits (431, 413) come first: the byte bound only stops a body's chunked framing from growing without end."""

_REFUSALS = {
    HeadTooLarge: (431, "Request Header Fields Too Large"),
    BodyTooLarge: (413, "Request Entity Too Large"),
}
"""The answer to a request koordrp refuses to read on; any other HTTPError is a 400."""


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
        self.client.from_dockerd(data)

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
    """One client connection: its request head read, then spliced to dockerd or handed to the interceptor.

    koordrp holds at most a request head (MAX_HEAD_BYTES), an intercepted call's body
    (MAX_BODY_BYTES) and one read beyond them; while dockerd is being connected to, the client is
    not read. A request refused before it was read whole is answered at once, and what the client
    still sends is read and dropped for LINGER_SECONDS, so that a client that writes its whole
    request before reading gets the answer.
    """

    log = Logger()

    def __init__(self, proxy: "DockerProxyFactory") -> None:
        self.proxy = proxy
        self._head_reader: HeadReader | None = HeadReader()
        self._head: RequestHead | None = None
        self._body: LengthBody | ChunkedBody | None = None
        self._after_head = b""
        """What came with the head, for dockerd once connected."""
        self._upstream: _Upstream | None = None
        self._handling: Deferred[Intercepted] | None = None
        self._awaiting_dockerd = False
        """A request passed to dockerd whose answer has not begun."""
        self._connecting: IConnector | None = None
        self._lingering: IDelayedCall | None = None
        self._gone = False

    def connectionMade(self) -> None:
        self.proxy.clients.add(self)

    @property
    def in_flight(self) -> bool:
        """Whether koordrp still owes this connection's request its answer: an intercepted call under way, or a
        request passed to dockerd whose answer has not begun."""
        return self._handling is not None or self._awaiting_dockerd

    def cut(self) -> None:
        """The stop's bound passed with this request in flight: it is dropped, as koordrp's going away would."""
        head = self._head
        self.log.warn(
            "stopping: {method} {path} cut at the stop's bound, still waiting for {what}",
            method=head.method if head is not None else "?",
            path=head.path if head is not None else "?",
            what="its hooks or dockerd" if self._handling is not None else "dockerd's answer",
        )
        self.transport.abortConnection()  # type: ignore[union-attr]

    def let_go(self) -> None:
        """koordrp stops: what the client was sent is flushed, then its connection closed; dockerd's side of a
        splice (a stream) is dropped at once."""
        if self._upstream is not None:
            self._upstream.transport.unregisterProducer()  # type: ignore[union-attr]
            self._upstream.transport.abortConnection()  # type: ignore[union-attr]
        self.transport.unregisterProducer()  # type: ignore[union-attr]
        self.transport.loseConnection()  # type: ignore[union-attr]

    def dataReceived(self, data: bytes) -> None:
        if self._upstream is not None:
            self._upstream.transport.write(data)  # type: ignore[union-attr]
        elif self._head_reader is not None:
            self._read_head(self._head_reader, data)
        elif self._body is not None:
            self._read_body(self._body, data)
        # Otherwise the intercepted call is under way or answered, or the request was refused: koordrp
        # closes the connection after its answer, so nothing more the client sends on it is kept.

    def _read_head(self, reader: HeadReader, data: bytes) -> None:
        try:
            read = reader.feed(data)
            if read is None:
                return
            self._head_reader = None
            head = self._head = parse_request_head(read[0])
            interceptor = self.proxy.interceptor
            if interceptor is not None and interceptor.wants(head):
                self._body = body_reader(head, MAX_BODY_BYTES)
        except HTTPError as error:
            self._refuse(error)
            return
        if self._body is not None:
            self._read_body(self._body, read[1])
        else:
            bounds.arrived(self.transport)  # what follows the head is the exchange's, however long it takes
            self._after_head = read[1]
            self._awaiting_dockerd = True
            # Until dockerd is connected there is nowhere to put what the client sends (a 200 MB image).
            self.transport.pauseProducing()  # type: ignore[union-attr]
            self._connecting = self.proxy.connect_upstream(_UpstreamFactory(self))

    def _read_body(self, reader: LengthBody | ChunkedBody, data: bytes) -> None:
        try:
            if not reader.feed(data):
                return
        except HTTPError as error:
            self._refuse(error)
            return
        self._body = None
        bounds.arrived(self.transport)
        head, interceptor = self._head, self.proxy.interceptor
        assert head is not None and interceptor is not None
        handled: Deferred[Intercepted] = interceptor.handle(head, reader.body)
        self._handling = handled
        handled.addCallbacks(self._deliver, self._interceptor_failed)

    def _deliver(self, intercepted: Intercepted) -> None:
        self._handling = None
        if intercepted.response is not None:
            self._answer(intercepted.response)
        intercepted.delivered()  # the call's post stages are announced: a stop that waited for it drains them next
        self.proxy.settled()

    def _interceptor_failed(self, failure: Failure) -> None:
        self._handling = None
        head = self._head
        assert head is not None
        self.log.failure("intercepting {method} {path} failed", failure, method=head.method, path=head.path)
        self._answer(json_response(500, "Internal Server Error", f"koordrp: {failure.getErrorMessage()}"))
        self.proxy.settled()

    def _answer(self, response: bytes) -> None:
        if self._gone:
            return
        transport: ITransport = self.transport  # type: ignore[assignment]
        transport.write(response)
        transport.loseConnection()

    def _refuse(self, error: HTTPError) -> None:
        status, reason = _REFUSALS.get(type(error), (400, "Bad Request"))
        self._answer_early(json_response(status, reason, f"koordrp: {error}"))

    def _answer_early(self, response: bytes) -> None:
        """Answer a request not read whole, and drop what the client still sends, for a while."""
        self._head_reader = self._body = None
        if self._gone:
            return
        bounds.arrived(self.transport)  # the lingering that follows has its own bound
        transport = ITCPTransport(self.transport)
        transport.write(response)
        transport.loseWriteConnection()
        self._lingering = self.proxy.clock.callLater(LINGER_SECONDS, transport.abortConnection)

    # The splice

    def upstream_ready(self, upstream: _Upstream) -> None:
        assert self._head is not None
        self._connecting = None
        if self._gone:
            upstream.transport.abortConnection()  # type: ignore[union-attr]
            return
        self._upstream = upstream
        upstream.transport.write(self._head.serialize() + self._after_head)  # type: ignore[union-attr]
        self._after_head = b""
        # Each side only reads as fast as the other writes: a 200 MB image load or an endless log
        # stream passes through without piling up in koordrp.
        upstream.transport.registerProducer(self.transport, True)  # type: ignore[union-attr]
        self.transport.registerProducer(upstream.transport, True)  # type: ignore[union-attr]
        self.transport.resumeProducing()  # type: ignore[union-attr]

    def from_dockerd(self, data: bytes) -> None:
        self.transport.write(data)  # type: ignore[union-attr]
        if self._awaiting_dockerd:
            self._answer_begun()

    def _answer_begun(self) -> None:
        self._awaiting_dockerd = False
        self.proxy.settled()

    def upstream_failed(self, reason: Failure) -> None:
        self._connecting = None
        self._after_head = b""
        if not self._gone:
            self.transport.resumeProducing()  # type: ignore[union-attr]
        self._answer_early(self.proxy.unavailable(reason.getErrorMessage()))
        self._answer_begun()

    def upstream_gone(self) -> None:
        self._upstream = None
        if self.transport is not None:
            self.transport.unregisterProducer()  # type: ignore[attr-defined]
            self.transport.loseConnection()
        if self._awaiting_dockerd:
            self._answer_begun()  # dockerd closed without a word: the client sees the close

    def readConnectionLost(self) -> None:
        if _hung_up(self.transport):
            # The client closed its end whole (cri-dockerd gave up): nobody is left to answer, and
            # whatever koordrp holds for it goes now (dockerd's own Go HTTP server cancels such a
            # request too), even while dockerd does not answer.
            self.transport.abortConnection()  # type: ignore[union-attr]
        elif self._upstream is not None:
            # The client finished writing (an exec whose stdin ended): dockerd must see it too.
            self._upstream.transport.loseWriteConnection()  # type: ignore[union-attr]
        else:
            # A request the client stopped sending, an intercepted call it stopped waiting for, or
            # the end of what it sent after koordrp's early answer. (While dockerd is being
            # connected to, the client is not read: its end is seen once the splice begins.)
            self.transport.loseConnection()  # type: ignore[union-attr]

    def writeConnectionLost(self) -> None:
        pass

    def connectionLost(self, reason: Failure = protocol.connectionDone) -> None:
        self._gone = True
        self.proxy.client_gone(self)
        if self._lingering is not None and self._lingering.active():
            self._lingering.cancel()
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
    log = Logger()

    def __init__(
        self,
        backend_path: str,
        reactor: IReactorUNIX,
        interceptor: IDockerInterceptor | None,
        unavailable: Callable[[str], bytes],
    ) -> None:
        self.backend_path = backend_path
        self.reactor = reactor
        self.clock = IReactorTime(reactor)
        self.interceptor = interceptor
        self.unavailable = unavailable
        self.clients: set[DockerClientConnection] = set()
        self._all_gone = Drain(self.clock)
        self._calls_over = Drain(self.clock)

    def buildProtocol(self, addr: IAddress | None) -> DockerClientConnection:
        return DockerClientConnection(self)

    def client_gone(self, client: DockerClientConnection) -> None:
        self.clients.discard(client)
        if not self.clients:
            self._all_gone.idle()
        self.settled()

    def in_flight(self) -> list[DockerClientConnection]:
        """The client connections whose request koordrp still owes its answer (``DockerClientConnection.in_flight``)."""
        return [client for client in self.clients if client.in_flight]

    def settled(self) -> None:
        """A request may no longer be in flight: a stop that waits for the last one goes on once it is not."""
        if self._calls_over.waiting and not self.in_flight():
            self._calls_over.idle()

    def quiet(self, timeout: float) -> "Deferred[None]":
        """Fires once no call is in flight (those that come meanwhile on connections already open included), or
        after ``timeout`` seconds, when those still in flight are cut, one warning each."""
        in_flight = self.in_flight()
        if in_flight and not self._calls_over.waiting:
            self.log.info(
                "stopping: {count} Docker call(s) in flight get up to {timeout:.3g}s",
                count=len(in_flight),
                timeout=timeout,
            )
        return self._calls_over.wait(bool(in_flight), timeout, self._cut)

    def _cut(self) -> None:
        for client in self.in_flight():
            client.cut()

    def let_go(self) -> "Deferred[None]":
        """koordrp stops: every client connection still open (an answer still being sent, a stream, a lingering
        refusal) is closed, and the Deferred fires once they are gone (those that did not take what they were
        sent within CLOSE_SECONDS are dropped)."""
        gone = self._all_gone.wait(bool(self.clients), CLOSE_SECONDS, self._drop_all)
        for client in list(self.clients):
            client.let_go()
        return gone

    def _drop_all(self) -> None:
        for client in list(self.clients):
            client.transport.abortConnection()  # type: ignore[union-attr]

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
