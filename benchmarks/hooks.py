"""koordrp's own cost on the hook path, paired per round with the same calls made without it.

Starts a private containerd, ``twistd -n koordrp`` in front of it, a minimal grpcio pass-through
(benchmarks/minimal_passthrough.py: what any grpcio proxy pays) and echo hook servers (processes of
their own answering a copy of each request, as koordlet does) on every hook point. With one server,
then two chained, it prints:

* **one hook stage**: per round, in random order and each after the same pause, the calls of ``ROWS``:
  UpdateContainerResources on pod H (hooks run) and pod S (labelled to skip them), directly, through
  koordrp and through the minimal pass-through; StartContainer of the running containers, which
  containerd refuses at once (a hooked call whose time is nearly all koordrp's and the hook's);
  ContainerStatus, passed through; the hook servers alone, called by a plain client with a request
  of the same shape; and one call of the floor's client (``FLOOR_PACED``). From each round:

  - koordrp's share of a hook stage = hooked - skipped - the servers alone;
  - koordrp's CPU per hook stage = its CPU (its process CPU clock: every thread's) during the hooked call
    minus during the skipped one, beside the CPU this process spends calling the servers alone; per
    hook call (over the servers chained), as a ratio to the floor: benchmarks/floor.py, a bare grpcio
    client's CPU per call against a no-op server, measured first in the same run, back to back; and
    as a ratio to the paced floor, the same client's CPU for one call (``FLOOR_PACED``) made in the
    rounds like every other call, after the same pause: each of koordrp's calls, too, comes alone to
    a process whose caches the other processes' work has emptied meanwhile, and a call costs any
    client more then than back to back;
  - a skipped call over a pass-through = the skipped call - the same call through the minimal
    pass-through; and, as this benchmark first measured it, (skipped - direct) - (ContainerStatus through
    koordrp - directly), which compares with a different call's pass-through;
* **NRI mode** (``--nri-pods``): benchmarks/nri_starts.py's pod starts on containerd 2.1 with NRI, against
  containerd/nri's Go stub.
* **pod start**: RunPodSandbox + CreateContainer + StartContainer, directly and through koordrp, one
  pod each way per round in random order; the ratio of the p50 sums. Twice: back to back, and each
  pod after a pause (``--pod-pause``), as pods start on a node. containerd's StartContainer takes
  ~21 ms or ~31 ms on this VM, the slower the longer containerd was idle before it; back to back,
  every millisecond koordrp adds before Start makes the slow one likelier, so that run's ratio says
  as much about containerd as about koordrp.

To compare commits on one machine in one run, ``--other LABEL=TWISTD`` (repeatable) also measures the
koordrp another checkout's virtualenv runs (e.g. ``--other 3a2cb84=../old/.venv/bin/twistd``), in
front of the same containerd, on pods of its own, its calls shuffled into the same rounds; the
figures of each koordrp are printed, then side by side. A koordrp run from this benchmark's own
virtualenv is 0.1-0.2 ms faster per call on a small VM than the same code run from another
virtualenv (most likely it shares the libraries' pages with the benchmark and the minimal
pass-through). ``--other-checkout LABEL=DIR`` runs another checkout's code with this virtualenv's
interpreter and libraries (DIR first on its ``PYTHONPATH``), so that only the code differs: the way
to compare commits whose dependencies are the same (benchmarks/README.md, "Comparing two commits").

    .venv/bin/python -m benchmarks.hooks [--pods 40] [--rounds 300] [--servers 1 2] [--pod-pause 0.5] [--nri-pods 40]
        [--other LABEL=TWISTD ...] [--other-checkout LABEL=DIR ...]
"""

import argparse
import os
import random
import statistics
import tempfile
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
from cri_api.v1 import api_pb2, api_pb2_grpc

