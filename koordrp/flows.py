"""The lifecycle flows: what each intercepted call does, written once for every front end.

A flow decides, for one lifecycle method, whether hooks are skipped, which pre and post hook stages
run, what is written back into the request, when the runtime is called, and what the store learns or
forgets. It is a coroutine on the reactor, whichever front end the call came through; it knows no
wire format and no thread, only small protocols each front end implements:

- ``Backend`` is the runtime behind the front end, for one call: forwarding the call (rewritten or as
  received) and reading back what the store lacks. Its answers are Deferreds whose cancellation
  reaches the runtime.
- The request protocols (``RunPodSandbox``, ``CreateContainer``, ``UpdateContainerResources``) are
  the call's own request: turned into a hook request, and written back once the hooks changed it.

``Call`` drives one flow: ``run`` starts it and fires with its ``Outcome``, a value (the runtime's
``Reply``, a ``Refusal``, or ``CALLER_GONE``) that the front end turns into its own answer;
``cancel`` is the caller giving up; ``ended`` is the answer having left, after which the call's post
stages start and its line and metrics are written, the same way in every mode.

The rules, method by method (docs/architecture.md tells where each one changes):

==========================  ===========================  ======================  ==================
method                      pre stage (written back)     post stage              store, on success
==========================  ===========================  ======================  ==================
RunPodSandbox               PreRunPodSandbox             —                       the pod
CreateContainer             PreCreateContainer           —                       the container
StartContainer              PreStartContainer (nothing)  PostStartContainer      running
UpdateContainerResources    PreUpdateContainerResources  —                       the container
StopContainer               —                            PostStopContainer       stopped
StopPodSandbox              —                            PostStopContainer,      the pod and its
                                                         PostStopPodSandbox      containers stopped
RemoveContainer             —                            —                       forgets it
RemovePodSandbox            —                            —                       forgets it and its containers
UpdatePodSandboxResources   —                            —                       the pod's resources
==========================  ===========================  ======================  ==================

Hooks are shown what kubelet asked (the store keeps it apart from what the runtime was given), and
a container's hooks are shown its pod as it is.

A pod labelled with the skip label gets no hook call (each skipped call is counted); a pod or
container the store does not know is read back from the runtime, and if the runtime does not know it
either, the call goes to the runtime unchanged and without hooks, for the runtime's own answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import (
    TYPE_CHECKING,
    Any,
    Awaitable,
    Callable,
    Coroutine,
    Generic,
    Iterable,
    Mapping,
    Protocol,
    Sequence,
    TypeVar,
    Union,
)

from twisted.internet.defer import CancelledError, Deferred, ensureDeferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from koordrp import calllog
from koordrp.calllog import CallRecord
from koordrp.hooks.messages import (
    ContainerHookRequest,
    HookRequest,
    PodHookRequest,
    Resources,
    copied,
    folded_update,
    placed_in_pod,
)
from koordrp.hooks.types import (
    SENT,
    SKIPPED,
    UNREADABLE,
    HookCall,
    HookServers,
    HookType,
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

HOOKS_SHARE = 0.5
"""The share of what is left of a call's deadline its hook stage may take; the runtime's call keeps the rest."""

SETTLE_SECONDS = 2.0
"""How long koordrp asks the runtime, on its own account, what a call the caller gave up on did."""


class Reply(Protocol):
    """The runtime's answer to a forwarded call, as the flows need to know it."""

    @property
    def ok(self) -> bool:
        """The runtime did what it was asked."""

    @property
    def created_id(self) -> str:
        """The id the runtime gave the pod or container a call created ("" for other calls)."""


AnyReply = TypeVar("AnyReply", bound=Reply)
AnyReply_co = TypeVar("AnyReply_co", bound=Reply, covariant=True)


@dataclass(frozen=True)
class LeftAlone:
    """What a front end could not write into its request: every change a hook answer made to a field whose
    path starts with ``path_prefix`` ("" for all of them), and why."""

    path_prefix: str
    why: str


@dataclass(frozen=True)
class Written:
    """A call's request with the hooks' changes, as its front end forwards it."""

    request: bytes | None
    """None: forward it as the caller sent it."""
    left_alone: tuple[LeftAlone, ...] = ()


class RefusalKind(Enum):
    HOOK_FAILED = "a Fail-policy hook server could not be heard"
    UNREADABLE = "a request a Fail-policy hook server must see cannot be read"
    INTERNAL = "koordrp failed"


