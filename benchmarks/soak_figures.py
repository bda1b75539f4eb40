"""What a node soak measures of koordrp at each checkpoint, and whether it stayed flat.

At a checkpoint the churn is paused with the node full again, every hook server answering, and
koordrp's store given time to agree with the runtime; then koordrp is read from /proc (RSS, open
file descriptors, threads, CPU), from its /metrics (the store gauges, hook calls by server and
result) and from its state directory (the files on disk). ``verdict`` applies the node soak's rule:
RSS within 10 % of the start, file descriptors and every store figure back to the start.

Nothing here starts anything; ``sample_process``, ``read_metrics`` and ``state_files`` read, the rest is
pure.
"""

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from prometheus_client.parser import text_string_to_metric_families

from tests.support.dockerd import unix_http
from tests.support.koordrp_process import cpu_seconds, rss_bytes

RSS_TOLERANCE = 0.10
STORE_GAUGES = ("koordrp_store_pods", "koordrp_store_containers", "koordrp_state_files")
"""What koordrp's store holds, as /metrics says ("n/a" where a scrape lacks one)."""
ON_DISK = "state files on disk"
FD_SAMPLES = 5
FD_SAMPLE_PAUSE = 0.2
"""A connection just closed by its client may still be open in koordrp for a moment: the fewest
descriptors over FD_SAMPLES reads is the count, which a leak raises all the same."""

Metrics = dict[str, list[tuple[dict[str, str], float]]]
"""Samples by name: each its labels and value."""


@dataclass(frozen=True)
class Process:
    rss: int
    fds: int
    threads: int
    cpu_seconds: float


@dataclass(frozen=True)
class Checkpoint:
    label: str
    minutes: float
    """Of churn, since the start checkpoint."""
    process: Process
    peak_rss: int
    """The most koordrp's RSS was so far (sampled twice a second), filling and warming up included."""
    store: dict[str, int | None]
    """Every figure of koordrp's store, by row name (``STORE_GAUGES``, ``ON_DISK``); None where a scrape
    lacks a gauge."""
    held: tuple[int, int]
    """The pods and containers the runtime holds."""
    hook_calls: dict[str, dict[str, int]]
    """koordrp's count of its hook calls, by server and result."""
    received: dict[str, int]
    """The calls each hook server counted (over all its lives)."""
    churned: int
    """Pods removed and made again since the soak began, behind koordrp's back ones included."""
    behind: int
    restarts: int
    wedges: int
    settled: float | None
    """Seconds koordrp's store took to agree with the runtime once the churn was paused; None if it did not."""


# -- reading ------------------------------------------------------------------------------------------


def sample_process(pid: int) -> Process:
    fds = []
    for index in range(FD_SAMPLES):
        if index:
            time.sleep(FD_SAMPLE_PAUSE)
        fds.append(len(os.listdir(f"/proc/{pid}/fd")))
    return Process(rss_bytes(pid), min(fds), threads(pid), cpu_seconds(pid))


def threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise RuntimeError(f"no Threads for {pid}")


def read_metrics(socket: Path) -> Metrics:
    status, _, body = unix_http(socket, "GET", "/metrics", timeout=30)
    if status != 200:
        raise RuntimeError(f"GET /metrics on {socket}: {status}")
    samples: Metrics = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def state_files(directory: Path) -> int:
    """The files koordrp keeps in its state directory (its temporary files, dot files, not counted)."""
    return sum(
        not name.startswith(".")
        for kind in ("pods", "containers")
        if (directory / kind).is_dir()
        for name in os.listdir(directory / kind)
    )


def store_figures(metrics: Metrics, on_disk: int) -> dict[str, int | None]:
    """The store's gauges (None where absent) and the files on disk."""
    figures: dict[str, int | None] = {name: _single(metrics, name) for name in STORE_GAUGES}
    figures[ON_DISK] = on_disk
    return figures


def store_size(store: dict[str, int | None]) -> tuple[int, int] | None:
    """The pods and containers koordrp's store says it holds (None: a scrape lacked them)."""
    pod_count, container_count = store.get("koordrp_store_pods"), store.get("koordrp_store_containers")
    if pod_count is None or container_count is None:
        return None
    return pod_count, container_count


def hook_calls(metrics: Metrics) -> dict[str, dict[str, int]]:
    """koordrp_hook_calls_total summed over hooks, by server and result."""
    calls: dict[str, dict[str, int]] = {}
    for labels, value in metrics.get("koordrp_hook_calls_total", []):
        by_result = calls.setdefault(labels["server"], {})
        by_result[labels["result"]] = by_result.get(labels["result"], 0) + int(value)
    return calls


def _single(metrics: Metrics, name: str, **labels: str) -> int | None:
    for sample_labels, value in metrics.get(name, []):
        if all(sample_labels.get(key) == wanted for key, wanted in labels.items()):
            return int(value)
    return None


