"""The client side of one HTTP/2 connection carrying unary gRPC calls: bytes in, bytes out, no socket, no reactor.

What koordrp asks of a hook server is a unary call: one request message, one answer or a status. This is
exactly that much of HTTP/2 (RFC 9113) and gRPC's use of it, in plain Python: the preface and settings,
flow control both ways, HPACK header blocks (sent without the dynamic table; received with the ``hpack``
library, which keeps the server's), PING answers, RST_STREAM and GOAWAY. Anything else a server sends that
HTTP/2 allows is read and let pass; anything it forbids ends the connection with GOAWAY, and every call on it
fails, once.

``koordrp.hooks.channel`` puts it on a socket.
"""

from __future__ import annotations

import math
import struct
from collections import deque
from dataclasses import dataclass
from enum import IntEnum
from urllib.parse import unquote

import hpack
from hpack import HPACKError

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEADER = struct.Struct(">HBBBL")
"""A frame's header: its length (3 bytes: a short and a byte), type, flags and stream id."""
DEFAULT_WINDOW = 65_535
DEFAULT_FRAME_SIZE = 16_384
MAX_WINDOW = 2**31 - 1
MAX_STREAM_ID = 2**31 - 1
HEADER_LIST_LIMIT = 64 << 10
"""The most of a header block (decoded) koordrp reads from a server, announced in its settings."""


class Frame(IntEnum):
    DATA = 0
    HEADERS = 1
    PRIORITY = 2
    RST_STREAM = 3
    SETTINGS = 4
    PUSH_PROMISE = 5
    PING = 6
    GOAWAY = 7
    WINDOW_UPDATE = 8
    CONTINUATION = 9


END_STREAM = ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20


class Setting(IntEnum):
    HEADER_TABLE_SIZE = 1
    ENABLE_PUSH = 2
    MAX_CONCURRENT_STREAMS = 3
    INITIAL_WINDOW_SIZE = 4
    MAX_FRAME_SIZE = 5
    MAX_HEADER_LIST_SIZE = 6


class ErrorCode(IntEnum):
    NO_ERROR = 0
    PROTOCOL_ERROR = 1
    INTERNAL_ERROR = 2
    FLOW_CONTROL_ERROR = 3
    SETTINGS_TIMEOUT = 4
    STREAM_CLOSED = 5
    FRAME_SIZE_ERROR = 6
    REFUSED_STREAM = 7
    CANCEL = 8
    COMPRESSION_ERROR = 9
    CONNECT_ERROR = 10
    ENHANCE_YOUR_CALM = 11
    INADEQUATE_SECURITY = 12
    HTTP_1_1_REQUIRED = 13


def error_name(code: int) -> str:
    try:
        return ErrorCode(code).name
    except ValueError:
        return f"error code {code}"


# gRPC's status codes by number (grpc's own StatusCode enum is keyed by name).
STATUS_NAMES = (
    "OK CANCELLED UNKNOWN INVALID_ARGUMENT DEADLINE_EXCEEDED NOT_FOUND ALREADY_EXISTS PERMISSION_DENIED "
    "RESOURCE_EXHAUSTED FAILED_PRECONDITION ABORTED OUT_OF_RANGE UNIMPLEMENTED INTERNAL UNAVAILABLE DATA_LOSS "
    "UNAUTHENTICATED"
).split()
DEADLINE_EXCEEDED = STATUS_NAMES.index("DEADLINE_EXCEEDED")


@dataclass(frozen=True)
class Answered:
    """The server's answer: the message's bytes (status OK)."""

    message: bytes


@dataclass(frozen=True)
class StatusSent:
    """The server answered with a gRPC status other than OK (or an HTTP status other than 200)."""

    code: int
    details: str

    @property
    def name(self) -> str:
        return STATUS_NAMES[self.code] if 0 <= self.code < len(STATUS_NAMES) else f"status {self.code}"


@dataclass(frozen=True)
class Failed:
    """No answer: the stream or the connection broke. ``lost``: the server never took the call (it is not there,
    refused the stream, or went away before it)."""

    reason: str
    lost: bool = False


Outcome = Answered | StatusSent | Failed
_CANCELLED = Failed("cancelled by the caller")


