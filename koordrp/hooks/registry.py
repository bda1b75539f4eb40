"""The hook servers registered in hookserver.d, kept current with inotify.

Three layers, so that the rules can be tested without a reactor or a file system:

- ``list_registrations`` and ``read_registration`` do the I/O, and turn every OSError into a value;
- ``RegistrationBook`` decides what each listing means: which files to read, what is in force,
  what to log;
- ``HookRegistry`` is the Twisted service: it watches, debounces, and publishes snapshots.
"""

import hashlib
import os
import stat
import time
from dataclasses import dataclass, replace
from typing import Callable, Mapping

from twisted.application import service
from twisted.internet import inotify
from twisted.internet.interfaces import IDelayedCall, IReactorFDSet, IReactorTime
from twisted.logger import Logger, LogLevel
from twisted.python.filepath import FilePath

from koordrp import files, trust
from koordrp.hooks.config import (
    MAX_CONFIG_BYTES,
    TOO_LARGE,
    HookConfigError,
    parse_hook_server_config,
    permission_problem,
)
from koordrp.hooks.limit import PreHookLimit
from koordrp.hooks.types import HookServerConfig, HookServers, HookType
from koordrp.trouble import Notice, Trouble

SUFFIX = ".json"

DEBOUNCE_SECONDS = 0.05
"""Editors and config managers touch a file several times per save; one rescan covers the burst."""

SAFETY_NET_SECONDS = 60.0
"""inotify can drop events (queue overflow, targets of symlinks outside the directory)."""

DEGRADED_SECONDS = 1.0
"""How often to look when inotify cannot watch, so that changes still count within a second."""

RACY_NANOSECONDS = 2_000_000_000
"""A file modified this recently may change again without its mtime moving (coarse file system
clocks), so its stat is not trusted to mean "unchanged" and it is read again at the next rescan."""

_DIRECTORY_MASK = inotify.IN_WATCH_MASK | inotify.IN_ONLYDIR
_PARENT_MASK = (
    inotify.IN_CREATE
    | inotify.IN_DELETE
    | inotify.IN_MOVED_FROM
    | inotify.IN_MOVED_TO
    | inotify.IN_MOVE_SELF
    | inotify.IN_UNMOUNT
    | inotify.IN_ONLYDIR
)

StatKey = tuple[int, int, int, int, int]
"""(device, inode, mtime_ns, size, ctime_ns): a file whose key is unchanged is not read again."""

Identity = tuple[int, int]
"""(device, inode) of a watched directory: inotify follows the inode, not the path."""

_EventCallback = Callable[[object, FilePath[bytes], int], None]


@dataclass(frozen=True)
class Content:
    data: bytes
    seen: StatKey | None
    """The key of the version read, or None when it is too fresh to be trusted (see RACY_NANOSECONDS)."""


@dataclass(frozen=True)
class Rejection:
    reason: str
    seen: StatKey | None = None
    version: bytes | None = None
    """A digest of the rejected content, when it was read: a different bad version is logged again."""


Reading = Content | Rejection | None
"""What reading one file gave; None when it vanished meanwhile."""

Listing = Mapping[str, StatKey | Rejection]


@dataclass(frozen=True)
class Entry:
    """What the registry remembers of one file."""

    seen: StatKey | None
    good: HookServerConfig | None
    complaint: tuple[str, bytes | None] | None
    """The rejection already logged for the file's current version."""
    distrust: str | None = None
    """Why koordrp does not trust the socket its good version names, as already logged (``koordrp.trust``)."""


