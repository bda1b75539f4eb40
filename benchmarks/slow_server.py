"""A hook server slower than containerd's NRI deadline, on containerd 1.7 and 2.1 with koordrp as their NRI plugin.

    .venv/bin/python -m benchmarks.slow_server [--releases 1.7 2.1] [--creates 8] [--apart 2.0] [--delay 2.5]

For each release, a private containerd with NRI, koordrp registered as its plugin, and a hook server in a
process of its own (benchmarks/slow_hook_server.py) answering PreCreateContainer in ``--delay`` seconds
with cpu shares 512 (its registration: ``timeout-seconds: 10``). It prints:

* containerd's ``plugin_request_timeout`` 2s (its default): ``--creates`` creates ``--apart`` seconds apart
  (start to start) in one pod, each create's time, and how many waited ≥ 1.5 s; beside the same creates
  with no hook server registered (containerd and koordrp alone, the same run);
* the time from the first create's start until its late answer's cpu shares are in containerd's spec of
  the container, and in its cgroup (the container is started right after its create);
* the same creates with ``plugin_request_timeout`` 10s: every answer applied in the create, at the cost of
  each create's wait;
* a wedged server (it never answers; ``timeout-seconds`` 60): another pod's start (RunPodSandbox,
  CreateContainer, StartContainer) begun 0.5 s after a create that reaches the wedged server, with 2s and
  with 10s, beside the same pod start with no hook server: containerd calls plugins one event at a time,
  so every pod on the node waits out what containerd gives the wedged call.
"""

import argparse
import statistics
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, Iterator

from cri_api.v1 import api_pb2

from benchmarks import slow_hook_server
from tests.support.cri_objects import container_config, pod_sandbox_config
from tests.support.hook_registration import register
from tests.support.images import BUSYBOX_REF, ImageSet, build_test_images
from tests.support.koordrp_process import KoordrpProcess
from tests.support.pods import remove_pod, runtime_spec
from tests.support.stack import start_containerd

TIMEOUT = 60.0
WAITED = 1.5
"""A create that took this long waited for the hook server."""


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


class Node:
    """One containerd with koordrp as its NRI plugin, and a hook server to register."""

    def __init__(self, stack: ExitStack, images: ImageSet, base: Path, release: str, request_timeout: str) -> None:
        self.base = base
        self.containerd = start_containerd(images, base / "containerd", release=release, nri=True, nri_request_timeout=request_timeout)
        stack.callback(self.containerd.stop)
        self.koordrp = KoordrpProcess(base, self.containerd.endpoint, nri_socket=self.containerd.paths.nri_socket)
        self.koordrp.start()
        stack.callback(self.koordrp.stop)
        self.runtime = self.containerd.runtime()
        self._stack = stack
        self._pods = 0

    def serve(self, name: str, seconds: float, timeout: float) -> None:
        socket = str(self.base / f"{name}.sock")
        self._stack.enter_context(slow_hook_server.running(socket, seconds))
        register(self.base / "hookserver.d", name, socket, ["PreCreateContainer"], "Ignore", **{"timeout-seconds": timeout})
        self.koordrp.wait_for_registrations(f"{name}.json")

    def unregister(self, name: str) -> None:
        (self.base / "hookserver.d" / f"{name}.json").unlink()
        self.koordrp.wait_for_servers(0)

    def pod(self) -> tuple[str, Any]:
        self._pods += 1
        config = pod_sandbox_config(f"pod{self._pods}", log_directory=self.base / "logs" / f"pod{self._pods}")
        sandbox_id = self.runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=config), timeout=TIMEOUT).pod_sandbox_id
        self._stack.callback(remove_pod, self.runtime, sandbox_id)
        return sandbox_id, config

    def create(self, pod: tuple[str, Any], name: str) -> str:
        sandbox_id, config = pod
        container = container_config(name, image=BUSYBOX_REF, command=["sleep", "3600"])
        request = api_pb2.CreateContainerRequest(pod_sandbox_id=sandbox_id, config=container, sandbox_config=config)
        container_id: str = self.runtime.CreateContainer(request, timeout=TIMEOUT).container_id
        return container_id

    def start(self, container_id: str) -> None:
        self.runtime.StartContainer(api_pb2.StartContainerRequest(container_id=container_id), timeout=TIMEOUT)

    def spec_shares(self, container_id: str) -> int:
        shares: int = runtime_spec(self.runtime, container_id)["linux"]["resources"].get("cpu", {}).get("shares", 0)
        return shares

    def cgroup_shares(self, container_id: str) -> int:
        path = runtime_spec(self.runtime, container_id)["linux"]["cgroupsPath"]
        try:
            return int(Path(f"/sys/fs/cgroup/cpu{path}/cpu.shares").read_text())
        except (OSError, ValueError):
            return 0