class Call:
    """One unary call on a connection, from the request queued to its outcome."""

    __slots__ = ("stream_id", "_pending", "_headers", "_body", "_status", "_window", "_received", "outcome", "header_block")

    def __init__(self, header_block: bytes, body: bytes) -> None:
        self.stream_id = 0
        """0 until its HEADERS are sent (stream ids are taken in the order streams open)."""
        self.header_block = header_block
        self._pending = memoryview(body)
        """Request bytes not yet sent (flow control may hold them)."""
        self._window = 0
        """What the server lets koordrp send on this stream now (set as it opens: the server's settings may change
        while it waits for a stream)."""
        self._headers: "Headers | None" = None
        self._body = bytearray()
        self._status = 0
        self._received = 0
        """Flow-controlled bytes received and not yet given back to the server in a WINDOW_UPDATE."""
        self.outcome: Outcome | None = None


def _integer(value: int, prefix_bits: int, first: int) -> bytes:
    """An HPACK integer (RFC 7541, 5.1) with ``first``'s high bits before its prefix."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(value: bytes) -> bytes:
    """An HPACK string, not Huffman-coded."""
    return _integer(len(value), 7, 0) + value


def _field(name: bytes | int, value: bytes) -> bytes:
    """A header field as a literal never added to the table: by the static table's index of its name, or named."""
    if isinstance(name, int):
        return _integer(name, 4, 0) + _literal(value)
    return b"\x00" + _literal(name) + _literal(value)


_METHOD_POST = b"\x83"  # static table 3
_SCHEME_HTTP = b"\x86"  # static table 6
_PATH = 4
_AUTHORITY = 1
_CONTENT_TYPE = 31
_USER_AGENT = 58


def request_headers(path: str, authority: str, user_agent: str) -> bytes:
    """The fixed part of a unary call's header block to ``path`` (grpc-timeout, which varies, follows it)."""
    return b"".join(
        (
            _METHOD_POST,
            _SCHEME_HTTP,
            _field(_PATH, path.encode()),
            _field(_AUTHORITY, authority.encode()),
            _field(_CONTENT_TYPE, b"application/grpc"),
            _field(b"te", b"trailers"),
            _field(_USER_AGENT, user_agent.encode()),
        )
    )


def grpc_timeout(seconds: float) -> bytes:
    """gRPC's timeout header, at most 8 digits: milliseconds, rounded up, or whole seconds when that is too many."""
    milliseconds = max(1, math.ceil(seconds * 1000))
    if milliseconds < 100_000_000:
        return _field(b"grpc-timeout", b"%dm" % milliseconds)
    return _field(b"grpc-timeout", b"%dS" % min(99_999_999, math.ceil(seconds)))


def _frame(kind: int, flags: int, stream_id: int, payload: bytes | memoryview = b"") -> bytes:
    length = len(payload)
    return FRAME_HEADER.pack(length >> 8, length & 0xFF, kind, flags, stream_id) + payload


Headers = tuple[tuple[bytes, bytes], ...]
_KNOWN_BLOCKS = 16


class HeaderBlocks:
    """The server's header blocks, decoded with its HPACK table.

    A server answers every call with the same few blocks, and once its table holds their fields, each leaves
    the table as it is (indexed fields, and literals it is not to keep): such a block reads the same for as
    long as no other block changes the table, and it is decoded once for that long.
    """

    def __init__(self) -> None:
        self._decoder = hpack.Decoder(max_header_list_size=HEADER_LIST_LIMIT)
        self._known: dict[bytes, Headers] = {}

    def decode(self, block: bytes) -> Headers:
        """``block``'s fields, as bytes; HPACKError: it cannot be read."""
        known = self._known.get(block)
        if known is not None:
            return known
        fields: Headers = tuple(self._decoder.decode(block, raw=True))  # raw: bytes
        if not leaves_table(block):
            self._known.clear()  # it may have changed the table
        elif len(self._known) < _KNOWN_BLOCKS:
            self._known[block] = fields
        return fields


