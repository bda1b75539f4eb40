"""The hook server registry: its rules without I/O, its file reading, and real inotify watching."""

import json
import os
import shutil
import socket
import stat
import time
from typing import Any, Callable

from twisted.internet import reactor as _global_reactor
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import deferLater
from twisted.logger import LogLevel, formatEvent
from twisted.trial.unittest import SynchronousTestCase, TestCase

from koordrp import check, trust
from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from koordrp.hooks import registry
from koordrp.hooks.client import HookCallError, HookClients
from koordrp.hooks.config import MAX_CONFIG_BYTES, TOO_LARGE, parse_hook_server_config
from koordrp.hooks.dispatcher import Dispatcher
from koordrp.hooks.limit import pre_hook_limit
from koordrp.hooks.registry import (
    Content,
    HookRegistry,
    Reading,
    RegistrationBook,
    Rejection,
    StatKey,
    describe,
    list_registrations,
    read_registration,
)
from koordrp.hooks.types import FailurePolicy, HookServerConfig, HookServers, HookType
from koordrp.trouble import Notice
from tests.fake.hook_server import FakeHookServer
from tests.support import koordlet
from tests.support.logs import logged_events
from tests.support.tempdirs import short_tempdir

reactor: IReactorTime = _global_reactor

DIRECTORY = "/etc/runtime/hookserver.d"


def registration(endpoint: str, hooks: tuple[str, ...] = ("PreRunPodSandbox",), **extra: object) -> bytes:
    fields = {name.replace("_", "-"): value for name, value in extra.items()}
    return json.dumps({"remote-endpoint": endpoint, "runtime-hooks": list(hooks), **fields}).encode()


def key(n: int) -> StatKey:
    return (1, n, n * 1000, 100, n * 1000)


class FakeFiles:
    """What ``read`` finds for each name, and which names were read."""

    def __init__(self) -> None:
        self.found: dict[str, Reading] = {}
        self.reads: list[str] = []

    def put(self, name: str, data: bytes, seen: StatKey | None) -> None:
        self.found[name] = Content(data, seen)

    def read(self, name: str) -> Reading:
        self.reads.append(name)
        return self.found.get(name)


class BookTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.book = RegistrationBook(DIRECTORY, 3.0)
        self.files = FakeFiles()

    def update(self, listing: dict[str, StatKey | Rejection] | None) -> tuple[bool, list[Notice]]:
        self.files.reads.clear()
        return self.book.update(listing, self.files.read)

    def endpoints(self) -> list[tuple[str, str]]:
        return [(server.name, server.endpoint) for server in self.book.servers.servers]

    def warnings(self, notices: list[Notice]) -> list[str]:
        return [notice.format.format(**notice.fields) for notice in notices if notice.level is LogLevel.warn]

    def test_first_update_always_says_what_is_in_force(self) -> None:
        changed, notices = self.update({})
        self.assertFalse(changed)
        self.assertEqual(notices, [Notice(LogLevel.info, registry.SERVERS, {"servers": "none"})])
        self.assertEqual(self.update({}), (False, []))

    def test_servers_are_in_file_name_order(self) -> None:
        for name in ("b.json", "10-z.json", "a.json"):
            self.files.put(name, registration(f"/run/{name}.sock"), key(len(name)))
        changed, _ = self.update({"b.json": key(1), "10-z.json": key(2), "a.json": key(3)})
        self.assertTrue(changed)
        self.assertEqual([name for name, _ in self.endpoints()], ["10-z.json", "a.json", "b.json"])

    def test_unchanged_stat_is_not_read_again(self) -> None:
        self.files.put("a.json", registration("/run/a.sock"), key(1))
        self.update({"a.json": key(1)})
        self.assertEqual(self.update({"a.json": key(1)}), (False, []))
        self.assertEqual(self.files.reads, [])

    def test_changed_stat_is_read_and_same_content_is_no_change(self) -> None:
        self.files.put("a.json", registration("/run/a.sock"), key(1))
        self.update({"a.json": key(1)})
        self.files.put("a.json", registration("/run/a.sock"), key(2))
        self.assertEqual(self.update({"a.json": key(2)}), (False, []))
        self.assertEqual(self.files.reads, ["a.json"])

    def test_modified_file_replaces_its_server(self) -> None:
        self.files.put("a.json", registration("/run/a.sock"), key(1))
        self.update({"a.json": key(1)})
        self.files.put("a.json", registration("/run/b.sock", failure_policy="Fail"), key(2))
        changed, notices = self.update({"a.json": key(2)})
        self.assertTrue(changed)
        self.assertEqual(self.endpoints(), [("a.json", "/run/b.sock")])
        self.assertEqual(
            [n.format.format(**n.fields) for n in notices],
            ["hook servers: a.json (/run/b.sock, Fail, 3s): PreRunPodSandbox"],
        )

    def test_fresh_file_is_read_again_without_complaining_twice(self) -> None:
        self.files.put("a.json", b"{", None)
        _, notices = self.update({"a.json": key(1)})
        self.assertEqual(len(self.warnings(notices)), 1)
        _, notices = self.update({"a.json": key(1)})
        self.assertEqual(self.files.reads, ["a.json"])
        self.assertEqual(notices, [])

    def test_bad_version_keeps_last_good_and_is_logged_once(self) -> None:
        self.files.put("a.json", registration("/run/a.sock"), key(1))
        self.update({"a.json": key(1)})
        self.files.put("a.json", registration("relative.sock"), key(2))
        changed, notices = self.update({"a.json": key(2)})
        self.assertFalse(changed)
        self.assertEqual(self.endpoints(), [("a.json", "/run/a.sock")])
        self.assertEqual(
            self.warnings(notices),
            [
                "hook server registration /etc/runtime/hookserver.d/a.json rejected: \"remote-endpoint\": "
                "'relative.sock' is not an absolute path or unix:// URL; its last good version stays in force"
            ],
        )
        self.assertEqual(self.update({"a.json": key(2)}), (False, []))
        self.files.put("a.json", registration("relative.sock"), key(3))
        self.assertEqual(self.update({"a.json": key(3)}), (False, []), "same bad content, touched")

    def test_another_bad_version_is_logged_again(self) -> None:
        self.files.put("a.json", b"{", key(1))
        _, first = self.update({"a.json": key(1)})
        self.files.put("a.json", b"[", key(2))
        _, second = self.update({"a.json": key(2)})
        self.assertEqual(len(self.warnings(first)), 1)
        self.assertEqual(len(self.warnings(second)), 1)
        self.assertNotIn("last good", self.warnings(second)[0])

    def test_recovery_is_logged(self) -> None:
        self.files.put("a.json", b"{", key(1))
        self.update({"a.json": key(1)})
        self.files.put("a.json", registration("/run/a.sock"), key(2))
        changed, notices = self.update({"a.json": key(2)})
        self.assertTrue(changed)
        self.assertIn(
            Notice(LogLevel.info, registry.VALID_AGAIN, {"file": "/etc/runtime/hookserver.d/a.json"}), notices
        )

    def test_refusals_from_listing_and_reading(self) -> None:
        self.files.found["big.json"] = Rejection(TOO_LARGE, key(2))
        loop = Rejection("cannot stat: Too many levels of symbolic links")
        _, notices = self.update({"loop.json": loop, "big.json": key(2)})
        self.assertEqual(
            self.warnings(notices),
            [
                "hook server registration /etc/runtime/hookserver.d/big.json rejected: larger than 1 MiB",
                "hook server registration /etc/runtime/hookserver.d/loop.json rejected: "
                "cannot stat: Too many levels of symbolic links",
            ],
        )
        self.assertEqual(self.update({"loop.json": loop, "big.json": key(2)}), (False, []))

    def test_removed_file_is_unregistered(self) -> None:
        self.files.put("a.json", registration("/run/a.sock"), key(1))
        self.files.put("b.json", b"{", key(2))
        self.update({"a.json": key(1), "b.json": key(2)})
        changed, notices = self.update({})
        self.assertTrue(changed)
        self.assertEqual(
            [n.format.format(**n.fields) for n in notices],
            [
                "hook server a.json unregistered: /etc/runtime/hookserver.d/a.json is gone",
                "hook servers: none",
            ],
        )

    def test_vanished_while_reading_counts_as_removed(self) -> None:
        self.files.put("a.json", registration("/run/a.sock"), key(1))
        self.update({"a.json": key(1)})
        del self.files.found["a.json"]
        changed, notices = self.update({"a.json": key(2)})
        self.assertTrue(changed)
        self.assertEqual(notices[0].format, registry.UNREGISTERED)

    def test_directory_gone_and_back(self) -> None:
        self.files.put("a.json", registration("/run/a.sock"), key(1))
        self.update({"a.json": key(1)})
        changed, notices = self.update(None)
        self.assertTrue(changed)
        self.assertEqual(
            [n.format for n in notices], [registry.DIRECTORY_GONE, registry.UNREGISTERED, registry.SERVERS]
        )
        self.assertEqual(self.update(None), (False, []))
        changed, notices = self.update({"a.json": key(1)})
        self.assertTrue(changed)
        self.assertEqual(self.files.reads, ["a.json"])
        self.assertEqual([n.format for n in notices], [registry.DIRECTORY_BACK, registry.SERVERS])

    def test_describe(self) -> None:
        servers = HookServers(
            (
                HookServerConfig(
                    "a.json",
                    "/run/a.sock",
                    FailurePolicy.IGNORE,
                    frozenset({HookType.PRE_START_CONTAINER, HookType.PRE_RUN_POD_SANDBOX}),
                    1.5,
                ),
                HookServerConfig("b.json", "/run/b.sock", FailurePolicy.FAIL, frozenset(), 3.0),
            )
        )
        self.assertEqual(
            describe(servers),
            "a.json (/run/a.sock, Ignore, 1.5s): PreRunPodSandbox, PreStartContainer; "
            "b.json (/run/b.sock, Fail, 3s): no hooks",
        )
        self.assertEqual(describe(HookServers()), "none")

    def lines(self, notices: list[Notice]) -> list[str]:
        return [notice.format.format(**notice.fields) for notice in notices]

    def test_koordlets_registrations_as_koordlet_writes_them(self) -> None:
        cases = {
            koordlet.DEFAULT: ("PreRunPodSandbox, PreCreateContainer, PreUpdateContainerResources", []),
            koordlet.WITH_RESCTRL: (
                "PreRunPodSandbox, PreCreateContainer, PreUpdateContainerResources",
                [f"hook server registration {DIRECTORY}/koordlet.json lists stages koordrp has no hook point for, "
                 'ignored: "PreRemoveRunPodSandbox"'],
            ),
            koordlet.NO_STAGES: (
                "no hooks",
                [f"hook server registration {DIRECTORY}/koordlet.json lists no hooks: the server is registered and "
                 "called for nothing"],
            ),
        }
        for data, (hooks, remarks) in cases.items():
            book = RegistrationBook(DIRECTORY, 2.0)
            files = FakeFiles()
            files.put("koordlet.json", data, key(1))
            changed, notices = book.update({"koordlet.json": key(1)}, files.read)
            self.assertTrue(changed)
            self.assertEqual(
                self.lines(notices),
                [*remarks, f"hook servers: koordlet.json (/var/run/koordlet/koordlet.sock, Ignore, 2s): {hooks}"],
            )

    def test_a_remark_is_made_once_per_version_of_the_file(self) -> None:
        self.files.put("koordlet.json", koordlet.WITH_RESCTRL, None)  # too fresh to trust: read at every rescan
        _, notices = self.update({"koordlet.json": key(1)})
        self.assertEqual(len([n for n in notices if n.format == registry.IGNORED_STAGES]), 1)
        self.assertEqual(self.update({"koordlet.json": key(1)}), (False, []))
        self.assertEqual(self.files.reads, ["koordlet.json"])
        self.files.put("koordlet.json", koordlet.WITH_RESCTRL.replace(b"Ignore", b"Fail"), key(2))
        _, notices = self.update({"koordlet.json": key(2)})
        self.assertEqual([n.format for n in notices], [registry.IGNORED_STAGES, registry.SERVERS])


    def test_a_server_that_may_take_longer_than_its_pre_hooks_get_is_warned_of_once_the_limit_is_known(self) -> None:
        """NRI mode: containerd's deadline is known once it configured koordrp; each server that may take
        longer gets one warning then, and the line of servers says what their pre hooks get."""
        limit = pre_hook_limit(2.0)
        self.files.put("koordlet.json", koordlet.DEFAULT, key(1))  # no timeout-seconds: the book's 3s
        self.files.put("quick.json", registration("/run/q.sock", ("PreCreateContainer",), timeout_seconds=1), key(2))
        self.files.put("post.json", registration("/run/p.sock", ("PostStopContainer",), timeout_seconds=30), key(3))
        self.update({"koordlet.json": key(1), "quick.json": key(2), "post.json": key(3)})
        notices = self.book.limit_known(limit)
        [warning] = self.warnings(notices)
        self.assertTrue(warning.startswith("hook server koordlet.json (/var/run/koordlet/koordlet.sock) may take 3s to answer"), warning)
        self.assertIn("its pre hooks get 1.9s: containerd's NRI gives each call 2s (plugin_request_timeout)", warning)
        self.assertIn("set its timeout-seconds (in a file without one, as koordlet writes it: koordrp's --hook-timeout) to 1.9 or less, or raise plugin_request_timeout", warning)
        self.assertIn("koordlet.json (/var/run/koordlet/koordlet.sock, Ignore, 3s; pre hooks 1.9s)", self.lines(notices)[-1])
        self.assertIn("quick.json (/run/q.sock, Ignore, 1s): PreCreateContainer", self.lines(notices)[-1])
        self.assertEqual(self.book.limit_known(limit), [])  # known already: said already
        # A server registered later is warned of as it registers; one changed, again.
        self.files.put("slow.json", registration("/run/s.sock", ("PreCreateContainer",), timeout_seconds=10), key(4))
        _, notices = self.update({"koordlet.json": key(1), "quick.json": key(2), "post.json": key(3), "slow.json": key(4)})
        [warning] = self.warnings(notices)
        self.assertIn("hook server slow.json (/run/s.sock) may take 10s", warning)
        self.assertIn("slow.json (/run/s.sock, Ignore, 10s; pre hooks 1.9s)", self.lines(notices)[-1])
        self.assertEqual(len(self.warnings(self.book.limit_known(pre_hook_limit(11.0)))), 0)
        self.assertEqual(len(self.warnings(self.book.limit_known(pre_hook_limit(1.0)))), 3)


