"""Files in the state directory, by kind and id: what the store (``koordrp.store``) keeps of each pod and
container koordrp saw made, and of each about to be made, so that it outlives koordrp.

The runtime keeps what it was given, hooks' changes included, and koordrp rebuilds its store from it
after a restart; what kubelet asked before the hooks changed it, and which pods and containers koordrp
saw made, are kept nowhere else. This module knows files, not what is in them: ``<dir>/pods/<id>``,
``<dir>/containers/<id>``, ``<dir>/pending/<name>``, in a directory only root may read (environment
values may be secrets). The default directory is under /var/run: it lasts as long as the node's running
containers do.

A file is written whole or not at all (a temporary file, renamed into place once every byte is in it):
a full or read-only directory costs what it would have kept, never a truncated file. One byte of a file
(a flag) may be changed in place (``write_byte``): a write of one byte is whole or not at all too, and it
spares the filesystem a new file (on ext4 a new file costs ten times the CPU of a byte written). Nothing is
fsync-ed: the files need to outlive koordrp, not the node, and a sync would hold the reactor.
"""

import errno
import os
import re
import stat
from typing import AbstractSet, Callable, Literal, Protocol, TypeVar

from google.protobuf.message import DecodeError
from twisted.logger import Logger

from koordrp import files

Kind = Literal["pods", "containers", "pending"]
KINDS: tuple[Kind, ...] = ("pods", "containers", "pending")
"""``pending``: what kubelet asked for a pod or container about to be made, kept before koordrp lets the runtime
make it (its id is not known yet), by a name derived from what kubelet calls it."""

# Runtime ids are hex; anything else (or absurdly long) is not given a file name.
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
DIRECTORY_MODE = 0o700
MAX_FILE_BYTES = 16 << 20
"""A kept hook request is a CRI request's worth: kubelet's own limit for one is 16 MiB."""

Parsed = TypeVar("Parsed")


class StateUnreadable(Exception):
    """Something is kept for a pod or container that koordrp cannot read; the message names the file and why."""


class Checkpoint(Protocol):
    write_failures: int
    """How many writes (and removals) of a kept file have failed so far."""

    def write(self, kind: Kind, identifier: str, data: bytes | None) -> bool:
        """Keep ``data`` for ``identifier``; None: keep nothing (forget what was kept). Whether it is kept (or
        forgotten) as asked."""

    def write_byte(self, kind: Kind, identifier: str, offset: int, value: int) -> bool:
        """Change the byte at ``offset`` of what is kept for ``identifier`` to ``value``, in place; False: nothing is
        kept there for it, or the change failed (counted), and the caller writes it whole."""

    def read(self, kind: Kind, identifier: str, parse: Callable[[bytes], Parsed]) -> Parsed | None:
        """What is kept for ``identifier``, parsed; None: nothing is kept.

        StateUnreadable: something is kept that cannot be read, or that ``parse`` refuses
        (DecodeError, ValueError).
        """

    def retain(self, kind: Kind, identifiers: AbstractSet[str]) -> None:
        """Forget what is kept for every identifier not in ``identifiers``."""

    def count(self) -> int:
        """How many pods and containers something is kept for."""

    def kept(self, kind: Kind) -> AbstractSet[str]:
        """The identifiers something is kept for."""

    @property
    def remembers(self) -> bool:
        """Whether what is kept tells every pod and container koordrp saw made (it keeps a file for each) from
        those it never saw."""


class NoCheckpoint:
    """Nothing is kept: after a restart, what the runtime has stands for what kubelet asked."""

    write_failures = 0

    def write(self, kind: Kind, identifier: str, data: bytes | None) -> bool:
        return False

    def write_byte(self, kind: Kind, identifier: str, offset: int, value: int) -> bool:
        return False

    def read(self, kind: Kind, identifier: str, parse: Callable[[bytes], Parsed]) -> Parsed | None:
        return None

    def retain(self, kind: Kind, identifiers: AbstractSet[str]) -> None:
        pass

    def count(self) -> int:
        return 0

    def kept(self, kind: Kind) -> AbstractSet[str]:
        return frozenset()

    @property
    def remembers(self) -> bool:
        return False


class CheckpointError(RuntimeError):
    """The checkpoint directory cannot be used; the message says why, in one line."""


