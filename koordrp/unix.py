"""Unix sockets: endpoints as operators write them, and the place where koordrp listens.

An endpoint is a plain absolute path or a ``unix://`` URL. Before binding, the socket's directory is
created (or checked: nobody else may write it), a stale socket is removed, and afterwards the socket
gets its mode and group.
"""

import contextlib
import errno
import os
import socket
import stat
from typing import Iterator

UNIX_SCHEME = "unix://"


class EndpointError(ValueError):
    """An endpoint that koordrp cannot use."""


def parse_unix_endpoint(value: str) -> str:
    """Return the absolute, normalised socket path named by ``value``.

    koord-runtime-proxy and kubelet both accept either form, so koordrp does too; anything that is
    not an absolute path (a relative path, ``tcp://``, an empty string) is refused rather than
    guessed at, because a daemon that binds or dials the wrong place fails far from the cause.
    """
    path = value[len(UNIX_SCHEME):] if value.startswith(UNIX_SCHEME) else value
    if "://" in path:
        raise EndpointError(f"{value!r} is not a unix socket endpoint (only unix:// is supported)")
    if not path.startswith("/"):
        raise EndpointError(f"{value!r} is not an absolute path or unix:// URL")
    return os.path.normpath(path)


def grpc_target(path: str) -> str:
    """The target string grpcio dials or binds for a unix socket path."""
    return "unix:" + path

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


def socket_problem(path: str) -> str | None:
    """Why ``path`` is not a unix socket to connect to (without connecting); None: it is one."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return f"socket {path} does not exist"
    except OSError as error:
        return f"socket {path} cannot be used: {error.strerror}"
    return None if stat.S_ISSOCK(mode) else f"{path} is not a socket"


def socket_identity(path: str) -> tuple[int, int, int] | None:
    """The socket at ``path`` (device, inode and change time: a freed inode is soon used again): a server that
    restarts makes a new one. None: no socket there."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (info.st_dev, info.st_ino, info.st_ctime_ns) if stat.S_ISSOCK(info.st_mode) else None


def connect_error(path: str, timeout: float) -> OSError | None:
    """Why connecting to the unix socket ``path`` fails, or None when a connection is accepted."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(timeout)
    try:
        probe.connect(path)
    except OSError as error:
        return error
    finally:
        probe.close()
    return None


def _accepts_connections(path: str) -> bool:
    error = connect_error(path, 1.0)
    if error is None:
        return True
    if error.errno in (errno.ECONNREFUSED, errno.ENOENT):
        return False
    raise error


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
