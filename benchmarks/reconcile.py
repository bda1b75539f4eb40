"""What keeping the store true costs on a node's worth of pods, against containerd's own listing.

Starts a private containerd with ``--pods`` host-network pods of ``--containers`` running busybox
containers each (110 x 2 by default: a node's size). Then, in this process, with koordrp's own
reading (``resync.read_everything`` over ``cri.runtime_lookup.RuntimeLookup``, the store's
``agree``) on a reactor, ``--repeat`` times each:

* the rebuild at start: everything listed and read back (verbose statuses) into an empty store;
* a periodic reconcile that changes nothing: listed, nothing read back;
* a periodic reconcile after 10 % of the pods were removed behind koordrp's back (on containerd);

and containerd's ListPodSandbox + ListContainers called directly (blocking grpc, same channel
options), for the ratio. Prints p50 and max of each, the store's sizes before and after, and the
reactor-thread CPU each takes.

    .venv/bin/python -m benchmarks.reconcile [--pods 110] [--containers 2] [--repeat 20] [--release 2.1]
"""

import argparse
import statistics
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Awaitable, Callable

import grpc
from cri_api.v1 import api_pb2
from twisted.internet import reactor
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.interfaces import IReactorFromThreads
from twisted.internet.task import react

from benchmarks.stats import quantile
from koordrp.cri.backend import CHANNEL_OPTIONS
from koordrp.cri.runtime_lookup import RuntimeLookup
from koordrp.resync import agree, read_everything
from koordrp.store import Store
from koordrp.unix import grpc_target
from tests.support.containerd import Containerd
from tests.support.cri_objects import container_config, pod_sandbox_config
from tests.support.images import BUSYBOX_REF, build_test_images
from tests.support.pods import remove_pod, start_container
from tests.support.stack import start_containerd

TIMEOUT = 30.0


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
    lookup = RuntimeLookup(IReactorFromThreads(reactor), lambda: nullcontext(channel))
    list_pods = channel.unary_unary("/runtime.v1.RuntimeService/ListPodSandbox", None, None)
    list_containers = channel.unary_unary("/runtime.v1.RuntimeService/ListContainers", None, None)

    direct = Measured("containerd's ListPodSandbox + ListContainers")
    for _ in range(repeat):
        started, cpu = time.perf_counter(), time.thread_time()
        list_pods(b"", timeout=TIMEOUT)
        list_containers(b"", timeout=TIMEOUT)
        direct.cpu.append(time.thread_time() - cpu)
        direct.seconds.append(time.perf_counter() - started)
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

    removed = sandbox_ids[: max(1, len(sandbox_ids) // 10)]
    runtime = containerd.runtime()
    for sandbox_id in removed:
        remove_pod(runtime, sandbox_id)
    forgetting = Measured(f"periodic reconcile, {len(removed)} pods gone")
    await timed(forgetting, reconciled)
    after = store.sizes()
    channel.close()

    print()
    print(direct.row(None))
    for measured in (rebuild, quiet, forgetting):
        print(measured.row(baseline))
    print(f"\nstore (pods, containers): {before} before, {after} after {len(removed)} pods were removed on containerd")
    print(f"periodic reconcile p99 over {repeat}: {quantile(quiet.seconds, 0.99) * 1000:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pods", type=int, default=110)
    parser.add_argument("--containers", type=int, default=2, help="containers per pod")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--release", default="2.1", help="containerd release (tests/support/containerd.py RELEASES)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="krp-bench-", dir="/tmp") as scratch:
        base = Path(scratch)
        containerd = start_containerd(build_test_images(base / "images"), base / "containerd", release=args.release)
        try:
            print(f"containerd {args.release}: {args.pods} pods x {args.containers} containers", flush=True)
            sandbox_ids = populate(containerd, args.pods, args.containers, base / "logs")

            def run(_: object) -> "Deferred[None]":
                return ensureDeferred(measure(containerd, sandbox_ids, args.repeat))

            try:
                react(run)
            except SystemExit:
                pass
        finally:
            containerd.stop()


if __name__ == "__main__":
    main()
