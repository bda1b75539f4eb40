"""The floor of a hook call's CPU: what a bare grpcio client pays per unary call to a no-op hook server.

    .venv/bin/python -m benchmarks.floor [--calls 2000]

The server (this module with ``--serve SOCKET``, a process of its own) answers every hook with an empty
message. The client, in this process, calls it as a client on an event loop must: ``.future()`` and a
done-callback, which here wakes the calling thread; one call at a time. Its CPU is every thread of this
process's, grpc's own included, those that ended too (its process CPU clock). benchmarks/hooks.py and benchmarks/nri_starts.py measure it
first, in the same run, and print koordrp's CPU per hook call as a ratio to it; hooks.py also makes one
call of the same client (``CallingBack``) in each of its rounds, after the same pause as koordrp's calls
(the paced floor). Blocking calls, which no reactor can make, are printed beside it for reference.
"""

import argparse
import os
import subprocess
import tempfile
import threading
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager

import grpc

from benchmarks.processes import running_module
from benchmarks.stats import process_cpu_ns
from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from koordrp.api.runtime.v1alpha1 import api_pb2_grpc as hook_grpc
from tests.fake import BytesHandler

WARM_UP = 200
CALLS = 2000


def request() -> hook.ContainerResourceHookRequest:
    """A request of the shape koordrp sends for a container's update: its pod's and its own metadata, resources."""
    sent = hook.ContainerResourceHookRequest()
    sent.pod_meta.name, sent.pod_meta.namespace, sent.pod_meta.uid = "web-0", "default", "5f0c1e8a-0000-4000-8000-000000000000"
    sent.container_meta.name, sent.container_meta.id = "app", "c" * 64
    sent.pod_labels["app"] = "web"
    sent.container_annotations["io.kubernetes.container.hash"] = "1a2b3c4d"
    sent.container_resources.cpu_shares = 1024
    sent.container_resources.memory_limit_in_bytes = 1 << 30
    sent.pod_cgroup_parent = "/kubepods/burstable/pod5f0c1e8a"
    return sent


def _empty(request: bytes, context: grpc.ServicerContext) -> bytes:
    return b""


class _NoOp(BytesHandler):
    def service(self, handler_call_details: grpc.HandlerCallDetails) -> "grpc.RpcMethodHandler[bytes, bytes]":
        return grpc.unary_unary_rpc_method_handler(_empty)


def serve(socket: str) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((_NoOp(),))
    server.add_insecure_port(f"unix:{socket}")
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()


def no_op_server(socket: Path) -> ContextManager["subprocess.Popen[bytes]"]:
    """The no-op hook server on ``socket``, in a process of its own, until the block ends."""
    return running_module("benchmarks.floor", "--serve", str(socket))


class CallingBack:
    """A bare grpcio client calling as one on an event loop must: ``.future()`` and a done-callback, which wakes the
    calling thread here; one call at a time."""

    def __init__(self, method: Any) -> None:
        self._method = method
        self._done = threading.Event()

    def _called_back(self, _: object) -> None:
        self._done.set()

    def call(self, sent: hook.ContainerResourceHookRequest) -> None:
        self._done.clear()
        self._method.future(sent, timeout=10).add_done_callback(self._called_back)
        self._done.wait()


def _with_callbacks(method: Any, sent: hook.ContainerResourceHookRequest, calls: int) -> None:
    client = CallingBack(method)
    for _ in range(calls):
        client.call(sent)


def _blocking(method: Any, sent: hook.ContainerResourceHookRequest, calls: int) -> None:
    for _ in range(calls):
        method(sent, timeout=10)


def _cpu_per_call(way: Callable[[Any, hook.ContainerResourceHookRequest, int], None], method: Any, calls: int) -> float:
    sent = request()
    way(method, sent, WARM_UP)
    before = process_cpu_ns(os.getpid())
    way(method, sent, calls)
    return (process_cpu_ns(os.getpid()) - before) / 1e9 / calls


@dataclass(frozen=True)
class Floor:
    """CPU seconds per call of a bare grpcio client against a no-op server."""

    future_and_callback: float
    """The floor: the way a client on an event loop calls."""
    blocking: float

    def line(self) -> str:
        return (
            f"the floor: a bare grpcio client, .future() and a done-callback, against a no-op hook server: "
            f"{self.future_and_callback * 1e3:.3f} ms of CPU per call (blocking calls: {self.blocking * 1e3:.3f} ms)"
        )

    def ratio(self, cpu_per_call: float) -> str:
        return f"{cpu_per_call / self.future_and_callback:.2f}x the floor"


def measure(calls: int = CALLS) -> Floor:
    """The floor, measured now (the caller's other work paused: this process's CPU is what is counted)."""
    with tempfile.TemporaryDirectory(prefix="krp-floor-", dir="/tmp") as scratch:
        socket = Path(scratch) / "no-op.sock"
        with no_op_server(socket), grpc.insecure_channel(f"unix:{socket}") as channel:
            method = hook_grpc.RuntimeHookServiceStub(channel).PreUpdateContainerResourcesHook
            return Floor(_cpu_per_call(_with_callbacks, method, calls), _cpu_per_call(_blocking, method, calls))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=CALLS, help="calls measured each way")
    parser.add_argument("--serve", metavar="SOCKET", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    print(measure(args.calls).line())


if __name__ == "__main__":
    main()
