"""Stages and a runtime for driving ``koordrp.flows`` directly, answering at once and recording everything."""

import copy
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from twisted.internet.defer import Deferred, succeed

from koordrp.adapters import LookupFailed, PodSource
from koordrp.hooks.messages import HookRequest, HookResponse, PodHookRequest, merge_response
from koordrp.hooks.types import HOOK_OK, HookCall, HookFailure, HookServerConfig, HookType, PostStage, StageOutcome, Subscribers
from koordrp.store import StoredContainer, StoredPod


@dataclass
class StageRecord:
    hook: HookType
    servers: list[str]
    request: HookRequest
    """A copy of the request as the stage was given it."""


@dataclass
class ScriptedStages:
    """``Stages`` whose servers all answer ``answers[hook]`` (or what ``behaviours[hook]`` makes of the
    request), merged as the dispatcher merges, or fail."""

    answers: dict[HookType, HookResponse] = field(default_factory=dict)
    behaviours: dict[HookType, Callable[[HookRequest], HookResponse]] = field(default_factory=dict)
    budgets: list[float | None] = field(default_factory=list)
    failures: dict[HookType, str] = field(default_factory=dict)
    ran: list[StageRecord] = field(default_factory=list)
    announced: list[PostStage] = field(default_factory=list)
    not_made: list[HookCall] = field(default_factory=list)
    drains: list[float] = field(default_factory=list)
    """The bound of each drain asked for."""
    pending: dict[HookType, "Deferred[None]"] = field(default_factory=dict)
    """A stage of these hooks waits until its Deferred fires (or is cancelled with the call)."""
    posts_skipped: dict[str, str] = field(default_factory=dict)
    """Why the post hooks of a server (by name) are skipped."""

    def announce(self, stages: Sequence[PostStage]) -> None:
        self.announced.extend(stages)

    def count_not_made(self, calls: Iterable[HookCall]) -> None:
        self.not_made.extend(calls)

    def skips_post(self, server: HookServerConfig) -> str | None:
        return self.posts_skipped.get(server.name)

    def drain(self, timeout: float) -> "Deferred[None]":
        self.drains.append(timeout)
        return succeed(None)

    async def run(
        self, hook: HookType, servers: Subscribers, request: HookRequest, budget: float | None, keep_late: bool = False
    ) -> StageOutcome:
        waiting = self.pending.get(hook)
        if waiting is not None:
            await waiting
        self.ran.append(StageRecord(hook, [server.name for server in servers], copy.deepcopy(request)))
        self.budgets.append(budget)
        reason = self.failures.get(hook)
        if reason is not None:
            return StageOutcome(request, HookFailure(servers[0], hook, reason))
        calls = []
        for server in servers:
            behaviour = self.behaviours.get(hook)
            answer = behaviour(request) if behaviour is not None else self.answers.get(hook)
            changes = merge_response(request, answer, server.apply_pod_resources) if answer is not None else []
            calls.append(HookCall(server, hook, HOOK_OK, 0.001, tuple(changes)))
        return StageOutcome(request, calls=calls)

    def hooks_run(self) -> list[HookType]:
        return [record.hook for record in self.ran]


@dataclass(frozen=True)
class Reply:
    ok: bool
    created_id: str

    @property
    def label(self) -> str:
        return "OK" if self.ok else "FAILED"


@dataclass
class RecordingRuntime:
    """``adapters.Backend``: records what is forwarded, answers ``ok`` with ``created_id``, knows ``pods``/``containers``."""

    ok: bool = True
    created_id: str = "created-1"
    pods: dict[str, PodHookRequest] = field(default_factory=dict)
    stopped_pods: set[str] = field(default_factory=set)
    containers: dict[str, StoredContainer] = field(default_factory=dict)
    broken: str | None = None
    """Set: every read-back fails with this reason."""
    forwarded: list[bytes | None] = field(default_factory=list)
    read_back: list[str] = field(default_factory=list)
    timeouts: list[float | None] = field(default_factory=list)
    """The timeout each forwarded call and read-back was given, in order."""
    answering: "Deferred[None] | None" = None
    """Set: forwarded calls wait until it fires (or is cancelled with the call)."""
    cancelled: int = 0

    async def forward(self, rewritten: bytes | None, timeout: float | None) -> Reply:
        self.forwarded.append(rewritten)
        self.timeouts.append(timeout)
        if self.answering is not None:
            try:
                await self.answering
            except Exception:
                self.cancelled += 1
                raise
        return Reply(self.ok, self.created_id)

    async def read_pod(self, sandbox_id: str, timeout: float | None) -> StoredPod | None:
        self.timeouts.append(timeout)
        self.read_back.append(sandbox_id)
        if self.broken is not None:
            raise LookupFailed(self.broken)
        pod = self.pods.get(sandbox_id)
        return StoredPod.read_back(copy.deepcopy(pod), sandbox_id in self.stopped_pods) if pod is not None else None

    async def read_container(self, container_id: str, pods: PodSource, timeout: float | None) -> StoredContainer | None:
        self.timeouts.append(timeout)
        self.read_back.append(container_id)
        if self.broken is not None:
            raise LookupFailed(self.broken)
        stored = self.containers.get(container_id)
        if stored is None:
            return None
        info = copy.deepcopy(stored.given)
        pod = await pods(stored.sandbox_id)
        if pod is not None:
            info.pod_labels.update(pod.labels)
            info.pod_cgroup_parent = pod.cgroup_parent
        return StoredContainer.read_back(stored.sandbox_id, info, stored.state)

    async def listed(self, timeout: float | None) -> tuple[list[str], list[str]]:
        if self.broken is not None:
            raise LookupFailed(self.broken)
        return list(self.pods), list(self.containers)