def leaves_table(block: bytes) -> bool:
    """Whether no field of ``block`` (which HPACK has read) changes the table: each is an indexed field (RFC 7541,
    6.1) or a literal not indexed or never indexed (6.2.2, 6.2.3); none is one to index (6.2.1) or a size update
    (6.3)."""
    offset, size = 0, len(block)
    while offset < size:
        first = block[offset]
        if first & 0x80:
            offset = _integer_end(block, offset, 0x7F)
        elif first & 0xC0 == 0x40 or first & 0xE0 == 0x20:
            return False
        else:
            named = not first & 0x0F  # index 0: the name follows as a string
            offset = _integer_end(block, offset, 0x0F)
            if named:
                offset = _string_end(block, offset)
            offset = _string_end(block, offset)
    return offset == size


def _integer_end(block: bytes, offset: int, prefix: int) -> int:
    """Where the HPACK integer at ``offset`` (with a prefix of ``prefix``'s bits) ends."""
    if block[offset] & prefix != prefix:
        return offset + 1
    offset += 1
    while offset < len(block) and block[offset] & 0x80:
        offset += 1
    return offset + 1


def _string_end(block: bytes, offset: int) -> int:
    """Where the HPACK string at ``offset`` ends (its length an integer with a 7-bit prefix)."""
    if offset >= len(block):
        return len(block) + 1
    length = block[offset] & 0x7F
    if length != 0x7F:
        return offset + 1 + length
    length, shift, offset = 0x7F, 0, offset + 1
    while offset < len(block):
        byte = block[offset]
        length += (byte & 0x7F) << shift
        shift += 7
        offset += 1
        if not byte & 0x80:
            break
    return offset + length


class ProtocolError(Exception):
    """The server broke HTTP/2: the connection ends with GOAWAY carrying ``code``."""

    def __init__(self, reason: str, code: ErrorCode = ErrorCode.PROTOCOL_ERROR) -> None:
        super().__init__(reason)
        self.code = code


