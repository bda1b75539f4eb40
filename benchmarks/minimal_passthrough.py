"""The floor koordrp's pass-through is measured against: the least a grpcio proxy can do.

    python -m benchmarks.minimal_passthrough LISTEN_SOCKET BACKEND_SOCKET

One generic handler, one cached unary handler, identity serializers, a blocking upstream call on one
shared channel with the caller's deadline and metadata: no routing, no status relaying, no
reachability tracking. It answers unary methods only, which is all the benchmark sends it.
"""

import signal
import subprocess
import sys
import threading
from concurrent import futures
from typing import TYPE_CHECKING, Any, ContextManager

import grpc

from benchmarks.processes import running_module

if TYPE_CHECKING:
    # grpc-stubs makes the handler generic; grpcio's class itself cannot be subscripted at run time.
    _BytesHandler = grpc.GenericRpcHandler[bytes, bytes]
else:
    _BytesHandler = grpc.GenericRpcHandler


def main() -> None:
    listen, backend = sys.argv[1], sys.argv[2]
    channel = grpc.insecure_channel(f"unix:{backend}")
    upstreams: dict[str, Any] = {}

    class Handler(_BytesHandler):
        def service(self, details: Any) -> Any:
            method = details.method
            if method not in upstreams:
                # grpc-stubs 1.53 predates grpcio's _registered_method and wrongly requires the serializers.
                upstream = channel.unary_unary(method, _registered_method=True)  # type: ignore[call-arg]

                def forward(request: bytes, context: Any) -> Any:
                    remaining = context.time_remaining()
                    return upstream(
                        request,
                        timeout=None if remaining > 1e9 else remaining,
                        metadata=context.invocation_metadata(),
                    )

                upstreams[method] = grpc.unary_unary_rpc_method_handler(forward)
            return upstreams[method]

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64), handlers=[Handler()])
    server.add_insecure_port(f"unix:{listen}")
    server.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print("ready", flush=True)
    stop.wait()
    server.stop(0)


def running(listen: str, backend: str) -> ContextManager["subprocess.Popen[bytes]"]:
    """This pass-through as a process of its own, listening on ``listen`` until the block ends."""
    return running_module("benchmarks.minimal_passthrough", listen, backend)


if __name__ == "__main__":
    main()
