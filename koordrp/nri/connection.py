"""One connection to containerd's NRI socket, on the reactor: ttrpc both ways over NRI's multiplexer.

containerd calls the plugin (``PluginCalls``) on one multiplexed connection; the plugin calls
containerd (``NRIConnection.call``, to register) on the other. Bytes that break the framing end the
connection (the reason it is lost with): containerd does the same, and the plugin connects again. A
message larger than ttrpc's limit is read and dropped, never held, and its stream answered
RESOURCE_EXHAUSTED, as ttrpc's own server and client do.
"""

from __future__ import annotations

import os
from typing import Protocol

from twisted.internet.defer import CancelledError, Deferred, TimeoutError as DeferredTimeout, fail
from twisted.internet.interfaces import IReactorTime
from twisted.internet.protocol import Protocol as TwistedProtocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure

from koordrp.api.ttrpc import ttrpc_pb2
from koordrp.sending import SentAtOnce
from koordrp.nri.wire import (
    MAX_TTRPC_MESSAGE,
    PLUGIN_SERVICE_CONNECTION,
    REQUEST,
    RESPONSE,
    RUNTIME_SERVICE_CONNECTION,
    MuxReader,
    Oversized,
    TtrpcMessage,
    TtrpcReader,
    WireError,
    mux_frames,
    ttrpc_message,
)
from koordrp.text import shortened

PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"
RUNTIME_SERVICE = "nri.pkg.api.v1alpha1.Runtime"

# gRPC status codes, as ttrpc carries them.
UNKNOWN = 2
RESOURCE_EXHAUSTED = 8
UNIMPLEMENTED = 12


class NRIError(Exception):
    """A failed call, either way: a status code and its message."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class NRIConnectionLost(NRIError):
    """The connection went while a call waited for its answer: the reason is the connection's."""


class PluginCalls(Protocol):
    """What containerd calls on the plugin: ``method`` of the Plugin service, its request's bytes, and what
    is left of containerd's deadline for it (None: it set none). The Deferred fires with the response's
    bytes, or fails (NRIError: with its code) for containerd to hear of the failure."""

    def made(self, connection: "NRIConnection") -> object:
        """The connection is up: the plugin may call containerd on it."""

    def called(self, method: str, payload: bytes, timeout: float | None) -> Deferred[bytes]: ...

    def oversized(self, length: int) -> None:
        """containerd sent a request of ``length`` bytes, more than a ttrpc message may have: it was dropped and
        answered RESOURCE_EXHAUSTED, as ttrpc's own server answers it."""

    def lost(self, reason: Failure) -> None:
        """The connection is gone; nothing more will be called, and answers will go nowhere."""


