"""What kubelet asked for each pod and container, and what the runtime was given, by id; changed on the reactor alone.

Entries are hook requests. ``asked`` is kubelet's request as hooks are shown it (folded over
kubelet's updates): every hook request is built from it, so a hook that scales a value scales
kubelet's, once, however often kubelet repeats an update. ``given`` is what the runtime has, the
hooks' changes included: a container's pod, where the container lives, is the pod as given. With
each entry, the state its pod or container is in as far as koordrp knows (it decides which post
hooks are owed). What goes in is copied; what is read is the entry itself, to read and never to
change: the store replaces an entry, it never changes one, so a caller that changes what it read
would change what every other caller sees (tests/unit/test_flows.py checks that no flow does). That
is also why a CRI worker may read an entry without the reactor (``koordrp.flows.goes_ahead``): a
dict's read is whole under the GIL, and an entry read is one the store had.

After a restart the store is rebuilt from the runtime, which knows only ``given``; ``asked`` comes
back from the checkpoint (``koordrp.checkpoint``), where it is kept whenever it differs. A kept file
koordrp cannot read costs a warning naming it, and the entry is marked (``asked_lost``) so that the
lines of the calls about it say their hooks were not shown kubelet's values.
"""

from dataclasses import dataclass, replace
from enum import Enum
from typing import AbstractSet, Callable, Iterable, TypeVar

from google.protobuf.unknown_fields import UnknownFieldSet
from twisted.logger import Logger

from koordrp.checkpoint import Checkpoint, Kind, NoCheckpoint, StateUnreadable
from koordrp.hooks.messages import ContainerHookRequest, PodHookRequest, Resources, copied


Request = TypeVar("Request", PodHookRequest, ContainerHookRequest)


class ContainerState(Enum):
    CREATED = "created"
    RUNNING = "running"
    STOPPED = "stopped"


# What the runtimes koordrp fronts call a container's (or a pod sandbox's) state, as the store counts
# its life: one table, so that "stopped" means the same in every mode. CRI's CONTAINER_UNKNOWN and
# dockerd's paused or restarting may well be running: a later stop still owes its PostStopContainer.
_RUNTIME_STATES = {
    # CRI v1 (containerd): ContainerState and PodSandboxState
    "CONTAINER_CREATED": ContainerState.CREATED,
    "CONTAINER_EXITED": ContainerState.STOPPED,
    "SANDBOX_NOTREADY": ContainerState.STOPPED,
    # containerd's NRI: ContainerState
    "CONTAINER_STOPPED": ContainerState.STOPPED,
    # dockerd: State.Status
    "created": ContainerState.CREATED,
    "exited": ContainerState.STOPPED,
    "dead": ContainerState.STOPPED,
}


def runtime_state(name: str) -> ContainerState:
    """The state the store keeps for a container (or a pod's sandbox) the runtime says is in state ``name``."""
    return _RUNTIME_STATES.get(name, ContainerState.RUNNING)


@dataclass(frozen=True)
class StoredPod:
    asked: PodHookRequest
    """kubelet's RunPodSandbox, as hooks see it (with later pod resizes)."""
    given: PodHookRequest
    """What the runtime was given: the pod as it is."""
    stopped: bool = False
    """Its sandbox is stopped (``runtime_state`` says STOPPED), and its containers with it."""
    asked_lost: bool = False
    """What kubelet asked was kept in a file koordrp could not read: ``asked`` is what the runtime has."""

    @classmethod
    def read_back(cls, pod: PodHookRequest, stopped: bool) -> "StoredPod":
        """A pod as the runtime has it; what kubelet asked is what it was given, unless the store knows better."""
        return cls(pod, pod, stopped)

    def copy(self) -> "StoredPod":
        return replace(self, asked=copied(self.asked), given=copied(self.given))


@dataclass(frozen=True)
class StoredContainer:
    sandbox_id: str
    asked: ContainerHookRequest
    """kubelet's CreateContainer (folded over its updates), as hooks see it; its pod fields as at create."""
    given: ContainerHookRequest
    """What the runtime was given."""
    state: ContainerState = ContainerState.CREATED
    asked_lost: bool = False
    """What kubelet asked was kept in a file koordrp could not read: ``asked`` is what the runtime has."""

    @classmethod
    def read_back(cls, sandbox_id: str, container: ContainerHookRequest, state: ContainerState) -> "StoredContainer":
        """A container as the runtime has it; what kubelet asked is what it was given, unless the store knows better."""
        return cls(sandbox_id, container, container, state)

    def copy(self) -> "StoredContainer":
        return replace(self, asked=copied(self.asked), given=copied(self.given))


