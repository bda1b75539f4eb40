"""Soak: pods through koordrp for minutes, with two hook servers, kubelet's polling and config reloads.

Starts a private containerd, ``twistd -n koordrp`` in front of it and two echo hook servers, each a
process of its own and each registered by its own hookserver.d file for every hook point. Then, until
``--pods`` pods are done or ``--seconds`` are up:

* ``--workers`` threads take pods from a queue and walk each through koordrp: RunPodSandbox,
  2 x (CreateContainer + StartContainer), StopContainer x2, RemoveContainer x2, StopPodSandbox,
  RemovePodSandbox (host-network pods, busybox ``sleep 3600`` containers);
* a poller replays kubelet's periodic calls through koordrp: ListPodSandbox and ListContainers every
  second, Status every 5 s, ListContainerStats every 10 s;
* another process rewrites one hookserver.d file every 2 s with the same content, in turn by atomic
  rename, in place, and in place leaving it empty for a moment, so that koordrp's registry reloads
  under load (the empty file is refused with a warning, its last good version staying in force).

When the time is up no new pod is started; pods under way are finished and removed. Then it prints
pods per second, p50/p99 of each call, the hook calls each server received against those the
successful CRI calls imply, every distinct error, koordrp's RSS (start, peak, after) and what was
left behind.

    .venv/bin/python -m benchmarks.soak [--seconds 300] [--pods 200] [--workers 8]

Exits 1 if a call failed, a hook call was lost (or came unasked), or a pod or container was left.
containerd 1.6's own ListContainerStats race (see ``containerd_race``) is shown but does not count.
"""

import argparse
import multiprocessing
import os
import queue
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

import grpc
from cri_api.v1 import api_pb2

from benchmarks.echo_hook_server import HookServerProcess
from benchmarks.stats import quantile
from koordrp.hooks.types import HookType
from tests.support.containerd import Containerd
from tests.support.cri_objects import container_config, pod_sandbox_config
from tests.support.hook_registration import register
from tests.support.images import BUSYBOX_REF
from tests.support.koordrp_process import KoordrpProcess, cpu_seconds, rss_bytes
from tests.support.pods import TIMEOUT
from tests.support.stack import containerd_and_koordrp

T = TypeVar("T")

CONTAINERS_PER_POD = 2
LIFECYCLE = (
    "RunPodSandbox",
    "CreateContainer",
    "StartContainer",
    "StopContainer",
    "RemoveContainer",
    "StopPodSandbox",
    "RemovePodSandbox",
)
POLL_PERIODS = {"ListPodSandbox": 1.0, "ListContainers": 1.0, "Status": 5.0, "ListContainerStats": 10.0}
"""Seconds between kubelet's calls: PLEG relists every second, the runtime status check runs every
5 s and the stats provider every 10 s."""

CALL_OF_HOOK = {
    HookType.PRE_RUN_POD_SANDBOX: "RunPodSandbox",
    HookType.PRE_CREATE_CONTAINER: "CreateContainer",
    HookType.PRE_START_CONTAINER: "StartContainer",
    HookType.POST_START_CONTAINER: "StartContainer",
    HookType.POST_STOP_CONTAINER: "StopContainer",
    HookType.POST_STOP_POD_SANDBOX: "StopPodSandbox",
    HookType.PRE_UPDATE_CONTAINER_RESOURCES: "UpdateContainerResources",
}
"""The CRI call each hook point rides on (docs/hook-server.md, "The hooks"): every server registered for it gets
one call per successful CRI call. The soak never updates resources, so that hook must stay at 0."""

HOOK_SERVERS = ("a-echo", "b-echo")
REWRITTEN = HOOK_SERVERS[0]
"""The first in file-name order: the server every pre hook stage starts with."""
REWRITE_PERIOD = 2.0
REWRITE_WAYS = ("renamed over", "rewritten in place", "rewritten in place, empty for a moment")
EMPTY_FOR = 0.2
SETTLE_LIMIT = 15.0
SETTLED_AFTER = 2.0
"""Post hooks reach the servers after the CRI answer: counts that have not moved for this long are final."""
RSS_PERIOD = 0.5
RSS_TOLERANCE = 0.10


