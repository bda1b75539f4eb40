"""Waiting, within a bound, for what is in flight to end."""

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from koordrp.drain import Drain


class DrainTests(SynchronousTestCase):
    def test_nothing_in_flight_is_drained_at_once(self) -> None:
        self.successResultOf(Drain(Clock()).wait(False, 10.0))

    def test_waiters_go_on_when_the_last_thing_ends_and_the_bound_is_dropped(self) -> None:
        clock = Clock()
        drain = Drain(clock)
        first, second = drain.wait(True, 10.0), drain.wait(True, 1.0)
        self.assertNoResult(first)
        drain.idle()
        self.successResultOf(first)
        self.successResultOf(second)
        self.assertEqual(clock.getDelayedCalls(), [])

    def test_at_the_first_waits_bound_what_still_runs_is_cut_and_the_waiters_go_on(self) -> None:
        clock = Clock()
        drain = Drain(clock)
        cut: list[str] = []
        waited = drain.wait(True, 5.0, lambda: cut.append("cut"))
        clock.advance(4.9)
        self.assertEqual((cut, drain.waiting), ([], True))
        clock.advance(0.1)
        self.assertEqual(cut, ["cut"])
        self.successResultOf(waited)
