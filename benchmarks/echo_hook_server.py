"""A hook server that answers every hook with a copy of its request, as koordlet does, in a process of its own.

    python -m benchmarks.echo_hook_server SOCKET

Prints ``ready`` once it listens. It counts the calls it received per RPC: on SIGUSR1 it prints them
as one JSON line (``{"PreRunPodSandboxHook": 3, ...}``) and goes on; on SIGTERM or SIGINT it prints
them a last time and exits. Benchmarks start it as a separate process, as a plugin such as koordlet
would be, so its work does not compete with the benchmark's client for one interpreter.
"""

import json
import queue
import signal
import subprocess
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from koordrp.hooks.types import HookType
from koordrp.sdk import reply
from tests.fake.hook_server import FakeHookServer

ROOT = Path(__file__).resolve().parents[1]
REPORT = signal.SIGUSR1
STOP = (signal.SIGTERM, signal.SIGINT)


@dataclass
class CountingHookServer(FakeHookServer):
    """Keeps a count per RPC instead of every request: a soak sends it tens of thousands."""

    counts: Counter[str] = field(default_factory=Counter)

    def answer(self, rpc: str, request: Any, context: grpc.ServicerContext) -> Any:
        with self._lock:
            self.counts[rpc] += 1
        return reply(request)

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


class HookServerProcess:
    """One echo hook server as a child process; its counts are asked for with SIGUSR1 and read from its stdout."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.echo_hook_server", str(socket)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        if self.process.stdout.readline().strip() != "ready":
            self.stop()
            raise RuntimeError(f"hook server on {socket} did not start")
        self._lines: "queue.Queue[str]" = queue.Queue()
        self.last = dict.fromkeys(HookType, 0)
        self.answering = True
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)

    def counts(self, timeout: float = 5.0) -> dict[HookType, int]:
        """What it received so far; from a server that died or does not answer, the last counts it gave,
        so that the figures are printed all the same (``answering`` tells)."""
        # A late answer to an earlier request that timed out must not pass for this one's.
        while not self._lines.empty():
            self._take(self._lines.get_nowait())
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGUSR1)
            try:
                self._take(self._lines.get(timeout=timeout))
            except queue.Empty:
                self.answering = False
        else:
            self.answering = False
        return self.last

    def _take(self, line: str) -> None:
        received = json.loads(line)
        self.last = {hook: received.get(hook.rpc_name, 0) for hook in HookType}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


if __name__ == "__main__":
    main()