@dataclass(frozen=True)
class Refusal:
    """koordrp answers the call itself, and the runtime never hears of it; ``message`` says why."""

    kind: RefusalKind
    message: str

    @property
    def status_code(self) -> "RefusalStatus":
        """The status of the answer (CRI's gRPC; NRI's ttrpc carries the same codes)."""
        return RefusalStatus.INVALID_ARGUMENT if self.kind is RefusalKind.UNREADABLE else RefusalStatus.UNKNOWN


class RefusalStatus(IntEnum):
    """The gRPC status codes a refusal is answered with: the call's line names them too."""

    UNKNOWN = 2
    INVALID_ARGUMENT = 3


class CallerGone:
    """The caller gave up (cancelled, its deadline passed, its connection closed): nobody to answer."""

    def __repr__(self) -> str:
        return "CALLER_GONE"


CALLER_GONE = CallerGone()

Outcome = Union[AnyReply, Refusal, CallerGone]
"""How a call ended, for its front end to answer: the runtime's reply, koordrp's refusal, or nobody to answer."""


class LookupFailed(Exception):
    """The runtime could not say (unreachable, or an answer koordrp cannot read); the text says why."""


class Unreadable(LookupFailed):
    """The runtime answered about one pod or container with something koordrp cannot read."""


class Stages(Protocol):
    """The hook stages (``koordrp.hooks.dispatcher.Dispatcher``)."""

    def run(
        self, hook: HookType, servers: Subscribers, request: HookRequest, budget: float | None
    ) -> Awaitable[StageOutcome]:
        """Run a pre stage: ``request`` comes back changed by each server's answer in turn."""

    def announce(self, stages: Sequence[PostStage]) -> None:
        """Start the post stages one call owes, one after another, without waiting for them."""

    def count_not_made(self, calls: Iterable[HookCall]) -> None:
        """Count the hook calls a call spared."""

    def drain(self) -> Deferred[Any]:
        """Fires once every post stage announced so far has ended."""


PodSource = Callable[[str], Awaitable[PodHookRequest | None]]
"""Where a container read back from the runtime finds its pod, by sandbox id."""


class RuntimeReader(Protocol):
    """Reading pods and containers back from the runtime, as the store keeps them, within ``timeout``.

    None: the runtime does not know the id (or it is not a Kubernetes one); LookupFailed: it
    could not say; Unreadable: it answered with something koordrp cannot read.
    """

    def read_pod(self, sandbox_id: str, timeout: float | None) -> Awaitable[StoredPod | None]: ...

    def read_container(
        self, container_id: str, pods: PodSource, timeout: float | None
    ) -> Awaitable[StoredContainer | None]: ...


class RuntimeInventory(RuntimeReader, Protocol):
    def listed(self, timeout: float | None) -> Awaitable[tuple[list[str], list[str]]]:
        """The ids of every Kubernetes pod sandbox and container the runtime has."""


class Backend(RuntimeReader, Protocol[AnyReply_co]):
    """The runtime behind the front end, for one call."""

    def forward(self, rewritten: bytes | None, timeout: float | None) -> Awaitable[AnyReply_co]:
        """Send the call on: ``rewritten`` as its request, or (None) exactly what the caller sent.

        Its answer, whatever it is, is a Reply; cancelling the Deferred cancels the runtime's call.
        """


class RunPodSandbox(Protocol):
    def hook_request(self) -> PodHookRequest: ...

    def rewritten(self, sent: PodHookRequest, final: PodHookRequest) -> Written:
        """The request with every field where ``final`` differs from ``sent`` (None: they do not differ)."""


class CreateContainer(Protocol):
    @property
    def sandbox_id(self) -> str: ...

    def hook_request(self) -> ContainerHookRequest:
        """The container as the request has it; ``pod_cgroup_parent`` is where the request places it."""

    def rewritten(self, sent: ContainerHookRequest, final: ContainerHookRequest) -> Written: ...

    def envs_sent(self) -> dict[str, str]:
        """The environment the runtime is given, as a map (after ``rewritten``)."""


class UpdatePodSandboxResources(Protocol):
    @property
    def sandbox_id(self) -> str: ...

    def resources(self) -> Resources | None: ...

    def overhead(self) -> Resources | None: ...


