"""Calling one hook server: one HTTP/2 connection per endpoint, kept, with calls as Deferreds on the reactor."""

from functools import partial
from typing import Callable, Iterable

from google.protobuf.message import DecodeError
from twisted.internet.defer import Deferred, fail
from twisted.internet.interfaces import IReactorTime, IReactorUNIX

from koordrp import trust
from koordrp.api.runtime.v1alpha1 import api_pb2
from koordrp.hooks.channel import HTTP2Channel
from koordrp.hooks.messages import HookRequest, HookResponse
from koordrp.hooks.types import HookType
from koordrp.http2 import DEADLINE_EXCEEDED, Answered, Failed, Outcome, StatusSent, grpc_timeout, request_headers
from koordrp.text import shortened
from koordrp.unix import socket_identity, socket_problem

MAX_ANSWER = 4 << 20
"""The largest answer read from a hook server: grpc's default receive limit, which koordrp's client had."""
_SERVICE = api_pb2.DESCRIPTOR.services_by_name["RuntimeHookService"]


def _prepared(hook: HookType) -> tuple[bytes, Callable[[bytes], HookResponse]]:
    """What every call of ``hook`` sends first (its header block, but for the timeout) and what reads its answer."""
    method = _SERVICE.methods_by_name[hook.rpc_name]
    answer: Callable[[bytes], HookResponse] = getattr(api_pb2, method.output_type.name).FromString
    return request_headers(f"/{_SERVICE.full_name}/{method.name}", "localhost", "koordrp"), answer


_PREPARED = {hook: _prepared(hook) for hook in HookType}


class HookCallError(Exception):
    """A hook call that did not produce an answer; the message says why, in one line."""

    timed_out = False

    def __init__(self, reason: str, sent_back: bool = False) -> None:
        super().__init__(reason)
        self.sent_back = sent_back
        """The server itself answered with this error: it is there, and it answers."""


class HookTimedOut(HookCallError):
    timed_out = True


def no_answer_within(timeout: float) -> str:
    """Why a call timed out, in words (a budget left of a deadline is shown to three figures: 1.9s, not 1.89997s)."""
    return f"no answer within {timeout:.3g}s"


def _raise_timed_out(result: object, timeout: float) -> object:
    raise HookTimedOut(no_answer_within(timeout))


def _read(outcome: Outcome, answer: Callable[[bytes], HookResponse], timeout: float, deadline: float, clock: IReactorTime) -> HookResponse:
    """The server's answer, or the HookCallError that says why there is none. Past ``deadline`` that is a timeout,
    however the server ended the call: grpc-go resets a stream whose grpc-timeout passed, with no status."""
    if isinstance(outcome, Answered):
        try:
            return answer(outcome.message)
        except DecodeError as error:
            raise HookCallError(f"INTERNAL: an answer that is no {answer.__qualname__.split('.')[0]}: {error}", sent_back=True) from None
    if isinstance(outcome, StatusSent):
        if outcome.code == DEADLINE_EXCEEDED:
            raise HookTimedOut(no_answer_within(timeout))
        raise HookCallError(f"{outcome.name}: {shortened(outcome.details)}", sent_back=True)
    assert isinstance(outcome, Failed)
    if clock.seconds() >= deadline:
        raise HookTimedOut(no_answer_within(timeout))
    # grpc's word for a server that never had the call, which operators know from koordrp's lines.
    raise HookCallError(f"UNAVAILABLE: {outcome.reason}" if outcome.lost else outcome.reason)


