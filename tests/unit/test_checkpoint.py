"""State files are written whole or not at all; a full or read-only state directory costs warnings, never a call."""

import errno
import os
import socket
import stat
import threading
from typing import Any, Callable

from prometheus_client import generate_latest
from twisted.logger import LogEvent, LogLevel, formatEvent
from twisted.trial.unittest import SynchronousTestCase

from koordrp import tap
from koordrp.checkpoint import MAX_FILE_BYTES, CheckpointError, DirectoryCheckpoint, NoCheckpoint, StateUnreadable
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


class InPlaceTests(SynchronousTestCase):
    """A byte of a kept file is changed in place, in the same file; where nothing of koordrp's is kept, the caller
    is told to write it whole."""

    def setUp(self) -> None:
        self.directory = self.mktemp()
        self.checkpoint = DirectoryCheckpoint(self.directory)
        self.checkpoint.open()
        self.path = os.path.join(self.directory, "containers", "c1")

    def test_a_byte_is_changed_in_the_file_written(self) -> None:
        self.assertTrue(self.checkpoint.write("containers", "c1", b"K\x01\x00rest"))
        written = os.stat(self.path).st_ino
        self.assertTrue(self.checkpoint.write_byte("containers", "c1", 2, 1))
        with open(self.path, "rb") as kept:
            self.assertEqual(kept.read(), b"K\x01\x01rest")
        self.assertEqual(os.stat(self.path).st_ino, written)

    def test_nothing_kept_or_too_short_is_for_the_caller_to_write_whole(self) -> None:
        self.assertFalse(self.checkpoint.write_byte("containers", "c1", 2, 1))
        self.checkpoint.write("containers", "c1", b"K")
        self.assertFalse(self.checkpoint.write_byte("containers", "c1", 2, 1))
        os.unlink(self.path)  # removed behind koordrp's back
        self.assertFalse(self.checkpoint.write_byte("containers", "c1", 0, 1))
        self.assertEqual(self.checkpoint.kept("containers"), frozenset())

    def test_a_fifo_put_in_its_place_is_never_opened(self) -> None:
        self.checkpoint.write("containers", "c1", b"K\x01\x00rest")
        os.unlink(self.path)
        os.mkfifo(self.path)
        self.assertFalse(self.checkpoint.write_byte("containers", "c1", 2, 1))  # returns at once: nothing waits for a reader
        self.assertEqual(self.checkpoint.write_failures, 0)


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


class FifoWriter:
    """A writer waiting (on a thread of its own) to open a FIFO, and closing it at once if it ever can: a read that
    opened the FIFO and waited would get its end of file, and the test its failure, instead of a hang."""

    def __init__(self, case: SynchronousTestCase, path: str) -> None:
        self.path = path
        self._thread = threading.Thread(target=self._open_and_close, daemon=True)
        self._thread.start()
        case.addCleanup(self._release)

    def _open_and_close(self) -> None:
        os.close(os.open(self.path, os.O_WRONLY))

    def _release(self) -> None:
        # Still waiting for a reader (nothing opened the FIFO): be that reader, so the thread ends.
        descriptor = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        self._thread.join()
        os.close(descriptor)


class NotAFileTests(SynchronousTestCase):
    """A state file that is no regular file is StateUnreadable naming what it is, at once: a FIFO, socket or device
    is never opened (a FIFO's open would hold the reactor until a writer came), nor a symbolic link followed."""

    def setUp(self) -> None:
        self.directory = self.mktemp()
        DirectoryCheckpoint(self.directory).open()
        self.path = os.path.join(self.directory, "containers", "c1")

    def unreadable(self) -> str:
        checkpoint = DirectoryCheckpoint(self.directory)
        checkpoint.open()  # learns that something is kept for c1
        with self.assertRaises(StateUnreadable) as raised:
            checkpoint.read("containers", "c1", bytes)
        return str(raised.exception)

    def test_a_fifo(self) -> None:
        os.mkfifo(self.path)
        FifoWriter(self, self.path)
        self.assertEqual(self.unreadable(), f"{self.path}: is a FIFO, not a regular file")

    def test_a_socket(self) -> None:
        listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.addCleanup(listening.close)
        listening.bind(self.path)
        self.assertEqual(self.unreadable(), f"{self.path}: is a socket, not a regular file")

    def test_a_device(self) -> None:
        if os.geteuid() != 0:
            self.skipTest("making a device takes root")
        os.mknod(self.path, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # as /dev/null
        self.assertEqual(self.unreadable(), f"{self.path}: is a character device, not a regular file")

    def test_a_symbolic_link_even_to_a_file(self) -> None:
        target = os.path.join(self.directory, "elsewhere")
        with open(target, "wb") as elsewhere:
            elsewhere.write(b"asked")
        os.symlink(os.path.abspath(target), self.path)
        self.assertEqual(self.unreadable(), f"{self.path}: is a symbolic link, not a regular file")

    def test_a_fifo_swapped_in_after_the_look_is_opened_without_waiting_and_refused(self) -> None:
        os.mkfifo(self.path)
        FifoWriter(self, self.path)
        regular = os.lstat(__file__)
        real_lstat, real_open = os.lstat, os.open
        flags: list[int] = []

        def lstat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
            return regular if path == self.path else real_lstat(path, *args, **kwargs)

        def open_(path: Any, given: int, *args: Any, **kwargs: Any) -> int:
            if path == self.path:
                flags.append(given)
            return real_open(path, given, *args, **kwargs)

        self.patch(os, "lstat", lstat)
        self.patch(os, "open", open_)
        self.assertEqual(self.unreadable(), f"{self.path}: is a FIFO, not a regular file")
        [opened] = flags
        self.assertEqual(opened & (os.O_NONBLOCK | os.O_NOFOLLOW), os.O_NONBLOCK | os.O_NOFOLLOW)

    def test_a_regular_file_is_read_and_one_too_large_is_not(self) -> None:
        with open(self.path, "wb") as kept:
            kept.write(b"asked")
        checkpoint = DirectoryCheckpoint(self.directory)
        checkpoint.open()
        self.assertEqual(checkpoint.read("containers", "c1", bytes), b"asked")
        with open(self.path, "wb") as kept:
            kept.truncate(MAX_FILE_BYTES + 1)
        self.assertEqual(self.unreadable(), f"{self.path}: larger than 16 MiB")


class PlantedNamesTests(SynchronousTestCase):
    """What is planted at a name koordrp writes (its temporary files, its probe) is removed, never opened: a FIFO
    would hold the reactor, a symbolic link would have root write where it points."""

    def test_a_fifo_or_a_link_where_a_file_is_written_is_replaced_not_opened(self) -> None:
        directory = self.mktemp()
        checkpoint = DirectoryCheckpoint(directory)
        checkpoint.open()
        outside = self.mktemp()
        with open(outside, "wb") as target:
            target.write(b"not koordrp's")
        os.mkfifo(os.path.join(directory, "pods", ".koordrp-probe"))
        DirectoryCheckpoint(directory).open()  # its probe goes where the FIFO was
        os.mkfifo(os.path.join(directory, "containers", ".c1.new"))
        os.symlink(outside, os.path.join(directory, "containers", ".c2.new"))
        checkpoint.write("containers", "c1", b"one")
        checkpoint.write("containers", "c2", b"two")
        self.assertEqual(
            [checkpoint.read("containers", name, bytes) for name in ("c1", "c2")], [b"one", b"two"]
        )
        with open(outside, "rb") as target:
            self.assertEqual(target.read(), b"not koordrp's")
        self.assertEqual(checkpoint.write_failures, 0)
