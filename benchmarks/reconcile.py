"""What keeping the store true costs on a node's worth of pods, against containerd's own listing.

Starts a private containerd with ``--pods`` host-network pods of ``--containers`` running busybox
containers each (110 x 2 by default: a node's size). Then, in this process, with koordrp's own
reading (``resync.read_everything`` over ``cri.runtime_lookup.RuntimeLookup``, the store's
``agree``) on a reactor, ``--repeat`` times each:

* the rebuild at start: everything listed and read back (verbose statuses) into an empty store;
* a periodic reconcile that changes nothing: listed, nothing read back;
* a periodic reconcile after 10 % of the pods were removed behind koordrp's back (on containerd);
* NRI mode's listing (``nri.listing.NRIListing.listed``, as koordrp's plugin "koordrp", index 10): a
  second connection to containerd's NRI socket that registers, takes containerd's synchronization
  of every pod and container, refuses it and closes; on a release with NRI (1.7, 2.1), which the
  benchmark's private containerd is then started with;

and containerd's ListPodSandbox + ListContainers called directly (blocking grpc, same channel
options), for the ratio. Prints p50 and max of each, the store's sizes before and after, and the
reactor-thread CPU each takes. For the NRI listing also, against the CRI listing's: the CPU
containerd and its shims spend on one; what containerd logs per listing; and how long it holds
its NRI lock for one (from its "Synchronizing NRI" line to the refusal it logs): every pod and
container event of containerd's waits on that lock meanwhile.

    .venv/bin/python -m benchmarks.reconcile [--pods 110] [--containers 2] [--repeat 20] [--release 2.1]
"""

import argparse
import re
import statistics
import tempfile
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Awaitable, Callable

import grpc
from cri_api.v1 import api_pb2
from twisted.internet import reactor
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.interfaces import IReactorFromThreads, IReactorUNIX
from twisted.internet.task import deferLater, react

from benchmarks.stats import quantile, process_cpu_ns
from koordrp.cri.backend import CHANNEL_OPTIONS
from koordrp.cri.runtime_lookup import RuntimeLookup
from koordrp.nri.listing import LINGER_SECONDS, NRIListing
from koordrp.nri.plugin import PluginIdentity
from koordrp.resync import agree, read_everything
from koordrp.store import Store
from koordrp.unix import grpc_target
from tests.support.containerd import RELEASES, Containerd
from tests.support.cri_objects import container_config, pod_sandbox_config
from tests.support.images import BUSYBOX_REF, build_test_images
from tests.support.pods import remove_pod, start_container
from tests.support.stack import start_containerd

TIMEOUT = 30.0

# koordrp's default plugin name and index: the listing registers as 10-koordrp-listing.
KOORDRP = PluginIdentity("koordrp", "10")

# Between two listings, so that one's close (LINGER_SECONDS after its result) is over, and counted in its
# CPU, before the next connects; koordrp lists at most every --reconcile-interval seconds anyway.
SETTLE_SECONDS = LINGER_SECONDS + 0.05

# containerd's logfmt lines: their time and message.
LOG_TIME = re.compile(r'time="([^"]+)"')
LOG_LEVEL = re.compile(r"level=(\w+)")
LOG_MESSAGE = re.compile(r'msg="((?:[^"\\]|\\.)*)"|msg=(\S+)')
SYNC_STARTED = "Synchronizing NRI (plugin) with current runtime state"
SYNC_SENDING = "synchronizing plugin "
SYNC_FAILED = "failed to synchronize plugin"


def populate(containerd: Containerd, pods: int, containers: int, logs: Path) -> list[str]:
    runtime = containerd.runtime()
    sandbox_ids = []
    for index in range(pods):
        config = pod_sandbox_config(f"node-{index}", log_directory=logs / f"pod-{index}")
        sandbox_id = runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=config), timeout=60).pod_sandbox_id
        sandbox_ids.append(sandbox_id)
        for number in range(containers):
            container = container_config(
                f"app-{number}", image=BUSYBOX_REF, command=["sleep", "3600"], log_path=f"app-{number}.log"
            )
            start_container(runtime, sandbox_id, config, container)
        if index % 10 == 9:
            print(f"  {index + 1} pods", flush=True)
    return sandbox_ids


class Measured:
    def __init__(self, name: str) -> None:
        self.name = name
        self.seconds: list[float] = []
        self.cpu: list[float] = []

    def row(self, baseline: float | None) -> str:
        p50 = statistics.median(self.seconds)
        ratio = f"  {p50 / baseline:5.1f}x the listing" if baseline else ""
        return (
            f"{self.name:<44} p50 {p50 * 1000:8.1f} ms  max {max(self.seconds) * 1000:8.1f} ms"
            f"  reactor CPU p50 {statistics.median(self.cpu) * 1000:7.1f} ms{ratio}"
        )


