"""Opening a file koordrp reads on its reactor: never waiting, and never anything but a regular file.

A FIFO's ``open`` waits for a writer and its ``read`` for data; a device may do something when opened.
Either would stop the reactor, and every call with it. So a file is looked at before it is opened
(what is not a regular file is never opened), opened without waiting (``O_NONBLOCK``, in case one
was swapped in meanwhile), and looked at again through what was opened (``fstat``) before a byte is
read. The hook server registrations and the state files are read so. A file koordrp writes is made anew
(``create_file``): whatever was at its name goes first, so that neither a FIFO (which would stop the
reactor) nor a symbolic link (which would have root write where it points) is ever opened; one it changes in
place is opened as one it reads is (``open_file(writing=True)``).
"""

import os
import stat

_KINDS = (
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symbolic link"),
)

_FLAGS = os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC

_READ_CHUNK = 64 * 1024


def kind(mode: int) -> str:
    """What a file of ``mode`` is, in words ("a FIFO")."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


class NotAFile(Exception):
    """What is at a path is no regular file; ``info`` (its stat) says what it is."""

    def __init__(self, info: os.stat_result) -> None:
        super().__init__(f"is {kind(info.st_mode)}, not a regular file")
        self.info = info


def open_file(path: str, follow: bool = True, writing: bool = False) -> tuple[int, os.stat_result]:
    """A descriptor of the regular file at ``path``, open for reading, and its ``fstat``; the caller closes it.

    ``follow=False``: a symbolic link is refused as what it is (``O_NOFOLLOW``), not followed. ``writing``: open
    for writing instead, to change in place what it holds (nothing is truncated).

    NotAFile: a directory, FIFO, device, socket (or, not following, a link), never opened, or found so once
    opened. OSError: as ``stat`` and ``open`` raise them.
    """
    info = os.stat(path) if follow else os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        raise NotAFile(info)
    flags = _FLAGS | (os.O_WRONLY if writing else os.O_RDONLY)
    descriptor = os.open(path, flags if follow else flags | os.O_NOFOLLOW)
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):  # swapped in since the stat
            raise NotAFile(info)
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor, info


def read_at_most(descriptor: int, limit: int) -> bytes:
    """What the file holds, ``limit`` + 1 bytes at most: more than ``limit`` says it is larger than that."""
    chunks: list[bytes] = []
    total = 0
    while total <= limit:
        chunk = os.read(descriptor, min(_READ_CHUNK, limit + 1 - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def create_file(path: str, mode: int = 0o600) -> int:
    """A descriptor of a new regular file at ``path``, open for writing; the caller closes it. Whatever was there
    (an earlier write's leftover, or something planted) is removed, and the file is created only if nothing
    took the name meanwhile (``O_EXCL``, which follows no link). OSError: as ``unlink`` and ``open`` raise them."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        return os.open(path, flags, mode)
    except FileExistsError:  # the name is seldom taken: an unlink only then spares every write a system call
        pass
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return os.open(path, flags, mode)