from benchmarks import minimal_passthrough, nri_starts
from benchmarks.echo_hook_server import HookServerProcess
from benchmarks.floor import CallingBack, Floor, no_op_server
from benchmarks.floor import measure as measure_floor
from benchmarks.floor import request as floor_request
from benchmarks.stats import quantile, process_cpu_ns
from koordrp.api.cri.v1 import api_pb2 as koordrp_cri
from koordrp.api.runtime.v1alpha1 import api_pb2_grpc as hook_grpc
from koordrp.cri import translate
from koordrp.hooks.messages import ContainerHookRequest, folded_update, placed_in_pod
from koordrp.hooks.types import HookType
from koordrp.defaults import DEFAULT_SKIP_HOOK_KEY, DEFAULT_SKIP_HOOK_VALUE
from tests.support.cri_objects import container_config, linux_resources, pod_sandbox_config
from tests.support.hook_registration import register
from tests.support.images import BUSYBOX_REF
from tests.support.koordrp_process import KoordrpProcess
from tests.support.pods import TIMEOUT, remove_pod, start_container
from tests.support.stack import containerd_and_koordrp

# A post hook or the call's log line may still be running in koordrp when its caller has the answer:
# waiting this long before reading koordrp's CPU time charges it to the call that caused it. Every
# call, whichever way it goes, comes after the same pause: threads that slept longer wake more
# slowly, and the comparisons must not depend on it.
SETTLE_SECONDS = 0.003

TARGETS = {
    "share p50": 0.2e-3,
    "share p99": 1.5e-3,
    "cpu": 0.3e-3,
    "skipped": 0.2e-3,
    "pod start": 1.08,
    "per call": 1.2,
}


ROWS = {
    "update direct H": "UpdateContainerResources, pod H's container, containerd directly",
    "update hooked": "the same through koordrp: its pre hook stage runs",
    "update direct S": "UpdateContainerResources, pod S's container (labelled to skip hooks), directly",
    "update skipped": "the same through koordrp: intercepted, hooks skipped",
    "update minimal": "the same through the minimal grpcio pass-through",
    "start hooked": "StartContainer of H's running container through koordrp: its pre hook stage runs, containerd refuses at once",
    "start skipped": "the same for S's container: intercepted, hooks skipped",
    "start minimal": "the same through the minimal grpcio pass-through",
    "status direct": "ContainerStatus of S's container, directly",
    "status koordrp": "the same through koordrp: passed through",
    "status minimal": "the same through the minimal grpcio pass-through",
}
"""The calls of each round for each koordrp measured (on pods H and S made through it), in random order with
``SERVERS_ALONE`` and ``FLOOR_PACED``."""
SERVERS_ALONE = "servers alone"
SERVERS_ALONE_WHAT = "a plain client calling each hook server in turn, with a request of the same shape"
FLOOR_PACED = "floor paced"
FLOOR_PACED_WHAT = "the floor's bare client (.future() and a done-callback) calling the no-op server once"
HEAD = "HEAD"
"""The label of this checkout's koordrp; ``--other LABEL=TWISTD`` names the others."""


@dataclass
class Samples:
    """Per round: seconds of each call, and koordrp's CPU seconds meanwhile."""

    seconds: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)
    client_cpu: list[float] = field(default_factory=list)
    """The CPU time this process spent calling the hook servers alone: what a plain client pays."""
    floor_cpu: list[float] = field(default_factory=list)
    """The CPU time this process spent on one call of the floor's client (``FLOOR_PACED``), paced as every call is."""

    def add(self, label: str, seconds: float, cpu: float) -> None:
        self.seconds.setdefault(label, []).append(seconds)
        self.cpu.setdefault(label, []).append(cpu)

    def paired(self, combine: Callable[..., float], *labels: str, cpu: bool = False) -> list[float]:
        series = self.cpu if cpu else self.seconds
        return [combine(*values) for values in zip(*(series[label] for label in labels))]


class Measured:
    """Times a call, and the CPU time koordrp spent meanwhile (about none for a call that bypasses it)."""

    def __init__(self, pid: int) -> None:
        self._pid = pid

    def __call__(self, call: Callable[[], object], own: bool = False) -> tuple[float, float, float]:
        """Seconds, koordrp's CPU seconds and, with ``own``, this process's CPU seconds."""
        time.sleep(SETTLE_SECONDS)
        cpu_before = process_cpu_ns(self._pid)
        own_before = process_cpu_ns(os.getpid()) if own else 0
        started = time.perf_counter()
        call()
        seconds = time.perf_counter() - started
        time.sleep(SETTLE_SECONDS)
        koordrp_cpu = (process_cpu_ns(self._pid) - cpu_before) / 1e9
        # Read after the same pause as koordrp's: what grpc's threads still do once the call returned counts too.
        own_cpu = (process_cpu_ns(os.getpid()) - own_before) / 1e9 if own else 0.0
        return seconds, koordrp_cpu, own_cpu


