"""What koordrp's NRI mode adds to a pod start, against containerd/nri's own Go stub.

    .venv/bin/python -m benchmarks.nri_starts [--rounds 260] [--settle 0.05] [--first-calls 3]

(``benchmarks/hooks.py --nri-pods N`` runs it too, after its proxy figures.) Private containerd 2.1s
with NRI enabled, one per way (a plugin is every pod's), and in each round one pod started each way
of ``WAYS``, in random order, each after the same pause (``--settle``); each round's pods are removed
after it, and one pod each way is started (and removed) before the rounds, unmeasured. A pod start is
RunPodSandbox + CreateContainer + StartContainer, called as kubelet calls them. Per way it prints:

* what it adds to a pod start over no plugin: the p50 of the per-round differences, with a 95 %
  confidence interval of that median (order statistics), and the same per phase;
* the plugin's CPU per pod start: its process CPU clock (every thread's), read after the pause
  before the pod start and again after the same pause once it started, so that what the plugin still
  does after containerd answered (a post hook, its log line) is counted; and, for a way with hooks,
  the echo hook server's CPU beside it; and per pod cycle, its removal (each pod's, after the round,
  as kubelet makes it: StopContainer, RemoveContainer, StopPodSandbox, RemovePodSandbox) measured the same way;
* koordrp's CPU per pod cycle without hook servers as a ratio to the Go stub's, and per hook call (with the
  echo server on all 7 hook points, less without, over the hook calls a cycle makes) as a ratio to the floor
  (benchmarks/floor.py: a bare grpcio client's CPU per call against a no-op server, measured first).

Then, for koordrp with hooks, restarted ``--first-calls`` times: its first hook call after it starts
(a new channel to the server) against the same hook in the next pod start, both as koordrp's own log
line times them.

The Go stub is benchmarks/nri_go_stub, built by scripts/build-go into .deps/nri-go-stub; without
it, the figures are printed without it.
"""

import argparse
import random
import re
import statistics
import subprocess
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager

from cri_api.v1 import api_pb2

from benchmarks import minimal_nri_plugin
from benchmarks.echo_hook_server import HookServerProcess
from benchmarks.floor import Floor
from benchmarks.floor import measure as measure_floor
from benchmarks.processes import running
from benchmarks.stats import median_interval, process_cpu_ns
from koordrp.hooks.types import HookType
from koordrp.defaults import DEFAULT_NRI_PLUGIN_INDEX, DEFAULT_NRI_PLUGIN_NAME
from tests.support.containerd import PROJECT_ROOT, Containerd
from tests.support.cri_objects import container_config, pod_sandbox_config
from tests.support.hook_registration import register
from tests.support.images import BUSYBOX_REF, build_test_images
from tests.support.koordrp_process import KoordrpProcess
from tests.support.pods import TIMEOUT, remove_pod
from tests.support.stack import start_containerd

GO_STUB = PROJECT_ROOT / ".deps" / "nri-go-stub"
RELEASE = "2.1"
SETTLE_SECONDS = 0.05
PHASES = ("RunPodSandbox", "CreateContainer", "StartContainer")
BASELINE = "no plugin"
WAYS = {
    BASELINE: "containerd with NRI enabled and no plugin: what the others are measured against",
    "Go stub": "benchmarks/nri_go_stub: containerd/nri's pkg/stub, empty handlers for koordrp's 11 events",
    "minimal plugin": "benchmarks/minimal_nri_plugin.py: koordrp's NRI connection layer answering at once",
    "koordrp": "koordrp as containerd's NRI plugin, no hook server registered",
    "koordrp, hooks": "the same with the echo hook server on all 7 hook points",
    "proxy": "koordrp's proxy in front of the containerd without a plugin, the echo server on all 7 hook points",
}
KOORDRP_PLUGIN = f"{DEFAULT_NRI_PLUGIN_INDEX}-{DEFAULT_NRI_PLUGIN_NAME}"
# How the stand-ins register (benchmarks/nri_go_stub/main.go's defaults, benchmarks/minimal_nri_plugin.py's).
GO_STUB_PLUGIN = "10-gostub"
MINIMAL_PLUGIN = "10-minimal"
ECHO = "echo"
# One hook call in koordrp's line of a lifecycle call: "PreRunPodSandbox@echo.json: ok 0.6 ms".
HOOK_CALL = re.compile(rf"(\w+)@{ECHO}(?:\.json)?: ok ([0-9.]+) ms")


@dataclass(frozen=True)
class Way:
    runtime: Any
    """What kubelet would call: a CRI RuntimeService stub."""
    plugin: int | None = None
    """The process whose CPU is charged to the pod start (a plugin, or koordrp's proxy)."""
    server: int | None = None
    """The echo hook server's process, for a way with hooks."""


