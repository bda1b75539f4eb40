"""What kubelet asked for each pod and container, and what the runtime was given, by id; changed on the reactor alone.

Entries are hook requests. ``asked`` is kubelet's request as hooks are shown it (folded over
kubelet's updates): every hook request is built from it, so a hook that scales a value scales
kubelet's, once, however often kubelet repeats an update. ``given`` is what the runtime has, the
hooks' changes included: a container's pod, where the container lives, is the pod as given. With
each entry, the state its pod or container is in as far as koordrp knows (it decides which post
hooks are owed). What goes in is copied; what is read is the entry itself, to read and never to
change: the store replaces an entry, it never changes one, so a caller that changes what it read
would change what every other caller sees (tests/unit/test_flows.py checks that no flow does).

One other thread reads the store: a CRI worker deciding whether a call goes ahead
(``koordrp.flows.goes_ahead``). What they share is which entry each id has, and it is guarded by one
lock, ``Store.changing``: the reactor holds it while it puts, replaces or drops an entry, the worker while
it reads; the reactor reads without it, since nothing else changes the store. An entry, once in, is never
changed, so what the worker read stays whole after it lets go.

After a restart the store is rebuilt from the runtime, which knows only ``given``; ``asked`` comes
back from the checkpoint (``koordrp.checkpoint``), where a file is kept for every pod and container koordrp
saw made (``hooked``: its post hooks are owed), with whether its stop was told, and, before the runtime
may make one, under the id it is to have if the front end knows it (NRI), else under a name from what kubelet
calls it (``expect_pod``). A kept file koordrp cannot read
costs a warning naming it, and the entry is marked (``asked_lost``) so that the lines of the calls about
it say their hooks were not shown kubelet's values.
"""

import hashlib
import threading
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import AbstractSet, Callable, Iterable, TypeVar

from google.protobuf.unknown_fields import UnknownFieldSet
from twisted.logger import Logger

from koordrp.checkpoint import Checkpoint, Kind, NoCheckpoint, StateUnreadable
from koordrp.hooks.messages import ContainerHookRequest, HookRequest, PodHookRequest, Resources, copied


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
    hooked: bool = True
    """koordrp saw it made (its pre hooks had their chance) or caught it up: only then are its post hooks owed."""

    @classmethod
    def read_back(cls, pod: PodHookRequest, stopped: bool) -> "StoredPod":
        """A pod as the runtime has it; what kubelet asked is what it was given, unless the store knows better."""
        return cls(pod, pod, stopped, hooked=False)

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
    hooked: bool = True
    """As ``StoredPod.hooked``."""

    @classmethod
    def read_back(cls, sandbox_id: str, container: ContainerHookRequest, state: ContainerState) -> "StoredContainer":
        """A container as the runtime has it; what kubelet asked is what it was given, unless the store knows better."""
        return cls(sandbox_id, container, container, state, hooked=False)

    def copy(self) -> "StoredContainer":
        return replace(self, asked=copied(self.asked), given=copied(self.given))


_RECORD_HEADER = b"K\x01"
"""How a state file begins (a hook request never does: its first byte is a field's tag, and K is a group's)."""
_STOPPED = 0x01
"""Flag: its stop was told (or it was found stopped): no post stop is owed for it any more."""
_CHANGED = 0x02
"""Flag, for a container about to be made: the hooks changed what the runtime is to make of it."""
_EXPECTED = 0x04
"""Flag: kept under the id it is to have before the runtime made it, as a ``pending`` file is: not seen made yet."""
_FLAGS_AT = len(_RECORD_HEADER)
"""Where a state file's flags are: a change of its flags alone is written in place (``Checkpoint.write_byte``)."""


def _body(asked: PodHookRequest | ContainerHookRequest) -> bytes:
    """What kubelet asked, as a state file holds it: the same request gives the same bytes, so that a file written
    before the runtime made it is known to hold it once made (protobuf writes a map's entries in whatever order a
    message's copy keeps them, unless asked to sort them)."""
    return asked.SerializeToString(deterministic=True)