class FileTests(SynchronousTestCase):
    """list_registrations and read_registration on a real directory."""

    def setUp(self) -> None:
        self.dir = short_tempdir(self)

    def write(self, name: str, data: bytes, age: float = 10.0) -> str:
        path = os.path.join(self.dir, name)
        with open(path, "wb") as file:
            file.write(data)
        past = time.time() - age
        os.utime(path, (past, past))
        return path

    def test_only_json_files_are_listed_and_only_regular_ones_are_read(self) -> None:
        self.write("a.json", b"{}")
        self.write("a.json.tmp", b"{}")
        self.write("README", b"")
        self.write("b.yaml", b"")
        os.mkdir(os.path.join(self.dir, "d.json"))
        os.mkfifo(os.path.join(self.dir, "f.json"))
        os.symlink("/dev/zero", os.path.join(self.dir, "z.json"))
        listening = socket.socket(socket.AF_UNIX)
        self.addCleanup(listening.close)
        listening.bind(os.path.join(self.dir, "s.json"))
        listing = list_registrations(self.dir)
        assert listing is not None
        self.assertEqual(sorted(listing), ["a.json", "d.json", "f.json", "s.json", "z.json"])
        self.assertEqual(
            [listing[name] for name in ("d.json", "f.json", "s.json", "z.json")],
            [
                Rejection("is a directory, not a regular file"),
                Rejection("is a FIFO, not a regular file"),
                Rejection("is a socket, not a regular file"),
                Rejection("is a symbolic link to /dev/zero, a character device, not a regular file"),
            ],
        )

    def test_koordrp_check_lists_what_is_not_a_file(self) -> None:
        os.mkfifo(os.path.join(self.dir, "x.json"))
        os.symlink("/dev/zero", os.path.join(self.dir, "zero.json"))
        findings, registered = check.hook_findings(self.dir, 3.0, 1.0)
        self.assertEqual(registered, [])
        self.assertEqual(
            [(finding.ok, finding.text) for finding in findings],
            [
                (False, f"{self.dir}/x.json is rejected: is a FIFO, not a regular file"),
                (False, f"{self.dir}/zero.json is rejected: is a symbolic link to /dev/zero, a character device, not a regular file"),
            ],
        )

    def test_symlinks(self) -> None:
        target = self.write("target", b"{}")
        os.symlink(target, os.path.join(self.dir, "link.json"))
        os.symlink("loop.json", os.path.join(self.dir, "loop.json"))
        os.symlink("missing", os.path.join(self.dir, "dangling.json"))
        os.symlink(self.dir, os.path.join(self.dir, "dir.json"))
        listing = list_registrations(self.dir)
        assert listing is not None
        self.assertEqual(listing["link.json"], registry.stat_key(os.stat(target)))
        self.assertEqual(listing["loop.json"], Rejection("cannot stat: Too many levels of symbolic links"))
        self.assertEqual(listing["dangling.json"], Rejection("is a symbolic link to a missing file"))
        self.assertEqual(listing["dir.json"], Rejection(f"is a symbolic link to {self.dir}, a directory, not a regular file"))

    def test_file_vanishing_between_listing_and_stat_is_left_out(self) -> None:
        self.write("a.json", b"{}")
        real_listdir = os.listdir
        self.patch(os, "listdir", lambda path: real_listdir(path) + ["gone.json"])
        self.assertEqual(sorted(list_registrations(self.dir) or {}), ["a.json"])

    def test_missing_directory(self) -> None:
        self.assertIsNone(list_registrations(os.path.join(self.dir, "nope")))
        self.assertIsNone(list_registrations(self.write("file", b"")))

    def test_read(self) -> None:
        path = self.write("a.json", b"{}")
        self.assertEqual(read_registration(path), Content(b"{}", registry.stat_key(os.stat(path))))

    def test_read_of_a_fresh_file_is_not_trusted(self) -> None:
        path = self.write("a.json", b"{}", age=0)
        self.assertEqual(read_registration(path), Content(b"{}", None))

    def test_read_of_a_vanished_file_or_a_fifo(self) -> None:
        self.assertIsNone(read_registration(os.path.join(self.dir, "gone.json")))
        fifo = os.path.join(self.dir, "f.json")
        os.mkfifo(fifo)  # swapped in after the listing: opened without waiting for a writer, and refused
        self.assertEqual(
            read_registration(fifo), Rejection("is a FIFO, not a regular file", seen=registry.stat_key(os.stat(fifo)))
        )

    def test_unreadable(self) -> None:
        def refuse(*args: Any) -> int:
            raise PermissionError(13, "Permission denied")

        path = self.write("a.json", b"{}")
        self.patch(os, "open", refuse)
        self.assertEqual(read_registration(path), Rejection("cannot open: Permission denied"))

    def test_oversized_file_is_not_read(self) -> None:
        read: list[int] = []
        real_read = os.read

        def counting_read(fd: int, n: int) -> bytes:
            data = real_read(fd, n)
            read.append(len(data))
            return data

        path = os.path.join(self.dir, "big.json")
        with open(path, "wb") as file:
            file.truncate(10 * MAX_CONFIG_BYTES)
        self.patch(os, "read", counting_read)
        reading = read_registration(path)
        self.assertEqual(reading, Rejection(TOO_LARGE, registry.stat_key(os.stat(path))))
        self.assertEqual(read, [])

    def test_file_that_grows_past_the_limit_is_read_only_that_far(self) -> None:
        read: list[int] = []

        def growing_read(fd: int, n: int) -> bytes:
            read.append(n)
            return b" " * n

        path = self.write("grows.json", b"{}")
        self.patch(os, "read", growing_read)
        self.assertIsInstance(read_registration(path), Rejection)
        self.assertLessEqual(sum(read), MAX_CONFIG_BYTES + 64 * 1024)

    def test_a_thousand_unchanged_files_are_not_read_again(self) -> None:
        for i in range(1000):
            self.write(f"{i:04}.json", registration(f"/run/{i}.sock"))
        book = RegistrationBook(self.dir, 3.0)
        reads: list[str] = []

        def read(name: str) -> Reading:
            reads.append(name)
            return read_registration(os.path.join(self.dir, name))

        book.update(list_registrations(self.dir), read)
        self.assertEqual(len(reads), 1000)
        self.assertEqual(len(book.servers.servers), 1000)
        reads.clear()
        self.assertEqual(book.update(list_registrations(self.dir), read), (False, []))
        self.assertEqual(reads, [])


BUDGET = 1.0


