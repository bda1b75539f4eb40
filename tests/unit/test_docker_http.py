"""The little HTTP the Docker proxy reads: request heads, chunked bodies, whole responses."""

from twisted.trial.unittest import SynchronousTestCase

from koordrp.docker.http import HTTPError, dechunk, json_response, parse_request_head, parse_response


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


class BodyTests(SynchronousTestCase):
    def test_dechunk_waits_for_the_end(self) -> None:
        message = b"4\r\nWiki\r\n6;ext=1\r\npedia \r\n0\r\n\r\nNEXT"
        for cut in range(len(message) - 4):
            self.assertIsNone(dechunk(message[:cut]))
        self.assertEqual(dechunk(message), (b"Wikipedia ", b"NEXT"))

    def test_bad_chunk_size(self) -> None:
        self.assertRaises(HTTPError, dechunk, b"zz\r\nab\r\n")

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
