"""A minimal, stdlib-only WebSocket client for CRI streaming (Exec/Attach) URLs.

containerd's streaming server speaks Kubernetes' remotecommand protocol over
WebSocket: every binary message starts with one channel byte (0 stdin,
1 stdout, 2 stderr, 3 error/status, 4 resize) followed by that channel's data.
With ``v4.channel.k8s.io`` the error channel carries a JSON metav1.Status that
also reports the exit code; with plain ``channel.k8s.io`` it is free text.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

# Offered together in one header; the server picks the first it supports,
# which is how the fallback from v4 to the original protocol happens.
DEFAULT_PROTOCOLS: tuple[str, ...] = ("v4.channel.k8s.io", "channel.k8s.io")

STDIN, STDOUT, STDERR, ERROR, RESIZE = range(5)

OP_CONTINUATION, OP_TEXT, OP_BINARY = 0x0, 0x1, 0x2
OP_CLOSE, OP_PING, OP_PONG = 0x8, 0x9, 0xA

_WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
_MAX_HEADER_BYTES = 64 * 1024


class StreamError(RuntimeError):
    """The handshake or the framing went wrong, or the deadline passed."""


@dataclass(frozen=True)
class StreamResult:
    protocol: str
    stdout: bytes = b""
    stderr: bytes = b""
    error: bytes = b""  # raw error-channel bytes
    status: dict[str, Any] | None = field(default=None)  # parsed v4 Status

    @property
    def exit_code(self) -> int | None:
        """0 on Success, the reported code on NonZeroExitCode, else None."""
        if self.status is None:
            return None
        if self.status.get("status") == "Success":
            return 0
        for cause in (self.status.get("details") or {}).get("causes") or []:
            if cause.get("reason") == "ExitCode":
                try:
                    return int(cause.get("message", ""))
                except ValueError:
                    return None
        return None


class _Connection:
    """A client WebSocket over one TCP socket, bounded by an absolute deadline."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline
        self._buffer = b""

    def _recv_some(self) -> bytes:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise StreamError("timed out waiting for the stream")
        self._sock.settimeout(remaining)
        try:
            return self._sock.recv(65536)
        except TimeoutError as exc:
            raise StreamError("timed out waiting for the stream") from exc

    def read_until(self, marker: bytes) -> bytes:
        while marker not in self._buffer:
            if len(self._buffer) > _MAX_HEADER_BYTES:
                raise StreamError("HTTP response header too large")
            chunk = self._recv_some()
            if not chunk:
                raise StreamError(f"connection closed during handshake: {self._buffer[:200]!r}")
            self._buffer += chunk
        head, _, self._buffer = self._buffer.partition(marker)
        return head

    def read_exact(self, size: int) -> bytes | None:
        """Return `size` bytes, or None if the peer closed cleanly first."""
        while len(self._buffer) < size:
            chunk = self._recv_some()
            if not chunk:
                if self._buffer:
                    raise StreamError("connection closed in the middle of a frame")
                return None
            self._buffer += chunk
        data, self._buffer = self._buffer[:size], self._buffer[size:]
        return data

    def read_frame(self) -> tuple[bool, int, bytes] | None:
        """Return (fin, opcode, payload), or None on a clean TCP close."""
        head = self.read_exact(2)
        if head is None:
            return None
        fin, opcode = bool(head[0] & 0x80), head[0] & 0x0F
        masked, length = bool(head[1] & 0x80), head[1] & 0x7F
        if length == 126:
            length = struct.unpack("!H", self._must_read(2))[0]
        elif length == 127:
            length = struct.unpack("!Q", self._must_read(8))[0]
        # Servers must not mask, but unmasking costs nothing if one does.
        mask = self._must_read(4) if masked else b""
        payload = self._must_read(length) if length else b""
        if masked:
            payload = _apply_mask(payload, mask)
        return fin, opcode, payload

    def _must_read(self, size: int) -> bytes:
        data = self.read_exact(size)
        if data is None:
            raise StreamError("connection closed in the middle of a frame")
        return data

    def send_frame(self, opcode: int, payload: bytes) -> None:
        self._sock.settimeout(max(self._deadline - time.monotonic(), 0.001))
        self._sock.sendall(encode_client_frame(opcode, payload))


