"""systemd notifications on a real unix datagram socket: ready, stopping, and a watchdog the reactor feeds."""

import os
import socket
import time
from typing import Any

from twisted.internet import reactor
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase, TestCase

from koordrp.systemd import SystemdNotifier, notify_address, watchdog_interval
from tests.support.logs import logged_events
from tests.support.tempdirs import short_tempdir


class Listener:
    """What systemd would receive on ``$NOTIFY_SOCKET``, each datagram with the time it came."""

    def __init__(self, address: str) -> None:
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.socket.bind(address)
        self.socket.setblocking(False)
        self.received: list[tuple[float, bytes]] = []

    def collect(self) -> list[bytes]:
        while True:
            try:
                self.received.append((time.monotonic(), self.socket.recv(4096)))
            except BlockingIOError:
                return [message for _, message in self.received]

    def close(self) -> None:
        self.socket.close()


class EnvironmentTests(SynchronousTestCase):
    def test_addresses_and_intervals(self) -> None:
        self.assertEqual(notify_address({"NOTIFY_SOCKET": "/run/systemd/notify"}), "/run/systemd/notify")
        self.assertEqual(notify_address({"NOTIFY_SOCKET": "@abstract"}), "\0abstract")
        self.assertIsNone(notify_address({}))
        self.assertEqual(watchdog_interval({"WATCHDOG_USEC": "30000000"}, 7), 15.0)
        self.assertEqual(watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "7"}, 7), 15.0)
        self.assertIsNone(watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "8"}, 7))
        self.assertIsNone(watchdog_interval({"WATCHDOG_USEC": "soon"}, 7))
        self.assertIsNone(watchdog_interval({}, 7))

    def test_without_systemd_nothing_is_sent_and_nothing_breaks(self) -> None:
        opened: list[tuple[object, ...]] = []
        real_socket = socket.socket

        def recording(*args: Any, **kwargs: Any) -> socket.socket:
            opened.append(args)
            return real_socket(*args, **kwargs)

        # Every notification is a datagram from a socket of its own: none opened is none sent.
        self.patch(socket, "socket", recording)
        clock = Clock()
        events = logged_events(self)
        # A watchdog interval alone (no $NOTIFY_SOCKET) has nowhere to send to: nothing is scheduled either.
        notifier = SystemdNotifier(clock, {"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid())})
        notifier.startService()
        self.assertEqual(clock.getDelayedCalls(), [])
        clock.pump([0.5] * 10)
        notifier.stopService()
        self.assertEqual((opened, events), ([], []))

    def test_a_socket_that_is_gone_costs_one_warning(self) -> None:
        clock = Clock()
        address = os.path.join(short_tempdir(self), "nobody")
        events = logged_events(self)
        notifier = SystemdNotifier(clock, {"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "1000000"})
        notifier.startService()
        clock.pump([0.5] * 10)
        notifier.stopService()
        self.assertEqual([event["log_format"] for event in events], ["cannot notify systemd at {address}: {reason}"])


class NotifyTests(TestCase):
    def setUp(self) -> None:
        self.address = os.path.join(short_tempdir(self), "notify")
        self.listener = Listener(self.address)
        self.addCleanup(self.listener.close)

    def test_ready_then_stopping(self) -> None:
        notifier = SystemdNotifier(reactor, {"NOTIFY_SOCKET": self.address})
        notifier.startService()
        self.assertEqual(self.listener.collect(), [b"READY=1"])
        notifier.stopService()
        self.assertEqual(self.listener.collect(), [b"READY=1", b"STOPPING=1"])

    def test_an_abstract_socket(self) -> None:
        name = f"koordrp-test-{os.getpid()}-{time.monotonic_ns()}"
        abstract = Listener("\0" + name)
        self.addCleanup(abstract.close)
        notifier = SystemdNotifier(reactor, {"NOTIFY_SOCKET": "@" + name})
        notifier.startService()
        notifier.stopService()
        self.assertEqual(abstract.collect(), [b"READY=1", b"STOPPING=1"])

    def test_the_watchdog_is_fed_by_the_reactor_and_starves_when_it_stalls(self) -> None:
        environ = {"NOTIFY_SOCKET": self.address, "WATCHDOG_USEC": "100000", "WATCHDOG_PID": str(os.getpid())}
        clock = Clock()
        notifier = SystemdNotifier(clock, environ)
        notifier.startService()
        self.addCleanup(notifier.stopService)
        clock.pump([0.05] * 10)
        self.assertEqual(self.listener.collect().count(b"WATCHDOG=1"), 10)  # every 50 ms, half of WatchdogSec
        # A reactor that does not turn (a deadlock) feeds nothing, however long it stalls.
        self.assertEqual(self.listener.collect().count(b"WATCHDOG=1"), 10)
        clock.pump([0.05] * 3)
        self.assertEqual(self.listener.collect().count(b"WATCHDOG=1"), 13)  # fed again
