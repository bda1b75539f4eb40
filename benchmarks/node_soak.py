"""A soak at a node's size: ~110 pods of 2 containers churned for half an hour, koordrp measured as it goes.

    .venv/bin/python -m benchmarks.node_soak --mode proxy|nri|docker|all [--minutes 30] [--pods 110]

One mode (``benchmarks/soak_nodes.py``): ``proxy`` (containerd 2.1, koordrp in front of it),
``nri`` (containerd 2.1 with NRI, koordrp its plugin), ``docker`` (dockerd, koordrp in front of
it); ``all`` runs the three one after the other and ends with one verdict line each.

The node is filled to ``--pods`` pods; then ``--workers`` threads churn it: each takes the oldest
pod, removes it and makes a new one, so that about ``--pods`` stay alive. Pods are made and removed
the way kubelet does (containers stopped and removed, then the sandbox), except every
``--behind-every``-th removal (10 %), which removes the running pod whole on the runtime directly,
behind koordrp's back. kubelet's relisting runs every second throughout. Three hook servers, each
a process of its own on a unix socket, are registered in hookserver.d for every hook point with the
Ignore policy: ``a-koordlet`` answers as koordlet does and marks every pod and container (so that
koordrp keeps a state file for each), ``b-restarting`` is restarted every ``--restart-every``
seconds, and ``c-wedged`` stops answering for ``--wedge-seconds`` once in every stretch of churn,
then answers its backlog and goes on (it is registered with ``timeout-seconds`` 2, so that the call
that finds it wedged waits 2 s rather than half its deadline).

After a ``--warmup-minutes`` stretch of churn (every disturbance happens once in it, so that what
koordrp allocates once is not taken for growth), three checkpoints: start, middle (``--minutes``/2
later) and end (``--minutes`` after the start). At each, the churn is paused with the node full
again, and koordrp's store is given up to three reconcile intervals (plus 15 s) to agree with the
runtime; then koordrp's RSS, open file descriptors, threads and CPU, its store gauges
(``koordrp_store_pods``, ``koordrp_store_containers``, ``koordrp_state_files``; the state files on disk) and its hook calls
by server and result are read. koordrp runs with ``--reconcile-interval`` (``--reconcile-interval`` here).

It prints the figures as a table, with the soak's verdict: flat when RSS is within 10 % of the start
and the file descriptors and every store figure are back to the start; and every failed call.
Exits 1 if a mode was not flat or a call failed.
"""

import argparse
import contextlib
import itertools
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

from benchmarks.echo_hook_server import HookServerProcess
from benchmarks.soak import Calls, Memory, koordrp_warnings, print_koordrp_warnings
from benchmarks.soak_figures import (
    Checkpoint,
    hook_calls,
    hook_rows,
    judged_rows,
    read_metrics,
    sample_process,
    shown_rows,
    state_files,
    store_figures,
    store_size,
    table,
    verdict,
)
from benchmarks.soak_nodes import MODES, NODES, Node, Pod
from benchmarks.stats import quantile
from koordrp.hooks.types import HookType
from tests.support.hook_registration import register
from tests.support.koordrp_process import log_files

WEDGED_TIMEOUT = 2
SETTLE_MARGIN = 15.0
SETTLE_POLL = 0.5
QUIESCE_LIMIT = 300.0
"""The most a pause waits for the pods under way to be done and the node to be full again."""


def log(line: str) -> None:
    print(f"[{datetime.now():%H:%M:%S}] {line}", flush=True)


# -- hook servers ---------------------------------------------------------------------------------------


class HookServers:
    """The three servers, registered for every hook point with the Ignore policy."""

    KOORDLET, RESTARTING, WEDGED = "a-koordlet", "b-restarting", "c-wedged"

    def __init__(self, base: Path) -> None:
        self._base = base
        self._servers: dict[str, HookServerProcess] = {}
        self._earlier: Counter[str] = Counter()
        """What the earlier lives of a restarted server received."""
        self.restarts = 0
        self.wedges = 0
        self._wedged = False
        hooks = [hook.value for hook in HookType]
        try:
            for name in (self.KOORDLET, self.RESTARTING, self.WEDGED):
                self._servers[name] = HookServerProcess(self._socket(name), mark=name == self.KOORDLET)
                extra: dict[str, Any] = {"timeout-seconds": WEDGED_TIMEOUT} if name == self.WEDGED else {}
                register(base / "hookserver.d", name, str(self._socket(name)), hooks, **extra)
        except BaseException:
            self.stop()
            raise

    def _socket(self, name: str) -> Path:
        return self._base / f"{name}.sock"

    def restart(self) -> None:
        """The restarting server stopped and started again on its socket."""
        ended = self._servers[self.RESTARTING].stop()
        self._earlier[self.RESTARTING] += sum(ended.values())
        self._servers[self.RESTARTING] = HookServerProcess(self._socket(self.RESTARTING))
        self.restarts += 1

    def wedge(self) -> None:
        self._servers[self.WEDGED].wedge()
        self._wedged = True
        self.wedges += 1

    def unwedge(self) -> None:
        if self._wedged:
            self._servers[self.WEDGED].unwedge()
            self._wedged = False

    def received(self) -> dict[str, int]:
        """The calls each server received so far, by its registration's name (as koordrp names it)."""
        return {
            f"{name}.json": self._earlier[name] + sum(server.counts().values()) for name, server in self._servers.items()
        }

    def stop(self) -> None:
        self.unwedge()
        for server in self._servers.values():
            server.stop()


