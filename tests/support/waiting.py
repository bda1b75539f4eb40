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


def eventually(condition: Callable[[], object], what: str, timeout: float = 60.0) -> None:
    """``until`` for a test that does not run on the reactor: polls ``condition`` until it holds; AssertionError
    naming ``what`` if it does not within ``timeout`` seconds (a generous bound, not a measure of speed)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached in time: {what}")
        time.sleep(0.01)
