"""koordrp.http2's client connection as bytes in and bytes out, against a server end written here from RFC 9113
and RFC 7541: its header blocks are HPACK with Huffman and the dynamic table (as grpc-go's are), and what the client
writes is parsed frame by frame and its header blocks decoded, so each test reads as a conversation on the wire."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import hpack
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from koordrp.http2 import (
    HeaderBlocks,
    leaves_table,
    ACK,
    DEFAULT_FRAME_SIZE,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    HEADER_LIST_LIMIT,
    MAX_STREAM_ID,
    PADDED,
    PREFACE,
    PRIORITY_FLAG,
    Answered,
    Call,
    ClientConnection,
    ErrorCode,
    Failed,
    Frame,
    Outcome,
    Setting,
    StatusSent,
    grpc_timeout,
    request_headers,
)

PATH = "/runtime.v1alpha1.RuntimeHookService/PreCreateContainerHook"
BLOCK = request_headers(PATH, "localhost", "koordrp")
MAX_ANSWER = 1 << 20
Fields = list[tuple[str, str]]


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return struct.pack(">L", len(payload))[1:] + struct.pack(">BBL", kind, flags, stream_id) + payload


def message(body: bytes, compressed: bool = False) -> bytes:
    """gRPC's length-prefixed message."""
    return struct.pack(">BL", compressed, len(body)) + body


def settings_frame(*pairs: tuple[Setting, int]) -> bytes:
    return frame(Frame.SETTINGS, 0, 0, b"".join(struct.pack(">HL", setting, value) for setting, value in pairs))


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(Frame.WINDOW_UPDATE, 0, stream_id, struct.pack(">L", increment))


def rst_stream(stream_id: int, code: ErrorCode) -> bytes:
    return frame(Frame.RST_STREAM, 0, stream_id, struct.pack(">L", code))


def goaway(last: int, code: ErrorCode = ErrorCode.NO_ERROR) -> bytes:
    return frame(Frame.GOAWAY, 0, 0, struct.pack(">LL", last, code))


def padded(payload: bytes, padding: int) -> bytes:
    return bytes((padding,)) + payload + b"\x00" * padding


@dataclass
class Written:
    """One frame the client wrote; ``fields``: its header block decoded (a HEADERS frame and its CONTINUATIONs)."""

    kind: int
    flags: int
    stream_id: int
    payload: bytes
    fields: Fields | None = None
    pieces: int = 1
    """How many frames the header block came in."""

    @property
    def error_code(self) -> int:
        """RST_STREAM's code, or GOAWAY's."""
        return int(struct.unpack(">L", self.payload[-4:])[0])


@dataclass
class ServerEnd:
    """The server's end of one connection: reads what the client wrote (checking HTTP/2's framing rules as it goes)
    and keeps the windows the client gave it, so that it can send only what they allow."""

    encoder: hpack.Encoder = field(default_factory=hpack.Encoder)
    decoder: hpack.Decoder = field(default_factory=hpack.Decoder)
    buffer: bytes = b""
    started: bool = False
    client_settings: dict[int, int] = field(default_factory=dict)
    connection_window: int = DEFAULT_WINDOW
    stream_windows: dict[int, int] = field(default_factory=dict)
    """What the client lets the server send on each stream it opened."""
    max_frame: int = DEFAULT_FRAME_SIZE
    """The largest frame the server's settings let the client send."""
    _block: Written | None = None

    def read(self, data: bytes) -> list[Written]:
        self.buffer += data
        if not self.started:
            assert self.buffer.startswith(PREFACE), self.buffer[:24]
            self.buffer = self.buffer[len(PREFACE) :]
            self.started = True
        frames = []
        while len(self.buffer) >= 9:
            length = int.from_bytes(self.buffer[:3], "big")
            kind, flags, stream_id = struct.unpack(">BBL", self.buffer[3:9])
            if len(self.buffer) < 9 + length:
                break
            payload, self.buffer = self.buffer[9 : 9 + length], self.buffer[9 + length :]
            assert length <= self.max_frame, length
            written = self._read(Written(kind, flags, stream_id, payload))
            if written is not None:
                frames.append(written)
        return frames

    def _read(self, written: Written) -> Written | None:
        if self._block is not None:
            # Nothing may come between a header block's frames (RFC 9113, 6.10).
            assert written.kind == Frame.CONTINUATION and written.stream_id == self._block.stream_id, written
            self._block.payload += written.payload
            self._block.pieces += 1
            if not written.flags & END_HEADERS:
                return None
            written, self._block = self._block, None
            written.flags |= END_HEADERS
        if written.kind == Frame.HEADERS:
            if not written.flags & END_HEADERS:
                self._block = written
                return None
            written.fields = [(str(name), str(value)) for name, value in self.decoder.decode(written.payload)]
            self.stream_windows.setdefault(written.stream_id, self.client_settings.get(Setting.INITIAL_WINDOW_SIZE, DEFAULT_WINDOW))
        elif written.kind == Frame.SETTINGS and not written.flags & ACK:
            for offset in range(0, len(written.payload), 6):
                setting, value = struct.unpack_from(">HL", written.payload, offset)
                self.client_settings[setting] = value
        elif written.kind == Frame.WINDOW_UPDATE:
            (increment,) = struct.unpack(">L", written.payload)
            if written.stream_id == 0:
                self.connection_window += increment
            else:
                self.stream_windows[written.stream_id] += increment
        return written

    def headers(self, stream_id: int, fields: Fields, flags: int = END_HEADERS) -> bytes:
        return frame(Frame.HEADERS, flags, stream_id, self.encoder.encode(fields))

    def response_headers(self, stream_id: int) -> bytes:
        return self.headers(stream_id, [(":status", "200"), ("content-type", "application/grpc")])

    def trailers(self, stream_id: int, status: int = 0, details: str | None = None) -> bytes:
        fields = [("grpc-status", str(status))] + ([("grpc-message", details)] if details is not None else [])
        return self.headers(stream_id, fields, END_HEADERS | END_STREAM)

    def answer(self, stream_id: int, body: bytes) -> bytes:
        """A whole answer of one message (within the default windows and frame size)."""
        return self.response_headers(stream_id) + frame(Frame.DATA, 0, stream_id, message(body)) + self.trailers(stream_id)

    def data(self, stream_id: int, payload: bytes, padding: int = 0, max_frame: int = DEFAULT_FRAME_SIZE) -> tuple[bytes, bytes]:
        """DATA frames for as much of ``payload`` as the client's windows let, each ``padding`` padded; and the rest."""
        out = b""
        while payload:
            room = min(self.connection_window, self.stream_windows[stream_id], max_frame) - (padding + 1 if padding else 0)
            if room <= 0:
                break
            piece, payload = payload[:room], payload[room:]
            sent = padded(piece, padding) if padding else piece
            out += frame(Frame.DATA, PADDED if padding else 0, stream_id, sent)
            self.connection_window -= len(sent)
            self.stream_windows[stream_id] -= len(sent)
        return out, payload