# -- the churn ------------------------------------------------------------------------------------------


class Churn:
    """Worker threads that keep ``target`` pods on the node, replacing the oldest one by one.

    Paused (as it starts), they only make pods until the node is full, then wait: a checkpoint
    finds every pod under way done and ``target`` pods alive.
    """

    def __init__(self, node: Node, calls: Calls, target: int, workers: int, behind_every: int) -> None:
        self._node = node
        self._calls = calls
        self._target = target
        self._behind_every = behind_every
        self._changed = threading.Condition()
        self._alive: deque[Pod] = deque()
        self._population = 0
        """Pods alive or being made: a pod being removed no longer counts."""
        self._paused = True
        self._filling_failed = False
        self._stopping = False
        self._waiting = 0
        self._names = itertools.count()
        self.churned = 0
        self.behind = 0
        self._threads = [threading.Thread(target=self._work, name=f"churn-{index}") for index in range(workers)]
        for thread in self._threads:
            thread.start()

    def _work(self) -> None:
        while True:
            with self._changed:
                task = self._next()
            if task is None:
                return
            pod, behind = task
            try:
                if pod is None:
                    self._make(f"soak-{next(self._names)}")
                elif behind:
                    self._node.remove_behind(pod, self._calls)
                else:
                    self._node.remove_pod(pod, self._calls)
            except Exception as error:  # a bug here must show in the figures, not end the thread quietly
                self._calls.fail("churn", error)
            with self._changed:
                self._changed.notify_all()

    def _next(self) -> tuple[Pod | None, bool] | None:
        """What to do next: ``(None, False)`` make a pod; ``(pod, behind)`` remove that one, behind
        koordrp's back or not; None: end."""
        while not self._stopping:
            if self._population < self._target and not (self._paused and self._filling_failed):
                self._population += 1
                return None, False
            if not self._paused and self._alive:
                pod = self._alive.popleft()
                self._population -= 1
                self.churned += 1
                behind = self.churned % self._behind_every == 0
                self.behind += behind
                return pod, behind
            self._waiting += 1
            self._changed.notify_all()
            self._changed.wait()
            self._waiting -= 1
        return None

    def _make(self, name: str) -> None:
        pod: Pod | None = None
        try:
            pod = self._node.make_pod(name, self._calls)
        finally:
            with self._changed:
                if pod is None:
                    self._population -= 1
                    self._filling_failed = self._paused
                else:
                    self._alive.append(pod)

    def resume(self) -> None:
        with self._changed:
            self._paused = False
            self._changed.notify_all()

    def pause(self, limit: float = QUIESCE_LIMIT) -> bool:
        """Paused, and the node full again with nothing under way; False if that took more than ``limit`` s."""
        deadline = time.monotonic() + limit
        with self._changed:
            self._paused = True
            self._filling_failed = False
            self._changed.notify_all()
            while self._waiting < len(self._threads):
                if not self._changed.wait(max(0.0, deadline - time.monotonic())):
                    return False
        return True

    @property
    def alive(self) -> int:
        with self._changed:
            return len(self._alive)

    def stop(self) -> None:
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        for thread in self._threads:
            thread.join()


@contextlib.contextmanager
def relisting(node: Node, calls: Calls, period: float) -> Iterator[None]:
    """kubelet's relisting every ``period`` s while the block runs."""
    stop = threading.Event()

    def relist() -> None:
        while not stop.wait(period):
            node.relist(calls)

    thread = threading.Thread(target=relist, name="relist")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


# -- one mode -------------------------------------------------------------------------------------------


