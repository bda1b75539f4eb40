"""What koordrp trusts on the file system, by the rule sshd applies to a user's keys (its StrictModes).

A hook server is told every pod's environment (secrets among it) and may rewrite every container, so
koordrp calls a hook server's socket only where nobody but root (and koordrp's own user) could have
put it, and reads registrations only from a directory nobody else can change:

- every directory on the way, from ``/``, is owned by root or koordrp's user and not writable by
  group or others; a sticky directory (``/tmp``, 1777) may be passed through, since there only an
  entry's owner can replace it, and each entry is checked;
- the directory that holds the socket, and the registration directory itself, are not writable by
  group or others, sticky or not: anyone could take the name there first (bind the socket before the
  hook server does, or while it restarts);
- the socket, and each symbolic link followed (the path is resolved as the kernel resolves it, the
  target checked the same way), is owned by root or koordrp's user.

A socket's own mode is not looked at: its write bits say who may connect to it, not who may replace it.
When koordrp runs as root (as on a node) its user is root, which is also the owner it requires of every
registration file (``koordrp.hooks.config.permission_problem``).
"""

import errno
import os
import stat
from collections import deque
from dataclasses import dataclass

MAX_LINKS = 40
"""Symbolic links followed in one path at most, as the kernel's own limit."""

SocketIdentity = tuple[int, int, int]
"""(device, inode, change time) of a socket (``koordrp.unix.socket_identity``): a server that binds anew, a chmod
or chown, or a socket swapped in changes it."""


def owners() -> frozenset[int]:
    """Who may own what koordrp trusts: root, and the user koordrp runs as."""
    return frozenset((0, os.geteuid()))


class _Distrusted(Exception):
    """Why a path is not trusted, in one line naming the part of it at fault."""


@dataclass(frozen=True)
class _End:
    """Where a path leads: the real path of its last part and that part's lstat (None: it is not there), and the
    real directory holding it with that directory's stat. ``whole``: every directory above it was there."""

    path: str
    info: os.stat_result | None
    directory: str
    directory_info: os.stat_result
    whole: bool


def _owner(path: str, info: os.stat_result, allowed: frozenset[int], what: str) -> None:
    if info.st_uid not in allowed:
        trusted = "root" if allowed == frozenset((0,)) else "root or koordrp's user (uid " + ", ".join(
            str(uid) for uid in sorted(allowed - {0})
        ) + ")"
        raise _Distrusted(f"{what} {path} is owned by uid {info.st_uid}, not {trusted}")


def _passed_through(path: str, info: os.stat_result, allowed: frozenset[int]) -> None:
    """A directory on the way: nobody else may replace what is in it, unless it is sticky (its entries are checked)."""
    _owner(path, info, allowed, "directory")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        raise _Distrusted(
            f"directory {path} is group- or world-writable (mode {stat.S_IMODE(info.st_mode):04o}): "
            "others could replace what is in it"
        )


def _parts(path: str) -> list[str]:
    return [part for part in path.split("/") if part not in ("", ".")]


def _follow(path: str, allowed: frozenset[int]) -> _End:
    """Resolve ``path`` (absolute) from ``/`` as the kernel would, checking each directory passed through and each
    link followed; where it ends. _Distrusted; OSError other than a part missing."""
    root = os.lstat("/")
    _passed_through("/", root, allowed)
    current, current_info = "/", root
    pending = deque(_parts(path))
    links = 0
    while pending:
        name = pending.popleft()
        if name == "..":  # in a link's target: the real parent, which was passed through on the way here
            current = os.path.dirname(current)
            current_info = os.lstat(current)
            continue
        candidate = os.path.join(current, name)
        try:
            info = os.lstat(candidate)
        except (FileNotFoundError, NotADirectoryError):
            return _End(candidate, None, current, current_info, not pending)
        if stat.S_ISLNK(info.st_mode):
            links += 1
            if links > MAX_LINKS:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
            _owner(candidate, info, allowed, "symbolic link")
            target = os.readlink(candidate)
            if target.startswith("/"):
                current, current_info = "/", root
            pending.extendleft(reversed(_parts(target)))
            continue
        if not pending:
            return _End(candidate, info, current, current_info, True)
        if not stat.S_ISDIR(info.st_mode):
            return _End(candidate, None, current, current_info, False)
        _passed_through(candidate, info, allowed)
        current, current_info = candidate, info
    # The path is "/", or ends in a link to "/" or in "..": it ends at a directory already passed through.
    parent = os.path.dirname(current)
    return _End(current, current_info, parent, os.lstat(parent), True)


def _writable_by_others(info: os.stat_result) -> bool:
    return bool(info.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


@dataclass(frozen=True)
class SocketTrust:
    """What koordrp makes of a hook server's socket path."""

    problem: str | None
    """Why it is not to be trusted, naming the part at fault; None: nothing found on it is untrusted."""
    socket: SocketIdentity | None = None
    """The socket found there and trusted; None: none (the path leads nowhere yet, or to no socket)."""


def socket_trust(path: str, allowed: frozenset[int] | None = None) -> SocketTrust:
    """Whether koordrp may call the socket at ``path`` (absolute, normalised), as far as the path exists.

    A socket not there yet is not a problem here (``koordrp.unix.socket_problem`` says so), but a directory that
    would hold it and that others may write is: whoever binds the name there first gets the calls.
    """
    allowed = owners() if allowed is None else allowed
    try:
        end = _follow(path, allowed)
    except _Distrusted as distrusted:
        return SocketTrust(_in(path, str(distrusted)))
    except OSError as error:
        return SocketTrust(_in(path, f"cannot be looked at: {error.strerror or error}"))
    if not end.whole:
        return SocketTrust(None)
    if _writable_by_others(end.directory_info):
        return SocketTrust(
            _in(
                path,
                f"directory {end.directory} is group- or world-writable (mode {stat.S_IMODE(end.directory_info.st_mode):04o}): "
                f"anyone could bind {'its name' if end.path == path else end.path} there before the hook server does",
            )
        )
    if end.info is None or not stat.S_ISSOCK(end.info.st_mode):
        return SocketTrust(None)
    try:
        _owner(end.path, end.info, allowed, "socket")
    except _Distrusted as distrusted:
        return SocketTrust(_in(path, str(distrusted)))
    return SocketTrust(None, (end.info.st_dev, end.info.st_ino, end.info.st_ctime_ns))


def _in(path: str, reason: str) -> str:
    return f"socket {path} is not trusted: {reason}"


def directory_problem(path: str, allowed: frozenset[int] | None = None) -> str | None:
    """Why the directory ``path`` (absolute) may not be trusted with what is in it; None: it may (or it is not there).

    It, and each directory above it, is owned by root or koordrp's user; it is not writable by group or
    others, sticky or not (anyone could add a name to it); the directories above may be sticky.
    """
    allowed = owners() if allowed is None else allowed
    try:
        end = _follow(path, allowed)
        if end.info is None or not stat.S_ISDIR(end.info.st_mode):
            return None
        _owner(end.path, end.info, allowed, "directory")
    except _Distrusted as distrusted:
        return str(distrusted)
    except OSError as error:
        return f"{path} cannot be looked at: {error.strerror or error}"
    if _writable_by_others(end.info):
        return (
            f"directory {end.path} is group- or world-writable (mode {stat.S_IMODE(end.info.st_mode):04o}): "
            "others could add, replace or remove what is in it"
        )
    return None