def of_kind(frames: list[Written], kind: Frame) -> list[Written]:
    return [written for written in frames if written.kind == kind]


class ConnectionTest(SynchronousTestCase):
    """A client connection and the server end it talks to, past the settings each sends first."""

    def connect(self, *server_settings: tuple[Setting, int], max_answer: int = MAX_ANSWER) -> None:
        self.client = ClientConnection(max_answer)
        self.server = ServerEnd(max_frame=dict(server_settings).get(Setting.MAX_FRAME_SIZE, DEFAULT_FRAME_SIZE))
        self.start = self.server.read(self.client.output())
        self.assertEqual(self.client.received(settings_frame(*server_settings)), [])
        [acked] = self.server.read(self.client.output())
        self.assertEqual((acked.kind, acked.flags), (Frame.SETTINGS, ACK))

    def setUp(self) -> None:
        self.connect()

    def call(self, request: bytes = b"request", timeout: float = 2.0) -> Call:
        return self.client.call(BLOCK + grpc_timeout(timeout), request)

    def written(self) -> list[Written]:
        return self.server.read(self.client.output())

    def outcomes(self, data: bytes) -> list[tuple[int, Outcome | None]]:
        """The calls that ``data`` ended: each stream id and outcome."""
        return [(call.stream_id, call.outcome) for call in self.client.received(data)]


class StartTests(ConnectionTest):
    def test_the_client_opens_with_the_preface_its_settings_and_a_connection_window_for_two_answers(self) -> None:
        settings_sent, update = self.start
        self.assertEqual((settings_sent.kind, settings_sent.flags, settings_sent.stream_id), (Frame.SETTINGS, 0, 0))
        window = self.server.client_settings[Setting.INITIAL_WINDOW_SIZE]
        self.assertGreaterEqual(window, MAX_ANSWER + 5)  # a whole answer fits in a stream's window
        self.assertEqual(self.server.client_settings[Setting.ENABLE_PUSH], 0)
        self.assertEqual(self.server.client_settings[Setting.MAX_HEADER_LIST_SIZE], HEADER_LIST_LIMIT)
        self.assertEqual((update.kind, update.stream_id), (Frame.WINDOW_UPDATE, 0))
        self.assertEqual(self.server.connection_window, 2 * window)

    def test_the_servers_settings_ack_is_not_acknowledged(self) -> None:
        self.assertEqual(self.client.received(frame(Frame.SETTINGS, ACK, 0)), [])
        self.assertEqual(self.client.output(), b"")


class RequestTests(ConnectionTest):
    def test_a_calls_header_block_is_a_grpc_unary_post(self) -> None:
        self.call(timeout=1.5)
        headers, data = self.written()
        self.assertEqual((headers.kind, headers.flags, headers.stream_id), (Frame.HEADERS, END_HEADERS, 1))
        self.assertEqual(
            headers.fields,
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", PATH),
                (":authority", "localhost"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
                ("user-agent", "koordrp"),
                ("grpc-timeout", "1500m"),
            ],
        )
        self.assertEqual((data.kind, data.flags, data.stream_id, data.payload), (Frame.DATA, END_STREAM, 1, message(b"request")))

    def test_the_header_block_adds_nothing_to_the_servers_table(self) -> None:
        """Literals without indexing: the server's decoder table stays empty, so no call depends on another's."""
        self.call()
        self.written()
        self.assertEqual(len(self.server.decoder.header_table.dynamic_entries), 0)

    def test_grpc_timeout_is_milliseconds_rounded_up_or_seconds_past_eight_digits(self) -> None:
        def value(seconds: float) -> str:
            [(name, text)] = hpack.Decoder().decode(grpc_timeout(seconds))
            self.assertEqual(name, "grpc-timeout")
            return str(text)

        self.assertEqual(value(2), "2000m")
        self.assertEqual(value(0.0001), "1m")  # never 0: that would be a deadline already past
        self.assertEqual(value(0), "1m")
        self.assertEqual(value(0.0015), "2m")
        self.assertEqual(value(99_999.999), "99999999m")
        self.assertEqual(value(99_999.9991), "100000S")
        self.assertEqual(value(100_000), "100000S")
        self.assertEqual(value(100_000.5), "100001S")
        self.assertEqual(value(10**12), "99999999S")

    def test_stream_ids_are_odd_and_increase(self) -> None:
        for _ in range(4):
            self.call()
        self.assertEqual([written.stream_id for written in of_kind(self.written(), Frame.HEADERS)], [1, 3, 5, 7])

    def test_a_header_block_over_the_frame_size_goes_on_in_continuations(self) -> None:
        path = "/" + "p" * (2 * DEFAULT_FRAME_SIZE)
        self.client.call(request_headers(path, "localhost", "koordrp"), b"")
        headers, data = self.written()
        self.assertEqual(headers.pieces, 3)
        assert headers.fields is not None
        self.assertIn((":path", path), headers.fields)
        self.assertEqual(data.payload, message(b""))