def containerd_race(method: str, error: Exception) -> bool:
    """containerd 1.6 fails a whole ListContainerStats with NOT_FOUND when a container is removed while it
    collects (containerd/containerd#10796, fixed later by #10724), without koordrp too: a few percent of
    the calls during this churn. kubelet logs it and asks again 10 s later. The answer is containerd's own,
    passed through unchanged (koordrp's own messages start with "koordrp:"), so it is shown apart and not
    counted against koordrp."""
    return (
        method == "ListContainerStats"
        and isinstance(error, grpc.Call)
        and error.code() == grpc.StatusCode.NOT_FOUND
        and (error.details() or "").startswith("failed to convert to cri containerd stats format")
    )


def describe_error(error: Exception) -> str:
    if isinstance(error, grpc.Call):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"


class Calls:
    """Latency, successes and errors of every CRI call the soak makes, from any thread.

    ``failures``: the exceptions a failed call raises (gRPC's; a Docker client's are its own)."""

    def __init__(self, failures: tuple[type[Exception], ...] = (grpc.RpcError,)) -> None:
        self._failures = failures
        self._lock = threading.Lock()
        self.seconds: dict[str, list[float]] = defaultdict(list)
        self.ok: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.containerd_races: Counter[str] = Counter()

    def make(self, method: str, call: Callable[[], T]) -> T | None:
        """``call()``'s answer, or None once its failure is recorded: one failed call must not stop the soak."""
        started = time.perf_counter()
        try:
            answer = call()
        except self._failures as error:
            self.fail(method, error)
            return None
        elapsed = time.perf_counter() - started
        with self._lock:
            self.seconds[method].append(elapsed)
            self.ok[method] += 1
        return answer

    def fail(self, what: str, error: Exception) -> None:
        kept = self.containerd_races if containerd_race(what, error) else self.errors
        with self._lock:
            kept[f"{what}: {describe_error(error)}"] += 1


# -- the load ---------------------------------------------------------------------------------------


def walk_pod(runtime: Any, calls: Calls, name: str, logs: Path) -> None:
    """One pod's whole life through koordrp."""
    started = start_pod(runtime, calls, name, logs)
    if started is not None:
        remove_pod(runtime, calls, *started)


def start_pod(runtime: Any, calls: Calls, name: str, logs: Path) -> tuple[str, list[str]] | None:
    """A pod and its CONTAINERS_PER_POD containers made and started as kubelet does: the sandbox's and
    the containers' ids. None if a call failed: what was made is then stopped and removed, the same
    way, so that a store in its path forgets it and the hook counts stay computable."""
    pod = pod_sandbox_config(name, log_directory=logs / name)
    sandbox = calls.make(
        "RunPodSandbox", lambda: runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=pod), timeout=TIMEOUT)
    )
    if sandbox is None:
        return None
    sandbox_id = sandbox.pod_sandbox_id
    containers: list[str] = []
    try:
        for index in range(CONTAINERS_PER_POD):
            config = container_config(
                f"c{index}", image=BUSYBOX_REF, command=["sleep", "3600"], log_path=f"c{index}.log"
            )
            request = api_pb2.CreateContainerRequest(pod_sandbox_id=sandbox_id, config=config, sandbox_config=pod)
            created = calls.make("CreateContainer", lambda: runtime.CreateContainer(request, timeout=TIMEOUT))
            if created is None:
                break
            containers.append(created.container_id)
            start = api_pb2.StartContainerRequest(container_id=created.container_id)
            if calls.make("StartContainer", lambda: runtime.StartContainer(start, timeout=TIMEOUT)) is None:
                break
        else:
            return sandbox_id, containers
    except BaseException:
        remove_pod(runtime, calls, sandbox_id, containers)
        raise
    remove_pod(runtime, calls, sandbox_id, containers)
    return None


