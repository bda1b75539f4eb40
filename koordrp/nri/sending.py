"""Writing to containerd's NRI socket at once, rather than on the reactor's next turn.

A Twisted transport's ``write`` only buffers: the reactor then polls the socket for writing, writes
on its next turn, and stops polling it: two more system calls and a turn of the loop for each of
containerd's calls, which waits for its answer meanwhile (0.2-0.4 ms of CPU per pod start:
docs/architecture.md). So what the socket takes is written to it at once; what it does not take
waits in the transport, and so does everything after it until the transport has written it all, so
that bytes never pass each other.
"""

from __future__ import annotations

import socket

from twisted.internet.interfaces import IConsumer, IPullProducer, ISystemHandle, ITransport
from zope.interface import implementer


@implementer(IPullProducer)
class SentAtOnce:
    """Writes to ``transport``'s socket directly while nothing waits in the transport; through it otherwise.

    A transport without a socket (a test's) is written through, always.
    """

    def __init__(self, transport: ITransport) -> None:
        self._transport = transport
        self._consumer = IConsumer(transport, None)
        handle = ISystemHandle(transport, None)
        found = handle.getHandle() if handle is not None else None
        self._socket: socket.socket | None = found if isinstance(found, socket.socket) else None
        self._waiting = False
        """Whether the transport holds bytes not yet written: later ones go after them."""
        self._registering = False
        self._closing = False

    def closing(self) -> None:
        """The connection is being closed (or aborted): what is written from now on is the transport's to flush or drop."""
        self._closing = True

    def write(self, data: bytes) -> None:
        if self._socket is None or self._consumer is None or self._waiting or self._closing:
            self._transport.write(data)
            return
        try:
            sent = self._socket.send(data)
        except OSError:  # full (EAGAIN), or broken: the transport meets the same error and loses the connection
            sent = 0
        if sent == len(data):
            return
        self._transport.write(data[sent:])
        self._waiting = True
        # A pull producer is asked for more each time the transport has written everything it held.
        self._registering = True
        try:
            self._consumer.registerProducer(self, False)
        finally:
            self._registering = False

    def resumeProducing(self) -> None:
        if self._registering:
            return  # registerProducer asks at once, while the transport still holds what was just written
        self._waiting = False
        if self._consumer is not None:
            self._consumer.unregisterProducer()

    def stopProducing(self) -> None:
        """The connection is gone: nothing more is written."""
