"""The lifecycle calls in CRI mode: kubelet's requests parsed and run through ``koordrp.flows`` on the reactor.

A handler runs on a grpc worker thread: it parses kubelet's bytes, hands the flow (``Call``) to the
reactor, and waits for its outcome, which it turns into the grpc answer (``answer``: the one place an
outcome becomes a grpc answer). A call its flow would forward as it came, hook-free
(``flows.goes_ahead``), is sent to the runtime by the worker itself first, and the flow's forward is
answered by that call. The runtime's answer reaches the worker from grpc's thread (``_Exchange``).
What the worker hands the reactor (a flow that went ahead, the runtime's answer) is queued without
waking it (``fastpaths.FastPaths.unwoken``): grpc reports the RPC's end once the worker has answered,
and the reactor is woken for all of it, in order, a moment later (``handoff.Later``), or sooner by
what comes next (kubelet's next call's flow runs after it); with the fast paths off, each wakes the
reactor as it comes. Hook calls, the runtime's call and read-backs are Deferreds on the reactor. When
grpc says the RPC has ended (answered, cancelled by kubelet, or past its deadline), the reactor hears
of it once: a flow still waiting for the runtime is cancelled, which cancels what it waits for
upstream (a call sent ahead included), and the call's end (post stages, log line, metrics) follows.
"""

import threading
from dataclasses import dataclass
from enum import Enum
from typing import Any, Awaitable, Callable, Coroutine, Generic, NoReturn, Protocol, TypeVar

import grpc
from google.protobuf.message import DecodeError
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorFromThreads, IReactorTime

from koordrp import adapters, fastpaths, flows
from koordrp.call import Call, Parts
from koordrp.fastpaths import Enqueue, FastPaths
from koordrp.api.cri.v1 import api_pb2 as cri
from koordrp.cri import translate
from koordrp.cri.backend import Answer, BackendChannel, Metadata, call_unary
from koordrp.cri.passthrough import relay_status, remaining_timeout
from koordrp.cri.runtime_lookup import RuntimeLookup
from koordrp.store import StoredContainer, StoredPod

RUNTIME_SERVICE = "/runtime.v1.RuntimeService/"

# Beyond the caller's deadline: the reactor may be busy for a moment. Past it the worker stops
# waiting for a reactor that is no longer running.
_SLACK_SECONDS = 1.0

Request = TypeVar("Request")
Flow = Coroutine[Any, Any, "CRIReply"]


@dataclass(frozen=True)
class CRIReply:
    """The runtime's answer to a forwarded call (``adapters.Reply``)."""

    answer: Answer
    created_id: str = ""

    @property
    def ok(self) -> bool:
        return self.answer.ok

    @property
    def label(self) -> str:
        return self.answer.code.name


@dataclass(frozen=True)
class _Method(Generic[Request]):
    """How one lifecycle method is read and which flow it takes."""

    parse: Callable[[bytes], Request]
    flow: Callable[["Call[CRIReply]", Request], Flow]
    created_id: Callable[[bytes], str] | None = None
    subject: Callable[[Request], str] | None = None
    """The id of the pod or container the request is about, where the call may go ahead (``flows.goes_ahead``)."""


def _sandbox_id(raw: bytes) -> str:
    return cri.RunPodSandboxResponse.FromString(raw).pod_sandbox_id


def _container_id(raw: bytes) -> str:
    return cri.CreateContainerResponse.FromString(raw).container_id


class _AboutContainer(Protocol):
    @property
    def container_id(self) -> str: ...


class _AboutPod(Protocol):
    @property
    def pod_sandbox_id(self) -> str: ...


def _container_of(request: _AboutContainer) -> str:
    return request.container_id


def _pod_of(request: _AboutPod) -> str:
    return request.pod_sandbox_id


