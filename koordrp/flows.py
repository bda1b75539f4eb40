"""The lifecycle flows: what each intercepted call does, written once for both front ends.

A flow decides, for one lifecycle method, whether hooks are skipped, which pre and post hook stages
run, what is written back into the request, when the runtime is called, and what the store learns or
forgets. It knows neither threads, nor the reactor, nor a wire format: it is a coroutine driving small
protocols that each front end implements.

- ``Stages`` run pre hook stages. CRI mode's are blocking (``koordrp.cri.bridge``: a grpc worker
  waits for the reactor); Docker mode's are the dispatcher's Deferreds, awaited on the reactor. Post
  stages wait in the ``Call`` until it has answered (``Call.answered``).
- ``Backend`` is the runtime behind the front end, for one call: forwarding the call (rewritten or as
  received) and reading back what the store lacks.
- The request protocols (``RunPodSandbox``, ``CreateContainer``, ``UpdateContainerResources``) are
  the call's own request: turned into a hook request, and written back once the hooks changed it.

CRI mode runs a flow to its end on the worker thread (``run_blocking``: nothing it awaits ever
suspends); Docker mode awaits it on the reactor.

The rules, method by method (docs/architecture.md tells where each one changes):

==========================  ===========================  ======================  ==================
method                      pre stage (written back)     post stage              store, on success
==========================  ===========================  ======================  ==================
RunPodSandbox               PreRunPodSandbox             —                       the pod
CreateContainer             PreCreateContainer           —                       the container
StartContainer              PreStartContainer (nothing)  PostStartContainer      —
UpdateContainerResources    PreUpdateContainerResources  —                       the container
StopContainer               —                            PostStopContainer       —
StopPodSandbox              —                            PostStopPodSandbox      —
RemoveContainer             —                            —                       forgets it
RemovePodSandbox            —                            —                       forgets it and its containers
==========================  ===========================  ======================  ==================

A pod labelled with the skip label gets no hook call (each skipped call is counted); a pod or
container the store does not know is read back from the runtime, and if the runtime does not know it
either, the call goes to the runtime unchanged and without hooks, for the runtime's own answer.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Coroutine, Generic, Mapping, Protocol, TypeVar

from twisted.logger import Logger

from koordrp.calllog import CallRecord
from koordrp.hooks.messages import ContainerHookRequest, HookRequest, PodHookRequest
from koordrp.hooks.types import (
    SENT,
    SKIPPED,
    UNREADABLE,
    FailurePolicy,
    HookCall,
    HookServers,
    HookType,
    PostStage,
    StageOutcome,
    Subscribers,
)
from koordrp.store import Store, StoredContainer, StoredPod
from koordrp.text import shortened

if TYPE_CHECKING:
    from koordrp.hooks.dispatcher import Dispatcher

Result = TypeVar("Result")
Request = TypeVar("Request", PodHookRequest, ContainerHookRequest)


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


class LookupFailed(Exception):
    """The runtime could not say (unreachable, or an answer koordrp cannot read); the text says why."""


class Unreadable(LookupFailed):
    """The runtime answered about one pod or container with something koordrp cannot read."""


class Stages(Protocol):
    """Running pre hook stages. A stage changes its request in place, as each server's answer is merged."""

    def run(self, hook: HookType, servers: Subscribers, request: HookRequest) -> Awaitable[StageOutcome]: ...


PodSource = Callable[[str], Awaitable[PodHookRequest | None]]
"""Where a container read back from the runtime finds its pod, by sandbox id."""


class RuntimeReader(Protocol):
    """Reading pods and containers back from the runtime, as the store keeps them.

    None: the runtime does not know the id (or it is not a Kubernetes one); LookupFailed: it
    could not say; Unreadable: it answered with something koordrp cannot read.
    """

    def read_pod(self, sandbox_id: str) -> Awaitable[StoredPod | None]: ...

    def read_container(self, container_id: str, pods: PodSource) -> Awaitable[StoredContainer | None]: ...


class RuntimeInventory(RuntimeReader, Protocol):
    def listed(self) -> Awaitable[tuple[list[str], list[str]]]:
        """The ids of every Kubernetes pod sandbox and container the runtime has."""


class Backend(RuntimeReader, Protocol[AnyReply_co]):
    """The runtime behind the front end, for one call."""

    def forward(self, rewritten: bytes | None) -> Awaitable[AnyReply_co]:
        """Send the call on: ``rewritten`` as its request, or (None) exactly what the caller sent."""


