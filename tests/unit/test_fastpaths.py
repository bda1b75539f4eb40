"""The one door to Twisted's and CPython's private parts (koordrp.fastpaths): each fast path checked, taken where
it holds, and the public way where it does not or the environment says so."""

import select
import socket
import threading
from collections import deque
from typing import Callable, cast

from twisted.internet import reactor
from twisted.internet.base import ReactorBase
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.interfaces import IConsumer, IReactorFromThreads, IReactorSocket, ISystemHandle, ITransport
from twisted.internet.protocol import Protocol, ServerFactory
from twisted.internet.testing import StringTransport
from twisted.logger import LogEvent, LogLevel, formatEvent
from twisted.trial.unittest import SynchronousTestCase, TestCase
from zope.interface import implementer

from koordrp import fastpaths, tap
from koordrp.fastpaths import AT_ONCE, ENVIRONMENT, TIMER, TIMERFD_FROM, UNWOKEN, FastPaths, TimerFD, Verdict
from tests.support.logs import logged_events

THREADS = IReactorFromThreads(reactor)
ON = FastPaths({})
OFF = FastPaths({ENVIRONMENT: "0"})

Calls = list[tuple[Callable[..., object], tuple[object, ...], dict[str, object]]]


class TwistedShapedReactor:
    """A reactor whose ``callFromThread`` is Twisted's own (ReactorBase's), on a queue the test turns, counting wakes."""

    callFromThread = ReactorBase.callFromThread

    def __init__(self, queue: Calls | None = None) -> None:
        self.threadCallQueue: Calls = [] if queue is None else queue
        self.wakes = 0

    def wakeUp(self) -> None:
        self.wakes += 1

    def turn(self) -> None:
        """Run what is queued, in order, as the reactor's turn does."""
        while self.threadCallQueue:
            work, args, kwargs = self.threadCallQueue.pop(0)
            work(*args, **kwargs)


class NotTwistedsReactor:
    """A reactor whose ``callFromThread`` is its own (asyncio's is): what is queued for it cannot wait unwoken."""

    def __init__(self) -> None:
        self.called: list[object] = []

    def callFromThread(self, work: Callable[..., object], *args: object) -> None:
        self.called.append(work(*args))


class Reshaped(list[tuple[Callable[..., object], tuple[object, ...], dict[str, object]]]):
    """A queue that keeps calls in a shape of its own, as a later Twisted might."""

    def append(self, entry: tuple[Callable[..., object], tuple[object, ...], dict[str, object]]) -> None:
        super().append((entry[0], (entry[1], entry[2]), {}))


def logged(case: SynchronousTestCase) -> list[LogEvent]:
    """What koordrp.fastpaths logs from now until ``case`` ends."""
    return logged_events(case, "koordrp.fastpaths")


class EnvironmentTests(SynchronousTestCase):
    def test_these_values_turn_every_path_off_and_say_so(self) -> None:
        for value in ("0", "false", "OFF", " no "):
            paths = FastPaths({ENVIRONMENT: value})
            self.assertEqual(paths.turned_off, f"{ENVIRONMENT}={value}")
            verdicts = paths.check(cast(IReactorFromThreads, TwistedShapedReactor()))
            self.assertEqual([v.off for v in verdicts], [f"{ENVIRONMENT}={value}"] * 3)

    def test_other_values_or_none_leave_them_on(self) -> None:
        for environ in ({}, {ENVIRONMENT: "1"}, {ENVIRONMENT: ""}, {"OTHER": "0"}):
            paths = FastPaths(environ)
            self.assertIsNone(paths.turned_off)
            self.assertEqual(paths.check(THREADS), [Verdict(UNWOKEN), Verdict(TIMER), Verdict(AT_ONCE)])

    def test_turned_off_no_path_is_offered(self) -> None:
        fake = TwistedShapedReactor()
        self.assertIsNone(OFF.unwoken(cast(IReactorFromThreads, fake)))
        self.assertIsNone(OFF.timer(0.001))
        self.assertIsNone(OFF.socket_send(StringTransport()))
        self.assertEqual((fake.threadCallQueue, fake.wakes), ([], 0))  # nothing checked on it


