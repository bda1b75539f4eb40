"""What a listening socket's clients may cost koordrp, and the file descriptors every socket shares.

Every connection holds one of koordrp's file descriptors, which its runtime calls, hook calls and
state files need too. A client that opens connections and sends nothing, or one byte every few
seconds (each byte restarts an idle timeout such as twisted.web's own), would hold them for as long
as it likes. ``BoundedFactory`` wraps any Twisted server factory and bounds that:

- at most ``Bounds.connections`` are open at once (and one more while the descriptor of one closed
  for a newer one is freed, on the reactor's next turn): a new connection over the cap aborts the one
  that has waited longest without a request in hand (new, idle, or its request still arriving), and
  is closed at once itself if every one is being answered or such an abort is under way. A
  connection that sends its request at once, such as kubelet's probe, so gets in while slow clients
  hold the cap;
- a connection waiting for a request (new, or done with the last one) is closed after
  ``idle_seconds``;
- once a request's first byte has come, the whole of it must come within ``arrival_seconds`` and
  ``arrival_bytes``, however it is dripped.

The wrapped protocol says where its requests begin and end, through the transport it was given:
``arrived(transport)`` once a request is whole (no bound while it is answered), ``waiting(transport)``
once it is done with it and waits for the next (the idle bound again). A protocol that says neither
has each connection closed ``arrival_seconds`` after its first byte. A connection past a bound is
closed as ``loseConnection`` does (what was written goes first, the client reads an end of file), and
aborted ``ABORT_SECONDS`` later if its client does not read; one closed for a newer connection is
aborted at once.

``raise_descriptor_limit`` and ``descriptors_in_use`` are about the process's descriptors as a whole.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from enum import Enum
from typing import Callable

from twisted.internet.interfaces import IAddress, IDelayedCall, IHalfCloseableProtocol, IProtocol, IProtocolFactory, IReactorTime
from twisted.internet.protocol import connectionDone
from twisted.logger import Logger
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.python.failure import Failure
from zope.interface import alsoProvides

ABORT_SECONDS = 2.0
"""How long a connection closed by a bound has to take what was written to it before it is aborted."""
WARN_EVERY_SECONDS = 60.0
"""At most one line this often about the connections a factory closed (its counts say the rest)."""

IDLE = "idle"
SLOW = "slow"
OVERSIZED = "oversized"
EVICTED = "evicted"
REFUSED = "refused"
REASONS = (IDLE, SLOW, OVERSIZED, EVICTED, REFUSED)
"""Why a connection was closed, as ``BoundedFactory.closed`` counts it."""


@dataclass(frozen=True)
class Bounds:
    connections: int
    """The most connections open at once."""
    arrival_seconds: float
    """From a request's first byte until the protocol says it ``arrived``."""
    idle_seconds: float
    """A connection waiting for a request: new, or since the protocol said it is ``waiting``."""
    arrival_bytes: int
    """The most bytes a request may take to arrive."""


class _State(Enum):
    WAITING = "waiting"
    ARRIVING = "arriving"
    ANSWERED = "answered"


def arrived(transport: object) -> None:
    """The request on ``transport`` (a protocol's own) is whole: its bounds stop while it is answered."""
    if isinstance(transport, BoundedConnection):
        transport.enter(_State.ANSWERED)


def waiting(transport: object) -> None:
    """The connection of ``transport`` is done with its request and waits for the next: the idle bound runs."""
    if isinstance(transport, BoundedConnection):
        transport.enter(_State.WAITING)


