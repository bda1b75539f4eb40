"""Writing to containerd's NRI socket at once (koordrp.sending), on real unix sockets and the real reactor, with the
fast paths on and off: the same bytes arrive in the same order either way, only sooner with them."""

import socket
from dataclasses import dataclass

from twisted.internet import reactor
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.interfaces import IReactorSocket, ITransport
from twisted.internet.protocol import Protocol, ServerFactory
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase, TestCase

from koordrp.fastpaths import ENVIRONMENT, FastPaths
from koordrp.sending import SentAtOnce
from tests.support.waiting import until

MORE_THAN_FITS = bytes(range(256)) * (32 << 10)
"""8 MiB: far beyond a unix socket's buffer."""


class Peer:
    """The far end of a socket pair, read without the reactor: what has arrived so far, and whether it ended."""

    def __init__(self, end: socket.socket) -> None:
        end.setblocking(False)
        self._end = end
        self.received = b""
        self.ended = False

    def read(self) -> bytes:
        try:
            while chunk := self._end.recv(1 << 20):
                self.received += chunk
            self.ended = True
        except BlockingIOError:
            pass
        return self.received

    def at_end(self) -> bool:
        """Whether the other end closed, once what came before is read."""
        self.read()
        return self.ended

    def close(self) -> None:
        self._end.close()


@dataclass
class Connected:
    sender: SentAtOnce
    transport: ITransport
    peer: Peer
    lost: Deferred[None]
    """Fires once the transport's connection is lost."""


class SentAtOnceTests(TestCase):
    paths = FastPaths({})

    def connected(self) -> Connected:
        """A sender on a Twisted transport over one end of a socket pair, and the other end."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        peer = Peer(theirs)
        self.addCleanup(peer.close)
        made: list[ITransport] = []
        lost: Deferred[None] = Deferred()

        class Made(Protocol):
            def connectionMade(self) -> None:
                assert self.transport is not None
                made.append(self.transport)

            def connectionLost(self, reason: object = None) -> None:
                lost.callback(None)

        factory = ServerFactory()
        factory.protocol = Made
        IReactorSocket(reactor).adoptStreamConnection(ours.fileno(), socket.AF_UNIX, factory)
        ours.close()  # the reactor holds its own copy

        def closed() -> Deferred[None]:
            made[0].abortConnection()  # type: ignore[attr-defined]
            return lost

        self.addCleanup(closed)
        return Connected(SentAtOnce(made[0], self.paths), made[0], peer, lost)

    @inlineCallbacks
    def arrived(self, peer: Peer, written: bytes):  # type: ignore[no-untyped-def]
        """What was just ``written`` has arrived after what the peer had read: before the reactor turns with the fast
        path, once it has without it."""
        before = peer.received
        if self.paths.turned_off:
            self.assertEqual(peer.read(), before)
            yield Deferred.fromCoroutine(until(lambda: len(peer.read()) >= len(before) + len(written)))
        self.assertEqual(peer.read(), before + written)

    @inlineCallbacks
    def test_what_is_written_arrives_before_the_reactor_turns_with_the_fast_path_and_once_it_has_without(self):  # type: ignore[no-untyped-def]
        connected = self.connected()
        sender, peer = connected.sender, connected.peer
        sender.write(b"the answer")
        yield self.arrived(peer, b"the answer")

    @inlineCallbacks
    def test_what_the_socket_cannot_take_at_once_is_written_in_order_and_what_follows_as_before(self):  # type: ignore[no-untyped-def]
        connected = self.connected()
        sender, peer = connected.sender, connected.peer
        sender.write(MORE_THAN_FITS)
        # Room again in the socket, while the transport still holds the rest: what comes next waits behind it.
        self.assertLess(len(peer.read()), len(MORE_THAN_FITS), "the socket took everything: nothing was left to wait")
        sender.write(b"after it")
        yield Deferred.fromCoroutine(until(lambda: len(peer.read()) == len(MORE_THAN_FITS) + len(b"after it")))
        self.assertEqual(peer.received, MORE_THAN_FITS + b"after it")
        # The transport has written everything it held: the next write goes to the socket at once again.
        sender.write(b"at once")
        yield self.arrived(peer, b"at once")

    @inlineCallbacks
    def test_a_connection_closed_while_the_transport_holds_bytes_ends_once_they_are_written(self):  # type: ignore[no-untyped-def]
        """As NRIConnection.close does it: the transport, whose producer SentAtOnce is meanwhile, still closes."""
        connected = self.connected()
        connected.sender.write(MORE_THAN_FITS)
        connected.sender.closing()
        connected.transport.loseConnection()
        connected.sender.write(b"the last answer")
        yield Deferred.fromCoroutine(until(connected.peer.at_end))
        self.assertEqual(connected.peer.received, MORE_THAN_FITS + b"the last answer")
        yield connected.lost

    @inlineCallbacks
    def test_a_socket_gone_under_the_sender_loses_the_connection_and_raises_nothing(self):  # type: ignore[no-untyped-def]
        connected = self.connected()
        connected.peer.close()
        connected.sender.write(b"the answer")
        yield connected.lost


class FastPathOffTests(SentAtOnceTests):
    paths = FastPaths({ENVIRONMENT: "0"})


class WithoutSocketTests(SynchronousTestCase):
    def test_a_transport_without_a_socket_is_written_through(self) -> None:
        transport = StringTransport()
        SentAtOnce(transport).write(b"the answer")
        self.assertEqual(transport.value(), b"the answer")
