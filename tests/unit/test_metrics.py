"""What koordrp's registry holds beyond its own counters: the process's, which deploy/prometheus/'s alerts use."""

import resource

from twisted.trial.unittest import SynchronousTestCase

from koordrp import bounds
from koordrp.metrics import Metrics


class ProcessMetricsTests(SynchronousTestCase):
    def test_the_descriptors_livez_counts_are_on_metrics(self) -> None:
        registry = Metrics().registry
        used, limit = bounds.descriptors_in_use()
        self.assertEqual(registry.get_sample_value("process_max_fds"), limit)  # the soft limit, as /livez's
        # prometheus_client counts the descriptor of its own listing of /proc/self/fd, which /livez does not.
        self.assertEqual(registry.get_sample_value("process_open_fds"), used + 1)

    def test_they_follow_the_limit_koordrp_raises(self) -> None:
        """Read at each scrape: the limit raised at start is the one reported."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        self.addCleanup(resource.setrlimit, resource.RLIMIT_NOFILE, (soft, hard))
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 512), hard))
        registry = Metrics().registry
        self.assertEqual(registry.get_sample_value("process_max_fds"), min(soft, 512))
        bounds.raise_descriptor_limit()
        self.assertEqual(registry.get_sample_value("process_max_fds"), hard)
