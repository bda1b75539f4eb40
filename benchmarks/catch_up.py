"""How long koordrp takes, back after an absence, to catch up on what containerd made meanwhile (NRI mode).

    .venv/bin/python -m benchmarks.catch_up [--pods 5] [--rounds 3] [--release 2.1]

Per containerd release with NRI (1.7 and 2.1), a private containerd, a hook server that gives cpu
shares 512 at PreCreateContainer (in this process), and koordrp as its NRI plugin. Each round:

* **baseline**: koordrp started with nothing to catch up; seconds from its start until it is containerd's
  plugin (its log says it registered, as its reply to the synchronization leaves): what every start pays;
* **away**: koordrp killed (SIGKILL), ``--pods`` pods of one running container made on containerd, koordrp
  started again (its state directory kept); seconds from its start until registered, and until every
  container has the hook's cpu shares in containerd's spec (what containerd applied);
* **boot**: the same pods on a node koordrp never saw (an empty state directory).

It prints the p50 of each over the rounds, and the catch-up (registered → every container at 512) as
a ratio to the baseline registration measured in the same run.
"""

import argparse
import contextlib
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from cri_api.v1 import api_pb2

from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from tests.fake.hook_server import FakeHookServer
from tests.support.containerd import NRI_RELEASES
from tests.support.cri_objects import container_config, linux_resources, pod_sandbox_config
from tests.support.hook_registration import register
from tests.support.images import build_test_images
from tests.support.koordrp_process import KoordrpProcess
from tests.support.pods import TIMEOUT, remove_pod, runtime_spec, start_container
from tests.support.stack import start_containerd

SHARES = 512
REGISTERED = "] registered with containerd"


def wait(condition: Any, what: str, timeout: float = 120.0) -> float:
    """Seconds until ``condition()`` holds, polled every millisecond."""
    began = time.monotonic()
    while not condition():
        if time.monotonic() - began > timeout:
            raise RuntimeError(f"not within {timeout:g}s: {what}")
        time.sleep(0.001)
    return time.monotonic() - began


@contextlib.contextmanager
def pods(runtime: Any, logs: Path, prefix: str, count: int) -> Iterator[list[str]]:
    """``count`` pods of one running container with cpu shares 102, made on containerd itself; their container ids."""
    sandboxes: list[str] = []
    containers: list[str] = []
    try:
        for index in range(count):
            config = pod_sandbox_config(f"{prefix}-{index}", log_directory=logs / f"{prefix}-{index}")
            sandbox_id = runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=config), timeout=TIMEOUT).pod_sandbox_id
            sandboxes.append(sandbox_id)
            container = container_config("app", command=["sleep", "3600"], resources=linux_resources(cpu_shares=102))
            containers.append(start_container(runtime, sandbox_id, config, container))
        yield containers
    finally:
        for sandbox_id in sandboxes:
            remove_pod(runtime, sandbox_id)


def started(koordrp: KoordrpProcess) -> float:
    """Starts ``koordrp``; seconds until it is containerd's plugin (its log says it registered: its reply to the
    synchronization, with what the catch-up changed by then, is on its way)."""
    earlier = len(koordrp.log())
    began = time.monotonic()
    koordrp.process = subprocess.Popen(koordrp.argv(), cwd=koordrp.base, stdin=subprocess.DEVNULL, env=koordrp.environ)
    wait(lambda: REGISTERED in koordrp.log()[earlier:], "koordrp registered")
    return time.monotonic() - began


def caught_up(runtime: Any, containers: list[str]) -> bool:
    return all(runtime_spec(runtime, c)["linux"]["resources"]["cpu"]["shares"] == SHARES for c in containers)


def measure(base: Path, release: str, count: int, rounds: int) -> dict[str, list[float]]:
    images = build_test_images(base / "images")
    containerd = start_containerd(images, base / f"containerd-{release}", release=release, nri=True)
    server = FakeHookServer(str(base / "tuner.sock")).start()
    server.behaviours["PreCreateContainerHook"] = lambda request: hook.ContainerResourceHookResponse(
        container_resources=hook.LinuxContainerResources(cpu_shares=SHARES)
    )
    figures: dict[str, list[float]] = {}
    runtime = containerd.runtime()
    try:
        for round_ in range(rounds):
            for way in ("baseline", "away", "boot"):
                work = base / f"{release}-{way}-{round_}"
                work.mkdir()
                register(work / "hookserver.d", "tuner", str(server.path), ["PreCreateContainer"])
                koordrp = KoordrpProcess(work, containerd.endpoint, nri_socket=containerd.paths.nri_socket)
                try:
                    if way == "baseline":
                        figures.setdefault("baseline: registered", []).append(started(koordrp))
                        continue
                    if way == "away":
                        started(koordrp)
                        koordrp.kill()
                    with pods(runtime, work, f"{way}-{round_}", count) as containers:
                        registered = started(koordrp)
                        done = wait(lambda: caught_up(runtime, containers), "every container at the hook's shares")
                        figures.setdefault(f"{way}: registered", []).append(registered)
                        figures.setdefault(f"{way}: caught up after registration", []).append(done)
                finally:
                    koordrp.stop()
    finally:
        server.stop()
        containerd.stop()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pods", type=int, default=5, help="pods made while koordrp is away")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--release", choices=NRI_RELEASES, action="append", help="containerd release (default: each)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="krp-catch-up-", dir="/tmp") as scratch:
        for release in args.release or NRI_RELEASES:
            figures = measure(Path(scratch), release, args.pods, args.rounds)
            baseline = statistics.median(figures["baseline: registered"])
            print(f"== containerd {release}: {args.pods} pods, p50 of {args.rounds} rounds")
            for name, values in figures.items():
                print(f"  {name:<40} {statistics.median(values) * 1e3:8.1f} ms")
            for way in ("away", "boot"):
                ratio = statistics.median(figures[f"{way}: caught up after registration"]) / baseline
                print(f"  {way}: catch-up / baseline registration      {ratio:8.2f}x")


if __name__ == "__main__":
    main()
