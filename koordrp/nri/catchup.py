"""Catching up, at containerd's Synchronize, on the pods and containers made while koordrp was away.

koordrp is away on every node boot, rollout, crash or stall, and containerd goes on without its NRI
plugin meanwhile. Its Synchronize tells of everything that exists when koordrp is back: each running
pod and container koordrp did not see made (the store learnt it from the synchronization, not
``hooked``) gets the pre hooks it missed, in lifecycle order, through the same flows as a live call
(``koordrp.flows``): a pod its PreRunPodSandbox, then each of its containers PreCreateContainer and,
if it runs, PreStartContainer (and PostStartContainer). Every such request is marked
(``CATCH_UP_ANNOTATION``), and a Fail-policy server cannot refuse (``Call``'s ``catch_up``).

What can still change, a container's resources, goes back in the Synchronize reply's ``update``,
which containerd applies to the running containers; a chain whose hooks have not answered by the time
the reply must leave (containerd's deadline less ``ANSWER_MARGIN`` and ``REPLY_SLACK``) sends its
update afterwards with containerd's UpdateContainers, as a late answer does. What cannot change
(environment, annotations, a sandbox) is named ``left alone (late)`` in each call's line.
"""

from __future__ import annotations

from typing import Any, Callable, Coroutine

from twisted.internet.defer import Deferred, DeferredList, ensureDeferred
from twisted.logger import Logger

from koordrp import adapters, flows
from koordrp.api.nri.v1alpha1 import api_pb2 as nri
from koordrp.call import Call, Parts
from koordrp.nri import translate
from koordrp.nri.adapters import LateAnswers, NRIReply
from koordrp.store import ContainerState, StoredContainer, StoredPod
from koordrp.text import shortened

REPLY_SLACK = 0.1
"""Seconds kept, beyond the margin every answer keeps, for writing the reply once the catch-up stops waiting."""

log = Logger()


class _Updates:
    """What the caught-up containers' hooks changed: in the reply while it has not left, with UpdateContainers after."""

    def __init__(self, late: LateAnswers) -> None:
        self._late = late
        self.in_reply: list[nri.ContainerUpdate] = []
        self.replied = False

    async def add(self, update: bytes, subject: str) -> None:
        if not self.replied:
            self.in_reply.extend(nri.UpdateContainersRequest.FromString(update).update)
            return
        try:
            await self._late.send(update)
        except adapters.LateNotApplied as error:
            log.warn("the catch-up of {subject} could not be applied: {error}", subject=subject, error=shortened(str(error)))


class _CatchUpBackend:
    """``adapters.Backend`` of a catch-up call: containerd has made the pod or container already; "forwarding" is
    handing what the hooks changed to ``_Updates``."""

    def __init__(self, updates: _Updates, created_id: str, subject: str) -> None:
        self._updates = updates
        self._created_id = created_id
        self._subject = subject

    async def forward(self, rewritten: bytes | None, timeout: float | None) -> NRIReply:
        if rewritten is not None:
            await self._updates.add(rewritten, self._subject)
        return NRIReply(True, self._created_id)

    async def read_pod(self, sandbox_id: str, timeout: float | None) -> StoredPod | None:
        return None  # the store learnt every pod of the synchronization first

    async def read_container(self, container_id: str, pods: adapters.PodSource, timeout: float | None) -> StoredContainer | None:
        return None


def _missed(stored: StoredPod | StoredContainer | None) -> bool:
    """Made while koordrp was away, and still running: worth its pre hooks."""
    if stored is None or stored.hooked:
        return False
    return not stored.stopped if isinstance(stored, StoredPod) else stored.state is not ContainerState.STOPPED


class CatchUp:
    """One synchronization's catch-up: ``reply`` fires with the updates for containerd's reply."""

    def __init__(self, parts: Parts, late: LateAnswers) -> None:
        self._parts = parts
        self._updates = _Updates(late)

    def reply(self, synchronization: nri.SynchronizeRequest, reply_by: float | None) -> Deferred[list[nri.ContainerUpdate]]:
        """Run the pre hooks the pods and containers of ``synchronization`` missed; fires once they are all done,
        or at ``reply_by`` (the reactor's clock; None: no deadline), with what they changed so far. The chains
        still running go on, and send what they change with UpdateContainers."""
        store = self._parts.store
        containers: dict[str, list[nri.Container]] = {}
        for container in synchronization.containers:
            if _missed(store.container(container.id)):
                containers.setdefault(container.pod_sandbox_id, []).append(container)
        chains = []
        for pod in synchronization.pods:
            pod_missed = _missed(store.pod(pod.id))
            if pod_missed or pod.id in containers:
                chains.append(ensureDeferred(self._pod(pod, pod_missed, containers.get(pod.id, []))))
        replying: Deferred[list[nri.ContainerUpdate]] = Deferred()
        if not chains:
            replying.callback([])
            return replying
        log.info(
            "catching up on {pods} pods and {containers} containers made while koordrp was away",
            pods=len(chains),
            containers=sum(len(found) for found in containers.values()),
        )
        clock = self._parts.clock
        timer = None if reply_by is None else clock.callLater(max(reply_by - clock.seconds(), 0.0), self._reply, replying)

        def done(_: object) -> None:
            if timer is not None and timer.active():
                timer.cancel()
            self._reply(replying)

        DeferredList(chains, consumeErrors=True).addCallback(done)
        return replying

    def _reply(self, replying: Deferred[list[nri.ContainerUpdate]]) -> None:
        if not replying.called:
            self._updates.replied = True
            replying.callback(self._updates.in_reply)

    async def _pod(self, pod: nri.PodSandbox, pod_missed: bool, containers: list[nri.Container]) -> None:
        if pod_missed:
            await self._call("RunPodSandbox", pod.id, lambda call: flows.run_pod_sandbox(call, translate.CaughtUpPod(pod)))
            self._counted("pod")
        for container in containers:  # one after another, as kubelet makes them
            await self._call(
                "CreateContainer", container.id, lambda call: flows.create_container(call, translate.CaughtUpContainer(pod, container))
            )
            self._counted("container")
            if container.state in (nri.CONTAINER_RUNNING, nri.CONTAINER_PAUSED):
                await self._call("StartContainer", container.id, lambda call: flows.start_container(call, container.id))

    async def _call(
        self, method: str, created_id: str, flow: Callable[[Call[NRIReply]], Coroutine[Any, Any, NRIReply]]
    ) -> None:
        subject = f"{method} of {shortened(created_id, 16)}"
        call = Call(
            self._parts,
            f"{method} (catch-up)",
            _CatchUpBackend(self._updates, created_id, subject),
            # Each hook call may take its server's own timeout: what misses the reply follows it.
            None,
            uneventful_line=False,
            catch_up=True,
        )
        await call.run(flow(call))
        call.ended()

    def _counted(self, kind: str) -> None:
        metrics = self._parts.metrics
        if metrics is not None:
            metrics.caught_up.labels(kind).inc()