class WatchingTests(TestCase):
    """HookRegistry with the real reactor and real inotify: every change shows within a second."""

    def setUp(self) -> None:
        self.root = short_tempdir(self)
        self.dir = os.path.join(self.root, "hookserver.d")
        self.changes: list[HookServers] = []
        self.markers = 0
        self.events = logged_events(self)

    def start(self) -> HookRegistry:
        hooks = HookRegistry(self.dir, 3.0, reactor, self.changes.append)
        hooks.startService()

        def stop() -> None:
            if hooks.running:
                hooks.stopService()

        self.addCleanup(stop)
        return hooks

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def write(self, name: str, data: bytes) -> None:
        with open(self.path(name), "wb") as file:
            file.write(data)

    def replace(self, name: str, data: bytes) -> None:
        self.write(name + ".tmp", data)
        os.rename(self.path(name + ".tmp"), self.path(name))

    def lines(self, level: LogLevel | None = None) -> list[str]:
        return [
            formatEvent(event)
            for event in self.events
            if event.get("log_namespace", "").startswith("koordrp.hooks.registry")
            and (level is None or event.get("log_level") is level)
        ]

    def warnings_about(self, name: str) -> list[str]:
        return [line for line in self.lines(LogLevel.warn) if self.path(name) in line]

    @staticmethod
    def endpoints(hooks: HookRegistry) -> dict[str, str]:
        return {server.name: server.endpoint for server in hooks.current.servers}

    async def until(self, condition: Callable[[], bool], what: str, budget: float = BUDGET) -> None:
        deadline = time.monotonic() + budget
        while not condition():
            if time.monotonic() > deadline:
                self.fail(f"not within {budget}s: {what}")
            await deferLater(reactor, 0.01, lambda: None)

    async def settle(self, hooks: HookRegistry) -> None:
        """Make one more change and wait for it, so that every rescan before it has happened."""
        self.markers += 1
        marker = f"zz-marker-{self.markers}.json"
        self.write(marker, registration("/run/marker.sock"))
        await self.until(lambda: marker in self.endpoints(hooks), "marker registered")

    def test_loads_existing_files_in_name_order_and_creates_nothing_else(self) -> None:
        os.mkdir(self.dir)
        for name in ("b.json", "10-z.json", "a.json"):
            self.write(name, registration(f"/run/{name}.sock"))
        self.write("notes.txt", b"not a registration")
        hooks = self.start()
        self.assertEqual([server.name for server in hooks.current.servers], ["10-z.json", "a.json", "b.json"])
        self.assertEqual(self.changes, [hooks.current])
        self.assertIn(f"watching {self.dir} for hook server registrations", self.lines(LogLevel.info))

    def test_creates_the_missing_directory(self) -> None:
        hooks = self.start()
        self.assertTrue(stat.S_ISDIR(os.stat(self.dir).st_mode))
        self.assertEqual(hooks.current, HookServers())
        self.assertEqual(self.changes, [])
        self.assertIn("hook servers: none", self.lines(LogLevel.info))

    async def test_create(self) -> None:
        hooks = self.start()
        self.write("a.json", registration("/run/a.sock", timeout_seconds=1))
        await self.until(lambda: self.endpoints(hooks) == {"a.json": "/run/a.sock"}, "a.json registered")
        self.assertEqual(hooks.current.servers[0].timeout, 1.0)
        self.assertEqual(len(self.changes), 1)

    async def test_modify_in_place(self) -> None:
        os.mkdir(self.dir)
        self.write("a.json", registration("/run/a.sock"))
        hooks = self.start()
        self.write("a.json", registration("/run/b.sock"))
        await self.until(lambda: self.endpoints(hooks) == {"a.json": "/run/b.sock"}, "a.json modified")

    async def test_truncate_then_write_keeps_last_good_meanwhile(self) -> None:
        os.mkdir(self.dir)
        self.write("a.json", registration("/run/a.sock"))
        hooks = self.start()
        with open(self.path("a.json"), "r+b") as file:
            file.truncate(0)
            file.flush()
            await self.until(lambda: len(self.warnings_about("a.json")) == 1, "empty a.json rejected")
            self.assertEqual(self.endpoints(hooks), {"a.json": "/run/a.sock"})
            self.assertIn("its last good version stays in force", self.warnings_about("a.json")[0])
            file.write(registration("/run/b.sock"))
        await self.until(lambda: self.endpoints(hooks) == {"a.json": "/run/b.sock"}, "a.json rewritten")
        self.assertEqual(len(self.warnings_about("a.json")), 1)
        self.assertIn(f"hook server registration {self.path('a.json')} is valid now", self.lines(LogLevel.info))

    async def test_atomic_rename_over(self) -> None:
        os.mkdir(self.dir)
        self.write("a.json", registration("/run/a.sock"))
        hooks = self.start()
        self.replace("a.json", registration("/run/b.sock"))
        await self.until(lambda: self.endpoints(hooks) == {"a.json": "/run/b.sock"}, "a.json replaced")
        self.replace("a.json", registration("/run/c.sock"))
        await self.until(lambda: self.endpoints(hooks) == {"a.json": "/run/c.sock"}, "a.json replaced again")

    async def test_delete(self) -> None:
        os.mkdir(self.dir)
        self.write("a.json", registration("/run/a.sock"))
        self.write("b.json", registration("/run/b.sock"))
        hooks = self.start()
        os.unlink(self.path("a.json"))
        await self.until(lambda: self.endpoints(hooks) == {"b.json": "/run/b.sock"}, "a.json unregistered")
        self.assertIn(f"hook server a.json unregistered: {self.path('a.json')} is gone", self.lines(LogLevel.info))

    async def test_renamed_away_from_json(self) -> None:
        os.mkdir(self.dir)
        self.write("a.json", registration("/run/a.sock"))
        hooks = self.start()
        os.rename(self.path("a.json"), self.path("a.json.disabled"))
        await self.until(lambda: self.endpoints(hooks) == {}, "a.json unregistered")

    async def test_directory_deleted_and_recreated(self) -> None:
        os.mkdir(self.dir)
        self.write("a.json", registration("/run/a.sock"))
        hooks = self.start()
        for round in range(3):
            shutil.rmtree(self.dir)
            await self.until(lambda: self.endpoints(hooks) == {}, f"round {round}: directory gone")
            os.mkdir(self.dir)
            self.write("a.json", registration(f"/run/a{round}.sock"))
            await self.until(
                lambda: self.endpoints(hooks) == {"a.json": f"/run/a{round}.sock"}, f"round {round}: directory back"
            )
            # The re-created directory is watched, not just listed once.
            self.write("b.json", registration("/run/b.sock"))
            await self.until(lambda: "b.json" in self.endpoints(hooks), f"round {round}: b.json in the new directory")
        self.assertEqual(self.lines(LogLevel.warn), [])
        self.assertIn(
            f"hook server directory {self.dir} is gone; its hook servers are unregistered", self.lines(LogLevel.info)
        )

    async def test_directory_deleted_and_recreated_at_once(self) -> None:
        os.mkdir(self.dir)
        self.write("a.json", registration("/run/a.sock"))
        hooks = self.start()
        shutil.rmtree(self.dir)
        os.mkdir(self.dir)
        self.write("a.json", registration("/run/b.sock"))
        await self.until(lambda: self.endpoints(hooks) == {"a.json": "/run/b.sock"}, "new directory read")
        self.write("c.json", registration("/run/c.sock"))
        await self.until(lambda: "c.json" in self.endpoints(hooks), "new directory watched")

    async def test_directory_moved_away_and_back(self) -> None:
        os.mkdir(self.dir)
        self.write("a.json", registration("/run/a.sock"))
        hooks = self.start()
        os.rename(self.dir, self.dir + ".old")
        await self.until(lambda: self.endpoints(hooks) == {}, "directory moved away")
        # Changes in the moved directory are no longer ours.
        with open(os.path.join(self.dir + ".old", "b.json"), "wb") as file:
            file.write(registration("/run/b.sock"))
        os.rename(self.dir + ".old", self.dir)
        await self.until(lambda: sorted(self.endpoints(hooks)) == ["a.json", "b.json"], "directory moved back")

    async def test_parent_deleted_and_recreated(self) -> None:
        # Nothing is left to watch then: the registry looks every DEGRADED_SECONDS until it can.
        parent = os.path.join(self.root, "runtime")
        self.dir = os.path.join(parent, "hookserver.d")
        hooks = self.start()
        self.write("a.json", registration("/run/a.sock"))
        await self.until(lambda: "a.json" in self.endpoints(hooks), "a.json registered")
        shutil.rmtree(parent)
        await self.until(lambda: self.endpoints(hooks) == {}, "parent gone")
        await self.until(lambda: any("does not exist" in line for line in self.lines(LogLevel.warn)), "warned")
        os.makedirs(self.dir)
        self.write("b.json", registration("/run/b.sock"))
        budget = registry.DEGRADED_SECONDS + BUDGET
        await self.until(lambda: self.endpoints(hooks) == {"b.json": "/run/b.sock"}, "back", budget)
        self.assertIn(f"watching {self.dir} again", self.lines(LogLevel.info))
        self.write("c.json", registration("/run/c.sock"))
        await self.until(lambda: "c.json" in self.endpoints(hooks), "watched again")
        self.assertEqual(
            self.lines(LogLevel.warn),
            [f"cannot watch {parent}: it does not exist; looking at {self.dir} every 1s instead"],
        )

    async def test_safety_net_catches_what_inotify_cannot_see(self) -> None:
        # A symlink's target outside the directory changes without an event in it.
        self.patch(registry, "SAFETY_NET_SECONDS", 0.2)
        elsewhere = os.path.join(self.root, "koordlet.json")
        with open(elsewhere, "wb") as file:
            file.write(registration("/run/v1.sock"))
        os.mkdir(self.dir)
        os.symlink(elsewhere, self.path("koordlet.json"))
        hooks = self.start()
        self.assertEqual(self.endpoints(hooks), {"koordlet.json": "/run/v1.sock"})
        with open(elsewhere, "wb") as file:
            file.write(registration("/run/v2.sock"))
        await self.until(lambda: self.endpoints(hooks) == {"koordlet.json": "/run/v2.sock"}, "target change seen")

    async def test_bad_file_keeps_last_good_with_one_log_line(self) -> None:
        os.mkdir(self.dir)
        self.write("a.json", registration("/run/a.sock"))
        hooks = self.start()
        self.write("a.json", registration("/run/a.sock", failure_policy="Sometimes"))
        await self.until(lambda: len(self.warnings_about("a.json")) == 1, "bad a.json rejected")
        self.assertEqual(self.endpoints(hooks), {"a.json": "/run/a.sock"})
        os.utime(self.path("a.json"))  # same bad version, new stat
        await self.settle(hooks)
        await self.settle(hooks)
        self.assertEqual(
            self.warnings_about("a.json"),
            [
                f"hook server registration {self.path('a.json')} rejected: "
                '"failure-policy" must be "Fail" or "Ignore", not "Sometimes"; its last good version stays in force'
            ],
        )
        self.assertEqual(self.endpoints(hooks)["a.json"], "/run/a.sock")

    async def test_a_file_others_could_change_is_not_trusted(self) -> None:
        os.mkdir(self.dir)
        self.write("a.json", registration("/run/a.sock"))
        hooks = self.start()
        os.chmod(self.path("a.json"), 0o666)
        await self.until(lambda: len(self.warnings_about("a.json")) == 1, "world-writable a.json rejected")
        self.assertIn("group- or world-writable (mode 0666)", self.warnings_about("a.json")[0])
        self.assertIn("last good version stays in force", self.warnings_about("a.json")[0])
        os.chmod(self.path("a.json"), 0o644)
        os.chown(self.path("a.json"), 4242, -1)
        await self.until(lambda: len(self.warnings_about("a.json")) == 2, "a.json owned by a user rejected")
        self.assertIn("owned by uid 4242, not root", self.warnings_about("a.json")[1])
        self.write("b.json", registration("/run/b.sock"))
        os.chmod(self.path("b.json"), 0o664)
        await self.until(lambda: len(self.warnings_about("b.json")) == 1, "group-writable b.json rejected")
        self.assertNotIn("b.json", self.endpoints(hooks))

    async def test_bad_new_file_is_not_registered(self) -> None:
        hooks = self.start()
        self.write("a.json", b'{"remote-endpoint": "tcp://1.2.3.4:5", "runtime-hooks": []}')
        await self.until(lambda: len(self.warnings_about("a.json")) == 1, "bad a.json rejected")
        await self.settle(hooks)
        self.assertNotIn("a.json", self.endpoints(hooks))
        self.assertEqual(len(self.warnings_about("a.json")), 1)

    async def test_non_json_files_are_ignored(self) -> None:
        hooks = self.start()
        self.write("a.yaml", registration("/run/a.sock"))
        self.write("a.json.tmp", registration("/run/a.sock"))
        self.write("README", b"hello")
        os.mkdir(self.path("sub.d"))
        await self.settle(hooks)
        self.assertEqual(list(self.endpoints(hooks)), ["zz-marker-1.json"])
        self.assertEqual(self.lines(LogLevel.warn), [])

    async def test_symlink_to_a_file(self) -> None:
        elsewhere = os.path.join(self.root, "koordlet-v1.json")
        with open(elsewhere, "wb") as file:
            file.write(registration("/run/v1.sock"))
        hooks = self.start()
        os.symlink(elsewhere, self.path("koordlet.json"))
        await self.until(lambda: self.endpoints(hooks) == {"koordlet.json": "/run/v1.sock"}, "symlink registered")
        # Retargeted the way Kubernetes updates a mounted ConfigMap: a new link renamed over the old.
        second = os.path.join(self.root, "koordlet-v2.json")
        with open(second, "wb") as file:
            file.write(registration("/run/v2.sock"))
        os.symlink(second, self.path("koordlet.json.new"))
        os.rename(self.path("koordlet.json.new"), self.path("koordlet.json"))
        await self.until(lambda: self.endpoints(hooks) == {"koordlet.json": "/run/v2.sock"}, "symlink retargeted")

    async def test_what_is_not_a_file_gets_one_warning_naming_it(self) -> None:
        hooks = self.start()
        os.mkfifo(self.path("x.json"))
        os.mkdir(self.path("d.json"))
        os.symlink("/dev/zero", self.path("zero.json"))
        self.write("a.json", registration("/run/a.sock"))
        await self.until(lambda: "a.json" in self.endpoints(hooks), "a.json registered beside them")
        await self.settle(hooks)
        await self.settle(hooks)  # another rescan, which finds them as they were, says nothing more
        self.assertEqual(
            [line for line in self.lines(LogLevel.warn) if "zz-marker" not in line],
            [
                f"hook server registration {self.path('d.json')} rejected: is a directory, not a regular file",
                f"hook server registration {self.path('x.json')} rejected: is a FIFO, not a regular file",
                f"hook server registration {self.path('zero.json')} rejected: "
                "is a symbolic link to /dev/zero, a character device, not a regular file",
            ],
        )
        # Another kind in its place is said again, once.
        os.unlink(self.path("x.json"))
        os.mkdir(self.path("x.json"))
        await self.until(lambda: len(self.warnings_about("x.json")) == 2, "x.json, now a directory, rejected")
        await self.settle(hooks)
        self.assertEqual(self.warnings_about("x.json")[1].rpartition(": ")[2], "is a directory, not a regular file")
        self.assertEqual([name for name in self.endpoints(hooks) if not name.startswith("zz-marker")], ["a.json"])

    async def test_symlink_loop(self) -> None:
        hooks = self.start()
        os.symlink("loop.json", self.path("loop.json"))
        self.write("a.json", registration("/run/a.sock"))
        await self.until(lambda: "a.json" in self.endpoints(hooks), "a.json registered beside the loop")
        await self.settle(hooks)
        self.assertEqual(
            self.warnings_about("loop.json"),
            [
                f"hook server registration {self.path('loop.json')} rejected: "
                "cannot stat: Too many levels of symbolic links"
            ],
        )
        self.assertNotIn("loop.json", self.endpoints(hooks))

    async def test_oversized_file(self) -> None:
        hooks = self.start()
        with open(self.path("big.json"), "wb") as file:
            file.write(b" " * (10 * MAX_CONFIG_BYTES))
        await self.until(lambda: len(self.warnings_about("big.json")) == 1, "big.json rejected")
        await self.settle(hooks)
        self.assertEqual(
            self.warnings_about("big.json"),
            [f"hook server registration {self.path('big.json')} rejected: larger than 1 MiB"],
        )

    async def test_invalid_utf8(self) -> None:
        hooks = self.start()
        self.write("latin1.json", b'{"remote-endpoint": "/run/caf\xe9.sock", "runtime-hooks": []}')
        await self.until(lambda: len(self.warnings_about("latin1.json")) == 1, "latin1.json rejected")
        await self.settle(hooks)
        self.assertEqual(
            self.warnings_about("latin1.json"),
            [f"hook server registration {self.path('latin1.json')} rejected: not valid UTF-8 (byte offset 29)"],
        )

    async def test_unreadable_file(self) -> None:
        if os.geteuid() == 0:
            self.skipTest("root reads any file")
        hooks = self.start()
        self.write("secret.json", registration("/run/a.sock"))
        os.chmod(self.path("secret.json"), 0)
        await self.until(lambda: len(self.warnings_about("secret.json")) >= 1, "secret.json rejected")
        await self.settle(hooks)
        self.assertEqual(len(self.warnings_about("secret.json")), 1)

    async def test_on_change_once_per_effective_change(self) -> None:
        hooks = self.start()
        self.assertEqual(self.changes, [])
        self.write("a.json", registration("/run/a.sock"))
        await self.until(lambda: len(self.changes) == 1, "a.json registered")
        self.replace("a.json", registration("/run/a.sock"))  # same content: no change
        self.write("a.yaml", b"")  # not a registration: no change
        await self.settle(hooks)  # the marker is the second change
        self.assertEqual(len(self.changes), 2)
        self.assertEqual(self.changes[-1], hooks.current)
        os.unlink(self.path("a.json"))
        await self.until(lambda: len(self.changes) == 3, "a.json unregistered")
        self.assertEqual(list(self.endpoints(hooks)), ["zz-marker-1.json"])
        self.assertEqual(self.changes[-1], hooks.current)

    async def test_bursts_are_coalesced(self) -> None:
        hooks = self.start()
        for i in range(50):
            self.write(f"{i:02}.json", registration(f"/run/{i}.sock"))
        await self.until(lambda: len(self.endpoints(hooks)) == 50, "50 files registered")
        self.assertLess(len(self.changes), 10)

    async def test_stop_stops_watching(self) -> None:
        hooks = self.start()
        hooks.stopService()
        self.write("a.json", registration("/run/a.sock"))
        await deferLater(reactor, 0.2, lambda: None)
        self.assertEqual(hooks.current, HookServers())
        self.assertEqual(self.changes, [])