def remove_pod(runtime: Any, calls: Calls, sandbox_id: str, containers: list[str]) -> None:
    for container_id in containers:
        # timeout 0 is a straight SIGKILL: sleep as PID 1 ignores SIGTERM and would hold every pod 30 s.
        stop = api_pb2.StopContainerRequest(container_id=container_id, timeout=0)
        calls.make("StopContainer", lambda: runtime.StopContainer(stop, timeout=TIMEOUT))
    for container_id in containers:
        remove = api_pb2.RemoveContainerRequest(container_id=container_id)
        calls.make("RemoveContainer", lambda: runtime.RemoveContainer(remove, timeout=TIMEOUT))
    stop_pod = api_pb2.StopPodSandboxRequest(pod_sandbox_id=sandbox_id)
    calls.make("StopPodSandbox", lambda: runtime.StopPodSandbox(stop_pod, timeout=TIMEOUT))
    remove_sandbox = api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id)
    calls.make("RemovePodSandbox", lambda: runtime.RemovePodSandbox(remove_sandbox, timeout=TIMEOUT))


def work(proxy: KoordrpProcess, pods: "queue.Queue[int]", calls: Calls, logs: Path, stop: threading.Event) -> None:
    """Walk pods from the queue until it is empty or ``stop`` is set; a pod under way is always finished."""
    with proxy.channel() as channel:
        runtime = proxy.runtime(channel)
        while not stop.is_set():
            try:
                index = pods.get_nowait()
            except queue.Empty:
                return
            try:
                walk_pod(runtime, calls, f"soak-{index}", logs)
            except Exception as error:  # a bug here must show in the figures, not end the thread quietly
                calls.fail(f"pod soak-{index}", error)


def poll(proxy: KoordrpProcess, calls: Calls, stop: threading.Event) -> None:
    """kubelet's periodic calls, each on its own period, until ``stop``."""
    with proxy.channel() as channel:
        runtime = proxy.runtime(channel)
        requests: dict[str, Callable[[], Any]] = {
            "ListPodSandbox": lambda: runtime.ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=TIMEOUT),
            "ListContainers": lambda: runtime.ListContainers(api_pb2.ListContainersRequest(), timeout=TIMEOUT),
            "Status": lambda: runtime.Status(api_pb2.StatusRequest(), timeout=TIMEOUT),
            "ListContainerStats": lambda: runtime.ListContainerStats(
                api_pb2.ListContainerStatsRequest(), timeout=TIMEOUT
            ),
        }
        due = dict.fromkeys(requests, time.monotonic())
        while not stop.is_set():
            for method, call in requests.items():
                if time.monotonic() >= due[method]:
                    calls.make(method, call)
                    # From now, not from when it was due: a slow call must not be followed by a burst.
                    due[method] = time.monotonic() + POLL_PERIODS[method]
            stop.wait(max(0.0, min(due.values()) - time.monotonic()))


def rewrite_forever(path: str, period: float, stop: Any, rewrites: Any) -> None:
    """In a process of its own: rewrite ``path`` with the content it has every ``period`` s until ``stop``.

    In turn: replaced atomically (temp file + rename: a new inode, as careful plugins do); written over
    in place at once (as an editor saves); written over in place with the file left empty for
    EMPTY_FOR s first (a slow writer: longer than koordrp's debounce, so that it does read the empty
    file and must keep the last good version in force meanwhile).
    """
    target = Path(path)
    content = target.read_bytes()
    temporary = target.with_name(f".{target.name}.tmp")
    while not stop.wait(period):
        way = rewrites.value % len(REWRITE_WAYS)
        if way == 0:
            temporary.write_bytes(content)
            os.chmod(temporary, 0o644)
            os.replace(temporary, target)
        else:
            with open(target, "wb") as file:
                if way == 2:
                    file.flush()
                    time.sleep(EMPTY_FOR)
                file.write(content)
        rewrites.value += 1


# -- what runs beside the load ------------------------------------------------------------------------


