"""A trouble that starts, repeats and ends: its rule, its back-off, and the two on a clock."""

from typing import cast

from twisted.internet.task import Clock
from twisted.logger import ILogObserver, LogEvent, Logger, LogLevel, LogPublisher
from twisted.trial.unittest import SynchronousTestCase

from koordrp.trouble import Backoff, Notice, Retrying, Trouble


class TroubleTests(SynchronousTestCase):
    def test_said_when_it_starts_for_each_new_reason_and_when_it_ends(self) -> None:
        trouble = Trouble("fine again in {directory}")
        self.assertIsNone(trouble.report(None, directory="/d"))
        self.assertEqual(trouble.report("broken"), Notice(LogLevel.warn, "{problem}", {"problem": "broken"}))
        self.assertIsNone(trouble.report("broken"))
        self.assertEqual(trouble.report("worse", LogLevel.error), Notice(LogLevel.error, "{problem}", {"problem": "worse"}))
        self.assertIsNone(trouble.report("broken"))  # said already in this trouble: reasons that alternate are said once
        ended = Notice(LogLevel.info, "fine again in {directory}", {"directory": "/d", "failures": 4})
        self.assertEqual(trouble.report(None, directory="/d"), ended)
        self.assertEqual(trouble.report("broken"), Notice(LogLevel.warn, "{problem}", {"problem": "broken"}))  # a new trouble

    def test_the_start_line_may_say_more_than_the_reason_it_compares(self) -> None:
        trouble = Trouble("back", started="{problem}; retrying in {retry}s")
        notice = trouble.report("down", retry=1)
        assert notice is not None
        self.assertEqual((notice.format, notice.fields), ("{problem}; retrying in {retry}s", {"problem": "down", "retry": 1}))
        self.assertIsNone(trouble.report("down", retry=2))


class BackoffTests(SynchronousTestCase):
    def test_doubles_to_its_cap_and_starts_afresh_when_reset(self) -> None:
        backoff = Backoff(1.0, 10.0)
        self.assertEqual([backoff.next() for _ in range(6)], [1.0, 2.0, 4.0, 8.0, 10.0, 10.0])
        backoff.reset()
        self.assertEqual(backoff.next(), 1.0)


class RetryingTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.events: list[LogEvent] = []
        publisher = LogPublisher(cast(ILogObserver, self.events.append))
        self.retrying = Retrying(
            self.clock, Logger(observer=publisher), Trouble("works again after {failures} failed attempts"), Backoff(1.0, 8.0), "test"
        )
        self.attempts = 0

    def attempt(self) -> None:
        self.attempts += 1

    def test_retries_with_the_back_off_and_says_the_trouble_once(self) -> None:
        waits = [self.retrying.failed("down", self.attempt)]
        for _ in range(5):
            self.clock.advance(waits[-1])
            waits.append(self.retrying.failed("down", self.attempt))
        self.assertEqual((waits, self.attempts), ([1.0, 2.0, 4.0, 8.0, 8.0, 8.0], 5))
        self.assertEqual([event["log_level"] for event in self.events], [LogLevel.warn])
        self.assertEqual(self.events[0]["retry"], 1.0)
        self.retrying.succeeded()
        self.assertEqual(self.events[-1]["failures"], 6)
        self.assertEqual(self.retrying.failed("down", self.attempt), 1.0)

    def test_a_wait_may_be_held_shorter_and_a_pending_retry_cancelled(self) -> None:
        for _ in range(4):
            self.retrying.failed("cannot connect", self.attempt, most=2.0)
        self.assertEqual([call.getTime() for call in self.clock.getDelayedCalls()], [2.0])
        self.assertEqual(self.events[0]["cap"], 2.0)  # the line says how often it tries
        self.retrying.cancel()
        self.assertEqual(self.clock.getDelayedCalls(), [])