NOBODY = 65534
"""Another user than root (``nobody``): whoever owns what koordrp must not trust."""


def bound(path: str) -> socket.socket:
    """A unix socket bound (and listening) at ``path``, closed when the test ends by the caller's cleanup."""
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(path)
    listening.listen(1)
    return listening


def made(path: str, mode: int, owner: int = 0) -> str:
    """The directory ``path``, with ``mode`` (chmod: makedirs' mode is cut by the umask) and ``owner``."""
    os.makedirs(path, exist_ok=True)
    os.chmod(path, mode)
    os.chown(path, owner, -1)
    return path


class TrustTests(SynchronousTestCase):
    """koordrp.trust on real paths: koordrp runs as root here, so root alone is trusted."""

    def setUp(self) -> None:
        if os.geteuid() != 0:
            self.skipTest("owners other than koordrp's own need root to make")
        self.root = short_tempdir(self)  # /tmp (1777) above a 0700 directory of root's

    def socket_at(self, path: str) -> str:
        self.addCleanup(bound(path).close)
        return path

    def test_a_socket_where_only_root_can_write_is_trusted_through_a_sticky_directory_above(self) -> None:
        path = self.socket_at(os.path.join(made(os.path.join(self.root, "run"), 0o755), "good.sock"))
        judged = trust.socket_trust(path)
        info = os.stat(path)
        self.assertEqual(judged, trust.SocketTrust(None, (info.st_dev, info.st_ino, info.st_ctime_ns)))
        self.assertEqual(trust.socket_trust(os.path.join(self.root, "run", "not-yet.sock")), trust.SocketTrust(None))

    def test_a_socket_in_a_directory_anyone_may_write_is_not_trusted_sticky_or_not_there_yet(self) -> None:
        sticky = made(os.path.join(self.root, "tmp"), 0o1777)
        for path in (self.socket_at(os.path.join(sticky, "squatted.sock")), os.path.join(sticky, "not-yet.sock")):
            judged = trust.socket_trust(path)
            self.assertIsNone(judged.socket)
            self.assertEqual(
                judged.problem,
                f"socket {path} is not trusted: directory {sticky} is group- or world-writable (mode 1777): "
                "anyone could bind its name there before the hook server does",
            )

    def test_a_group_writable_directory_on_the_way_or_holding_the_socket_is_not_trusted(self) -> None:
        group = made(os.path.join(self.root, "group"), 0o775)
        below = made(os.path.join(group, "below"), 0o755)
        for path in (os.path.join(below, "a.sock"), os.path.join(group, "b.sock")):
            problem = trust.socket_trust(path).problem or ""
            self.assertIn(f"directory {group} is group- or world-writable (mode 0775)", problem)

    def test_a_directory_or_socket_owned_by_another_user_is_not_trusted(self) -> None:
        theirs = made(os.path.join(self.root, "theirs"), 0o755, NOBODY)
        self.assertEqual(
            trust.socket_trust(os.path.join(theirs, "a.sock")).problem,
            f"socket {theirs}/a.sock is not trusted: directory {theirs} is owned by uid {NOBODY}, not root",
        )
        path = self.socket_at(os.path.join(made(os.path.join(self.root, "ours"), 0o755), "b.sock"))
        os.chown(path, NOBODY, -1)  # as if nobody had bound it
        self.assertEqual(
            trust.socket_trust(path).problem, f"socket {path} is not trusted: socket {path} is owned by uid {NOBODY}, not root"
        )

    def test_symbolic_links_are_followed_as_the_kernel_does_and_their_targets_checked(self) -> None:
        good = self.socket_at(os.path.join(made(os.path.join(self.root, "good"), 0o755), "s.sock"))
        sticky = made(os.path.join(self.root, "tmp"), 0o1777)
        squatted = self.socket_at(os.path.join(sticky, "s.sock"))
        links = made(os.path.join(self.root, "links"), 0o755)
        os.symlink(good, os.path.join(links, "absolute.sock"))
        os.symlink("../good/s.sock", os.path.join(links, "relative.sock"))  # ".." from the link's own directory
        os.symlink("../tmp", os.path.join(links, "dir"))
        os.symlink(squatted, os.path.join(links, "squatted.sock"))
        os.symlink(good, os.path.join(links, "theirs.sock"))
        os.lchown(os.path.join(links, "theirs.sock"), NOBODY, -1)
        os.symlink("loop.sock", os.path.join(links, "loop.sock"))
        info = os.stat(good)
        judged = {name: trust.socket_trust(os.path.join(links, name)) for name in os.listdir(links) + ["dir/s.sock"]}
        for name in ("absolute.sock", "relative.sock"):
            self.assertEqual(judged[name].socket, (info.st_dev, info.st_ino, info.st_ctime_ns))
        for name in ("dir/s.sock", "squatted.sock"):
            self.assertIn(
                f"directory {sticky} is group- or world-writable (mode 1777): anyone could bind {squatted} there",
                judged[name].problem or "",
            )
        self.assertIn(f"symbolic link {links}/theirs.sock is owned by uid {NOBODY}, not root", judged["theirs.sock"].problem or "")
        self.assertIn("Too many levels of symbolic links", judged["loop.sock"].problem or "")

    def test_an_endpoint_that_climbs_is_the_path_it_climbs_to_and_that_path_is_checked(self) -> None:
        sticky = made(os.path.join(self.root, "tmp"), 0o1777)
        made(os.path.join(self.root, "run"), 0o755)
        endpoint = parse_hook_server_config("x.json", registration(f"{self.root}/run/../tmp/x.sock"), 3.0).endpoint
        self.assertEqual(endpoint, f"{sticky}/x.sock")
        self.assertIn(f"directory {sticky} is group- or world-writable", trust.socket_trust(endpoint).problem or "")
        passwd = parse_hook_server_config("p.json", registration("/var/run/../../etc/passwd"), 3.0)
        self.assertEqual(passwd.endpoint, "/etc/passwd")
        self.assertEqual(registry._socket_distrust(passwd), "/etc/passwd is a regular file, not a socket")

    def test_the_registration_directory_is_trusted_like_a_socket_directory(self) -> None:
        self.assertIsNone(trust.directory_problem(made(os.path.join(self.root, "hookserver.d"), 0o755)))
        self.assertIsNone(trust.directory_problem(os.path.join(self.root, "missing.d")))
        for mode in (0o777, 0o1777, 0o775):
            path = made(os.path.join(self.root, f"{mode:o}.d"), mode)
            self.assertEqual(
                trust.directory_problem(path),
                f"directory {path} is group- or world-writable (mode {mode:04o}): "
                "others could add, replace or remove what is in it",
            )
        theirs = made(os.path.join(self.root, "theirs.d"), 0o755, NOBODY)
        self.assertEqual(trust.directory_problem(theirs), f"directory {theirs} is owned by uid {NOBODY}, not root")
        group = made(os.path.join(self.root, "group"), 0o775)
        below = made(os.path.join(group, "hookserver.d"), 0o755)
        self.assertIn(f"directory {group} is group- or world-writable (mode 0775): others could replace", trust.directory_problem(below) or "")

    def test_koordrp_check_says_what_koordrp_does_not_trust(self) -> None:
        hooks = made(os.path.join(self.root, "hookserver.d"), 0o755)
        sticky = made(os.path.join(self.root, "tmp"), 0o1777)
        with open(os.path.join(hooks, "squatted.json"), "wb") as file:
            file.write(registration(os.path.join(sticky, "s.sock")))
        findings, registered = check.hook_findings(hooks, 3.0, 1.0)
        [finding] = findings
        self.assertFalse(finding.ok)
        self.assertIn(
            f"{hooks}/squatted.json registers squatted.json ({sticky}/s.sock, Ignore, 3s): PreRunPodSandbox; koordrp does "
            f"not call it: socket {sticky}/s.sock is not trusted: directory {sticky} is group- or world-writable (mode 1777)",
            finding.text,
        )
        self.assertEqual([server.name for server in registered], ["squatted.json"])
        os.chmod(hooks, 0o777)
        findings, registered = check.hook_findings(hooks, 3.0, 1.0)
        self.assertEqual(
            [(finding.ok, finding.text) for finding in findings],
            [
                (
                    False,
                    f"{hooks} is not trusted: directory {hooks} is group- or world-writable (mode 0777): others could add, "
                    "replace or remove what is in it; koordrp reads none of its registrations",
                )
            ],
        )
        self.assertEqual(registered, [])