def pod_start(runtime: Any, name: str, logs: Path) -> tuple[float, str]:
    """Seconds for RunPodSandbox + CreateContainer + StartContainer, and the sandbox id."""
    pod = pod_sandbox_config(name, log_directory=logs / name)
    container = container_config(name, image=BUSYBOX_REF, command=["sleep", "3600"], log_path=f"{name}.log")
    started = time.perf_counter()
    sandbox_id = runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=pod), timeout=TIMEOUT).pod_sandbox_id
    start_container(runtime, sandbox_id, pod, container)
    return time.perf_counter() - started, sandbox_id


def pod_starts(ways: dict[str, Any], pods: int, logs: Path, label: str, pause: float) -> dict[str, list[float]]:
    """``pods`` pod starts each way (a name and the runtime kubelet would call), one of each per round in
    random order, each after ``pause`` seconds; each pod is removed after its round."""
    times: dict[str, list[float]] = {way: [] for way in ways}
    for index in range(pods):
        order = list(ways.items())
        random.shuffle(order)
        started = []
        for way, runtime in order:
            time.sleep(pause)
            seconds, sandbox_id = pod_start(runtime, f"{label}-{way.replace(' ', '-')}-{index}-{pause:g}", logs)
            times[way].append(seconds)
            started.append((runtime, sandbox_id))
        for runtime, sandbox_id in started:
            remove_pod(runtime, sandbox_id)
    return times


@dataclass(frozen=True)
class Koordrp:
    """One koordrp measured, in front of the benchmark's containerd: this checkout's or another's (``--other``)."""

    label: str
    process: KoordrpProcess
    runtime: Any
    hooked: "Pod"
    skipped: "Pod"
    """Pods H and S, made through it (so that its store knows them); S is labelled to skip hooks."""


@dataclass(frozen=True)
class Pod:
    """A pod with one running container, made through koordrp (so koordrp's store knows it)."""

    sandbox_id: str
    container_id: str
    hook_request: ContainerHookRequest
    """What koordrp sends the hook servers for an update of this container (its shape, at least)."""


def make_pod(proxied: Any, name: str, logs: Path, labels: dict[str, str]) -> Pod:
    pod = pod_sandbox_config(name, log_directory=logs / name, labels=labels)
    container = container_config(name, image=BUSYBOX_REF, command=["sleep", "3600"], log_path=f"{name}.log")
    run = api_pb2.RunPodSandboxRequest(config=pod)
    sandbox_id = proxied.RunPodSandbox(run, timeout=TIMEOUT).pod_sandbox_id
    container_id = start_container(proxied, sandbox_id, pod, container)
    create = api_pb2.CreateContainerRequest(pod_sandbox_id=sandbox_id, config=container, sandbox_config=pod)
    # The same bytes kubelet would send, read as koordrp reads them.
    pod_request = translate.pod_hook_request(koordrp_cri.RunPodSandboxRequest.FromString(run.SerializeToString()))
    created = koordrp_cri.CreateContainerRequest.FromString(create.SerializeToString())
    update = koordrp_cri.UpdateContainerResourcesRequest.FromString(update_request(container_id, 0).SerializeToString())
    stored = placed_in_pod(translate.container_hook_request(created), pod_request)
    updated = translate.UpdateContainerResources(update)
    return Pod(sandbox_id, container_id, folded_update(stored, container_id, updated.resources(), updated.annotations()))


def update_request(container_id: str, index: int) -> Any:
    # Alternate the value, so that every update is one the runtime really makes.
    return api_pb2.UpdateContainerResourcesRequest(
        container_id=container_id, linux=linux_resources(cpu_shares=1024 + index % 2)
    )


