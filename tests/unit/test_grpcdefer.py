"""grpc futures as Deferreds: what grpc's thread hands the reactor, and what it never loses."""

from typing import Any, Callable, cast

import grpc
from twisted.internet.defer import Deferred
from twisted.trial.unittest import SynchronousTestCase

from koordrp.grpcdefer import when_done


class StandInFuture:
    """What ``when_done`` uses of a grpc future; ``finish`` is grpc's thread calling back."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[Any], None]] = []
        self.was_cancelled = False

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        self.callbacks.append(callback)

    def cancel(self) -> bool:
        self.was_cancelled = True
        self.finish()  # grpc calls back on the cancelling thread
        return True

    def cancelled(self) -> bool:
        return self.was_cancelled

    def finish(self) -> None:
        for callback in self.callbacks:
            callback(self)


class AtOnce:
    """A reactor whose calls from threads run at once, in order."""

    def callFromThread(self, f: Callable[..., object], *args: object, **kwargs: object) -> None:
        f(*args, **kwargs)


def when(
    future: StandInFuture, read: Callable[[Any], object], handed: Callable[[object, Callable[[], None]], None] | None = None
) -> "Deferred[object]":
    return when_done(cast("grpc.Future[object]", future), cast(Any, AtOnce()), read, handed)


class WhenDoneTests(SynchronousTestCase):
    def test_the_reactor_has_the_value_once_whoever_is_handed_it_hands_it_over(self) -> None:
        future, handed = StandInFuture(), cast(list[tuple[object, Callable[[], None]]], [])
        done = when(future, lambda _: "answer", lambda value, hand_over: handed.append((value, hand_over)))
        future.finish()
        [(value, hand_over)] = handed
        self.assertEqual(value, "answer")
        self.assertNoResult(done)
        hand_over()
        self.assertEqual(self.successResultOf(done), "answer")

    def test_without_anyone_handed_it_the_reactor_has_the_value_at_once(self) -> None:
        future = StandInFuture()
        done = when(future, lambda _: "answer")
        future.finish()
        self.assertEqual(self.successResultOf(done), "answer")

    def test_a_read_that_fails_fails_the_deferred_and_hands_nothing(self) -> None:
        future, handed = StandInFuture(), cast(list[object], [])

        def read(_: object) -> object:
            raise KeyError("unreadable")

        done = when(future, read, lambda value, _: handed.append(value))
        future.finish()
        self.failureResultOf(done, KeyError)
        self.assertEqual(handed, [])

    def test_a_cancelled_call_is_not_read(self) -> None:
        future, reads = StandInFuture(), cast(list[object], [])
        done = when(future, lambda f: reads.append(f))
        done.cancel()
        self.assertTrue(future.was_cancelled)
        self.assertEqual(reads, [])
        self.failureResultOf(done)
