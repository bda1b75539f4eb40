"""Just enough HTTP/1.1 for a Docker API proxy: request heads, small whole responses, chunked bodies.

Everything koordrp does not intercept is spliced byte for byte after its request head, so only the
head (to route it and to ask the backend to close after answering) and the few small bodies of the
intercepted calls are ever parsed.
"""

import json
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

MAX_HEAD_BYTES = 64 * 1024
MAX_BODY_BYTES = 1024 * 1024
"""The most of an intercepted call's body koordrp reads (cri-dockerd's bodies are a few KB)."""
MAX_CHUNK_LINE_BYTES = 4096
"""The longest chunk size line (with its extensions) or trailer line, as Go's net/http allows."""
HEAD_END = b"\r\n\r\n"


class HTTPError(ValueError):
    """A message koordrp cannot read; the text is the reason, in one line."""


@dataclass
class RequestHead:
    method: str
    target: str
    version: str
    headers: list[tuple[str, str]] = field(default_factory=list)

    def header(self, name: str) -> str | None:
        wanted = name.lower()
        for key, value in self.headers:
            if key.lower() == wanted:
                return value
        return None

    @property
    def path(self) -> str:
        return urlsplit(self.target).path

    def query(self, name: str) -> str | None:
        values = parse_qs(urlsplit(self.target).query).get(name)
        return values[0] if values else None

    @property
    def upgrades(self) -> bool:
        return self.header("Upgrade") is not None

    @property
    def chunked(self) -> bool:
        return "chunked" in (self.header("Transfer-Encoding") or "").lower()

    def content_length(self) -> int | None:
        value = self.header("Content-Length")
        if value is None:
            return None
        if not value.strip().isdigit():
            raise HTTPError(f"bad Content-Length {value!r}")
        return int(value)

    def serialize(self, body_length: int | None = None, close: bool = True) -> bytes:
        """The head to send upstream: the backend is asked to close after answering, unless the
        client asks to upgrade the connection (attach, exec), and a rewritten body gets its length."""
        drop = {"content-length", "transfer-encoding"} if body_length is not None else set()
        if close and not self.upgrades:
            drop |= {"connection", "keep-alive"}
        lines = [f"{self.method} {self.target} {self.version}"]
        lines += [f"{key}: {value}" for key, value in self.headers if key.lower() not in drop]
        if body_length is not None:
            lines.append(f"Content-Length: {body_length}")
        if close and not self.upgrades:
            lines.append("Connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def parse_request_head(data: bytes) -> RequestHead:
    """``data`` is everything before the blank line that ends the head."""
    try:
        text = data.decode("latin-1")
    except UnicodeDecodeError as error:  # latin-1 decodes every byte; kept for clarity of intent
        raise HTTPError(str(error)) from None
    request_line, *header_lines = text.split("\r\n")
    parts = request_line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        raise HTTPError(f"bad request line {request_line[:80]!r}")
    head = RequestHead(parts[0], parts[1], parts[2])
    for line in header_lines:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            raise HTTPError(f"bad header line {line[:80]!r}")
        head.headers.append((name, value.strip()))
    return head


class HeadTooLarge(HTTPError):
    """A request head longer than MAX_HEAD_BYTES."""


class BodyTooLarge(HTTPError):
    """A body longer than koordrp reads whole: told as soon as the length is known, before it arrives."""


def in_units(limit: int) -> str:
    """``limit`` bytes in words for a message: "1 MiB", "64 KiB"."""
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if limit >= 1 << shift:
            return f"{limit / (1 << shift):g} {unit}"
    return f"{limit} bytes"


class HeadReader:
    """A request head as it arrives: everything up to the blank line, never more than MAX_HEAD_BYTES of it.

    Each byte is looked at once, however the head is split across reads.
    """

    def __init__(self, limit: int = MAX_HEAD_BYTES) -> None:
        self._limit = limit
        self._buffer = bytearray()

    def feed(self, data: bytes) -> tuple[bytes, bytes] | None:
        """The head (without its blank line) and the bytes after it, once the head is complete.

        HeadTooLarge as soon as more than the limit has arrived without the head ending.
        """
        searched = max(0, len(self._buffer) - len(HEAD_END) + 1)
        self._buffer += data
        end = self._buffer.find(HEAD_END, searched)
        if end < 0 or end > self._limit:
            if len(self._buffer) > self._limit + len(HEAD_END):
                raise HeadTooLarge(f"request head larger than {in_units(self._limit)}")
            return None
        head, rest = bytes(self._buffer[:end]), bytes(self._buffer[end + len(HEAD_END) :])
        self._buffer = bytearray()
        return head, rest


class LengthBody:
    """A body of a known length, as it arrives."""

    def __init__(self, length: int) -> None:
        self._length = length
        self._body = bytearray()

    def feed(self, data: bytes) -> bool:
        """Take the next bytes; True once the body is complete (what follows it is not kept)."""
        self._body += memoryview(data)[: self._length - len(self._body)]
        return len(self._body) == self._length

    @property
    def body(self) -> bytes:
        return bytes(self._body)


_SIZE, _DATA, _DATA_END, _TRAILER, _DONE = range(5)


class ChunkedBody:
    """A chunked body (RFC 9112 section 7.1) decoded as it arrives, in time linear in its length.

    It holds the decoded body and at most one unfinished line, of MAX_CHUNK_LINE_BYTES; a chunk that
    would take the body past ``limit`` is refused (BodyTooLarge) from its size line, before its
    data arrives. Extensions are skipped and trailers read and dropped (the Docker API uses neither);
    lines may end in a bare LF, as Go's readers accept.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._body = bytearray()
        self._line = bytearray()
        self._state = _SIZE
        self._left = 0
        self._trailer_bytes = 0
        self.rest = b""
        """What followed the body in the last bytes fed, once it is complete."""

    @property
    def body(self) -> bytes:
        return bytes(self._body)

    def feed(self, data: bytes) -> bool:
        """Take the next bytes; True once the body is complete. HTTPError: not a chunked body."""
        view = memoryview(data)
        position = 0
        while position < len(view) and self._state != _DONE:
            if self._state == _DATA:
                taken = min(self._left, len(view) - position)
                self._body += view[position : position + taken]
                position += taken
                self._left -= taken
                if self._left == 0:
                    self._state = _DATA_END
                continue
            line_end = data.find(b"\n", position)
            if line_end < 0:
                self._add_to_line(view[position:])
                break
            self._add_to_line(view[position:line_end])
            position = line_end + 1
            line = bytes(self._line).removesuffix(b"\r")
            self._line.clear()
            self._end_of_line(line)
        if self._state == _DONE:
            self.rest = bytes(view[position:])
            return True
        return False

    def _add_to_line(self, part: memoryview) -> None:
        self._line += part
        if len(self._line) > MAX_CHUNK_LINE_BYTES:
            what = "chunk size line" if self._state == _SIZE else "chunk data's end" if self._state == _DATA_END else "trailer line"
            raise HTTPError(f"{what} longer than {MAX_CHUNK_LINE_BYTES} bytes")

    def _end_of_line(self, line: bytes) -> None:
        if self._state == _DATA_END:
            if line:
                raise HTTPError("chunk data longer than its size says")
            self._state = _SIZE
        elif self._state == _SIZE:
            size = _chunk_size(line)
            if size == 0:
                self._state = _TRAILER
            elif len(self._body) + size > self._limit:
                raise BodyTooLarge(f"body larger than {in_units(self._limit)}")
            else:
                self._left = size
                self._state = _DATA
        elif not line:
            self._state = _DONE
        else:
            self._trailer_bytes += len(line)
            if self._trailer_bytes > MAX_HEAD_BYTES:
                raise HTTPError(f"trailers larger than {in_units(MAX_HEAD_BYTES)}")


def _chunk_size(line: bytes) -> int:
    """The size a chunk size line gives (hexadecimal; chunk extensions after ``;`` are ignored)."""
    text = line.split(b";", 1)[0].strip(b" \t")
    if not text or len(text) > 16 or text.strip(b"0123456789abcdefABCDEF"):
        raise HTTPError(f"bad chunk size {line[:20]!r}")
    return int(text, 16)


def body_reader(head: RequestHead, limit: int) -> LengthBody | ChunkedBody:
    """How to read ``head``'s body, never more than ``limit`` bytes of it (BodyTooLarge at once if it says more)."""
    if head.chunked:
        return ChunkedBody(limit)
    length = head.content_length() or 0
    if length > limit:
        raise BodyTooLarge(f"body larger than {in_units(limit)}")
    return LengthBody(length)


@dataclass
class Response:
    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def json(self) -> object:
        return json.loads(self.body) if self.body else None


def parse_response(raw: bytes) -> Response:
    """A whole response as read until the backend closed (it was asked to); what was read bounds it."""
    head_end = raw.find(HEAD_END)
    if head_end < 0:
        raise HTTPError("response ended inside its head")
    status_line, *header_lines = raw[:head_end].decode("latin-1").split("\r\n")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[1].isdigit():
        raise HTTPError(f"bad status line {status_line[:80]!r}")
    headers = [(name, value.strip()) for name, _, value in (line.partition(":") for line in header_lines)]
    body = raw[head_end + 4 :]
    if any(name.lower() == "transfer-encoding" and "chunked" in value.lower() for name, value in headers):
        chunked = ChunkedBody(len(body))
        if not chunked.feed(body):
            raise HTTPError("chunked response ended early")
        body = chunked.body
    return Response(int(parts[1]), headers, body)


def json_response(status: int, reason: str, message: str) -> bytes:
    """An error the way dockerd writes them, so the docker CLI shows ``message`` as it would dockerd's."""
    body = json.dumps({"message": message}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body
