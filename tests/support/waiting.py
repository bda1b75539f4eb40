"""Waiting on the real reactor for something a test expects to happen: an event, never a fixed time."""

import time
from typing import Callable

from twisted.internet import reactor
from twisted.internet.task import deferLater


async def until(condition: Callable[[], object], timeout: float = 30.0) -> None:
    """Once ``condition()`` is true; AssertionError if it does not within ``timeout`` seconds (a generous bound
    for a loaded machine, not a measure of speed)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await deferLater(reactor, 0.01, lambda: None)