class BoundedConnection(ProtocolWrapper):
    """One connection of a ``BoundedFactory``: the transport its wrapped protocol writes to."""

    factory: BoundedFactory

    def __init__(self, factory: BoundedFactory, wrapped: IProtocol) -> None:
        super().__init__(factory, wrapped)
        self.state = _State.WAITING
        self._received = 0
        self._bound: IDelayedCall | None = None
        self._abort: IDelayedCall | None = None
        self.closed_for: str | None = None
        """Why koordrp closed it (one of ``REASONS``); None while it is open or if it was closed otherwise."""

    def makeConnection(self, transport: object) -> None:
        super().makeConnection(transport)  # type: ignore[no-untyped-call]
        if IHalfCloseableProtocol.providedBy(self.wrappedProtocol):
            # The transport asks its protocol, this wrapper, whether it takes half-closes.
            alsoProvides(self, IHalfCloseableProtocol)

    def connectionMade(self) -> None:
        self.enter(_State.WAITING)

    def enter(self, state: _State) -> None:
        if self.closed_for is not None or (state is _State.ANSWERED and self.state is _State.ANSWERED):
            return
        self._cancel_bound()
        self.state = state
        self._received = 0
        self.factory.moved(self)
        if state is _State.WAITING:
            self._bound = self.factory.clock.callLater(self.factory.bounds.idle_seconds, self.close, IDLE)
        elif state is _State.ARRIVING:
            self._bound = self.factory.clock.callLater(self.factory.bounds.arrival_seconds, self.close, SLOW)

    def dataReceived(self, data: bytes) -> None:
        if self.closed_for is not None:
            return
        if self.state is _State.WAITING:
            self.enter(_State.ARRIVING)
        if self.state is _State.ARRIVING:
            self._received += len(data)
            if self._received > self.factory.bounds.arrival_bytes:
                self.close(OVERSIZED)
                return
        super().dataReceived(data)  # type: ignore[no-untyped-call]

    def readConnectionLost(self) -> None:
        IHalfCloseableProtocol(self.wrappedProtocol).readConnectionLost()

    def writeConnectionLost(self) -> None:
        IHalfCloseableProtocol(self.wrappedProtocol).writeConnectionLost()

    def close(self, reason: str) -> None:
        """Close it for ``reason``: an end of file once what was written has gone, an abort if that takes too long;
        closed for a newer connection (``EVICTED``), an abort at once, which frees its descriptor on the reactor's
        next turn."""
        if self.closed_for is not None:
            return
        self.closed_for = reason
        self._cancel_bound()
        self.factory.let_go(self, reason)
        abort: Callable[[], object] | None = getattr(self.transport, "abortConnection", None)
        if abort is not None and reason == EVICTED:
            abort()
            return
        if abort is not None:
            self._abort = self.factory.clock.callLater(ABORT_SECONDS, abort)
        self.loseConnection()  # type: ignore[no-untyped-call]

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._cancel_bound()
        if self._abort is not None and self._abort.active():
            self._abort.cancel()
        self._abort = None
        self.factory.forget(self)
        super().connectionLost(reason)  # type: ignore[no-untyped-call]

    def _cancel_bound(self) -> None:
        if self._bound is not None and self._bound.active():
            self._bound.cancel()
        self._bound = None


class BoundedFactory(WrappingFactory[BoundedConnection]):
    """``wrapped``'s connections, bounded by ``bounds`` on ``clock``; ``name`` says whose in log lines.

    ``open`` is how many it holds now, ``closed`` how many it closed, by reason (``REASONS``).
    """

    protocol = BoundedConnection
    log = Logger()

    def __init__(self, wrapped: IProtocolFactory, bounds: Bounds, clock: IReactorTime, name: str) -> None:
        super().__init__(wrapped)  # type: ignore[no-untyped-call]
        self.bounds = bounds
        self.clock = clock
        self.name = name
        self.closed = dict.fromkeys(REASONS, 0)
        # Every connection not yet gone (its descriptor open), those being closed included.
        self._open: dict[BoundedConnection, None] = {}
        # Those without a request in hand and not being closed, the one that has waited longest first.
        self._evictable: dict[BoundedConnection, None] = {}
        self._evicting: BoundedConnection | None = None
        self._unsaid = dict.fromkeys(REASONS, 0)
        self._said_at: float | None = None

    @property
    def open(self) -> int:
        """Connections whose descriptors are open, those being closed included."""
        return len(self._open)

    def buildProtocol(self, addr: IAddress) -> BoundedConnection | None:  # type: ignore[override]
        if len(self._open) >= self.bounds.connections:
            oldest = next(iter(self._evictable), None)
            if oldest is None or self._evicting is not None:
                self._count(REFUSED)
                return None  # the listening port closes it at once
            self._evicting = oldest
            oldest.close(EVICTED)
        wrapped = self.wrappedFactory.buildProtocol(addr)
        if wrapped is None:
            return None
        connection = BoundedConnection(self, wrapped)
        self._open[connection] = None
        return connection

    def moved(self, connection: BoundedConnection) -> None:
        """``connection`` entered its state now: without a request in hand since, it queues for eviction behind
        those without one for longer (a request's first byte keeps its place)."""
        if connection.state is _State.ANSWERED:
            self._evictable.pop(connection, None)
        elif connection in self._open and connection.closed_for is None and connection not in self._evictable:
            self._evictable[connection] = None

    def let_go(self, connection: BoundedConnection, reason: str) -> None:
        """``connection`` is being closed for ``reason``."""
        self._evictable.pop(connection, None)
        self._count(reason)

    def forget(self, connection: BoundedConnection) -> None:
        """``connection`` is gone, its descriptor closed."""
        self._open.pop(connection, None)
        self._evictable.pop(connection, None)
        if self._evicting is connection:
            self._evicting = None

    def _count(self, reason: str) -> None:
        self.closed[reason] += 1
        if reason == IDLE:
            return  # a scraper's keep-alive connection, routinely
        self._unsaid[reason] += 1
        now = self.clock.seconds()
        if self._said_at is not None and now - self._said_at < WARN_EVERY_SECONDS:
            return
        self._said_at = now
        bounds = self.bounds
        what = {
            SLOW: f"{{}} whose request did not arrive whole within {bounds.arrival_seconds:g} s",
            OVERSIZED: f"{{}} whose request was larger than {bounds.arrival_bytes} bytes",
            EVICTED: f"{{}} without a request in hand, for newer ones ({bounds.connections} open at most)",
            REFUSED: f"{{}} new ones at once ({bounds.connections} open at most)",
        }
        said = ", ".join(what[reason].format(count) for reason, count in self._unsaid.items() if count)
        self.log.warn(
            "{name} closed connections: {said}; at most one such line a minute",
            name=self.name,
            said=said,
        )
        self._unsaid = dict.fromkeys(REASONS, 0)


