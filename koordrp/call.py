"""``Call`` drives one intercepted call's flow on the reactor, whichever front end it came through.

``run`` starts the flow and fires with its ``Outcome`` as soon as the caller can be answered;
``cancel`` is the caller giving up (what the flow waits for, a hook or the runtime, is cancelled at
once); ``ended`` is the answer having left, after which the call's post stages start and its metrics
and line (NRI mode: unless it is uneventful) are written, in every mode. In between, the flow uses the
call for what flows do: name what the call is about (``concerns``), run pre and post stages, forward,
find its pod or container in the store or read it back from the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Coroutine, Generic, Iterable, Mapping, Protocol, Sequence, TypeVar

from twisted.internet.defer import CancelledError, Deferred, ensureDeferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from koordrp import calllog
from koordrp.api.runtime.v1alpha1.api_pb2 import ContainerResourceHookResponse
from koordrp.adapters import (
    CALLER_GONE,
    AnyReply,
    Backend,
    LateNotApplied,
    LateUpdates,
    LookupFailed,
    Outcome,
    Refusal,
    RefusalKind,
    Written,
    outcome_label,
)
from koordrp.calllog import CallRecord
from koordrp.hooks.messages import (
    Change,
    ContainerHookRequest,
    HookRequest,
    PodHookRequest,
    copied,
    left_alone,
    marked_catch_up,
    merge_container_response,
    placed_in_pod,
    subject_text,
    unmarked_catch_up,
)
from koordrp.hooks.types import (
    HOOK_OK,
    NOT_ANSWERING,
    SENT,
    SKIPPED,
    FailurePolicy,
    HookCall,
    HookServerConfig,
    HookServers,
    HookType,
    LateCall,
    PostStage,
    StageOutcome,
    Subscribers,
)
from koordrp.store import ContainerState, Store, StoredContainer, StoredPod
from koordrp.text import shortened

if TYPE_CHECKING:
    # Only --metrics-endpoint loads prometheus_client: it costs a node daemon ~6 MB of RSS.
    from koordrp.metrics import Metrics

Result = TypeVar("Result")
Request = TypeVar("Request", PodHookRequest, ContainerHookRequest)
Stored = TypeVar("Stored", StoredPod, StoredContainer)

HOOKS_SHARE = 0.5
"""The share of what is left of a call's deadline its hook stage may take; the runtime's call keeps the rest."""

SETTLE_SECONDS = 2.0
"""How long koordrp asks the runtime, on its own account, what a call the caller gave up on did."""


class Stages(Protocol):
    """The hook stages (``koordrp.hooks.dispatcher.Dispatcher``)."""

    def run(
        self, hook: HookType, servers: Subscribers, request: HookRequest, budget: float | None, keep_late: bool
    ) -> Awaitable[StageOutcome]:
        """Run a pre stage: ``request`` comes back changed by each server's answer in turn; ``keep_late``: a call
        that misses the budget is left running, as the outcome's ``late`` one."""

    def announce(self, stages: Sequence[PostStage]) -> None:
        """Start the post stages one call owes, one after another, without waiting for them."""

    def count_not_made(self, calls: Iterable[HookCall]) -> None:
        """Count the hook calls a call spared."""

    def skips_post(self, server: HookServerConfig) -> str | None:
        """Why a post hook call to ``server`` would be skipped now (None: it would be made)."""

    def drain(self, timeout: float) -> Deferred[None]:
        """Fires once no post stage runs, or after ``timeout`` seconds, when those still running are cut."""


@dataclass(frozen=True)
class SkipLabel:
    """The pod label that spares a pod (and its containers) every hook call."""

    key: str
    value: str

    def skips(self, labels: Mapping[str, str]) -> bool:
        return labels.get(self.key) == self.value


@dataclass(frozen=True)
class Parts:
    """What every intercepted call shares, whichever front end it came through."""

    store: Store
    dispatcher: Stages
    registrations: Callable[[], HookServers]
    """The hook servers in force now."""
    skip: SkipLabel
    clock: IReactorTime
    metrics: Metrics | None = None