class AnswerTests(ConnectionTest):
    def test_an_answer_is_its_message(self) -> None:
        call = self.call()
        self.assertEqual(self.outcomes(self.server.answer(1, b"answer")), [(1, Answered(b"answer"))])
        self.assertEqual(call.outcome, Answered(b"answer"))
        self.assertEqual(self.client.calls, 0)

    def answer_in_pieces(self, cuts: list[int]) -> None:
        self.call()
        answer = self.server.answer(1, b"answer" * 10)
        ended: list[Call] = []
        start = 0
        for cut in sorted(cuts) + [len(answer)]:
            ended += self.client.received(answer[start:cut])
            start = cut
        self.assertEqual([call.outcome for call in ended], [Answered(b"answer" * 10)])

    def test_an_answer_read_a_byte_at_a_time_is_the_same(self) -> None:
        self.answer_in_pieces(list(range(200)))

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.integers(min_value=0, max_value=150)))
    def test_an_answer_cut_anywhere_is_the_same(self, cuts: list[int]) -> None:
        self.connect()
        self.answer_in_pieces(cuts)

    def test_a_trailers_only_answer_is_its_status_with_its_message_percent_decoded(self) -> None:
        self.call()
        sent = self.server.headers(
            1, [(":status", "200"), ("content-type", "application/grpc"), ("grpc-status", "9"), ("grpc-message", "no%20room %E2%9C%93")], END_HEADERS | END_STREAM
        )
        [(_, outcome)] = self.outcomes(sent)
        self.assertEqual(outcome, StatusSent(9, "no room ✓"))
        assert isinstance(outcome, StatusSent)
        self.assertEqual(outcome.name, "FAILED_PRECONDITION")

    def test_a_status_in_trailers_after_headers(self) -> None:
        self.call()
        sent = self.server.response_headers(1) + self.server.trailers(1, 13, "broken%25")
        self.assertEqual(self.outcomes(sent), [(1, StatusSent(13, "broken%"))])

    def test_an_http_status_other_than_200_is_read_as_grpc_reads_it(self) -> None:
        self.call()
        [(_, outcome)] = self.outcomes(self.server.headers(1, [(":status", "503")], END_HEADERS | END_STREAM))
        assert isinstance(outcome, StatusSent)
        self.assertEqual((outcome.name, outcome.details), ("UNAVAILABLE", "HTTP status 503"))

    def test_an_answer_without_a_grpc_status_fails(self) -> None:
        self.call()
        sent = self.server.response_headers(1) + frame(Frame.DATA, 0, 1, message(b"a")) + self.server.headers(1, [("x", "y")], END_HEADERS | END_STREAM)
        self.assertEqual(self.outcomes(sent), [(1, Failed("an answer without a gRPC status"))])

    def test_an_answer_ending_with_data_has_no_grpc_status(self) -> None:
        self.call()
        sent = self.server.response_headers(1) + frame(Frame.DATA, END_STREAM, 1, message(b"a"))
        self.assertEqual(self.outcomes(sent), [(1, Failed("an answer without a gRPC status"))])

    def test_a_compressed_answer_fails(self) -> None:
        self.call()
        sent = self.server.response_headers(1) + frame(Frame.DATA, 0, 1, message(b"a", compressed=True)) + self.server.trailers(1)
        self.assertEqual(self.outcomes(sent), [(1, Failed("a compressed answer, which koordrp never asked for"))])

    def test_two_messages_in_one_answer_fail(self) -> None:
        self.call()
        sent = self.server.response_headers(1) + frame(Frame.DATA, 0, 1, message(b"a") + message(b"b")) + self.server.trailers(1)
        self.assertEqual(self.outcomes(sent), [(1, Failed("an answer that is not exactly one message"))])

    def test_an_ok_answer_without_a_message_fails(self) -> None:
        self.call()
        self.assertEqual(
            self.outcomes(self.server.response_headers(1) + self.server.trailers(1)), [(1, Failed("an OK answer without a message"))]
        )

    def test_an_answer_without_an_http_status_fails_and_resets_its_stream(self) -> None:
        """The server still thinks the stream open: it hears that it is not, so it does not count against its limit."""
        self.call()
        self.written()
        self.assertEqual(self.outcomes(self.server.headers(1, [("content-type", "application/grpc")])), [(1, Failed("an answer without an HTTP status"))])
        [reset] = self.written()
        self.assertEqual((reset.kind, reset.stream_id, reset.error_code), (Frame.RST_STREAM, 1, ErrorCode.PROTOCOL_ERROR))

    def test_informational_headers_before_the_answer_are_let_pass(self) -> None:
        self.call()
        sent = self.server.headers(1, [(":status", "100")]) + self.server.headers(1, [(":status", "103"), ("link", "</x>")]) + self.server.answer(1, b"a")
        self.assertEqual(self.outcomes(sent), [(1, Answered(b"a"))])

    def test_an_answer_in_several_data_frames_is_one_message(self) -> None:
        self.call()
        body = message(b"x" * 100)
        sent = self.server.response_headers(1) + b"".join(frame(Frame.DATA, 0, 1, body[i : i + 7]) for i in range(0, len(body), 7))
        self.assertEqual(self.outcomes(sent + self.server.trailers(1)), [(1, Answered(b"x" * 100))])

    def test_padded_data_and_headers_are_read_without_their_padding(self) -> None:
        self.call()
        headers = self.server.encoder.encode([(":status", "200"), ("content-type", "application/grpc")])
        trailers = self.server.encoder.encode([("grpc-status", "0")])
        sent = (
            frame(Frame.HEADERS, END_HEADERS | PADDED, 1, padded(headers, 10))
            + frame(Frame.DATA, PADDED, 1, padded(message(b"answer"), 255))
            + frame(Frame.DATA, PADDED, 1, padded(b"", 3))
            + frame(Frame.HEADERS, END_HEADERS | END_STREAM | PADDED, 1, padded(trailers, 0))
        )
        self.assertEqual(self.outcomes(sent), [(1, Answered(b"answer"))])

    def test_headers_with_priority_are_read_past_it(self) -> None:
        self.call()
        headers = self.server.encoder.encode([(":status", "200"), ("content-type", "application/grpc")])
        priority = struct.pack(">LB", 0, 15)
        sent = (
            frame(Frame.HEADERS, END_HEADERS | PRIORITY_FLAG | PADDED, 1, padded(priority + headers, 4))
            + frame(Frame.PRIORITY, 0, 1, priority)
            + frame(Frame.DATA, 0, 1, message(b"answer"))
            + frame(Frame.HEADERS, END_HEADERS | END_STREAM | PRIORITY_FLAG, 1, priority + self.server.encoder.encode([("grpc-status", "0")]))
        )
        self.assertEqual(self.outcomes(sent), [(1, Answered(b"answer"))])

    def test_header_blocks_in_continuations_are_read_whole(self) -> None:
        self.call()
        block = self.server.encoder.encode([(":status", "200"), ("content-type", "application/grpc"), ("x-long", "v" * 300)])
        trailers = self.server.encoder.encode([("grpc-status", "0")])
        sent = (
            frame(Frame.HEADERS, 0, 1, block[:3])
            + frame(Frame.CONTINUATION, 0, 1, block[3:100])
            + frame(Frame.CONTINUATION, END_HEADERS, 1, block[100:])
            + frame(Frame.DATA, 0, 1, message(b"answer"))
            + frame(Frame.HEADERS, END_STREAM, 1, trailers[:1])
            + frame(Frame.CONTINUATION, END_HEADERS, 1, trailers[1:])
        )
        self.assertEqual(self.outcomes(sent), [(1, Answered(b"answer"))])

    def test_an_answer_over_the_limit_resets_its_stream_and_fails(self) -> None:
        self.connect(max_answer=100)
        self.call()
        self.written()
        sent = self.server.response_headers(1) + frame(Frame.DATA, 0, 1, message(b"x" * 101))
        [(_, outcome)] = self.outcomes(sent)
        self.assertEqual(outcome, Failed("an answer over koordrp's limit of 100 bytes"))
        [reset] = self.written()
        self.assertEqual((reset.kind, reset.stream_id, reset.error_code), (Frame.RST_STREAM, 1, ErrorCode.CANCEL))
        # What the server still sends of it is let pass.
        self.assertEqual(self.outcomes(frame(Frame.DATA, 0, 1, b"more") + self.server.trailers(1)), [])
        self.assertIsNone(self.client.ended)

    def test_an_answer_of_exactly_the_limit_is_read(self) -> None:
        self.connect(max_answer=100)
        self.call()
        self.assertEqual(self.outcomes(self.server.answer(1, b"x" * 100)), [(1, Answered(b"x" * 100))])

    def test_an_answer_before_the_whole_request_tells_the_server_the_rest_is_not_coming(self) -> None:
        """gRPC lets a server answer before the request ends: the stream is reset with NO_ERROR, as grpc-go does."""
        self.connect((Setting.INITIAL_WINDOW_SIZE, 10))
        self.call(b"x" * 100)
        self.written()
        self.assertEqual(self.outcomes(self.server.answer(1, b"early")), [(1, Answered(b"early"))])
        [reset] = self.written()
        self.assertEqual((reset.kind, reset.stream_id, reset.error_code), (Frame.RST_STREAM, 1, ErrorCode.NO_ERROR))
        # The rest of the request stays unsent, whatever window the server gives.
        self.client.received(window_update(0, 1000) + window_update(1, 1000))
        self.assertEqual(self.written(), [])


