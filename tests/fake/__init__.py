"""Stand-ins for what a unit test cannot have for real."""

from concurrent import futures
from typing import TYPE_CHECKING, Callable

import grpc

from koordrp.unix import grpc_target

if TYPE_CHECKING:
    # grpc-stubs makes the handler generic; grpcio's class itself cannot be subscripted at run time.
    BytesHandler = grpc.GenericRpcHandler[bytes, bytes]
else:
    BytesHandler = grpc.GenericRpcHandler


class FakeGrpcServer:
    """A real grpc server on a unix socket, started and stopped by the test."""

    path: str
    _server: grpc.Server | None = None

    def _serve(self, register: Callable[[grpc.Server], None], handlers: list[grpc.GenericRpcHandler] | None = None) -> None:  # type: ignore[type-arg]
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), handlers=handlers)
        register(server)
        server.add_insecure_port(grpc_target(self.path))
        server.start()
        self._server = server

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(0).wait()
            self._server = None