class BookTrustTests(SynchronousTestCase):
    """What the registry says of registrations it does not trust, without I/O."""

    def setUp(self) -> None:
        self.book = RegistrationBook(DIRECTORY, 3.0)
        self.files = FakeFiles()
        self.distrust: dict[str, str] = {}
        self.files.put("a.json", registration("/run/a.sock"), key(1))
        self.files.put("b.json", registration("/tmp/b.sock", failure_policy="Fail"), key(2))

    def update(self, refused: str | None = None) -> list[str]:
        _, notices = self.book.update(
            {"a.json": key(1), "b.json": key(2)}, self.files.read, lambda server: self.distrust.get(server.endpoint), refused
        )
        return [f"{notice.level.name}: {notice.format.format(**notice.fields)}" for notice in notices if notice.format != registry.SERVERS]

    def names(self) -> list[str]:
        return [server.name for server in self.book.servers.servers]

    def test_a_server_whose_socket_is_not_trusted_stays_registered_and_is_said_once_per_reason(self) -> None:
        # Registered: its calls fail as a missing socket's do, so a Fail policy still fails the CRI call.
        self.distrust["/tmp/b.sock"] = "first reason"
        self.assertEqual(
            self.update(),
            [f"warn: hook server registration {DIRECTORY}/b.json is not called: first reason; its calls fail, as with a missing socket"],
        )
        self.assertEqual(self.names(), ["a.json", "b.json"])
        self.assertEqual(self.update(), [])
        self.distrust["/tmp/b.sock"] = "second reason"
        self.assertEqual(len(self.update()), 1)
        del self.distrust["/tmp/b.sock"]
        self.assertEqual(self.update(), [f"info: hook server registration {DIRECTORY}/b.json: its socket is trusted now"])
        self.assertEqual(self.update(), [])

    def test_a_directory_not_trusted_registers_nobody_until_it_is_trusted_again(self) -> None:
        self.update()
        self.assertEqual(self.names(), ["a.json", "b.json"])
        reason = f"directory {DIRECTORY} is group- or world-writable (mode 0777): others could add, replace or remove it"
        self.assertEqual(
            self.update(refused=reason),
            [
                f"warn: hook server directory {DIRECTORY} is not trusted: {reason}; none of its registrations is read, "
                "and the hook servers it registered are unregistered"
            ],
        )
        self.assertEqual(self.names(), [])
        self.assertEqual(self.update(refused=reason), [])
        self.files.reads.clear()
        self.assertEqual(self.update(), [f"info: hook server directory {DIRECTORY} is trusted again; its registrations are read"])
        self.assertEqual((self.names(), sorted(self.files.reads)), (["a.json", "b.json"], ["a.json", "b.json"]))


