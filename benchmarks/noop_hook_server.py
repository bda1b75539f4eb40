"""A hook server that answers every hook with an empty response, in a process of its own.

    python -m benchmarks.noop_hook_server SOCKET

Prints ``ready`` once it listens. It counts the calls it received per RPC: on SIGUSR1 it prints them
as one JSON line (``{"PreRunPodSandboxHook": 3, ...}``) and goes on; on SIGTERM or SIGINT it prints
them a last time and exits. Benchmarks start it as a separate process, as a plugin such as koordlet
would be, so its work does not compete with the benchmark's client for one interpreter.
"""

import json
import queue
import signal
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import grpc

from tests.fake.hook_server import FakeHookServer, empty_response

REPORT = signal.SIGUSR1
STOP = (signal.SIGTERM, signal.SIGINT)


@dataclass
class CountingHookServer(FakeHookServer):
    """Keeps a count per RPC instead of every request: a soak sends it tens of thousands."""

    counts: Counter[str] = field(default_factory=Counter)

    def answer(self, rpc: str, request: Any, context: grpc.ServicerContext) -> Any:
        with self._lock:
            self.counts[rpc] += 1
        return empty_response(rpc)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


def main() -> None:
    server = CountingHookServer(sys.argv[1])
    server.start()
    # Handlers only queue the signal (SimpleQueue.put is safe in a signal handler); printing happens
    # here, so a report never interleaves with another one.
    signals: "queue.SimpleQueue[int]" = queue.SimpleQueue()
    for signum in (REPORT, *STOP):
        signal.signal(signum, lambda received, _frame: signals.put(received))
    print("ready", flush=True)
    while True:
        received = signals.get()
        print(json.dumps(server.snapshot(), sort_keys=True), flush=True)
        if received != REPORT:
            break
    server.stop()


if __name__ == "__main__":
    main()
