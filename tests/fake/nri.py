"""containerd's side of an NRI connection, in memory: bytes in NRI's framing to and from a protocol under test."""

from dataclasses import dataclass

from google.protobuf.message import Message
from twisted.internet.testing import StringTransport

from koordrp.api.ttrpc import ttrpc_pb2
from koordrp.nri.connection import PLUGIN_SERVICE
from koordrp.nri.wire import (
    PLUGIN_SERVICE_CONNECTION,
    REQUEST,
    RESPONSE,
    RUNTIME_SERVICE_CONNECTION,
    MuxReader,
    TtrpcMessage,
    TtrpcReader,
    mux_frames,
    ttrpc_message,
)
from twisted.internet.protocol import Protocol


@dataclass(frozen=True)
class Sent:
    """What the plugin sent containerd: on connection 1 an answer, on connection 2 a request."""

    connection: int
    stream_id: int
    response: ttrpc_pb2.Response | None = None
    request: ttrpc_pb2.Request | None = None


class FakeContainerd:
    """Feeds ``protocol`` what containerd would send, and reads back what it sent (``sent()``)."""

    def __init__(self, protocol: Protocol) -> None:
        self.protocol = protocol
        self.transport = StringTransport()
        self._read = 0
        self._trunk = MuxReader()
        self._streams = {PLUGIN_SERVICE_CONNECTION: TtrpcReader(), RUNTIME_SERVICE_CONNECTION: TtrpcReader()}
        self._next_stream = 1
        self.frames_sent: list[int] = []
        """The size of each multiplexer frame the plugin sent."""
        self._frame = 0
        protocol.makeConnection(self.transport)

    def call(
        self, method: str, message: Message, timeout: float | None = 2.0, service: str = PLUGIN_SERVICE, payload: bytes | None = None
    ) -> int:
        """containerd calls ``method`` of the plugin (with ``payload`` for bytes, if given, instead of ``message``);
        the ttrpc stream id of the call."""
        stream_id = self._next_stream
        self._next_stream += 2
        sent = message.SerializeToString() if payload is None else payload
        request = ttrpc_pb2.Request(service=service, method=method, payload=sent)
        if timeout is not None:
            request.timeout_nano = int(timeout * 1e9)
        self.feed(mux_frames(PLUGIN_SERVICE_CONNECTION, ttrpc_message(stream_id, REQUEST, request.SerializeToString())))
        return stream_id

    def answer(self, stream_id: int, message: Message | None = None, code: int = 0, error: str = "") -> None:
        """containerd answers the plugin's call on ``stream_id``."""
        response = ttrpc_pb2.Response(payload=b"" if message is None else message.SerializeToString())
        if code:
            response.status.code, response.status.message = code, error
        self.feed(mux_frames(RUNTIME_SERVICE_CONNECTION, ttrpc_message(stream_id, RESPONSE, response.SerializeToString())))

    def feed(self, data: bytes) -> None:
        self.protocol.dataReceived(data)

    def sent(self) -> list[Sent]:
        """Everything the plugin sent since the last look."""
        data = self.transport.value()[self._read :]
        self._read += len(data)
        found: list[Sent] = []
        for chunk in self._trunk.feed(data):
            self._frame += len(chunk.data)
            if chunk.ends_frame:
                self.frames_sent.append(self._frame)
                self._frame = 0
            for message in self._streams[chunk.connection].feed(chunk.data):
                assert isinstance(message, TtrpcMessage), message  # koordrp never sends what ttrpc cannot carry
                if message.kind == RESPONSE:
                    found.append(Sent(chunk.connection, message.stream_id, response=ttrpc_pb2.Response.FromString(message.payload)))
                else:
                    found.append(Sent(chunk.connection, message.stream_id, request=ttrpc_pb2.Request.FromString(message.payload)))
        return found

    def answers(self) -> dict[int, ttrpc_pb2.Response]:
        """The plugin's answers sent since the last look, by stream id."""
        return {sent.stream_id: sent.response for sent in self.sent() if sent.response is not None}