@dataclass
class Memory:
    """koordrp's RSS, sampled every RSS_PERIOD s by a thread of its own."""

    pid: int
    start: int = 0
    peak: int = 0
    after: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def begin(self) -> None:
        self.start = self.peak = rss_bytes(self.pid)
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(RSS_PERIOD):
            self.peak = max(self.peak, rss_bytes(self.pid))

    def end(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.after = rss_bytes(self.pid)
        self.peak = max(self.peak, self.after)


@dataclass
class Outcome:
    """Everything the report needs, filled in as the soak goes."""

    pods_asked: int
    calls: Calls = field(default_factory=Calls)
    load_seconds: float = 0.0
    timed_out: bool = False
    rewrites: int = 0
    expected: dict[HookType, int] = field(default_factory=dict)
    received: dict[str, dict[HookType, int]] = field(default_factory=dict)
    settle_seconds: float = 0.0
    silent_servers: list[str] = field(default_factory=list)
    left_through_koordrp: tuple[int, int] = (0, 0)
    left_in_containerd: tuple[int, int] = (0, 0)
    cpu_seconds: float = 0.0
    koordrp_warnings: Counter[str] = field(default_factory=Counter)


# -- the soak ---------------------------------------------------------------------------------------


def hook_servers(base: Path, stack: ExitStack) -> dict[str, HookServerProcess]:
    """Both servers started and registered for every hook point, each by its own file."""
    servers = {}
    for name in HOOK_SERVERS:
        server = HookServerProcess(base / f"{name}.sock")
        stack.callback(server.stop)
        register(base / "hookserver.d", name, str(server.socket), [hook.value for hook in HookType])
        servers[f"{name}.json"] = server
    return servers


def run_load(args: argparse.Namespace, base: Path, proxy: KoordrpProcess, outcome: Outcome) -> None:
    """Workers, poller and config rewriter together, until the pods are done or the time is up."""
    pods: "queue.Queue[int]" = queue.Queue()
    for index in range(args.pods):
        pods.put(index)
    stop_pods, stop_poll = threading.Event(), threading.Event()
    spawn = multiprocessing.get_context("spawn")  # grpcio does not survive fork()
    stop_rewrites, rewrites = spawn.Event(), spawn.Value("i", 0)
    rewriter = spawn.Process(
        target=rewrite_forever,
        args=(str(base / "hookserver.d" / f"{REWRITTEN}.json"), REWRITE_PERIOD, stop_rewrites, rewrites),
    )
    rewriter.start()
    poller = threading.Thread(target=poll, args=(proxy, outcome.calls, stop_poll))
    poller.start()
    workers = [
        threading.Thread(target=work, args=(proxy, pods, outcome.calls, base / "logs", stop_pods))
        for _ in range(args.workers)
    ]
    started = time.monotonic()
    for worker in workers:
        worker.start()
    try:
        outcome.timed_out = not join_by(workers, started + args.seconds)
    finally:
        # Even after Ctrl-C: pods under way are finished, so that nothing is left behind.
        stop_pods.set()
        for worker in workers:
            worker.join()
        outcome.load_seconds = time.monotonic() - started
        stop_poll.set()
        poller.join()
        stop_rewrites.set()
        rewriter.join(REWRITE_PERIOD + 10)
        outcome.rewrites = rewrites.value


def join_by(threads: list[threading.Thread], deadline: float) -> bool:
    """Whether every thread ended before ``deadline``."""
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return not any(thread.is_alive() for thread in threads)


def expected_hook_calls(calls: Calls) -> dict[HookType, int]:
    return {hook: calls.ok[method] for hook, method in CALL_OF_HOOK.items()}


def settle(
    servers: dict[str, HookServerProcess], expected: dict[HookType, int]
) -> tuple[dict[str, dict[HookType, int]], float]:
    """Each server's counts once all match ``expected``, or have not moved for SETTLED_AFTER s, at most
    SETTLE_LIMIT s after the last CRI call; and how long that took."""
    started = time.monotonic()
    last: dict[str, dict[HookType, int]] = {}
    moved = started
    while True:
        counts = {name: server.counts() for name, server in servers.items()}
        now = time.monotonic()
        if all(received == expected for received in counts.values()):
            return counts, now - started
        if counts != last:
            last, moved = counts, now
        elif now - moved >= SETTLED_AFTER or now - started >= SETTLE_LIMIT:
            return counts, now - started
        time.sleep(0.1)


def left_behind(runtime: Any, calls: Calls, where: str) -> tuple[int, int]:
    """(pods, containers) the runtime still lists; a listing that fails counts as an error, not a crash,
    so that the figures are printed all the same."""
    try:
        pods = runtime.ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=TIMEOUT).items
        containers = runtime.ListContainers(api_pb2.ListContainersRequest(), timeout=TIMEOUT).containers
    except grpc.RpcError as error:
        calls.fail(f"listing what is left {where}", error)
        return 0, 0
    return len(pods), len(containers)


