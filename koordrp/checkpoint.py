"""What kubelet asked for each pod and container, kept on disk where it differs from what the runtime has.

The runtime keeps what it was given, hooks' changes included, and koordrp rebuilds its store from it
after a restart; what kubelet asked before the hooks changed it is kept nowhere else. Hooks are asked
with kubelet's values (a hook that scales a value must scale kubelet's, once), so koordrp keeps
them here, one small file per pod or container whose hooks changed something, in a directory only
root may read (environment values may be secrets): ``<dir>/pods/<id>``, ``<dir>/containers/<id>``,
each the serialized hook request. The default directory is under /var/run: it lasts as long as the
node's running containers do.
"""

import os
import re
import stat
from typing import AbstractSet, Callable, Literal, Protocol, TypeVar

from google.protobuf.message import DecodeError
from twisted.logger import Logger

Kind = Literal["pods", "containers"]
KINDS: tuple[Kind, ...] = ("pods", "containers")

# Runtime ids are hex; anything else (or absurdly long) is not given a file name.
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
DIRECTORY_MODE = 0o700
MAX_FILE_BYTES = 16 << 20
"""A kept hook request is a CRI request's worth: kubelet's own limit for one is 16 MiB."""

Parsed = TypeVar("Parsed")


class StateUnreadable(Exception):
    """Something is kept for a pod or container that koordrp cannot read; the message names the file and why."""


class Checkpoint(Protocol):
    def write(self, kind: Kind, identifier: str, data: bytes | None) -> None:
        """Keep ``data`` for ``identifier``; None: keep nothing (forget what was kept)."""

    def read(self, kind: Kind, identifier: str, parse: Callable[[bytes], Parsed]) -> Parsed | None:
        """What is kept for ``identifier``, parsed; None: nothing is kept.

        StateUnreadable: something is kept that cannot be read, or that ``parse`` refuses
        (DecodeError, ValueError).
        """

    def retain(self, kind: Kind, identifiers: AbstractSet[str]) -> None:
        """Forget what is kept for every identifier not in ``identifiers``."""

    def count(self) -> int:
        """How many pods and containers something is kept for."""


class NoCheckpoint:
    """Nothing is kept: after a restart, what the runtime has stands for what kubelet asked."""

    def write(self, kind: Kind, identifier: str, data: bytes | None) -> None:
        pass

    def read(self, kind: Kind, identifier: str, parse: Callable[[bytes], Parsed]) -> Parsed | None:
        return None

    def retain(self, kind: Kind, identifiers: AbstractSet[str]) -> None:
        pass

    def count(self) -> int:
        return 0


class CheckpointError(RuntimeError):
    """The checkpoint directory cannot be used; the message says why, in one line."""


class DirectoryCheckpoint:
    """One file per identifier, written atomically (a temporary file, then a rename).

    A file that cannot be written costs one warning per reason, and koordrp goes on: it then
    knows what kubelet asked only until it restarts.
    """

    log = Logger()

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._kept: dict[Kind, set[str]] = {kind: set() for kind in KINDS}
        self._failing: tuple[str, str] | None = None
        """What failed last (the warning's format, the reason), while it keeps failing."""

    def open(self) -> None:
        """Create the directory or check it, 0700 (it holds environment values); learn what is kept there.

        CheckpointError: it cannot be used, or someone else could change what it holds.
        """
        try:
            for kind in KINDS:
                os.makedirs(os.path.join(self.directory, kind), mode=DIRECTORY_MODE, exist_ok=True)
            status = os.stat(self.directory)
            if status.st_uid != os.geteuid() or status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                raise CheckpointError(f"{self.directory} may be written by others than koordrp's user; refusing it")
            os.chmod(self.directory, DIRECTORY_MODE)  # makedirs' mode is cut by the umask, and spares parents
            for kind in KINDS:
                path = os.path.join(self.directory, kind)
                os.chmod(path, DIRECTORY_MODE)
                self._kept[kind] = {name for name in os.listdir(path) if _ID.fullmatch(name)}
        except OSError as error:
            raise CheckpointError(f"cannot use {self.directory}: {error.strerror}") from None

    def _path(self, kind: Kind, identifier: str) -> str | None:
        return os.path.join(self.directory, kind, identifier) if _ID.fullmatch(identifier) else None

    def write(self, kind: Kind, identifier: str, data: bytes | None) -> None:
        path = self._path(kind, identifier)
        if path is None:
            return
        kept = self._kept[kind]
        if data is None:
            if identifier in kept:
                kept.discard(identifier)
                try:
                    _remove(path)
                except OSError as error:
                    self._failed(error, "cannot remove what was kept for a pod or container gone from {directory}: {reason}")
            return
        temporary = os.path.join(self.directory, kind, f".{identifier}.new")
        try:
            descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(descriptor, data)
            finally:
                os.close(descriptor)
            os.replace(temporary, path)
        except OSError as error:
            self._failed(error, "cannot keep what kubelet asked in {directory}: {reason}; it is kept in memory only")
            try:
                _remove(temporary)
            except OSError:
                pass  # the reason is said already
            return
        self._failing = None
        kept.add(identifier)

    def _failed(self, error: OSError, format: str) -> None:
        """One warning for each thing that fails and why, for as long as it keeps failing."""
        reason = error.strerror or str(error)
        if (format, reason) != self._failing:
            self._failing = (format, reason)
            self.log.warn(format, directory=self.directory, reason=reason)

    def read(self, kind: Kind, identifier: str, parse: Callable[[bytes], Parsed]) -> Parsed | None:
        path = self._path(kind, identifier)
        if path is None or identifier not in self._kept[kind]:
            return None
        try:
            with open(path, "rb") as stream:
                data = stream.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:  # removed by someone else: nothing is kept
            self._kept[kind].discard(identifier)
            return None
        except OSError as error:
            raise StateUnreadable(f"{path}: {error.strerror}") from None
        if len(data) > MAX_FILE_BYTES:
            raise StateUnreadable(f"{path}: larger than {MAX_FILE_BYTES >> 20} MiB")
        try:
            return parse(data)
        except (DecodeError, ValueError) as error:
            raise StateUnreadable(f"{path}: {error or type(error).__name__}") from None

    def retain(self, kind: Kind, identifiers: AbstractSet[str]) -> None:
        for identifier in self._kept[kind] - identifiers:
            self.write(kind, identifier, None)

    def count(self) -> int:
        return sum(len(kept) for kept in self._kept.values())


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
