"""A unix socket server that accepts connections, reads what comes, and never answers: a wedged daemon.

It closes nothing itself, not even a connection whose other side stopped writing: a wedged daemon
does not notice. ``open_connections`` counts those the other side has not closed whole.
"""

import os
import select
import socket
import threading
import time
from typing import Callable


class WedgedServer:
    def __init__(self, path: str) -> None:
        self.path = path
        self._listener = socket.socket(socket.AF_UNIX)
        self._listener.bind(path)
        self._listener.listen(128)
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._ended: set[socket.socket] = set()
        self._stopping = False
        self.accepted = 0
        self._serving = threading.Thread(target=self._serve, daemon=True)
        self._serving.start()

    def _serve(self) -> None:
        while not self._stopping:
            with self._lock:
                reading = [connection for connection in self._open if connection not in self._ended]
            readable, _, _ = select.select([self._listener, *reading], [], [], 0.05)
            for ready in readable:
                if ready is self._listener:
                    connection, _ = self._listener.accept()
                    with self._lock:
                        self._open.append(connection)
                        self.accepted += 1
                elif not ready.recv(65536):
                    with self._lock:
                        self._ended.add(ready)  # and kept open: wedged

    @property
    def open_connections(self) -> int:
        """Connections whose other side has not closed them whole (POLLHUP: both directions shut)."""
        with self._lock:
            connections = list(self._open)
        poller = select.poll()
        for connection in connections:
            poller.register(connection, select.POLLHUP)
        hung_up = {descriptor for descriptor, events in poller.poll(0) if events & select.POLLHUP}
        return sum(connection.fileno() not in hung_up for connection in connections)

    def wait_for(self, condition: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def stop(self) -> None:
        self._stopping = True
        self._serving.join()  # its select() waits at most 0.05 s; closing under it would race
        self._listener.close()
        with self._lock:
            for connection in self._open:
                connection.close()
            self._open = []
        if os.path.exists(self.path):
            os.unlink(self.path)
