"""Calling one hook server: a reused grpc channel per endpoint, calls as Deferreds on the reactor."""

from functools import partial
from typing import Callable, Iterable

import grpc
from twisted.internet.defer import Deferred, fail
from twisted.internet.interfaces import IReactorFromThreads, IReactorTime

from koordrp.api.runtime.v1alpha1 import api_pb2_grpc
from koordrp.grpcdefer import failed_call, when_done
from koordrp.hooks.messages import HookRequest, HookResponse
from koordrp.hooks.types import HookType
from koordrp.text import shortened
from koordrp.unix import grpc_target, socket_problem

# Hook servers come and go with their plugins; reconnect quickly when one is back.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.enable_retries", 0),
    # grpc shares connections between channels to the same target, backoff included; a fresh
    # channel (see HookClient.call) must really start afresh.
    ("grpc.use_local_subchannel_pool", 1),
]


class HookCallError(Exception):
    """A hook call that did not produce an answer; the message says why, in one line."""

    timed_out = False

    def __init__(self, reason: str, sent_back: bool = False, lost: bool = False) -> None:
        super().__init__(reason)
        self.sent_back = sent_back
        """The server itself answered with this error: it is there, and it answers."""
        self.lost = lost
        """grpc could not reach the server: the channel waits out a backoff before it tries again."""


class HookTimedOut(HookCallError):
    timed_out = True


def no_answer_within(timeout: float) -> str:
    """Why a call timed out, in words (a budget left of a deadline is shown to three figures: 1.9s, not 1.89997s)."""
    return f"no answer within {timeout:.3g}s"


def _raise_timed_out(result: object, timeout: float) -> object:
    raise HookTimedOut(no_answer_within(timeout))


def _read(done: "grpc.Future[HookResponse]", timeout: float) -> "HookResponse | HookCallError":
    """The server's answer, or why there is none (read on grpc's thread)."""
    error = done.exception()
    if error is None:
        return done.result()
    call = failed_call(error)
    if call is None:
        return HookCallError(shortened(str(error)))
    code = call.code()
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return HookTimedOut(no_answer_within(timeout))
    # UNAVAILABLE is grpc's own word for a server it could not reach; any other code the server sent.
    sent_back = code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    return HookCallError(
        f"{code.name}: {shortened(call.details() or '')}", sent_back=sent_back, lost=code is grpc.StatusCode.UNAVAILABLE
    )


def _unwatched(_: grpc.ChannelConnectivity) -> None:
    pass


class HookClient:
    def __init__(self, endpoint: str, reactor: IReactorTime) -> None:
        """``reactor`` also provides IReactorFromThreads: grpc answers on its own threads."""
        self.endpoint = endpoint
        self._clock = reactor
        self._from_threads = IReactorFromThreads(reactor)
        self._connect()

    def _connect(self) -> None:
        self._channel = grpc.insecure_channel(grpc_target(self.endpoint), options=_CHANNEL_OPTIONS)
        self._stub = api_pb2_grpc.RuntimeHookServiceStub(self._channel)
        self._lost = False
        if socket_problem(self.endpoint) is None:
            # Connect now rather than in the first call, which has a deadline (containerd's, in NRI mode) to
            # keep. One attempt: subscribing with try_to_connect starts it, and grpc's watch of the channel
            # ends a moment after the unsubscribe, so a server that is not there costs nothing more.
            self._channel.subscribe(_unwatched, try_to_connect=True)
            self._channel.unsubscribe(_unwatched)

    def call(self, hook: HookType, request: HookRequest, timeout: float) -> "Deferred[HookResponse]":
        """Call ``hook`` with ``request``; fails with HookCallError, at the latest after ``timeout``."""
        # A missing socket would otherwise cost a connection attempt (and its backoff) per call.
        problem = socket_problem(self.endpoint)
        if problem is not None:
            return fail(HookCallError(problem))
        if self._lost:
            # A channel that lost its server waits out grpc's reconnect backoff before it tries
            # again; a plugin restarted meanwhile must get the very next call, so start afresh.
            self._channel.close()
            self._connect()
        future = getattr(self._stub, hook.rpc_name).future(request, timeout=timeout)
        answered: Deferred[HookResponse] = when_done(future, self._from_threads, partial(_read, timeout=timeout)).addCallback(
            self._answer
        )
        # The reactor's clock bounds the call too, so a hook that never answers cannot hold a CRI call.
        answered.addTimeout(timeout, self._clock, _raise_timed_out)
        return answered

    def _answer(self, read: "HookResponse | HookCallError") -> HookResponse:
        if isinstance(read, HookCallError):
            if read.lost:
                self._lost = True
            raise read
        return read

    def close(self) -> None:
        self._channel.close()


class HookClients:
    """One client per endpoint, reused across calls; closed when no registration names it."""

    def __init__(
        self, reactor: IReactorTime, make_client: Callable[[str, IReactorTime], HookClient] = HookClient
    ) -> None:
        self._reactor = reactor
        self._make_client = make_client
        self._clients: dict[str, HookClient] = {}

    def get(self, endpoint: str) -> HookClient:
        client = self._clients.get(endpoint)
        if client is None:
            client = self._clients[endpoint] = self._make_client(endpoint, self._reactor)
        return client

    def retain(self, endpoints: Iterable[str]) -> None:
        """The servers registered now: a new one's client is made (it connects) at once, others' are closed."""
        keep = set(endpoints)
        for endpoint in [e for e in self._clients if e not in keep]:
            self._clients.pop(endpoint).close()
        for endpoint in keep:
            self.get(endpoint)

    def close_all(self) -> None:
        self.retain(())
