"""Raw-bytes forwarding of every CRI call to its backend.

This is kubelet's hot path: nothing here parses a message, logs per call or touches the reactor.
Requests and responses stay bytes (no serializers), the caller's deadline and metadata go upstream,
and the backend's status, details and trailing metadata come back as they were.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable, Iterator, NoReturn, Sequence, TypeVar, cast

import grpc

from koordrp.cri.backend import BackendChannel
from koordrp.cri.methods import BackendRole, Cardinality, route

Request = TypeVar("Request")
"""A streaming call's request: bytes, or an iterator of them."""

if TYPE_CHECKING:
    # Only --metrics-endpoint loads prometheus_client: it costs a node daemon ~6 MB of RSS.
    from koordrp.metrics import Metrics

    # grpc-stubs makes the handler generic; grpcio's class itself cannot be subscripted at run time.
    _BytesHandler = grpc.GenericRpcHandler[bytes, bytes]
else:
    _BytesHandler = grpc.GenericRpcHandler

# grpcio reports "no deadline" as a remaining time of about 292 years; upstream that means none.
_NO_DEADLINE_THRESHOLD = 10 * 365 * 24 * 3600.0
# Method names come from callers; only this many distinct ones get a cached handler, so a client
# inventing names cannot grow koordrp's memory.
_MAX_CACHED_METHODS = 512


