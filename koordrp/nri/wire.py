"""NRI's wire, as bytes: ttrpc messages inside the connections of NRI's multiplexer. Nothing here does I/O.

A plugin's one unix connection to containerd's NRI socket is a *trunk* carrying several byte streams
(containerd/nri ``pkg/net/multiplex``): every frame is a connection id and a length (two big-endian
uint32) and that many bytes of the stream. NRI uses two: on connection 1 containerd calls the
plugin's ``Plugin`` service; on connection 2 the plugin calls containerd's ``Runtime`` service (to
register). Each stream is ttrpc (containerd/ttrpc): a 10-byte header (length and stream id, two
big-endian uint32; message type; flags) and a protobuf ``ttrpc.Request`` or ``ttrpc.Response``.
"""

import struct
from typing import NamedTuple

PLUGIN_SERVICE_CONNECTION = 1
"""The multiplexed connection on which containerd calls the plugin."""
RUNTIME_SERVICE_CONNECTION = 2
"""The multiplexed connection on which the plugin calls containerd."""

REQUEST = 1
RESPONSE = 2

_MUX_HEADER = struct.Struct(">II")
_TTRPC_HEADER = struct.Struct(">IIBB")

# The multiplexer's own limit on a frame's payload (NRI 0.6's; NRI 0.8's is ttrpc's message and header);
# ttrpc's on a message.
MAX_MUX_PAYLOAD = 1 << 24
MAX_TTRPC_MESSAGE = 4 << 20

# containerd reads each stream through a 4096-byte buffer and cannot take a frame larger than the
# buffer it reads into (ENOMEM): what koordrp sends goes in frames no larger than that.
MAX_MUX_FRAME_SENT = 4096


class WireError(Exception):
    """Bytes that break NRI's framing: the trunk cannot be read past them."""


class MuxChunk(NamedTuple):
    """Bytes of one multiplexer frame's payload, as they arrived (a tuple: one is made for every read)."""

    connection: int
    data: bytes
    ends_frame: bool


class MuxReader:
    """The trunk's frames, as bytes arrive: ``feed`` returns each frame's payload in the chunks it came in.

    A frame may be as large as the multiplexer allows (NRI 0.6's: 16 MiB), and is not held whole:
    what it carries is the ttrpc reader's to bound.
    """

    def __init__(self) -> None:
        self._header = bytearray()
        self._connection = 0
        self._left = 0
        """Bytes of the current frame's payload still to come."""

    def feed(self, data: bytes) -> list[MuxChunk]:
        chunks: list[MuxChunk] = []
        at, end = 0, len(data)
        while at < end:
            if self._left == 0:
                if self._header or end - at < _MUX_HEADER.size:  # a header split between reads
                    wanted = _MUX_HEADER.size - len(self._header)
                    self._header += data[at : at + wanted]
                    at += wanted
                    if len(self._header) < _MUX_HEADER.size:
                        break
                    self._connection, self._left = _MUX_HEADER.unpack(self._header)
                    self._header.clear()
                else:
                    self._connection, self._left = _MUX_HEADER.unpack_from(data, at)
                    at += _MUX_HEADER.size
                if self._left > MAX_MUX_PAYLOAD:
                    raise WireError(f"a multiplexer frame of {self._left} bytes (the limit is {MAX_MUX_PAYLOAD})")
                continue
            taken = min(self._left, end - at)
            self._left -= taken
            chunks.append(MuxChunk(self._connection, data[at : at + taken], self._left == 0))
            at += taken
        return chunks


def mux_frames(connection: int, data: bytes) -> bytes:
    """``data`` as frames of ``connection``, none larger than containerd can read."""
    if len(data) <= MAX_MUX_FRAME_SENT:
        return _MUX_HEADER.pack(connection, len(data)) + data
    return b"".join(
        _MUX_HEADER.pack(connection, len(chunk)) + chunk
        for chunk in (data[start : start + MAX_MUX_FRAME_SENT] for start in range(0, len(data), MAX_MUX_FRAME_SENT))
    )


class TtrpcMessage(NamedTuple):
    stream_id: int
    kind: int
    """REQUEST, RESPONSE (or ttrpc's stream data, which NRI does not use)."""
    flags: int
    payload: bytes


class Oversized(NamedTuple):
    """A message larger than ttrpc carries, whose bytes were read and dropped (ttrpc's own server does the
    same, then answers its stream with RESOURCE_EXHAUSTED)."""

    stream_id: int
    kind: int
    length: int


class TtrpcReader:
    """One ttrpc stream's messages, as its bytes arrive; never more than one message's limit held."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._dropping: Oversized | None = None
        self._left = 0
        """Bytes of the oversized message being dropped still to come."""

    def feed(self, data: bytes) -> list[TtrpcMessage | Oversized]:
        messages: list[TtrpcMessage | Oversized] = []
        at, end = 0, len(data)
        while True:
            if self._dropping is not None:
                dropped = min(self._left, end - at)
                self._left -= dropped
                at += dropped
                if self._left:
                    return messages
                messages.append(self._dropping)
                self._dropping = None
            if not self._buffer and end - at >= _TTRPC_HEADER.size:
                # The message's header is here whole, as it nearly always is: read from ``data`` itself.
                length, stream_id, kind, flags = _TTRPC_HEADER.unpack_from(data, at)
                if length <= MAX_TTRPC_MESSAGE and end - at - _TTRPC_HEADER.size >= length:
                    at += _TTRPC_HEADER.size + length
                    messages.append(TtrpcMessage(stream_id, kind, flags, data[at - length : at]))
                    continue
            if at == end:
                return messages
            if len(self._buffer) < _TTRPC_HEADER.size:
                wanted = _TTRPC_HEADER.size - len(self._buffer)
                self._buffer += data[at : at + wanted]
                at += wanted
                if len(self._buffer) < _TTRPC_HEADER.size:
                    return messages
            length, stream_id, kind, flags = _TTRPC_HEADER.unpack_from(self._buffer)
            if length > MAX_TTRPC_MESSAGE:
                self._dropping, self._left = Oversized(stream_id, kind, length), length
                self._buffer.clear()
                continue
            wanted = _TTRPC_HEADER.size + length - len(self._buffer)
            self._buffer += data[at : at + wanted]
            at += wanted
            if len(self._buffer) < _TTRPC_HEADER.size + length:
                return messages
            payload = bytes(self._buffer[_TTRPC_HEADER.size :])
            self._buffer.clear()
            messages.append(TtrpcMessage(stream_id, kind, flags, payload))


def ttrpc_message(stream_id: int, kind: int, payload: bytes) -> bytes:
    if len(payload) > MAX_TTRPC_MESSAGE:
        raise WireError(f"a ttrpc message of {len(payload)} bytes (the limit is {MAX_TTRPC_MESSAGE})")
    return _TTRPC_HEADER.pack(len(payload), stream_id, kind, 0) + payload
