"""Where one hook call's CPU goes inside koordrp, beside the floor, all in one process and one run.

    .venv/bin/python -m benchmarks.hook_call [--calls 3000]

Against benchmarks/floor.py's no-op hook server (a process of its own), one call at a time, this process's
CPU per call (its process CPU clock: every thread, those that ended too):

* the floor: a bare grpcio client, ``.future()`` and a done-callback (and blocking calls, for reference);
* koordrp's hook client alone (``HookClient.call`` on the reactor: the HTTP/2 connection, the reactor's
  turn for the answer, the timeout, the answer parsed);
* a hook stage of one server (``Dispatcher.run``: the client, plus the budget, silences, the answer
  checked and merged, the call counted).

What a whole intercepted call adds beyond the stage (the flow waiting for it and going on, the call's
line, post stages) is in benchmarks/hooks.py (proxy) and benchmarks/nri_starts.py (NRI), which measure
the floor the same way.
"""

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

from benchmarks.floor import CALLS, WARM_UP, no_op_server, request
from benchmarks.floor import measure as measure_floor
from benchmarks.stats import process_cpu_ns
from koordrp.hooks.client import HookClients
from koordrp.hooks.dispatcher import Dispatcher
from koordrp.hooks.types import FailurePolicy, HookServerConfig, HookType

HOOK = HookType.PRE_UPDATE_CONTAINER_RESOURCES


def _on_the_reactor(call: Callable[[], "Deferred[Any]"], calls: int) -> float:
    """CPU seconds per call of ``calls`` made one after another on the reactor (after a warm-up)."""
    measured: list[float] = []

    def failed(failure: Failure) -> None:
        print(failure.getTraceback())
        reactor.crash()

    def run(left: int, before: int) -> None:
        if left == 0:
            measured.append((process_cpu_ns(os.getpid()) - before) / 1e9 / calls)
            reactor.crash()
            return
        call().addCallback(lambda _: run(left - 1, before)).addErrback(failed)

    def warmed(left: int) -> None:
        if left == 0:
            run(calls, process_cpu_ns(os.getpid()))
            return
        call().addCallback(lambda _: warmed(left - 1)).addErrback(failed)

    reactor.callWhenRunning(warmed, WARM_UP)
    reactor.run()
    if not measured:
        raise SystemExit("a hook call failed")
    return measured[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=CALLS, help="calls measured each way")
    args = parser.parse_args()
    floor = measure_floor(args.calls)
    print(floor.line())
    with tempfile.TemporaryDirectory(prefix="krp-hook-call-", dir="/tmp") as scratch:
        socket = Path(scratch) / "no-op.sock"
        with no_op_server(socket):
            os.chmod(socket, 0o600)  # koordrp calls only a socket others may not write
            sent = request()
            clients = HookClients(reactor)
            client = clients.get(str(socket))
            alone = _on_the_reactor(lambda: client.call(HOOK, sent, 10.0), args.calls)
            server = HookServerConfig("no-op.json", str(socket), FailurePolicy.IGNORE, frozenset(HookType), 10.0)
            dispatcher = Dispatcher(clients, reactor)
            stage = _on_the_reactor(lambda: Deferred.fromCoroutine(dispatcher.run(HOOK, (server,), sent, 10.0)), args.calls)
            clients.close_all()
    print(f"koordrp's hook client alone: {alone * 1e3:.3f} ms of CPU per call, {floor.ratio(alone)}")
    print(
        f"a hook stage of one server (Dispatcher.run): {stage * 1e3:.3f} ms, {floor.ratio(stage)}; "
        f"the stage's own share {(stage - alone) * 1e3:.3f} ms"
    )


if __name__ == "__main__":
    main()
