"""Hook clients whose calls the test answers, on the test's clock: no grpc, no sockets."""

from dataclasses import dataclass, field
from typing import cast

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

from koordrp.hooks.client import HookClient, HookClients, HookTimedOut, no_answer_within
from koordrp.hooks.messages import HookRequest, HookResponse, copied
from koordrp.hooks.types import HookType


@dataclass
class PendingCall:
    """One call the server received: the test answers it (``answer``), or lets its timeout pass."""

    hook: HookType
    request: HookRequest
    timeout: float
    answered: "Deferred[HookResponse]"
    cancelled: list[object] = field(default_factory=list)

    def answer(self, response: HookResponse) -> None:
        if not self.answered.called:
            self.answered.callback(response)


class ScriptedHookClient(HookClient):
    def __init__(self, endpoint: str, reactor: IReactorTime) -> None:  # no channel: nothing is dialled
        self.endpoint = endpoint
        self._clock = reactor
        self.calls: list[PendingCall] = []

    def call(self, hook: HookType, request: HookRequest, timeout: float) -> "Deferred[HookResponse]":
        cancelled: list[object] = []
        answered: Deferred[HookResponse] = Deferred(cancelled.append)

        def timed_out(result: object, timeout: float) -> object:
            raise HookTimedOut(no_answer_within(timeout))

        answered.addTimeout(timeout, self._clock, timed_out)
        self.calls.append(PendingCall(hook, copied(request), timeout, answered, cancelled))
        return answered

    def close(self) -> None:
        pass


def scripted_clients(clock: IReactorTime) -> HookClients:
    return HookClients(clock, make_client=ScriptedHookClient)


def calls_to(clients: HookClients, endpoint: str) -> list[PendingCall]:
    """What the server at ``endpoint`` received, in order: each request once, however often it was asked."""
    return cast(ScriptedHookClient, clients.get(endpoint)).calls
