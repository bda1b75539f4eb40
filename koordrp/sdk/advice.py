"""Advice for a hook server's author: an answer that clears what it did not mean to.

koordrp takes the cpuset a container answer's resources carry as it is, the empty string included:
koordlet clears kubelet's cpuset that way, answering with a copy of the request. An answer built
from scratch that sets only, say, the CPU shares carries an empty cpuset too, and clears kubelet's
without meaning to. Nothing in the answer says which it is, but a copy of the request carries the
request's own numbers and environment: an answer that has none of them was not built from it.
"""

from koordrp.api.runtime.v1alpha1 import api_pb2
from koordrp.hooks.messages import CPUSET_FIELDS
_NUMBERS = ("cpu_period", "cpu_quota", "cpu_shares", "memory_limit_in_bytes", "memory_swap_limit_in_bytes")


def _built_from(request: api_pb2.ContainerResourceHookRequest, response: api_pb2.ContainerResourceHookResponse) -> bool:
    """Whether ``response`` carries what a copy of ``request`` would (or the request had nothing to tell by)."""
    asked, answered = request.container_resources, response.container_resources
    numbers = [name for name in _NUMBERS if getattr(asked, name)]
    if any(getattr(answered, name) == getattr(asked, name) for name in numbers):
        return True
    envs = dict(request.container_envs)
    if envs and any(response.container_envs.get(key) == value for key, value in envs.items()):
        return True
    return not numbers and not envs


def cleared(request: api_pb2.ContainerResourceHookRequest, response: api_pb2.ContainerResourceHookResponse) -> list[str]:
    """The fields ``response`` clears that ``request`` had, when ``response`` was not built from the request."""
    if not response.HasField("container_resources") or _built_from(request, response):
        return []
    asked, answered = request.container_resources, response.container_resources
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