class ConnectionFrameTests(ConnectionTest):
    def test_a_ping_is_answered_with_its_payload_and_a_ping_ack_is_not(self) -> None:
        self.client.received(frame(Frame.PING, 0, 0, b"12345678"))
        [pong] = self.written()
        self.assertEqual((pong.kind, pong.flags, pong.stream_id, pong.payload), (Frame.PING, ACK, 0, b"12345678"))
        self.client.received(frame(Frame.PING, ACK, 0, b"87654321"))
        self.assertEqual(self.written(), [])

    def test_frames_of_unknown_types_are_let_pass(self) -> None:
        self.call()
        self.assertEqual(self.outcomes(frame(0xFA, 0xFF, 1, b"whatever") + frame(0xFB, 0, 0) + self.server.answer(1, b"a")), [(1, Answered(b"a"))])

    def test_goaway_fails_the_streams_it_never_processed_as_lost_and_the_others_are_still_answered(self) -> None:
        for _ in range(3):
            self.call()
        self.written()
        ended = self.outcomes(goaway(3))
        self.assertEqual(ended, [(5, Failed("the server went away (NO_ERROR)", lost=True))])
        self.assertFalse(self.client.accepting)
        self.assertRaises(ValueError, self.call)
        self.assertEqual(self.outcomes(self.server.answer(1, b"one") + self.server.answer(3, b"three")), [(1, Answered(b"one")), (3, Answered(b"three"))])

    def test_a_graceful_goaway_naming_every_stream_still_takes_no_new_call(self) -> None:
        """grpc-go's server first says GOAWAY with the highest stream id, then the real last one: no stream may open
        after either (RFC 9113, 6.8)."""
        self.call()
        self.written()
        self.assertEqual(self.outcomes(goaway(0xFFFFFFFF)), [])
        self.assertFalse(self.client.accepting)
        self.assertEqual(self.outcomes(goaway(1) + self.server.answer(1, b"a")), [(1, Answered(b"a"))])

    def test_goaway_fails_the_calls_waiting_for_a_stream_as_lost(self) -> None:
        self.connect((Setting.MAX_CONCURRENT_STREAMS, 1))
        first, second = self.call(), self.call()
        self.assertEqual([(call.stream_id, call.outcome) for call in self.client.received(goaway(1))], [(0, Failed("the server went away (NO_ERROR)", lost=True))])
        self.assertIsNone(first.outcome)
        self.assertTrue(second.outcome)

    def test_a_refused_stream_is_lost_and_a_stream_reset_otherwise_is_not(self) -> None:
        self.call(), self.call()
        self.written()
        self.assertEqual(
            self.outcomes(rst_stream(1, ErrorCode.REFUSED_STREAM) + rst_stream(3, ErrorCode.INTERNAL_ERROR)),
            [
                (1, Failed("the server reset the stream: REFUSED_STREAM", lost=True)),
                (3, Failed("the server reset the stream: INTERNAL_ERROR")),
            ],
        )
        self.assertEqual(self.written(), [])  # never a reset for a reset

    def test_a_reset_of_a_stream_whose_request_is_held_is_not_answered_with_a_reset(self) -> None:
        self.connect((Setting.INITIAL_WINDOW_SIZE, 10))
        self.call(b"x" * 100)
        self.written()
        self.assertEqual(self.outcomes(rst_stream(1, ErrorCode.CANCEL)), [(1, Failed("the server reset the stream: CANCEL"))])
        self.assertEqual(self.written(), [])  # RFC 9113, 5.4.2: no RST_STREAM for a RST_STREAM

    def test_a_reset_of_a_stream_that_ended_is_let_pass(self) -> None:
        self.call()
        self.client.received(self.server.answer(1, b"a"))
        self.assertEqual(self.outcomes(rst_stream(1, ErrorCode.NO_ERROR)), [])
        self.assertIsNone(self.client.ended)