def _record(asked: PodHookRequest | ContainerHookRequest, stopped: bool, changed: bool = False) -> bytes:
    """A state file's content: what kubelet asked, whether its stop was told, whether hooks changed it."""
    flags = (_STOPPED if stopped else 0) | (_CHANGED if changed else 0)
    return _RECORD_HEADER + bytes((flags,)) + _body(asked)


@dataclass(frozen=True)
class Record:
    """A state file, read: what kubelet asked, whether its stop was told, whether hooks changed it."""

    asked: PodHookRequest | ContainerHookRequest
    stopped: bool
    changed: bool = False
    earlier: bool = False
    """Written by an earlier koordrp (no header)."""
    expected: bool = False
    """Kept under its id before the runtime made it (``_EXPECTED``)."""


def _parser(template: type[Request], uid: str | None) -> Callable[[bytes], Record]:
    """How a state file about a pod or container of pod ``uid`` (None: any) is read.

    koordrp writes the fields it knows and no other, about the pod (or a container of the pod) the
    runtime has: bytes that parse into something else were not written by it for this entry. A file
    without the header was written by an earlier koordrp (the request alone), which did not say whether the
    stop was told: it is taken as told, so that no stop is told twice.
    """

    def parse(data: bytes) -> Record:
        flags = _STOPPED
        earlier = not data.startswith(_RECORD_HEADER)
        if not earlier:
            if len(data) < len(_RECORD_HEADER) + 1:
                raise ValueError("shorter than its header")
            flags = data[len(_RECORD_HEADER)]
            data = data[len(_RECORD_HEADER) + 1 :]
        kept = template.FromString(data)
        if len(UnknownFieldSet(kept)):
            raise ValueError(f"not a {template.__name__} as koordrp writes it")
        if uid is not None and kept.pod_meta.uid != uid:
            raise ValueError(f"about pod uid {kept.pod_meta.uid!r}, not {uid!r}")
        return Record(kept, bool(flags & _STOPPED), bool(flags & _CHANGED), earlier, bool(flags & _EXPECTED))

    return parse


def _name(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def pending_pod_name(pod: PodHookRequest) -> str:
    """The name of what is kept for a pod about to be run: what kubelet calls it (the runtime refuses a second
    sandbox of the same name and attempt)."""
    meta = pod.pod_meta
    return _name("pod", meta.namespace, meta.name, meta.uid, str(meta.attempt))


def pending_container_name(sandbox_id: str, container: ContainerHookRequest) -> str:
    """As ``pending_pod_name``, for a container about to be created in ``sandbox_id``."""
    meta = container.container_meta
    return _name("container", sandbox_id, meta.name, str(meta.attempt))


def _as_the_runtime_shows(container: ContainerHookRequest) -> tuple[Resources, dict[str, str]]:
    """What of a container the runtime shows as it was made, whatever the front end: its resources and environment."""
    return container.container_resources, dict(container.container_envs)


@dataclass
class OwedStops:
    """Pods and containers koordrp saw made whose stop it did not see: they stopped, or went, while it was away or
    behind its back. Each owes its post stop, once (what kubelet asked for it, as kept)."""

    pods: list[PodHookRequest] = field(default_factory=list)
    containers: list[ContainerHookRequest] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.pods or self.containers)


@dataclass(frozen=True)
class _Kept:
    """What the state directory says of a pod or container the runtime has."""

    asked: PodHookRequest | ContainerHookRequest
    lost: bool
    hooked: bool
    stopped: bool
    rewrite: bool = False
    """Its state file is to be written as this koordrp writes them (an earlier koordrp's, or none where it kept none)."""