@dataclass
class Soak:
    args: argparse.Namespace
    base: Path
    node: Node
    churn: Churn
    servers: HookServers
    calls: Calls
    memory: Memory
    settle_limit: float
    churned_seconds: float = 0.0
    """Of churn since the start checkpoint."""
    checkpoints: list[Checkpoint] = field(default_factory=list)

    def stretch(self, seconds: float) -> None:
        """Churn for ``seconds`` with the disturbances, then pause with the node full."""
        began = time.monotonic()
        events: list[tuple[float, str]] = []
        # Half a period in first: a stretch as short as one period still has its restart.
        restart_at = began + self.args.restart_every / 2
        while restart_at < began + seconds:
            events.append((restart_at, "restart"))
            restart_at += self.args.restart_every
        wedged_for = min(self.args.wedge_seconds, seconds / 2)
        if wedged_for > 0:
            events += [(began + seconds / 4, "wedge"), (began + seconds / 4 + wedged_for, "unwedge")]
        self.churn.resume()
        for at, event in sorted(events):
            time.sleep(max(0.0, at - time.monotonic()))
            if event == "restart":
                self.servers.restart()
            elif event == "wedge":
                self.servers.wedge()
            else:
                self.servers.unwedge()
        time.sleep(max(0.0, began + seconds - time.monotonic()))
        self.servers.unwedge()
        self.churned_seconds += time.monotonic() - began
        if not self.churn.pause():
            log(f"the churn did not come to a pause within {QUIESCE_LIMIT:g} s: figures taken all the same")

    def settle(self) -> float | None:
        """Seconds until koordrp's store holds what the runtime holds; None if not within the limit."""
        began = time.monotonic()
        metrics_socket = self.base / "metrics.sock"
        while True:
            held = self.node.held()
            store = store_figures(read_metrics(metrics_socket), 0)
            elapsed = time.monotonic() - began
            if store_size(store) == held:
                return elapsed
            if elapsed >= self.settle_limit:
                return None
            time.sleep(SETTLE_POLL)

    def checkpoint(self, label: str) -> Checkpoint:
        settled = self.settle()
        process = sample_process(self.node.proxy.pid)
        metrics = read_metrics(self.base / "metrics.sock")
        point = Checkpoint(
            label=label,
            minutes=self.churned_seconds / 60,
            process=process,
            peak_rss=self.memory.peak,
            store=store_figures(metrics, state_files(self.base / "state")),
            held=self.node.held(),
            hook_calls=hook_calls(metrics),
            received=self.servers.received(),
            churned=self.churn.churned,
            behind=self.churn.behind,
            restarts=self.servers.restarts,
            wedges=self.servers.wedges,
            settled=settled,
        )
        self.checkpoints.append(point)
        store = ", ".join(f"{name} {'n/a' if value is None else value}" for name, value in point.store.items())
        log(
            f"{label}: RSS {process.rss / 2**20:.1f} MiB, {process.fds} fds, {process.threads} threads; "
            f"runtime {point.held[0]} pods, {point.held[1]} containers; {store}; "
            f"store agreed after {'never' if settled is None else f'{settled:.1f} s'}; {point.churned} pods churned"
        )
        return point


def keep_log(logfile: Path, kept: Path) -> None:
    """koordrp's whole log in one file, what twistd rotated out included."""
    kept.parent.mkdir(parents=True, exist_ok=True)
    with open(kept, "wb") as copy:
        for path in log_files(logfile):
            copy.write(path.read_bytes())
    print(f"koordrp's log kept in {kept}")


def soak_mode(mode: str, args: argparse.Namespace) -> tuple[str, bool]:
    """One mode's soak, reported; its verdict and whether it passed (flat, and no call failed)."""
    began = time.monotonic()
    reconciling = f"--reconcile-interval={args.reconcile_interval:g}"
    settle_limit = 3 * args.reconcile_interval + SETTLE_MARGIN
    with tempfile.TemporaryDirectory(prefix="krp-nsoak-", dir="/tmp") as scratch, contextlib.ExitStack() as stack:
        base = Path(scratch)
        if args.keep_logs is not None:
            # Called last, once koordrp has stopped: its whole log.
            stack.callback(keep_log, base / "koordrp.log", args.keep_logs / f"koordrp-{mode}.log")
        servers = HookServers(base)
        stack.callback(servers.stop)
        koordrp_args = [f"--metrics-endpoint=unix:{base / 'metrics.sock'}", reconciling]
        node = stack.enter_context(NODES[mode](base, koordrp_args))
        node.proxy.wait_for_servers(3)
        calls = Calls(node.failures)
        log(f"{mode} mode: {node.runtime_name}; filling the node to {args.pods} pods with {args.workers} workers")
        churn = Churn(node, calls, args.pods, args.workers, args.behind_every)
        stack.callback(churn.stop)
        memory = Memory(node.proxy.pid)
        memory.begin()
        stack.callback(memory.end)
        soak = Soak(args, base, node, churn, servers, calls, memory, settle_limit)
        stack.enter_context(relisting(node, calls, args.relist_every))
        if not churn.pause(QUIESCE_LIMIT + args.pods * 10):
            log("the node did not fill: figures taken all the same")
        filled = time.monotonic() - began
        log(f"{churn.alive} pods alive after {filled:.0f} s; warming up for {args.warmup_minutes:g} min")
        soak.stretch(args.warmup_minutes * 60)
        soak.churned_seconds = 0.0
        soak.checkpoint("start")
        for label in ("middle", "end"):
            soak.stretch(args.minutes * 30)
            soak.checkpoint(label)
        said = report(mode, node, soak, reconciling, filled, time.monotonic() - began)
    return said, said == "flat" and not calls.errors