def remaining_timeout(context: grpc.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None or remaining > _NO_DEADLINE_THRESHOLD else remaining


def relay_status(
    context: grpc.ServicerContext,
    backend: BackendChannel,
    code: grpc.StatusCode,
    details: str | None,
    trailing: Sequence[tuple[str, str | bytes]] | None,
) -> NoReturn:
    """End the caller's RPC with the backend's status, or with a clear outage message."""
    if trailing:
        context.set_trailing_metadata(tuple(trailing))
    if code is grpc.StatusCode.UNAVAILABLE and not backend.reachable:
        details = backend.outage_details(details)
    context.abort(code, details or "")


def relay_failure(error: grpc.RpcError, context: grpc.ServicerContext, backend: BackendChannel) -> NoReturn:
    call = cast(grpc.Call, error)
    relay_status(context, backend, call.code(), call.details(), call.trailing_metadata())


def cancel_with_caller(context: grpc.ServicerContext, call: "grpc.Future[bytes]") -> None:
    """Cancel the upstream ``call`` when the caller's RPC ends; after completion a cancel does nothing."""

    def cancel() -> None:
        call.cancel()

    if not context.add_callback(cancel):
        cancel()


class StreamRegistry:
    """The upstream streams in flight, so that shutting down can end them at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: set[grpc.Future[bytes]] = set()
        self.closing = False

    def add(self, stream: grpc.Future[bytes]) -> None:
        with self._lock:
            self._streams.add(stream)
        if self.closing:
            stream.cancel()

    def discard(self, stream: grpc.Future[bytes]) -> None:
        with self._lock:
            self._streams.discard(stream)

    def end_all(self) -> None:
        self.closing = True
        with self._lock:
            streams = list(self._streams)
        for stream in streams:
            stream.cancel()


def _relay_stream(
    responses: grpc.CallIterator[bytes],
    context: grpc.ServicerContext,
    backend: BackendChannel,
    streams: StreamRegistry,
) -> Iterator[bytes]:
    call = cast("grpc.Future[bytes]", responses)
    streams.add(call)
    cancel_with_caller(context, call)
    try:
        yield from cast(Iterator[bytes], responses)
    except grpc.RpcError as error:
        if streams.closing:
            context.abort(grpc.StatusCode.UNAVAILABLE, "koordrp is shutting down")
        relay_failure(error, context, backend)
    finally:
        streams.discard(call)
    trailing = responses.trailing_metadata()
    if trailing:
        context.set_trailing_metadata(trailing)


def unary_unary_forwarder(method: str, backend: BackendChannel) -> Callable[[bytes, grpc.ServicerContext], bytes]:
    upstream = backend.channel.unary_unary(method, _registered_method=True)  # type: ignore[call-arg]

    def forward(request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            response, call = upstream.with_call(
                request, timeout=remaining_timeout(context), metadata=context.invocation_metadata()
            )
        except grpc.RpcError as error:
            relay_failure(error, context, backend)
        trailing = call.trailing_metadata()
        if trailing:
            context.set_trailing_metadata(trailing)
        return cast(bytes, response)

    return forward


def cancellable_unary_unary_forwarder(
    method: str, backend: BackendChannel
) -> Callable[[bytes, grpc.ServicerContext], bytes]:
    upstream = backend.channel.unary_unary(method, _registered_method=True)  # type: ignore[call-arg]

    def forward(request: bytes, context: grpc.ServicerContext) -> bytes:
        call = upstream.future(request, timeout=remaining_timeout(context), metadata=context.invocation_metadata())
        cancel_with_caller(context, cast("grpc.Future[bytes]", call))
        try:
            response = call.result()
        except grpc.RpcError as error:
            relay_failure(error, context, backend)
        trailing = cast(grpc.Call, call).trailing_metadata()
        if trailing:
            context.set_trailing_metadata(trailing)
        return cast(bytes, response)

    return forward


def unary_stream_forwarder(
    method: str, backend: BackendChannel, streams: StreamRegistry
) -> Callable[[bytes, grpc.ServicerContext], Iterator[bytes]]:
    upstream = backend.channel.unary_stream(method, _registered_method=True)  # type: ignore[call-arg]

    def forward(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        responses = upstream(request, timeout=remaining_timeout(context), metadata=context.invocation_metadata())
        return _relay_stream(responses, context, backend, streams)

    return forward


def stream_stream_forwarder(
    method: str, backend: BackendChannel, streams: StreamRegistry
) -> Callable[[Iterator[bytes], grpc.ServicerContext], Iterator[bytes]]:
    upstream = backend.channel.stream_stream(method, None, None)

    def forward(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        responses = upstream(requests, timeout=remaining_timeout(context), metadata=context.invocation_metadata())
        return _relay_stream(responses, context, backend, streams)

    return forward


class PassThroughHandler(_BytesHandler):
    """Answers every method, known or not, by forwarding it to the backend that serves it."""

    def __init__(
        self,
        backends: dict[BackendRole, BackendChannel],
        intercepted: dict[str, Callable[[bytes, grpc.ServicerContext], bytes]] | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self._backends = backends
        self._metrics = metrics
        # Intercepted methods are answered (and counted, at their end) by their own handlers;
        # everything else is forwarded.
        self._handlers: dict[str, grpc.RpcMethodHandler[bytes, bytes]] = {
            method: grpc.unary_unary_rpc_method_handler(behaviour) for method, behaviour in (intercepted or {}).items()
        }
        self.streams = StreamRegistry()

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[bytes, bytes] | None:
        method = handler_call_details.method
        handler = self._handlers.get(method)
        if handler is None:
            handler = self._build(method)
            if len(self._handlers) < _MAX_CACHED_METHODS:
                self._handlers[method] = handler
        return handler

    def _counted(
        self, method: str, behaviour: Callable[[bytes, grpc.ServicerContext], bytes]
    ) -> Callable[[bytes, grpc.ServicerContext], bytes]:
        return behaviour if self._metrics is None else self._metrics.unary(method, behaviour)

    def _counted_stream(
        self, method: str, behaviour: Callable[[Request, grpc.ServicerContext], Iterator[bytes]]
    ) -> Callable[[Request, grpc.ServicerContext], Iterator[bytes]]:
        return behaviour if self._metrics is None else self._metrics.streaming(method, behaviour)

    def _build(self, method: str) -> grpc.RpcMethodHandler[bytes, bytes]:
        how = route(method)
        backend = self._backends[how.role]
        if how.cardinality is Cardinality.UNARY_UNARY:
            forwarder = cancellable_unary_unary_forwarder if how.cancellable else unary_unary_forwarder
            return grpc.unary_unary_rpc_method_handler(self._counted(method, forwarder(method, backend)))
        if how.cardinality is Cardinality.UNARY_STREAM:
            relay = unary_stream_forwarder(method, backend, self.streams)
            return grpc.unary_stream_rpc_method_handler(self._counted_stream(method, relay))
        relay_stream = stream_stream_forwarder(method, backend, self.streams)
        return grpc.stream_stream_rpc_method_handler(self._counted_stream(method, relay_stream))