# Each method reads its own request type: a table of them can only say Any.
_METHODS: dict[str, _Method[Any]] = {
    "RunPodSandbox": _Method(
        cri.RunPodSandboxRequest.FromString,
        lambda call, request: flows.run_pod_sandbox(call, translate.RunPodSandbox(request)),
        _sandbox_id,
    ),
    "CreateContainer": _Method(
        cri.CreateContainerRequest.FromString,
        lambda call, request: flows.create_container(call, translate.CreateContainer(request)),
        _container_id,
    ),
    "StartContainer": _Method(
        cri.StartContainerRequest.FromString,
        lambda call, request: flows.start_container(call, request.container_id),
        subject=_container_of,
    ),
    "UpdateContainerResources": _Method(
        cri.UpdateContainerResourcesRequest.FromString,
        lambda call, request: flows.update_container_resources(call, translate.UpdateContainerResources(request)),
        subject=_container_of,
    ),
    "StopContainer": _Method(
        cri.StopContainerRequest.FromString,
        lambda call, request: flows.stop_container(call, request.container_id),
        subject=_container_of,
    ),
    "StopPodSandbox": _Method(
        cri.StopPodSandboxRequest.FromString,
        lambda call, request: flows.stop_pod_sandbox(call, request.pod_sandbox_id),
        subject=_pod_of,
    ),
    "RemoveContainer": _Method(
        cri.RemoveContainerRequest.FromString,
        lambda call, request: flows.remove_container(call, request.container_id),
        subject=_container_of,
    ),
    "RemovePodSandbox": _Method(
        cri.RemovePodSandboxRequest.FromString,
        lambda call, request: flows.remove_pod_sandbox(call, request.pod_sandbox_id),
        subject=_pod_of,
    ),
    "UpdatePodSandboxResources": _Method(
        cri.UpdatePodSandboxResourcesRequest.FromString,
        lambda call, request: flows.update_pod_sandbox_resources(call, translate.UpdatePodSandboxResources(request)),
        subject=_pod_of,
    ),
}


class _State(Enum):
    """Where one call's exchange between its worker, grpc's threads and the reactor is (``_Exchange``).

    Three things decide it: whether an outcome is offered and whose (the flow's, or the runtime's answer to
    the forward), whether the worker has stopped waiting (with the outcome, or without), and whether grpc
    has said the RPC is over. A state named ``..._OVER`` is its namesake once grpc has said so.
    """

    WAITING = "the worker waits; nothing is offered"
    WAITING_OVER = "the worker waits; nothing is offered; the RPC is over (the caller gone, its deadline past)"
    FLOWS = "the flow's outcome is offered; the worker has not taken it yet"
    FLOWS_OVER = "the flow's outcome is offered; the worker has not taken it yet; the RPC is over"
    RUNTIMES = "the runtime's answer is offered; the worker has not taken it, nor handed it to the reactor, yet"
    RUNTIMES_OVER = "the runtime's answer is offered; the worker has not taken it yet; the RPC is over"
    DECIDED = "the worker took the flow's outcome, or stopped waiting without one"
    DECIDED_OVER = "the worker took the flow's outcome, or stopped waiting without one; the RPC is over"
    ANSWERED = "the worker took the runtime's answer and handed it to the reactor"
    ANSWERED_OVER = "the worker took the runtime's answer and handed it to the reactor; the RPC is over"

    # Enum hashes a member by its name, in Python; a member's identity says as much, at C's speed, and every
    # event of every call looks one up.
    __hash__ = object.__hash__


class _Event(Enum):
    """What happens to an exchange, each at most once, from the thread it names, in any order."""

    OFFERED = "the reactor: the flow has its outcome"
    ANSWERED = "grpc's thread: the runtime answered the forward"
    WORKER_DONE = "the worker: it has its outcome, or stopped waiting for one"
    RPC_OVER = "grpc's thread: the RPC is over (answered, cancelled, past its deadline)"

    __hash__ = object.__hash__  # as _State's