def koordrp_warnings(log: str) -> Counter[str]:
    """koordrp's warning, error and critical log lines, without their timestamps, by count."""
    levels = ("#warn]", "#error]", "#critical]")
    return Counter(line.split(" ", 1)[-1] for line in log.splitlines() if any(level in line for level in levels))


def soak(args: argparse.Namespace, base: Path, stack: ExitStack) -> int:
    servers = hook_servers(base, stack)
    containerd, proxy = stack.enter_context(containerd_and_koordrp(base))
    proxy.wait_for_servers(len(servers))
    outcome = Outcome(pods_asked=args.pods)
    memory = Memory(proxy.pid)
    memory.begin()
    cpu_start = cpu_seconds(proxy.pid)
    try:
        run_load(args, base, proxy, outcome)
    finally:
        conclude(outcome, servers, containerd, proxy, memory, cpu_start)
        failures = report(args, outcome, memory)
    return 1 if failures else 0


def conclude(
    outcome: Outcome,
    servers: dict[str, HookServerProcess],
    containerd: Containerd,
    proxy: KoordrpProcess,
    memory: Memory,
    cpu_start: float,
) -> None:
    """The after-state: hook counts once settled, what is left, RSS and CPU, koordrp's complaints."""
    outcome.expected = expected_hook_calls(outcome.calls)
    outcome.received, outcome.settle_seconds = settle(servers, outcome.expected)
    outcome.silent_servers = [name for name, server in servers.items() if not server.answering]
    with proxy.channel() as channel:
        outcome.left_through_koordrp = left_behind(proxy.runtime(channel), outcome.calls, "through koordrp")
    outcome.left_in_containerd = left_behind(containerd.runtime(), outcome.calls, "in containerd")
    outcome.cpu_seconds = cpu_seconds(proxy.pid) - cpu_start
    memory.end()
    outcome.koordrp_warnings = koordrp_warnings(proxy.whole_log())


# -- the figures ------------------------------------------------------------------------------------


def report(args: argparse.Namespace, outcome: Outcome, memory: Memory) -> list[str]:
    """Print the figures; return what failed (empty: the soak passed)."""
    pods_done = outcome.calls.ok["RemovePodSandbox"]
    print(
        f"soak: {args.workers} workers, {len(HOOK_SERVERS)} echo hook servers on every hook point, "
        f"limit {args.seconds:g} s"
    )
    rate = pods_done / outcome.load_seconds if outcome.load_seconds else 0.0
    print(f"pods: {pods_done} of {outcome.pods_asked} through in {outcome.load_seconds:.1f} s: {rate:.2f} pods/s")
    if outcome.timed_out:
        never = outcome.pods_asked - outcome.calls.ok["RunPodSandbox"]
        print(f"  the time was up before every pod was started: {never} never started")
    print_latencies(outcome.calls)
    failures = print_hook_calls(outcome)
    failures += print_errors(outcome.calls)
    ways = "; ".join(REWRITE_WAYS)
    print(f"\n{REWRITTEN}.json rewritten {outcome.rewrites} times with the same content, in turn: {ways}")
    print_koordrp_warnings(outcome.koordrp_warnings)
    print_memory(memory, pods_done, outcome.cpu_seconds)
    failures += print_left_behind(outcome)
    print(f"\nresult: {'FAILED: ' + '; '.join(failures) if failures else 'passed'}")
    return failures


