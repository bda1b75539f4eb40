"""A unix socket relay a test can cut: the runtime stays up while koordrp loses sight of it.

It can also answer some requests itself (``answer``), the way a runtime with one broken endpoint would.
"""

import contextlib
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

WEDGED = b""
"""What ``answer`` returns for a request the relay accepts and never answers."""


@dataclass
class Relayed:
    """One connection through the relay, as its client (koordrp) used it."""

    sent: bytearray = field(default_factory=bytearray)
    """What the client sent."""
    answer: bytearray = field(default_factory=bytearray)
    """What the target answered."""
    answer_when_closed: bytes | None = None
    """What the target had answered when the client stopped sending (it closed, or shut its writing side)."""
    closed: threading.Event = field(default_factory=threading.Event)


class UnixRelay:
    def __init__(self, listen_path: str, target_path: str) -> None:
        self.listen_path = listen_path
        self.target_path = target_path
        self.answer: Callable[[bytes], bytes | None] | None = None
        """Given what a connection's client sent first: the relay's own answer, WEDGED, or None to relay it."""
        self._listener: socket.socket | None = None
        self._connections: list[socket.socket] = []
        self._lock = threading.Lock()
        self.relayed: list[Relayed] = []

    def relayed_with(self, text: bytes, timeout: float = 5.0) -> Relayed:
        """The first connection whose client sent ``text``, once there is one."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                found = [connection for connection in self.relayed if text in connection.sent]
            if found:
                return found[0]
            if time.monotonic() > deadline:
                raise AssertionError(f"no connection through the relay sent {text!r} within {timeout}s")
            time.sleep(0.01)

    def start(self) -> "UnixRelay":
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(self.listen_path)
        listener.listen(16)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def cut(self) -> None:
        """Close the listener and every relayed connection, as if the runtime had gone."""
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.listen_path)
        with self._lock:
            connections, self._connections = self._connections, []
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            connection.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            with self._lock:
                self._connections.append(client)
            if self.answer is None:
                self._relay(client, b"")
            else:
                threading.Thread(target=self._answer_or_relay, args=(client, self.answer), daemon=True).start()

    def _answer_or_relay(self, client: socket.socket, answer: Callable[[bytes], bytes | None]) -> None:
        try:
            first = client.recv(65536)
        except OSError:
            return
        own = answer(first)
        if own is None:
            self._relay(client, first)
        elif own != WEDGED:
            with contextlib.suppress(OSError):
                client.sendall(own)
                client.shutdown(socket.SHUT_RDWR)

    def _relay(self, client: socket.socket, first: bytes) -> None:
        upstream = socket.socket(socket.AF_UNIX)
        upstream.connect(self.target_path)
        upstream.sendall(first)
        relayed = Relayed(sent=bytearray(first))
        with self._lock:
            self._connections.append(upstream)
            self.relayed.append(relayed)
        threading.Thread(target=self._pump, args=(client, upstream, relayed, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(upstream, client, relayed, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, relayed: Relayed, from_client: bool) -> None:
        try:
            while data := source.recv(65536):
                with self._lock:
                    (relayed.sent if from_client else relayed.answer).extend(data)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            if from_client:
                with self._lock:
                    relayed.answer_when_closed = bytes(relayed.answer)
                relayed.closed.set()
            try:
                sink.shutdown(socket.SHUT_WR)
            except OSError:
                pass