class _Exchange:
    """One intercepted call between its grpc worker, grpc's threads and the reactor: a state machine
    (``_State``, ``_Event``, the one table ``_TRANSITIONS``).

    The worker waits for the call's outcome, which comes from the reactor (the flow's outcome) or,
    sooner, from grpc's thread as the runtime answers the forward (``Call.forward``: that answer is
    the caller's), whichever is first. The worker queues the runtime's answer for the reactor before
    it answers the caller, so that the flow's bookkeeping runs before kubelet's next call, without
    waking the reactor. grpc reports the RPC's end once the worker has answered: it is queued after
    the answer, and the reactor is woken for all of the call's part a moment later (``later``), when
    kubelet has had the time to take its answer. (An end reported before, the caller gone or its
    deadline past, wakes the reactor at once, to give up what the flow waits for: a runtime's answer
    that comes after is handed over with a wake.)

    Two locks. ``_lock`` is held through each transition and its action, from whichever thread the
    event comes: the state, the outcome, what the worker is to hand the reactor and when it had its
    outcome change only under it, and what a transition hands the reactor reaches the reactor's
    queue in the order of the transitions. ``_known`` is no mutex but the worker's signal: held from
    the start, released once, by the transition that offers the worker its outcome. The call and
    whether the RPC ended before the flow started are the reactor's alone.
    """

    def __init__(self, reactor: IReactorFromThreads, unwoken: Enqueue, later: Enqueue, clock: IReactorTime) -> None:
        self._reactor = reactor
        self._unwoken = unwoken
        self._later = later
        self._clock = clock
        self._lock = threading.Lock()
        self._state = _State.WAITING
        self.outcome: adapters.Outcome[CRIReply] = adapters.CALLER_GONE
        """The worker's outcome, once it is done waiting."""
        self._settle: Callable[[], None] | None = None
        """What gives the flow the runtime's answer on the reactor, while the worker has it to hand over."""
        self._decided_at: float | None = None
        """When the worker had its outcome: where the call's duration ends (its flow may have it later)."""
        # Held until the outcome is known: the cheapest hand-off to a waiting thread.
        self._known = threading.Lock()
        self._known.acquire()
        self._call: _Driven | None = None
        self._rpc_over = False

    def _step(
        self,
        event: _Event,
        outcome: "adapters.Outcome[CRIReply] | None" = None,
        settle: Callable[[], None] | None = None,
    ) -> _State:
        """``event`` happened, with what it brings: the state it found, once its transition and action are done."""
        with self._lock:
            found = self._state
            try:
                self._state, action = _TRANSITIONS[found, event]
            except KeyError:
                raise RuntimeError(f"{event.name} cannot happen in {found.name}: {found.value}") from None
            action(self, outcome, settle)
        return found

    def start(self, call: "_Driven", flow: Flow) -> None:
        """On the reactor: the flow runs; its outcome is handed to the waiting worker."""
        self._call = call
        call.run(flow).addCallback(self.offer)
        if self._rpc_over:  # grpc said so before the flow could start
            self.rpc_ended()

    def offer(self, outcome: "adapters.Outcome[CRIReply]") -> None:
        """From the reactor: the first outcome offered is the worker's."""
        self._step(_Event.OFFERED, outcome)

    def runtime_answered(self, answer: Answer, settle: Callable[[], None]) -> None:
        """On grpc's thread: the runtime answered the forward; ``settle`` gives the flow the answer, on the reactor.

        A waiting worker takes the answer and queues ``settle`` as it goes on; once the worker has its
        outcome (or stopped waiting), ``settle`` goes to the reactor from here.
        """
        self._step(_Event.ANSWERED, CRIReply(answer), settle)

    def wait(self, timeout: float | None) -> bool:
        """In the worker: whether the outcome came within ``timeout`` seconds (None: however long it takes).

        The runtime's answer, if it is the outcome, is queued for the reactor on the way out, before an end
        reported from then on can be.
        """
        self._known.acquire(timeout=-1 if timeout is None else timeout)
        return self._step(_Event.WORKER_DONE) in _OFFERED

    def end_reported(self) -> None:
        """On grpc's thread, once the RPC is over (answered, cancelled, past its deadline): the reactor hears of it
        (``rpc_ended``), after what was queued for it. A moment later once the worker has its outcome, since nothing
        in the call's end is kubelet's business then; at once before, since the flow must give up what it waits for.
        """
        self._step(_Event.RPC_OVER)

    def rpc_ended(self) -> None:
        """On the reactor, once grpc says the RPC is over: an unfinished flow is given up, then the call ends.

        Unless the runtime has answered it: its answer is the caller's and is on its way to the flow, which
        finishes with it (a caller that went just then did not take it, but the runtime did the call).
        """
        call = self._call
        if call is None:
            self._rpc_over = True
            return
        with self._lock:
            answered, decided_at = self._state in _RUNTIME_ANSWERED, self._decided_at
        if not answered:
            call.cancel()  # the outcome is known from here on
        call.ended(decided_at)

    # The actions of the transitions, under the lock, with what the event brought.

    def _nothing(self, outcome: "adapters.Outcome[CRIReply] | None", settle: Callable[[], None] | None) -> None:
        """Nothing to hand anyone: an outcome after the worker's, or a worker that stopped waiting without one (its
        caller hears that koordrp did not finish in time)."""

    def _to_worker(self, outcome: "adapters.Outcome[CRIReply] | None", settle: Callable[[], None] | None) -> None:
        """The worker's outcome: it wakes for it (with the runtime's answer, what to hand the reactor)."""
        assert outcome is not None
        self.outcome, self._settle = outcome, settle
        self._known.release()

    def _settle_now(self, outcome: "adapters.Outcome[CRIReply] | None", settle: Callable[[], None] | None) -> None:
        """The runtime's answer after the worker's outcome was decided: the reactor is woken for the flow's sake."""
        assert settle is not None
        self._reactor.callFromThread(settle)

    def _taken(self, outcome: "adapters.Outcome[CRIReply] | None", settle: Callable[[], None] | None) -> None:
        """The worker has its outcome: the call's duration ends here."""
        self._decided_at = self._clock.seconds()

    def _taken_queued(self, outcome: "adapters.Outcome[CRIReply] | None", settle: Callable[[], None] | None) -> None:
        """The worker has the runtime's answer, and queues it for the reactor unwoken: the RPC's end will wake it."""
        self._taken(outcome, settle)
        self._hand_over(self._unwoken)

    def _taken_woken(self, outcome: "adapters.Outcome[CRIReply] | None", settle: Callable[[], None] | None) -> None:
        """The worker has the runtime's answer after the RPC's end woke the reactor: it wakes it for the answer."""
        self._taken(outcome, settle)
        self._hand_over(self._reactor.callFromThread)

    def _hand_over(self, enqueue: Enqueue) -> None:
        settle, self._settle = self._settle, None
        assert settle is not None
        enqueue(settle)

    def _end_now(self, outcome: "adapters.Outcome[CRIReply] | None", settle: Callable[[], None] | None) -> None:
        """The RPC is over before the worker has its outcome: the flow must give up what it waits for, now."""
        self._reactor.callFromThread(self.rpc_ended)

    def _end_later(self, outcome: "adapters.Outcome[CRIReply] | None", settle: Callable[[], None] | None) -> None:
        """The RPC is over after the worker had its outcome: the reactor hears of it a moment later."""
        self._later(self.rpc_ended)