class FlowControlTests(ConnectionTest):
    def sent_data(self) -> list[Written]:
        return of_kind(self.written(), Frame.DATA)

    def test_a_request_over_the_servers_stream_window_waits_for_its_window_update(self) -> None:
        self.connect((Setting.INITIAL_WINDOW_SIZE, 1000))
        request = bytes(range(256)) * 10
        self.call(request)
        self.assertEqual([len(data.payload) for data in self.sent_data()], [1000])
        self.client.received(window_update(1, 500))
        self.assertEqual([len(data.payload) for data in self.sent_data()], [500])
        self.client.received(window_update(1, 5000))
        [last] = self.sent_data()
        self.assertEqual((len(last.payload), last.flags), (len(request) + 5 - 1500, END_STREAM))

    def test_a_request_over_the_connection_window_waits_for_its_window_update(self) -> None:
        self.connect((Setting.INITIAL_WINDOW_SIZE, 1 << 20), (Setting.MAX_FRAME_SIZE, 1 << 20))
        self.call(b"x" * 100_000)
        self.assertEqual([len(data.payload) for data in self.sent_data()], [DEFAULT_WINDOW])
        self.client.received(window_update(0, 1 << 20))
        self.assertEqual([len(data.payload) for data in self.sent_data()], [100_005 - DEFAULT_WINDOW])

    def test_data_frames_keep_to_the_servers_frame_size(self) -> None:
        self.call(b"x" * 40_000)
        self.assertEqual([len(data.payload) for data in self.sent_data()], [DEFAULT_FRAME_SIZE, DEFAULT_FRAME_SIZE, 40_005 - 2 * DEFAULT_FRAME_SIZE])
        self.connect((Setting.MAX_FRAME_SIZE, 20_000))
        self.call(b"x" * 40_000)
        self.assertEqual([len(data.payload) for data in self.sent_data()], [20_000, 20_000, 5])

    def test_a_smaller_initial_window_after_a_stream_opened_holds_its_request(self) -> None:
        """The server's settings may come after the first call went out: its window shrinks with them (RFC 9113, 6.9.2)."""
        self.client = ClientConnection(MAX_ANSWER)
        self.server = ServerEnd()
        self.call(b"x" * 70_000)
        sent = sum(len(data.payload) for data in self.sent_data())
        self.assertEqual(sent, DEFAULT_WINDOW)
        self.client.received(settings_frame((Setting.INITIAL_WINDOW_SIZE, 100)))
        self.assertEqual(self.sent_data(), [])  # its window is now 100 - 65535, below 0
        self.client.received(window_update(0, 10_000) + window_update(1, DEFAULT_WINDOW - 100 + 10))
        self.assertEqual([len(data.payload) for data in self.sent_data()], [10])

    def test_a_call_waiting_for_a_stream_opens_with_the_window_the_server_sets_meanwhile(self) -> None:
        self.connect((Setting.MAX_CONCURRENT_STREAMS, 1))
        self.call()
        self.call(b"x" * 100)
        self.written()
        self.client.received(settings_frame((Setting.INITIAL_WINDOW_SIZE, 10)) + self.server.answer(1, b"a"))
        self.assertEqual([len(data.payload) for data in self.sent_data()], [10])

    def test_max_concurrent_streams_holds_a_call_until_a_stream_ends(self) -> None:
        self.connect((Setting.MAX_CONCURRENT_STREAMS, 1))
        first, second = self.call(), self.call()
        self.assertEqual([written.stream_id for written in of_kind(self.written(), Frame.HEADERS)], [1])
        self.assertEqual((second.stream_id, self.client.calls), (0, 2))
        self.assertEqual(self.outcomes(self.server.answer(1, b"a")), [(1, Answered(b"a"))])
        self.assertEqual([written.stream_id for written in of_kind(self.written(), Frame.HEADERS)], [3])
        self.assertEqual(self.outcomes(self.server.answer(3, b"b")), [(3, Answered(b"b"))])
        self.assertEqual((first.outcome, second.outcome), (Answered(b"a"), Answered(b"b")))

    def test_a_higher_concurrent_streams_limit_opens_the_calls_waiting(self) -> None:
        self.connect((Setting.MAX_CONCURRENT_STREAMS, 0))
        self.call(), self.call()
        self.assertEqual(self.written(), [])
        self.client.received(settings_frame((Setting.MAX_CONCURRENT_STREAMS, 5)))
        self.assertEqual([written.stream_id for written in of_kind(self.written(), Frame.HEADERS)], [1, 3])

    def answer_within_windows(self, stream_id: int, body: bytes, padding: int = 0) -> Outcome | None:
        """Send an answer as a server keeping to the client's windows would, giving each window update back in
        turn; fails if the client stops giving room before the answer is whole."""
        self.written()
        ended = self.client.received(self.server.response_headers(stream_id))
        rest = message(body)
        while rest:
            sent, rest = self.server.data(stream_id, rest, padding)
            self.assertTrue(sent, "the client gave no more room: the answer stalled")
            ended += self.client.received(sent)
            self.written()
        ended += self.client.received(self.server.trailers(stream_id))
        [call] = ended
        return call.outcome

    def test_many_answers_over_64_kib_in_sequence_never_stall(self) -> None:
        self.connect(max_answer=200_000)
        for stream_id in range(1, 40, 2):
            self.call()
            self.assertEqual(self.answer_within_windows(stream_id, b"y" * 200_000), Answered(b"y" * 200_000))

    def test_an_answer_padded_past_its_stream_window_never_stalls(self) -> None:
        """Padding counts in the windows too: a whole answer with every frame padded is more than a stream's window."""
        self.connect(max_answer=200_000)
        for stream_id in (1, 3, 5):
            self.call()
            self.assertEqual(self.answer_within_windows(stream_id, b"z" * 200_000, padding=255), Answered(b"z" * 200_000))

    def test_windows_given_back_never_exceed_what_was_received(self) -> None:
        self.connect(max_answer=200_000)
        self.call()
        self.answer_within_windows(1, b"y" * 200_000)
        self.assertLessEqual(self.server.connection_window, 2 * self.server.client_settings[Setting.INITIAL_WINDOW_SIZE])

    def test_a_stream_window_update_of_zero_resets_the_stream(self) -> None:
        self.connect((Setting.INITIAL_WINDOW_SIZE, 10))
        self.call(b"x" * 100)
        self.written()
        self.assertEqual(self.outcomes(window_update(1, 0)), [(1, Failed("the server broke flow control"))])
        [reset] = self.written()  # one reset: the rest of the request is not also reset
        self.assertEqual((reset.kind, reset.stream_id), (Frame.RST_STREAM, 1))