@dataclass
class Samples:
    """Per way, one entry per round."""

    phases: dict[str, list[tuple[float, ...]]] = field(default_factory=dict)
    plugin_cpu: dict[str, list[float]] = field(default_factory=dict)
    """The plugin's CPU per pod start."""
    removal_cpu: dict[str, list[float]] = field(default_factory=dict)
    """The plugin's CPU per pod removal: with the start, a whole pod cycle."""
    server_cpu: dict[str, list[float]] = field(default_factory=dict)

    def cycle_cpu(self, way: str) -> list[float]:
        return [start + removal for start, removal in zip(self.plugin_cpu[way], self.removal_cpu[way])]

    def totals(self, way: str) -> list[float]:
        return [sum(phases) for phases in self.phases[way]]

    def phase(self, way: str, index: int) -> list[float]:
        return [phases[index] for phases in self.phases[way]]


def cpu_seconds(pid: int | None) -> float:
    return 0.0 if pid is None else process_cpu_ns(pid) / 1e9


def phased_pod_start(runtime: Any, name: str, logs: Path) -> tuple[tuple[float, ...], str, str]:
    """Seconds of RunPodSandbox, CreateContainer and StartContainer of a pod with one container; its sandbox's and
    its container's ids."""
    pod = pod_sandbox_config(name, log_directory=logs / name)
    container = container_config(name, image=BUSYBOX_REF, command=["sleep", "3600"], log_path=f"{name}.log")
    began = time.perf_counter()
    sandbox_id = runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=pod), timeout=TIMEOUT).pod_sandbox_id
    ran = time.perf_counter()
    create = api_pb2.CreateContainerRequest(pod_sandbox_id=sandbox_id, config=container, sandbox_config=pod)
    container_id = runtime.CreateContainer(create, timeout=TIMEOUT).container_id
    created = time.perf_counter()
    runtime.StartContainer(api_pb2.StartContainerRequest(container_id=container_id), timeout=TIMEOUT)
    return (ran - began, created - ran, time.perf_counter() - created), sandbox_id, container_id


def pod_name(way: str, index: int | str) -> str:
    return f"nri-{re.sub('[^a-z0-9]+', '-', way.lower())}-{index}"


def rounds(ways: dict[str, Way], count: int, settle: float, logs: Path) -> Samples:
    samples = Samples()
    for index in ["warm-up", *range(count)]:
        order = list(ways.items())
        random.shuffle(order)
        started = []
        for name, way in order:
            time.sleep(settle)
            plugin_before, server_before = cpu_seconds(way.plugin), cpu_seconds(way.server)
            phases, sandbox_id, container_id = phased_pod_start(way.runtime, pod_name(name, index), logs)
            time.sleep(settle)
            if index != "warm-up":
                samples.phases.setdefault(name, []).append(phases)
                samples.plugin_cpu.setdefault(name, []).append(cpu_seconds(way.plugin) - plugin_before)
                samples.server_cpu.setdefault(name, []).append(cpu_seconds(way.server) - server_before)
            started.append((name, way, sandbox_id, container_id))
        for name, way, sandbox_id, container_id in started:
            # The rest of the pod's cycle (its stops and removals as kubelet makes them, and their post hooks),
            # charged the same way.
            time.sleep(settle)
            plugin_before = cpu_seconds(way.plugin)
            remove_pod(way.runtime, sandbox_id, [container_id])
            time.sleep(settle)
            if index != "warm-up":
                samples.removal_cpu.setdefault(name, []).append(cpu_seconds(way.plugin) - plugin_before)
    return samples


def synchronizations(containerd: Containerd, plugin: str) -> int:
    """How often containerd has logged ``plugin`` (index-name) as connected and synchronized."""
    return containerd.paths.log.read_text(errors="replace").count(f'{plugin}\\" connected and synchronized')


def wait_for_plugin(containerd: Containerd, plugin: str, count: int = 1, timeout: float = 60.0) -> None:
    """Until containerd has taken ``plugin`` in for the ``count``-th time: from then on every pod is its."""
    deadline = time.monotonic() + timeout
    while synchronizations(containerd, plugin) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"containerd did not synchronize NRI plugin {plugin} within {timeout:g}s")
        time.sleep(0.02)