class UpdateContainerResources(Protocol):
    @property
    def container_id(self) -> str: ...

    def resources(self) -> Resources | None:
        """The resources the update names (zero and empty: keep); None: it names none."""

    def annotations(self) -> Mapping[str, str]: ...

    def rewritten(self, sent: ContainerHookRequest, final: ContainerHookRequest) -> Written: ...


# The hook points of each CRI method (Docker calls stand for one of them); tests check the flows
# call exactly these.
METHOD_HOOKS: dict[str, tuple[HookType, ...]] = {
    "RunPodSandbox": (HookType.PRE_RUN_POD_SANDBOX,),
    "CreateContainer": (HookType.PRE_CREATE_CONTAINER,),
    "StartContainer": (HookType.PRE_START_CONTAINER, HookType.POST_START_CONTAINER),
    "UpdateContainerResources": (HookType.PRE_UPDATE_CONTAINER_RESOURCES,),
    "StopContainer": (HookType.POST_STOP_CONTAINER,),
    "StopPodSandbox": (HookType.POST_STOP_CONTAINER, HookType.POST_STOP_POD_SANDBOX),
    "RemoveContainer": (),
    "RemovePodSandbox": (),
    "UpdatePodSandboxResources": (),
}


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


class _Refused(Exception):
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
    ) -> None:
        """``method`` names the call in its log line; ``timeout`` is what is left of the caller's deadline, of
        which the hook stages may take ``hooks_share``."""
        self.store = parts.store
        self._parts = parts
        self.servers = parts.registrations()
        self.backend = backend
        self.record = CallRecord(method)
        self.lifecycle = method
        """The CRI method the call stands for (its flow says), for metrics."""
        self.logged = True
        """Whether the call gets a line and metrics (a Docker call about a container that is not Kubernetes' does not)."""
        self.posts: list[PostStage] = []
        self._skipping = False
        self._started = parts.clock.seconds()
        self._deadline = None if timeout is None else self._started + timeout
        self._hooks_share = hooks_share
        self._answer: Deferred[Outcome[AnyReply]] = Deferred(lambda _: self.cancel())
        self._running: Deferred[AnyReply] | None = None
        self._cancelled = False
        self._flow_over = False
        self._ended_as: str | None = None
        self._seconds = 0.0

    # Driving the flow

    def run(self, flow: Coroutine[Any, Any, AnyReply]) -> Deferred[Outcome[AnyReply]]:
        """Start ``flow``; fires with its outcome as soon as the caller can be answered.

        Cancelling the Deferred is ``cancel()``.
        """
        running = ensureDeferred(flow)
        self._running = running
        running.addCallbacks(self._answered, self._stopped).addBoth(self._over)
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
        self._answered(CALLER_GONE)

    def ended(self, outcome: str) -> None:
        """The answer has left (or nobody is left to take it), as ``outcome`` names it (a status, "CANCELLED")."""
        if self._ended_as is None:
            self._ended_as = outcome
            self._finish_if_over()

    def remaining(self) -> float | None:
        """What is left of the caller's deadline, in seconds (None: it set none)."""
        return None if self._deadline is None else self._deadline - self._parts.clock.seconds()

    def _answered(self, outcome: Outcome[AnyReply]) -> None:
        if not self._answer.called:
            self._seconds = self._parts.clock.seconds() - self._started
            self._answer.callback(outcome)

    def _stopped(self, failure: Failure) -> None:
        if isinstance(failure.value, _Refused):
            self._answered(failure.value.refusal)
        elif isinstance(failure.value, CancelledError):
            self._answered(CALLER_GONE)
        else:
            self.log.failure("{method} failed inside koordrp", failure, method=self.record.method)
            self._answered(Refusal(RefusalKind.INTERNAL, f"koordrp: {shortened(failure.getErrorMessage())}"))

    def _over(self, _: object) -> None:
        self._flow_over = True
        self._finish_if_over()

    def _finish_if_over(self) -> None:
        outcome = self._ended_as
        if outcome is None or not self._flow_over:
            return
        dispatcher = self._parts.dispatcher
        if self.posts:
            dispatcher.announce(self.posts)
        dispatcher.count_not_made(self.record.calls)
        metrics = self._parts.metrics
        if metrics is not None:
            for call, change in self.record.left_alone():
                metrics.changes_left_alone.labels(call.server.name, call.hook.value, calllog.field_name(change)).inc()
        if self.logged:
            calllog.write(self.record, outcome, self._seconds)
            if metrics is not None:
                metrics.cri_call(self.lifecycle, outcome, self._seconds)

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

    async def _run(self, hook: HookType, callees: Subscribers, request: HookRequest) -> None:
        outcome = await self._parts.dispatcher.run(hook, callees, request, self.hook_budget())
        self.record.add(outcome.calls)
        if outcome.failure is not None:
            raise _Refused(Refusal(RefusalKind.HOOK_FAILED, outcome.failure.message))

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
    ) -> bytes | None:
        """Run a pre stage and write what it changed into the call's request; None: forward it as received.

        ``sent`` is the hook request as the call's request has it (default: ``request`` before the
        stage); ``rewritten`` runs even when no hook is called, since what the store knows may
        differ from what the caller sent (a pod's cgroup parent, set by hooks when it ran).
        """
        callees = self._callees(hook)
        if sent is None:
            sent = copied(request) if callees else request
        if callees:
            await self._run(hook, callees, request)
        written = rewritten(sent, request)
        for left in written.left_alone:
            self.record.leave_alone(hook, left.path_prefix, left.why)
        return written.request

    def post(self, hook: HookType, request: HookRequest) -> None:
        callees = self._callees(hook)
        if callees:
            self.posts.append(PostStage(hook, callees, request))
            self.record.add(HookCall(server, hook, SENT) for server in callees)

    async def forward(self, rewritten: bytes | None = None) -> AnyReply:
        return await self.backend.forward(rewritten, self.remaining())

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
        """The container from the store, or read back from the runtime (and remembered), with its pod."""
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
        return stored

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

    async def container_now(self, container_id: str, state: ContainerState) -> bool:
        """Whether the runtime says, on koordrp's own account (the caller is gone), the container is in ``state``."""

        async def stored_pod(sandbox_id: str) -> PodHookRequest | None:
            pod = self.store.pod(sandbox_id)
            return None if pod is None else pod.given

        try:
            found = await self.backend.read_container(container_id, stored_pod, SETTLE_SECONDS)
        except LookupFailed:
            return False
        return found is not None and found.state is state

    async def pod_now_stopped(self, sandbox_id: str) -> bool:
        """Whether the runtime says, on koordrp's own account (the caller is gone), the pod is stopped."""
        try:
            found = await self.backend.read_pod(sandbox_id, SETTLE_SECONDS)
        except LookupFailed:
            return False
        return found is not None and found.stopped


