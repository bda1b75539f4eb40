"""A trouble that starts, repeats and ends, said once: the one rule for every failure koordrp keeps retrying.

A failure that repeats (containerd's NRI refusing koordrp, a runtime that cannot be read, a directory
that cannot be watched) gets one line when it starts, one for each reason not yet given while it
lasts, and one when it ends, which says how many attempts failed in between; never a line per
attempt. ``Trouble`` is that rule as plain code; ``Backoff`` spaces the attempts; ``Retrying`` puts
both on the reactor's clock, with a line's logger and a counter on /metrics
(``koordrp_failed_attempts_total{activity}``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping

from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger, LogLevel

if TYPE_CHECKING:
    # Only --metrics-endpoint loads prometheus_client: it costs a node daemon ~6 MB of RSS.
    from koordrp.metrics import Metrics


@dataclass(frozen=True)
class Notice:
    """A log line decided on by plain code and written by the service."""

    level: LogLevel
    format: str
    fields: Mapping[str, object] = field(default_factory=dict)


class Trouble:
    """One ongoing problem: said when it starts, when its reason is one not given yet, and once when it is over."""

    def __init__(self, resolved: str, started: str = "{problem}") -> None:
        """``resolved`` is the line for its end (its fields: those given then, and ``failures``); ``started`` the
        line for a reason (its fields: ``problem`` and those given with it)."""
        self._resolved = resolved
        self._started = started
        self.current: str | None = None
        self.failures = 0
        """Reports of a problem since it started."""
        self._said: set[str] = set()

    def report(self, problem: str | None, level: LogLevel = LogLevel.warn, **fields: object) -> Notice | None:
        """How it is now (None: fine); the line to write, if any."""
        if problem is None:
            ended = self.current is not None
            failures, self.current, self.failures = self.failures, None, 0
            self._said.clear()
            return Notice(LogLevel.info, self._resolved, {**fields, "failures": failures}) if ended else None
        self.current = problem
        self.failures += 1
        if problem in self._said:
            return None
        self._said.add(problem)
        return Notice(level, self._started, {"problem": problem, **fields})


RETRY_SECONDS = 1.0
"""The wait after a first failure of what koordrp keeps retrying; it doubles after each next one, up to RETRY_CAP_SECONDS."""
RETRY_CAP_SECONDS = 30.0
"""The longest wait between attempts. containerd that refuses koordrp logs each attempt and does the same work
each time; a CRI front end reads the runtime again as soon as it is reachable again, whatever the wait, and a
call about what the store lacks reads it back itself."""


class Backoff:
    """The wait before each next attempt: ``first`` seconds, doubled after each failure, at most ``cap``."""

    def __init__(self, first: float, cap: float) -> None:
        self.first = first
        self.cap = cap
        self._next = first

    def next(self) -> float:
        delay, self._next = self._next, min(self._next * 2, self.cap)
        return delay

    def reset(self) -> None:
        self._next = self.first


class Retrying:
    """Something koordrp keeps trying until it works (``activity`` names it on /metrics), on the reactor."""

    def __init__(
        self,
        clock: IReactorTime,
        log: Logger,
        trouble: Trouble,
        backoff: Backoff,
        activity: str,
        metrics: Metrics | None = None,
    ) -> None:
        self._clock = clock
        self._log = log
        self._activity = activity
        self._metrics = metrics
        self.trouble = trouble
        self.backoff = backoff
        self._retry: IDelayedCall | None = None

    @property
    def failing(self) -> str | None:
        """The reason of the last failure, while it lasts."""
        return self.trouble.current

    def failed(
        self, problem: str, retry: Callable[[], None], level: LogLevel = LogLevel.warn, most: float | None = None, **fields: object
    ) -> float:
        """An attempt failed because of ``problem``: said if the rule says so, counted, and ``retry`` called
        after the back-off's wait (at most ``most`` seconds, if given); the wait is returned."""
        delay = self.backoff.next()
        if most is not None:
            delay = min(delay, most)
        if self._metrics is not None:
            self._metrics.failed_attempts.labels(self._activity).inc()
        cap = self.backoff.cap if most is None else min(most, self.backoff.cap)
        self._emit(self.trouble.report(problem, level, retry=delay, cap=cap, **fields))
        self.cancel()
        self._retry = self._clock.callLater(delay, retry)
        return delay

    def succeeded(self, **fields: object) -> None:
        """An attempt worked: the trouble, if there was one, is over, and the back-off starts afresh."""
        self.backoff.reset()
        self._emit(self.trouble.report(None, LogLevel.info, **fields))

    def cancel(self) -> None:
        """No retry is pending after this."""
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
        self._retry = None

    def _emit(self, notice: Notice | None) -> None:
        if notice is not None:
            self._log.emit(notice.level, notice.format, **notice.fields)