def report(mode: str, node: Node, soak: Soak, reconciling: str, filled: float, seconds: float) -> str:
    args, points = soak.args, soak.checkpoints
    print(f"\nnode soak, {mode} mode on {node.runtime_name}: {args.pods} pods x 2 containers, {args.workers} workers")
    print(
        f"hook servers (every hook, Ignore): {HookServers.KOORDLET}.json marks every pod and container; "
        f"{HookServers.RESTARTING}.json restarted every {args.restart_every:g} s; {HookServers.WEDGED}.json "
        f"wedged {args.wedge_seconds:g} s in every stretch (timeout-seconds {WEDGED_TIMEOUT})"
    )
    print(f"every {args.behind_every}th pod removed behind koordrp's back; kubelet's relisting every {args.relist_every:g} s")
    print(
        f"koordrp: {reconciling}; filled in {filled:.0f} s, warmed up {args.warmup_minutes:g} min, "
        f"then {args.minutes:g} min of churn\n"
    )
    rows = judged_rows(points)
    print(table(points, rows))
    print()
    print(table(points, shown_rows(points)))
    print("\nhook calls so far (koordrp's count by server and result, and what each server received):")
    print(table(points, hook_rows(points)))
    print_calls(soak.calls)
    print_koordrp_warnings(koordrp_warnings(node.proxy.whole_log()))
    said = verdict(rows)
    print(f"\nverdict ({mode}: RSS within 10 %, file descriptors and store figures back to the start): {said}")
    print(f"{mode} mode took {seconds / 60:.1f} min")
    return said


def print_calls(calls: Calls) -> None:
    print(f"\n{'call':<28}{'ok':>8}{'failed':>8}{'p50':>11}{'p99':>11}")
    failed = Counter(error.split(":", 1)[0] for error in calls.errors.elements())
    for method in sorted({*calls.ok, *failed}):
        samples = calls.seconds.get(method, [])
        p50 = f"{quantile(samples, 0.5) * 1e3:.1f}ms" if samples else "-"
        p99 = f"{quantile(samples, 0.99) * 1e3:.1f}ms" if samples else "-"
        print(f"{method:<28}{calls.ok[method]:>8}{failed[method]:>8}{p50:>11}{p99:>11}")
    print(f"errors: {sum(calls.errors.values())}")
    for error, count in calls.errors.most_common(20):
        print(f"  {count} x {error}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=(*MODES, "all"), required=True)
    parser.add_argument("--minutes", type=float, default=30, help="of churn from the start checkpoint to the end one")
    parser.add_argument("--pods", type=int, default=110, help="pods kept alive (a node's default maximum)")
    parser.add_argument("--workers", type=int, default=4, help="pods made or removed at once")
    parser.add_argument("--warmup-minutes", type=float, default=None, help="of churn before the start [a tenth of --minutes, at least 1]")
    parser.add_argument("--behind-every", type=int, default=10, help="every Nth removal is behind koordrp's back")
    parser.add_argument("--restart-every", type=float, default=60, help="seconds between restarts of b-restarting")
    parser.add_argument("--wedge-seconds", type=float, default=60, help="c-wedged is wedged this long in every stretch")
    parser.add_argument("--reconcile-interval", type=float, default=10, help="koordrp's --reconcile-interval (seconds)")
    parser.add_argument("--relist-every", type=float, default=1.0, help="seconds between kubelet's relists")
    parser.add_argument("--keep-logs", type=Path, help="a directory to copy koordrp's log to (koordrp-MODE.log)")
    args = parser.parse_args()
    if args.warmup_minutes is None:
        args.warmup_minutes = max(1.0, args.minutes / 10)
    results = []
    for mode in MODES if args.mode == "all" else (args.mode,):
        began = time.monotonic()
        said, passed = soak_mode(mode, args)
        results.append((mode, said, passed, time.monotonic() - began))
    if len(results) > 1:
        print("\nnode soak, every mode:")
        for mode, said, passed, seconds in results:
            failed = " (calls failed)" if said == "flat" and not passed else ""
            print(f"  {mode:<7} {said}{failed}; {seconds / 60:.1f} min")
    return 0 if all(passed for _, _, passed, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