def print_latencies(calls: Calls) -> None:
    print(f"\n{'CRI call':<20}{'ok':>7}{'failed':>8}{'p50':>11}{'p99':>11}")
    failed = Counter(error.split(":", 1)[0] for error in (calls.errors + calls.containerd_races).elements())
    for method in (*LIFECYCLE, None, *POLL_PERIODS):
        if method is None:
            print("polled, as kubelet does:")
            continue
        samples = calls.seconds.get(method, [])
        p50 = f"{quantile(samples, 0.5) * 1e3:.1f}ms" if samples else "-"
        p99 = f"{quantile(samples, 0.99) * 1e3:.1f}ms" if samples else "-"
        print(f"{method:<20}{calls.ok[method]:>7}{failed[method]:>8}{p50:>11}{p99:>11}")


def print_hook_calls(outcome: Outcome) -> list[str]:
    names = list(outcome.received)
    print(f"\n{'hook calls':<30}{'expected':>9}" + "".join(f"{name:>14}" for name in names))
    differences = []
    for hook in HookType:
        expected = outcome.expected.get(hook, 0)
        row = [outcome.received[name].get(hook, 0) for name in names]
        print(f"{hook.value:<30}{expected:>9}" + "".join(f"{count:>14}" for count in row))
        for name, count in zip(names, row):
            if count != expected:
                kind = "lost" if count < expected else "unasked"
                missing = abs(count - expected)
                differences.append(f"{name} {hook.value}: expected {expected}, received {count} ({missing} {kind})")
    for name in outcome.silent_servers:
        differences.append(f"{name} stopped answering for its counts: the figures above are the last it gave")
    if not differences:
        print(f"hook calls: nothing lost (counts final {outcome.settle_seconds:.1f} s after the last CRI call)")
        return []
    print(f"hook calls: {len(differences)} differences (read {outcome.settle_seconds:.1f} s after the last CRI call):")
    for difference in differences:
        print(f"  {difference}")
    return ["hook calls lost or unasked"]


def print_errors(calls: Calls) -> list[str]:
    total = sum(calls.errors.values())
    print(f"\nerrors: {total}")
    for error, count in calls.errors.most_common():
        print(f"  {count} x {error}")
    if calls.containerd_races:
        races = sum(calls.containerd_races.values())
        print(f"containerd's own ListContainerStats race (containerd#10796), passed through, not counted: {races}")
        for error, count in calls.containerd_races.most_common():
            print(f"  {count} x {error}")
    return [f"{total} errors"] if total else []


def print_koordrp_warnings(warnings: Counter[str], shown: int = 10) -> None:
    print(f"koordrp logged {sum(warnings.values())} warnings or errors")
    for line, count in warnings.most_common(shown):
        print(f"  {count} x {line}")
    if len(warnings) > shown:
        print(f"  ... and {len(warnings) - shown} other distinct lines")


def print_memory(memory: Memory, pods: int, cpu: float) -> None:
    mib = 2**20
    growth = (memory.after - memory.start) / memory.start
    verdict = "within" if abs(growth) <= RSS_TOLERANCE else "NOT within"
    print(
        f"\nkoordrp RSS: {memory.start / mib:.1f} MiB at start, {memory.peak / mib:.1f} MiB peak, "
        f"{memory.after / mib:.1f} MiB after all pods were removed ({growth:+.1%}: {verdict} "
        f"{RSS_TOLERANCE:.0%} of start)"
    )
    per_pod = f", {cpu / pods * 1e3:.0f} ms per pod" if pods else ""
    print(f"koordrp CPU: {cpu:.1f} s{per_pod}")


def print_left_behind(outcome: Outcome) -> list[str]:
    pods, containers = outcome.left_through_koordrp
    direct_pods, direct_containers = outcome.left_in_containerd
    print(
        f"left behind: {pods} pods, {containers} containers listed through koordrp; "
        f"{direct_pods} pods, {direct_containers} containers in containerd"
    )
    if pods or containers or direct_pods or direct_containers:
        return ["pods or containers left behind"]
    return []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=300, help="no pod is started after this long")
    parser.add_argument("--pods", type=int, default=200, help="pods to walk through, at most")
    parser.add_argument("--workers", type=int, default=8, help="pods walked through at once")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="krp-soak-", dir="/tmp") as scratch, ExitStack() as stack:
        return soak(args, Path(scratch), stack)


if __name__ == "__main__":
    sys.exit(main())
