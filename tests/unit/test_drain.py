"""Waiting, within a bound, for what is in flight to end; and the stop's end."""

import signal
from typing import Callable

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from koordrp.drain import Drain
from koordrp.shutdown import OrderlyStopOnSIGTERM
from tests.fake.reactor import InlineThreadsReactor
from tests.support.logs import logged_events


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


class OrderlyStopTests(SynchronousTestCase):
    """SIGTERM's stop (koordrp.shutdown): the reactor stops, and once its shutdown is over the process ends at
    once, skipping Python's teardown of every module (CPU work that serves nothing, past the stop's bound)."""

    def setUp(self) -> None:
        self.reactor = InlineThreadsReactor()
        self.exit_handlers: list[Callable[[], None]] = []
        self.ended: list[int] = []
        self.stop = OrderlyStopOnSIGTERM(self.reactor, at_exit=self.exit_handlers.append, end=self.ended.append)
        self.stop.startService()
        self.events = logged_events(self)

    def shut_down(self) -> None:
        """The reactor's shutdown ends: its "after" triggers run."""
        for trigger, args, kwargs in self.reactor.triggers["after"]["shutdown"]:
            trigger(*args, **kwargs)

    def test_after_sigterm_the_process_ends_at_once_with_status_0_once_the_shutdown_is_over(self) -> None:
        self.reactor.whenRunningHooks.clear()  # not signal.signal: this test process keeps its own SIGTERM
        self.stop._on_sigterm(signal.SIGTERM, None)
        self.assertTrue(self.reactor.hasStopped)
        self.assertEqual(self.exit_handlers, [])  # the shutdown (the front end's drain) runs first
        self.reactor.advance(10.25)
        self.shut_down()
        [stopped] = [event for event in self.events if event["log_format"].startswith("stopped ")]
        self.assertEqual(stopped["seconds"], 10.25)
        [handler] = self.exit_handlers  # registered last: Python runs it first
        self.assertEqual(self.ended, [])
        handler()
        self.assertEqual(self.ended, [0])

    def test_a_shutdown_sigterm_did_not_ask_for_leaves_the_process_to_python(self) -> None:
        # A start that failed, or SIGINT (twistd stops and re-raises it): their own exit status stands.
        self.shut_down()
        self.assertEqual((self.exit_handlers, self.ended), ([], []))

    def test_a_second_sigterm_keeps_the_first_ones_time(self) -> None:
        self.stop._on_sigterm(signal.SIGTERM, None)
        self.reactor.advance(3)
        self.stop._on_sigterm(signal.SIGTERM, None)
        self.reactor.advance(1)
        self.shut_down()
        [stopped] = [event for event in self.events if event["log_format"].startswith("stopped ")]
        self.assertEqual(stopped["seconds"], 4)