class UnwokenTests(SynchronousTestCase):
    def test_work_waits_unwoken_for_the_next_wake_and_runs_in_order_with_it(self) -> None:
        fake = TwistedShapedReactor()
        queue = ON.unwoken(cast(IReactorFromThreads, fake))
        assert queue is not None
        fake.turn()  # the check's probe
        wakes, ran = fake.wakes, cast(list[str], [])
        queue(ran.append, "unwoken")
        self.assertEqual((fake.wakes, ran), (wakes, []))
        cast(IReactorFromThreads, fake).callFromThread(ran.append, "woken")
        self.assertEqual(fake.wakes, wakes + 1)
        fake.turn()
        self.assertEqual(ran, ["unwoken", "woken"])

    def test_a_reactor_whose_callFromThread_is_its_own_is_woken_for_everything(self) -> None:
        other = NotTwistedsReactor()
        self.assertIsNone(ON.unwoken(cast(IReactorFromThreads, other)))
        unwoken, timer, _ = ON.check(cast(IReactorFromThreads, other))
        self.assertIn("not Twisted's", str(unwoken.off))
        self.assertIn("cannot wait unwoken", str(timer.off))

    def test_a_queue_that_is_no_list_or_keeps_another_shape_is_not_used(self) -> None:
        for queue, why in (
            (cast(Calls, deque()), "no threadCallQueue list"),
            (Reshaped(), "no longer queues (f, args, kwargs)"),
        ):
            fake = TwistedShapedReactor(queue)
            self.assertIsNone(ON.unwoken(cast(IReactorFromThreads, fake)))
            self.assertIn(why, str(ON.check(cast(IReactorFromThreads, fake))[0].off))

    def test_a_reactor_without_wakeUp_is_not_used(self) -> None:
        fake = TwistedShapedReactor()
        fake.wakeUp = None  # type: ignore[assignment,method-assign]
        self.assertIsNone(ON.unwoken(cast(IReactorFromThreads, fake)))


class UnwokenOnTheReactorTests(TestCase):
    @inlineCallbacks
    def test_work_queued_from_a_thread_waits_for_the_next_wake_and_runs_first(self):  # type: ignore[no-untyped-def]
        queue = ON.unwoken(THREADS)
        assert queue is not None
        ran: list[tuple[str, bool]] = []
        done: Deferred[None] = Deferred()

        def work(name: str) -> None:
            ran.append((name, threading.current_thread() is threading.main_thread()))

        def from_a_thread() -> None:
            queue(work, "unwoken")
            THREADS.callFromThread(work, "woken")
            THREADS.callFromThread(done.callback, None)

        wakes: list[threading.Thread] = []
        wake_up = reactor.wakeUp  # type: ignore[attr-defined]

        def counted() -> None:
            wakes.append(threading.current_thread())
            wake_up()

        self.patch(reactor, "wakeUp", counted)
        thread = threading.Thread(target=from_a_thread)
        thread.start()
        thread.join()
        yield done
        self.assertEqual(ran, [("unwoken", True), ("woken", True)])
        self.assertEqual(sum(1 for woke in wakes if woke is thread), 2)  # the two callFromThread alone


class TimerTests(SynchronousTestCase):
    def test_it_must_expire_after_some_time(self) -> None:
        for seconds in (0, 1e-10, -1):
            self.assertRaises(ValueError, TimerFD, seconds)

    def test_it_is_readable_once_it_expires_and_not_once_cleared(self) -> None:
        timer = ON.timer(0.001)
        assert timer is not None
        self.addCleanup(timer.close)
        self.assertEqual(select.select([timer], [], [], 0)[0], [])
        timer.arm()
        # Waits for it to expire (the bound is for a machine so loaded that it never does, not a measure of speed).
        self.assertEqual(select.select([timer], [], [], 30)[0], [timer])
        timer.clear()
        self.assertEqual(select.select([timer], [], [], 0)[0], [])

    def test_the_check_names_where_the_timerfd_comes_from(self) -> None:
        self.assertIn(TIMERFD_FROM, TIMER.uses)
        self.assertIn(TIMERFD_FROM, ("os.timerfd_*", "libc's timerfd_* through ctypes"))


@implementer(ISystemHandle)
class BlockingSocketTransport(StringTransport):
    """A transport whose handle is a socket that blocks: writing to it beside the transport could hold the reactor."""

    def __init__(self, handle: socket.socket) -> None:
        super().__init__()
        self._handle = handle

    def getHandle(self) -> socket.socket:
        return self._handle