class Refused(Exception):
    """How a flow stops where koordrp refuses the call; ``Call.run`` turns it into the Refusal value."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


class Call(Generic[AnyReply]):
    """One intercepted call, driven on the reactor: its flow, its answer, and what it owes once answered.

    It takes the hook servers in force when it arrives and uses them throughout. What it owes once
    it has answered (its post stages, counting the hook calls it spared, its log line and metrics)
    waits until the front end says the answer has left (``ended``) and the flow is over.
    """

    log = Logger()

    def __init__(
        self,
        parts: Parts,
        method: str,
        backend: Backend[AnyReply],
        timeout: float | None = None,
        hooks_share: float = HOOKS_SHARE,
        late: LateUpdates | None = None,
        servers: HookServers | None = None,
        went_ahead: bool = False,
        uneventful_line: bool = True,
        catch_up: bool = False,
    ) -> None:
        """``method`` names the call in its log line; ``timeout`` is what is left of the caller's deadline, of
        which the hook stages may take ``hooks_share``; ``late``: the front end can still apply a pre-create
        answer that comes after the budget (``apply_late``); ``servers``: the hook servers in force as the
        call arrived, if the front end took them (default: now); ``went_ahead``: the front end sent the call
        to the runtime before its flow runs (``koordrp.flows.goes_ahead``); ``uneventful_line``: the call gets
        its line even when it is uneventful (``CallRecord.uneventful``); ``catch_up``: the call makes up for what
        happened while koordrp was away (NRI mode's catch-up): its hook requests are marked so
        (``CATCH_UP_ANNOTATION``), and a Fail-policy server cannot refuse what runs already (``_unheard``)."""
        self.store = parts.store
        self._parts = parts
        self.servers = parts.registrations() if servers is None else servers
        self._catch_up = catch_up
        self._must_be_heard: frozenset[str] = frozenset()
        if catch_up:
            self._must_be_heard = frozenset(s.name for s in self.servers.servers if s.failure_policy is FailurePolicy.FAIL)
            self.servers = HookServers(tuple(replace(s, failure_policy=FailurePolicy.IGNORE) for s in self.servers.servers))
        self.backend = backend
        self.record = CallRecord(method)
        self.lifecycle = method
        """The CRI method the call stands for (its flow says), for metrics."""
        self.logged = True
        """Whether the call gets metrics and a line (a Docker call about a container that is not Kubernetes' does not)."""
        self._uneventful_line = uneventful_line
        self.posts: list[PostStage] = []
        self._skipping = False
        self._started = parts.clock.seconds()
        self._deadline = None if timeout is None else self._started + timeout
        self._hooks_share = hooks_share
        self._answer: Deferred[Outcome[AnyReply]] = Deferred(lambda _: self.cancel())
        self._running: Deferred[AnyReply] | None = None
        self._forwarded: AnyReply | None = None
        """The runtime's answer, once the flow has forwarded the call."""
        self.went_ahead = went_ahead
        self._cancelled = False
        self._flow_over = False
        self._outcome: Outcome[AnyReply] | None = None
        self._ended = False
        self._seconds = 0.0
        self._decided_at: float | None = None
        self._late_updates = late
        self._late: LateCall | None = None
        self._late_at = 0
        """Where the late call is in the call's record."""
        self._applying_late: Deferred[None] | None = None

    # Driving the flow

    def run(self, flow: Coroutine[Any, Any, AnyReply]) -> Deferred[Outcome[AnyReply]]:
        """Start ``flow``; fires with its outcome as soon as the caller can be answered.

        Cancelling the Deferred is ``cancel()``.
        """
        running = ensureDeferred(flow)
        self._running = running
        running.addBoth(self._over)
        return self._answer

    def cancel(self) -> None:
        """The caller gave up: what the flow waits for (a hook, the runtime) is cancelled at once.

        The answer is CALLER_GONE at once; a flow that gave up on the runtime may still ask it what
        happened (``_forward_changing``) before it is over.
        """
        if self._cancelled:
            return
        self._cancelled = True
        if self._running is not None and not self._running.called:
            self._running.cancel()
        if self._applying_late is not None:
            self._applying_late.cancel()
        self._answered(CALLER_GONE)

    def ended(self, decided_at: float | None = None) -> None:
        """The answer has left (or nobody is left to take it). ``decided_at``: when the front end had the caller's
        answer, if that may come before the flow has it (CRI: the worker, before the reactor is woken); the call's
        duration ends there."""
        if not self._ended:
            self._ended = True
            if decided_at is not None:
                self._decided_at = decided_at
            self._finish_if_over()

    def remaining(self) -> float | None:
        """What is left of the caller's deadline, in seconds (None: it set none)."""
        return None if self._deadline is None else self._deadline - self._parts.clock.seconds()

    def _answered(self, outcome: Outcome[AnyReply]) -> None:
        if not self._answer.called:
            self._outcome = outcome
            self._seconds = self._parts.clock.seconds() - self._started
            self._answer.callback(outcome)

    def _stopped(self, failure: Failure) -> None:
        if isinstance(failure.value, Refused):
            self._answered(failure.value.refusal)
        elif isinstance(failure.value, CancelledError):
            self._answered(CALLER_GONE)
        else:
            self.log.failure("{method} failed inside koordrp", failure, method=self.record.method)
            forwarded = self._forwarded
            if forwarded is not None:
                self._answered(forwarded)
            else:
                self._answered(Refusal(RefusalKind.INTERNAL, f"koordrp: {shortened(failure.getErrorMessage())}"))

    def _over(self, result: "AnyReply | Failure") -> None:
        if self._late is not None:  # the flow ended without a container to apply it to
            late, self._late = self._late, None
            late.drop()
        # Over before it answers: a front end that says ``ended`` as the answer leaves has the call's post stages
        # announced then, so that a stop that waited for the call drains them next.
        self._flow_over = True
        # Nothing after this finishes the call if its caller is gone already, or if the front end said the
        # answer had left before the flow was over (CRI: the runtime's, as kubelet went just then).
        finish_here = self._answer.called or self._ended
        if isinstance(result, Failure):
            self._stopped(result)  # once the caller is gone there is no answer, but a failure is still said
        else:
            self._answered(result)
        if finish_here:
            self._finish_if_over()

    def _finish_if_over(self) -> None:
        if self._outcome is None or not self._ended or not self._flow_over or self._applying_late is not None:
            return
        outcome = outcome_label(self._outcome)
        seconds = self._seconds if self._decided_at is None else min(self._seconds, self._decided_at - self._started)
        dispatcher = self._parts.dispatcher
        if self.posts:
            dispatcher.announce(self.posts)
        dispatcher.count_not_made(self.record.calls)
        metrics = self._parts.metrics
        if metrics is not None:
            for call, change in self.record.left_alone():
                metrics.changes_left_alone.labels(call.server.name, call.hook.value, calllog.field_name(change)).inc()
        if self.logged:
            if self._uneventful_line or not self.record.uneventful(outcome):
                calllog.write(self.record, outcome, seconds)
            if metrics is not None:
                metrics.cri_call(self.lifecycle, outcome, seconds)

    # What flows do

    def concerns(self, subject: HookRequest) -> None:
        """The call is about this pod or container: its line names it, and its pod's labels say whether hooks are skipped."""
        self.record.subject = subject
        labels = subject.labels if isinstance(subject, PodHookRequest) else subject.pod_labels
        self._skipping = self._parts.skip.skips(labels)

    def _callees(self, hook: HookType) -> Subscribers:
        """The servers to call: none when nobody subscribed, or when the pod is skipped (counted)."""
        subscribed = self.servers.subscribed(hook)
        if subscribed and self._skipping:
            self.not_called(hook, subscribed, SKIPPED)
            return ()
        return subscribed

    def not_called(self, hook: HookType, servers: Subscribers, result: str) -> None:
        """Record the calls to ``servers`` that ``result`` (SKIPPED, UNREADABLE) spared; they are counted at the end."""
        self.record.add(HookCall(server, hook, result) for server in servers)

    def hook_budget(self) -> float | None:
        """How long a hook stage may take: its share of what is left of the caller's deadline.

        kubelet gives each call 2 minutes, crictl its --timeout: a slow hook server gets its answer
        applied as long as the runtime keeps enough of the deadline to do the call.
        """
        remaining = self.remaining()
        return None if remaining is None else remaining * self._hooks_share

    async def _run(self, hook: HookType, callees: Subscribers, request: HookRequest, keep_late: bool = False) -> None:
        if self._catch_up:
            marked_catch_up(request)
        outcome = await self._parts.dispatcher.run(hook, callees, request, self.hook_budget(), keep_late)
        if self._catch_up:
            unmarked_catch_up(request)
            self._unheard(outcome.calls)
        if outcome.late is not None:
            self._late = outcome.late
            self._late_at = len(self.record.calls) + outcome.calls.index(outcome.late.call)
        self.record.add(outcome.calls)
        if outcome.failure is not None:
            raise Refused(Refusal(RefusalKind.HOOK_FAILED, outcome.failure.message))

    def _unheard(self, calls: Iterable[HookCall]) -> None:
        """A Fail-policy server not heard at a catch-up: what it would refuse runs already, so it is said and counted."""
        for call in calls:
            if call.server.name in self._must_be_heard and call.hook.is_pre and call.result != HOOK_OK:
                subject = self.record.subject
                self.log.warn(
                    "hook server {server} (Fail policy) was not heard at the catch-up {hook} of {subject} ({result}: "
                    "{reason}): it runs already and cannot be refused",
                    server=call.server.name,
                    hook=call.hook.value,
                    subject="?" if subject is None else subject_text(subject),
                    result=call.result,
                    reason=shortened(call.reason) or "no reason given",
                )
                if self._parts.metrics is not None:
                    self._parts.metrics.catch_up_unheard.labels(call.server.name).inc()

    async def pre(self, hook: HookType, request: HookRequest) -> None:
        """Run a pre stage on ``request``, which comes back changed by the hooks."""
        callees = self._callees(hook)
        if callees:
            await self._run(hook, callees, request)

    async def pre_rewriting(
        self,
        hook: HookType,
        request: Request,
        rewritten: Callable[[Request, Request], Written],
        sent: Request | None = None,
        keep_late: bool = False,
    ) -> bytes | None:
        """Run a pre stage and write what it changed into the call's request; None: forward it as received.

        ``sent`` is the hook request as the call's request has it (default: ``request`` before the
        stage); ``rewritten`` runs even when no hook is called, since what the store knows may
        differ from what the caller sent (a pod's cgroup parent, set by hooks when it ran).
        ``keep_late``: where the front end can apply it, an answer that comes after the budget is
        applied once the flow says the container exists (``apply_late``).
        """
        callees = self._callees(hook)
        if sent is None:
            sent = copied(request) if callees else request
        if callees:
            await self._run(hook, callees, request, keep_late and self._late_updates is not None)
        written = rewritten(sent, request)
        for left in written.left_alone:
            self.record.leave_alone(hook, left.path_prefix, left.why)
        return written.request

    def apply_late(self, container_id: str, applied: Callable[[ContainerHookRequest, Sequence[Change]], None]) -> None:
        """The container exists now: the answer of a pre-create call that missed its budget, once it comes, is
        applied to it (what cannot change after create is left alone), and ``applied`` is told the container
        as answered and what of it was applied. The call's line waits for it, and tells it."""
        late, self._late = self._late, None
        if late is None or self._late_updates is None:
            return
        applying = ensureDeferred(self._apply_late(self._late_updates, late, container_id, applied))
        self._applying_late = applying

        def done(_: object) -> None:
            self._applying_late = None
            self._finish_if_over()

        applying.addErrback(self._late_failed).addBoth(done)

    async def _apply_late(
        self,
        updates: LateUpdates,
        late: LateCall,
        container_id: str,
        applied: Callable[[ContainerHookRequest, Sequence[Change]], None],
    ) -> None:
        answer = await late.ended
        call = answer.call
        if isinstance(answer.response, ContainerResourceHookResponse) and isinstance(late.request, ContainerHookRequest):
            answered = copied(late.request)
            changes = tuple(merge_container_response(answered, answer.response))
            try:
                if not self.store.has_container(container_id):
                    raise LateNotApplied("the container was removed meanwhile")
                for left in await updates.apply(container_id, late.request, answered):
                    changes = left_alone(changes, left.path_prefix, left.why)
            except LateNotApplied as error:
                changes = left_alone(changes, "", f"late, and not applied: {shortened(str(error))}")
            if any(change.applied for change in changes):
                applied(answered, changes)
            call = replace(call, changes=changes)
        self.record.calls[self._late_at] = call

    def _late_failed(self, failure: Failure) -> None:
        if not isinstance(failure.value, CancelledError):
            self.log.failure("applying a late hook answer to {method} failed inside koordrp", failure, method=self.record.method)

    def post(self, hook: HookType, request: HookRequest) -> None:
        """Owe a post stage, run once the call has answered: its line names each call ``sent``, or ``not-answering``
        for a server whose post hooks are skipped then (it let a call pass its own timeout)."""
        callees = self._callees(hook)
        if callees:
            self.posts.append(PostStage(hook, callees, marked_catch_up(request) if self._catch_up else request))
            self.record.add(self._sent(server, hook) for server in callees)

    def _sent(self, server: HookServerConfig, hook: HookType) -> HookCall:
        skipped = self._parts.dispatcher.skips_post(server)
        return HookCall(server, hook, SENT) if skipped is None else HookCall(server, hook, NOT_ANSWERING, reason=skipped)

    async def forward(self, rewritten: bytes | None = None) -> AnyReply:
        """Forward the call: the runtime's answer is the caller's, whatever the flow does next.

        The runtime has done (or refused) what was asked; what a flow does after it (the store, the
        post stages it owes) is koordrp's own bookkeeping and cannot change that answer: a failure
        there is said, and the caller still gets the runtime's answer. A front end may hand that
        answer over as soon as it comes (CRI's worker does, as grpc's thread wakes it), as long as the
        reactor has it queued first, so that the caller's next call finds the store as this one leaves it.
        """
        if self.went_ahead and rewritten is not None:
            # flows.goes_ahead sends only what its flow forwards as it came: this is koordrp's bug, said as one.
            self.log.error(
                "{method} went to the runtime before its flow ran, which then changed it: the change was not sent",
                method=self.record.method,
            )
        reply = await self.backend.forward(rewritten, self.remaining())
        self._forwarded = reply
        return reply

    def shown(self, stored: Stored) -> Stored:
        """The hooks are shown what kubelet asked for this pod or container: if it was lost (its state file
        could not be read), the call's line says so. (A container's hooks are shown its pod as given.)"""
        if stored.asked_lost:
            self.record.asked_lost = True
        return stored

    async def pod(self, sandbox_id: str) -> StoredPod | None:
        """The pod from the store, or read back from the runtime (and remembered) if the store lacks it."""
        pod = self.store.pod(sandbox_id)
        if pod is None and sandbox_id:
            stored = await self._read_back("pod", sandbox_id, lambda: self.backend.read_pod(sandbox_id, self.remaining()))
            if stored is not None:
                self.store.learn([(sandbox_id, stored)], [])
                pod = self.store.pod(sandbox_id)
        return pod

    async def _pod_as_given(self, sandbox_id: str) -> PodHookRequest | None:
        pod = await self.pod(sandbox_id)
        return None if pod is None else pod.given

    async def container(self, container_id: str) -> StoredContainer | None:
        """The container from the store, or read back from the runtime (and remembered), with its pod; its
        hooks are shown what kubelet asked for it (``shown``)."""
        stored = self.store.container(container_id)
        if stored is None and container_id:
            stored = await self._read_back(
                "container",
                container_id,
                lambda: self.backend.read_container(container_id, self._pod_as_given, self.remaining()),
            )
            if stored is not None:
                self.store.learn([], [(container_id, stored)])
                stored = self.store.container(container_id)
        return None if stored is None else self.shown(stored)

    def container_request(self, container: ContainerHookRequest, sandbox_id: str) -> ContainerHookRequest:
        """What a hook about a container is shown: ``container`` (kubelet's, copied), in its pod as the pod is now."""
        request = copied(container)
        pod = self.store.pod(sandbox_id)
        return request if pod is None else placed_in_pod(request, pod.given)

    async def _read_back(self, kind: str, identifier: str, read: Callable[[], Awaitable[Result | None]]) -> Result | None:
        try:
            return await read()
        except LookupFailed as error:
            self.log.warn(
                "{kind} {id} is not in the store and could not be read from the runtime: {error}",
                kind=kind,
                id=shortened(identifier, 80),
                error=shortened(str(error)),
            )
            return None

    async def container_now(self, container_id: str, state: ContainerState | None) -> bool:
        """Whether the runtime says, on koordrp's own account (the caller is gone), the container is in
        ``state`` (None: that it no longer has it)."""

        async def stored_pod(sandbox_id: str) -> PodHookRequest | None:
            pod = self.store.pod(sandbox_id)
            return None if pod is None else pod.given

        try:
            found = await self.backend.read_container(container_id, stored_pod, SETTLE_SECONDS)
        except LookupFailed:
            return False
        return found is None if state is None else found is not None and found.state is state

    async def pod_now(self, sandbox_id: str, stopped: bool | None) -> bool:
        """Whether the runtime says, on koordrp's own account (the caller is gone), the pod is ``stopped`` (or
        running; None: that it no longer has it)."""
        try:
            found = await self.backend.read_pod(sandbox_id, SETTLE_SECONDS)
        except LookupFailed:
            return False
        return found is None if stopped is None else found is not None and found.stopped is stopped


def pod_labels(store: Store, container: ContainerHookRequest, sandbox_id: str) -> Mapping[str, str]:
    """The labels a hook about ``container`` is shown as its pod's (``container_request``'s, without its copy):
    the pod's as the store has it, else the container's own."""
    pod = store.pod(sandbox_id)
    return container.pod_labels if pod is None else pod.given.labels
