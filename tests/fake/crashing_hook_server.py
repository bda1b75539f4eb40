"""A hook server process that dies in the middle of every call, as a crashing plugin would.

    python -m tests.fake.crashing_hook_server SOCKET
"""

import os
import sys
import threading

from tests.fake.hook_server import HOOK_RPCS, FakeHookServer


def main() -> None:
    server = FakeHookServer(sys.argv[1])
    for rpc in HOOK_RPCS:
        server.behaviours[rpc] = lambda request: os._exit(3)
    server.start()
    print("ready", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
