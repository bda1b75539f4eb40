"""State files are written whole or not at all; a full or read-only state directory costs warnings, never a call."""

import errno
import os
from typing import Any, Callable

from prometheus_client import generate_latest
from twisted.logger import LogEvent, LogLevel, formatEvent
from twisted.trial.unittest import SynchronousTestCase

from koordrp import tap
from koordrp.checkpoint import CheckpointError, DirectoryCheckpoint, NoCheckpoint
from koordrp.hooks.client import HookClients
from koordrp.hooks.dispatcher import Dispatcher
from koordrp.metrics import Metrics
from tests.fake.reactor import InlineThreadsReactor
from tests.support.logs import logged_events

BIG = bytes(range(256)) * 80  # 20 KiB: a container with many environment entries


def failing(number: int) -> OSError:
    return OSError(number, os.strerror(number))


def warnings(events: list[LogEvent]) -> list[str]:
    return [formatEvent(event) for event in events if event.get("log_level") is LogLevel.warn]


class WholeOrNothingTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.directory = self.mktemp()
        self.checkpoint = DirectoryCheckpoint(self.directory)
        self.checkpoint.open()
        self.path = os.path.join(self.directory, "containers", "c1")

    def files(self) -> list[str]:
        return sorted(os.listdir(os.path.join(self.directory, "containers")))

    def content(self) -> bytes:
        with open(self.path, "rb") as kept:
            return kept.read()

    def write_taking(self, sizes: Callable[[int], int | OSError]) -> None:
        """Until the test ends, the n-th os.write takes ``sizes(n)`` bytes at most, or raises what it gives."""
        real = os.write
        calls = [0]

        def write(descriptor: int, data: Any) -> int:
            calls[0] += 1
            taken = sizes(calls[0])
            if isinstance(taken, OSError):
                raise taken
            return real(descriptor, bytes(data)[:taken])

        self.patch(os, "write", write)

    def test_a_write_that_takes_a_few_bytes_at_a_time_still_keeps_all_of_it(self) -> None:
        events = logged_events(self)
        self.write_taking(lambda call: 7)
        self.checkpoint.write("containers", "c1", BIG)
        self.assertEqual((self.content(), self.files(), self.checkpoint.write_failures), (BIG, ["c1"], 0))
        self.assertEqual(warnings(events), [])
        self.assertEqual(self.checkpoint.count(), 1)

    def test_a_disk_filling_midway_leaves_the_previous_file_no_temporary_one_warning_naming_the_file(self) -> None:
        self.checkpoint.write("containers", "c1", b"what was kept before")
        events = logged_events(self)
        # As a full tmpfs does: the first write takes what fits (two pages), the next one fails.
        self.write_taking(lambda call: 8192 if call == 1 else failing(errno.ENOSPC))
        self.checkpoint.write("containers", "c1", BIG)
        self.assertEqual((self.content(), self.files()), (b"what was kept before", ["c1"]))
        [warning] = warnings(events)
        self.assertIn(f"cannot write {self.path}: No space left on device", warning)
        self.assertEqual(self.checkpoint.write_failures, 1)

    def test_a_write_that_takes_nothing_fails_rather_than_spins(self) -> None:
        self.write_taking(lambda call: 0)
        self.checkpoint.write("containers", "c1", b"x")
        self.assertEqual((self.files(), self.checkpoint.write_failures), ([], 1))

    def test_a_full_disk_warns_once_however_many_writes_fail_and_again_after_a_success(self) -> None:
        events = logged_events(self)
        full = [True]
        self.write_taking(lambda call: failing(errno.ENOSPC) if full[0] else 1 << 30)
        for identifier in ("c1", "c2", "c3"):
            self.checkpoint.write("containers", identifier, BIG)
        self.assertEqual(len(warnings(events)), 1)
        self.assertIn(self.path, warnings(events)[0])
        self.assertEqual((self.files(), self.checkpoint.write_failures), ([], 3))
        full[0] = False
        self.checkpoint.write("containers", "c4", BIG)
        full[0] = True
        self.checkpoint.write("containers", "c5", BIG)
        self.assertEqual(len(warnings(events)), 2)
        self.assertIn(os.path.join(self.directory, "containers", "c5"), warnings(events)[1])
        self.assertEqual((self.files(), self.checkpoint.write_failures), (["c4"], 4))

    def test_writes_and_removals_failing_in_turn_warn_once_each(self) -> None:
        self.checkpoint.write("containers", "old1", b"x")
        self.checkpoint.write("containers", "old2", b"x")
        events = logged_events(self)
        read_only(self)
        self.checkpoint.write("containers", "c1", b"y")
        self.checkpoint.write("containers", "old1", None)
        self.checkpoint.write("containers", "c2", b"y")
        self.checkpoint.write("containers", "old2", None)
        self.assertEqual(len(warnings(events)), 2, warnings(events))
        self.assertIn(f"cannot write {self.path}: Read-only file system", warnings(events)[0])
        self.assertIn(os.path.join(self.directory, "containers", "old1"), warnings(events)[1])
        self.assertEqual(self.checkpoint.write_failures, 4)


