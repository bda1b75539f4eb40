"""Docker mode's answer to an oversized request body: how long it takes, and what it costs koordrp.

Starts a private dockerd and ``twistd -n koordrp --backend-runtime-mode=Docker`` in front of it, then
sends ``POST /containers/create`` with a body of ``--megabytes`` MB, once as one chunk of a chunked
body and once with a Content-Length, as a plain client would: it writes the whole body (koordrp may
stop reading it) and then reads the answer. Prints, for each, the seconds until the answer's first
byte arrived, its status, and koordrp's peak RSS growth (VmHWM after, less VmRSS before; the peak is
reset first where the kernel lets us). No dockerd is asked: nothing is created.

    .venv/bin/python -m benchmarks.docker_bodies [--megabytes 48] [--give-up 120]
"""

import argparse
import select
import socket
import threading
import time
from pathlib import Path

from benchmarks.docker import docker_mode
from tests.support.koordrp_process import KoordrpProcess, peak_rss_bytes, reset_peak_rss, rss_bytes


def send(client: socket.socket, head: bytes, body_parts: list[bytes]) -> None:
    try:
        client.sendall(head)
        for part in body_parts:
            client.sendall(part)
    except OSError:
        pass  # koordrp stopped reading: its answer is waiting to be read all the same


def answer_after(path: Path, head: bytes, body_parts: list[bytes], give_up: float) -> tuple[float | None, str]:
    """Seconds until the answer's first byte, and its status line."""
    client = socket.socket(socket.AF_UNIX)
    client.connect(str(path))
    started = time.monotonic()
    writer = threading.Thread(target=send, args=(client, head, body_parts), daemon=True)
    writer.start()
    received = b""
    first: float | None = None
    while b"\r\n" not in received:
        left = started + give_up - time.monotonic()
        if left <= 0 or not select.select([client], [], [], left)[0]:
            break
        data = client.recv(65536)
        if not data:
            break
        if first is None:
            first = time.monotonic() - started
        received += data
    client.close()
    writer.join(10)
    return first, received.split(b"\r\n", 1)[0].decode("latin-1")


def measure(proxy: KoordrpProcess, megabytes: int, give_up: float) -> None:
    size = megabytes * 1_000_000
    part = b"x" * 1_000_000
    parts = [part] * megabytes
    ways = {
        "one chunk": (b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % size, parts + [b"\r\n0\r\n\r\n"]),
        "Content-Length": (b"Content-Length: %d\r\n\r\n" % size, parts),
    }
    print(f"POST /containers/create with a {megabytes} MB body through koordrp (give up after {give_up:g}s)")
    print(f"{'body':<16}{'answer after':>14}{'peak RSS growth':>17}  status")
    for label, (framing, body_parts) in ways.items():
        head = b"POST /v1.41/containers/create HTTP/1.1\r\nHost: docker\r\nContent-Type: application/json\r\n" + framing
        reset_peak_rss(proxy.pid)
        before = rss_bytes(proxy.pid)
        seconds, status = answer_after(proxy.socket, head, body_parts, give_up)
        growth = peak_rss_bytes(proxy.pid) - before
        shown = "none" if seconds is None else f"{seconds:.2f}s"
        print(f"{label:<16}{shown:>14}{growth / 1e6:>15.1f}MB  {status or '(no answer)'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=int, default=48)
    parser.add_argument("--give-up", type=float, default=120.0)
    args = parser.parse_args()
    with docker_mode() as (_, _, proxy):
        measure(proxy, args.megabytes, args.give_up)


if __name__ == "__main__":
    main()
