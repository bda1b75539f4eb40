"""The node soak's verdict (benchmarks/soak_figures.py), flat or not: RSS within 10 % of the start, file descriptors
and every store figure back to the start; what this koordrp does not measure is said, not judged."""

from twisted.trial.unittest import SynchronousTestCase

from benchmarks.soak_figures import (
    Checkpoint,
    Metrics,
    Process,
    hook_calls,
    hook_rows,
    judged_rows,
    store_figures,
    store_size,
    table,
    verdict,
)

MIB = 2**20


def checkpoint(label: str, rss_mib: float = 60, fds: int = 20, churned: int = 0, **store: int | None) -> Checkpoint:
    figures: dict[str, int | None] = {"koordrp_store_pods": 110, "koordrp_store_containers": 220, "state files on disk": 330}
    figures.update(store)
    return Checkpoint(
        label=label,
        minutes=0,
        process=Process(rss=int(rss_mib * MIB), fds=fds, threads=7, cpu_seconds=1.0),
        peak_rss=int(rss_mib * MIB),
        store=figures,
        held=(110, 220),
        hook_calls={"a.json": {"ok": churned * 10}},
        received={"a.json": churned * 10},
        churned=churned,
        behind=churned // 10,
        restarts=0,
        wedges=0,
        settled=0.5,
    )


class VerdictTests(SynchronousTestCase):
    def test_flat_when_rss_is_within_ten_percent_and_counts_are_back(self) -> None:
        points = [checkpoint("start"), checkpoint("middle", rss_mib=70, fds=25), checkpoint("end", rss_mib=65.9)]
        self.assertEqual(verdict(judged_rows(points)), "flat")

    def test_rss_beyond_ten_percent_is_not_flat(self) -> None:
        rows = judged_rows([checkpoint("start"), checkpoint("end", rss_mib=66.1)])
        self.assertEqual(verdict(rows), "NOT flat: koordrp RSS (MiB)")
        self.assertEqual(rows[0].change, "x1.102")

    def test_a_descriptor_or_a_store_figure_not_back_is_not_flat(self) -> None:
        rows = judged_rows([checkpoint("start"), checkpoint("end", fds=21, koordrp_store_pods=113)])
        self.assertEqual(verdict(rows), "NOT flat: open file descriptors, koordrp_store_pods")
        self.assertEqual([row.change for row in rows if row.judged_not_flat], ["+1", "+3"])

    def test_a_gauge_this_koordrp_lacks_is_said_and_not_judged(self) -> None:
        points = [checkpoint("start", koordrp_state_files=None), checkpoint("end", koordrp_state_files=None)]
        rows = judged_rows(points)
        self.assertEqual(verdict(rows), "flat (n/a, not judged: koordrp_state_files)")
        self.assertIn("n/a", table(points, rows))


class MetricsTests(SynchronousTestCase):
    METRICS: Metrics = {
        "koordrp_hook_calls_total": [
            ({"server": "a.json", "hook": "PreRunPodSandbox", "result": "ok"}, 3.0),
            ({"server": "a.json", "hook": "PreCreateContainer", "result": "ok"}, 6.0),
            ({"server": "a.json", "hook": "PreCreateContainer", "result": "timeout"}, 1.0),
        ],
    }

    def test_a_scrape_without_the_gauges_says_so_and_has_no_store_size(self) -> None:
        store = store_figures(self.METRICS, on_disk=21)
        self.assertEqual((store["koordrp_store_pods"], store["state files on disk"]), (None, 21))
        self.assertIsNone(store_size(store))

    def test_the_gauges_say_the_store_size(self) -> None:
        metrics: Metrics = {"koordrp_store_pods": [({}, 6.0)], "koordrp_store_containers": [({}, 12.0)]}
        store = store_figures(metrics, on_disk=0)
        self.assertEqual(store_size(store), (6, 12))
        self.assertEqual(list(store), ["koordrp_store_pods", "koordrp_store_containers", "koordrp_state_files", "state files on disk"])

    def test_hook_calls_are_summed_over_hooks_by_server_and_result(self) -> None:
        self.assertEqual(hook_calls(self.METRICS), {"a.json": {"ok": 9, "timeout": 1}})

    def test_hook_calls_change_per_pod_churned(self) -> None:
        rows = hook_rows([checkpoint("start", churned=10), checkpoint("end", churned=30)])
        self.assertEqual([(row.figure, row.change) for row in rows], [("a.json ok", "10.00/pod"), ("a.json received", "10.00/pod")])
