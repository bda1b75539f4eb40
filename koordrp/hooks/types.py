"""The hook points, failure policies and hook server registrations koordrp knows."""

from dataclasses import dataclass, field
from enum import Enum

from twisted.internet.defer import CancelledError, Deferred
from twisted.python.failure import Failure

from koordrp.hooks.messages import Change, HookRequest, HookResponse


class HookType(Enum):
    """A hook point; the value is its name in hookserver.d files."""

    PRE_RUN_POD_SANDBOX = "PreRunPodSandbox"
    POST_STOP_POD_SANDBOX = "PostStopPodSandbox"
    PRE_CREATE_CONTAINER = "PreCreateContainer"
    PRE_START_CONTAINER = "PreStartContainer"
    POST_START_CONTAINER = "PostStartContainer"
    POST_STOP_CONTAINER = "PostStopContainer"
    PRE_UPDATE_CONTAINER_RESOURCES = "PreUpdateContainerResources"

    @property
    def rpc_name(self) -> str:
        """The RuntimeHookService method called for this hook point."""
        return self.value + "Hook"

    @property
    def is_pre(self) -> bool:
        return self.value.startswith("Pre")

    @property
    def is_pod_hook(self) -> bool:
        """Pod hooks exchange PodSandboxHook messages; the others ContainerResourceHook messages."""
        return self in (HookType.PRE_RUN_POD_SANDBOX, HookType.POST_STOP_POD_SANDBOX)


HOOKS_BY_NAME: dict[str, HookType] = {hook.value: hook for hook in HookType}
"""Every hook point by the name hookserver.d files (and SDK handlers) give it."""


class FailurePolicy(Enum):
    FAIL = "Fail"
    IGNORE = "Ignore"


@dataclass(frozen=True)
class HookServerConfig:
    """One hook server, as registered by one hookserver.d file."""

    name: str
    """The registration's file name (e.g. ``koordlet.json``): how logs and errors name the server."""
    endpoint: str
    """Absolute path of the server's unix socket."""
    failure_policy: FailurePolicy
    hooks: frozenset[HookType]
    timeout: float
    """Seconds one hook call may take."""
    ignored_stages: tuple[str, ...] = field(default=(), compare=False)
    """Stage names the file lists that koordrp has no hook point for (koordlet's PreRemoveRunPodSandbox)."""
    apply_pod_resources: bool = False
    """Its PreRunPodSandbox answer's ``resources`` size the sandbox (koordrp's own field; koordlet's file lacks it)."""

    def must_be_heard(self, hook: HookType) -> bool:
        """Whether a call must fail when this server cannot be heard at ``hook``: the Fail policy, at a pre hook.

        A post hook is told what happened already; nothing it says can undo that.
        """
        return hook.is_pre and self.failure_policy is FailurePolicy.FAIL


@dataclass(frozen=True)
class HookServers:
    """An immutable snapshot of the registered servers, in file-name order.

    A CRI call takes the snapshot in force when it arrives and uses it throughout, so a
    registration that changes mid-call affects only the calls that arrive after it.
    """

    servers: tuple[HookServerConfig, ...] = ()

    def subscribed(self, hook: HookType) -> "Subscribers":
        return tuple(server for server in self.servers if hook in server.hooks)

    @property
    def endpoints(self) -> frozenset[str]:
        return frozenset(server.endpoint for server in self.servers)


Subscribers = tuple[HookServerConfig, ...]
"""The servers one stage calls, in order."""


@dataclass(frozen=True)
class PostStage:
    """A post hook stage a call owes once it has answered."""

    hook: HookType
    servers: Subscribers
    request: HookRequest


@dataclass(frozen=True)
class HookFailure:
    """A Fail-policy server that could not be heard: the call must fail with this message."""

    server: HookServerConfig
    hook: HookType
    reason: str

    @property
    def message(self) -> str:
        return f"koordrp: hook server {self.server.name} ({self.server.endpoint}) failed {self.hook.value}: {self.reason}"


@dataclass(frozen=True)
class HookCall:
    """What became of one hook call, for the call's log line."""

    server: HookServerConfig
    hook: HookType
    result: str
    """HOOK_OK, ERROR, TIMEOUT; LATE (answered after its call went on without it, and applied where the front
    end still could); NOT_ANSWERING (skipped: the server let an earlier call that could wait no longer pass
    its budget and has not answered one in time since; for a post hook, one its stage would skip as the
    call's line is written); or, for calls not made: SENT (a post hook, not waited for), SKIPPED (by the
    pod's label), UNREADABLE (the CRI request could not be read)."""
    seconds: float | None = None
    changes: tuple[Change, ...] = ()
    reason: str = ""
    trial: bool = False
    """The call was the trial of a server that had not answered in time (``koordrp.hooks.answering``)."""


HOOK_OK, ERROR, TIMEOUT, LATE, SENT, SKIPPED, UNREADABLE = "ok", "error", "timeout", "late", "sent", "skipped", "unreadable"
NOT_ANSWERING = "not-answering"
NOT_MADE = (SKIPPED, UNREADABLE)
"""The results of hook calls a CRI call spared (a post hook SENT is still made, later)."""


@dataclass(frozen=True)
class LateAnswer:
    """How a call that missed its stage's budget ended: ``call`` as its line tells it now (LATE with the
    server's ``response``; TIMEOUT or ERROR without one)."""

    call: HookCall
    response: HookResponse | None = None


@dataclass(frozen=True)
class LateCall:
    """A pre hook call that missed its stage's budget and was left running, to its server's own timeout,
    for a front end that can still apply its answer (NRI mode: a PreCreateContainer answer's resources)."""

    call: HookCall
    """As the stage recorded it (TIMEOUT)."""
    request: HookRequest
    """The request as the server was sent it (a copy)."""
    ended: "Deferred[LateAnswer]"
    """Fires once the call ends; cancelling it cancels the call."""

    def drop(self) -> None:
        """Nothing is left to apply its answer to: the call is cancelled, and nobody waits for its end."""
        self.ended.addErrback(_cancelled)
        self.ended.cancel()


def _cancelled(failure: Failure) -> Failure | None:
    """Consumes the CancelledError of what was cancelled on purpose; any other failure goes on."""
    return None if isinstance(failure.value, CancelledError) else failure


@dataclass
class StageOutcome:
    """The request after every server had its say, or the failure that stops the call."""

    request: HookRequest
    failure: HookFailure | None = None
    calls: list[HookCall] = field(default_factory=list)
    late: LateCall | None = None
    """A call that missed the budget and goes on (only for a stage that keeps them)."""