async def _forward_changing(
    call: Call[AnyReply], happened: Callable[[], None], done_all_the_same: Callable[[], Awaitable[bool]]
) -> AnyReply:
    """Forward a call that starts or stops something; ``happened()`` once the runtime has done it.

    This is where a call the caller gives up on (kubelet cancels, its deadline passes) is settled:
    the runtime's call is cancelled with it, but may have done its work all the same. koordrp then
    asks the runtime (``done_all_the_same``, on a bound of its own) and ``happened()`` runs only if
    it says so: a cancelled StopContainer owes PostStopContainer only if the container did stop.
    Otherwise the store keeps the state it had, and kubelet's repeat of the call owes what this one
    would have.
    """
    try:
        reply = await call.forward()
    except CancelledError:
        if await done_all_the_same():
            happened()
        raise
    if reply.ok:
        happened()
    return reply


def created_container(
    final: ContainerHookRequest, container_id: str, envs_sent: dict[str, str]
) -> ContainerHookRequest:
    """The container as the runtime now has it: the final hook request, with its id and the envs it was given."""
    final.container_meta.id = container_id
    final.container_envs.clear()
    final.container_envs.update(envs_sent)
    return final


def updated_container(given: ContainerHookRequest, final: ContainerHookRequest) -> ContainerHookRequest:
    """The container as the runtime has it after an update: what it was given, with the update's resources and annotations."""
    updated = copied(given)
    updated.container_resources.CopyFrom(final.container_resources)
    updated.container_annotations.update(final.container_annotations)
    return updated


# ---------------------------------------------------------------------------------------------
# The flows, one per method