class Store:
    log = Logger()

    def __init__(
        self, checkpoint: Checkpoint | None = None, owed: Callable[[OwedStops], object] = lambda stopped: None
    ) -> None:
        """``owed`` is told of what stopped, or went, while koordrp was away (its post stops are owed)."""
        self._pods: dict[str, StoredPod] = {}
        self._containers: dict[str, StoredContainer] = {}
        self.changing = threading.Lock()
        """Held while an entry is put, replaced or dropped (on the reactor), and by another thread while it reads
        entries; the reactor reads without it."""
        self._checkpoint: Checkpoint = checkpoint if checkpoint is not None else NoCheckpoint()
        self._owed = owed
        self.unreadable_state_files = 0
        """How many times a kept file could not be read (each costs one warning)."""
        self._pending_seen: AbstractSet[str] = frozenset()
        """What was kept for pods and containers about to be made at the previous reconcile."""
        self._expected_seen: AbstractSet[tuple[Kind, str]] = frozenset()
        """As ``_pending_seen``, of what was kept under the ids they were to have."""
        self._expected: dict[tuple[Kind, str], bytes] = {}
        """What this store kept for each pod and container about to be made under the id it is to have (``expect_pod``),
        as written, until the runtime made it."""
        self._as_kept: dict[tuple[Kind, str], tuple[HookRequest, int]] = {}
        """The request and flags each state file this store wrote holds (the request is an entry's ``asked`` itself,
        never changed): a file whose flags alone change is changed in place, and one that would not change is not
        written."""
        self._earlier: bool | None = None

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

    def _set_pod(self, sandbox_id: str, stored: StoredPod) -> None:
        with self.changing:
            self._pods[sandbox_id] = stored

    def _set_container(self, container_id: str, stored: StoredContainer) -> None:
        with self.changing:
            self._containers[container_id] = stored

    def _drop_pod(self, sandbox_id: str) -> StoredPod | None:
        with self.changing:
            return self._pods.pop(sandbox_id, None)

    def _drop_containers(self, container_ids: Iterable[str]) -> list[StoredContainer]:
        with self.changing:
            return [dropped for dropped in (self._containers.pop(i, None) for i in container_ids) if dropped is not None]

    def _keep_pod(self, sandbox_id: str, stored: StoredPod) -> None:
        if stored.hooked:
            self._keep("pods", sandbox_id, stored.asked, _STOPPED if stored.stopped else 0)

    def _keep_container(self, container_id: str, stored: StoredContainer) -> None:
        if stored.hooked:
            self._keep("containers", container_id, stored.asked, _STOPPED if stored.state is ContainerState.STOPPED else 0)

    def _keep(self, kind: Kind, identifier: str, asked: HookRequest, flags: int) -> None:
        """Keep an entry's ``asked`` and ``flags`` in its state file: written whole, or only its flags where the file
        holds that request already (on ext4 a new file costs ten times the CPU of a byte written)."""
        key = (kind, identifier)
        as_kept = self._as_kept.get(key)
        if as_kept is not None and (as_kept[0] is asked or as_kept[0] == asked):
            if as_kept[1] == flags or self._checkpoint.write_byte(kind, identifier, _FLAGS_AT, flags):
                self._as_kept[key] = (asked, flags)
                return
        body = _body(asked)
        kept = self._expected.pop(key, None) == body and self._checkpoint.write_byte(kind, identifier, _FLAGS_AT, flags)
        if kept or self._checkpoint.write(kind, identifier, _RECORD_HEADER + bytes((flags,)) + body):
            self._as_kept[key] = (asked, flags)
        else:
            self._as_kept.pop(key, None)

    def _let_go(self, kind: Kind, identifier: str) -> None:
        """Nothing is kept any more for the pod or container ``identifier``."""
        self._as_kept.pop((kind, identifier), None)
        self._expected.pop((kind, identifier), None)
        self._checkpoint.write(kind, identifier, None)

    def _expect(self, kind: Kind, made_id: str, pending: str, asked: HookRequest, flags: int) -> None:
        """What kubelet asked, kept before the runtime makes it: under ``made_id`` if known (then what it will be
        kept as once made differs by its flags alone), else under the ``pending`` name."""
        body = _body(asked)
        if made_id:
            key = (kind, made_id)
            self._as_kept.pop(key, None)
            if self._checkpoint.write(kind, made_id, _RECORD_HEADER + bytes((flags | _EXPECTED,)) + body):
                self._expected[key] = body
            self._expected_seen -= {key}
        else:
            self._checkpoint.write("pending", pending, _RECORD_HEADER + bytes((flags,)) + body)
            self._pending_seen -= {pending}

    def expect_pod(self, asked: PodHookRequest, made_id: str = "") -> None:
        """The runtime is about to run this pod: what kubelet asked is kept first, so that a koordrp killed before
        it hears that the pod runs still has it (``learn`` takes it). ``made_id``: the id the runtime gives the pod,
        if the front end knows it before it forwards the call (NRI mode)."""
        self._expect("pods", made_id, "" if made_id else pending_pod_name(asked), asked, 0)

    def expect_container(
        self, sandbox_id: str, asked: ContainerHookRequest, changed: ContainerHookRequest | None, made_id: str = ""
    ) -> None:
        """As ``expect_pod``, for a container about to be created in ``sandbox_id``; ``changed``: what the hooks made of
        it, if the runtime is sent their changes (if the runtime then shows it as kubelet asked where the hooks
        changed it, their answer never reached it)."""
        shown_changed = changed is not None and _as_the_runtime_shows(changed) != _as_the_runtime_shows(asked)
        pending = "" if made_id else pending_container_name(sandbox_id, asked)
        self._expect("containers", made_id, pending, asked, _CHANGED if shown_changed else 0)

    def put_pod(self, sandbox_id: str, asked: PodHookRequest, given: PodHookRequest) -> None:
        """A pod the runtime has just run."""
        stored = StoredPod(copied(asked), copied(given))
        self._set_pod(sandbox_id, stored)
        expected = ("pods", sandbox_id) in self._expected
        self._keep_pod(sandbox_id, stored)
        if not expected:
            self._checkpoint.write("pending", pending_pod_name(asked), None)

    def not_made(self, kind: Kind, identifier: str) -> None:
        """The runtime did not make the pod or container expected under ``identifier`` (``expect_pod``,
        ``expect_container``): what was kept for it goes now (a reading would keep it a while, as one about to be
        made)."""
        if self._expected.pop((kind, identifier), None) is not None:
            self._let_go(kind, identifier)

    def awaits_a_reading(self) -> bool:
        """Whether something kept for a pod or container about to be made, and seen neither made nor awaited by one
        reading (a koordrp killed meanwhile left it), waits for the next reading that does not list it, to go."""
        return bool(self._expected_seen or self._pending_seen)

    def not_waited_for(self, kind: Kind, identifier: str) -> None:
        """The flow that expected ``identifier`` ended before it knew whether the runtime made it (its caller or
        its connection went): its file stays, for the readings to settle as one kept before a kill, and nothing
        here holds it any more."""
        self._expected.pop((kind, identifier), None)

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
        self._set_pod(sandbox_id, resized)
        self._keep_pod(sandbox_id, resized)

    def put_container(
        self, container_id: str, sandbox_id: str, asked: ContainerHookRequest, given: ContainerHookRequest
    ) -> None:
        """A container the runtime has just created."""
        stored = StoredContainer(sandbox_id, copied(asked), copied(given))
        self._set_container(container_id, stored)
        expected = ("containers", container_id) in self._expected
        self._keep_container(container_id, stored)
        if not expected:
            self._checkpoint.write("pending", pending_container_name(sandbox_id, asked), None)

    def revise_container(self, container_id: str, asked: ContainerHookRequest, given: ContainerHookRequest) -> None:
        """The runtime took an update of the container; one forgotten meanwhile stays forgotten."""
        asked, given = copied(asked), copied(given)
        stored = self._containers.get(container_id)
        if stored is None:
            return
        revised = replace(stored, asked=asked, given=given)
        self._set_container(container_id, revised)
        self._keep_container(container_id, revised)

    def started(self, container_id: str) -> bool:
        """The container started: True when koordrp knew it as not running (its PostStartContainer is owed, if
        koordrp saw it made)."""
        return self._enter(container_id, ContainerState.RUNNING)

    def stopped(self, container_id: str) -> bool:
        """The container stopped: True when koordrp knew it as not stopped (its PostStopContainer is owed, if
        koordrp saw it made)."""
        return self._enter(container_id, ContainerState.STOPPED)

    def _enter(self, container_id: str, state: ContainerState) -> bool:
        stored = self._containers.get(container_id)
        if stored is None or stored.state is state:
            return False
        entered = replace(stored, state=state)
        self._set_container(container_id, entered)
        if state is ContainerState.STOPPED:
            self._keep_container(container_id, entered)
        return stored.hooked

    def pod_stopped(self, sandbox_id: str) -> tuple[bool, list[StoredContainer]]:
        """The pod stopped, and its containers with it.

        Says whether koordrp knew the pod as not stopped (its PostStopPodSandbox is owed), and which
        of its containers it knew as not stopped (their PostStopContainer are owed), oldest first:
        of those koordrp saw made.
        """
        stored = self._pods.get(sandbox_id)
        newly = stored is not None and not stored.stopped
        if stored is not None and newly:
            stopped_pod = replace(stored, stopped=True)
            self._set_pod(sandbox_id, stopped_pod)
            self._keep_pod(sandbox_id, stopped_pod)
        containers = []
        for container_id, container in self._containers.items():
            if container.sandbox_id == sandbox_id and container.state is not ContainerState.STOPPED:
                stopped = replace(container, state=ContainerState.STOPPED)
                self._set_container(container_id, stopped)  # a value replaced, the size kept: the iteration goes on
                self._keep_container(container_id, stopped)
                if container.hooked:
                    containers.append(container)
        return newly and stored is not None and stored.hooked, [container.copy() for container in containers]

    def unhook(self, container_id: str) -> None:
        """What the hooks made of a container did not reach the runtime: it is taken again for one made while
        koordrp was away (its state file goes)."""
        stored = self._containers.get(container_id)
        if stored is not None:
            self._set_container(container_id, replace(stored, hooked=False))
            self._let_go("containers", container_id)

    def forget_container(self, container_id: str) -> None:
        self._drop_containers((container_id,))
        self._let_go("containers", container_id)

    def forget_pod(self, sandbox_id: str) -> None:
        """Forget a pod and every container in it: the runtime removes them with the sandbox."""
        self._drop_pod(sandbox_id)
        gone = [cid for cid, c in self._containers.items() if c.sandbox_id == sandbox_id]
        self._drop_containers(gone)
        self._let_go("pods", sandbox_id)
        for container_id in gone:
            self._let_go("containers", container_id)

    def learn(self, pods: Iterable[tuple[str, StoredPod]], containers: Iterable[tuple[str, StoredContainer]]) -> None:
        """Add what the runtime has and the store lacks (after a start or a store miss), with what kubelet asked
        from the checkpoint.

        An entry already present was written by a CRI call that went through koordrp, which is
        at least as fresh as anything read back from the runtime, so it is kept (and its checkpoint
        file is not read). One koordrp kept nothing for (where it keeps a file for everything it saw
        made) is not ``hooked``. One it saw made and not stopped, that the runtime has stopped, owes its
        post stop (``owed``).
        """
        self._kept_by_earlier_koordrp()  # looked at once, before any file is rewritten
        owed = OwedStops()
        for sandbox_id, pod in pods:
            if sandbox_id not in self._pods:
                kept = self._kept("pods", sandbox_id, pod.given, pending_pod_name(pod.given))
                assert isinstance(kept.asked, PodHookRequest)
                learnt = replace(pod, asked=kept.asked, given=copied(pod.given), asked_lost=kept.lost, hooked=kept.hooked)
                self._set_pod(sandbox_id, learnt)
                owes = learnt.hooked and learnt.stopped and not kept.stopped and not kept.rewrite
                if owes:
                    owed.pods.append(learnt.asked)
                if owes or kept.rewrite:
                    self._keep_pod(sandbox_id, learnt)
        for container_id, stored in containers:
            if container_id not in self._containers:
                pending = pending_container_name(stored.sandbox_id, stored.given)
                kept = self._kept("containers", container_id, stored.given, pending)
                assert isinstance(kept.asked, ContainerHookRequest)
                learnt_container = replace(
                    stored, asked=kept.asked, given=copied(stored.given), asked_lost=kept.lost, hooked=kept.hooked
                )
                self._set_container(container_id, learnt_container)
                stopped = learnt_container.state is ContainerState.STOPPED
                owes = learnt_container.hooked and stopped and not kept.stopped and not kept.rewrite
                if owes:
                    owed.containers.append(learnt_container.asked)
                if owes or kept.rewrite:
                    self._keep_container(container_id, learnt_container)
        if owed:
            self._owed(owed)

    def _kept(self, kind: Kind, identifier: str, given: Request, pending: str) -> _Kept:
        """What the state directory says of a pod or container the runtime has as ``given``: what kubelet asked
        (or what the runtime has, if nothing was kept), whether something was kept that cannot be read (what the
        runtime has then stands in, said once), whether koordrp saw it made, and whether its stop was told.

        What was kept for it while it was about to be made (``expect_pod``) is taken, and kept under its id as seen made.
        """
        parse = _parser(type(given), given.pod_meta.uid)
        self._as_kept.pop((kind, identifier), None)  # what its file holds is decided here
        for where, name in ((kind, identifier), ("pending", pending)):
            try:
                record = self._checkpoint.read(where, name, parse)
            except StateUnreadable as error:
                self._unreadable(
                    kind, identifier, error, "its hooks are shown what the runtime has instead, which may hold earlier hooks' changes"
                )
                # It was kept, so koordrp saw it made; whether its stop was told is not known: not told twice.
                return _Kept(copied(given), True, True, True)
            if record is None:
                continue
            asked = record.asked
            if where == "pending" or record.expected:
                if where == "pending":
                    self._checkpoint.write("pending", name, None)
                if record.changed and isinstance(given, ContainerHookRequest) and isinstance(asked, ContainerHookRequest) and (
                    _as_the_runtime_shows(given) == _as_the_runtime_shows(asked)
                ):
                    # koordrp was killed before the runtime had the hooks' answer: made as if it were away.
                    self._let_go(kind, identifier)
                    return _Kept(copied(given), False, False, False)
                if isinstance(asked, ContainerHookRequest):
                    asked.container_meta.id = identifier
                self._checkpoint.write(kind, identifier, _record(asked, False))
            return _Kept(asked, False, True, record.stopped, rewrite=record.earlier)
        if self._kept_by_earlier_koordrp():
            # It kept files only for what the hooks changed: what it has none for was seen made all the same.
            return _Kept(copied(given), False, True, False, rewrite=True)
        return _Kept(copied(given), False, not self._checkpoint.remembers, False)

    def _kept_by_earlier_koordrp(self) -> bool:
        """Whether the state directory holds files of an earlier koordrp, read once (then rewritten as they are learnt)."""
        if self._earlier is None:

            def earlier(kind: Kind, name: str) -> bool:
                try:
                    return bool(self._checkpoint.read(kind, name, lambda data: not data.startswith(_RECORD_HEADER)))
                except StateUnreadable:
                    return False

            self._earlier = any(earlier(kind, name) for kind in ("pods", "containers") for name in self._checkpoint.kept(kind))
        return self._earlier

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
        while koordrp could not see it, and is forgotten; so is what was kept in the state directory
        for pods and containers neither known nor listed (removed while koordrp was away). Of those,
        each koordrp saw made and whose stop it did not tell owes its post stop (``owed``). Entries
        written after ``known_before`` came from calls the listing may have missed, and are kept.
        Everything read back and unknown is learnt. What was kept for a pod or container about to be made
        (``expect_pod``, ``expect_container``, pending files) that two readings in a row neither list nor
        see taken goes, unless this store still waits for it: a listing that reads nothing back (NRI
        mode's) counts as a reading for that, so that a file left by a koordrp killed while containerd
        refused the create does not stay for good.
        """
        pods_before, containers_before = known_before
        listed_pods, listed_containers = listed
        gone_pods = [i for i in pods_before - listed_pods if i in self._pods]
        gone_containers = [i for i in containers_before - listed_containers if i in self._containers]
        owed = OwedStops()
        for container in self._drop_containers(gone_containers):
            if container.hooked and container.state is not ContainerState.STOPPED:
                owed.containers.append(container.asked)
        for sandbox_id in gone_pods:
            pod = self._drop_pod(sandbox_id)
            if pod is not None and pod.hooked and not pod.stopped:
                owed.pods.append(pod.asked)
        new = len({i for i, _ in pods} - self._pods.keys()) + len({i for i, _ in containers} - self._containers.keys())
        self.learn(pods, containers)
        # What was kept for pods and containers gone before this koordrp learnt them (it was away), or about to be made.
        expected: set[tuple[Kind, str]] = set()
        for container_id in sorted(self._checkpoint.kept("containers") - listed_containers - self._containers.keys()):
            if container_id not in gone_containers and self._owe(owed.containers, "containers", container_id, ContainerHookRequest):
                expected.add(("containers", container_id))
        for sandbox_id in sorted(self._checkpoint.kept("pods") - listed_pods - self._pods.keys()):
            if sandbox_id not in gone_pods and self._owe(owed.pods, "pods", sandbox_id, PodHookRequest):
                expected.add(("pods", sandbox_id))
        # What was kept for a pod or container about to be made, and not taken since the previous reconcile: its
        # call failed (or was given up before the runtime made it). What this store is waiting for stays.
        spared = expected - self._expected_seen
        self._expected_seen = spared - self._expected.keys()  # what it waits for is seen from when it no longer does
        spared |= self._expected.keys()
        # What was kept for the pods and containers the runtime no longer has goes; not what was kept for
        # those it lists and the store has not learnt (yet: NRI mode learns from Synchronize alone).
        stay: tuple[tuple[Kind, AbstractSet[str]], ...] = (
            ("pods", self._pods.keys() | listed_pods),
            ("containers", self._containers.keys() | listed_containers),
        )
        for kind, staying in stay:
            self._checkpoint.retain(kind, staying | {i for k, i in spared if k == kind})
            kept = self._checkpoint.kept(kind)
            self._as_kept = {key: value for key, value in self._as_kept.items() if key[0] != kind or key[1] in kept}
        pending = self._checkpoint.kept("pending")
        self._checkpoint.retain("pending", pending - self._pending_seen)
        self._pending_seen = pending - self._pending_seen
        if owed:
            self._owed(owed)
        return len(gone_pods) + len(gone_containers), new

    def _owe(self, owed: list[Request], kind: Kind, identifier: str, template: type[Request]) -> bool:
        """The post stop owed for what was kept of a pod or container gone while koordrp was away, if any; True: it was
        kept while about to be made (it may be made yet), and owes none."""
        try:
            record = self._checkpoint.read(kind, identifier, _parser(template, None))
        except StateUnreadable as error:
            self._unreadable(kind, identifier, error, "it went while koordrp was away, and its post stop cannot be told")
            return False
        if record is not None and record.expected:
            return True
        if record is not None and not record.stopped:
            asked = record.asked
            assert isinstance(asked, template)
            owed.append(asked)
        return False

    def _unreadable(self, kind: Kind, identifier: str, error: StateUnreadable, consequence: str) -> None:
        """Something is kept for a pod or container that cannot be read: said once (with ``consequence``), counted."""
        self.unreadable_state_files += 1
        self.log.warn(
            "cannot read what kubelet asked for {kind} {id}, kept in {error}; {consequence}",
            kind=kind[:-1],
            id=identifier,
            error=str(error),
            consequence=consequence,
        )

    def sizes(self) -> tuple[int, int]:
        return len(self._pods), len(self._containers)

    def state_files(self) -> int:
        """How many pods and containers a state file is kept for."""
        return self._checkpoint.count()