class _Driven(Protocol):
    """What an exchange needs of the call it carries (``Call``)."""

    def run(self, flow: Flow) -> "Deferred[adapters.Outcome[CRIReply]]": ...

    def cancel(self) -> None: ...

    def ended(self, decided_at: float | None = None) -> None: ...


_Action = Callable[[_Exchange, "adapters.Outcome[CRIReply] | None", "Callable[[], None] | None"], None]

_S, _E, _X = _State, _Event, _Exchange
_TRANSITIONS: dict[tuple[_State, _Event], tuple[_State, _Action]] = {
    # Nothing offered yet: the first outcome is the worker's; an RPC over wakes the reactor to give the flow up.
    (_S.WAITING, _E.OFFERED): (_S.FLOWS, _X._to_worker),
    (_S.WAITING, _E.ANSWERED): (_S.RUNTIMES, _X._to_worker),
    (_S.WAITING, _E.WORKER_DONE): (_S.DECIDED, _X._nothing),  # it gave up: the reactor is not running
    (_S.WAITING, _E.RPC_OVER): (_S.WAITING_OVER, _X._end_now),
    (_S.WAITING_OVER, _E.OFFERED): (_S.FLOWS_OVER, _X._to_worker),
    (_S.WAITING_OVER, _E.ANSWERED): (_S.RUNTIMES_OVER, _X._to_worker),
    (_S.WAITING_OVER, _E.WORKER_DONE): (_S.DECIDED_OVER, _X._nothing),
    # The flow's outcome offered: the worker takes it; the runtime's answer, after it, is the flow's alone.
    (_S.FLOWS, _E.ANSWERED): (_S.FLOWS, _X._settle_now),
    (_S.FLOWS, _E.WORKER_DONE): (_S.DECIDED, _X._taken),
    (_S.FLOWS, _E.RPC_OVER): (_S.FLOWS_OVER, _X._end_now),
    (_S.FLOWS_OVER, _E.ANSWERED): (_S.FLOWS_OVER, _X._settle_now),
    (_S.FLOWS_OVER, _E.WORKER_DONE): (_S.DECIDED_OVER, _X._taken),
    # The runtime's answer offered: the worker takes it and hands it to the reactor, unwoken unless the RPC's end
    # woke it already; the flow's outcome after it is not the caller's.
    (_S.RUNTIMES, _E.OFFERED): (_S.RUNTIMES, _X._nothing),
    (_S.RUNTIMES, _E.WORKER_DONE): (_S.ANSWERED, _X._taken_queued),
    (_S.RUNTIMES, _E.RPC_OVER): (_S.RUNTIMES_OVER, _X._end_now),
    (_S.RUNTIMES_OVER, _E.OFFERED): (_S.RUNTIMES_OVER, _X._nothing),
    (_S.RUNTIMES_OVER, _E.WORKER_DONE): (_S.ANSWERED_OVER, _X._taken_woken),
    # The worker is done: the RPC's end comes a moment later; a runtime's answer goes to the reactor, woken for it.
    (_S.DECIDED, _E.OFFERED): (_S.DECIDED, _X._nothing),
    (_S.DECIDED, _E.ANSWERED): (_S.DECIDED, _X._settle_now),
    (_S.DECIDED, _E.RPC_OVER): (_S.DECIDED_OVER, _X._end_later),
    (_S.DECIDED_OVER, _E.OFFERED): (_S.DECIDED_OVER, _X._nothing),
    (_S.DECIDED_OVER, _E.ANSWERED): (_S.DECIDED_OVER, _X._settle_now),
    (_S.ANSWERED, _E.OFFERED): (_S.ANSWERED, _X._nothing),
    (_S.ANSWERED, _E.RPC_OVER): (_S.ANSWERED_OVER, _X._end_later),
    (_S.ANSWERED_OVER, _E.OFFERED): (_S.ANSWERED_OVER, _X._nothing),
}
"""Every (state, event) that can happen, and the state and action it leads to. What is not here cannot happen:
each event comes once, and the runtime answers once."""

