"""What koordrp logs during a test."""

from typing import cast

from twisted.logger import ILogObserver, LogEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase


def logged_events(case: SynchronousTestCase) -> list[LogEvent]:
    """Every event logged from now until ``case`` ends, in order."""
    events: list[LogEvent] = []
    observer = cast(ILogObserver, events.append)
    globalLogPublisher.addObserver(observer)
    case.addCleanup(globalLogPublisher.removeObserver, observer)
    return events