class RunPodSandbox(Protocol):
    def hook_request(self) -> PodHookRequest: ...

    def rewritten(self, before: PodHookRequest, after: PodHookRequest) -> bytes | None:
        """The request with what the hooks changed between ``before`` and ``after``; None: nothing changed."""


class CreateContainer(Protocol):
    @property
    def sandbox_id(self) -> str: ...

    def hook_request(self, pod: PodHookRequest) -> ContainerHookRequest: ...

    def rewritten(self, before: ContainerHookRequest, after: ContainerHookRequest) -> bytes | None: ...

    def envs_sent(self) -> dict[str, str]:
        """The environment the runtime is given, as a map (after ``rewritten``)."""


class UpdateContainerResources(Protocol):
    @property
    def container_id(self) -> str: ...

    def hook_request(self, stored: ContainerHookRequest) -> ContainerHookRequest:
        """The stored container with the update's values on top."""

    def rewritten(self, before: ContainerHookRequest, after: ContainerHookRequest) -> bytes | None: ...


class HookFailed(Exception):
    """A Fail-policy hook server could not be heard: the call fails with this message, unforwarded."""


class UnreadableRequest(Exception):
    """A request koordrp cannot read, which a Fail-policy server must see: the call fails with this message."""


# The hook points of each CRI method (Docker calls stand for one of them).
METHOD_HOOKS: dict[str, tuple[HookType, ...]] = {
    "RunPodSandbox": (HookType.PRE_RUN_POD_SANDBOX,),
    "CreateContainer": (HookType.PRE_CREATE_CONTAINER,),
    "StartContainer": (HookType.PRE_START_CONTAINER, HookType.POST_START_CONTAINER),
    "UpdateContainerResources": (HookType.PRE_UPDATE_CONTAINER_RESOURCES,),
    "StopContainer": (HookType.POST_STOP_CONTAINER,),
    "StopPodSandbox": (HookType.POST_STOP_CONTAINER, HookType.POST_STOP_POD_SANDBOX),
    "RemoveContainer": (),
    "RemovePodSandbox": (),
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
    dispatcher: Dispatcher
    registrations: Callable[[], HookServers]
    """The hook servers in force now."""
    skip: SkipLabel


class Call(Generic[AnyReply]):
    """One intercepted call: the hook servers in force when it arrived, its front end's stages and backend.

    What a call owes once it has answered (its post stages, counting the hook calls it spared, its
    log line) waits in the call until the front end calls ``answered`` on the reactor: in CRI mode
    that is one crossing into the reactor per call, made once the answer has left.
    """

    log = Logger()

    def __init__(self, parts: Parts, method: str, stages: Stages, backend: Backend[AnyReply]) -> None:
        self.store = parts.store
        self._skip = parts.skip
        self._dispatcher = parts.dispatcher
        self.servers = parts.registrations()
        self.stages = stages
        self.backend = backend
        self.record = CallRecord(method)
        self.posts: list[PostStage] = []
        self._skipping = False

    def concerns(self, labels: Mapping[str, str]) -> None:
        """The call is about the pod with these labels: whether its hooks are skipped."""
        self._skipping = self._skip.skips(labels)

    def _callees(self, hook: HookType) -> Subscribers:
        """The servers to call: none when nobody subscribed, or when the pod is skipped (counted)."""
        subscribed = self.servers.subscribed(hook)
        if subscribed and self._skipping:
            self.not_called(hook, subscribed, SKIPPED)
            return ()
        return subscribed

    def not_called(self, hook: HookType, servers: Subscribers, result: str) -> None:
        """Record the calls to ``servers`` that ``result`` (SKIPPED, UNREADABLE) spared; ``answered`` counts them."""
        self.record.add(HookCall(server, hook, result) for server in servers)

    def answered(self) -> None:
        """On the reactor, once the call has answered: its post stages start and the calls it spared are counted."""
        if self.posts:
            self._dispatcher.announce(self.posts)
        self._dispatcher.count_not_made(self.record.calls)

    async def _run(self, hook: HookType, callees: Subscribers, request: HookRequest) -> None:
        outcome = await self.stages.run(hook, callees, request)
        self.record.add(outcome.calls)
        if outcome.failure is not None:
            raise HookFailed(outcome.failure.message)

    async def pre(self, hook: HookType, request: HookRequest) -> None:
        """Run a pre stage on ``request``, which comes back changed by the hooks."""
        self.record.subject = request
        callees = self._callees(hook)
        if callees:
            await self._run(hook, callees, request)

    async def pre_rewriting(
        self, hook: HookType, request: Request, rewritten: Callable[[Request, Request], bytes | None]
    ) -> bytes | None:
        """Run a pre stage and write what it changed into the call's request; None: forward it as received.

        ``rewritten`` runs even when no hook is called: what the store knows may still differ
        from what the caller sent (a pod's cgroup parent, set by hooks when it ran).
        """
        self.record.subject = request
        callees = self._callees(hook)
        before = copy.deepcopy(request) if callees else request
        if callees:
            await self._run(hook, callees, request)
        return rewritten(before, request)

    def post(self, hook: HookType, request: HookRequest) -> None:
        self.record.subject = request
        callees = self._callees(hook)
        if callees:
            self.posts.append(PostStage(hook, callees, request))
            self.record.add(HookCall(server, hook, SENT) for server in callees)

    async def pod(self, sandbox_id: str) -> PodHookRequest | None:
        """The pod from the store, or read back from the runtime (and remembered) if the store lacks it."""
        pod = self.store.pod(sandbox_id)
        if pod is None and sandbox_id:
            stored = await self._read_back("pod", sandbox_id, self.backend.read_pod)
            if stored is not None:
                self.store.learn([(sandbox_id, stored)], [])
                pod = stored.info
        return pod

    async def container(self, container_id: str) -> StoredContainer | None:
        """The container from the store, or read back from the runtime (and remembered), with its pod."""
        stored = self.store.container(container_id)
        if stored is None and container_id:
            stored = await self._read_back(
                "container", container_id, lambda identifier: self.backend.read_container(identifier, self.pod)
            )
            if stored is not None:
                self.store.learn([], [(container_id, stored)])
        return stored

    async def _read_back(
        self, kind: str, identifier: str, read: Callable[[str], Awaitable[Result | None]]
    ) -> Result | None:
        try:
            return await read(identifier)
        except LookupFailed as error:
            self.log.warn(
                "{kind} {id} is not in the store and could not be read from the runtime: {error}",
                kind=kind,
                id=shortened(identifier, 80),
                error=shortened(str(error)),
            )
            return None


def created_container(
    final: ContainerHookRequest, container_id: str, envs_sent: dict[str, str]
) -> ContainerHookRequest:
    """The container as the runtime now has it: the final hook request, with its id and the envs it was given."""
    final.container_meta.id = container_id
    final.container_envs.clear()
    final.container_envs.update(envs_sent)
    return final


# ---------------------------------------------------------------------------------------------
# The flows, one per method


async def run_pod_sandbox(call: Call[AnyReply], request: RunPodSandbox) -> AnyReply:
    pod = request.hook_request()
    call.concerns(pod.labels)
    rewritten = await call.pre_rewriting(HookType.PRE_RUN_POD_SANDBOX, pod, request.rewritten)
    reply = await call.backend.forward(rewritten)
    if reply.ok:
        call.store.put_pod(reply.created_id, pod)
    return reply


async def create_container(call: Call[AnyReply], request: CreateContainer) -> AnyReply:
    pod = await call.pod(request.sandbox_id)
    if pod is None:
        return await call.backend.forward(None)
    call.concerns(pod.labels)
    container = request.hook_request(pod)
    rewritten = await call.pre_rewriting(HookType.PRE_CREATE_CONTAINER, container, request.rewritten)
    reply = await call.backend.forward(rewritten)
    if reply.ok:
        container_id = reply.created_id  # Docker mode reads it from the JSON answer, so once
        call.store.put_container(container_id, request.sandbox_id, created_container(container, container_id, request.envs_sent()))
    return reply


async def start_container(call: Call[AnyReply], container_id: str) -> AnyReply:
    stored = await call.container(container_id)
    if stored is None:
        return await call.backend.forward(None)
    container = stored.info
    call.concerns(container.pod_labels)
    await call.pre(HookType.PRE_START_CONTAINER, container)
    reply = await call.backend.forward(None)
    if reply.ok and call.store.started(container_id):
        call.post(HookType.POST_START_CONTAINER, container)
    return reply


async def update_container_resources(call: Call[AnyReply], request: UpdateContainerResources) -> AnyReply:
    stored = await call.container(request.container_id)
    if stored is None:
        return await call.backend.forward(None)
    container = request.hook_request(stored.info)
    call.concerns(container.pod_labels)
    hook = HookType.PRE_UPDATE_CONTAINER_RESOURCES
    rewritten = await call.pre_rewriting(hook, container, request.rewritten)
    reply = await call.backend.forward(rewritten)
    if reply.ok:
        call.store.revise_container(request.container_id, container)
    return reply


async def stop_container(call: Call[AnyReply], container_id: str) -> AnyReply:
    stored = await call.container(container_id)
    reply = await call.backend.forward(None)
    # kubelet stops again what is stopped already (retries, garbage collection): once per stop.
    if reply.ok and stored is not None and call.store.stopped(container_id):
        call.concerns(stored.info.pod_labels)
        call.post(HookType.POST_STOP_CONTAINER, stored.info)
    return reply


async def stop_pod_sandbox(call: Call[AnyReply], sandbox_id: str) -> AnyReply:
    pod = await call.pod(sandbox_id)
    reply = await call.backend.forward(None)
    if reply.ok and pod is not None:
        pod_was_up, containers = call.store.pod_stopped(sandbox_id)
        call.concerns(pod.labels)
        # The runtime stopped the pod's containers too: a plugin sees every stop that went through koordrp.
        for container in containers:
            call.post(HookType.POST_STOP_CONTAINER, container.info)
        if pod_was_up:
            call.post(HookType.POST_STOP_POD_SANDBOX, pod)
    return reply


async def remove_container(call: Call[AnyReply], container_id: str) -> AnyReply:
    stored = call.store.container(container_id)
    call.record.subject = stored.info if stored is not None else None
    reply = await call.backend.forward(None)
    if reply.ok:
        call.store.forget_container(container_id)
    return reply


async def remove_pod_sandbox(call: Call[AnyReply], sandbox_id: str) -> AnyReply:
    call.record.subject = call.store.pod(sandbox_id)
    reply = await call.backend.forward(None)
    if reply.ok:
        call.store.forget_pod(sandbox_id)
    return reply


async def unreadable(call: Call[AnyReply], method: str, reason: str) -> AnyReply:
    """A ``method`` request koordrp cannot read goes to the runtime as it came, for the runtime's own answer.

    koordrp never refuses what the runtime accepts, so its hooks are skipped (counted, with one
    warning), unless a Fail-policy server is subscribed to its pre hook: that server must see
    every such call, so the call fails (UnreadableRequest), naming why.
    """
    hooks = METHOD_HOOKS[method]
    for hook in (hook for hook in hooks if hook.is_pre):
        strict = [server for server in call.servers.subscribed(hook) if server.failure_policy is FailurePolicy.FAIL]
        if strict:
            raise UnreadableRequest(
                f"koordrp: cannot read the {method} request, which hook server {strict[0].name} "
                f"(Fail policy) must see at {hook.value}: {shortened(reason)}"
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
    return await call.backend.forward(None)


# ---------------------------------------------------------------------------------------------
# What the runtime has, for the store to agree with

log = Logger()

Inventory = tuple[list[tuple[str, StoredPod]], list[tuple[str, StoredContainer]]]


async def read_everything(runtime: RuntimeInventory) -> Inventory:
    """Every Kubernetes pod and container the runtime has, as the store keeps them.

    One that cannot be read is left out with a warning; one the runtime no longer knows is left
    out; if the runtime cannot be asked, LookupFailed says why.
    """
    sandbox_ids, container_ids = await runtime.listed()
    pods: dict[str, StoredPod] = {}
    for sandbox_id in sandbox_ids:
        pod = await _readable("pod", sandbox_id, runtime.read_pod(sandbox_id))
        if pod is not None:
            pods[sandbox_id] = pod

    async def listed_pod(sandbox_id: str) -> PodHookRequest | None:
        found = pods.get(sandbox_id)
        return None if found is None else found.info

    containers: list[tuple[str, StoredContainer]] = []
    for container_id in container_ids:
        stored = await _readable("container", container_id, runtime.read_container(container_id, listed_pod))
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


# ---------------------------------------------------------------------------------------------
# Driving a flow where nothing suspends


def run_blocking(flow: Coroutine[Any, Any, Result]) -> Result:
    """Run ``flow`` to its end in this thread: for stages and backends that block instead of suspending."""
    try:
        flow.send(None)
    except StopIteration as done:
        result: Result = done.value
        return result
    flow.close()
    raise RuntimeError("a flow run in a thread waited on something that only an event loop can finish")