class ProtocolErrorTests(ConnectionTest):
    """What HTTP/2 forbids ends the connection: GOAWAY, and every call on it fails once."""

    def broken_by(self, data: bytes, code: ErrorCode = ErrorCode.PROTOCOL_ERROR) -> None:
        self.connect((Setting.MAX_CONCURRENT_STREAMS, 2))
        calls = [self.call() for _ in range(3)]
        self.written()
        ended = self.client.received(data)
        self.assertEqual(sorted(ended, key=id), sorted(calls, key=id))
        for call in calls:
            assert isinstance(call.outcome, Failed)
            self.assertTrue(call.outcome.reason.startswith("the server broke HTTP/2"), call.outcome.reason)
        self.assertEqual(calls[2].outcome, Failed(str(self.client.ended), lost=True))  # it never had a stream
        self.assertIsNotNone(self.client.ended)
        self.assertFalse(self.client.accepting)
        [away] = self.written()
        self.assertEqual((away.kind, away.stream_id, away.error_code), (Frame.GOAWAY, 0, code))
        self.assertEqual(struct.unpack(">L", away.payload[:4]), (0,))  # koordrp processed none of the server's streams
        # Nothing more is read, written or ended.
        self.assertEqual(self.client.received(self.server.answer(1, b"a")), [])
        self.assertEqual(self.client.lost("closed"), [])
        self.assertEqual(self.client.output(), b"")

    def test_a_frame_on_a_stream_never_opened(self) -> None:
        self.broken_by(frame(Frame.DATA, 0, 7, b"x"))

    def test_headers_on_a_stream_never_opened(self) -> None:
        self.broken_by(self.server.response_headers(9))

    def test_a_reset_of_a_stream_never_opened(self) -> None:
        self.broken_by(rst_stream(11, ErrorCode.CANCEL))

    def test_a_window_update_on_a_stream_never_opened(self) -> None:
        self.broken_by(window_update(13, 1))

    def test_a_frame_on_an_even_stream(self) -> None:
        self.broken_by(self.server.response_headers(2))

    def test_a_push_promise(self) -> None:
        self.broken_by(frame(Frame.PUSH_PROMISE, END_HEADERS, 1, struct.pack(">L", 2) + self.server.encoder.encode([(":method", "GET")])))

    def test_a_frame_over_the_size_koordrp_allows(self) -> None:
        self.broken_by(frame(Frame.DATA, 0, 1, b"x" * (DEFAULT_FRAME_SIZE + 1))[:20], ErrorCode.FRAME_SIZE_ERROR)

    def test_a_frame_between_headers_and_their_continuation(self) -> None:
        block = self.server.encoder.encode([(":status", "200")])
        self.broken_by(frame(Frame.HEADERS, 0, 1, block) + frame(Frame.PING, 0, 0, b"12345678"))

    def test_a_continuation_of_another_stream(self) -> None:
        block = self.server.encoder.encode([(":status", "200")])
        self.broken_by(frame(Frame.HEADERS, 0, 1, block) + frame(Frame.CONTINUATION, END_HEADERS, 3, b""))

    def test_a_header_block_hpack_cannot_read(self) -> None:
        self.broken_by(frame(Frame.HEADERS, END_HEADERS, 1, b"\xff\x80\x01"), ErrorCode.COMPRESSION_ERROR)

    def test_data_on_stream_0(self) -> None:
        self.broken_by(frame(Frame.DATA, 0, 0, b"x"))

    def test_padding_longer_than_its_frame(self) -> None:
        self.broken_by(self.server.response_headers(1) + frame(Frame.DATA, PADDED, 1, b"\x05abc"))

    def test_trailers_that_do_not_end_their_stream(self) -> None:
        self.broken_by(self.server.response_headers(1) + self.server.headers(1, [("grpc-status", "0")]))

    def test_settings_on_a_stream(self) -> None:
        self.broken_by(frame(Frame.SETTINGS, 0, 1))

    def test_an_initial_window_over_2_to_the_31(self) -> None:
        self.broken_by(settings_frame((Setting.INITIAL_WINDOW_SIZE, 2**31)), ErrorCode.FLOW_CONTROL_ERROR)

    def test_a_connection_window_over_2_to_the_31(self) -> None:
        self.broken_by(window_update(0, MAX_STREAM_ID), ErrorCode.FLOW_CONTROL_ERROR)

    def test_a_malformed_ping(self) -> None:
        self.broken_by(frame(Frame.PING, 0, 0, b"1234"), ErrorCode.FRAME_SIZE_ERROR)

    def test_a_ping_on_a_stream(self) -> None:
        self.broken_by(frame(Frame.PING, 0, 1, b"12345678"))

    def test_a_malformed_reset(self) -> None:
        self.broken_by(frame(Frame.RST_STREAM, 0, 1, b"\x00\x00\x08"), ErrorCode.FRAME_SIZE_ERROR)

    def test_a_reset_of_stream_0(self) -> None:
        self.broken_by(rst_stream(0, ErrorCode.CANCEL))

    def test_an_error_found_in_a_later_read_fails_every_call_once(self) -> None:
        self.connect()
        calls = [self.call(), self.call()]
        self.assertEqual(self.outcomes(self.server.answer(1, b"a")), [(1, Answered(b"a"))])
        self.assertEqual(self.client.received(frame(Frame.PUSH_PROMISE, 0, 3)), [calls[1]])