class NRIConnection(TwistedProtocol):
    log = Logger()

    def __init__(self, plugin: PluginCalls, clock: IReactorTime) -> None:
        self._plugin = plugin
        self._clock = clock
        self._trunk = MuxReader()
        self._served = TtrpcReader()
        self._answers = TtrpcReader()
        self._next_stream = 1
        self._pending: dict[int, Deferred[bytes]] = {}
        self._serving: set[Deferred[bytes]] = set()
        self._lost = False
        self._broken: WireError | None = None
        self._sending: SentAtOnce | None = None

    def connectionMade(self) -> None:
        assert self.transport is not None
        self._sending = SentAtOnce(self.transport)
        self._plugin.made(self)

    # containerd calling the plugin

    def dataReceived(self, data: bytes) -> None:
        try:
            for chunk in self._trunk.feed(data):
                if chunk.connection == PLUGIN_SERVICE_CONNECTION:
                    for message in self._served.feed(chunk.data):
                        self._request(message)
                elif chunk.connection == RUNTIME_SERVICE_CONNECTION:
                    for message in self._answers.feed(chunk.data):
                        self._response(message)
        except WireError as error:
            # Nothing after bytes that break the framing can be read: containerd ends such a connection too.
            self._broken = error
            self._abort()

    def _request(self, message: TtrpcMessage | Oversized) -> None:
        if isinstance(message, Oversized):
            if message.kind == REQUEST:
                self._respond(message.stream_id, _status(RESOURCE_EXHAUSTED, _too_large(message.length)))
                self._plugin.oversized(message.length)
        elif message.kind == REQUEST:
            self._serve(message.stream_id, message.payload)

    def _response(self, message: TtrpcMessage | Oversized) -> None:
        if isinstance(message, Oversized):
            answer = self._pending.pop(message.stream_id, None)
            if answer is not None and message.kind == RESPONSE:
                answer.errback(NRIError(RESOURCE_EXHAUSTED, _too_large(message.length)))
        elif message.kind == RESPONSE:
            self._answered(message.stream_id, message.payload)

    def _serve(self, stream_id: int, payload: bytes) -> None:
        try:
            request = ttrpc_pb2.Request.FromString(payload)
        except Exception:  # protobuf's DecodeError, or worse: never the reactor's problem
            failure = Failure()  # type: ignore[no-untyped-call]
            unread = f"koordrp cannot read the ttrpc request: {failure.getErrorMessage()}"
            self._respond(stream_id, self._unknown(failure, "request", unread))
            return
        if request.service != PLUGIN_SERVICE:
            self._respond(stream_id, _status(UNIMPLEMENTED, f"koordrp serves no {request.service}"))
            return
        timeout = request.timeout_nano / 1e9 if request.timeout_nano > 0 else None
        method = request.method
        answer = self._plugin.called(method, request.payload, timeout)
        self._serving.add(answer)

        # One callback, not a chain of them: every lifecycle event pays for each.
        def respond(result: bytes | Failure) -> None:
            self._serving.discard(answer)
            if self._lost:
                return  # cut by the connection's loss, which is said: there is nobody to answer
            try:
                if isinstance(result, Failure):
                    self._respond(stream_id, self._failed(result, method))
                else:
                    self._respond(stream_id, ttrpc_pb2.Response(payload=result))
            except Exception:
                self.log.failure("cannot answer containerd's {method}", method=method)

        answer.addBoth(respond)

    def _respond(self, stream_id: int, response: ttrpc_pb2.Response) -> None:
        if not self._lost:
            message = ttrpc_message(stream_id, RESPONSE, response.SerializeToString())
            self._send(mux_frames(PLUGIN_SERVICE_CONNECTION, message))

    def _failed(self, failure: Failure, method: str) -> ttrpc_pb2.Response:
        """containerd's answer to ``method``, which failed: an NRIError's status, said where it was decided; any other
        failure is UNKNOWN."""
        if isinstance(failure.value, NRIError):
            return _status(failure.value.code, str(failure.value))
        if isinstance(failure.value, (CancelledError, DeferredTimeout)):
            return self._unknown(failure, method, f"koordrp gave up on {method}")
        return self._unknown(failure, method, f"koordrp: {method} failed: {shortened(failure.getErrorMessage())}")

    def _unknown(self, failure: Failure, method: str, message: str) -> ttrpc_pb2.Response:
        """UNKNOWN with ``message`` for containerd, and one line for the operator: which of containerd's calls it
        answers, and the error (a traceback would be a line per frame, for every call that fails so)."""
        self.log.error("answered containerd's NRI {method} with UNKNOWN: {error}", method=method, error=_error_line(failure))
        return _status(UNKNOWN, message)

    def _send(self, frames: bytes) -> None:
        assert self._sending is not None, "connectionMade comes first"
        self._sending.write(frames)

    # the plugin calling containerd

    def call(self, method: str, payload: bytes, timeout: float) -> Deferred[bytes]:
        """Call ``method`` of containerd's Runtime service; fails with NRIError, or TimeoutError after ``timeout``."""
        if self._lost:
            return fail(NRIError(UNKNOWN, "the NRI connection is closed"))
        stream_id = self._next_stream
        self._next_stream += 2  # ttrpc: a client's streams are odd and increase
        request = ttrpc_pb2.Request(service=RUNTIME_SERVICE, method=method, payload=payload, timeout_nano=int(timeout * 1e9))
        answer: Deferred[bytes] = Deferred(lambda _: self._forget(stream_id))
        self._pending[stream_id] = answer
        answer.addTimeout(timeout, self._clock)
        message = ttrpc_message(stream_id, REQUEST, request.SerializeToString())
        self._send(mux_frames(RUNTIME_SERVICE_CONNECTION, message))
        return answer

    def _forget(self, stream_id: int) -> None:
        self._pending.pop(stream_id, None)

    def _answered(self, stream_id: int, payload: bytes) -> None:
        answer = self._pending.pop(stream_id, None)
        if answer is None:
            return  # it timed out
        try:
            response = ttrpc_pb2.Response.FromString(payload)
        except Exception as error:
            answer.errback(NRIError(UNKNOWN, f"containerd's answer cannot be read: {error}"))
            return
        if response.status.code:
            answer.errback(NRIError(response.status.code, response.status.message))
        else:
            answer.callback(response.payload)

    # the connection's end

    def _abort(self) -> None:
        if self._sending is not None:
            self._sending.closing()
        if self.transport is not None:
            self.transport.abortConnection()  # type: ignore[attr-defined]

    def close(self) -> None:
        if self._sending is not None:
            self._sending.closing()
        if self.transport is not None:
            self.transport.loseConnection()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._lost = True
        if self._broken is not None:
            reason = Failure(self._broken)  # type: ignore[no-untyped-call]
        pending, self._pending = self._pending, {}
        for answer in pending.values():
            answer.errback(NRIConnectionLost(UNKNOWN, f"the NRI connection was lost: {reason.getErrorMessage()}"))
        for serving in list(self._serving):
            serving.cancel()
        self._plugin.lost(reason)


def _too_large(length: int) -> str:
    return f"message length {length} exceeds the maximum message size of {MAX_TTRPC_MESSAGE}"


def _status(code: int, message: str) -> ttrpc_pb2.Response:
    return ttrpc_pb2.Response(status=ttrpc_pb2.Status(code=code, message=message))


def _error_line(failure: Failure) -> str:
    """The error on one line: its type, its message and where it was raised."""
    where = ""
    if failure.frames:
        function, path, line = failure.frames[-1][:3]
        where = f" (in {function}, {os.path.basename(path)}:{line})"
    return f"{type(failure.value).__name__}: {shortened(failure.getErrorMessage())}{where}"
