"""Which pods containerd's NRI will tell koordrp the stop and removal of.

containerd keeps, for its plugins, the state of each pod it ran and of each container; a stop or a
removal is told only for what it has a state of. A pod gets one when containerd runs it (its
RunPodSandbox event); a container also when containerd synchronizes a plugin. So a pod that
containerd ran before it last restarted is never told to be gone: koordrp would keep it, and its
state file, until its next connection's Synchronize leaves it out. koordrp cannot know when a pod
it learnt from a Synchronize was run, so every pod it did not hear run on the containerd it is
connected to counts as untold; ``koordrp.nri.listing`` looks for those.

A containerd is known by its NRI socket: containerd makes the socket anew each time it starts, so
the file (device, inode, and the time it was made, should a file system reuse the inode) is the same
only while the same containerd serves it.
"""

from __future__ import annotations

import os
from typing import AbstractSet

SocketFile = tuple[int, int, int]
"""The device, inode and change time (ns) of containerd's NRI socket."""


def socket_file(path: str) -> SocketFile | None:
    """The socket at ``path`` as a file, or None if it cannot be looked at (then no containerd can be told apart)."""
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_dev, found.st_ino, found.st_ctime_ns


class ToldPods:
    """The pods koordrp heard containerd run, since that containerd started."""

    def __init__(self) -> None:
        self._socket: SocketFile | None = None
        self._told: set[str] = set()

    def connected(self, socket: SocketFile | None) -> None:
        """A connection to the containerd serving ``socket``: another containerd than the last one tells of no
        pod it did not run itself."""
        if socket is None or socket != self._socket:
            self._told.clear()
        self._socket = socket

    def ran(self, sandbox_id: str) -> None:
        self._told.add(sandbox_id)

    def removed(self, sandbox_id: str) -> None:
        self._told.discard(sandbox_id)

    def synchronized(self, sandbox_ids: AbstractSet[str]) -> None:
        """containerd has these pods now: those it removed while koordrp was not connected are no longer told."""
        self._told &= sandbox_ids

    def untold(self, known: AbstractSet[str]) -> set[str]:
        """Those of ``known`` whose stop and removal containerd will not tell koordrp of."""
        return set(known) - self._told