class CancelTests(ConnectionTest):
    def test_a_cancelled_call_resets_its_stream_and_never_ends_again(self) -> None:
        call = self.call()
        self.written()
        self.client.cancel(call)
        [reset] = self.written()
        self.assertEqual((reset.kind, reset.stream_id, reset.error_code), (Frame.RST_STREAM, 1, ErrorCode.CANCEL))
        self.assertEqual(call.outcome, Failed("cancelled by the caller"))
        self.assertEqual(self.client.received(self.server.answer(1, b"late")), [])
        self.assertEqual(self.client.lost("closed"), [])
        self.client.cancel(call)
        self.assertEqual(self.written(), [])

    def test_a_cancelled_streams_header_blocks_still_keep_the_table_in_step(self) -> None:
        """The server's header blocks add to its table whatever the stream: one skipped would leave the next
        answer's indexes pointing at the wrong fields."""
        cancelled, answered = self.call(), self.call()
        self.written()
        self.client.cancel(cancelled)
        # Fields only the cancelled stream's block adds to the table; the later answer names them by index.
        unusual = [(":status", "200"), ("content-type", "application/grpc"), ("x-only-here", "1")]
        self.client.received(self.server.headers(1, unusual) + frame(Frame.DATA, 0, 1, message(b"late")) + self.server.trailers(1, 0, "once%20only"))
        headers = self.server.headers(3, unusual)
        self.assertEqual(len(headers), 9 + 3)  # three fields, each an index into the server's table
        later = headers + frame(Frame.DATA, 0, 3, message(b"a")) + self.server.trailers(3, 5, "once%20only")
        self.assertEqual(self.outcomes(later), [(3, StatusSent(5, "once only"))])
        self.assertEqual(answered.outcome, StatusSent(5, "once only"))

    def test_a_cancelled_streams_continuations_are_still_read(self) -> None:
        cancelled, _ = self.call(), self.call()
        self.written()
        self.client.cancel(cancelled)
        block = self.server.encoder.encode([(":status", "200"), ("content-type", "application/grpc")])
        self.client.received(frame(Frame.HEADERS, 0, 1, block[:2]) + frame(Frame.CONTINUATION, END_HEADERS, 1, block[2:]))
        self.assertEqual(self.outcomes(self.server.answer(3, b"a")), [(3, Answered(b"a"))])

    def test_a_cancelled_call_waiting_for_a_stream_never_opens_one(self) -> None:
        self.connect((Setting.MAX_CONCURRENT_STREAMS, 1))
        _, waiting = self.call(), self.call()
        self.written()
        self.client.cancel(waiting)
        self.assertEqual(self.written(), [])
        self.client.received(self.server.answer(1, b"a"))
        self.assertEqual(of_kind(self.written(), Frame.HEADERS), [])
        self.assertEqual(self.client.calls, 0)

    def test_data_for_a_cancelled_stream_still_counts_in_the_connection_window(self) -> None:
        self.connect(max_answer=200_000)
        call = self.call()
        self.written()
        self.client.cancel(call)
        self.client.received(self.server.response_headers(1))
        rest = message(b"q" * 200_000)
        while rest:
            sent, rest = self.server.data(1, rest)
            self.assertTrue(sent)
            self.client.received(sent)
            self.written()
        self.call()
        self.assertEqual(self.answer_size(3, 200_000), Answered(b"r" * 200_000))

    def answer_size(self, stream_id: int, size: int) -> Outcome | None:
        self.written()
        ended = self.client.received(self.server.response_headers(stream_id))
        rest = message(b"r" * size)
        while rest:
            sent, rest = self.server.data(stream_id, rest)
            self.assertTrue(sent, "stalled")
            ended += self.client.received(sent)
            self.written()
        [call] = ended + self.client.received(self.server.trailers(stream_id))
        return call.outcome