async def timed(measured: Measured, reading: Callable[[], Awaitable[object]]) -> None:
    started, cpu = time.perf_counter(), time.thread_time()
    await reading()
    measured.cpu.append(time.thread_time() - cpu)
    measured.seconds.append(time.perf_counter() - started)


async def measure(containerd: Containerd, sandbox_ids: list[str], repeat: int) -> None:
    channel = grpc.insecure_channel(grpc_target(containerd.address), options=CHANNEL_OPTIONS)
    lookup = RuntimeLookup(IReactorFromThreads(reactor), channel)
    list_pods = channel.unary_unary("/runtime.v1.RuntimeService/ListPodSandbox", None, None)
    list_containers = channel.unary_unary("/runtime.v1.RuntimeService/ListContainers", None, None)

    direct = Measured("containerd's ListPodSandbox + ListContainers")
    runtime_before = RuntimeCPU.of(containerd)
    for _ in range(repeat):
        started, cpu = time.perf_counter(), time.thread_time()
        list_pods(b"", timeout=TIMEOUT)
        list_containers(b"", timeout=TIMEOUT)
        direct.cpu.append(time.thread_time() - cpu)
        direct.seconds.append(time.perf_counter() - started)
    direct_runtime = RuntimeCPU.of(containerd).since(runtime_before, repeat)
    baseline = statistics.median(direct.seconds)

    rebuild = Measured("rebuild at start (list + read back all)")
    store = Store()
    for _ in range(repeat):
        store = Store()

        async def rebuilt() -> None:
            agree(store, await read_everything(lookup, TIMEOUT, store), store.ids(), "containerd")

        await timed(rebuild, rebuilt)
    before = store.sizes()

    async def reconciled() -> None:
        known = store.ids()
        agree(store, await read_everything(lookup, TIMEOUT, store), known, "containerd", quiet=True)

    quiet = Measured("periodic reconcile, nothing changed")
    for _ in range(repeat):
        await timed(quiet, reconciled)

    nri = await measure_nri(containerd, store, set(sandbox_ids), repeat) if containerd.nri else None

    removed = sandbox_ids[: max(1, len(sandbox_ids) // 10)]
    runtime = containerd.runtime()
    for sandbox_id in removed:
        remove_pod(runtime, sandbox_id)
    forgetting = Measured(f"periodic reconcile, {len(removed)} pods gone")
    await timed(forgetting, reconciled)
    after = store.sizes()
    channel.close()
    nri_after: int | None = None
    if containerd.nri:
        listing = NRIListing(IReactorUNIX(reactor), str(containerd.paths.nri_socket), KOORDRP, store)
        nri_after = len((await listing.listed(TIMEOUT))[0])

    print()
    print(direct.row(None))
    for measured in (rebuild, quiet, forgetting):
        print(measured.row(baseline))
    if nri is None:
        print(f"(containerd {containerd.release} has no NRI: no NRI listing)")
    else:
        print(nri.listing.row(baseline))
        print(
            f"containerd's CPU per listing, its own threads (its {nri.runtime.shim_count} shims'):"
            f" CRI {direct_runtime}; NRI {nri.runtime}, of which idle for the {SETTLE_SECONDS * 1000:g} ms"
            f" after each {nri.idle}"
        )
        nri.report(repeat)
        print(f"NRI listing after {len(removed)} pods were removed: {nri_after} pods")
    print(f"\nstore (pods, containers): {before} before, {after} after {len(removed)} pods were removed on containerd")
    print(f"periodic reconcile p99 over {repeat}: {quantile(quiet.seconds, 0.99) * 1000:.1f} ms")


class RuntimeCPU:
    """Seconds containerd's threads, and its shims', have run: what a listing costs on its side."""

    def __init__(self, containerd: float, shims: float, shim_count: int) -> None:
        self.containerd = containerd
        self.shims = shims
        self.shim_count = shim_count

    @classmethod
    def of(cls, containerd: Containerd) -> "RuntimeCPU":
        shims = containerd.shim_pids()
        return cls(_cpu(containerd.daemon_pids()), _cpu(shims), len(shims))

    def since(self, earlier: "RuntimeCPU", calls: int) -> "RuntimeCPU":
        """Per call, of ``calls`` made since ``earlier``."""
        return RuntimeCPU(
            (self.containerd - earlier.containerd) / calls, (self.shims - earlier.shims) / calls, self.shim_count
        )

    def __str__(self) -> str:
        return f"{self.containerd * 1000:.1f} ms ({self.shims * 1000:.1f} ms)"


def _cpu(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            total += process_cpu_ns(pid)
        except FileNotFoundError:
            pass  # gone meanwhile: its CPU is nobody's listing's
    return total / 1e9


class NRIFigures:
    """The NRI listings' times, containerd's CPU for them, and what containerd logged meanwhile."""

    def __init__(self, listing: Measured, runtime: RuntimeCPU, idle: RuntimeCPU, log: str) -> None:
        self.listing = listing
        self.runtime = runtime
        self.idle = idle
        self.log = log

    def report(self, repeat: int) -> None:
        lines = self.log.splitlines()
        print(f"containerd's log: {len(lines) / repeat:g} lines per NRI listing ({len(lines)} over {repeat}):")
        for message, count in Counter(map(_message, lines)).most_common():
            print(f"  {count / repeat:g} x {message}")
        held = _lock_held(lines)
        if held:
            gathering = [gathered for gathered, _ in held]
            total = [whole for _, whole in held]
            print(
                f"containerd's NRI lock held per listing (its sync line to its refusal line, over {len(held)}):"
                f" p50 {statistics.median(total) * 1000:.1f} ms, max {max(total) * 1000:.1f} ms;"
                f" of which gathering the pods and containers before sending:"
                f" p50 {statistics.median(gathering) * 1000:.1f} ms, max {max(gathering) * 1000:.1f} ms"
            )


async def measure_nri(containerd: Containerd, store: Store, pods: set[str], repeat: int) -> NRIFigures:
    """``repeat`` listings by NRI, each checked against the pods made and the store's containers."""
    listing = NRIListing(IReactorUNIX(reactor), str(containerd.paths.nri_socket), KOORDRP, store)
    containers = store.ids()[1]
    measured = Measured("NRI listing (a synchronization, refused)")
    # containerd's CPU per listing includes the pause after each: what it spends idle, the same time.
    idle_before = RuntimeCPU.of(containerd)
    await deferLater(reactor, SETTLE_SECONDS * repeat)
    idle = RuntimeCPU.of(containerd).since(idle_before, repeat)
    log_start = containerd.paths.log.stat().st_size
    runtime_before = RuntimeCPU.of(containerd)
    for _ in range(repeat):
        started, cpu = time.perf_counter(), time.thread_time()
        listed_pods, listed_containers = await listing.listed(TIMEOUT)
        seconds = time.perf_counter() - started
        # The close is the listing's own work, done on the reactor once the result is given.
        await deferLater(reactor, SETTLE_SECONDS)
        measured.cpu.append(time.thread_time() - cpu)
        measured.seconds.append(seconds)
        if set(listed_pods) != pods or set(listed_containers) != containers:
            raise RuntimeError(
                f"the NRI listing disagrees: {len(listed_pods)} pods, {len(listed_containers)} containers;"
                f" {len(pods)} and {len(containers)} expected"
            )
    runtime = RuntimeCPU.of(containerd).since(runtime_before, repeat)
    # containerd logs the refusal after the plugin's answer: give the last one time to be written.
    await deferLater(reactor, 0.5)
    with containerd.paths.log.open("rb") as log:
        log.seek(log_start)
        return NRIFigures(measured, runtime, idle, log.read().decode(errors="replace"))


def _message(line: str) -> str:
    found = LOG_MESSAGE.search(line)
    if found is None:
        return line[:120]
    level = LOG_LEVEL.search(line)
    # The plugin's pid differs per listing; the message's shape does not.
    message = re.sub(r"\[\d+\]", "[pid]", found.group(1) or found.group(2))
    return f"{level.group(1) if level else '?'}: {message}"


def _lock_held(lines: list[str]) -> list[tuple[float, float]]:
    """Seconds from each of containerd's sync lines to its line saying it sends the synchronization, and to
    the refusal it logs next: it holds its NRI lock from the first to the last."""
    held = []
    started: datetime | None = None
    sending: datetime | None = None
    for line in lines:
        stamp = LOG_TIME.search(line)
        if stamp is None:
            continue
        at = datetime.fromisoformat(stamp.group(1))
        if SYNC_STARTED in line:
            started, sending = at, None
        elif SYNC_SENDING in line:
            sending = at
        elif SYNC_FAILED in line and started is not None and sending is not None:
            held.append(((sending - started).total_seconds(), (at - started).total_seconds()))
            started = None
    return held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pods", type=int, default=110)
    parser.add_argument("--containers", type=int, default=2, help="containers per pod")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--release", default="2.1", help="containerd release (tests/support/containerd.py RELEASES)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="krp-bench-", dir="/tmp") as scratch:
        base = Path(scratch)
        # NRI on where the release has it: only then is NRI mode's listing there to measure.
        nri = RELEASES[args.release].nri
        containerd = start_containerd(build_test_images(base / "images"), base / "containerd", release=args.release, nri=nri)
        try:
            print(
                f"containerd {args.release}{' with NRI' if nri else ''}: {args.pods} pods x {args.containers} containers",
                flush=True,
            )
            sandbox_ids = populate(containerd, args.pods, args.containers, base / "logs")

            def run(_: object) -> "Deferred[None]":
                return ensureDeferred(measure(containerd, sandbox_ids, args.repeat))

            try:
                react(run)
            except SystemExit as ended:
                # react always ends so; a failed measure (its traceback printed) must fail the run.
                if ended.code:
                    raise
        finally:
            containerd.stop()


if __name__ == "__main__":
    main()
