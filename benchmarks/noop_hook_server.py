"""A hook server that answers every hook with an empty response, in a process of its own.

    python -m benchmarks.noop_hook_server SOCKET

Runs until SIGTERM or SIGINT. Benchmarks start it as a separate process, as a plugin such as
koordlet would be, so its work does not compete with the benchmark's client for one interpreter.
"""

import signal
import sys
import threading

from tests.fake.hook_server import FakeHookServer


def main() -> None:
    server = FakeHookServer(sys.argv[1]).start()
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    print("ready", flush=True)
    stop.wait()
    server.stop()


if __name__ == "__main__":
    main()