REJECTED = "hook server registration {file} rejected: {reason}"
REJECTED_KEEPING = "hook server registration {file} rejected: {reason}; its last good version stays in force"
VALID_AGAIN = "hook server registration {file} is valid now"
IGNORED_STAGES = "hook server registration {file} lists stages koordrp has no hook point for, ignored: {stages}"
NO_HOOKS = "hook server registration {file} lists no hooks: the server is registered and called for nothing"
_STAGES_SHOWN = 10
UNREGISTERED = "hook server {name} unregistered: {file} is gone"
DIRECTORY_GONE = "hook server directory {directory} is gone; its hook servers are unregistered"
DIRECTORY_BACK = "hook server directory {directory} is back"
SERVERS = "hook servers: {servers}"
DISTRUSTED = "hook server registration {file} is not called: {reason}; its calls fail, as with a missing socket"
TRUSTED = "hook server registration {file}: its socket is trusted now"
DIRECTORY_REFUSED = (
    "hook server directory {directory} is not trusted: {reason}; none of its registrations is read, "
    "and the hook servers it registered are unregistered"
)
DIRECTORY_TRUSTED = "hook server directory {directory} is trusted again; its registrations are read"


def list_registrations(directory: str) -> dict[str, StatKey | Rejection] | None:
    """Stat every ``*.json`` in ``directory``; None if there is no such directory.

    What is not a regular file (a directory, FIFO, device, socket, or a symbolic link to one) is a
    Rejection saying what it is; stat never opens it. A file that vanishes while being looked at is
    left out: its removal brings its own event. Other errors reading the directory itself are raised.
    """
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return None
    listing: dict[str, StatKey | Rejection] = {}
    for name in names:
        if not name.endswith(SUFFIX):
            continue
        path = os.path.join(directory, name)
        try:
            info = os.stat(path)
        except FileNotFoundError:
            if os.path.islink(path):
                listing[name] = Rejection("is a symbolic link to a missing file")
            continue
        except OSError as error:
            listing[name] = Rejection(f"cannot stat: {error.strerror or error}")
            continue
        if stat.S_ISREG(info.st_mode):
            listing[name] = stat_key(info)
        else:
            listing[name] = Rejection(not_a_file(path, info.st_mode))
    return listing


def not_a_file(path: str, mode: int) -> str:
    """Why ``path``, of ``mode`` (as stat follows links), is no registration: what it is, through which link."""
    kind = files.kind(mode)
    try:
        target = os.readlink(path)
    except OSError:
        return f"is {kind}, not a regular file"
    return f"is a symbolic link to {target}, {kind}, not a regular file"


def stat_key(info: os.stat_result) -> StatKey:
    return (info.st_dev, info.st_ino, info.st_mtime_ns, info.st_size, info.st_ctime_ns)


def read_registration(path: str) -> Reading:
    """Read one registration, never more than MAX_CONFIG_BYTES + 1 bytes of it, never waiting (``koordrp.files``)."""
    try:
        # A FIFO or device swapped in after the listing is not opened, or not waited for: the reactor reads this.
        fd, info = files.open_file(path)
    except FileNotFoundError:
        return None
    except files.NotAFile as error:
        return Rejection(not_a_file(path, error.info.st_mode), seen=stat_key(error.info))
    except OSError as error:
        return Rejection(f"cannot open: {error.strerror or error}")
    try:
        key = stat_key(info)
        # Checked on the opened file, so a swap between this check and the read cannot slip through.
        untrusted = permission_problem(info.st_mode, info.st_uid, os.geteuid())
        if untrusted is not None:
            return Rejection(untrusted, seen=key)
        if info.st_size > MAX_CONFIG_BYTES:
            return Rejection(TOO_LARGE, seen=key)
        data = files.read_at_most(fd, MAX_CONFIG_BYTES)
        if len(data) > MAX_CONFIG_BYTES:  # it grew after fstat
            return Rejection(TOO_LARGE, seen=key)
        # Keyed by the fstat taken before reading: a write that lands during the read moves
        # mtime past it, so the next rescan reads again.
        fresh = time.time_ns() - info.st_mtime_ns < RACY_NANOSECONDS
        return Content(data, seen=None if fresh else key)
    except OSError as error:
        return Rejection(f"cannot read: {error.strerror or error}")
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Understood:
    """A registration koordrp accepts: the hook server it registers, and the version read."""

    config: HookServerConfig
    seen: StatKey | None