class DirectoryCheckpoint:
    """One file per identifier, written atomically (a temporary file, then a rename).

    A file that cannot be written (or removed) is counted (``write_failures``) and costs one warning
    naming it, one per reason for as long as writes keep failing; koordrp goes on: it then knows what
    kubelet asked for that pod or container only until it restarts. A directory that cannot be
    written at start costs one warning naming it, and koordrp starts all the same.
    """

    log = Logger()

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._kept: dict[Kind, set[str]] = {kind: set() for kind in KINDS}
        self._failing: set[tuple[str, str]] = set()
        """What has failed (the warning's format, the reason) since a write last succeeded."""
        self.write_failures = 0
        self._checked = False
        """Whether open found the directory koordrp's own: only then are its subdirectories made after open."""
        self._remembers = True

    def open(self) -> None:
        """Create the directory or check it, 0700 (it holds environment values); learn what is kept there.

        A directory that cannot be created, made 0700 or written (read-only, full, ...) costs one
        warning naming it; what it holds is still learnt if it can be listed, and each later write
        that fails is said as any is.

        CheckpointError: someone else could change what it holds.
        """
        trouble: OSError | None = None
        try:
            for kind in KINDS:
                os.makedirs(os.path.join(self.directory, kind), mode=DIRECTORY_MODE, exist_ok=True)
        except OSError as error:
            trouble = error
        try:
            status = os.stat(self.directory)
        except OSError as error:
            self._unwritable(trouble or error)
            return
        if status.st_uid != os.geteuid() or status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise CheckpointError(f"{self.directory} may be written by others than koordrp's user; refusing it")
        self._checked = True
        for kind in KINDS:
            try:
                names = os.listdir(os.path.join(self.directory, kind))
            except OSError as error:
                trouble = trouble or error
                continue
            self._kept[kind] = {name for name in names if _ID.fullmatch(name)}
            for name in names:
                if name.startswith(".") and name.endswith(".new"):  # a write cut by a kill
                    try:
                        _remove(os.path.join(self.directory, kind, name))
                    except OSError:
                        pass  # the probe below says why
        if trouble is None:
            try:
                os.chmod(self.directory, DIRECTORY_MODE)  # makedirs' mode is cut by the umask, and spares parents
                for kind in KINDS:
                    os.chmod(os.path.join(self.directory, kind), DIRECTORY_MODE)
                    _probe(os.path.join(self.directory, kind, _PROBE))
            except OSError as error:
                trouble = error
        if trouble is not None:
            self._unwritable(trouble)

    def _unwritable(self, error: OSError) -> None:
        # What it keeps can no longer tell what koordrp saw made from what it did not.
        self._remembers = False
        self.log.warn(
            "cannot write in the state directory {directory}: {reason}; what kubelet asked is kept in memory only, "
            "until koordrp restarts",
            directory=self.directory,
            reason=error.strerror or str(error),
        )

    def _path(self, kind: Kind, identifier: str) -> str | None:
        return f"{self.directory}/{kind}/{identifier}" if _ID.fullmatch(identifier) else None

    def write(self, kind: Kind, identifier: str, data: bytes | None) -> bool:
        path = self._path(kind, identifier)
        if path is None:
            return False
        kept = self._kept[kind]
        if data is None:
            if identifier in kept:
                kept.discard(identifier)
                try:
                    _remove(path)
                except OSError as error:
                    self._failed(error, path, "cannot remove what was kept in {path}: {reason}")
                    return False
            return True
        temporary = f"{self.directory}/{kind}/.{identifier}.new"
        try:
            descriptor = self._create(kind, temporary)
            try:
                _write_all(descriptor, data)
            finally:
                os.close(descriptor)
            os.replace(temporary, path)  # only once all of it is there: the previous file stays until then
        except OSError as error:
            try:
                _remove(temporary)
            except OSError:
                pass  # the reason is said below
            self._failed(error, path, _UNWRITTEN)
            return False
        self._failing.clear()
        kept.add(identifier)
        return True

    def write_byte(self, kind: Kind, identifier: str, offset: int, value: int) -> bool:
        path = self._path(kind, identifier)
        if path is None or identifier not in self._kept[kind]:
            return False
        try:
            descriptor, info = files.open_file(path, follow=False, writing=True)
        except FileNotFoundError:  # removed by someone else: written whole again
            self._kept[kind].discard(identifier)
            return False
        except (OSError, files.NotAFile):
            return False  # replaced by the whole write that follows, or said by its failure
        try:
            # Only a file koordrp made itself (its own, with no other name) is changed in place; anything else
            # is replaced by the whole write that follows.
            if info.st_nlink != 1 or info.st_uid != os.geteuid() or info.st_size <= offset:
                return False
            if os.pwrite(descriptor, bytes((value,)), offset) != 1:
                return False
        except OSError as error:
            self._failed(error, path, _UNWRITTEN)
            return False
        finally:
            os.close(descriptor)
        return True

    def _create(self, kind: Kind, temporary: str) -> int:
        try:
            return files.create_file(temporary)
        except FileNotFoundError:
            if not self._checked:
                raise
        # Not made at open (a directory read-only or full then): made now, or the filesystem's reason said.
        os.mkdir(os.path.join(self.directory, kind), DIRECTORY_MODE)
        return files.create_file(temporary)

    def _failed(self, error: OSError, path: str, format: str) -> None:
        """Counted; one warning (naming the first file) for each thing that fails and why, until a write succeeds."""
        self.write_failures += 1
        reason = error.strerror or str(error)
        if (format, reason) not in self._failing:
            self._failing.add((format, reason))
            self.log.warn(format, directory=self.directory, path=path, reason=reason)

    def read(self, kind: Kind, identifier: str, parse: Callable[[bytes], Parsed]) -> Parsed | None:
        path = self._path(kind, identifier)
        if path is None or identifier not in self._kept[kind]:
            return None
        try:
            # Read on the reactor: a FIFO, device or socket there is never opened (a FIFO's open would wait for a
            # writer, forever), nor is a symbolic link followed (koordrp writes none).
            descriptor, info = files.open_file(path, follow=False)
            try:
                data = b"" if info.st_size > MAX_FILE_BYTES else files.read_at_most(descriptor, MAX_FILE_BYTES)
            finally:
                os.close(descriptor)
        except FileNotFoundError:  # removed by someone else: nothing is kept
            self._kept[kind].discard(identifier)
            return None
        except files.NotAFile as error:
            # A directory in words open(2) uses for one, as any other error here is said.
            raise StateUnreadable(f"{path}: {os.strerror(errno.EISDIR) if stat.S_ISDIR(error.info.st_mode) else error}") from None
        except OSError as error:
            raise StateUnreadable(f"{path}: {error.strerror}") from None
        if len(data) > MAX_FILE_BYTES or info.st_size > MAX_FILE_BYTES:
            raise StateUnreadable(f"{path}: larger than {MAX_FILE_BYTES >> 20} MiB")
        try:
            return parse(data)
        except (DecodeError, ValueError) as error:
            raise StateUnreadable(f"{path}: {error or type(error).__name__}") from None

    def retain(self, kind: Kind, identifiers: AbstractSet[str]) -> None:
        for identifier in self._kept[kind] - identifiers:
            self.write(kind, identifier, None)

    def count(self) -> int:
        return len(self._kept["pods"]) + len(self._kept["containers"])

    def kept(self, kind: Kind) -> AbstractSet[str]:
        return frozenset(self._kept[kind])

    @property
    def remembers(self) -> bool:
        """Unless the directory could not be written at start."""
        return self._remembers


_UNWRITTEN = "cannot write {path}: {reason}; what kubelet asked for it is kept in memory only, until koordrp restarts"

_PROBE = ".koordrp-probe"
"""Written and removed at open, to learn whether the directory can be written: no identifier is named so."""


def _write_all(descriptor: int, data: bytes) -> None:
    """Every byte of ``data``, or OSError: a write may take fewer bytes than it was given (a filesystem filling)."""
    left = memoryview(data)
    while left:
        written = os.write(descriptor, left)
        if written <= 0:
            raise OSError(errno.EIO, "a write took no byte")
        left = left[written:]


def _probe(path: str) -> None:
    """OSError: a file of one byte cannot be written at ``path`` (a full filesystem takes an empty one)."""
    try:
        descriptor = files.create_file(path)
        try:
            _write_all(descriptor, b"\n")
        finally:
            os.close(descriptor)
    finally:
        _remove(path)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
