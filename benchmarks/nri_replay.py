"""The CPU koordrp's NRI plugin spends on a pod start, without containerd's or the socket's.

    .venv/bin/python -m benchmarks.nri_replay [--rounds 300] [--pause 0.05]

First it records what containerd sends its plugin for one pod's start and removal: a private
containerd 2.1 with NRI and, as its plugin, the minimal plugin run by this module as
``--record FILE NRI_SOCKET``, which writes down each request it answers. Then, in this process,
it feeds those bytes to koordrp's NRI plugin (no hook server; its log lines go through
twisted.logger's text observer to a file, as under twistd) and to the minimal plugin, both on
koordrp's connection layer (``koordrp.nri.connection``) with an in-memory transport, round after
round, in turns. A round's CPU is the thread's (``time.thread_time``) over the pod start's five
requests; the removal that follows is not counted. Each way runs once warm (rounds back to back)
and once cold (``--pause`` of sleep before each pod start, as between the pod starts of
``benchmarks/nri_starts.py``).

What it prints is the median CPU per pod start of each way and koordrp's over the minimal plugin's:
the part of ``nri_starts.py``'s plugin CPU that is koordrp's own Python, measured without the noise
of containerd and runc sharing the cores. A change to the flows, the store or the plugin shows here
first. With no hook server, a pod start's calls are uneventful: they get no line. Under containerd
the same work costs about twice as much again (benchmarks/README.md, "nri_replay.py").
"""

import argparse
import base64
import io
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack, redirect_stdout
from pathlib import Path
from typing import TextIO

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.logger import globalLogBeginner, textFileLogObserver

from benchmarks import minimal_nri_plugin
from benchmarks.nri_starts import MINIMAL_PLUGIN, phased_pod_start, wait_for_plugin
from benchmarks.processes import running_module
from koordrp.api.nri.v1alpha1 import api_pb2 as nri
from koordrp.call import Parts, SkipLabel
from koordrp.hooks.client import HookClients
from koordrp.hooks.dispatcher import Dispatcher
from koordrp.hooks.types import HookServers
from koordrp.nri.connection import PluginCalls, NRIConnection
from koordrp.nri.plugin import NRIPlugin, PluginIdentity
from koordrp.store import Store
from koordrp.defaults import (
    DEFAULT_NRI_PLUGIN_INDEX,
    DEFAULT_NRI_PLUGIN_NAME,
    DEFAULT_SKIP_HOOK_KEY,
    DEFAULT_SKIP_HOOK_VALUE,
)
from tests.fake.nri import FakeContainerd
from tests.support.images import build_test_images
from tests.support.pods import remove_pod
from tests.support.stack import start_containerd

Request = tuple[str, bytes, float | None]
START_REQUESTS = 5
"""RunPodSandbox, CreateContainer, PostCreateContainer, StartContainer, PostStartContainer."""
REMOVAL_REQUESTS = 4
"""StopContainer, StopPodSandbox, RemoveContainer, RemovePodSandbox."""


class Recording(minimal_nri_plugin.MinimalPlugin):
    """The minimal plugin, writing down each request containerd calls it with (JSON lines)."""

    def __init__(self, out: TextIO) -> None:
        self._out = out

    def called(self, method: str, payload: bytes, timeout: float | None) -> "Deferred[bytes]":
        self._out.write(json.dumps({"method": method, "payload": base64.b64encode(payload).decode(), "timeout": timeout}) + "\n")
        self._out.flush()
        return super().called(method, payload, timeout)


def recorded(path: Path) -> list[Request]:
    requests = []
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        requests.append((entry["method"], base64.b64decode(entry["payload"]), entry["timeout"]))
    return requests