def understand(name: str, reading: Reading, default_timeout: float) -> Understood | Rejection | None:
    """What koordrp makes of one file's reading, as the daemon and ``koordrp check`` both judge it."""
    if reading is None or isinstance(reading, Rejection):
        return reading
    try:
        return Understood(parse_hook_server_config(name, reading.data, default_timeout), reading.seen)
    except HookConfigError as error:
        return Rejection(error.reason, reading.seen, hashlib.sha256(reading.data).digest())


def describe(servers: HookServers, limit: PreHookLimit | None = None) -> str:
    """One line naming every server, where it listens, its policy, timeout (and what ``limit`` leaves of it) and hooks."""
    if not servers.servers:
        return "none"
    return "; ".join(
        f"{server.name} ({server.endpoint}, {server.failure_policy.value}, {server.timeout:g}s"
        f"{limit.effective(server) if limit is not None else ''}): "
        + (", ".join(hook.value for hook in HookType if hook in server.hooks) or "no hooks")
        for server in servers.servers
    )


class RegistrationBook:
    """The registry's memory and rules, with no I/O of its own.

    ``update`` takes a fresh listing and a way to read one file by name, reads only what changed,
    and says what to log. A file that fails keeps its last good version in force, and each bad
    version is complained about once.
    """

    def __init__(self, directory: str, default_timeout: float) -> None:
        self.directory = directory
        self._default_timeout = default_timeout
        self._entries: dict[str, Entry] = {}
        self._present = True
        self._described = False
        self._limit: PreHookLimit | None = None
        self._refused: str | None = None
        self.servers = HookServers()

    def limit_known(self, limit: PreHookLimit) -> list[Notice]:
        """What to log once the time pre hooks get is known (or changes): each server that may take longer, and
        the servers with what they get."""
        if limit == self._limit:
            return []
        self._limit = limit
        slow = [server for server in self.servers.servers if limit.exceeded_by(server)]
        if not slow:
            return []
        notices = [Notice(LogLevel.warn, "{warning}", {"warning": limit.warning(server)}) for server in slow]
        return notices + [Notice(LogLevel.info, SERVERS, {"servers": describe(self.servers, limit)})]

    def update(
        self,
        listing: Listing | None,
        read: Callable[[str], Reading],
        judge: Callable[[HookServerConfig], str | None] | None = None,
        refused: str | None = None,
    ) -> tuple[bool, list[Notice]]:
        """Take in ``listing`` (None: the directory is gone); say whether the servers changed, and what to log.

        ``judge`` says why koordrp does not trust the socket a server names (None: it does), said once per
        reason; ``refused``, why it does not trust the directory itself: every server it registered is then let
        go, and its files are read again once it is trusted.
        """
        notices: list[Notice] = []
        if refused is not None:
            if refused != self._refused:
                notices.append(Notice(LogLevel.warn, DIRECTORY_REFUSED, {"directory": self.directory, "reason": refused}))
            self._refused = refused
            return self._publish({}, notices)
        if self._refused is not None:
            notices.append(Notice(LogLevel.info, DIRECTORY_TRUSTED, {"directory": self.directory}))
            self._refused = None
        if listing is None:
            if self._present:
                notices.append(Notice(LogLevel.info, DIRECTORY_GONE, {"directory": self.directory}))
            self._present = False
            listing = {}
        elif not self._present:
            notices.append(Notice(LogLevel.info, DIRECTORY_BACK, {"directory": self.directory}))
            self._present = True

        entries: dict[str, Entry] = {}
        for name in sorted(listing):
            entry = self._examine(name, self._entries.get(name), listing[name], read, notices)
            if entry is not None:
                entries[name] = entry
        for name, old in sorted(self._entries.items()):
            if name not in entries and old.good is not None:
                notices.append(Notice(LogLevel.info, UNREGISTERED, {"name": name, "file": self._path(name)}))
        if judge is not None:
            for name, entry in entries.items():
                entries[name] = self._judged(name, entry, judge, notices)
        return self._publish(entries, notices)

    def _judged(self, name: str, entry: Entry, judge: Callable[[HookServerConfig], str | None], notices: list[Notice]) -> Entry:
        """``entry``, with what koordrp makes of the socket it names now; a new reason not to trust it is said."""
        if entry.good is None:
            return entry
        old = self._entries.get(name)
        said = old.distrust if old is not None and old.good is not None and old.good.endpoint == entry.good.endpoint else None
        distrust = judge(entry.good)
        if distrust is not None and distrust != said:
            notices.append(Notice(LogLevel.warn, DISTRUSTED, {"file": self._path(name), "reason": distrust}))
        elif distrust is None and said is not None:
            notices.append(Notice(LogLevel.info, TRUSTED, {"file": self._path(name)}))
        return replace(entry, distrust=distrust)

    def _publish(self, entries: dict[str, Entry], notices: list[Notice]) -> tuple[bool, list[Notice]]:
        self._entries = entries
        servers = HookServers(tuple(entry.good for _, entry in sorted(entries.items()) if entry.good is not None))
        changed = servers != self.servers
        self.servers = servers
        if changed or not self._described:
            # The first update always says what is in force, so the log shows it from start-up on.
            notices.append(Notice(LogLevel.info, SERVERS, {"servers": describe(servers, self._limit)}))
            self._described = True
        return changed, notices

    def _examine(
        self,
        name: str,
        old: Entry | None,
        found: StatKey | Rejection,
        read: Callable[[str], Reading],
        notices: list[Notice],
    ) -> Entry | None:
        if isinstance(found, Rejection):
            return self._reject(name, old, found, notices)
        if old is not None and old.seen == found:
            return old
        understood = understand(name, read(name), self._default_timeout)
        if understood is None:
            return None
        if isinstance(understood, Rejection):
            return self._reject(name, old, understood, notices)
        config = understood.config
        if old is not None and old.complaint is not None:
            notices.append(Notice(LogLevel.info, VALID_AGAIN, {"file": self._path(name)}))
        if old is None or old.good is None or old.good != config or old.good.ignored_stages != config.ignored_stages:
            notices.extend(self._remarks(name, config))
        return Entry(seen=understood.seen, good=config, complaint=None)

    def _remarks(self, name: str, config: HookServerConfig) -> list[Notice]:
        """What a new version of a valid file may still deserve a word about."""
        remarks = []
        if config.ignored_stages:
            stages = ", ".join(config.ignored_stages[:_STAGES_SHOWN])
            if len(config.ignored_stages) > _STAGES_SHOWN:
                stages += f" and {len(config.ignored_stages) - _STAGES_SHOWN} more"
            remarks.append(Notice(LogLevel.info, IGNORED_STAGES, {"file": self._path(name), "stages": stages}))
        if not config.hooks:
            remarks.append(Notice(LogLevel.info, NO_HOOKS, {"file": self._path(name)}))
        if self._limit is not None and self._limit.exceeded_by(config):
            remarks.append(Notice(LogLevel.warn, "{warning}", {"warning": self._limit.warning(config)}))
        return remarks

    def _reject(self, name: str, old: Entry | None, rejection: Rejection, notices: list[Notice]) -> Entry:
        good = old.good if old is not None else None
        complaint = (rejection.reason, rejection.version)
        if old is None or old.complaint != complaint:
            notices.append(
                Notice(
                    LogLevel.warn,
                    REJECTED if good is None else REJECTED_KEEPING,
                    {"file": self._path(name), "reason": rejection.reason},
                )
            )
        return Entry(seen=rejection.seen, good=good, complaint=complaint)

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)