_OFFERED = frozenset({_State.FLOWS, _State.FLOWS_OVER, _State.RUNTIMES, _State.RUNTIMES_OVER})
"""Where the worker, done waiting, takes an outcome."""
_RUNTIME_ANSWERED = frozenset({_State.RUNTIMES, _State.RUNTIMES_OVER, _State.ANSWERED, _State.ANSWERED_OVER})
"""Where the runtime's answer is the caller's, and on its way to the flow: the RPC's end does not give the flow up."""


class CRIBackend:
    """``adapters.Backend`` for one CRI call: its bytes forwarded with kubelet's metadata, read-backs from containerd."""

    def __init__(
        self,
        interceptor: "Interceptor",
        method: str,
        raw: bytes,
        metadata: Metadata,
        created_id: Callable[[bytes], str] | None,
        exchange: _Exchange,
    ) -> None:
        self._interceptor = interceptor
        self._method = method
        self._raw = raw
        self._metadata = metadata
        self._created_id = created_id
        self._exchange = exchange
        self._sent: Deferred[Answer] | None = None

    def send_ahead(self, timeout: float | None) -> None:
        """From the worker: the call goes to the runtime as it came, before its flow runs (``flows.goes_ahead``);
        the flow's forward is answered by it (and cancelling that cancels it)."""
        self._sent = self._send(self._raw, timeout)

    def _send(self, request: bytes, timeout: float | None) -> "Deferred[Answer]":
        interceptor = self._interceptor
        return call_unary(
            interceptor.reactor,
            interceptor.upstream(self._method),
            request,
            timeout,
            self._metadata,
            self._exchange.runtime_answered,
        )

    async def forward(self, rewritten: bytes | None, timeout: float | None) -> CRIReply:
        sent = self._sent
        answer = await (self._send(self._raw if rewritten is None else rewritten, timeout) if sent is None else sent)
        if answer.ok and self._created_id is not None:
            return CRIReply(answer, self._created_id(answer.raw))
        return CRIReply(answer)

    def read_pod(self, sandbox_id: str, timeout: float | None) -> Awaitable[StoredPod | None]:
        return self._interceptor.lookup.read_pod(sandbox_id, timeout)

    def read_container(
        self, container_id: str, pods: adapters.PodSource, timeout: float | None
    ) -> Awaitable[StoredContainer | None]:
        return self._interceptor.lookup.read_container(container_id, pods, timeout)


