"""NRI's wire, as bytes: ttrpc messages inside the connections of NRI's multiplexer. Nothing here does I/O.

A plugin's one unix connection to containerd's NRI socket is a *trunk* carrying several byte streams
(containerd/nri ``pkg/net/multiplex``): every frame is a connection id and a length (two big-endian
uint32) and that many bytes of the stream. NRI uses two: on connection 1 containerd calls the
plugin's ``Plugin`` service; on connection 2 the plugin calls containerd's ``Runtime`` service (to
register). Each stream is ttrpc (containerd/ttrpc): a 10-byte header (length and stream id, two
big-endian uint32; message type; flags) and a protobuf ``ttrpc.Request`` or ``ttrpc.Response``.
"""

import struct
from dataclasses import dataclass
from typing import Iterator

PLUGIN_SERVICE_CONNECTION = 1
"""The multiplexed connection on which containerd calls the plugin."""
RUNTIME_SERVICE_CONNECTION = 2
"""The multiplexed connection on which the plugin calls containerd."""

REQUEST = 1
RESPONSE = 2

_MUX_HEADER = struct.Struct(">II")
_TTRPC_HEADER = struct.Struct(">IIBB")

# The multiplexer's own limit on a frame's payload; ttrpc's on a message.
MAX_MUX_PAYLOAD = 1 << 24
MAX_TTRPC_MESSAGE = 4 << 20

# containerd reads each stream through a 4096-byte buffer and cannot take a frame larger than the
# buffer it reads into (ENOMEM): what koordrp sends goes in frames no larger than that.
MAX_MUX_FRAME_SENT = 4096


class WireError(Exception):
    """Bytes that break NRI's framing: the trunk cannot be read past them."""


class MuxReader:
    """The trunk's frames, as bytes arrive: ``feed`` returns each whole frame's (connection id, payload)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        self._buffer += data
        frames: list[tuple[int, bytes]] = []
        while len(self._buffer) >= _MUX_HEADER.size:
            connection, length = _MUX_HEADER.unpack_from(self._buffer)
            if length > MAX_MUX_PAYLOAD:
                raise WireError(f"a multiplexer frame of {length} bytes (the limit is {MAX_MUX_PAYLOAD})")
            end = _MUX_HEADER.size + length
            if len(self._buffer) < end:
                break
            frames.append((connection, bytes(self._buffer[_MUX_HEADER.size : end])))
            del self._buffer[:end]
        return frames


def mux_frames(connection: int, data: bytes) -> bytes:
    """``data`` as frames of ``connection``, none larger than containerd can read."""
    return b"".join(
        _MUX_HEADER.pack(connection, len(chunk)) + chunk
        for chunk in (data[start : start + MAX_MUX_FRAME_SENT] for start in range(0, len(data), MAX_MUX_FRAME_SENT))
    )


@dataclass(frozen=True)
class TtrpcMessage:
    stream_id: int
    kind: int
    """REQUEST, RESPONSE (or ttrpc's stream data, which NRI does not use)."""
    flags: int
    payload: bytes


class TtrpcReader:
    """One ttrpc stream's messages, as its bytes arrive."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> Iterator[TtrpcMessage]:
        self._buffer += data
        while len(self._buffer) >= _TTRPC_HEADER.size:
            length, stream_id, kind, flags = _TTRPC_HEADER.unpack_from(self._buffer)
            if length > MAX_TTRPC_MESSAGE:
                raise WireError(f"a ttrpc message of {length} bytes (the limit is {MAX_TTRPC_MESSAGE})")
            end = _TTRPC_HEADER.size + length
            if len(self._buffer) < end:
                return
            payload = bytes(self._buffer[_TTRPC_HEADER.size : end])
            del self._buffer[:end]
            yield TtrpcMessage(stream_id, kind, flags, payload)


def ttrpc_message(stream_id: int, kind: int, payload: bytes) -> bytes:
    if len(payload) > MAX_TTRPC_MESSAGE:
        raise WireError(f"a ttrpc message of {len(payload)} bytes (the limit is {MAX_TTRPC_MESSAGE})")
    return _TTRPC_HEADER.pack(len(payload), stream_id, kind, 0) + payload
