"""Handing work to the reactor from other threads (koordrp.cri.handoff), on the real reactor."""

import errno
import os
import select
import threading
from typing import Callable, cast

from twisted.internet import reactor
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IReactorFDSet, IReactorFromThreads
from twisted.logger import ILogObserver, LogEvent, LogLevel, formatEvent, globalLogPublisher
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase

from koordrp.cri.handoff import Later, TimerFD
from tests.support.waiting import until

THREADS = IReactorFromThreads(reactor)


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


class LaterTests(TestCase):
    def later(self) -> tuple[Later, PipeTimer]:
        timer = PipeTimer()
        later = Later(THREADS, timer)
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

        wakes = self.wakes_from_this_thread(queue_both)
        self.assertEqual((timer.arms, wakes, ran), (1, 0, []))  # one wake coming, for both, and none now
        timer.expire()
        yield Deferred.fromCoroutine(until(lambda: timer.clears == 1))
        self.assertEqual(ran, [("first", True), ("second", True)])
        from_another_thread(lambda: later.queue(work, "third"))
        self.assertEqual(timer.arms, 2)  # the first wake has come: the next work arms the timer again
        timer.expire()
        yield Deferred.fromCoroutine(until(lambda: len(ran) == 3))

    def wakes_from_this_thread(self, work: Callable[[], None]) -> int:
        """How many times ``work``, run on a thread of its own, woke the reactor."""
        wakes: list[threading.Thread] = []
        thread = threading.Thread(target=work)
        wake_up = reactor.wakeUp  # type: ignore[attr-defined]

        def counted() -> None:
            wakes.append(threading.current_thread())
            wake_up()

        self.patch(reactor, "wakeUp", counted)
        thread.start()
        thread.join()
        return sum(1 for woke in wakes if woke is thread)

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
        later = Later(THREADS, TimerFD(0.001))
        self.addCleanup(later.close)
        ran: Deferred[bool] = Deferred()
        from_another_thread(lambda: later.queue(lambda: ran.callback(threading.current_thread() is threading.main_thread())))
        self.assertTrue((yield ran))


    @inlineCallbacks
    def test_a_timer_that_cannot_be_armed_is_said_once_and_work_then_wakes_the_reactor_at_once(self):  # type: ignore[no-untyped-def]
        timer = BrokenTimer()
        later = Later(THREADS, timer)
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
        later = Later(other, timer)  # type: ignore[arg-type]
        later.queue(lambda: "ran")
        self.assertEqual((other.called, timer.arms, timer.closed), (["ran"], 0, True))


class TimerFDTests(SynchronousTestCase):
    def test_it_must_expire_after_some_time(self) -> None:
        for seconds in (0, 1e-10, -1):
            self.assertRaises(ValueError, TimerFD, seconds)

    def test_it_is_readable_once_it_expires_and_not_once_cleared(self) -> None:
        timer = TimerFD(0.001)
        self.addCleanup(timer.close)
        self.assertEqual(select.select([timer], [], [], 0)[0], [])
        timer.arm()
        # Waits for it to expire (the bound is for a machine so loaded that it never does, not a measure of speed).
        self.assertEqual(select.select([timer], [], [], 30)[0], [timer])
        timer.clear()
        self.assertEqual(select.select([timer], [], [], 0)[0], [])