def _apply_mask(data: bytes, mask: bytes) -> bytes:
    # XOR through big integers: far faster than a per-byte Python loop.
    repeated = (mask * (len(data) // 4 + 1))[: len(data)]
    return (int.from_bytes(data, "big") ^ int.from_bytes(repeated, "big")).to_bytes(len(data), "big")


def encode_client_frame(opcode: int, payload: bytes) -> bytes:
    """One final frame, masked as RFC 6455 requires of every client frame."""
    header = bytes([0x80 | opcode])
    size = len(payload)
    if size < 126:
        header += bytes([0x80 | size])
    elif size < 1 << 16:
        header += bytes([0x80 | 126]) + struct.pack("!H", size)
    else:
        header += bytes([0x80 | 127]) + struct.pack("!Q", size)
    mask = os.urandom(4)
    return header + mask + _apply_mask(payload, mask)


def _accept_key(key: str) -> str:
    return base64.b64encode(hashlib.sha1(key.encode() + _WS_GUID).digest()).decode()


def _handshake(conn: _Connection, sock: socket.socket, url: str, protocols: Sequence[str]) -> str:
    """Upgrade to WebSocket; return the subprotocol the server chose."""
    parts = urlsplit(url)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    key = base64.b64encode(os.urandom(16)).decode()
    request = (
        f"GET {path} HTTP/1.1\r\n"
        f"Host: {parts.netloc}\r\n"
        "Upgrade: websocket\r\n"
        "Connection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\n"
        "Sec-WebSocket-Version: 13\r\n"
        f"Sec-WebSocket-Protocol: {', '.join(protocols)}\r\n"
        f"Origin: http://{parts.netloc}\r\n"
        "\r\n"
    )
    sock.sendall(request.encode())
    status_line, *header_lines = conn.read_until(b"\r\n\r\n").decode("iso-8859-1").split("\r\n")
    if status_line.split(" ", 2)[1:2] != ["101"]:
        raise StreamError(f"WebSocket upgrade refused by {url}: {status_line!r}")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("sec-websocket-accept") != _accept_key(key):
        raise StreamError("server answered with a wrong Sec-WebSocket-Accept")
    chosen = headers.get("sec-websocket-protocol", "")
    # An old server may stay silent about the protocol; it then speaks the original one.
    return chosen or "channel.k8s.io"


def stream(
    url: str,
    *,
    stdin: bytes | None = None,
    timeout: float = 10.0,
    protocols: Sequence[str] = DEFAULT_PROTOCOLS,
) -> StreamResult:
    """Connect to a CRI streaming URL, collect output until the server closes.

    `stdin` is sent once as a single message; the v4 protocol has no way to
    signal end of input, so commands that read stdin to EOF will not finish.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "ws") or parts.hostname is None:
        raise StreamError(f"unsupported streaming URL: {url!r}")
    deadline = time.monotonic() + timeout
    with socket.create_connection((parts.hostname, parts.port or 80), timeout=timeout) as sock:
        conn = _Connection(sock, deadline)
        protocol = _handshake(conn, sock, url, protocols)
        if stdin is not None:
            conn.send_frame(OP_BINARY, bytes([STDIN]) + stdin)
        channels = _read_channels(conn)
    status = None
    if protocol.startswith("v4.") and channels[ERROR]:
        try:
            status = json.loads(channels[ERROR])
        except ValueError:
            status = None
    return StreamResult(
        protocol=protocol,
        stdout=channels[STDOUT],
        stderr=channels[STDERR],
        error=channels[ERROR],
        status=status,
    )


def _read_channels(conn: _Connection) -> dict[int, bytes]:
    """Demultiplex messages by channel byte until close or EOF."""
    channels = {ch: b"" for ch in range(5)}
    message = b""
    while True:
        frame = conn.read_frame()
        if frame is None:
            return channels
        fin, opcode, payload = frame
        if opcode == OP_CLOSE:
            try:
                conn.send_frame(OP_CLOSE, payload[:2])
            except OSError:
                pass  # the server may already have hung up; we are done anyway
            return channels
        if opcode == OP_PING:
            conn.send_frame(OP_PONG, payload)
            continue
        if opcode == OP_PONG:
            continue
        message += payload
        if not fin:
            continue
        # The server opens with an empty message on the first output channel
        # to say it is ready; it carries a channel byte and nothing else.
        if message:
            channel, data = message[0], message[1:]
            channels[channel] = channels.get(channel, b"") + data
        message = b""