class SocketSendTests(TestCase):
    def transport(self) -> tuple[ITransport, socket.socket]:
        """A Twisted transport over one end of a socket pair, and the other end."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.addCleanup(theirs.close)
        made: list[ITransport] = []

        class Made(Protocol):
            def connectionMade(self) -> None:
                assert self.transport is not None
                made.append(self.transport)

        factory = ServerFactory()
        factory.protocol = Made
        IReactorSocket(reactor).adoptStreamConnection(ours.fileno(), socket.AF_UNIX, factory)
        ours.close()  # the reactor holds its own copy
        self.addCleanup(lambda: made[0].abortConnection())  # type: ignore[attr-defined]
        return made[0], theirs

    def test_what_the_socket_takes_is_written_before_the_reactor_turns(self) -> None:
        transport, theirs = self.transport()
        send = ON.socket_send(transport)
        assert send is not None
        self.assertEqual(send(b"the answer"), len(b"the answer"))
        self.assertEqual(theirs.recv(100), b"the answer")

    def test_a_full_socket_takes_nothing_and_raises_nothing(self) -> None:
        transport, _ = self.transport()
        send = ON.socket_send(transport)
        assert send is not None
        while send(b"x" * 65536):
            pass
        self.assertEqual(send(b"more"), 0)

    def test_a_transport_without_a_nonblocking_stream_socket_is_written_through_said_once_each(self) -> None:
        events = logged(self)
        paths = FastPaths({})
        blocking, other = socket.socketpair()
        self.addCleanup(blocking.close)
        self.addCleanup(other.close)
        for transport in (StringTransport(), StringTransport(), BlockingSocketTransport(blocking)):
            self.assertIsNone(paths.socket_send(transport))
        lines = [formatEvent(event) for event in events]
        self.assertEqual(len(lines), 2)
        self.assertIn("the transport has no system handle", lines[0])
        self.assertIn("the transport's socket blocks", lines[1])

    def test_a_transport_that_is_no_consumer_is_written_through(self) -> None:
        @implementer(ISystemHandle)
        class NoConsumer:
            def getHandle(self) -> socket.socket:
                raise AssertionError("never asked for")

        self.assertFalse(IConsumer.providedBy(NoConsumer()))
        self.assertIsNone(FastPaths({}).socket_send(cast(ITransport, NoConsumer())))


class AnnounceTests(SynchronousTestCase):
    def test_on_it_names_every_path_and_what_it_leans_on_in_one_line(self) -> None:
        events = logged(self)
        ON.announce(THREADS)
        self.assertEqual(len(events), 1)
        self.assertEqual(events[0]["log_level"], LogLevel.info)
        line = formatEvent(events[0])
        self.assertTrue(line.startswith("fast paths on: "), line)
        for path in (UNWOKEN, TIMER, AT_ONCE):
            self.assertIn(f"{path.name} ({path.uses})", line)
        self.assertNotIn("off:", line)
        self.assertIn(f"{ENVIRONMENT}=0 turns them off", line)

    def test_turned_off_by_the_environment_it_says_so_and_what_is_done_instead(self) -> None:
        events = logged(self)
        OFF.announce(THREADS)
        self.assertEqual(len(events), 1)
        line = formatEvent(events[0])
        self.assertTrue(line.startswith(f"fast paths off ({ENVIRONMENT}=0): "), line)
        for path in (UNWOKEN, TIMER, AT_ONCE):
            self.assertIn(path.name, line)
            self.assertIn(path.instead, line)

    def test_a_path_whose_check_fails_is_named_off_with_why_and_what_instead(self) -> None:
        events = logged(self)
        ON.announce(cast(IReactorFromThreads, NotTwistedsReactor()))
        line = formatEvent(events[0])
        self.assertIn(f"fast paths on: {AT_ONCE.name}", line)
        self.assertIn(f"off: {UNWOKEN.name} (the reactor's callFromThread is not Twisted's", line)
        self.assertIn(f"instead: {UNWOKEN.instead}", line)

    def test_by_default_it_checks_the_installed_reactor_as_the_environment_says(self) -> None:
        events = logged(self)
        fastpaths.announce()
        self.assertEqual(len(events), 1)
        self.assertIn("fast paths o", formatEvent(events[0]))

    def test_it_names_only_the_paths_the_modes_front_end_takes(self) -> None:
        events = logged(self)
        ON.announce(THREADS, used=tap.FAST_PATHS["NRI"])
        ON.announce(THREADS, used=tap.FAST_PATHS["Containerd"])
        ON.announce(THREADS, used=tap.FAST_PATHS["Docker"])
        nri, proxy, docker = (formatEvent(event) for event in events)
        self.assertIn(AT_ONCE.name, nri)
        self.assertNotIn(UNWOKEN.name, nri)
        self.assertIn(UNWOKEN.name, proxy)
        self.assertIn(TIMER.name, proxy)
        self.assertIn(AT_ONCE.name, proxy)  # hook calls, in every mode
        self.assertIn(AT_ONCE.name, docker)
        self.assertNotIn(UNWOKEN.name, docker)
        self.assertNotIn(TIMER.name, docker)
