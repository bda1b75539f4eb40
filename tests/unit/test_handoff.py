"""Handing work to the reactor from other threads (koordrp.cri.handoff), on the real reactor, with the fast paths
on and off."""

import errno
import os
import threading
from typing import Callable, cast

from twisted.internet import reactor
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IReactorFDSet, IReactorFromThreads
from twisted.logger import ILogObserver, LogEvent, LogLevel, formatEvent, globalLogPublisher
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase

from koordrp.cri.handoff import Later
from koordrp.fastpaths import ENVIRONMENT, FastPaths, TimerFD
from tests.support.waiting import until

THREADS = IReactorFromThreads(reactor)
ON = FastPaths({})
OFF = FastPaths({ENVIRONMENT: "0"})


class PipeTimer:
    """A timer that expires when the test says (``expire``): a pipe the reactor reads, as it reads a timerfd."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.arms = 0
        self.clears = 0
        self.closed = False

    def fileno(self) -> int:
        return self._read

    def arm(self) -> None:
        self.arms += 1

    def expire(self) -> None:
        os.write(self._write, b"\x01")

    def clear(self) -> None:
        self.clears += 1
        try:
            os.read(self._read, 8)
        except BlockingIOError:
            pass

    def close(self) -> None:
        self.closed = True
        os.close(self._read)
        os.close(self._write)


def from_another_thread(work: Callable[[], object]) -> None:
    """Run ``work`` on a thread of its own, to its end: the reactor, whose thread waits here, does not turn."""
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()


def wakes_from_a_thread(case: SynchronousTestCase, work: Callable[[], None]) -> int:
    """How many times ``work``, run on a thread of its own, woke the reactor."""
    wakes: list[threading.Thread] = []
    thread = threading.Thread(target=work)
    wake_up = reactor.wakeUp  # type: ignore[attr-defined]

    def counted() -> None:
        wakes.append(threading.current_thread())
        wake_up()

    case.patch(reactor, "wakeUp", counted)
    thread.start()
    thread.join()
    return sum(1 for woke in wakes if woke is thread)


class LaterTests(TestCase):
    def later(self) -> tuple[Later, PipeTimer]:
        timer = PipeTimer()
        later = Later(THREADS, timer, ON)
        self.addCleanup(later.close)
        return later, timer

    @inlineCallbacks
    def test_work_from_threads_waits_for_the_timer_armed_once_then_runs_in_order_on_the_reactor(self):  # type: ignore[no-untyped-def]
        later, timer = self.later()
        ran: list[tuple[str, bool]] = []

        def work(name: str) -> None:
            ran.append((name, threading.current_thread() is threading.main_thread()))

        def queue_both() -> None:
            later.queue(work, "first")
            later.queue(work, "second")

        wakes = wakes_from_a_thread(self, queue_both)
        self.assertEqual((timer.arms, wakes, ran), (1, 0, []))  # one wake coming, for both, and none now
        timer.expire()
        yield Deferred.fromCoroutine(until(lambda: timer.clears == 1))
        self.assertEqual(ran, [("first", True), ("second", True)])
        from_another_thread(lambda: later.queue(work, "third"))
        self.assertEqual(timer.arms, 2)  # the first wake has come: the next work arms the timer again
        timer.expire()
        yield Deferred.fromCoroutine(until(lambda: len(ran) == 3))

    @inlineCallbacks
    def test_work_queued_before_something_else_wakes_the_reactor_runs_before_it(self):  # type: ignore[no-untyped-def]
        later, timer = self.later()
        ran: list[str] = []
        done: Deferred[None] = Deferred()

        def queue_then_wake() -> None:
            later.queue(ran.append, "later")
            THREADS.callFromThread(done.callback, None)

        from_another_thread(queue_then_wake)
        yield done
        self.assertEqual((ran, timer.clears), (["later"], 0))

    @inlineCallbacks
    def test_once_closed_the_timer_is_gone_and_work_wakes_the_reactor_at_once(self):  # type: ignore[no-untyped-def]
        later, timer = self.later()
        later.close()
        self.assertTrue(timer.closed)
        self.assertNotIn(later, IReactorFDSet(reactor).getReaders())
        ran: Deferred[str] = Deferred()
        from_another_thread(lambda: later.queue(ran.callback, "ran"))
        self.assertEqual((yield ran), "ran")
        self.assertEqual(timer.arms, 0)

    @inlineCallbacks
    def test_with_a_real_timerfd_work_from_a_thread_runs_on_the_reactor(self):  # type: ignore[no-untyped-def]
        later = Later.on(THREADS, 0.001, ON)
        self.addCleanup(later.close)
        self.assertIsInstance(later._timer, TimerFD)
        ran: Deferred[bool] = Deferred()
        from_another_thread(lambda: later.queue(lambda: ran.callback(threading.current_thread() is threading.main_thread())))
        self.assertTrue((yield ran))

    @inlineCallbacks
    def test_a_timer_that_cannot_be_armed_is_said_once_and_work_then_wakes_the_reactor_at_once(self):  # type: ignore[no-untyped-def]
        timer = BrokenTimer()
        later = Later(THREADS, timer, ON)
        self.addCleanup(later.close)
        warnings = observed_warnings(self)
        ran: Deferred[str] = Deferred()
        from_another_thread(lambda: later.queue(ran.callback, "ran"))
        self.assertEqual((yield ran), "ran")
        yield Deferred.fromCoroutine(until(lambda: timer.closed))  # on the reactor, after the work
        again: Deferred[str] = Deferred()
        from_another_thread(lambda: later.queue(again.callback, "again"))
        self.assertEqual((yield again), "again")
        self.assertEqual(len(warnings), 1)
        self.assertIn("cannot arm the CRI calls' timer", formatEvent(warnings[0]))

    def test_a_timer_the_reactor_let_go_of_is_closed(self) -> None:
        later, timer = self.later()
        IReactorFDSet(reactor).removeReader(later)
        later.connectionLost(Failure(ConnectionDone()))
        self.assertTrue(timer.closed)


class BrokenTimer(PipeTimer):
    def arm(self) -> None:
        raise OSError(errno.EBADF, "Bad file descriptor")


def observed_warnings(case: SynchronousTestCase) -> list[LogEvent]:
    events: list[LogEvent] = []

    def observe(event: LogEvent) -> None:
        if event.get("log_level") is LogLevel.warn:
            events.append(event)

    observer = cast(ILogObserver, observe)
    globalLogPublisher.addObserver(observer)
    case.addCleanup(globalLogPublisher.removeObserver, observer)
    return events


class NotTwistedsReactor:
    """A reactor whose ``callFromThread`` is its own (asyncio's is): what is queued for it cannot wait unwoken."""

    def __init__(self) -> None:
        self.called: list[object] = []

    def callFromThread(self, work: Callable[..., object], *args: object) -> None:
        self.called.append(work(*args))


class LaterWithoutATimerTests(SynchronousTestCase):
    def test_a_reactor_that_is_not_twisteds_own_is_woken_at_once_and_the_timer_given_back(self) -> None:
        timer, other = PipeTimer(), NotTwistedsReactor()
        later = Later(other, timer, ON)  # type: ignore[arg-type]
        later.queue(lambda: "ran")
        self.assertEqual((other.called, timer.arms, timer.closed), (["ran"], 0, True))


class FastPathsOffTests(TestCase):
    """With the fast paths off, Later is callFromThread: the same work runs, in the same order, each woken at once."""

    @inlineCallbacks
    def test_work_from_threads_wakes_the_reactor_at_once_and_runs_in_order_on_it(self):  # type: ignore[no-untyped-def]
        timer = PipeTimer()
        later = Later(THREADS, timer, OFF)
        self.addCleanup(later.close)
        self.assertTrue(timer.closed)  # given back: nothing would wait for it
        self.assertNotIn(later, IReactorFDSet(reactor).getReaders())
        ran: list[tuple[str, bool]] = []
        done: Deferred[None] = Deferred()

        def work(name: str) -> None:
            ran.append((name, threading.current_thread() is threading.main_thread()))
            if len(ran) == 2:
                done.callback(None)

        def queue_both() -> None:
            later.queue(work, "first")
            later.queue(work, "second")

        self.assertEqual(wakes_from_a_thread(self, queue_both), 2)
        yield done
        self.assertEqual(ran, [("first", True), ("second", True)])

    def test_made_on_a_reactor_it_has_no_timer(self) -> None:
        later = Later.on(THREADS, 0.001, OFF)
        self.addCleanup(later.close)
        self.assertIsNone(later._timer)
