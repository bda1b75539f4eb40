"""Pass-through cost of koordrp: the same client calls containerd directly and through koordrp.

Starts a private containerd with ``--pods`` host-network sandboxes, starts ``twistd -n koordrp`` in
front of it, then prints per method the sequential latency (p50/p99) both ways and their ratio,
throughput at several concurrencies, koordrp's CPU time per call (from /proc) and its RSS.

    .venv/bin/python -m benchmarks.passthrough [--calls 2000] [--pods 50]
"""

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import grpc
from cri_api.v1 import api_pb2, api_pb2_grpc

from benchmarks import minimal_passthrough
from benchmarks.stats import quantile, timed
from tests.support.cri_objects import container_config, pod_sandbox_config
from tests.support.images import BUSYBOX_REF
from tests.support.koordrp_process import KoordrpProcess, cpu_seconds, rss_bytes
from tests.support.pods import start_container
from tests.support.stack import containerd_and_koordrp

Call = Callable[[api_pb2_grpc.RuntimeServiceStub], Any]


def sequential(stub: api_pb2_grpc.RuntimeServiceStub, call: Call, count: int) -> list[float]:
    for _ in range(min(100, count)):
        call(stub)
    return timed(count, lambda _: call(stub))


def throughput(channel: grpc.Channel, call: Call, concurrency: int, total: int) -> float:
    stub = api_pb2_grpc.RuntimeServiceStub(channel)
    per_worker = max(1, total // concurrency)
    barrier = threading.Barrier(concurrency + 1)

    def worker() -> None:
        barrier.wait()
        for _ in range(per_worker):
            call(stub)

    workers = [threading.Thread(target=worker) for _ in range(concurrency)]
    for thread in workers:
        thread.start()
    barrier.wait()
    started = time.perf_counter()
    for thread in workers:
        thread.join()
    return per_worker * concurrency / (time.perf_counter() - started)


def populate(runtime: api_pb2_grpc.RuntimeServiceStub, pods: int, logs: Path) -> str:
    """Create ``pods`` sandboxes and one running container; returns the container's id."""
    container_id = ""
    for index in range(pods):
        config = pod_sandbox_config(f"bench-{index}", log_directory=logs / f"pod-{index}")
        sandbox = runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=config), timeout=60)
        if not container_id:
            container = container_config("app", image=BUSYBOX_REF, command=["sleep", "3600"], log_path="app.log")
            container_id = start_container(runtime, sandbox.pod_sandbox_id, config, container)
    return container_id


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000, help="sequential calls per method and path")
    parser.add_argument("--pods", type=int, default=50, help="sandboxes present during the calls")
    parser.add_argument("--throughput-calls", type=int, default=4000, help="calls per throughput measurement")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="krp-bench-", dir="/tmp") as scratch:
        base = Path(scratch)
        with containerd_and_koordrp(base) as (containerd, proxy):
            direct_channel = containerd.channel()
            container_id = populate(api_pb2_grpc.RuntimeServiceStub(direct_channel), args.pods, base / "logs")
            with proxy.channel() as proxy_channel:
                report(args, direct_channel, proxy_channel, proxy, container_id)


