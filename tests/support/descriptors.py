"""koordrp's file descriptors as a test sees them: started with systemd's default limit, and counted while it works."""

import os
import shutil
import threading

from tests.support.koordrp_process import KoordrpProcess

DESCRIPTOR_LIMIT = 1024
"""systemd's default for a unit that sets no LimitNOFILE, soft and hard."""


class LimitedKoordrp(KoordrpProcess):
    """koordrp with the descriptor limit systemd gives a unit that sets none, soft and hard."""

    def argv(self) -> list[str]:
        prlimit = shutil.which("prlimit")
        assert prlimit is not None, "prlimit (util-linux) is needed to start koordrp with 1024 descriptors"
        return [prlimit, f"--nofile={DESCRIPTOR_LIMIT}:{DESCRIPTOR_LIMIT}", "--", *super().argv()]


def open_descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class MostDescriptors(threading.Thread):
    """The most descriptors ``pid`` has open, read every few milliseconds until ``stop``."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.most = open_descriptors(pid)
        self._stopping = threading.Event()

    def run(self) -> None:
        while not self._stopping.wait(0.002):
            self.most = max(self.most, open_descriptors(self.pid))

    def stop(self) -> int:
        self._stopping.set()
        self.join()
        return self.most
