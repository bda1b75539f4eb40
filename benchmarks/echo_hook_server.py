"""A hook server that answers every hook with a copy of its request, as koordlet does, in a process of its own.

    python -m benchmarks.echo_hook_server SOCKET [--mark]

Prints ``ready`` once it listens. It counts the calls it received per RPC: on SIGUSR1 it prints them
as one JSON line (``{"PreRunPodSandboxHook": 3, ...}``) and goes on; on SIGTERM or SIGINT it prints
them a last time and exits. On SIGUSR2 it wedges: calls are counted and then left unanswered until
SIGHUP, when it answers them all, late, as a wedged server that recovers does. With ``--mark`` its
PreRunPodSandbox answer adds the annotation ``MARK`` and its PreCreateContainer answer adds it as an
annotation and as an environment variable, so that koordrp keeps a state file for every pod and
container. Benchmarks start it as a separate process, as a plugin such as koordlet would be, so its
work does not compete with the benchmark's client for one interpreter.
"""

import argparse
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
WEDGE = signal.SIGUSR2
UNWEDGE = signal.SIGHUP
STOP = (signal.SIGTERM, signal.SIGINT)
MARK = "koordrp-soak-mark"
MARKED = {HookType.PRE_RUN_POD_SANDBOX.rpc_name, HookType.PRE_CREATE_CONTAINER.rpc_name}


@dataclass
class CountingHookServer(FakeHookServer):
    """Keeps a count per RPC instead of every request: a soak sends it tens of thousands."""

    counts: Counter[str] = field(default_factory=Counter)
    mark: bool = False
    _answering: threading.Event = field(default_factory=threading.Event)

    def start(self) -> "CountingHookServer":
        self._answering.set()
        super().start()
        return self

    def answer(self, rpc: str, request: Any, context: grpc.ServicerContext) -> Any:
        with self._lock:
            self.counts[rpc] += 1
        self._answering.wait()
        response = reply(request)
        if self.mark and rpc in MARKED:
            if rpc == HookType.PRE_RUN_POD_SANDBOX.rpc_name:
                response.annotations[MARK] = "pod"
            else:
                response.container_annotations[MARK] = "container"
                response.container_envs[MARK.upper().replace("-", "_")] = "container"
        return response

    def wedge(self) -> None:
        self._answering.clear()

    def unwedge(self) -> None:
        self._answering.set()

    def stop(self) -> None:
        self._answering.set()  # a handler left waiting would keep the process from exiting
        super().stop()

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("socket")
    parser.add_argument("--mark", action="store_true", help="add MARK to pods and containers")
    args = parser.parse_args()
    server = CountingHookServer(args.socket, mark=args.mark)
    server.start()
    # Handlers only queue the signal (SimpleQueue.put is safe in a signal handler); printing happens
    # here, so a report never interleaves with another one.
    signals: "queue.SimpleQueue[int]" = queue.SimpleQueue()
    for signum in (REPORT, WEDGE, UNWEDGE, *STOP):
        signal.signal(signum, lambda received, _frame: signals.put(received))
    print("ready", flush=True)
    while True:
        received = signals.get()
        if received == WEDGE:
            server.wedge()
            continue
        if received == UNWEDGE:
            server.unwedge()
            continue
        if received != REPORT:
            break
        print(json.dumps(server.snapshot(), sort_keys=True), flush=True)
    # Stopped before the last count: a call answered meanwhile is in it.
    server.stop()
    print(json.dumps(server.snapshot(), sort_keys=True), flush=True)


class HookServerProcess:
    """One echo hook server as a child process; its counts are asked for with SIGUSR1 and read from its stdout."""

    def __init__(self, socket: Path, mark: bool = False) -> None:
        self.socket = socket
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.echo_hook_server", str(socket), *(["--mark"] if mark else [])],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        self._lines: "queue.Queue[str]" = queue.Queue()
        self.last = dict.fromkeys(HookType, 0)
        self.answering = True
        self._reader = threading.Thread(target=self._read, daemon=True)
        if self.process.stdout.readline().strip() != "ready":
            self.stop()
            raise RuntimeError(f"hook server on {socket} did not start")
        self._reader.start()

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

    def wedge(self) -> None:
        """From now on, calls are received (and counted) but not answered."""
        self.process.send_signal(WEDGE)

    def unwedge(self) -> None:
        """Every call left unanswered is answered now, and the next ones at once."""
        self.process.send_signal(UNWEDGE)

    def stop(self) -> dict[HookType, int]:
        """Ended; what it received in all, from the counts it prints as it exits."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        if self._reader.is_alive():
            self._reader.join(10)
        while not self._lines.empty():
            self._take(self._lines.get_nowait())
        return self.last


if __name__ == "__main__":
    main()
