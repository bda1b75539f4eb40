"""The little HTTP the Docker proxy reads: request heads, chunked bodies, whole responses."""

from twisted.trial.unittest import SynchronousTestCase

from koordrp.docker.http import (
    MAX_CHUNK_LINE_BYTES,
    BodyTooLarge,
    ChunkedBody,
    HeadReader,
    HeadTooLarge,
    HTTPError,
    LengthBody,
    body_reader,
    json_response,
    parse_request_head,
    parse_response,
)

MESSAGE = b"4\r\nWiki\r\n6;ext=1;name=\"va;lue\"\r\npedia \r\nB \t; e\r\nin chunks.\n\r\n0\r\nTrailer: x\r\nMore: y\r\n\r\nNEXT"
BODY = b"Wikipedia in chunks.\n"


def fed(reader: LengthBody | ChunkedBody, parts: list[bytes]) -> list[bool]:
    return [reader.feed(part) for part in parts]


class RequestHeadTests(SynchronousTestCase):
    def test_parse_and_ask(self) -> None:
        head = parse_request_head(
            b"POST /v1.41/containers/create?name=k8s_POD_web_prod_u1_0 HTTP/1.1\r\n"
            b"Host: docker\r\nContent-Type: application/json\r\nContent-Length: 12\r\nConnection: keep-alive"
        )
        self.assertEqual((head.method, head.path, head.version), ("POST", "/v1.41/containers/create", "HTTP/1.1"))
        self.assertEqual(head.query("name"), "k8s_POD_web_prod_u1_0")
        self.assertEqual(head.header("content-length"), "12")
        self.assertEqual(head.content_length(), 12)
        self.assertFalse(head.upgrades)

    def test_serialize_asks_the_backend_to_close_unless_upgrading(self) -> None:
        head = parse_request_head(b"GET /info HTTP/1.1\r\nHost: docker\r\nConnection: keep-alive")
        self.assertEqual(head.serialize(), b"GET /info HTTP/1.1\r\nHost: docker\r\nConnection: close\r\n\r\n")
        upgrade = parse_request_head(
            b"POST /exec/1/start HTTP/1.1\r\nHost: docker\r\nConnection: Upgrade\r\nUpgrade: tcp"
        )
        self.assertEqual(
            upgrade.serialize(), b"POST /exec/1/start HTTP/1.1\r\nHost: docker\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n\r\n"
        )

    def test_serialize_a_rewritten_body_with_its_length(self) -> None:
        head = parse_request_head(b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\nHost: d")
        self.assertEqual(
            head.serialize(body_length=5), b"POST /x HTTP/1.1\r\nHost: d\r\nContent-Length: 5\r\nConnection: close\r\n\r\n"
        )

    def test_bad_heads(self) -> None:
        for raw in (b"GARBAGE", b"GET / HTTP/1.1\r\nno colon here", b"GET /  HTTP/1.1", b"GET / HTTP/1.1\r\n bad: x"):
            self.assertRaises(HTTPError, parse_request_head, raw)
        head = parse_request_head(b"POST / HTTP/1.1\r\nContent-Length: x1")
        self.assertRaises(HTTPError, head.content_length)


class HeadReaderTests(SynchronousTestCase):
    HEAD = b"POST /containers/create HTTP/1.1\r\nHost: docker\r\nContent-Length: 2"

    def test_a_head_split_anywhere_is_found_once_complete(self) -> None:
        message = self.HEAD + b"\r\n\r\n{}"
        for cut in range(1, len(message)):
            reader = HeadReader()
            first = reader.feed(message[:cut])
            if cut < len(self.HEAD) + 4:
                self.assertIsNone(first, cut)
                self.assertEqual(reader.feed(message[cut:]), (self.HEAD, b"{}"), cut)
            else:
                self.assertEqual(first, (self.HEAD, message[len(self.HEAD) + 4 : cut]), cut)

    def test_byte_by_byte(self) -> None:
        reader = HeadReader()
        results = [reader.feed(bytes([byte])) for byte in self.HEAD + b"\r\n\r\n"]
        self.assertEqual(results, [None] * (len(self.HEAD) + 3) + [(self.HEAD, b"")])

    def test_a_head_that_never_ends_is_refused_once_past_the_limit(self) -> None:
        reader = HeadReader(limit=100)
        self.assertIsNone(reader.feed(b"GET / HTTP/1.1\r\n" + b"X" * 80))
        error = self.assertRaises(HeadTooLarge, reader.feed, b"X" * 30)
        self.assertEqual(str(error), "request head larger than 100 bytes")

    def test_a_head_longer_than_the_limit_is_refused_even_when_it_arrives_whole(self) -> None:
        self.assertRaises(HeadTooLarge, HeadReader(limit=10).feed, b"GET /long/path HTTP/1.1\r\n\r\n")
        self.assertEqual(HeadReader(limit=14).feed(b"GET / HTTP/1.1\r\n\r\n"), (b"GET / HTTP/1.1", b""))


class ChunkedBodyTests(SynchronousTestCase):
    def test_extensions_trailers_and_what_follows(self) -> None:
        reader = ChunkedBody(1024)
        self.assertTrue(reader.feed(MESSAGE))
        self.assertEqual((reader.body, reader.rest), (BODY, b"NEXT"))

    def test_split_across_reads_anywhere(self) -> None:
        """Chunk sizes, extensions, data, line ends and trailers split at every point between two reads."""
        for cut in range(1, len(MESSAGE) - len(b"NEXT")):
            reader = ChunkedBody(1024)
            self.assertEqual(fed(reader, [MESSAGE[:cut], MESSAGE[cut:]]), [False, True], cut)
            self.assertEqual((reader.body, reader.rest), (BODY, b"NEXT"), cut)

    def test_byte_by_byte(self) -> None:
        reader = ChunkedBody(1024)
        self.assertEqual(fed(reader, [bytes([byte]) for byte in MESSAGE[:-4]]), [False] * (len(MESSAGE) - 5) + [True])
        self.assertEqual((reader.body, reader.rest), (BODY, b""))

    def test_a_chunk_size_split_across_reads_is_read_whole(self) -> None:
        reader = ChunkedBody(1024)
        self.assertEqual(fed(reader, [b"1", b"0\r", b"\n", b"x" * 16, b"\r\n0\r\n\r\n"]), [False] * 4 + [True])
        self.assertEqual(reader.body, b"x" * 16)

    def test_bare_line_feeds(self) -> None:
        reader = ChunkedBody(1024)
        self.assertTrue(reader.feed(b"3\nabc\n0\n\n"))
        self.assertEqual(reader.body, b"abc")

    def test_a_chunk_past_the_limit_is_refused_from_its_size_line(self) -> None:
        reader = ChunkedBody(1 << 20)
        self.assertFalse(reader.feed(b"100000\r\n" + b"x" * 100))  # exactly 1 MiB: taken
        error = self.assertRaises(BodyTooLarge, ChunkedBody(1 << 20).feed, b"2DC6C00\r\n")  # 48 MB, no data yet
        self.assertEqual(str(error), "body larger than 1 MiB")

    def test_chunks_count_together(self) -> None:
        reader = ChunkedBody(10)
        self.assertFalse(reader.feed(b"6\r\nabcdef\r\n"))
        self.assertRaises(BodyTooLarge, reader.feed, b"5\r\n")
        reader = ChunkedBody(10)
        self.assertTrue(reader.feed(b"6\r\nabcdef\r\n4\r\nghij\r\n0\r\n\r\n"))

    def test_a_chunk_line_that_never_ends(self) -> None:
        reader = ChunkedBody(1 << 20)
        self.assertFalse(reader.feed(b"5;" + b"e" * (MAX_CHUNK_LINE_BYTES - 2)))
        error = self.assertRaises(HTTPError, reader.feed, b"e")
        self.assertEqual(str(error), f"chunk size line longer than {MAX_CHUNK_LINE_BYTES} bytes")

    def test_trailers_that_never_end(self) -> None:
        reader = ChunkedBody(1 << 20)
        self.assertFalse(reader.feed(b"0\r\n"))
        self.assertRaises(HTTPError, fed, reader, [b"T: " + b"x" * 1000 + b"\r\n"] * 100)
        self.assertRaises(HTTPError, ChunkedBody(1024).feed, b"0\r\n" + b"T" * (MAX_CHUNK_LINE_BYTES + 1))

    def test_bad_chunk_sizes(self) -> None:
        for line in (b"zz", b"", b" ", b"0x10", b"+5", b"-1", b"1_0", b"1 0", b"1" * 17, b";ext"):
            self.assertRaises(HTTPError, ChunkedBody(1024).feed, line + b"\r\n")

    def test_data_longer_than_its_size(self) -> None:
        error = self.assertRaises(HTTPError, ChunkedBody(1024).feed, b"2\r\nabc\r\n0\r\n\r\n")
        self.assertEqual(str(error), "chunk data longer than its size says")


class BodyReaderTests(SynchronousTestCase):
    def test_content_length(self) -> None:
        head = parse_request_head(b"POST /x HTTP/1.1\r\nContent-Length: 5")
        reader = body_reader(head, 1024)
        assert isinstance(reader, LengthBody)
        self.assertEqual(fed(reader, [b"ab", b"cdeFOLLOWING"]), [False, True])
        self.assertEqual(reader.body, b"abcde")

    def test_no_body(self) -> None:
        reader = body_reader(parse_request_head(b"POST /x HTTP/1.1"), 1024)
        self.assertTrue(reader.feed(b""))
        self.assertEqual(reader.body, b"")

    def test_chunked_wins_over_content_length(self) -> None:
        head = parse_request_head(b"POST /x HTTP/1.1\r\nContent-Length: 5000\r\nTransfer-Encoding: chunked")
        self.assertIsInstance(body_reader(head, 1024), ChunkedBody)

    def test_a_content_length_past_the_limit_is_refused_at_once(self) -> None:
        head = parse_request_head(b"POST /x HTTP/1.1\r\nContent-Length: 48000000")
        error = self.assertRaises(BodyTooLarge, body_reader, head, 1 << 20)
        self.assertEqual(str(error), "body larger than 1 MiB")


class ResponseTests(SynchronousTestCase):
    def test_whole_responses(self) -> None:
        plain = parse_response(b'HTTP/1.1 201 Created\r\nContent-Type: application/json\r\n\r\n{"Id":"abc"}')
        self.assertEqual((plain.status, plain.json()), (201, {"Id": "abc"}))
        chunked = parse_response(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
        self.assertEqual((chunked.status, chunked.body), (200, b"{}"))
        self.assertRaises(HTTPError, parse_response, b"HTTP/1.1 200 OK\r\nContent-")
        self.assertRaises(HTTPError, parse_response, b"HTTP/1.1 OK\r\n\r\n")

    def test_errors_look_like_dockerds(self) -> None:
        response = parse_response(json_response(503, "Service Unavailable", "koordrp: backend away"))
        self.assertEqual((response.status, response.json()), (503, {"message": "koordrp: backend away"}))