def hook_stage_rounds(
    direct: Any, minimal: Any, koordrps: list[Koordrp], servers: list[str], rounds: int, floor_client: CallingBack
) -> dict[str, Samples]:
    """Per koordrp, its samples of ``ROWS`` (and everyone's of the servers alone and of the floor's client); one round
    makes each call once, in random order, and charges each call the CPU of the koordrp it is about."""
    stubs = [hook_grpc.RuntimeHookServiceStub(grpc.insecure_channel(f"unix:{socket}")) for socket in servers]
    request = koordrps[0].hooked.hook_request
    samples = {koordrp.label: Samples() for koordrp in koordrps}
    meters = {koordrp.label: Measured(koordrp.process.pid) for koordrp in koordrps}

    def servers_alone() -> None:
        for stub in stubs:
            stub.PreUpdateContainerResourcesHook(request, timeout=TIMEOUT)

    sent = floor_request()
    for index in range(rounds):
        calls: dict[tuple[str, str], Callable[[], object]] = {
            (HEAD, SERVERS_ALONE): servers_alone,
            (HEAD, FLOOR_PACED): lambda: floor_client.call(sent),
        }
        for koordrp in koordrps:
            calls.update(((koordrp.label, row), call) for row, call in round_calls(direct, minimal, koordrp, index).items())
        order = list(calls)
        random.shuffle(order)
        for label, row in order:
            own = row in (SERVERS_ALONE, FLOOR_PACED)
            seconds, cpu, own_cpu = meters[label](calls[label, row], own=own)
            if own:
                # What a plain client pays for the same hook calls, or for the floor's (this process's CPU: no
                # koordrp in it), each after the same pause as koordrp's calls.
                for measured in samples.values():
                    measured.add(row, seconds, 0.0)
                    (measured.client_cpu if row == SERVERS_ALONE else measured.floor_cpu).append(own_cpu)
            else:
                samples[label].add(row, seconds, cpu)
    return samples


def round_calls(direct: Any, minimal: Any, koordrp: Koordrp, index: int) -> dict[str, Callable[[], object]]:
    """The calls of ``ROWS``, about ``koordrp``'s pods."""
    proxied, hooked, skipped = koordrp.runtime, koordrp.hooked, koordrp.skipped
    return {
        "update direct H": lambda: direct.UpdateContainerResources(update_request(hooked.container_id, index)),
        "update hooked": lambda: proxied.UpdateContainerResources(update_request(hooked.container_id, index)),
        "update direct S": lambda: direct.UpdateContainerResources(update_request(skipped.container_id, index)),
        "update skipped": lambda: proxied.UpdateContainerResources(update_request(skipped.container_id, index)),
        "update minimal": lambda: minimal.UpdateContainerResources(update_request(skipped.container_id, index)),
        "start hooked": lambda: refused_start(proxied, hooked),
        "start skipped": lambda: refused_start(proxied, skipped),
        "start minimal": lambda: refused_start(minimal, skipped),
        "status direct": lambda: direct.ContainerStatus(status_request(skipped)),
        "status koordrp": lambda: proxied.ContainerStatus(status_request(skipped)),
        "status minimal": lambda: minimal.ContainerStatus(status_request(skipped)),
    }


def refused_start(runtime: Any, pod: Pod) -> None:
    """Start a running container: containerd refuses at once, so the call's time is nearly all koordrp's."""
    try:
        runtime.StartContainer(api_pb2.StartContainerRequest(container_id=pod.container_id), timeout=TIMEOUT)
    except grpc.RpcError as error:
        if "RUNNING" not in (error.details() or ""):
            raise
    else:
        raise AssertionError("containerd started a running container")


def status_request(pod: Pod) -> Any:
    return api_pb2.ContainerStatusRequest(container_id=pod.container_id)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def verdict(value: float, target_key: str) -> str:
    target = TARGETS[target_key]
    shown = f"{target:.2f}x" if target_key in ("pod start", "per call") else ms(target)
    return f"(target {shown}: {'met' if value <= target else 'NOT met'})"


def report_pod_start(direct: list[float], proxied: list[float], alone: float, passthrough: float, pause: float) -> None:
    d50, k50 = statistics.median(direct), statistics.median(proxied)
    when = "back to back" if not pause else f"each after a {pause:g} s pause"
    print(f"  pod start, {len(direct)} pods each way, {when}: direct p50 {ms(d50)}, koordrp p50 {ms(k50)}, added {ms(k50 - d50)}")
    print(f"  ratio of the p50 sums: {k50 / d50:.3f} {verdict(k50 / d50, 'pod start')}")
    least = 3 * alone + 3 * passthrough
    print(f"  the least a proxy with hooks adds (3 pre stages' servers alone + 3 pass-through costs): +{ms(least)}; beyond it: {ms(k50 - d50 - least)}")


