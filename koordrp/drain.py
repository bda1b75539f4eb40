"""Waiting, within a bound, for the moment nothing is in flight any more: how a stop drains what runs."""

from typing import Callable

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime


class Drain:
    """Who waits until what is in flight has ended (what starts meanwhile included), or a bound has passed.

    Its owner says ``idle()`` each time the last thing in flight ends; at the bound, ``at_bound`` runs
    first (to cut what still runs), then the waiters go on.
    """

    def __init__(self, clock: IReactorTime) -> None:
        self._clock = clock
        self._waiters: list[Deferred[None]] = []
        self._bound: IDelayedCall | None = None

    def wait(self, busy: bool, timeout: float, at_bound: Callable[[], None] = lambda: None) -> Deferred[None]:
        """Fires once ``idle()`` is said (at once if nothing is ``busy``), or after ``timeout`` seconds; a second
        wait keeps the first one's bound."""
        waiter: Deferred[None] = Deferred()
        if not busy:
            waiter.callback(None)
            return waiter
        self._waiters.append(waiter)
        if self._bound is None:
            self._bound = self._clock.callLater(max(timeout, 0.0), self._passed, at_bound)
        return waiter

    @property
    def waiting(self) -> bool:
        return bool(self._waiters)

    def idle(self) -> None:
        """Nothing is in flight any more."""
        if self._bound is not None and self._bound.active():
            self._bound.cancel()
        self._bound = None
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.callback(None)

    def _passed(self, at_bound: Callable[[], None]) -> None:
        self._bound = None
        at_bound()
        self.idle()
