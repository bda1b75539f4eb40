"""One report per outage and per recovery, whatever grpc's reconnection attempts look like."""

import grpc
from twisted.trial.unittest import SynchronousTestCase

from koordrp.cri.reachability import Reachability, ReachabilityTracker
from koordrp.unix import EndpointError, parse_unix_endpoint

C = grpc.ChannelConnectivity


class ReachabilityTrackerTests(SynchronousTestCase):
    def observe_all(self, *states: grpc.ChannelConnectivity) -> list[Reachability]:
        tracker = ReachabilityTracker()
        return [change for state in states if (change := tracker.observe(state)) is not None]

    def test_first_connection_is_reported_once(self) -> None:
        self.assertEqual(self.observe_all(C.IDLE, C.CONNECTING, C.READY, C.IDLE, C.READY), [Reachability.FIRST_CONNECTED])

    def test_an_outage_with_many_retries_is_one_report_and_one_recovery(self) -> None:
        states = (C.CONNECTING, C.READY, C.IDLE, C.CONNECTING, C.TRANSIENT_FAILURE, C.CONNECTING, C.TRANSIENT_FAILURE)
        self.assertEqual(
            self.observe_all(*states, C.CONNECTING, C.READY),
            [Reachability.FIRST_CONNECTED, Reachability.UNREACHABLE, Reachability.RECOVERED],
        )

    def test_backend_missing_at_start(self) -> None:
        self.assertEqual(
            self.observe_all(C.CONNECTING, C.TRANSIENT_FAILURE, C.TRANSIENT_FAILURE, C.READY),
            [Reachability.UNREACHABLE, Reachability.RECOVERED],
        )

    def test_reachable_only_when_ready(self) -> None:
        tracker = ReachabilityTracker()
        self.assertFalse(tracker.reachable)
        tracker.observe(C.READY)
        self.assertTrue(tracker.reachable)
        tracker.observe(C.IDLE)
        self.assertFalse(tracker.reachable)


class EndpointTests(SynchronousTestCase):
    def test_paths_and_unix_urls(self) -> None:
        self.assertEqual(parse_unix_endpoint("/run/a.sock"), "/run/a.sock")
        self.assertEqual(parse_unix_endpoint("unix:///run//a.sock"), "/run/a.sock")

    def test_everything_else_is_refused(self) -> None:
        for value in ("", "a.sock", "unix://a.sock", "tcp://127.0.0.1:1", "unix:/run/a.sock"):
            self.assertRaises(EndpointError, parse_unix_endpoint, value)
