"""Advice for a hook server's author: an answer that clears what it did not mean to.

koordrp takes the cpuset a container answer's resources carry as it is, the empty string included:
koordlet clears kubelet's cpuset that way, answering with a copy of the request. An answer built
from scratch that sets only, say, the CPU shares carries an empty cpuset too, and clears kubelet's
without meaning to. The answer's values cannot tell the two apart (a copy may change every number
the request had), so the SDK keeps count instead: while a handler has a request, the answers
``reply()`` builds from it are remembered (``handed``), and an answer is a copy exactly when it is
one of them.
"""

from contextlib import contextmanager
from typing import Iterator

from koordrp.api.runtime.v1alpha1 import api_pb2
from koordrp.hooks.messages import CPUSET_FIELDS

# The answers reply() built from each request a handler holds, by the request's id: the SDK holds the
# request until the call ends, so no other object can have its id meanwhile, and every answer listed
# is held too, so an identity test cannot mistake a new answer for one gone.
_replies: dict[int, list[api_pb2.ContainerResourceHookResponse]] = {}


@contextmanager
def handed(request: object) -> Iterator[None]:
    """While the block runs, ``request`` is a handler's: the answers ``reply()`` builds from it are remembered."""
    if not isinstance(request, api_pb2.ContainerResourceHookRequest):
        yield
        return
    key = id(request)
    _replies[key] = []
    try:
        yield
    finally:
        del _replies[key]


def built(request: api_pb2.ContainerResourceHookRequest, answer: api_pb2.ContainerResourceHookResponse) -> None:
    """``reply()`` built ``answer`` from ``request`` (remembered only while a handler holds the request)."""
    replies = _replies.get(id(request))
    if replies is not None:
        replies.append(answer)


def _built_from(request: api_pb2.ContainerResourceHookRequest, answer: api_pb2.ContainerResourceHookResponse) -> bool:
    return any(answer is reply for reply in _replies.get(id(request), ()))


def cleared(request: api_pb2.ContainerResourceHookRequest, answer: api_pb2.ContainerResourceHookResponse) -> list[str]:
    """The cpuset fields ``answer`` clears that ``request`` had, unless ``reply(request)`` built it (while handed)."""
    if not answer.HasField("container_resources") or _built_from(request, answer):
        return []
    asked, answered = request.container_resources, answer.container_resources
    return [
        f'{name} "{getattr(asked, name)}"'
        for name in CPUSET_FIELDS
        if getattr(asked, name) and not getattr(answered, name)
    ]


def advice(hook_name: str, fields: list[str]) -> str:
    return (
        f"the {hook_name} answer clears {', '.join(fields)} that the request had: its resources were not built "
        "from the request, and koordrp takes an answer's cpuset as it is, the empty string included. Start from "
        "koordrp.sdk.reply(request) and change what you mean to (said once for this handler)"
    )