def first_hook_calls(
    koordrp: KoordrpProcess, containerd: Containerd, restarts: int, logs: Path
) -> list[tuple[str, float, float]]:
    """Per restart of ``koordrp``: its first hook call's hook, and that call's seconds and the same hook's
    in the next pod start, as koordrp's log times them."""
    found = []
    runtime = containerd.runtime()
    for restart in range(restarts):
        offset = len(koordrp.whole_log())  # its log may be rotated meanwhile
        synchronized = synchronizations(containerd, KOORDRP_PLUGIN)
        koordrp.stop()
        koordrp.start()
        wait_for_plugin(containerd, KOORDRP_PLUGIN, synchronized + 1)
        sandboxes = [phased_pod_start(runtime, pod_name("first", f"{restart}-{pod}"), logs)[1] for pod in range(2)]
        for sandbox_id in sandboxes:
            remove_pod(runtime, sandbox_id)
        calls = HOOK_CALL.findall(koordrp.whole_log()[offset:])
        if not calls:
            continue
        hook, first = calls[0]
        later = next((seconds for called, seconds in calls[1:] if called == hook), None)
        if later is not None:
            found.append((hook, float(first) / 1e3, float(later) / 1e3))
    return found


def ms(seconds: float, sign: bool = False) -> str:
    return f"{seconds * 1e3:{'+' if sign else ''}.1f} ms"


def paired(samples: Samples, way: str, values: Callable[[Samples, str], list[float]]) -> list[float]:
    return [value - base for value, base in zip(values(samples, way), values(samples, BASELINE))]


def report(samples: Samples, rounds_done: int, version: str, settle: float) -> None:
    print(
        f"\n== containerd {version}, NRI enabled: {rounds_done} pod starts each way, one each way per round "
        f"in random order, each after a {settle:g} s pause =="
    )
    measured = [way for way in WAYS if way in samples.phases]
    for way in measured:
        print(f"   {way:<15} {WAYS[way]}")
    base_phases = ", ".join(f"{phase} {ms(statistics.median(samples.phase(BASELINE, i)))}" for i, phase in enumerate(PHASES))
    print(f"  {BASELINE}: pod start p50 {ms(statistics.median(samples.totals(BASELINE)))} ({base_phases})")
    print("  added to a pod start over no plugin (p50 of the per-round differences; 95 % CI), per phase; CPU per pod start (p50)")
    for way in measured[1:]:
        added = paired(samples, way, Samples.totals)
        low, high = median_interval(added)
        per_phase = ", ".join(
            f"{phase} {ms(statistics.median(paired(samples, way, lambda s, w: s.phase(w, i))), sign=True)}"
            for i, phase in enumerate(PHASES)
        )
        cpu = f"{'koordrp' if way == 'proxy' else 'plugin'} CPU {ms(statistics.median(samples.plugin_cpu[way]))}"
        if any(samples.server_cpu[way]):
            cpu += f" (+{ms(statistics.median(samples.server_cpu[way]))} in the echo server)"
        print(f"    {way:<15} {ms(statistics.median(added), sign=True)} (CI {ms(low, sign=True)} … {ms(high, sign=True)});")
        print(f"    {'':<15} {per_phase}; {cpu}; per pod cycle {ms(statistics.median(samples.cycle_cpu(way)))}")


def report_per_cycle(samples: Samples, floor: Floor, hook_calls: float) -> None:
    """koordrp's CPU per pod cycle against the Go stub's, and per hook call against the floor (``hook_calls`` a cycle)."""
    print("  CPU per pod cycle (start, then stop and removal as kubelet makes them), p50 of the rounds:")
    koordrp = samples.cycle_cpu("koordrp")
    if "Go stub" in samples.plugin_cpu:
        ratio = statistics.median(koordrp) / statistics.median(samples.cycle_cpu("Go stub"))
        print(
            f"    koordrp, no hook server: {ms(statistics.median(koordrp))}, {ratio:.2f}x the Go stub's "
            f"{ms(statistics.median(samples.cycle_cpu('Go stub')))} (target 1.30x: {'met' if ratio <= 1.3 else 'NOT met'})"
        )
    added = [hooked - idle for hooked, idle in zip(samples.cycle_cpu("koordrp, hooks"), koordrp)]
    per_call = statistics.median(added) / hook_calls
    verdict = "met" if per_call <= 1.5 * floor.future_and_callback else "NOT met"
    print(
        f"    a hook call: (koordrp, hooks - koordrp) {ms(statistics.median(added))} over the {hook_calls:g} hook calls of a "
        f"cycle = {ms(per_call)}, {floor.ratio(per_call)} (target 1.50x: {verdict})"
    )