class LostTests(ConnectionTest):
    def test_a_connection_never_made_loses_every_call(self) -> None:
        calls = [self.call(), self.call()]
        ended = self.client.lost("no connection", seen=False)
        self.assertEqual([call.outcome for call in ended], [Failed("no connection", lost=True)] * 2)
        self.assertEqual(ended, calls)
        self.assertEqual(self.client.ended, "no connection")

    def test_a_connection_lost_fails_calls_sent_and_loses_calls_never_sent(self) -> None:
        self.connect((Setting.MAX_CONCURRENT_STREAMS, 1))
        sent, waiting = self.call(), self.call()
        self.client.lost("gone")
        self.assertEqual((sent.outcome, waiting.outcome), (Failed("gone"), Failed("gone", lost=True)))
        self.assertFalse(self.client.accepting)
        self.assertEqual(self.client.received(self.server.answer(1, b"a")), [])


class HeaderBlockTests(SynchronousTestCase):
    """A block of indexed fields only is decoded once for as long as the server's table stays as it was."""

    def test_a_repeated_indexed_block_reads_the_same_and_a_table_change_is_never_missed(self) -> None:
        server, blocks = hpack.Encoder(), HeaderBlocks()
        first = server.encode([("grpc-status", "0")], huffman=True)  # a literal the table keeps
        self.assertEqual(blocks.decode(first), ((b"grpc-status", b"0"),))
        indexed = server.encode([("grpc-status", "0")], huffman=True)
        self.assertEqual(indexed, b"\xbe")  # dynamic entry 62
        self.assertEqual(blocks.decode(indexed), ((b"grpc-status", b"0"),))
        self.assertEqual(blocks.decode(indexed), ((b"grpc-status", b"0"),))
        # A new entry moves the first one to 63: the very same byte now names the new one.
        blocks.decode(server.encode([("grpc-message", "late")], huffman=True))
        self.assertEqual(blocks.decode(indexed), ((b"grpc-message", b"late"),))

    def test_a_block_leaves_the_table_unless_a_field_is_to_be_indexed_or_the_size_changes(self) -> None:
        self.assertTrue(leaves_table(b"\x88\xff\x81\x01\xbe"))  # indexed 8, 127 + 1 + 128, 62
        # grpcio's trailers once its table holds grpc-status: indexed, then a literal not indexed, named.
        self.assertTrue(leaves_table(bytes.fromhex("be000c677270632d6d65737361676500")))
        self.assertTrue(leaves_table(b"\x1f\x10\x01x"))  # never indexed, name index 31 (content-type)
        self.assertTrue(leaves_table(b"\x00\x7f\x01" + b"n" * 128 + b"\x00"))  # a 128-byte name
        self.assertFalse(leaves_table(b"\x88\x40\x01a\x01b"))  # a literal with incremental indexing
        self.assertFalse(leaves_table(b"\x3f\xe1\x1f"))  # a table size update

    def test_grpcios_answers_are_decoded_once_while_the_table_stays(self) -> None:
        blocks = HeaderBlocks()
        first = bytes.fromhex("88400c636f6e74656e742d74797065106170706c69636174696f6e2f67727063")
        trailers = bytes.fromhex("400b677270632d7374617475730130000c677270632d6d65737361676500")
        blocks.decode(first)
        blocks.decode(trailers)
        later = bytes.fromhex("be000c677270632d6d65737361676500")
        self.assertEqual(blocks.decode(later), ((b"grpc-status", b"0"), (b"grpc-message", b"")))
        self.assertIs(blocks.decode(later), blocks.decode(later))