def record(scratch: Path) -> list[Request]:
    """containerd's requests to its plugin from its Configure to one pod's removal."""
    out = scratch / "requests.jsonl"
    with ExitStack() as stack:
        containerd = start_containerd(build_test_images(scratch / "images"), scratch / "containerd", release="2.1", nri=True)
        stack.callback(containerd.stop)
        stack.enter_context(running_module("benchmarks.nri_replay", "--record", str(out), str(containerd.paths.nri_socket)))
        wait_for_plugin(containerd, MINIMAL_PLUGIN)
        runtime = containerd.runtime()
        remove_pod(runtime, phased_pod_start(runtime, "replayed", scratch / "logs")[1])
        # containerd tells of a removal once it is done: the last request may still be on its way.
        deadline = time.monotonic() + 30
        while len(recorded(out)) < 2 + START_REQUESTS + REMOVAL_REQUESTS and time.monotonic() < deadline:
            time.sleep(0.02)
    requests = recorded(out)
    if [method for method, _, _ in requests[:2]] != ["Configure", "Synchronize"] or len(requests) != 2 + START_REQUESTS + REMOVAL_REQUESTS:
        raise RuntimeError(f"unexpected requests from containerd: {[method for method, _, _ in requests]}")
    return requests


class Replay:
    """One plugin on koordrp's connection layer, fed the recorded requests."""

    def __init__(self, plugin: Callable[[Clock], PluginCalls], requests: list[Request]) -> None:
        self.clock = Clock()
        self.containerd = FakeContainerd(NRIConnection(plugin(self.clock), self.clock))
        self._requests = requests
        with redirect_stdout(io.StringIO()):  # the minimal plugin says "ready" once synchronized
            self._feed(requests[:2])

    def _feed(self, requests: list[Request]) -> None:
        for method, payload, timeout in requests:
            self.containerd.call(method, nri.Empty(), timeout=timeout, payload=payload)
        self.clock.advance(0)
        self.containerd.transport.clear()  # type: ignore[no-untyped-call]

    def pod(self, pause: float) -> float:
        """The thread's CPU seconds over one pod start; its removal after, not counted."""
        if pause:
            time.sleep(pause)
        began = time.thread_time()
        self._feed(self._requests[2 : 2 + START_REQUESTS])
        spent = time.thread_time() - began
        self._feed(self._requests[2 + START_REQUESTS :])
        return spent


def koordrp_plugin(clock: Clock) -> NRIPlugin:
    parts = Parts(Store(), Dispatcher(HookClients(clock), clock), HookServers, SkipLabel(DEFAULT_SKIP_HOOK_KEY, DEFAULT_SKIP_HOOK_VALUE), clock)
    return NRIPlugin(parts, PluginIdentity(DEFAULT_NRI_PLUGIN_NAME, DEFAULT_NRI_PLUGIN_INDEX))


def main() -> None:
    if sys.argv[1:2] == ["--record"]:
        with open(sys.argv[2], "a") as out:
            minimal_nri_plugin.serve(sys.argv[3], lambda: Recording(out))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--pause", type=float, default=0.05, help="seconds of sleep before each cold pod start")
    parsed = parser.parse_args()
    if parsed.rounds < 1:
        parser.error("--rounds must be at least 1")
    with tempfile.TemporaryDirectory(prefix="krp-replay-", dir="/tmp") as scratch, open(Path(scratch) / "koordrp.log", "w") as log:
        requests = record(Path(scratch))
        globalLogBeginner.beginLoggingTo([textFileLogObserver(log)], redirectStandardIO=False)
        ways = {"minimal plugin": Replay(lambda clock: minimal_nri_plugin.MinimalPlugin(), requests), "koordrp": Replay(koordrp_plugin, requests)}
        for label, pause in (("warm", 0.0), ("cold", parsed.pause)):
            spent: dict[str, list[float]] = {way: [] for way in ways}
            for index in range(parsed.rounds + 20):
                for way, replay in random.sample(list(ways.items()), len(ways)):
                    seconds = replay.pod(pause)
                    if index >= 20:  # the first rounds warm the interpreter up
                        spent[way].append(seconds)
            medians = {way: statistics.median(samples) * 1000 for way, samples in spent.items()}
            print(f"{label} ({parsed.rounds} pod starts each" + (f", {pause:g}s of sleep before each):" if pause else "):"))
            for way, median in medians.items():
                print(f"  {way:15} {median:.3f} ms CPU per pod start")
            print(f"  koordrp's own   {medians['koordrp'] - medians['minimal plugin']:.3f} ms")


if __name__ == "__main__":
    main()
