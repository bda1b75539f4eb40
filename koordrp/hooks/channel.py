"""One HTTP/2 connection to a hook server on the reactor: unary gRPC calls as Deferreds, with no thread between.

``koordrp.http2`` keeps the connection's state; this puts it on a unix socket. The reactor writes a call
(at once: ``koordrp.sending``), reads the answer when the socket has it, and fires the call's Deferred,
with no hand-off to grpc's threads and back. Cancelling the Deferred resets the stream, so the server hears
of it at once.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IConnector, IReactorUNIX
from twisted.internet.interfaces import IAddress
from twisted.internet.protocol import ClientFactory, Protocol, connectionDone
from twisted.python.failure import Failure

from koordrp import fastpaths
from koordrp.fastpaths import FastPaths
from koordrp.http2 import Call, ClientConnection, Outcome
from koordrp.sending import SentAtOnce


class HTTP2Channel(Protocol):
    """A connection to ``path``, made at once; calls made before it is up wait for it in its buffers."""

    def __init__(self, reactor: IReactorUNIX, path: str, max_answer: int, paths: FastPaths = fastpaths.DEFAULT) -> None:
        self._state = ClientConnection(max_answer)
        self._calls: dict[Call, Deferred[Outcome]] = {}
        self._paths = paths
        self._sending: SentAtOnce | None = None
        self._closing = False
        self._connector: IConnector = reactor.connectUNIX(path, _Dialling(self))

    @property
    def accepting(self) -> bool:
        """Whether a new call may go on this channel (else a new one is made for it)."""
        return not self._closing and self._state.accepting

    def call(self, header_block: bytes, message: bytes) -> "Deferred[Outcome]":
        """Send one unary call; fires with its outcome, never fails. Cancelling it resets its stream."""
        call = self._state.call(header_block, message)
        answered: Deferred[Outcome] = Deferred(lambda _: self._cancel(call))
        self._calls[call] = answered
        self._flush()
        return answered

    def close(self) -> None:
        """Every call still on it fails; the socket is closed."""
        self._closing = True
        if self.transport is None:
            if self._connector.state == "connecting":  # type: ignore[attr-defined]
                self._connector.stopConnecting()
        else:
            self.transport.loseConnection()

    def close_when_idle(self) -> None:
        """No new call comes: closed once the calls on it end."""
        self._closing = True
        if not self._calls:
            self.close()

    def _cancel(self, call: Call) -> None:
        if self._calls.pop(call, None) is not None:
            self._state.cancel(call)
            self._flush()
            self._idle_check()

    def connectionMade(self) -> None:
        assert self.transport is not None
        self._sending = SentAtOnce(self.transport, self._paths)
        self._flush()
        self._idle_check()  # closed while it connected, its calls gone meanwhile

    def dataReceived(self, data: bytes) -> None:
        ended = self._state.received(data)
        self._flush()
        if self._state.ended is not None:
            self.close()
        self._settle(ended)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if self._sending is not None:
            self._sending.closing()
        self._closing = True
        self._settle(self._state.lost(f"the connection was lost: {reason.getErrorMessage()}"))

    def not_made(self, reason: Failure) -> None:
        """The connection could not be made: every call waiting for it fails, lost."""
        self._closing = True
        self._settle(self._state.lost(f"no connection: {reason.getErrorMessage()}", seen=False))

    def _flush(self) -> None:
        if self._sending is not None:
            output = self._state.output()
            if output:
                self._sending.write(output)

    def _settle(self, ended: list[Call]) -> None:
        for call in ended:
            answered = self._calls.pop(call, None)
            if answered is not None:
                assert call.outcome is not None
                answered.callback(call.outcome)
        self._idle_check()

    def _idle_check(self) -> None:
        if self._closing and not self._calls and self.transport is not None and self.connected:
            self.transport.loseConnection()



class _Dialling(ClientFactory):
    """Makes ``channel``'s one connection."""

    def __init__(self, channel: HTTP2Channel) -> None:
        self._channel = channel

    def buildProtocol(self, addr: IAddress | None) -> HTTP2Channel:
        return self._channel

    def clientConnectionFailed(self, connector: IConnector, reason: Failure) -> None:
        self._channel.not_made(reason)
