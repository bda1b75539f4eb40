"""What koordrp told the runtime about each pod and container, by id, safe to use from any thread.

Entries are hook requests: exactly what the next hook for that pod or container is sent, with the
state the pod or container is in as far as koordrp knows (it decides which post hooks are owed).
Every read and write copies, so no caller can change what another one sees.
"""

import threading
from dataclasses import dataclass, replace
from enum import Enum
from typing import Iterable

from koordrp.hooks.messages import ContainerHookRequest, PodHookRequest


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
    # dockerd: State.Status
    "created": ContainerState.CREATED,
    "exited": ContainerState.STOPPED,
    "dead": ContainerState.STOPPED,
}


def runtime_state(name: str) -> ContainerState:
    """The state the store keeps for a container (or a pod's sandbox) the runtime says is in state ``name``."""
    return _RUNTIME_STATES.get(name, ContainerState.RUNNING)


def _copy_pod(pod: PodHookRequest) -> PodHookRequest:
    copied = PodHookRequest()
    copied.CopyFrom(pod)
    return copied


def _copy_container(container: ContainerHookRequest) -> ContainerHookRequest:
    copied = ContainerHookRequest()
    copied.CopyFrom(container)
    return copied


@dataclass(frozen=True)
class StoredPod:
    info: PodHookRequest
    stopped: bool = False
    """Its sandbox is stopped (``runtime_state`` says STOPPED), and its containers with it."""

    def copy(self) -> "StoredPod":
        return StoredPod(_copy_pod(self.info), self.stopped)


@dataclass(frozen=True)
class StoredContainer:
    sandbox_id: str
    info: ContainerHookRequest
    state: ContainerState = ContainerState.CREATED

    def copy(self) -> "StoredContainer":
        return StoredContainer(self.sandbox_id, _copy_container(self.info), self.state)


class Store:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pods: dict[str, StoredPod] = {}
        self._containers: dict[str, StoredContainer] = {}

    def pod(self, sandbox_id: str) -> PodHookRequest | None:
        with self._lock:
            stored = self._pods.get(sandbox_id)
        return None if stored is None else _copy_pod(stored.info)

    def container(self, container_id: str) -> StoredContainer | None:
        with self._lock:
            stored = self._containers.get(container_id)
        return None if stored is None else stored.copy()

    def has_pod(self, sandbox_id: str) -> bool:
        with self._lock:
            return sandbox_id in self._pods

    def has_container(self, container_id: str) -> bool:
        with self._lock:
            return container_id in self._containers

    def put_pod(self, sandbox_id: str, pod: PodHookRequest) -> None:
        """A pod the runtime has just run."""
        stored = StoredPod(_copy_pod(pod))
        with self._lock:
            self._pods[sandbox_id] = stored

    def put_container(self, container_id: str, sandbox_id: str, info: ContainerHookRequest) -> None:
        """A container the runtime has just created."""
        stored = StoredContainer(sandbox_id, _copy_container(info))
        with self._lock:
            self._containers[container_id] = stored

    def revise_container(self, container_id: str, info: ContainerHookRequest) -> None:
        """New information about a container (its resources were updated); one forgotten meanwhile stays forgotten."""
        copied = _copy_container(info)
        with self._lock:
            stored = self._containers.get(container_id)
            if stored is not None:
                self._containers[container_id] = replace(stored, info=copied)

    def started(self, container_id: str) -> bool:
        """The container started: True when koordrp knew it as not running (its PostStartContainer is owed)."""
        return self._enter(container_id, ContainerState.RUNNING)

    def stopped(self, container_id: str) -> bool:
        """The container stopped: True when koordrp knew it as not stopped (its PostStopContainer is owed)."""
        return self._enter(container_id, ContainerState.STOPPED)

    def _enter(self, container_id: str, state: ContainerState) -> bool:
        with self._lock:
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
        with self._lock:
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
        with self._lock:
            self._containers.pop(container_id, None)

    def forget_pod(self, sandbox_id: str) -> None:
        """Forget a pod and every container in it: the runtime removes them with the sandbox."""
        with self._lock:
            self._pods.pop(sandbox_id, None)
            for container_id in [cid for cid, c in self._containers.items() if c.sandbox_id == sandbox_id]:
                del self._containers[container_id]

    def learn(self, pods: Iterable[tuple[str, StoredPod]], containers: Iterable[tuple[str, StoredContainer]]) -> None:
        """Add what the runtime has and the store lacks (after a start or a store miss).

        An entry already present was written by a CRI call that went through koordrp, which is
        at least as fresh as anything read back from the runtime, so it is kept.
        """
        new_pods = [(sandbox_id, pod.copy()) for sandbox_id, pod in pods]
        new_containers = [(container_id, stored.copy()) for container_id, stored in containers]
        with self._lock:
            for sandbox_id, pod in new_pods:
                self._pods.setdefault(sandbox_id, pod)
            for container_id, stored in new_containers:
                self._containers.setdefault(container_id, stored)

    def ids(self) -> tuple[set[str], set[str]]:
        """The pod and container ids known now: what a later reconcile may forget."""
        with self._lock:
            return set(self._pods), set(self._containers)

    def reconcile(
        self,
        pods: list[tuple[str, StoredPod]],
        containers: list[tuple[str, StoredContainer]],
        known_before: tuple[set[str], set[str]],
    ) -> tuple[int, int]:
        """Agree with a listing of the runtime taken after ``known_before``; returns (forgotten, learnt).

        What was known before the listing and is not in it was removed while koordrp could not see
        it, and is forgotten. Entries written after ``known_before`` came from calls the listing may
        have missed, and are kept. Everything listed and unknown is learnt.
        """
        pods_before, containers_before = known_before
        listed_pods = {sandbox_id for sandbox_id, _ in pods}
        listed_containers = {container_id for container_id, _ in containers}
        with self._lock:
            gone_pods = [i for i in pods_before - listed_pods if i in self._pods]
            gone_containers = [i for i in containers_before - listed_containers if i in self._containers]
            for sandbox_id in gone_pods:
                del self._pods[sandbox_id]
            for container_id in gone_containers:
                del self._containers[container_id]
            new = sum(i not in self._pods for i in listed_pods) + sum(
                i not in self._containers for i in listed_containers
            )
        self.learn(pods, containers)
        return len(gone_pods) + len(gone_containers), new

    def sizes(self) -> tuple[int, int]:
        with self._lock:
            return len(self._pods), len(self._containers)