OWN_DESCRIPTORS = 256
"""File descriptors no client connection may take. koordrp holds ~20 at rest (the reactor's and grpc's pollers
and wakers, its listening sockets, the runtime and image channels, inotify: 19 measured in front of containerd,
13 in Docker mode), and more as it works: one or two per hook server's channel (a fresh one while the old one
closes), a state file being written with its directory, a reading of /proc, its own questions to dockerd."""
METRICS_DESCRIPTORS = 2 * 64
"""What --metrics-endpoint's clients may hold: its cap (``koordrp.web.METRICS_BOUNDS``, 64 connections), two
each, since in Docker mode each /healthz asks dockerd on a connection of its own."""
FEWEST_CONNECTIONS = 8
"""An endpoint's cap under a descriptor limit too low to keep the reserve: kubelet still gets in (a warning says so)."""


def descriptor_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def connection_cap(most: int, per_connection: int, limit: int) -> int:
    """How many client connections an endpoint may hold: ``most``, fewer if the descriptor ``limit`` (RLIMIT_NOFILE)
    less koordrp's own and the metrics endpoint's cannot give each its ``per_connection`` descriptors."""
    if limit == resource.RLIM_INFINITY:
        return most
    return min(most, max(FEWEST_CONNECTIONS, (limit - OWN_DESCRIPTORS - METRICS_DESCRIPTORS) // per_connection))


def reserve_unkept(limit: int, connections: int, per_connection: int) -> bool:
    """Whether ``connections`` clients of ``per_connection`` descriptors each, with the metrics endpoint's, could take
    descriptors koordrp keeps for its own under ``limit`` (a limit too low: said at start)."""
    return limit != resource.RLIM_INFINITY and limit - per_connection * connections - METRICS_DESCRIPTORS < OWN_DESCRIPTORS


DESCRIPTOR_RESERVE = 64
"""Fewer free file descriptors than this and koordrp is running out: /livez says so."""


def raise_descriptor_limit() -> tuple[int, int]:
    """Raise the soft limit on open file descriptors to the hard one; the soft limit (before, after).

    systemd gives services a soft limit of 1024 whatever their hard one, for select()'s sake; koordrp's
    reactor and grpc use epoll, so the hard limit is koordrp's to use.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == resource.RLIM_INFINITY or soft >= hard:
        return soft, soft
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return soft, hard


def descriptors_in_use(fd_directory: str = "/proc/self/fd") -> tuple[int, int]:
    """How many file descriptors koordrp has open, and its (soft) limit.

    Read from ``/proc/self/fd`` (tens of microseconds for a few hundred); reading it takes one
    descriptor itself, so OSError (EMFILE) when there is none left.
    """
    listed = len(os.listdir(fd_directory)) - 1  # the directory's own, open while it was read
    return listed, resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def descriptor_shortage(count: Callable[[], tuple[int, int]] = descriptors_in_use, reserve: int = DESCRIPTOR_RESERVE) -> str | None:
    """Why koordrp is running out of file descriptors (fewer than ``reserve`` free), or None."""
    try:
        used, limit = count()
    except OSError as error:
        return f"cannot count koordrp's open file descriptors: {error.strerror or error}"
    if limit != resource.RLIM_INFINITY and limit - used < reserve:
        return f"{used} of koordrp's {limit} file descriptors are open, fewer than {reserve} free"
    return None
