"""A unix socket relay a test can cut: the runtime stays up while koordrp loses sight of it."""

import contextlib
import os
import socket
import threading


class UnixRelay:
    def __init__(self, listen_path: str, target_path: str) -> None:
        self.listen_path = listen_path
        self.target_path = target_path
        self._listener: socket.socket | None = None
        self._connections: list[socket.socket] = []
        self._lock = threading.Lock()

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
            upstream = socket.socket(socket.AF_UNIX)
            upstream.connect(self.target_path)
            with self._lock:
                self._connections += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            try:
                sink.shutdown(socket.SHUT_WR)
            except OSError:
                pass
