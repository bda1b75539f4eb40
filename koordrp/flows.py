"""The lifecycle flows: what each intercepted call does, written once for every front end.

A flow decides, for one lifecycle method, whether hooks are skipped, which pre and post hook stages
run, what is written back into the request, when the runtime is called, and what the store learns or
forgets. It is a coroutine on the reactor, driven by ``koordrp.call.Call``, whichever front end the
call came through; it knows no wire format and no thread, only the front end's adapters
(``koordrp.adapters``).

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

from typing import Awaitable, Callable, Sequence

from twisted.internet.defer import CancelledError

from koordrp.adapters import (
    AnyReply,
    CreateContainer,
    LeftAlone,
    Refusal,
    RefusalKind,
    RunPodSandbox,
    UpdateContainerResources,
    UpdatePodSandboxResources,
    Written,
)
from koordrp.call import Call, Parts, Refused, pod_labels
from koordrp.hooks.messages import (
    Change,
    ContainerHookRequest,
    HookRequest,
    PodHookRequest,
    copied,
    copy_changed,
    folded_update,
    marked_catch_up,
    placed_in_pod,
    subject_text,
)
from koordrp.hooks.types import UNREADABLE, HookServers, HookType, PostStage
from koordrp.checkpoint import Kind
from koordrp.store import ContainerState, OwedStops
from koordrp.text import shortened

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


# The methods whose flow, once the store knows the pod or container the call is about, forwards the
# request as the caller sent it unless a pre hook calls a server, and whether that is a container
# (else a pod). RunPodSandbox's and CreateContainer's flows write a request of their own.
_SENT_AS_IT_CAME = {
    "StartContainer": True,
    "UpdateContainerResources": True,
    "StopContainer": True,
    "RemoveContainer": True,
    "StopPodSandbox": False,
    "RemovePodSandbox": False,
    "UpdatePodSandboxResources": False,
}


def goes_ahead(parts: Parts, servers: HookServers, method: str, subject_id: str) -> bool:
    """Whether a call may go to the runtime before its flow runs: its flow would forward it as it came.

    That is a call about a pod or container the store knows (its flow reads nothing back from the
    runtime first) whose pre hook, if its method has one, would call nobody among ``servers`` (the
    ones the call's flow will use): no server subscribed, or the pod is skipped. A front end that has
    the call on a thread of its own (CRI) spares it the wait for the reactor; the flow runs as ever,
    its forward answered by what was sent ahead.

    It runs on the front end's thread, while the reactor changes the store: it reads the store under its lock
    (``Store.changing``). What it reads besides is not changed once made: the entries, ``servers`` (the
    call's own) and ``parts.skip``. The reactor may not have stored the previous call's outcome yet:
    an entry not there yet only makes the call take the slower way.
    """
    about_container = _SENT_AS_IT_CAME.get(method)
    if about_container is None:
        return False
    store = parts.store
    if not about_container:
        with store.changing:
            return store.has_pod(subject_id)  # no call about a pod has a pre hook
    subscribed = any(servers.subscribed(hook) for hook in METHOD_HOOKS[method] if hook.is_pre)
    with store.changing:
        container = store.container(subject_id)
        if container is None or not subscribed:
            return container is not None
        labels = pod_labels(store, container.asked, container.sandbox_id)
    return parts.skip.skips(labels)


async def _forward_changing(
    call: Call[AnyReply], happened: Callable[[], None], done_all_the_same: Callable[[], Awaitable[bool]]
) -> AnyReply:
    """Forward a call that starts, stops or removes something; ``happened()`` once the runtime has done it.

    This is where a call the caller gives up on (kubelet cancels, its deadline passes) is settled:
    the runtime's call is cancelled with it, but may have done its work all the same. koordrp then
    asks the runtime (``done_all_the_same``, on a bound of its own) and ``happened()`` runs only if
    it says so: a cancelled StopContainer owes PostStopContainer only if the container did stop, a
    cancelled RemoveContainer forgets the container only if it is gone. Otherwise the store keeps
    what it had, and kubelet's repeat of the call owes what this one would have (or the next
    reconcile forgets it).
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


async def _forward_expected(call: Call[AnyReply], rewritten: bytes | None, kind: Kind, made_id: str) -> AnyReply:
    """Forward a call that makes the pod or container the store expects under ``made_id`` (if known); a forward that
    ends in neither answer (the caller or the connection went) leaves it to the store's readings."""
    try:
        return await call.forward(rewritten)
    except BaseException:
        if made_id:
            call.store.not_waited_for(kind, made_id)
        raise


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


async def run_pod_sandbox(call: Call[AnyReply], request: RunPodSandbox, made_id: str = "") -> AnyReply:
    """``made_id``: the sandbox's id, if the front end knows it before it forwards the call (NRI mode's, made already)."""
    call.lifecycle = "RunPodSandbox"
    asked = request.hook_request()
    pod = copied(asked)
    call.concerns(pod)
    rewritten = await call.pre_rewriting(HookType.PRE_RUN_POD_SANDBOX, pod, request.rewritten, asked)
    call.store.expect_pod(asked, made_id)  # kept before the runtime can make it: a koordrp killed meanwhile still has it
    reply = await _forward_expected(call, rewritten, "pods", made_id)
    if reply.ok:
        call.store.put_pod(reply.created_id, asked, pod)
    elif made_id:
        call.store.not_made("pods", made_id)
    return reply


async def create_container(call: Call[AnyReply], request: CreateContainer, made_id: str = "") -> AnyReply:
    """``made_id``: the container's id, if the front end knows it before it forwards the call (NRI mode's)."""
    call.lifecycle = "CreateContainer"
    pod = await call.pod(request.sandbox_id)
    if pod is None:
        return await call.forward()
    sent = request.hook_request()
    asked = placed_in_pod(copied(sent), pod.given)
    container = copied(asked)
    call.concerns(container)
    rewritten = await call.pre_rewriting(HookType.PRE_CREATE_CONTAINER, container, request.rewritten, sent, keep_late=True)
    call.store.expect_container(request.sandbox_id, asked, None if rewritten is None else container, made_id)
    reply = await _forward_expected(call, rewritten, "containers", made_id)
    if reply.ok:
        container_id = reply.created_id  # Docker mode reads it from the JSON answer, so once
        asked.container_meta.id = container_id
        given = created_container(container, container_id, request.envs_sent())
        call.store.put_container(container_id, request.sandbox_id, asked, given)

        def applied_late(answered: ContainerHookRequest, changes: Sequence[Change]) -> None:
            # The runtime has what the late update sent, over the container as it was then (an update kubelet
            # made meanwhile included); kubelet's values stay what hooks are shown.
            stored = call.store.container(container_id)
            if stored is not None:
                call.store.revise_container(container_id, stored.asked, copy_changed(copied(stored.given), answered, changes))

        call.apply_late(container_id, applied_late)
    elif made_id:
        call.store.not_made("containers", made_id)
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
            call.post(HookType.POST_STOP_CONTAINER, placed_in_pod(call.shown(container).asked, pod.given))
        if pod_was_up:
            call.post(HookType.POST_STOP_POD_SANDBOX, call.shown(pod).asked)

    return await _forward_changing(call, stopped, lambda: call.pod_now(sandbox_id, stopped=True))


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
    return await _forward_changing(
        call, lambda: call.store.forget_container(container_id), lambda: call.container_now(container_id, None)
    )


async def remove_pod_sandbox(call: Call[AnyReply], sandbox_id: str) -> AnyReply:
    call.lifecycle = "RemovePodSandbox"
    pod = call.store.pod(sandbox_id)
    if pod is not None:
        call.concerns(pod.asked)
    return await _forward_changing(
        call, lambda: call.store.forget_pod(sandbox_id), lambda: call.pod_now(sandbox_id, stopped=None)
    )


def tell_owed_stops(parts: Parts, stopped: OwedStops) -> None:
    """The post stops owed for pods and containers that stopped, or went, while koordrp was away: told once each,
    marked as catch-up calls (``CATCH_UP_ANNOTATION``), containers before their pods, to the servers registered
    now (a pod with the skip label is spared)."""
    servers = parts.registrations()
    stages = []
    owed: list[tuple[HookType, HookRequest]] = [(HookType.POST_STOP_CONTAINER, c) for c in stopped.containers]
    owed += [(HookType.POST_STOP_POD_SANDBOX, pod) for pod in stopped.pods]
    for hook, request in owed:
        subscribed = servers.subscribed(hook)
        labels = request.labels if isinstance(request, PodHookRequest) else request.pod_labels
        if subscribed and not parts.skip.skips(labels):
            stages.append(PostStage(hook, subscribed, marked_catch_up(copied(request))))
            Call.log.info(
                "{subject} stopped or went without koordrp seeing it: its {hook} is told now, late",
                subject=subject_text(request),
                hook=hook.value,
            )
    if stages:
        parts.dispatcher.announce(stages)


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
            raise Refused(
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