class ClientTrustTests(TestCase):
    """A hook server whose socket koordrp does not trust is never sent a request: each call fails at once, as with a
    missing socket (Fail: the stage fails; Ignore: it goes on)."""

    def setUp(self) -> None:
        if os.geteuid() != 0:
            self.skipTest("owners other than koordrp's own need root to make")
        self.root = short_tempdir(self)
        self.clients = HookClients(reactor)
        self.addCleanup(self.clients.close_all)
        self.events = logged_events(self)

    def server(self, directory: str) -> FakeHookServer:
        fake = FakeHookServer(os.path.join(directory, "hook.sock")).start()
        self.addCleanup(fake.stop)
        return fake

    async def test_a_squatted_socket_gets_no_call_and_the_stage_follows_the_policy(self) -> None:
        squatter = self.server(made(os.path.join(self.root, "tmp"), 0o1777))
        dispatcher = Dispatcher(self.clients, reactor)
        request = hook.ContainerResourceHookRequest(container_envs={"PASSWORD": "secret"})
        for policy in FailurePolicy:
            server = HookServerConfig("squatted.json", squatter.path, policy, frozenset(HookType), 5.0)
            outcome = await dispatcher.run(HookType.PRE_CREATE_CONTAINER, (server,), request)
            [made_call] = outcome.calls
            self.assertIn(
                f"socket {squatter.path} is not trusted: directory {self.root}/tmp is group- or world-writable (mode 1777)",
                made_call.reason,
            )
            self.assertEqual(outcome.failure is not None, policy is FailurePolicy.FAIL)
        self.assertEqual(squatter.rpcs(), [])

    async def test_a_trusted_socket_is_looked_at_again_once_it_changes(self) -> None:
        fake = self.server(made(os.path.join(self.root, "run"), 0o755))
        client = self.clients.get(fake.path)
        await client.call(HookType.PRE_CREATE_CONTAINER, hook.ContainerResourceHookRequest(), 5.0)
        os.chown(fake.path, NOBODY, -1)  # the socket is not the one found trusted: as one bound anew by nobody
        with self.assertRaises(HookCallError) as refused:
            await client.call(HookType.PRE_CREATE_CONTAINER, hook.ContainerResourceHookRequest(), 5.0)
        self.assertEqual(
            str(refused.exception), f"socket {fake.path} is not trusted: socket {fake.path} is owned by uid {NOBODY}, not root"
        )
        os.chown(fake.path, 0, -1)
        await client.call(HookType.PRE_CREATE_CONTAINER, hook.ContainerResourceHookRequest(), 5.0)
        self.assertEqual(fake.rpcs(), ["PreCreateContainerHook", "PreCreateContainerHook"])


