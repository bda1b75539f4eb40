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

from twisted.python.failure import Failure

from koordrp import adapters, flows
from koordrp.api.nri.v1alpha1 import api_pb2 as nri
from koordrp.call import Call, Parts
from koordrp.nri import translate
from koordrp.nri.adapters import LateAnswers, NRIReply, not_done
from koordrp.store import ContainerState, StoredContainer, StoredPod
from koordrp.text import shortened

REPLY_SLACK = 0.1
"""Seconds kept, beyond the margin every answer keeps, for writing the reply once the catch-up stops waiting."""

log = Logger()


NOT_APPLIED = "late, and not applied"
"""Why what a catch-up call's hooks changed is named left alone when containerd did not take it."""


class _Updates:
    """What the caught-up containers' hooks changed: in the reply while it has not left, with UpdateContainers after."""

    def __init__(self, late: LateAnswers) -> None:
        self._late = late
        self.in_reply: dict[str, nri.ContainerUpdate] = {}
        self.replied = False

    async def add(self, container_id: str, update: bytes) -> str | None:
        """Why containerd did not take ``update`` (an UpdateContainersRequest), if it did not."""
        if not self.replied:
            for each in nri.UpdateContainersRequest.FromString(update).update:
                self.in_reply[container_id] = each
            return None
        try:
            await self._late.send(update)
        except adapters.LateNotApplied as error:
            return str(error)
        return None


class _CatchUpBackend:
    """``adapters.Backend`` of a catch-up call: containerd has made the pod or container already; "forwarding" is
    handing what the hooks changed to ``_Updates``, and what the flow then stores is what still exists."""

    def __init__(self, parts: Parts, updates: _Updates, pod_id: str, container_id: str | None) -> None:
        self._store = parts.store
        self._updates = updates
        self._pod_id = pod_id
        self._container_id = container_id

    async def forward(self, rewritten: bytes | None, timeout: float | None) -> NRIReply:
        created = self._container_id or self._pod_id
        if rewritten is not None and self._container_id is not None:
            refused = await self._updates.add(self._container_id, rewritten)
            if refused is not None:
                return NRIReply(False, created, f"containerd did not take the update: {shortened(refused)}")
        # containerd's events while the hooks were asked win: a pod or container gone or stopped meanwhile stays so.
        if self._container_id is None:
            pod = self._store.pod(self._pod_id)
            gone = pod is None or pod.stopped
        else:
            container = self._store.container(self._container_id)
            gone = container is None or container.state is ContainerState.STOPPED
        return NRIReply(not gone, created, "containerd stopped or removed it meanwhile" if gone else "")

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
    """One synchronization's catch-up: ``reply`` fires with the updates for containerd's reply.

    ``catching_up`` holds the ids of what is being caught up now, by any connection's synchronization: a
    reconnect while a chain still waits on a hook does not call its hooks a second time.
    """

    def __init__(self, parts: Parts, late: LateAnswers, catching_up: set[str]) -> None:
        self._parts = parts
        self._updates = _Updates(late)
        self._catching_up = catching_up

    def reply(self, synchronization: nri.SynchronizeRequest, reply_by: float | None) -> Deferred[list[nri.ContainerUpdate]]:
        """Run the pre hooks the pods and containers of ``synchronization`` missed; fires once they are all done,
        or at ``reply_by`` (the reactor's clock; None: no deadline), with what they changed so far. The chains
        still running go on, and send what they change with UpdateContainers."""
        store = self._parts.store
        containers: dict[str, list[nri.Container]] = {}
        for container in synchronization.containers:
            if container.id not in self._catching_up and _missed(store.container(container.id)):
                containers.setdefault(container.pod_sandbox_id, []).append(container)
        chains = []
        pods_missed = 0
        for pod in synchronization.pods:
            pod_missed = pod.id not in self._catching_up and _missed(store.pod(pod.id))
            pods_missed += pod_missed
            if pod_missed or pod.id in containers:
                ids = [pod.id] if pod_missed else []
                ids += [container.id for container in containers.get(pod.id, [])]
                self._catching_up.update(ids)
                chain = ensureDeferred(self._pod(pod, pod_missed, containers.get(pod.id, [])))
                chains.append(chain.addErrback(self._failed, pod).addBoth(self._done, ids))
        replying: Deferred[list[nri.ContainerUpdate]] = Deferred()
        if not chains:
            replying.callback([])
            return replying
        log.info(
            "catching up on what containerd made while koordrp was away: {pods} pods, {containers} containers",
            pods=pods_missed,
            containers=sum(len(found) for found in containers.values()),
        )
        clock = self._parts.clock
        timer = None if reply_by is None else clock.callLater(max(reply_by - clock.seconds(), 0.0), self._reply, replying)

        def done(_: object) -> None:
            if timer is not None and timer.active():
                timer.cancel()
            self._reply(replying)

        DeferredList(chains).addCallback(done)
        return replying

    def _reply(self, replying: Deferred[list[nri.ContainerUpdate]]) -> None:
        if not replying.called:
            self._updates.replied = True
            replying.callback(list(self._updates.in_reply.values()))

    def not_replied(self) -> None:
        """The reply that carried the updates never reached containerd: what they were for is caught up again at
        the next synchronization."""
        for container_id in self._updates.in_reply:
            self._parts.store.unhook(container_id)

    def _failed(self, failure: Failure, pod: nri.PodSandbox) -> None:
        log.failure("catching up on pod {namespace}/{name} failed inside koordrp", failure, namespace=pod.namespace, name=pod.name)

    def _done(self, result: object, ids: list[str]) -> object:
        self._catching_up.difference_update(ids)
        return result

    async def _pod(self, pod: nri.PodSandbox, pod_missed: bool, containers: list[nri.Container]) -> None:
        if pod_missed:
            if not await self._call("RunPodSandbox", pod.id, None, lambda call: flows.run_pod_sandbox(call, translate.CaughtUpPod(pod), pod.id)):
                return
            self._counted("pod")
        for container in containers:  # one after another, as kubelet makes them
            create = translate.CaughtUpContainer(pod, container)
            if not await self._call("CreateContainer", pod.id, container.id, lambda call: flows.create_container(call, create, container.id)):
                continue
            self._counted("container")
            if container.state in (nri.CONTAINER_RUNNING, nri.CONTAINER_PAUSED):
                await self._call("StartContainer", pod.id, container.id, lambda call: flows.start_container(call, container.id))

    async def _call(
        self,
        method: str,
        pod_id: str,
        container_id: str | None,
        flow: Callable[[Call[NRIReply]], Coroutine[Any, Any, NRIReply]],
    ) -> bool:
        """One catch-up call through its flow; whether containerd has what it is about, as the hooks left it."""
        call = Call(
            self._parts,
            f"{method} (catch-up)",
            _CatchUpBackend(self._parts, self._updates, pod_id, container_id),
            # Each hook call may take its server's own timeout: what misses the reply follows it.
            None,
            uneventful_line=False,
            catch_up=True,
        )
        outcome = await call.run(flow(call))
        if isinstance(outcome, NRIReply) and not outcome.ok:
            not_done(call, outcome.why_not, NOT_APPLIED)
        call.ended()
        return isinstance(outcome, NRIReply) and outcome.ok

    def _counted(self, kind: str) -> None:
        metrics = self._parts.metrics
        if metrics is not None:
            metrics.caught_up.labels(kind).inc()