def _socket_distrust(server: HookServerConfig) -> str | None:
    """Why ``server`` is not called, as far as that shows before a call: koordrp does not trust its socket, or what is
    at its endpoint is no socket (``/var/run/../../etc/passwd`` is ``/etc/passwd``). None: it is called (a socket not
    there yet is said at each call, as ever)."""
    judged = trust.socket_trust(server.endpoint)
    if judged.problem is not None or judged.socket is not None:
        return judged.problem
    try:
        mode = os.stat(server.endpoint).st_mode
    except OSError:
        return None
    return None if stat.S_ISSOCK(mode) else f"{server.endpoint} is {files.kind(mode)}, not a socket"


def _identity(path: str) -> Identity | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (info.st_dev, info.st_ino) if stat.S_ISDIR(info.st_mode) else None


class HookRegistry(service.Service):
    """Keeps ``current`` in step with the ``*.json`` files of a directory.

    inotify watches the directory for its files and its parent for the directory itself coming and
    going. Every event schedules one debounced rescan; a slow periodic rescan catches whatever
    inotify cannot report.
    """

    log = Logger()

    def __init__(
        self,
        directory: str,
        default_timeout: float,
        reactor: IReactorTime,
        on_change: Callable[[HookServers], None] | None = None,
    ) -> None:
        """``reactor`` must also provide IReactorFDSet, through which inotify is read."""
        self.directory = os.path.abspath(directory)
        self._parent = os.path.dirname(self.directory)
        self._parent_bytes = os.fsencode(self._parent)
        self._name_bytes = os.fsencode(os.path.basename(self.directory))
        self._reactor = reactor
        self._fds = IReactorFDSet(reactor)
        self._on_change = on_change
        self._book = RegistrationBook(self.directory, default_timeout)
        self._current = HookServers()
        self._notifier: inotify.INotify | None = None
        self._watched: tuple[Identity | None, Identity | None] = (None, None)
        self._watch_trouble = Trouble("watching {directory} again")
        self._list_trouble = Trouble("can list {directory} again")
        self._rescan_call: IDelayedCall | None = None
        self._tick_call: IDelayedCall | None = None

    @property
    def current(self) -> HookServers:
        """The servers in force. Replaced whole on each change, so any thread may read it without a lock."""
        return self._current

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        try:
            os.makedirs(self.directory, mode=0o755, exist_ok=True)
        except OSError as error:
            # Without the directory koordrp is a plain proxy, which beats not starting at all;
            # the directory is picked up when it appears.
            self.log.warn("cannot create {directory}: {reason}", directory=self.directory, reason=error.strerror)
        self._rescan()
        if self._watch_trouble.current is None:
            self.log.info("watching {directory} for hook server registrations", directory=self.directory)

    def stopService(self) -> None:
        super().stopService()  # type: ignore[no-untyped-call]
        for call in (self._rescan_call, self._tick_call):
            if call is not None and call.active():
                call.cancel()
        self._rescan_call = self._tick_call = None
        self._stop_watching()

    def _on_directory_event(self, _watch: object, _path: FilePath[bytes], _mask: int) -> None:
        self._schedule_rescan()

    def _on_parent_event(self, _watch: object, path: FilePath[bytes], _mask: int) -> None:
        # Only the parent's own fate and our directory's matter; it may have other busy children.
        if path.path == self._parent_bytes or path.basename() == self._name_bytes:
            self._schedule_rescan()

    def _schedule_rescan(self) -> None:
        if self.running and (self._rescan_call is None or not self._rescan_call.active()):
            self._rescan_call = self._reactor.callLater(DEBOUNCE_SECONDS, self._rescan)

    def _rescan(self) -> None:
        if self._rescan_call is not None and self._rescan_call.active():
            self._rescan_call.cancel()
        self._rescan_call = None
        try:
            self._ensure_watching()
            self._refresh()
        except Exception:
            # Every expected failure is a value by now; this keeps the unexpected from killing the watch.
            self.log.failure("rescanning {directory} failed", directory=self.directory)
        finally:
            self._schedule_tick()

    def _schedule_tick(self) -> None:
        if not self.running:
            return
        interval = SAFETY_NET_SECONDS if self._watch_trouble.current is None else DEGRADED_SECONDS
        if self._tick_call is not None and self._tick_call.active():
            self._tick_call.reset(interval)
        else:
            self._tick_call = self._reactor.callLater(interval, self._rescan)

    def _refresh(self) -> None:
        refused = trust.directory_problem(self.directory)
        if refused is not None:
            self._take(None, refused)
            return
        try:
            listing = list_registrations(self.directory)
        except OSError as error:
            reason = error.strerror or str(error)
            problem = f"cannot list {self.directory}: {reason}; hook servers stay as they are"
            self._emit(self._list_trouble.report(problem))
            return
        self._emit(self._list_trouble.report(None, directory=self.directory))
        self._take(listing, None)

    def _take(self, listing: Listing | None, refused: str | None) -> None:
        changed, notices = self._book.update(listing, self._read, _socket_distrust, refused)
        for notice in notices:
            self._emit(notice)
        if changed:
            self._current = self._book.servers
            if self._on_change is not None:
                try:
                    self._on_change(self._current)
                except Exception:
                    self.log.failure("hook server change listener failed")

    def limit_known(self, limit: PreHookLimit) -> None:
        """The time pre hooks get is known now (NRI mode: containerd configured koordrp): servers that may take
        longer get a warning each, now and when they register."""
        for notice in self._book.limit_known(limit):
            self._emit(notice)

    def _read(self, name: str) -> Reading:
        return read_registration(os.path.join(self.directory, name))

    def _emit(self, notice: Notice | None) -> None:
        if notice is not None:
            self.log.emit(notice.level, notice.format, **notice.fields)

    def _ensure_watching(self) -> None:
        wanted = (_identity(self._parent), _identity(self.directory))
        notifier = self._notifier
        # A deleted watched directory makes Twisted's INotify close itself, taking every watch with
        # it: a dead notifier is replaced whole, as is one watching inodes no longer at our paths.
        if notifier is not None and notifier.connected and wanted == self._watched:
            if self._watch_trouble.current is None:
                return
        self._stop_watching()
        self._emit(self._watch_trouble.report(self._watch(wanted), directory=self.directory))
        if (_identity(self._parent), _identity(self.directory)) != wanted:
            # Something moved while the watches were being set up, and its event may be lost.
            self._schedule_rescan()

    def _watch(self, wanted: tuple[Identity | None, Identity | None]) -> str | None:
        """Set up the watches; return what could not be watched, if anything."""
        fallback = f"; looking at {self.directory} every {DEGRADED_SECONDS:g}s instead"
        try:
            notifier = inotify.INotify(reactor=self._fds)  # type: ignore[no-untyped-call]
        except (inotify.INotifyError, OSError):
            return "cannot create an inotify instance (fs.inotify.max_user_instances reached?)" + fallback
        notifier.startReading()  # type: ignore[no-untyped-call]
        self._notifier = notifier
        self._watched = wanted
        parent, directory = wanted
        targets: list[tuple[str, int, _EventCallback]] = []
        if parent is not None:
            targets.append((self._parent, _PARENT_MASK, self._on_parent_event))
        if directory is not None:
            targets.append((self.directory, _DIRECTORY_MASK, self._on_directory_event))
        for path, mask, callback in targets:
            try:
                notifier.watch(FilePath(path), mask=mask, callbacks=[callback])  # type: ignore[no-untyped-call]
            except inotify.INotifyError:
                return f"cannot watch {path} (unreadable, or fs.inotify.max_user_watches reached?)" + fallback
        if parent is None:
            return f"cannot watch {self._parent}: it does not exist" + fallback
        return None

    def _stop_watching(self) -> None:
        notifier, self._notifier = self._notifier, None
        self._watched = (None, None)
        if notifier is not None:
            notifier.loseConnection()  # type: ignore[no-untyped-call]
