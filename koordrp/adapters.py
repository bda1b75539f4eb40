"""The seam between the lifecycle flows and the front ends (CRI, Docker, NRI), written once for all three.

What a front end gives a flow:

- ``Backend``, the runtime behind the front end for one call: forwarding the call (rewritten or as
  received) and reading back what the store lacks. Its answers are Deferreds whose cancellation
  reaches the runtime. ``RuntimeInventory`` reads everything, for the store to agree with;
  ``RuntimeListing`` only lists (NRI mode: what appears, containerd's events tell of).
- The request protocols (``RunPodSandbox``, ``CreateContainer``, ``UpdateContainerResources``,
  ``UpdatePodSandboxResources``): the call's own request, turned into a hook request and written back
  once the hooks changed it (``Written``, with what the front end could not write: ``LeftAlone``).
- ``LateUpdates``, for a front end that can still change a created container (NRI mode): a
  pre-create answer that came after the runtime went on without it is applied there.

And what it gets back: the call's ``Outcome``, a value (the runtime's ``Reply``, koordrp's
``Refusal``, or ``CALLER_GONE``) that the front end turns into its own answer, and that
``outcome_label`` names the same way in every mode, for the call's line and metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import Awaitable, Callable, Mapping, Protocol, TypeVar, Union, runtime_checkable

from koordrp.hooks.messages import ContainerHookRequest, PodHookRequest, Resources
from koordrp.store import StoredContainer, StoredPod


class Reply(Protocol):
    """The runtime's answer to a forwarded call, as the flows need to know it."""

    @property
    def ok(self) -> bool:
        """The runtime did what it was asked."""

    @property
    def created_id(self) -> str:
        """The id the runtime gave the pod or container a call created ("" for other calls)."""

    @property
    def label(self) -> str:
        """The runtime's own word for its answer (a gRPC status name, an HTTP status), for the call's line and metrics."""


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
    """The gRPC status codes a refusal is answered with (NRI's ttrpc carries the same codes): the call's line
    names them in every mode."""

    UNKNOWN = 2
    INVALID_ARGUMENT = 3

    @property
    def http(self) -> tuple[int, str]:
        """The HTTP status (and its reason) that says the same, for Docker mode."""
        return (400, "Bad Request") if self is RefusalStatus.INVALID_ARGUMENT else (500, "Internal Server Error")


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


class RuntimeListing(Protocol):
    def listed(self, timeout: float | None) -> Awaitable[tuple[list[str], list[str]]]:
        """The ids of every Kubernetes pod sandbox and container the runtime has."""


@runtime_checkable
class RuntimeInventory(RuntimeReader, RuntimeListing, Protocol):
    """A listing whose pods and containers can be read back: what the store lacks is learnt from it."""


class Backend(RuntimeReader, Protocol[AnyReply_co]):
    """The runtime behind the front end, for one call."""

    def forward(self, rewritten: bytes | None, timeout: float | None) -> Awaitable[AnyReply_co]:
        """Send the call on: ``rewritten`` as its request, or (None) exactly what the caller sent.

        Its answer, whatever it is, is a Reply; cancelling the Deferred cancels the runtime's call.
        """


class LateNotApplied(Exception):
    """The runtime did not take what a late answer changed; the text says why."""


class LateUpdates(Protocol):
    """What a front end can still do once a container exists with a pre-create answer that came after the
    runtime went on without it (NRI mode: containerd's UpdateContainers)."""

    def apply(self, container_id: str, sent: ContainerHookRequest, answered: ContainerHookRequest) -> Awaitable[tuple[LeftAlone, ...]]:
        """Change the container by what differs between ``sent`` (the request as the server was sent it) and
        ``answered`` (with its answer merged); what cannot change now, left alone. Raises LateNotApplied."""


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


OK_LABEL = "OK"
"""How a call's line and metrics name a call the runtime did, in the modes whose word is gRPC's (CRI, NRI)."""


def outcome_label(outcome: Outcome[AnyReply]) -> str:
    """How the call's line and metrics name ``outcome``, in every mode: the runtime's own word for its
    answer, the status of koordrp's refusal, or CANCELLED when nobody was left to answer."""
    if isinstance(outcome, Refusal):
        return outcome.status_code.name
    if isinstance(outcome, CallerGone):
        return "CANCELLED"
    return outcome.label
