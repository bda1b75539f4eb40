"""Writing to a socket at once, rather than on the reactor's next turn: containerd's NRI socket, a hook server's.

A Twisted transport's ``write`` only buffers: the reactor then polls the socket for writing, writes
on its next turn, and stops polling it: two more system calls and a turn of the loop for each message,
whose peer waits for it meanwhile (benchmarks/nri_starts.py and benchmarks/hooks.py, run with
``KOORDRP_FAST_PATHS=0`` too, show what that costs). So what the socket takes is written to it at once
(``fastpaths.FastPaths.socket_send``); what it does not take waits in the transport, and so does
everything after it until the transport has written it all, so that bytes never pass each other. Where
that fast path is off, everything goes through the transport.
"""

from __future__ import annotations

from twisted.internet.interfaces import IConsumer, IPullProducer, ITransport
from zope.interface import implementer

from koordrp import fastpaths
from koordrp.fastpaths import FastPaths


@implementer(IPullProducer)
class SentAtOnce:
    """Writes to ``transport``'s socket directly while nothing waits in the transport; through it otherwise.

    A transport without a socket to write to (a test's), or with the fast path off, is written through, always.
    """

    def __init__(self, transport: ITransport, paths: FastPaths = fastpaths.DEFAULT) -> None:
        self._transport = transport
        self._at_once = paths.socket_send(transport)
        self._waiting = False
        """Whether the transport holds bytes not yet written: later ones go after them."""
        self._registering = False
        self._closing = False

    def closing(self) -> None:
        """The connection is being closed (or aborted): what is written from now on is the transport's to flush or drop."""
        self._closing = True

    def write(self, data: bytes) -> None:
        at_once = self._at_once
        if at_once is None or self._waiting or self._closing:
            self._transport.write(data)
            return
        sent = at_once(data)
        if sent == len(data):
            return
        self._transport.write(data[sent:])
        self._waiting = True
        # A pull producer is asked for more each time the transport has written everything it held.
        self._registering = True
        try:
            IConsumer(self._transport).registerProducer(self, False)
        finally:
            self._registering = False

    def resumeProducing(self) -> None:
        if self._registering:
            return  # registerProducer asks at once, while the transport still holds what was just written
        self._waiting = False
        IConsumer(self._transport).unregisterProducer()

    def stopProducing(self) -> None:
        """The connection is gone: nothing more is written."""
