"""What koordrp logs during a test."""

from typing import cast

from twisted.logger import ILogObserver, LogEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase


def logged_events(case: SynchronousTestCase, namespace: str | None = None) -> list[LogEvent]:
    """Every event logged from now until ``case`` ends, in order (``namespace``: only those logged there)."""
    events: list[LogEvent] = []

    def observe(event: LogEvent) -> None:
        if namespace is None or event.get("log_namespace") == namespace:
            events.append(event)

    observer = cast(ILogObserver, observe)
    globalLogPublisher.addObserver(observer)
    case.addCleanup(globalLogPublisher.removeObserver, observer)
    return events