def answer(outcome: "adapters.Outcome[CRIReply]", context: grpc.ServicerContext, backend: BackendChannel) -> bytes:
    """Answer the caller with ``outcome``: the runtime's answer as it came, or koordrp's own status."""
    if isinstance(outcome, CRIReply):
        reply = outcome.answer
        if reply.ok:
            if reply.trailing:
                context.set_trailing_metadata(reply.trailing)
            return reply.raw
        relay_status(context, backend, reply.code, reply.details, reply.trailing)
    if isinstance(outcome, adapters.Refusal):
        context.abort(grpc.StatusCode[outcome.status_code.name], outcome.message)
    context.abort(grpc.StatusCode.CANCELLED, "koordrp: the call was given up")


class Interceptor:
    """Handlers for the CRI methods that have hooks or change the store."""

    def __init__(
        self,
        reactor: IReactorFromThreads,
        backend: BackendChannel,
        parts: Parts,
        lookup: RuntimeLookup,
        later: Enqueue,
        paths: FastPaths = fastpaths.DEFAULT,
    ) -> None:
        """``later`` queues a call's end for the reactor once the caller has its answer (``handoff.Later``);
        ``paths`` says whether work may be queued for the reactor without waking it."""
        self.reactor = reactor
        self._unwoken = paths.unwoken(reactor) or reactor.callFromThread
        self._later = later
        self.backend = backend
        self.lookup = lookup
        self._parts = parts
        # grpc-stubs 1.53 predates grpcio's _registered_method and wrongly requires the serializers.
        self._upstreams: dict[str, grpc.UnaryUnaryMultiCallable[bytes, bytes]] = {
            RUNTIME_SERVICE + name: backend.channel.unary_unary(RUNTIME_SERVICE + name, _registered_method=True)  # type: ignore[call-arg]
            for name in _METHODS
        }
        self.handlers: dict[str, Callable[[bytes, grpc.ServicerContext], bytes]] = {
            RUNTIME_SERVICE + name: self._handler(name, method) for name, method in _METHODS.items()
        }

    def upstream(self, method: str) -> "grpc.UnaryUnaryMultiCallable[bytes, bytes]":
        return self._upstreams[method]

    def _handler(self, name: str, method: _Method[Request]) -> Callable[[bytes, grpc.ServicerContext], bytes]:
        path = RUNTIME_SERVICE + name

        def handle(raw: bytes, context: grpc.ServicerContext) -> bytes:
            timeout = remaining_timeout(context)
            exchange = _Exchange(self.reactor, self._unwoken, self._later, self._parts.clock)
            backend = CRIBackend(self, path, raw, tuple(context.invocation_metadata()), method.created_id, exchange)
            servers = self._parts.registrations()
            unreadable: str | None = None
            try:
                request = method.parse(raw)
            except DecodeError as error:
                unreadable = str(error)
            ahead = (
                unreadable is None
                and method.subject is not None
                and flows.goes_ahead(self._parts, servers, name, method.subject(request))
            )
            if ahead:
                backend.send_ahead(timeout)  # first: the runtime works while the rest is made
            call = Call(self._parts, name, backend, timeout, servers=servers, went_ahead=ahead)
            flow = method.flow(call, request) if unreadable is None else flows.unreadable(call, name, unreadable)
            if ahead:
                # Queued before the RPC's end is watched: that end, whenever it comes, has the reactor woken for it.
                self._unwoken(exchange.start, call, flow)
            # Asked before a flow that forwards is handed over, so that the worker waits, and lets the reactor have
            # the GIL, as soon as it has handed it; an end that comes before the flow started is kept until it
            # does (``_Exchange``).
            gone = not context.add_callback(exchange.end_reported)
            if not ahead:
                self.reactor.callFromThread(exchange.start, call, flow)
            if gone:
                exchange.end_reported()  # the caller is gone already
            if not exchange.wait(None if timeout is None else timeout + _SLACK_SECONDS):
                _reactor_stuck(context, name)
            return answer(exchange.outcome, context, self.backend)

        return handle


def _reactor_stuck(context: grpc.ServicerContext, name: str) -> NoReturn:
    context.abort(grpc.StatusCode.UNAVAILABLE, f"koordrp: {name} did not finish within the call's deadline")
