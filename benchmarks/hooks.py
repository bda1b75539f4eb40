"""Cost of runtime hooks: pod start through koordrp with a no-op hook server on every hook vs direct.

Starts a private containerd and ``twistd -n koordrp`` in front of it, registers one hook server that
answers every hook with an empty response (it changes nothing), then prints:

* RunPodSandbox + CreateContainer + StartContainer latency over ``--pods`` pods, direct and through
  koordrp (interleaved, so both see the same machine), p50/p90 and the ratio;
* the dispatch overhead of one hook stage: UpdateContainerResources (one pre hook) on the same
  container through koordrp with the hook registered and without, p50 difference.

    .venv/bin/python -m benchmarks.hooks [--pods 50] [--updates 300]
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
from cri_api.v1 import api_pb2

from benchmarks.stats import quantile, timed
from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from koordrp.api.runtime.v1alpha1 import api_pb2_grpc as hook_grpc
from koordrp.hooks.types import HookType
from tests.support.cri_objects import container_config, linux_resources, pod_sandbox_config
from tests.support.hook_registration import register
from tests.support.images import BUSYBOX_REF
from tests.support.pods import TIMEOUT, remove_pod
from tests.support.stack import containerd_and_koordrp


STEPS = ("RunPodSandbox", "CreateContainer", "StartContainer")


def pod_start(runtime: Any, name: str, logs: Path) -> tuple[list[float], str]:
    """Seconds for RunPodSandbox, CreateContainer and StartContainer, and the sandbox id."""
    pod = pod_sandbox_config(name, log_directory=logs / name)
    container = container_config(name, image=BUSYBOX_REF, command=["sleep", "3600"], log_path=f"{name}.log")
    times = [time.perf_counter()]
    sandbox_id = runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=pod), timeout=TIMEOUT).pod_sandbox_id
    times.append(time.perf_counter())
    container_id = runtime.CreateContainer(
        api_pb2.CreateContainerRequest(pod_sandbox_id=sandbox_id, config=container, sandbox_config=pod), timeout=TIMEOUT
    ).container_id
    times.append(time.perf_counter())
    runtime.StartContainer(api_pb2.StartContainerRequest(container_id=container_id), timeout=TIMEOUT)
    times.append(time.perf_counter())
    return [end - start for start, end in zip(times, times[1:])], sandbox_id


def updates(runtime: Any, container_id: str, count: int) -> list[float]:
    def update(index: int) -> object:
        request = api_pb2.UpdateContainerResourcesRequest(
            container_id=container_id, linux=linux_resources(cpu_shares=1024 + index % 2)
        )
        return runtime.UpdateContainerResources(request, timeout=TIMEOUT)

    return timed(count, update)


def hook_round_trips(socket: str, count: int) -> list[float]:
    """The no-op hook server's own latency: the same hook called directly, without koordrp."""
    request = hook.ContainerResourceHookRequest(container_meta=hook.ContainerMetadata(name="bench"))
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        stub = hook_grpc.RuntimeHookServiceStub(channel)
        return timed(count, lambda _: stub.PreUpdateContainerResourcesHook(request, timeout=TIMEOUT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pods", type=int, default=50)
    parser.add_argument("--updates", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="krp-bench-", dir="/tmp") as scratch:
        base = Path(scratch)
        socket = str(base / "noop.sock")
        noop = subprocess.Popen([sys.executable, "-m", "benchmarks.noop_hook_server", socket], stdout=subprocess.PIPE)
        try:
            assert noop.stdout is not None and noop.stdout.readline().strip() == b"ready"
            with containerd_and_koordrp(base) as (containerd, proxy):
                direct = containerd.runtime()
                with proxy.channel() as channel:
                    measure(args, base, direct, proxy.runtime(channel), proxy, socket)
        finally:
            noop.terminate()
            noop.wait(10)


def measure(args: argparse.Namespace, base: Path, direct: Any, proxied: Any, proxy: Any, socket: str) -> None:
    registration = register(base / "hookserver.d", "noop", socket, [point.value for point in HookType])
    proxy.wait_for_servers(1)
    paths = {"direct": direct, "koordrp, no-op hooks": proxied}
    samples: dict[str, list[list[float]]] = {label: [] for label in paths}
    sandboxes = []
    for index in range(args.pods):
        for label, runtime in paths.items():
            steps, sandbox_id = pod_start(runtime, f"{label.split(',')[0]}-{index}", base / "logs")
            samples[label].append(steps)
            sandboxes.append(sandbox_id)
    print(f"pod start, {args.pods} pods each way (interleaved), p50 per call")
    print(f"{'':<22}" + "".join(f"{step:>17}" for step in STEPS) + f"{'sum of the 3':>15}{'p90 sum':>10}")
    totals = {}
    for label, rows in samples.items():
        columns = [statistics.median(row[i] for row in rows) for i in range(len(STEPS))]
        totals[label] = [sum(row) for row in rows]
        print(
            f"{label:<22}" + "".join(f"{value * 1e3:>15.1f}ms" for value in columns)
            + f"{statistics.median(totals[label]) * 1e3:>13.1f}ms{quantile(totals[label], 0.9) * 1e3:>8.1f}ms"
        )
    ratio = statistics.median(totals["koordrp, no-op hooks"]) / statistics.median(totals["direct"])
    print(f"ratio koordrp/direct of the p50 sums: {ratio:.3f} (4 hook stages per pod: PreRun, PreCreate, PreStart, PostStart)")

    container_id = proxied.ListContainers(api_pb2.ListContainersRequest()).containers[0].id
    hooked = updates(proxied, container_id, args.updates)
    registration.unlink()
    proxy.wait_for_servers(0)
    bare = updates(proxied, container_id, args.updates)
    overhead = statistics.median(hooked) - statistics.median(bare)
    round_trip = statistics.median(hook_round_trips(socket, args.updates))
    print(f"\nUpdateContainerResources through koordrp, {args.updates} calls each")
    print(f"{'without hooks':<26}{statistics.median(bare) * 1e3:>8.2f}ms")
    print(f"{'with a no-op pre hook':<26}{statistics.median(hooked) * 1e3:>8.2f}ms")
    print(f"{'one hook stage adds':<26}{overhead * 1e3:>8.2f}ms (p50)")
    print(f"{'  of which the hook server':<26}{round_trip * 1e3:>8.2f}ms (p50 of a call made to it directly)")
    print(f"{'  and koordrp':<26}{(overhead - round_trip) * 1e3:>8.2f}ms")
    for sandbox_id in sandboxes:
        remove_pod(direct, sandbox_id)


if __name__ == "__main__":
    main()
