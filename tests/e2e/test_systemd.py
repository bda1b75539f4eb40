"""``twistd koordrp`` under systemd's notify protocol, heard on a real unix datagram socket."""

import socket
from pathlib import Path

from tests.support.containerd import Containerd
from tests.support.koordrp_process import KoordrpProcess


def test_ready_once_the_socket_serves_a_fed_watchdog_and_stopping_on_sigterm(containerd: Containerd, workdir: Path) -> None:
    address = str(workdir / "notify")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(address)
    listener.settimeout(10)
    proxy = KoordrpProcess(workdir, containerd.endpoint, environ={"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "400000"})
    try:
        proxy.start()
        assert listener.recv(4096) == b"READY=1"
        with proxy.channel() as channel:
            assert proxy.answers(channel)
        pings = [listener.recv(4096) for _ in range(3)]
        assert pings == [b"WATCHDOG=1"] * 3
        assert proxy.terminate() == 0
        messages = []
        while b"STOPPING=1" not in messages:
            messages.append(listener.recv(4096))
        assert set(messages) <= {b"WATCHDOG=1", b"STOPPING=1"}
    finally:
        proxy.stop()
        listener.close()