class ClientConnection:
    """One HTTP/2 connection's state, client side. Every method returns at once; what is to be written to the
    socket collects in ``output()``, and calls that end are returned by ``received`` and ``lost``."""

    def __init__(self, max_answer: int) -> None:
        self._max_answer = max_answer
        self._window_size = max_answer + 5 + 256
        """The window koordrp gives each stream (and, twice over, the connection): a whole answer fits, padding too."""
        self._out: list[bytes] = [
            PREFACE,
            _frame(
                Frame.SETTINGS,
                0,
                0,
                struct.pack(
                    ">HLHLHL",
                    Setting.ENABLE_PUSH,
                    0,
                    Setting.INITIAL_WINDOW_SIZE,
                    self._window_size,
                    Setting.MAX_HEADER_LIST_SIZE,
                    HEADER_LIST_LIMIT,
                ),
            ),
        ]
        if 2 * self._window_size > DEFAULT_WINDOW:  # else the connection's default window is more than that already
            self._out.append(_frame(Frame.WINDOW_UPDATE, 0, 0, struct.pack(">L", 2 * self._window_size - DEFAULT_WINDOW)))
        self._connection_received = 0
        self._blocks = HeaderBlocks()
        self._buffer = bytearray()
        self._streams: dict[int, Call] = {}
        self._queued: deque[Call] = deque()
        """Calls waiting for the server's limit of concurrent streams."""
        self._blocked: dict[int, Call] = {}
        """Open streams with request bytes that flow control holds."""
        self._next_id = 1
        self._send_window = DEFAULT_WINDOW
        self._initial_send_window = DEFAULT_WINDOW
        self._max_frame = DEFAULT_FRAME_SIZE
        self._max_streams: int | None = None
        self._continued: tuple[int, int, bytearray] | None = None
        """A header block being continued: its stream, the HEADERS frame's flags and the block so far."""
        self._gone_away = False
        """The server sent GOAWAY: no stream may open any more (RFC 9113, 6.8), whatever its last stream id; grpc-go's
        first one names the highest there is."""
        self._ended: list[Call] = []
        """The calls that ended while the server's bytes were read."""
        self.ended: str | None = None
        """Why the connection may carry nothing more (None: it may)."""

    @property
    def accepting(self) -> bool:
        """Whether a new call may go on this connection."""
        return self.ended is None and not self._gone_away and self._next_id <= MAX_STREAM_ID

    @property
    def calls(self) -> int:
        return len(self._streams) + len(self._queued)

    def output(self) -> bytes:
        """What is to be written to the socket now (and is forgotten here)."""
        if not self._out:
            return b""
        out = b"".join(self._out)
        self._out.clear()
        return out

    def call(self, header_block: bytes, message: bytes) -> Call:
        """Queue a unary call: ``header_block`` from ``request_headers`` (+ ``grpc_timeout``), ``message`` the
        serialized request."""
        if not self.accepting:
            raise ValueError("the connection takes no new call")
        call = Call(header_block, b"\x00" + struct.pack(">L", len(message)) + message)
        self._queued.append(call)
        self._open_queued()
        return call

    def cancel(self, call: Call) -> None:
        """The caller gave ``call`` up: the server is told (RST_STREAM CANCEL), and nothing of it is returned."""
        if call.outcome is not None:
            return
        call.outcome = _CANCELLED  # ended: nothing more of it is read, and it is never returned
        if call.stream_id == 0:
            self._queued.remove(call)
            return
        self._close(call)
        if self.ended is None:
            self._out.append(_frame(Frame.RST_STREAM, 0, call.stream_id, struct.pack(">L", ErrorCode.CANCEL)))
        self._open_queued()

    def lost(self, reason: str, seen: bool = True) -> list[Call]:
        """The socket is gone: every call still on it ends. ``seen`` False: it was never connected, so the server
        saw none of them (each is ``lost``); else those sent may have reached it."""
        if self.ended is None:
            self.ended = reason
        self._end_all(reason, seen)
        ended, self._ended = self._ended, []
        return ended

    def received(self, data: bytes) -> list[Call]:
        """Read what the socket gave; returns the calls that ended. A server that breaks HTTP/2 ends the connection
        (``ended`` says why, GOAWAY is in the output) and every call on it."""
        if self.ended is not None:
            return []
        buffer = self._buffer
        buffer += data
        try:
            offset = 0
            size = len(buffer)
            view = memoryview(buffer)
            try:
                while size - offset >= 9:
                    high, low, kind, flags, stream_id = FRAME_HEADER.unpack_from(buffer, offset)
                    length = (high << 8) | low
                    if length > DEFAULT_FRAME_SIZE:
                        raise ProtocolError(f"a frame of {length} bytes, over the {DEFAULT_FRAME_SIZE} allowed", ErrorCode.FRAME_SIZE_ERROR)
                    end = offset + 9 + length
                    if end > size:
                        break
                    self._frame(kind, flags, stream_id & MAX_STREAM_ID, bytes(view[offset + 9 : end]))
                    offset = end
            finally:
                view.release()
                del buffer[:offset]
        except ProtocolError as error:
            # Its last stream id is the last of the server's streams koordrp processed: it opens none.
            self._out.append(_frame(Frame.GOAWAY, 0, 0, struct.pack(">LL", 0, error.code)))
            self.ended = f"the server broke HTTP/2: {error}"
            self._buffer.clear()
            self._end_all(self.ended)
        if self._connection_received >= self._window_size and self.ended is None:
            self._out.append(_frame(Frame.WINDOW_UPDATE, 0, 0, struct.pack(">L", self._connection_received)))
            self._connection_received = 0
        ended, self._ended = self._ended, []
        return ended

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._continued is not None and kind != Frame.CONTINUATION:
            raise ProtocolError("a header block left unfinished")
        if kind == Frame.DATA:
            return self._data(flags, stream_id, payload)
        if kind == Frame.HEADERS:
            if stream_id == 0:
                raise ProtocolError("HEADERS on stream 0")
            block = self._unpadded(flags, payload)
            if flags & PRIORITY_FLAG:
                block = block[5:]
            if flags & END_HEADERS:
                return self._headers(stream_id, flags, block)
            self._continued = (stream_id, flags, bytearray(block))
            return None
        if kind == Frame.CONTINUATION:
            if self._continued is None or self._continued[0] != stream_id:
                raise ProtocolError("CONTINUATION out of place")
            continued_id, first_flags, block_so_far = self._continued
            block_so_far += payload
            if len(block_so_far) > HEADER_LIST_LIMIT:
                raise ProtocolError("a header block over its limit", ErrorCode.ENHANCE_YOUR_CALM)
            if flags & END_HEADERS:
                self._continued = None
                return self._headers(stream_id, first_flags, bytes(block_so_far))
            return None
        if kind == Frame.RST_STREAM:
            if stream_id == 0:
                raise ProtocolError("RST_STREAM on stream 0")
            if len(payload) != 4:
                raise ProtocolError("a malformed RST_STREAM", ErrorCode.FRAME_SIZE_ERROR)
            call = self._streams.get(stream_id)
            if call is None:
                self._known(stream_id)
                return None
            (code,) = struct.unpack(">L", payload)
            refused = code == ErrorCode.REFUSED_STREAM
            # Never a RST_STREAM for a RST_STREAM (RFC 9113, 5.4.2), even with request bytes held.
            self._end(call, Failed(f"the server reset the stream: {error_name(code)}", refused), None)
            return None
        if kind == Frame.SETTINGS:
            self._settings(flags, stream_id, payload)
            return None
        if kind == Frame.PING:
            if len(payload) != 8 or stream_id != 0:
                raise ProtocolError("a malformed PING", ErrorCode.FRAME_SIZE_ERROR if stream_id == 0 else ErrorCode.PROTOCOL_ERROR)
            if not flags & ACK:
                self._out.append(_frame(Frame.PING, ACK, 0, payload))
            return None
        if kind == Frame.GOAWAY:
            self._goaway(stream_id, payload)
            return None
        if kind == Frame.WINDOW_UPDATE:
            self._window_update(stream_id, payload)
            return None
        if kind == Frame.PUSH_PROMISE:
            raise ProtocolError("PUSH_PROMISE, which koordrp's settings forbid")
        return None  # PRIORITY, and types HTTP/2 lets a peer add: read and let pass

    @staticmethod
    def _unpadded(flags: int, payload: bytes) -> bytes:
        if not flags & PADDED:
            return payload
        if not payload or payload[0] >= len(payload):
            raise ProtocolError("padding longer than its frame")
        return payload[1 : len(payload) - payload[0]]

    def _data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise ProtocolError("DATA on stream 0")
        self._connection_received += len(payload)
        call = self._streams.get(stream_id)
        if call is None:
            self._known(stream_id)
            return None
        if call._headers is None:
            raise ProtocolError("DATA before the answer's HEADERS")
        call._body += self._unpadded(flags, payload)
        call._received += len(payload)
        if len(call._body) > self._max_answer + 5:
            self._end(call, Failed(f"an answer over koordrp's limit of {self._max_answer} bytes"), ErrorCode.CANCEL)
        elif flags & END_STREAM:
            self._finished(call, _outcome(call._status, call._headers, call._body, None))
        elif call._received * 2 >= self._window_size:
            self._out.append(_frame(Frame.WINDOW_UPDATE, 0, stream_id, struct.pack(">L", call._received)))
            call._received = 0
        return None

    def _headers(self, stream_id: int, flags: int, block: bytes) -> None:
        try:
            # Decoded even for a stream that ended: the server's table changes with every block it sends.
            headers = self._blocks.decode(block)
        except HPACKError as error:
            raise ProtocolError(f"a header block HPACK cannot read ({error})", ErrorCode.COMPRESSION_ERROR) from None
        call = self._streams.get(stream_id)
        if call is None:
            self._known(stream_id)
            return None
        if call._headers is None:
            status = next((value for name, value in headers if name == b":status"), None)
            if status is None or len(status) != 3 or not status.isdigit():
                # A malformed answer (RFC 9113, 8.1.1): the server hears the stream is over unless it ended it.
                failed = Failed("an answer without an HTTP status")
                if flags & END_STREAM:
                    self._finished(call, failed)
                else:
                    self._end(call, failed, ErrorCode.PROTOCOL_ERROR)
                return None
            if status.startswith(b"1") and not flags & END_STREAM:
                return None  # informational (HTTP allows any number before the answer): the answer's headers follow
            call._status = int(status)
            call._headers = headers
            if flags & END_STREAM:  # a trailers-only answer: the status is in these headers
                self._finished(call, _outcome(call._status, headers, call._body, headers))
            return None
        if not flags & END_STREAM:
            raise ProtocolError("trailers that do not end their stream")
        self._finished(call, _outcome(call._status, call._headers, call._body, headers))
        return None

    def _known(self, stream_id: int) -> None:
        """A frame for a stream that is not open: one that ended is let pass; one never opened breaks HTTP/2."""
        if stream_id % 2 == 0 or stream_id >= self._next_id:
            raise ProtocolError(f"a frame on stream {stream_id}, which koordrp never opened")

    def _settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id != 0:
            raise ProtocolError("SETTINGS on a stream")
        if flags & ACK:
            return
        if len(payload) % 6:
            raise ProtocolError("a malformed SETTINGS", ErrorCode.FRAME_SIZE_ERROR)
        for offset in range(0, len(payload), 6):
            setting, value = struct.unpack_from(">HL", payload, offset)
            if setting == Setting.INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ProtocolError("an initial window over 2^31-1", ErrorCode.FLOW_CONTROL_ERROR)
                delta = value - self._initial_send_window
                self._initial_send_window = value
                for call in self._streams.values():
                    call._window += delta
            elif setting == Setting.MAX_FRAME_SIZE:
                if not DEFAULT_FRAME_SIZE <= value <= 2**24 - 1:
                    raise ProtocolError(f"a maximum frame size of {value}")
                self._max_frame = value
            elif setting == Setting.MAX_CONCURRENT_STREAMS:
                self._max_streams = value
            elif setting == Setting.ENABLE_PUSH and value > 1:
                raise ProtocolError("ENABLE_PUSH neither 0 nor 1")
            # HEADER_TABLE_SIZE bounds a table koordrp's header blocks never use; MAX_HEADER_LIST_SIZE is far above them.
        self._out.append(_frame(Frame.SETTINGS, ACK, 0))
        self._send_blocked()
        self._open_queued()

    def _goaway(self, stream_id: int, payload: bytes) -> None:
        if stream_id != 0 or len(payload) < 8:
            raise ProtocolError("a malformed GOAWAY")
        last, code = struct.unpack_from(">LL", payload)
        last &= MAX_STREAM_ID
        self._gone_away = True
        reason = f"the server went away ({error_name(code)})"
        # Streams above the last it processes never reached it (and are closed there); the calls waiting for a
        # stream never will. A later GOAWAY may only lower ``last``: the streams above an earlier one ended then.
        for call in self._queued:
            call.outcome = Failed(reason, lost=True)
            self._ended.append(call)
        self._queued.clear()
        for call in [call for call in self._streams.values() if call.stream_id > last]:
            self._end(call, Failed(reason, lost=True), None)

    def _window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ProtocolError("a malformed WINDOW_UPDATE", ErrorCode.FRAME_SIZE_ERROR)
        (increment,) = struct.unpack(">L", payload)
        increment &= MAX_WINDOW
        if stream_id == 0:
            if increment == 0:
                raise ProtocolError("a window update of 0")
            self._send_window += increment
            if self._send_window > MAX_WINDOW:
                raise ProtocolError("a connection window over 2^31-1", ErrorCode.FLOW_CONTROL_ERROR)
            self._send_blocked()
            return
        call = self._streams.get(stream_id)
        if call is None:
            self._known(stream_id)
            return
        call._window += increment
        if increment == 0 or call._window > MAX_WINDOW:
            self._end(call, Failed("the server broke flow control"), ErrorCode.PROTOCOL_ERROR if increment == 0 else ErrorCode.FLOW_CONTROL_ERROR)
            return
        self._send_blocked()

    def _open_queued(self) -> None:
        while self._queued and self.ended is None and (self._max_streams is None or len(self._streams) < self._max_streams):
            if self._next_id > MAX_STREAM_ID:
                # Out of stream ids: the calls left never reach the server (new ones go on a new connection).
                for call in self._queued:
                    call.outcome = Failed("the connection ran out of stream ids", lost=True)
                    self._ended.append(call)
                self._queued.clear()
                return
            call = self._queued.popleft()
            call.stream_id = self._next_id
            call._window = self._initial_send_window
            self._next_id += 2
            self._streams[call.stream_id] = call
            block = call.header_block
            first = block[: self._max_frame]
            if len(block) <= self._max_frame:
                self._out.append(_frame(Frame.HEADERS, END_HEADERS, call.stream_id, block))
            else:
                self._out.append(_frame(Frame.HEADERS, 0, call.stream_id, first))
                rest = block[self._max_frame :]
                while rest:
                    piece, rest = rest[: self._max_frame], rest[self._max_frame :]
                    self._out.append(_frame(Frame.CONTINUATION, 0 if rest else END_HEADERS, call.stream_id, piece))
            self._send(call)

    def _send(self, call: Call) -> None:
        """Send what flow control lets of ``call``'s request; the rest waits for the server's window updates."""
        pending = call._pending
        while pending:
            room = min(self._send_window, call._window, self._max_frame)
            if room <= 0:
                self._blocked[call.stream_id] = call
                call._pending = pending
                return
            piece = pending[:room]
            pending = pending[room:]
            self._send_window -= len(piece)
            call._window -= len(piece)
            self._out.append(_frame(Frame.DATA, 0 if pending else END_STREAM, call.stream_id, piece))
        call._pending = pending
        self._blocked.pop(call.stream_id, None)

    def _send_blocked(self) -> None:
        for call in list(self._blocked.values()):
            self._send(call)

    def _close(self, call: Call) -> None:
        del self._streams[call.stream_id]
        self._blocked.pop(call.stream_id, None)

    def _end(self, call: Call, outcome: Outcome, reset: ErrorCode | None) -> None:
        """``call`` ends with ``outcome``; ``reset``: the RST_STREAM that tells the server, where it may think the
        stream open still (None: it knows)."""
        call.outcome = outcome
        self._ended.append(call)
        self._close(call)
        if reset is not None:
            self._out.append(_frame(Frame.RST_STREAM, 0, call.stream_id, struct.pack(">L", reset)))
        self._open_queued()

    def _finished(self, call: Call, outcome: Outcome) -> None:
        """The server ended ``call``'s stream (END_STREAM)."""
        # If it answered before it had the whole request (gRPC allows it), the rest is not wanted: grpc-go says so
        # with NO_ERROR.
        self._end(call, outcome, ErrorCode.NO_ERROR if call._pending else None)

    def _end_all(self, reason: str, seen: bool = True) -> None:
        for call in self._streams.values():
            call.outcome = Failed(reason, lost=not seen)
            self._ended.append(call)
        for call in self._queued:
            call.outcome = Failed(reason, lost=True)
            self._ended.append(call)
        self._streams.clear()
        self._queued.clear()
        self._blocked.clear()