def report(
    args: argparse.Namespace,
    direct_channel: grpc.Channel,
    proxy_channel: grpc.Channel,
    proxy: KoordrpProcess,
    container_id: str,
) -> None:
    calls: dict[str, Call] = {
        "Version": lambda s: s.Version(api_pb2.VersionRequest()),
        "ListPodSandbox": lambda s: s.ListPodSandbox(api_pb2.ListPodSandboxRequest()),
        "ListContainers": lambda s: s.ListContainers(api_pb2.ListContainersRequest()),
        "ContainerStatus": lambda s: s.ContainerStatus(api_pb2.ContainerStatusRequest(container_id=container_id)),
    }
    direct = api_pb2_grpc.RuntimeServiceStub(direct_channel)
    proxied = api_pb2_grpc.RuntimeServiceStub(proxy_channel)
    rss_start = rss_bytes(proxy.pid)
    print(f"pass-through, {args.calls} sequential calls per method, {args.pods} sandboxes present")
    header = f"{'method':<16}{'direct p50':>12}{'koordrp p50':>13}{'added':>9}{'ratio':>7}"
    header += f"{'direct p99':>12}{'koordrp p99':>13}{'ratio':>7}{'CPU/call':>10}"
    print(header)
    for name, call in calls.items():
        baseline = sequential(direct, call, args.calls)
        cpu_before = cpu_seconds(proxy.pid)
        through = sequential(proxied, call, args.calls)
        cpu_per_call = (cpu_seconds(proxy.pid) - cpu_before) / (args.calls + min(100, args.calls))
        d50, k50 = statistics.median(baseline), statistics.median(through)
        d99, k99 = quantile(baseline, 0.99), quantile(through, 0.99)
        print(
            f"{name:<16}{d50 * 1e6:>10.0f}us{k50 * 1e6:>11.0f}us{(k50 - d50) * 1e6:>7.0f}us{k50 / d50:>7.2f}"
            f"{d99 * 1e6:>10.0f}us{k99 * 1e6:>11.0f}us{k99 / d99:>7.2f}{cpu_per_call * 1e6:>8.0f}us"
        )
    print(f"\nthroughput of Version, {args.throughput_calls} calls per measurement")
    print(f"{'concurrency':<12}{'direct':>12}{'koordrp':>12}{'ratio':>7}")
    for concurrency in (1, 8, 32):
        direct_rate = throughput(direct_channel, calls["Version"], concurrency, args.throughput_calls)
        proxy_rate = throughput(proxy_channel, calls["Version"], concurrency, args.throughput_calls)
        print(f"{concurrency:<12}{direct_rate:>8.0f}/s{proxy_rate:>10.0f}/s{proxy_rate / direct_rate:>7.2f}")
    print(f"\nkoordrp RSS: {rss_start / 2**20:.1f} MiB before the calls, {rss_bytes(proxy.pid) / 2**20:.1f} MiB after")
    compare_with_the_floor(args, direct, proxied, proxy)


def compare_with_the_floor(
    args: argparse.Namespace, direct: api_pb2_grpc.RuntimeServiceStub, proxied: api_pb2_grpc.RuntimeServiceStub, proxy: KoordrpProcess
) -> None:
    """The same Version calls through the least a grpcio proxy can do (benchmarks/minimal_passthrough.py).

    Measured in the same run, on the same machine, it tells what part of koordrp's cost is grpcio's
    own and what part is koordrp's.
    """
    listen = str(proxy.base / "minimal.sock")
    with minimal_passthrough.running(listen, proxy.runtime_endpoint.removeprefix("unix://")) as floor:
        with grpc.insecure_channel(f"unix:{listen}") as channel:
            minimal = api_pb2_grpc.RuntimeServiceStub(channel)
            version: Call = lambda stub: stub.Version(api_pb2.VersionRequest())
            rows = []
            for label, stub, pid in (("direct", direct, None), ("minimal", minimal, floor.pid), ("koordrp", proxied, proxy.pid)):
                cpu_before = cpu_seconds(pid) if pid else 0.0
                samples = sequential(stub, version, args.calls)
                cpu = (cpu_seconds(pid) - cpu_before) / (args.calls + min(100, args.calls)) if pid else 0.0
                rows.append((label, statistics.median(samples), cpu))
    base = rows[0][1]
    print(f"\nthe floor: Version, {args.calls} sequential calls, with a minimal grpcio pass-through in the same run")
    print(f"{'':<10}{'p50':>10}{'added':>10}{'CPU/call':>10}")
    for label, p50, cpu in rows:
        print(f"{label:<10}{p50 * 1e6:>8.0f}us{(p50 - base) * 1e6:>8.0f}us{cpu * 1e6:>8.0f}us")
    added_minimal, added_koordrp = rows[1][1] - base, rows[2][1] - base
    print(f"koordrp's added latency / the minimal one's: {added_koordrp / added_minimal:.2f}")


if __name__ == "__main__":
    main()
