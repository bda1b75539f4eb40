"""Writing to containerd's NRI socket at once (koordrp.nri.sending), on real unix sockets and the real reactor."""

import socket

from twisted.internet import reactor
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.interfaces import IReactorSocket, ITransport
from twisted.internet.protocol import Protocol, ServerFactory
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase, TestCase

from koordrp.nri.sending import SentAtOnce
from tests.support.waiting import until


class Peer:
    """The far end of a socket pair, read without the reactor: what has arrived so far."""

    def __init__(self, end: socket.socket) -> None:
        end.setblocking(False)
        self._end = end
        self.received = b""

    def read(self) -> bytes:
        try:
            while chunk := self._end.recv(1 << 20):
                self.received += chunk
        except BlockingIOError:
            pass
        return self.received


class SentAtOnceTests(TestCase):
    def connected(self) -> tuple[SentAtOnce, Peer]:
        """A sender on a Twisted transport over one end of a socket pair, and the other end."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.addCleanup(theirs.close)
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
        return SentAtOnce(made[0]), Peer(theirs)

    def test_what_the_socket_takes_is_there_before_the_reactor_turns(self) -> None:
        sender, peer = self.connected()
        sender.write(b"the answer")
        self.assertEqual(peer.read(), b"the answer")

    @inlineCallbacks
    def test_what_the_socket_cannot_take_at_once_is_written_in_order_and_then_at_once_again(self):  # type: ignore[no-untyped-def]
        sender, peer = self.connected()
        more_than_fits = bytes(range(256)) * (32 << 10)  # 8 MiB: far beyond a unix socket's buffer
        sender.write(more_than_fits)
        # Room again in the socket, while the transport still holds the rest: what comes next waits behind it.
        self.assertLess(len(peer.read()), len(more_than_fits), "the socket took everything: nothing was left to wait")
        sender.write(b"after it")
        yield Deferred.fromCoroutine(until(lambda: len(peer.read()) == len(more_than_fits) + len(b"after it")))
        self.assertEqual(peer.received, more_than_fits + b"after it")
        # The transport has written everything it held: the next write goes to the socket at once again.
        sender.write(b"at once")
        self.assertEqual(peer.read(), more_than_fits + b"after it" + b"at once")


class WithoutSocketTests(SynchronousTestCase):
    def test_a_transport_without_a_socket_is_written_through(self) -> None:
        transport = StringTransport()
        SentAtOnce(transport).write(b"the answer")
        self.assertEqual(transport.value(), b"the answer")
