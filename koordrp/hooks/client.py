"""Calling one hook server: a reused grpc channel per endpoint, calls as Deferreds on the reactor."""

from functools import partial
from typing import Callable, Iterable

import grpc
from twisted.internet.defer import Deferred, fail
from twisted.internet.interfaces import IReactorFromThreads, IReactorTime

from koordrp import trust
from koordrp.api.runtime.v1alpha1 import api_pb2_grpc
from koordrp.grpcdefer import failed_call, when_done
from koordrp.hooks.messages import HookRequest, HookResponse
from koordrp.hooks.types import HookType
from koordrp.text import shortened
from koordrp.unix import grpc_target, socket_identity, socket_problem

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
    idle: Callable[[], None] | None = None
    """Told each time the last of its calls ends (HookClients: a client no registration names is closed then)."""
    _calls = 0

    @property
    def busy(self) -> bool:
        """Calls are in flight on it."""
        return self._calls > 0

    def __init__(self, endpoint: str, reactor: IReactorTime) -> None:
        """``reactor`` also provides IReactorFromThreads: grpc answers on its own threads."""
        self.endpoint = endpoint
        self._clock = reactor
        self._from_threads = IReactorFromThreads(reactor)
        self._connect()

    def _connect(self, eagerly: bool = True) -> None:
        self._channel = grpc.insecure_channel(grpc_target(self.endpoint), options=_CHANNEL_OPTIONS)
        self._stub = api_pb2_grpc.RuntimeHookServiceStub(self._channel)
        self._lost = False
        self._trusted: trust.SocketIdentity | None = None
        """The socket last found trusted at the endpoint: a new channel, or another socket there, is looked at anew."""
        if eagerly and self.problem() is None:
            # Connect now rather than in the first call, which has a deadline (containerd's, in NRI mode) to
            # keep. One attempt: subscribing with try_to_connect starts it, and grpc's watch of the channel
            # ends a moment after the unsubscribe, so a server that is not there costs nothing more.
            self._channel.subscribe(_unwatched, try_to_connect=True)
            self._channel.unsubscribe(_unwatched)

    def call(self, hook: HookType, request: HookRequest, timeout: float) -> "Deferred[HookResponse]":
        """Call ``hook`` with ``request``; fails with HookCallError, at the latest after ``timeout``."""
        if self._lost:
            # A channel that lost its server waits out grpc's reconnect backoff before it tries
            # again; a plugin restarted meanwhile must get the very next call, so start afresh.
            self._channel.close()
            self._connect(eagerly=False)
        # A missing socket would otherwise cost a connection attempt (and its backoff) per call; one koordrp does
        # not trust is never called.
        problem = self.problem()
        if problem is not None:
            return self._counted(fail(HookCallError(problem)))  # counted too: it ends at once
        future = getattr(self._stub, hook.rpc_name).future(request, timeout=timeout)
        answered: Deferred[HookResponse] = when_done(future, self._from_threads, partial(_read, timeout=timeout)).addCallback(
            self._answer
        )
        # The reactor's clock bounds the call too, so a hook that never answers cannot hold a CRI call.
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
        swapped), or a new channel, has its path looked at again before anything is sent to it.
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
