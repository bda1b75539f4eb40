"""A dockerd that answers as a test scripts it, on a real unix socket: one request per connection, as koordrp asks."""

import json
from dataclasses import dataclass, field
from typing import Any, Union

from twisted.internet.protocol import Factory, Protocol
from twisted.python.failure import Failure

from koordrp.docker.http import HEAD_END, parse_request_head

WEDGED = None
"""An answer that never comes."""


@dataclass
class Held:
    """An answer dockerd gives only when the test says so (``release``): a dockerd that takes its time."""

    response: bytes
    waiting: list["_Exchange"] = field(default_factory=list)

    def release(self) -> None:
        waiting, self.waiting = self.waiting, []
        for exchange in waiting:
            exchange.answer(self.response)


@dataclass(frozen=True)
class Endless:
    """An answer that begins with ``start`` and never ends: a stream (events, a followed log)."""

    start: bytes


Scripted = Union[bytes, Held, Endless, None]


def answer(status: int, document: object = None, reason: str = "Scripted") -> bytes:
    """An HTTP answer with ``document`` as its JSON body, the way dockerd writes them."""
    body = b"" if document is None else json.dumps(document).encode()
    head = f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


class _Exchange(Protocol):
    def __init__(self, dockerd: "ScriptedDockerd") -> None:
        self.dockerd = dockerd
        self.received = b""
        self.answered = False

    def dataReceived(self, data: bytes) -> None:
        self.received += data
        end = self.received.find(HEAD_END)
        if self.answered or end < 0:
            return
        head = parse_request_head(self.received[:end])
        if len(self.received) < end + len(HEAD_END) + (head.content_length() or 0):
            return
        self.answered = True
        self.dockerd.requests.append(self.received)
        response = self.dockerd.answer_for(f"{head.method} {head.path}")
        if isinstance(response, Held):
            response.waiting.append(self)
        elif isinstance(response, Endless):
            self.transport.write(response.start)  # type: ignore[union-attr]
        elif response is not WEDGED:
            self.answer(response)

    def answer(self, response: bytes) -> None:
        self.transport.write(response)  # type: ignore[union-attr]
        self.transport.loseConnection()  # type: ignore[union-attr]

    def connectionLost(self, reason: Failure = Failure(Exception())) -> None:
        self.dockerd.open -= 1


class ScriptedDockerd(Factory):
    """``answers`` maps "METHOD /path" prefixes (the API version stripped) to answers; the longest match wins."""

    def __init__(self, answers: dict[str, Scripted]) -> None:
        self.answers = answers
        self.requests: list[bytes] = []
        self.open = 0

    def buildProtocol(self, addr: Any) -> _Exchange:
        self.open += 1
        return _Exchange(self)

    def answer_for(self, request: str) -> Scripted:
        method, _, path = request.partition(" ")
        if path.startswith("/v1."):
            path = "/" + path.split("/", 2)[2]
        matches = [prefix for prefix in self.answers if f"{method} {path}".startswith(prefix)]
        if not matches:
            return answer(404, {"message": f"scripted dockerd has no answer for {method} {path}"}, "Not Found")
        return self.answers[max(matches, key=len)]

    def asked(self, request: str) -> list[bytes]:
        return [raw for raw in self.requests if raw.startswith(request.encode())]