def report_first_calls(found: list[tuple[str, float, float]], restarts: int) -> None:
    if not found:
        print(f"  first hook call after koordrp starts: none found in koordrp's log over {restarts} restarts")
        return
    hooks = sorted({hook for hook, _, _ in found})
    firsts = " ".join(ms(first) for _, first, _ in found)
    nexts = " ".join(ms(later) for _, _, later in found)
    print(f"  first hook call after koordrp (with hooks) starts, {len(found)} restarts ({', '.join(hooks)}, koordrp's log):")
    print(f"    first: {firsts}; the same hook in the next pod start: {nexts}")


def measure(base: Path, count: int, settle: float = SETTLE_SECONDS, restarts: int = 3, floor: Floor | None = None) -> None:
    """Starts everything under ``base``, runs ``count`` rounds, prints the figures, stops everything. ``floor``: the
    one measured earlier in the run (else it is measured first)."""
    if floor is None:
        floor = measure_floor()
        print(floor.line())
    images = build_test_images(base / "nri-images")
    every_hook = [hook.value for hook in HookType]
    with ExitStack() as stack:

        def containerd(name: str) -> Containerd:
            started = start_containerd(images, base / name, release=RELEASE, nri=True)
            stack.callback(started.stop)
            return started

        def echo_server(name: str) -> HookServerProcess:
            server = HookServerProcess(base / f"{name}.sock")
            stack.callback(server.stop)
            return server

        def plugin(process: ContextManager["subprocess.Popen[bytes]"], runtime: Containerd, name: str) -> Way:
            """A plugin's process, once ``runtime`` has taken it in as ``name`` (index-name)."""
            pid = stack.enter_context(process).pid
            wait_for_plugin(runtime, name)
            return Way(runtime.runtime(), pid)

        def koordrp(name: str, runtime: Containerd, server: HookServerProcess | None, nri: bool = True) -> KoordrpProcess:
            """koordrp in front of ``runtime``, or its NRI plugin, with ``server`` on every hook point."""
            process = KoordrpProcess(base / name, runtime.endpoint, nri_socket=runtime.paths.nri_socket if nri else None)
            process.base.mkdir(parents=True)
            if server is not None:
                register(process.base / "hookserver.d", ECHO, str(server.socket), every_hook)
            process.start()
            stack.callback(process.stop)
            process.wait_for_servers(0 if server is None else 1)
            if nri:
                wait_for_plugin(runtime, KOORDRP_PLUGIN)
            return process

        bare = containerd("cd-bare")
        ways = {BASELINE: Way(bare.runtime())}
        if GO_STUB.exists():
            stub = containerd("cd-go-stub")
            ways["Go stub"] = plugin(running([str(GO_STUB), f"--nri-socket={stub.paths.nri_socket}"]), stub, GO_STUB_PLUGIN)
        else:
            print(f"Go NRI stub: {GO_STUB} is missing (scripts/build-go builds it); measured without it")
        minimal = containerd("cd-minimal")
        ways["minimal plugin"] = plugin(minimal_nri_plugin.running(str(minimal.paths.nri_socket)), minimal, MINIMAL_PLUGIN)
        idle = containerd("cd-koordrp")
        ways["koordrp"] = Way(idle.runtime(), koordrp("koordrp", idle, None).pid)
        plugged = containerd("cd-koordrp-hooks")
        nri_server = echo_server("echo-nri")
        hooked = koordrp("koordrp-hooks", plugged, nri_server)
        ways["koordrp, hooks"] = Way(plugged.runtime(), hooked.pid, nri_server.process.pid)
        proxy_server = echo_server("echo-proxy")
        proxy = koordrp("proxy", bare, proxy_server, nri=False)
        ways["proxy"] = Way(proxy.runtime(stack.enter_context(proxy.channel())), proxy.pid, proxy_server.process.pid)

        version = bare.runtime().Version(api_pb2.VersionRequest(), timeout=TIMEOUT).runtime_version
        samples = rounds(ways, count, settle, base / "nri-logs")
        hook_calls = sum(nri_server.counts().values()) / (count + 1)  # the warm-up's pods too
        report(samples, count, version, settle)
        report_per_cycle(samples, floor, hook_calls)
        if restarts:
            report_first_calls(first_hook_calls(hooked, plugged, restarts, base / "nri-logs"), restarts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=260, help="pod starts each way, one each way per round")
    parser.add_argument("--settle", type=float, default=SETTLE_SECONDS, help="seconds of pause before and after each pod start")
    parser.add_argument("--first-calls", type=int, default=3, help="restarts of koordrp with hooks, for its first hook call")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="krp-nri-", dir="/tmp") as scratch:
        measure(Path(scratch), args.rounds, args.settle, args.first_calls)


if __name__ == "__main__":
    main()