def _outcome(status: int, headers: Headers, body: bytearray, trailers: Headers | None) -> Outcome:
    """A finished stream's outcome, as gRPC reads it: HTTP status, then grpc-status, then exactly one message."""
    if status != 200:
        return StatusSent(_HTTP_CODES.get(status, STATUS_NAMES.index("UNKNOWN")), f"HTTP status {status}")
    grpc_status = grpc_message = None
    for name, value in trailers or ():
        if name == b"grpc-status":
            grpc_status = value
        elif name == b"grpc-message":
            grpc_message = value
    if grpc_status is None or len(grpc_status) > 3 or not grpc_status.isdigit():
        return Failed("an answer without a gRPC status")
    code = int(grpc_status)
    if code != 0:
        return StatusSent(code, unquote(grpc_message.decode("utf-8", "replace")) if grpc_message else "")
    if len(body) < 5:
        return Failed("an OK answer without a message")
    if body[0] != 0:
        return Failed("a compressed answer, which koordrp never asked for")
    (length,) = struct.unpack_from(">L", body, 1)
    if length != len(body) - 5:
        return Failed("an answer that is not exactly one message")
    return Answered(bytes(body[5:]))


# How gRPC reads an HTTP status other than 200 (its doc/http-grpc-status-mapping.md).
_HTTP_CODES = {
    400: STATUS_NAMES.index("INTERNAL"),
    401: STATUS_NAMES.index("UNAUTHENTICATED"),
    403: STATUS_NAMES.index("PERMISSION_DENIED"),
    404: STATUS_NAMES.index("UNIMPLEMENTED"),
    429: STATUS_NAMES.index("UNAVAILABLE"),
    502: STATUS_NAMES.index("UNAVAILABLE"),
    503: STATUS_NAMES.index("UNAVAILABLE"),
    504: STATUS_NAMES.index("UNAVAILABLE"),
}