class WatchingTrustTests(TestCase):
    """The registry, on real files: what it does not trust is said once, naming the file, the path and why."""

    def setUp(self) -> None:
        if os.geteuid() != 0:
            self.skipTest("owners other than koordrp's own need root to make")
        self.root = short_tempdir(self)
        self.dir = made(os.path.join(self.root, "hookserver.d"), 0o755)
        self.events = logged_events(self)

    def start(self) -> HookRegistry:
        hooks = HookRegistry(self.dir, 3.0, reactor)
        hooks.startService()
        self.addCleanup(lambda: hooks.stopService() if hooks.running else None)
        return hooks

    def write(self, name: str, endpoint: str) -> None:
        with open(os.path.join(self.dir, name), "wb") as file:
            file.write(registration(endpoint))

    def warnings(self) -> list[str]:
        return [
            formatEvent(event)
            for event in self.events
            if event.get("log_namespace", "").startswith("koordrp.hooks.registry") and event.get("log_level") is LogLevel.warn
        ]

    async def until(self, condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 30  # a bound, not a measure: inotify tells within a second
        while not condition():
            if time.monotonic() > deadline:
                self.fail(f"never: {what}")
            await deferLater(reactor, 0.01, lambda: None)

    async def test_a_socket_in_a_directory_anyone_may_write_is_warned_of_once_beside_a_good_one(self) -> None:
        sticky = made(os.path.join(self.root, "tmp"), 0o1777)
        good = made(os.path.join(self.root, "run"), 0o755)
        hooks = self.start()
        self.write("bad.json", os.path.join(sticky, "bad.sock"))
        self.write("good.json", os.path.join(good, "good.sock"))
        await self.until(lambda: len(hooks.current.servers) == 2, "both registered")
        self.write("zz.json", os.path.join(good, "zz.sock"))  # another rescan, which says nothing more of bad.json
        await self.until(lambda: len(hooks.current.servers) == 3, "zz.json registered")
        self.assertEqual(
            self.warnings(),
            [
                f"hook server registration {self.dir}/bad.json is not called: socket {sticky}/bad.sock is not trusted: "
                f"directory {sticky} is group- or world-writable (mode 1777): anyone could bind its name there before "
                "the hook server does; its calls fail, as with a missing socket"
            ],
        )

    async def test_a_directory_others_may_write_registers_nobody_until_it_is_fixed(self) -> None:
        hooks = self.start()
        self.write("a.json", "/run/a.sock")
        await self.until(lambda: len(hooks.current.servers) == 1, "a.json registered")
        os.chmod(self.dir, 0o777)
        self.write("b.json", "/run/b.sock")  # an event, so that the registry looks at once
        await self.until(lambda: not hooks.current.servers, "everything unregistered")
        self.assertEqual(len(self.warnings()), 1)
        self.assertIn(
            f"hook server directory {self.dir} is not trusted: directory {self.dir} is group- or world-writable (mode 0777)",
            self.warnings()[0],
        )
        os.chmod(self.dir, 0o755)
        self.write("c.json", "/run/c.sock")
        await self.until(lambda: len(hooks.current.servers) == 3, "registered again")
        self.assertEqual(len(self.warnings()), 1)