@dataclass(frozen=True)
class Figures:
    """The p50s of one koordrp's rounds, compared between koordrps."""

    skipped_over_passthrough: float
    quick_skipped_over_passthrough: float
    skipped_against_status: float
    cpu_per_hook_stage: float
    quick_cpu_per_hook_stage: float
    passthrough_over_direct: float
    passthrough_over_minimal: float
    passthrough_cpu: float
    servers_alone: float


COMPARED = {
    "skipped_over_passthrough": "intercepted, hooks skipped, over a pass-through (update skipped - update minimal)",
    "quick_skipped_over_passthrough": "  the same, on a quick call (start skipped - start minimal)",
    "skipped_against_status": "  against ContainerStatus ((update skipped - direct S) - (status koordrp - status direct))",
    "cpu_per_hook_stage": "koordrp CPU per hook stage (CPU of update hooked - of update skipped)",
    "quick_cpu_per_hook_stage": "  the same, on a quick call (CPU of start hooked - of start skipped)",
    "passthrough_over_direct": "a pass-through call over direct (status koordrp - status direct)",
    "passthrough_over_minimal": "  over the minimal pass-through (status koordrp - status minimal)",
    "passthrough_cpu": "koordrp CPU per pass-through call (status koordrp)",
}


def report_rounds(label: str, samples: Samples, floor: Floor, servers: int) -> Figures:
    """Prints the figures of one koordrp's hook stage (``servers`` hook calls); returns them for the comparison and
    the pod start."""
    print(f"  koordrp {label}")
    print(f"  {'':<18}{'p50':>11}{'p99':>11}{'koordrp CPU':>13}")
    for row, what in [*ROWS.items(), (SERVERS_ALONE, SERVERS_ALONE_WHAT), (FLOOR_PACED, FLOOR_PACED_WHAT)]:
        seconds, cpu_seconds = samples.seconds[row], samples.cpu[row]
        print(
            f"  {row:<18}{ms(statistics.median(seconds)):>11}{ms(quantile(seconds, 0.99)):>11}"
            f"{ms(statistics.median(cpu_seconds)):>13}   {what}"
        )
    share = samples.paired(lambda hooked, skipped, alone: hooked - skipped - alone, "update hooked", "update skipped", SERVERS_ALONE)
    quick_share = samples.paired(lambda hooked, skipped, alone: hooked - skipped - alone, "start hooked", "start skipped", SERVERS_ALONE)
    cpu = samples.paired(lambda hooked, skipped: hooked - skipped, "update hooked", "update skipped", cpu=True)
    quick_cpu = samples.paired(lambda hooked, skipped: hooked - skipped, "start hooked", "start skipped", cpu=True)
    over_same = samples.paired(lambda skipped, minimal: skipped - minimal, "update skipped", "update minimal")
    quick_over_same = samples.paired(lambda skipped, minimal: skipped - minimal, "start skipped", "start minimal")
    over_status = samples.paired(
        lambda skipped, direct, through, status: (skipped - direct) - (through - status),
        "update skipped", "update direct S", "status koordrp", "status direct",
    )
    passthrough = samples.paired(lambda through, status: through - status, "status koordrp", "status direct")
    over_minimal = samples.paired(lambda through, status: through - status, "status koordrp", "status minimal")
    print("  per round (differences of the calls of one round):")
    figure("koordrp's share of a hook stage", share, "share p50", "update hooked - update skipped - servers alone")
    figure("", share, "share p99", None, 0.99)
    figure("  the same, on a quick call", quick_share, "share p50", "start hooked - start skipped - servers alone")
    figure("", quick_share, "share p99", None, 0.99)
    figure("koordrp CPU per hook stage", cpu, "cpu", "CPU of update hooked - of update skipped")
    figure("  the same, on a quick call", quick_cpu, "cpu", "CPU of start hooked - of start skipped")
    paced = statistics.median(samples.floor_cpu)
    for name, stage in (("koordrp CPU per hook call", cpu), ("  the same, on a quick call", quick_cpu)):
        per_call = statistics.median(stage) / servers
        print(f"    {name:<36}p50 {ms(per_call):>10} = {floor.ratio(per_call)} {verdict(per_call / floor.future_and_callback, 'per call')}")
        print(f"    {'':<36}{'':>14} = {per_call / paced:.2f}x the paced floor {verdict(per_call / paced, 'per call')}")
    figure("the floor, paced", samples.floor_cpu, None, "this process, one call of the floor's client (floor paced)")
    figure("a plain client's CPU, same calls", samples.client_cpu, None, "this process, calling the servers alone")
    figure("skipped over a pass-through", over_same, "skipped", "update skipped - update minimal")
    figure("  the same, on a quick call", quick_over_same, "skipped", "start skipped - start minimal")
    figure("  against ContainerStatus", over_status, None, "(update skipped - direct S) - (status koordrp - status direct)")
    figure("a pass-through over direct", passthrough, None, "status koordrp - status direct")
    figure("  over the minimal pass-through", over_minimal, None, "status koordrp - status minimal")
    return Figures(
        skipped_over_passthrough=statistics.median(over_same),
        quick_skipped_over_passthrough=statistics.median(quick_over_same),
        skipped_against_status=statistics.median(over_status),
        cpu_per_hook_stage=statistics.median(cpu),
        quick_cpu_per_hook_stage=statistics.median(quick_cpu),
        passthrough_over_direct=statistics.median(passthrough),
        passthrough_over_minimal=statistics.median(over_minimal),
        passthrough_cpu=statistics.median(samples.cpu["status koordrp"]),
        servers_alone=statistics.median(samples.seconds[SERVERS_ALONE]),
    )