async def run_pod_sandbox(call: Call[AnyReply], request: RunPodSandbox) -> AnyReply:
    call.lifecycle = "RunPodSandbox"
    asked = request.hook_request()
    pod = copied(asked)
    call.concerns(pod)
    rewritten = await call.pre_rewriting(HookType.PRE_RUN_POD_SANDBOX, pod, request.rewritten, asked)
    reply = await call.forward(rewritten)
    if reply.ok:
        call.store.put_pod(reply.created_id, asked, pod)
    return reply


async def create_container(call: Call[AnyReply], request: CreateContainer) -> AnyReply:
    call.lifecycle = "CreateContainer"
    pod = await call.pod(request.sandbox_id)
    if pod is None:
        return await call.forward()
    sent = request.hook_request()
    asked = placed_in_pod(copied(sent), pod.given)
    container = copied(asked)
    call.concerns(container)
    rewritten = await call.pre_rewriting(HookType.PRE_CREATE_CONTAINER, container, request.rewritten, sent)
    reply = await call.forward(rewritten)
    if reply.ok:
        container_id = reply.created_id  # Docker mode reads it from the JSON answer, so once
        asked.container_meta.id = container_id
        given = created_container(container, container_id, request.envs_sent())
        call.store.put_container(container_id, request.sandbox_id, asked, given)
    return reply


async def start_container(call: Call[AnyReply], container_id: str) -> AnyReply:
    call.lifecycle = "StartContainer"
    stored = await call.container(container_id)
    if stored is None:
        return await call.forward()
    container = call.container_request(stored.asked, stored.sandbox_id)
    call.concerns(container)
    await call.pre(HookType.PRE_START_CONTAINER, container)

    def started() -> None:
        if call.store.started(container_id):
            call.post(HookType.POST_START_CONTAINER, call.container_request(stored.asked, stored.sandbox_id))

    return await _forward_changing(call, started, lambda: call.container_now(container_id, ContainerState.RUNNING))


# A running container's environment and cgroup are fixed: no front end's update can change them.
_NOT_IN_ANY_UPDATE = tuple(
    LeftAlone(path, "a container's update cannot change it") for path in ("container_envs", "pod_cgroup_parent")
)


async def update_container_resources(call: Call[AnyReply], request: UpdateContainerResources) -> AnyReply:
    call.lifecycle = "UpdateContainerResources"
    stored = await call.container(request.container_id)
    if stored is None:
        return await call.forward()
    # Hooks are shown kubelet's values, folded: what a hook makes of them is applied to kubelet's
    # request each time, never to what it made of them before.
    asked = folded_update(stored.asked, request.container_id, request.resources(), request.annotations())
    container = call.container_request(asked, stored.sandbox_id)
    call.concerns(container)

    def rewritten(before: ContainerHookRequest, after: ContainerHookRequest) -> Written:
        written = request.rewritten(before, after)
        return Written(written.request, written.left_alone + _NOT_IN_ANY_UPDATE)

    rewritten_request = await call.pre_rewriting(HookType.PRE_UPDATE_CONTAINER_RESOURCES, container, rewritten)
    reply = await call.forward(rewritten_request)
    if reply.ok:
        call.store.revise_container(request.container_id, asked, updated_container(stored.given, container))
    return reply


async def stop_container(call: Call[AnyReply], container_id: str) -> AnyReply:
    call.lifecycle = "StopContainer"
    stored = await call.container(container_id)
    if stored is None:
        return await call.forward()
    container = call.container_request(stored.asked, stored.sandbox_id)
    call.concerns(container)

    def stopped() -> None:
        # kubelet stops again what is stopped already (retries, garbage collection): once per stop.
        if call.store.stopped(container_id):
            call.post(HookType.POST_STOP_CONTAINER, container)

    return await _forward_changing(call, stopped, lambda: call.container_now(container_id, ContainerState.STOPPED))


async def stop_pod_sandbox(call: Call[AnyReply], sandbox_id: str) -> AnyReply:
    call.lifecycle = "StopPodSandbox"
    pod = await call.pod(sandbox_id)
    if pod is None:
        return await call.forward()
    call.concerns(pod.asked)

    def stopped() -> None:
        pod_was_up, containers = call.store.pod_stopped(sandbox_id)
        # The runtime stopped the pod's containers too: a plugin sees every stop that went through koordrp.
        for container in containers:  # copies, in the pod at hand
            call.post(HookType.POST_STOP_CONTAINER, placed_in_pod(container.asked, pod.given))
        if pod_was_up:
            call.post(HookType.POST_STOP_POD_SANDBOX, pod.asked)

    return await _forward_changing(call, stopped, lambda: call.pod_now_stopped(sandbox_id))


