"""Which CRI methods koordrp knows, how each one streams, and which backend serves it."""

from dataclasses import dataclass
from enum import Enum

from cri_api.v1 import api_pb2 as cri_v1
from cri_api.v1alpha2 import api_pb2 as cri_v1alpha2


class Cardinality(Enum):
    UNARY_UNARY = "unary-unary"
    UNARY_STREAM = "unary-stream"
    STREAM_STREAM = "stream-stream"


class BackendRole(Enum):
    RUNTIME = "runtime"
    IMAGE = "image"


# Unary methods that make the runtime work (seconds, sometimes minutes). If the caller gives up on
# one, the backend call is cancelled too; that costs ~200 us of CPU per call, which the quick
# queries (Version, List*, *Status, *Stats) are spared: their answers come before a cancel could.
WORKING_METHODS = frozenset(
    {
        "RunPodSandbox",
        "StopPodSandbox",
        "RemovePodSandbox",
        "CreateContainer",
        "StartContainer",
        "StopContainer",
        "RemoveContainer",
        "UpdateContainerResources",
        "ReopenContainerLog",
        "ExecSync",
        "CheckpointContainer",
        "UpdateRuntimeConfig",
        "PullImage",
        "RemoveImage",
    }
)


@dataclass(frozen=True)
class MethodRoute:
    cardinality: Cardinality
    role: BackendRole
    cancellable: bool


def _known_methods() -> dict[str, Cardinality]:
    known: dict[str, Cardinality] = {}
    for module in (cri_v1, cri_v1alpha2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                if method.client_streaming:
                    cardinality = Cardinality.STREAM_STREAM
                elif method.server_streaming:
                    cardinality = Cardinality.UNARY_STREAM
                else:
                    cardinality = Cardinality.UNARY_UNARY
                known[f"/{service.full_name}/{method.name}"] = cardinality
    return known


KNOWN_METHODS = _known_methods()


def role_of(method: str) -> BackendRole:
    """ImageService of any CRI version goes to the image endpoint, everything else to the runtime."""
    service = method.lstrip("/").split("/", 1)[0]
    return BackendRole.IMAGE if service.endswith(".ImageService") else BackendRole.RUNTIME


def route(method: str) -> MethodRoute:
    """How to forward ``method``.

    A method the stubs do not describe (a newer CRI, another service) is relayed as a bidirectional
    stream: on the wire unary and streaming calls are the same HTTP/2 exchange, so this carries any
    cardinality unchanged.
    """
    cardinality = KNOWN_METHODS.get(method, Cardinality.STREAM_STREAM)
    cancellable = cardinality is not Cardinality.UNARY_UNARY or method.rsplit("/", 1)[-1] in WORKING_METHODS
    return MethodRoute(cardinality, role_of(method), cancellable)
