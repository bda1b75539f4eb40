"""Preparing the place where koordrp listens: its directory, a stale socket, its permissions."""

import contextlib
import errno
import os
import socket
import stat
from typing import Iterator


class CannotListen(RuntimeError):
    """koordrp cannot take its socket; the message says why, in one line."""


class SocketInUse(CannotListen):
    """Another live process already serves the socket path."""


class NotASocket(CannotListen):
    """Something other than a socket sits where koordrp should listen."""


class UnsafeDirectory(CannotListen):
    """The socket's directory lets someone else replace koordrp's socket."""


SOCKET_DIRECTORY_MODE = 0o755
# kubelet (root) and whoever is in the socket's group may talk to koordrp; nobody else.
SOCKET_MODE = 0o660


def prepare_listening_path(path: str) -> None:
    """Make ``path`` ready to bind: create its directory and remove a socket nobody serves.

    A socket that still accepts connections belongs to a running proxy, and anything that is not
    a socket is an operator's file: koordrp refuses both rather than stealing or deleting them.
    """
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        os.makedirs(directory, exist_ok=True)
        # Explicitly: makedirs' mode is cut by the umask, and twistd daemonizes with 077.
        os.chmod(directory, SOCKET_DIRECTORY_MODE)
    check_directory(directory)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise NotASocket(f"{path} exists and is not a socket; refusing to replace it")
    if _accepts_connections(path):
        raise SocketInUse(f"{path} is in use by another running process")
    os.unlink(path)


def check_directory(directory: str) -> None:
    """Whoever can write the socket's directory can swap the socket kubelet talks to."""
    info = os.stat(directory)
    if info.st_uid != os.geteuid():
        raise UnsafeDirectory(f"{directory} is owned by uid {info.st_uid}, not by koordrp's user (uid {os.geteuid()})")
    if info.st_mode & 0o022:
        raise UnsafeDirectory(f"{directory} is group- or world-writable (mode {stat.S_IMODE(info.st_mode):04o})")


def _accepts_connections(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError as error:
        if error.errno in (errno.ECONNREFUSED, errno.ENOENT):
            return False
        raise
    finally:
        probe.close()
    return True


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    """Bind under a restrictive umask so the socket is never, even briefly, wider than intended."""
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


def restrict_socket(path: str, gid: int | None) -> None:
    """Give the listening socket its mode and, when asked, the group that may use it."""
    os.chmod(path, SOCKET_MODE)
    if gid is not None:
        os.chown(path, -1, gid)


def remove_socket(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