class HookClient:
    idle: Callable[[], None] | None = None
    """Told each time the last of its calls ends (HookClients: a client no registration names is closed then)."""
    _calls = 0

    @property
    def busy(self) -> bool:
        """Calls are in flight on it."""
        return self._calls > 0

    def __init__(self, endpoint: str, reactor: IReactorTime) -> None:
        """``reactor`` also provides IReactorUNIX: the connection is the reactor's."""
        self.endpoint = endpoint
        self._clock = reactor
        self._unix = IReactorUNIX(reactor)
        self._channel: HTTP2Channel | None = None
        self._channel_socket: trust.SocketIdentity | None = None
        self._trusted: trust.SocketIdentity | None = None
        """The socket last found trusted at the endpoint: another socket there is looked at anew."""
        if self.problem() is None:
            # Connect now rather than in the first call, which has a deadline (containerd's, in NRI mode) to keep.
            self._connected()

    def _connected(self) -> HTTP2Channel:
        """A channel that takes a new call, to the socket found trusted: the one there is, or a new one."""
        channel = self._channel
        if channel is not None and channel.accepting and self._channel_socket == self._trusted:
            return channel
        if channel is not None:
            # Its calls end on it; a server restarted, or another socket bound there, gets the next call at once.
            channel.close_when_idle()
        self._channel = channel = HTTP2Channel(self._unix, self.endpoint, MAX_ANSWER)
        self._channel_socket = self._trusted
        return channel

    def call(self, hook: HookType, request: HookRequest, timeout: float) -> "Deferred[HookResponse]":
        """Call ``hook`` with ``request``; fails with HookCallError, at the latest after ``timeout``."""
        # A missing socket would otherwise cost a connection attempt per call; one koordrp does not trust is never called.
        problem = self.problem()
        if problem is not None:
            return self._counted(fail(HookCallError(problem)))  # counted too: it ends at once
        headers, answer = _PREPARED[hook]
        sent: Deferred[Outcome] = self._connected().call(headers + grpc_timeout(timeout), request.SerializeToString())
        answered: Deferred[HookResponse] = sent.addCallback(_read, answer, timeout, self._clock.seconds() + timeout, self._clock)
        # The reactor's clock bounds the call too, so a hook that never answers cannot hold a CRI call; the
        # cancel it makes resets the stream, so the server hears of it.
        answered.addTimeout(timeout, self._clock, _raise_timed_out)
        return self._counted(answered)

    def _counted(self, answered: "Deferred[HookResponse]") -> "Deferred[HookResponse]":
        """``answered``, counted among the calls in flight until it fires."""
        self._calls += 1
        return answered.addBoth(self._ended)

    def _ended(self, result: object) -> object:
        self._calls -= 1
        if self._calls == 0 and self.idle is not None:
            self.idle()
        return result

    def problem(self) -> str | None:
        """Why the endpoint may not be called now: no socket there, or one koordrp does not trust (``koordrp.trust``).

        The socket found trusted last costs one stat; another one there (its server bound it anew, or it was
        swapped) has its path looked at again before anything is sent to it.
        """
        found = socket_identity(self.endpoint)
        if found is not None and found == self._trusted:
            return None
        problem = socket_problem(self.endpoint)
        if problem is not None:
            return problem
        judged = trust.socket_trust(self.endpoint)
        if judged.problem is not None:
            return judged.problem
        if judged.socket is None:  # gone or replaced between the two looks
            return socket_problem(self.endpoint) or f"socket {self.endpoint} changed while koordrp looked at it"
        self._trusted = judged.socket
        return None

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()


class HookClients:
    """One client per endpoint, reused across calls; closed when no registration names it."""

    def __init__(
        self, reactor: IReactorTime, make_client: Callable[[str, IReactorTime], HookClient] = HookClient
    ) -> None:
        self._reactor = reactor
        self._make_client = make_client
        self._clients: dict[str, HookClient] = {}
        self._registered: frozenset[str] | None = None
        """The endpoints the last ``retain`` named (None before it: every client is kept until then)."""

    def get(self, endpoint: str) -> HookClient:
        client = self._clients.get(endpoint)
        if client is None:
            client = self._clients[endpoint] = self._make_client(endpoint, self._reactor)
            if self._registered is not None and endpoint not in self._registered:
                # A stage that began while its registration was there still calls it (a call's later post
                # stages): kept in the dict, such a client was never closed. Its channel goes once its calls end.
                client.idle = partial(self._unregistered_idle, endpoint, client)
        return client

    def _unregistered_idle(self, endpoint: str, client: HookClient) -> None:
        if self._clients.get(endpoint) is client and self._registered is not None and endpoint not in self._registered:
            del self._clients[endpoint]
            client.close()

    def retain(self, endpoints: Iterable[str]) -> None:
        """The servers registered now: a new one's client is made (it connects) at once, others' are closed, each
        once its calls in flight end (a registration rewritten in place must not cut a call it began)."""
        keep = self._registered = frozenset(endpoints)
        for endpoint, client in [(e, c) for e, c in self._clients.items() if e not in keep]:
            if client.busy:
                client.idle = partial(self._unregistered_idle, endpoint, client)
            else:
                del self._clients[endpoint]
                client.close()
        for endpoint in keep:
            self.get(endpoint).idle = None

    def close_all(self) -> None:
        """koordrp stops (its post hooks drained or cut): every channel goes now."""
        self._registered = frozenset()
        for client in self._clients.values():
            client.close()
        self._clients.clear()