async def update_pod_sandbox_resources(call: Call[AnyReply], request: UpdatePodSandboxResources) -> AnyReply:
    """kubelet resizes a pod in place: later container hooks see its new resources."""
    call.lifecycle = "UpdatePodSandboxResources"
    pod = await call.pod(request.sandbox_id)
    if pod is not None:
        call.concerns(pod.asked)
    reply = await call.forward()
    if reply.ok:
        call.store.resize_pod(request.sandbox_id, request.resources(), request.overhead())
    return reply


async def remove_container(call: Call[AnyReply], container_id: str) -> AnyReply:
    call.lifecycle = "RemoveContainer"
    stored = call.store.container(container_id)
    if stored is not None:
        call.concerns(call.container_request(stored.asked, stored.sandbox_id))
    reply = await call.forward()
    if reply.ok:
        call.store.forget_container(container_id)
    return reply


async def remove_pod_sandbox(call: Call[AnyReply], sandbox_id: str) -> AnyReply:
    call.lifecycle = "RemovePodSandbox"
    pod = call.store.pod(sandbox_id)
    if pod is not None:
        call.concerns(pod.asked)
    reply = await call.forward()
    if reply.ok:
        call.store.forget_pod(sandbox_id)
    return reply


async def unreadable(call: Call[AnyReply], method: str, reason: str) -> AnyReply:
    """A ``method`` request koordrp cannot read goes to the runtime as it came, for the runtime's own answer.

    koordrp never refuses what the runtime accepts, so its hooks are skipped (counted, with one
    warning), unless a server that must be heard is subscribed to its pre hook: that server must
    see every such call, so the call is refused (UNREADABLE), naming why.
    """
    call.lifecycle = method
    hooks = METHOD_HOOKS[method]
    for hook in hooks:
        strict = [server for server in call.servers.subscribed(hook) if server.must_be_heard(hook)]
        if strict:
            raise _Refused(
                Refusal(
                    RefusalKind.UNREADABLE,
                    f"koordrp: cannot read the {method} request, which hook server {strict[0].name} "
                    f"(Fail policy) must see at {hook.value}: {shortened(reason)}",
                )
            )
    for hook in hooks:
        subscribed = call.servers.subscribed(hook)
        if subscribed:
            call.not_called(hook, subscribed, UNREADABLE)
    call.log.warn(
        "cannot read the {method} request ({reason}); it goes to the runtime as it came, without hooks",
        method=method,
        reason=shortened(reason),
    )
    return await call.forward()


# ---------------------------------------------------------------------------------------------
# What the runtime has, for the store to agree with

log = Logger()

Inventory = tuple[list[tuple[str, StoredPod]], list[tuple[str, StoredContainer]]]


async def read_everything(runtime: RuntimeInventory, timeout: float | None) -> Inventory:
    """Every Kubernetes pod and container the runtime has, as the store keeps them; each question bounded by ``timeout``.

    One that cannot be read is left out with a warning; one the runtime no longer knows is left
    out; if the runtime cannot be asked, LookupFailed says why.
    """
    sandbox_ids, container_ids = await runtime.listed(timeout)
    pods: dict[str, StoredPod] = {}
    for sandbox_id in sandbox_ids:
        pod = await _readable("pod", sandbox_id, runtime.read_pod(sandbox_id, timeout))
        if pod is not None:
            pods[sandbox_id] = pod

    async def listed_pod(sandbox_id: str) -> PodHookRequest | None:
        found = pods.get(sandbox_id)
        return None if found is None else found.given

    containers: list[tuple[str, StoredContainer]] = []
    for container_id in container_ids:
        stored = await _readable("container", container_id, runtime.read_container(container_id, listed_pod, timeout))
        if stored is not None:
            containers.append((container_id, stored))
    return list(pods.items()), containers


async def _readable(kind: str, identifier: str, reading: Awaitable[Result | None]) -> Result | None:
    try:
        return await reading
    except Unreadable as error:
        log.warn(
            "{kind} {id} cannot be read from the runtime; left out: {error}",
            kind=kind,
            id=shortened(identifier, 80),
            error=shortened(str(error)),
        )
        return None
