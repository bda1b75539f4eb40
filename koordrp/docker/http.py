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


def dechunk(data: bytes) -> tuple[bytes, bytes] | None:
    """The body of a complete chunked message and what follows it, or None while it is incomplete."""
    body = bytearray()
    position = 0
    while True:
        line_end = data.find(b"\r\n", position)
        if line_end < 0:
            return None
        size_text = data[position:line_end].split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise HTTPError(f"bad chunk size {size_text[:20]!r}") from None
        position = line_end + 2
        if size == 0:
            trailer_end = data.find(b"\r\n\r\n", line_end)
            if trailer_end < 0:
                return None
            return bytes(body), data[trailer_end + 4 :]
        if len(data) < position + size + 2:
            return None
        body += data[position : position + size]
        position += size + 2
        if len(body) > MAX_BODY_BYTES:
            raise HTTPError("body larger than 1 MiB")


@dataclass
class Response:
    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def json(self) -> object:
        return json.loads(self.body) if self.body else None


def parse_response(raw: bytes) -> Response:
    """A whole response as read until the backend closed (it was asked to)."""
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
        whole = dechunk(body)
        if whole is None:
            raise HTTPError("chunked response ended early")
        body = whole[0]
    return Response(int(parts[1]), headers, body)


def json_response(status: int, reason: str, message: str) -> bytes:
    """An error the way dockerd writes them, so the docker CLI shows ``message`` as it would dockerd's."""
    body = json.dumps({"message": message}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body