def _kept(asked: PodHookRequest | ContainerHookRequest, given: PodHookRequest | ContainerHookRequest) -> bytes | None:
    """What the checkpoint keeps: kubelet's request where it differs from the runtime's."""
    return None if asked == given else asked.SerializeToString()


def _parser(given: Request) -> Callable[[bytes], Request]:
    """How a kept request about the pod or container the runtime has as ``given`` is read.

    koordrp writes the fields it knows and no other, about the pod (or a container of the pod) the
    runtime has: bytes that parse into something else were not written by it for this entry.
    """

    def parse(data: bytes) -> Request:
        kept = type(given).FromString(data)
        if len(UnknownFieldSet(kept)):
            raise ValueError(f"not a {type(given).__name__} as koordrp writes it")
        if kept.pod_meta.uid != given.pod_meta.uid:
            raise ValueError(f"about pod uid {kept.pod_meta.uid!r}, not {given.pod_meta.uid!r}")
        return kept

    return parse


class Store:
    log = Logger()

    def __init__(self, checkpoint: Checkpoint | None = None) -> None:
        self._pods: dict[str, StoredPod] = {}
        self._containers: dict[str, StoredContainer] = {}
        self._checkpoint: Checkpoint = checkpoint if checkpoint is not None else NoCheckpoint()
        self.unreadable_state_files = 0
        """How many times a kept file could not be read (each costs one warning)."""

    def pod(self, sandbox_id: str) -> StoredPod | None:
        """The pod's entry itself, to read and never to change: the store replaces an entry, it never changes
        one, so no copy is made on each lifecycle call's way."""
        return self._pods.get(sandbox_id)

    def container(self, container_id: str) -> StoredContainer | None:
        """The container's entry itself, to read and never to change (``pod``)."""
        return self._containers.get(container_id)

    def has_pod(self, sandbox_id: str) -> bool:
        return sandbox_id in self._pods

    def has_container(self, container_id: str) -> bool:
        return container_id in self._containers

    def put_pod(self, sandbox_id: str, asked: PodHookRequest, given: PodHookRequest) -> None:
        """A pod the runtime has just run."""
        stored = StoredPod(copied(asked), copied(given))
        self._pods[sandbox_id] = stored
        self._checkpoint.write("pods", sandbox_id, _kept(asked, given))

    def resize_pod(self, sandbox_id: str, resources: Resources | None, overhead: Resources | None) -> None:
        """The runtime resized the pod (kubelet's UpdatePodSandboxResources): kubelet's values, asked and given."""
        stored = self._pods.get(sandbox_id)
        if stored is None:
            return
        resized = stored.copy()
        for pod in (resized.asked, resized.given):
            if resources is not None:
                pod.resources.CopyFrom(resources)
            if overhead is not None:
                pod.overhead.CopyFrom(overhead)
        self._pods[sandbox_id] = resized
        self._checkpoint.write("pods", sandbox_id, _kept(resized.asked, resized.given))

    def put_container(
        self, container_id: str, sandbox_id: str, asked: ContainerHookRequest, given: ContainerHookRequest
    ) -> None:
        """A container the runtime has just created."""
        stored = StoredContainer(sandbox_id, copied(asked), copied(given))
        self._containers[container_id] = stored
        self._checkpoint.write("containers", container_id, _kept(asked, given))

    def revise_container(self, container_id: str, asked: ContainerHookRequest, given: ContainerHookRequest) -> None:
        """The runtime took an update of the container; one forgotten meanwhile stays forgotten."""
        asked, given = copied(asked), copied(given)
        stored = self._containers.get(container_id)
        if stored is None:
            return
        self._containers[container_id] = replace(stored, asked=asked, given=given)
        self._checkpoint.write("containers", container_id, _kept(asked, given))

    def started(self, container_id: str) -> bool:
        """The container started: True when koordrp knew it as not running (its PostStartContainer is owed)."""
        return self._enter(container_id, ContainerState.RUNNING)

    def stopped(self, container_id: str) -> bool:
        """The container stopped: True when koordrp knew it as not stopped (its PostStopContainer is owed)."""
        return self._enter(container_id, ContainerState.STOPPED)

    def _enter(self, container_id: str, state: ContainerState) -> bool:
        stored = self._containers.get(container_id)
        if stored is None or stored.state is state:
            return False
        self._containers[container_id] = replace(stored, state=state)
        return True

    def pod_stopped(self, sandbox_id: str) -> tuple[bool, list[StoredContainer]]:
        """The pod stopped, and its containers with it.

        Says whether koordrp knew the pod as not stopped (its PostStopPodSandbox is owed), and which
        of its containers it knew as not stopped (their PostStopContainer are owed), oldest first.
        """
        stored = self._pods.get(sandbox_id)
        newly = stored is not None and not stored.stopped
        if stored is not None:
            self._pods[sandbox_id] = replace(stored, stopped=True)
        containers = []
        for container_id, container in self._containers.items():
            if container.sandbox_id == sandbox_id and container.state is not ContainerState.STOPPED:
                self._containers[container_id] = replace(container, state=ContainerState.STOPPED)
                containers.append(container)
        return newly, [container.copy() for container in containers]

    def forget_container(self, container_id: str) -> None:
        self._containers.pop(container_id, None)
        self._checkpoint.write("containers", container_id, None)

    def forget_pod(self, sandbox_id: str) -> None:
        """Forget a pod and every container in it: the runtime removes them with the sandbox."""
        self._pods.pop(sandbox_id, None)
        gone = [cid for cid, c in self._containers.items() if c.sandbox_id == sandbox_id]
        for container_id in gone:
            del self._containers[container_id]
        self._checkpoint.write("pods", sandbox_id, None)
        for container_id in gone:
            self._checkpoint.write("containers", container_id, None)

    def learn(self, pods: Iterable[tuple[str, StoredPod]], containers: Iterable[tuple[str, StoredContainer]]) -> None:
        """Add what the runtime has and the store lacks (after a start or a store miss), with what kubelet asked
        from the checkpoint.

        An entry already present was written by a CRI call that went through koordrp, which is
        at least as fresh as anything read back from the runtime, so it is kept (and its checkpoint
        file is not read).
        """
        for sandbox_id, pod in pods:
            if sandbox_id not in self._pods:
                asked, lost = self._asked("pods", sandbox_id, pod.given)
                self._pods[sandbox_id] = replace(pod, asked=asked, given=copied(pod.given), asked_lost=lost)
        for container_id, stored in containers:
            if container_id not in self._containers:
                container_asked, lost = self._asked("containers", container_id, stored.given)
                self._containers[container_id] = replace(
                    stored, asked=container_asked, given=copied(stored.given), asked_lost=lost
                )

    def _asked(self, kind: Kind, identifier: str, given: Request) -> tuple[Request, bool]:
        """What kubelet asked, as the checkpoint kept it (or what the runtime has, if nothing was kept), and
        whether something was kept that cannot be read (what the runtime has then stands in, said once)."""
        try:
            kept = self._checkpoint.read(kind, identifier, _parser(given))
        except StateUnreadable as error:
            self.unreadable_state_files += 1
            self.log.warn(
                "cannot read what kubelet asked for {kind} {id}, kept in {error}; its hooks are shown what the "
                "runtime has instead, which may hold earlier hooks' changes",
                kind=kind[:-1],
                id=identifier,
                error=str(error),
            )
            return copied(given), True
        return (copied(given), False) if kept is None else (kept, False)

    def ids(self) -> tuple[set[str], set[str]]:
        """The pod and container ids known now: what a later reconcile may forget."""
        return set(self._pods), set(self._containers)

    def reconcile(
        self,
        listed: tuple[AbstractSet[str], AbstractSet[str]],
        pods: list[tuple[str, StoredPod]],
        containers: list[tuple[str, StoredContainer]],
        known_before: tuple[AbstractSet[str], AbstractSet[str]],
    ) -> tuple[int, int]:
        """Agree with a listing of the runtime taken after ``known_before``; returns (forgotten, learnt).

        ``listed`` is the id of every pod and container the runtime has; ``pods`` and ``containers``
        are those of them read back. What was known before the listing and is not in it was removed
        while koordrp could not see it, and is forgotten. Entries written after ``known_before`` came
        from calls the listing may have missed, and are kept. Everything read back and unknown is learnt.
        """
        pods_before, containers_before = known_before
        listed_pods, listed_containers = listed
        gone_pods = [i for i in pods_before - listed_pods if i in self._pods]
        gone_containers = [i for i in containers_before - listed_containers if i in self._containers]
        for sandbox_id in gone_pods:
            del self._pods[sandbox_id]
        for container_id in gone_containers:
            del self._containers[container_id]
        new = len({i for i, _ in pods} - self._pods.keys()) + len({i for i, _ in containers} - self._containers.keys())
        self.learn(pods, containers)
        # What was kept for the pods and containers the runtime no longer has goes; not what was kept for
        # those it lists and the store has not learnt (yet: NRI mode learns from Synchronize alone).
        self._checkpoint.retain("pods", self._pods.keys() | listed_pods)
        self._checkpoint.retain("containers", self._containers.keys() | listed_containers)
        return len(gone_pods) + len(gone_containers), new

    def sizes(self) -> tuple[int, int]:
        return len(self._pods), len(self._containers)

    def state_files(self) -> int:
        """How many pods and containers a state file is kept for."""
        return self._checkpoint.count()