def read_only(case: SynchronousTestCase) -> Callable[[], None]:
    """Until ``case`` ends (or what this returns is called), the filesystem refuses every change as a read-only
    one does (root may chmod, not that)."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), args[0] if args else None)

    real_open = os.open

    def open_(path: str, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            refuse(path)
        return real_open(path, flags, *args, **kwargs)

    patches = [case.patch(os, name, refuse) for name in ("mkdir", "chmod", "unlink", "replace", "rename")]
    patches.append(case.patch(os, "open", open_))

    def writable() -> None:
        for patch in patches:
            patch.restore()

    return writable


class UnwritableAtStartTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.directory = self.mktemp()

    def test_a_read_only_directory_is_one_warning_naming_it_and_what_it_keeps_is_still_read(self) -> None:
        DirectoryCheckpoint(self.directory).open()
        kept = os.path.join(self.directory, "containers", "c1")
        with open(kept, "wb") as earlier:
            earlier.write(b"asked")
        events = logged_events(self)
        read_only(self)
        checkpoint = DirectoryCheckpoint(self.directory)
        checkpoint.open()
        [warning] = warnings(events)
        self.assertEqual(warning, f"cannot write in the state directory {self.directory}: Read-only file system; "
                                  "what kubelet asked is kept in memory only, until koordrp restarts")
        self.assertEqual((checkpoint.count(), checkpoint.read("containers", "c1", bytes)), (1, b"asked"))
        self.assertEqual(checkpoint.write_failures, 0)  # nothing was asked to be written yet
        # What is made from now on cannot be kept: nothing is taken for made while koordrp was away.
        self.assertFalse(checkpoint.remembers)
        checkpoint.write("containers", "c2", b"asked")
        self.assertEqual(checkpoint.write_failures, 1)
        self.assertIn(f"cannot write {os.path.join(self.directory, 'containers', 'c2')}: Read-only file system", warnings(events)[1])

    def test_a_directory_that_cannot_be_made_is_one_warning_and_nothing_kept(self) -> None:
        events = logged_events(self)
        read_only(self)
        checkpoint = DirectoryCheckpoint(self.directory)
        checkpoint.open()
        self.assertEqual(len(warnings(events)), 1)
        self.assertIn(f"{self.directory}: Read-only file system", warnings(events)[0])
        self.assertEqual(checkpoint.count(), 0)
        self.assertFalse(os.path.exists(self.directory))

    def test_what_could_not_be_made_at_start_is_made_once_it_can_be(self) -> None:
        os.makedirs(self.directory, mode=0o700)  # an empty read-only mount, say
        events = logged_events(self)
        writable = read_only(self)
        checkpoint = DirectoryCheckpoint(self.directory)
        checkpoint.open()
        checkpoint.write("containers", "c1", b"asked")
        path = os.path.join(self.directory, "containers", "c1")
        self.assertIn(f"cannot write {path}: Read-only file system", warnings(events)[1])  # not "No such file"
        writable()  # remounted read-write
        checkpoint.write("containers", "c1", b"asked")
        with open(path, "rb") as kept:
            self.assertEqual(kept.read(), b"asked")
        self.assertEqual(os.stat(os.path.dirname(path)).st_mode & 0o777, 0o700)
        self.assertEqual((len(warnings(events)), checkpoint.write_failures), (2, 1))

    def test_a_full_directory_is_said_at_start_and_no_probe_is_left(self) -> None:
        events = logged_events(self)
        real = os.write

        def full(descriptor: int, data: Any) -> int:
            raise failing(errno.ENOSPC)

        self.patch(os, "write", full)
        DirectoryCheckpoint(self.directory).open()
        self.patch(os, "write", real)
        [warning] = warnings(events)
        self.assertIn(f"{self.directory}: No space left on device", warning)
        self.assertEqual(os.listdir(os.path.join(self.directory, "containers")), [])

    def test_a_writable_directory_is_not_warned_of_and_a_write_cut_by_a_kill_is_cleared(self) -> None:
        DirectoryCheckpoint(self.directory).open()
        cut = os.path.join(self.directory, "containers", ".c1.new")
        with open(cut, "wb") as temporary:
            temporary.write(b"half")
        events = logged_events(self)
        checkpoint = DirectoryCheckpoint(self.directory)
        checkpoint.open()
        self.assertEqual(warnings(events), [])
        self.assertEqual((os.listdir(os.path.join(self.directory, "containers")), checkpoint.count()), ([], 0))
        self.assertTrue(checkpoint.remembers)

    def koordrp(self) -> tap.Koordrp:
        reactor = InlineThreadsReactor()
        return tap.Koordrp(DirectoryCheckpoint(self.directory), Dispatcher(HookClients(reactor), reactor))

    def test_koordrp_starts_on_a_read_only_directory(self) -> None:
        read_only(self)
        top = self.koordrp()
        top.startService()
        self.assertTrue(top.running)
        self.successResultOf(top.stopService())

    def test_koordrp_does_not_start_on_a_directory_others_may_write(self) -> None:
        os.makedirs(self.directory)
        os.chmod(self.directory, 0o777)
        self.assertRaises(CheckpointError, DirectoryCheckpoint(self.directory).open)
        self.assertRaises(SystemExit, self.koordrp().startService)


class MetricTests(SynchronousTestCase):
    def test_failed_writes_are_counted_on_metrics(self) -> None:
        directory = self.mktemp()
        checkpoint = DirectoryCheckpoint(directory)
        checkpoint.open()
        metrics = Metrics()
        metrics.watch_checkpoint(checkpoint)
        self.assertIn(b"\nkoordrp_state_file_write_failures_total 0.0\n", generate_latest(metrics.registry))
        read_only(self)
        checkpoint.write("pods", "p1", b"asked")
        checkpoint.write("pods", "p2", b"asked")
        self.assertIn(b"\nkoordrp_state_file_write_failures_total 2.0\n", generate_latest(metrics.registry))
        self.assertEqual(NoCheckpoint().write_failures, 0)