def report_comparison(figures: dict[str, Figures]) -> None:
    """The p50s of every koordrp measured side by side, from the same rounds."""
    labels = list(figures)
    print("  side by side, p50s of the same rounds:")
    print(f"    {'':<92}" + "".join(f"{label:>12}" for label in labels))
    for name, what in COMPARED.items():
        print(f"    {what:<92}" + "".join(f"{ms(getattr(figures[label], name)):>12}" for label in labels))


def figure(name: str, values: list[float], target: str | None, how: str | None, fraction: float = 0.5) -> None:
    value = statistics.median(values) if fraction == 0.5 else quantile(values, fraction)
    text = f"    {name:<36}p{round(fraction * 100)} {ms(value):>10}"
    if target is not None:
        text += f" {verdict(value, target)}"
    if how is not None:
        text += f"   {how}"
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pods", type=int, default=40, help="pod starts each way, per number of hook servers (0: none)")
    parser.add_argument("--rounds", type=int, default=300, help="rounds of the hook stage measurement")
    parser.add_argument(
        "--pod-pause", type=float, default=0.5, help="seconds before each pod start of the second pod start run"
    )
    parser.add_argument("--servers", type=int, nargs="+", default=[1, 2], help="numbers of chained hook servers")
    parser.add_argument(
        "--nri-pods", type=int, default=40, help="pod starts each way of benchmarks/nri_starts.py (0: none)"
    )
    parser.add_argument(
        "--other",
        action="append",
        default=[],
        metavar="LABEL=TWISTD",
        help="also measure the koordrp this twistd runs (e.g. an older checkout's .venv/bin/twistd), in the same rounds",
    )
    parser.add_argument(
        "--other-checkout",
        action="append",
        default=[],
        metavar="LABEL=DIR",
        help="also measure the koordrp of the checkout in DIR, run by this virtualenv's twistd, in the same rounds",
    )
    args = parser.parse_args()
    floor = measure_floor()  # first, while nothing else runs
    print(floor.line())
    with tempfile.TemporaryDirectory(prefix="krp-bench-", dir="/tmp") as scratch, ExitStack() as stack:
        base = Path(scratch)
        echo_servers = [stack.enter_context(running(base / f"echo-{n}.sock")) for n in range(max(args.servers))]
        containerd, proxy = stack.enter_context(containerd_and_koordrp(base))
        processes = {HEAD: proxy}
        others = [
            (label, OtherKoordrp(base / f"other-{label}", containerd.endpoint, twistd=twistd))
            for label, _, twistd in (other.partition("=") for other in args.other)
        ]
        others += [
            (label, OtherKoordrp(base / f"other-{label}", containerd.endpoint, environ=checkout_first(checkout)))
            for label, _, checkout in (other.partition("=") for other in args.other_checkout)
        ]
        for label, other in others:
            other.base.mkdir()
            stack.callback(other.stop)
            other.start()
            processes[label] = other
        listen = str(base / "minimal.sock")
        stack.enter_context(minimal_passthrough.running(listen, containerd.endpoint.removeprefix("unix://")))
        minimal = api_pb2_grpc.RuntimeServiceStub(stack.enter_context(grpc.insecure_channel(f"unix:{listen}")))
        koordrps = [
            made_koordrp(label, process, stack.enter_context(process.channel()), base / "logs")
            for label, process in processes.items()
        ]
        floor_socket = base / "no-op.sock"
        stack.enter_context(no_op_server(floor_socket))
        floor_channel = stack.enter_context(grpc.insecure_channel(f"unix:{floor_socket}"))
        floor_client = CallingBack(hook_grpc.RuntimeHookServiceStub(floor_channel).PreUpdateContainerResourcesHook)
        measure(args, containerd.runtime(), minimal, koordrps, echo_servers, base / "logs", floor, floor_client)
        if args.nri_pods:
            nri_starts.measure(base / "nri", args.nri_pods, floor=floor)