def paced(count: int, apart: float) -> Iterator[int]:
    """``count`` indexes, each handed out ``apart`` seconds after the one before (start to start)."""
    first = time.monotonic()
    for index in range(count):
        time.sleep(max(0.0, first + index * apart - time.monotonic()))
        yield index


def timed(action: Callable[[], object]) -> float:
    started = time.monotonic()
    action()
    return time.monotonic() - started


def until(condition: Callable[[], bool], since: float, bound: float = 30.0) -> float | None:
    """Seconds from ``since`` until ``condition`` holds (looked at every 10 ms); None after ``bound``."""
    while not condition():
        if time.monotonic() - since > bound:
            return None
        time.sleep(0.01)
    return time.monotonic() - since


def creates(node: Node, count: int, apart: float, prefix: str) -> list[float]:
    pod = node.pod()
    return [timed(lambda: node.create(pod, f"{prefix}{index}")) for index in paced(count, apart)]


def report_creates(what: str, times: list[float], baseline: float) -> None:
    waited = sum(1 for seconds in times if seconds >= WAITED)
    print(f"  {what}: {', '.join(ms(seconds) for seconds in times)}")
    print(f"    {waited} of {len(times)} waited ≥ {WAITED:g} s; p50 {ms(statistics.median(times))} (no hook server: {ms(baseline)})")


def late_answer(node: Node) -> None:
    pod = node.pod()
    started = time.monotonic()
    container_id = node.create(pod, "first")
    answered = time.monotonic() - started
    node.start(container_id)
    in_spec = until(lambda: node.spec_shares(container_id) == slow_hook_server.SHARES, started)
    in_cgroup = until(lambda: node.cgroup_shares(container_id) == slow_hook_server.SHARES, started)
    print(
        f"  the first create's late answer: containerd answered the create after {ms(answered)}; cpu shares "
        f"{slow_hook_server.SHARES} in containerd's spec after {'never' if in_spec is None else ms(in_spec)}, "
        f"in the running container's cgroup after {'never' if in_cgroup is None else ms(in_cgroup)}"
    )


def pod_start(node: Node, name: str) -> float:
    def start() -> None:
        pod = node.pod()
        node.start(node.create(pod, name))

    return timed(start)


def stalled_pod_start(node: Node) -> tuple[float, float]:
    """Another pod's start, begun 0.5 s after a create that reaches the wedged server; and that create's time."""
    pod = node.pod()
    blocked: list[float] = []
    creating = threading.Thread(target=lambda: blocked.append(timed(lambda: node.create(pod, "blocked"))))
    creating.start()
    time.sleep(0.5)
    other = pod_start(node, "other")
    creating.join()
    return other, blocked[0]


def measure(stack: ExitStack, images: ImageSet, base: Path, release: str, args: argparse.Namespace) -> None:
    print(f"\n== containerd {release}, koordrp its NRI plugin ==")
    for request_timeout in ("2s", "10s"):
        node = Node(stack, images, base / f"{release}-{request_timeout}", release, request_timeout)
        baseline = statistics.median(creates(node, args.creates, 0.0, "bare"))
        free_start = pod_start(node, "free")
        print(f" plugin_request_timeout {request_timeout}:")
        node.serve("slow", args.delay, 10.0)
        report_creates(f"{args.creates} creates {args.apart:g} s apart, a server answering in {args.delay:g} s", creates(node, args.creates, args.apart, "c"), baseline)
        node.unregister("slow")
        if request_timeout == "2s":
            node.serve("fresh", args.delay, 10.0)  # a server not silenced yet: its first create
            late_answer(node)
            node.unregister("fresh")
        node.serve("wedged", float("inf"), 60.0)
        other, blocked = stalled_pod_start(node)
        print(
            f"  a wedged server: a create that reaches it took {ms(blocked)}; another pod's start begun 0.5 s later "
            f"took {ms(other)} (with no hook server: {ms(free_start)})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--releases", nargs="+", default=["1.7", "2.1"])
    parser.add_argument("--creates", type=int, default=8)
    parser.add_argument("--apart", type=float, default=2.0)
    parser.add_argument("--delay", type=float, default=2.5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="krp-slow-", dir="/tmp") as directory:
        base = Path(directory)
        images = build_test_images(base / "images")
        for release in args.releases:
            with ExitStack() as stack:
                measure(stack, images, base, release, args)


if __name__ == "__main__":
    main()