# -- judging ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    figure: str
    values: tuple[str, ...]
    change: str
    """End against start: a ratio or a difference."""
    judgement: str
    """``flat``, ``NOT flat``, ``n/a`` (not measured), or "" (shown, not judged)."""

    @property
    def judged_not_flat(self) -> bool:
        return self.judgement == "NOT flat"


def judged_rows(checkpoints: Sequence[Checkpoint]) -> list[Row]:
    """The rows the verdict rests on: RSS, file descriptors, every store figure."""
    start, end = checkpoints[0], checkpoints[-1]
    mib = 2**20
    ratio = end.process.rss / start.process.rss
    rows = [
        Row(
            "koordrp RSS (MiB)",
            tuple(f"{point.process.rss / mib:.1f}" for point in checkpoints),
            f"x{ratio:.3f}",
            "flat" if abs(ratio - 1) <= RSS_TOLERANCE else "NOT flat",
        ),
        _count_row("open file descriptors", [point.process.fds for point in checkpoints]),
    ]
    for figure in start.store:
        rows.append(_count_row(figure, [point.store.get(figure) for point in checkpoints]))
    return rows


def _count_row(figure: str, values: Sequence[int | None]) -> Row:
    shown = tuple("n/a" if value is None else str(value) for value in values)
    start, end = values[0], values[-1]
    if start is None or end is None:
        return Row(figure, shown, "", "n/a")
    return Row(figure, shown, f"{end - start:+d}", "flat" if end == start else "NOT flat")


def verdict(rows: Iterable[Row]) -> str:
    """``flat``, or ``NOT flat:`` and what is not; what could not be measured is said too."""
    rows = list(rows)
    drifted = [row.figure for row in rows if row.judged_not_flat]
    unmeasured = [row.figure for row in rows if row.judgement == "n/a"]
    said = f"NOT flat: {', '.join(drifted)}" if drifted else "flat"
    return said + (f" (n/a, not judged: {', '.join(unmeasured)})" if unmeasured else "")


def shown_rows(checkpoints: Sequence[Checkpoint]) -> list[Row]:
    """What the verdict does not rest on but a reader needs: the runtime, the churn, the disturbances."""

    def row(figure: str, values: Iterable[object]) -> Row:
        return Row(figure, tuple(str(value) for value in values), "", "")

    return [
        row("koordrp RSS peak so far (MiB)", (f"{point.peak_rss / 2**20:.1f}" for point in checkpoints)),
        row("threads", (point.process.threads for point in checkpoints)),
        row("koordrp CPU (s)", (f"{point.process.cpu_seconds:.0f}" for point in checkpoints)),
        row("runtime holds pods", (point.held[0] for point in checkpoints)),
        row("runtime holds containers", (point.held[1] for point in checkpoints)),
        row("store agreed after (s)", (_settled(point.settled) for point in checkpoints)),
        row("pods churned", (point.churned for point in checkpoints)),
        row("  of them behind koordrp", (point.behind for point in checkpoints)),
        row("hook server restarts", (point.restarts for point in checkpoints)),
        row("hook server wedges", (point.wedges for point in checkpoints)),
    ]


def _settled(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds:.1f}"


def hook_rows(checkpoints: Sequence[Checkpoint]) -> list[Row]:
    """Hook calls so far, by server and result as koordrp counts them and as each server counts them;
    the change is per pod churned, from the start to the end."""
    start, end = checkpoints[0], checkpoints[-1]
    churned = end.churned - start.churned
    servers = sorted({server for point in checkpoints for server in (*point.hook_calls, *point.received)})
    rows = []
    for server in servers:
        results = sorted({result for point in checkpoints for result in point.hook_calls.get(server, {})})
        for result in results:
            values = [point.hook_calls.get(server, {}).get(result, 0) for point in checkpoints]
            rows.append(Row(f"{server} {result}", tuple(map(str, values)), _per_pod(values, churned), ""))
        received = [point.received.get(server, 0) for point in checkpoints]
        rows.append(Row(f"{server} received", tuple(map(str, received)), _per_pod(received, churned), ""))
    return rows


def _per_pod(values: Sequence[int], churned: int) -> str:
    return f"{(values[-1] - values[0]) / churned:.2f}/pod" if churned else ""


def table(checkpoints: Sequence[Checkpoint], rows: Iterable[Row]) -> str:
    labels = [f"{point.label} ({point.minutes:.1f} min)" for point in checkpoints]
    rows = list(rows)
    first = max(len(row.figure) for row in rows) + 2
    width = max(12, *(len(label) + 2 for label in labels))
    lines = [f"{'':<{first}}" + "".join(f"{label:>{width}}" for label in labels) + f"{'end vs start':>14}  judgement"]
    for row in rows:
        cells = "".join(f"{value:>{width}}" for value in row.values)
        lines.append(f"{row.figure:<{first}}{cells}{row.change:>14}  {row.judgement}".rstrip())
    return "\n".join(lines)