def checkout_first(checkout: str) -> dict[str, str]:
    """The environment in which this virtualenv's twistd runs the koordrp of ``checkout`` (a directory)."""
    if not checkout:
        raise SystemExit("--other-checkout: give LABEL=DIR")
    directory = Path(checkout).resolve()
    if not (directory / "koordrp" / "__init__.py").is_file():
        raise SystemExit(f"--other-checkout: {directory} is not a koordrp checkout")
    return {"PYTHONPATH": os.pathsep.join([str(directory), *filter(None, [os.environ.get("PYTHONPATH")])])}


class OtherKoordrp(KoordrpProcess):
    """Another checkout's koordrp: an older one lacks options newer ones have, so it gets only those every
    koordrp has (its state, if it keeps one, goes where its defaults say, under its own directory)."""

    def argv(self) -> list[str]:
        return [argument for argument in super().argv() if not argument.startswith("--state-dir=")]


def made_koordrp(label: str, process: KoordrpProcess, channel: grpc.Channel, logs: Path) -> Koordrp:
    """``process``, with pods H and S made through it."""
    runtime = process.runtime(channel)
    hooked = make_pod(runtime, f"hooked-{label}", logs, {})
    skipped = make_pod(runtime, f"skipped-{label}", logs, {DEFAULT_SKIP_HOOK_KEY: DEFAULT_SKIP_HOOK_VALUE})
    return Koordrp(label, process, runtime, hooked, skipped)




@contextmanager
def running(socket: Path) -> Iterator[HookServerProcess]:
    server = HookServerProcess(socket)
    try:
        yield server
    finally:
        server.stop()


def measure(
    args: argparse.Namespace,
    direct: Any,
    minimal: Any,
    koordrps: list[Koordrp],
    servers: list[HookServerProcess],
    logs: Path,
    floor: Floor,
    floor_client: CallingBack,
) -> None:
    every_hook = [hook.value for hook in HookType]
    for count in args.servers:
        for koordrp in koordrps:
            for index, server in enumerate(servers[:count]):
                register(koordrp.process.base / "hookserver.d", f"echo-{index}", str(server.socket), every_hook)
            koordrp.process.wait_for_servers(count)
        print(f"\n== {count} echo hook server{'s' if count > 1 else ''} on every hook point, chained ==")
        sockets = [str(s.socket) for s in servers[:count]]
        rounds = hook_stage_rounds(direct, minimal, koordrps, sockets, args.rounds, floor_client)
        print(f"one hook stage: UpdateContainerResources, {args.rounds} rounds")
        figures = {label: report_rounds(label, samples, floor, count) for label, samples in rounds.items()}
        if len(figures) > 1:
            report_comparison(figures)
        if args.pods:
            print("pod start")
            ways = {"direct": direct, **{koordrp.label: koordrp.runtime for koordrp in koordrps}}
            for pause in (0.0, args.pod_pause):
                starts = pod_starts(ways, args.pods, logs, f"s{count}", pause)
                for label, measured in figures.items():
                    print(f"  koordrp {label}")
                    report_pod_start(starts["direct"], starts[label], measured.servers_alone, measured.passthrough_over_direct, pause)
    for koordrp in koordrps:
        for pod in (koordrp.hooked, koordrp.skipped):
            remove_pod(koordrp.runtime, pod.sandbox_id)


if __name__ == "__main__":
    main()
