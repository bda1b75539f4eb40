"""How a grpc worker thread reaches the reactor: pre hook stages, run there and waited for; and what a
call owes once it has answered, handed over without waiting (``in_reactor``).

``HookBridge.stages(remaining)`` gives one CRI call ``koordrp.flows.Stages`` that block the worker
instead of suspending: the dispatcher's awaitable stages, crossed into the reactor once each.
"""

import concurrent.futures
from typing import Callable

from twisted.internet.defer import maybeDeferred
from twisted.internet.interfaces import IReactorFromThreads
from twisted.python.failure import Failure

from koordrp.hooks.dispatcher import Dispatcher
from koordrp.hooks.messages import HookRequest
from koordrp.hooks.types import HookType, StageOutcome, Subscribers

# Beyond the hook timeouts themselves: the reactor may be busy for a moment.
_SLACK_SECONDS = 1.0


class HookStageTimeout(Exception):
    """The reactor did not finish a hook stage in time (it is stopping, or stuck)."""


class HookBridge:
    """Hook stages for CRI worker threads, over the reactor's dispatcher."""

    def __init__(self, reactor: IReactorFromThreads, dispatcher: Dispatcher) -> None:
        self._reactor = reactor
        self._dispatcher = dispatcher

    def in_reactor(self, function: Callable[..., object], *args: object) -> None:
        self._reactor.callFromThread(function, *args)

    def stages(self, remaining: Callable[[], float | None]) -> "BlockingStages":
        """The stages of one call, each bounded by what ``remaining()`` says is left of its deadline."""
        return BlockingStages(self, remaining)

    def run(self, hook: HookType, servers: Subscribers, request: HookRequest, budget: float | None) -> StageOutcome:
        """Run a stage in the reactor and wait for it; the request comes back changed by the hooks."""
        # Every hook call is bounded by its own timeout (and by the budget), so the stage is too; the
        # wait here only guards against a reactor that is no longer running.
        bound = sum(server.timeout for server in servers)
        if budget is not None:
            bound = min(bound, budget)
        answer: concurrent.futures.Future[StageOutcome] = concurrent.futures.Future()

        def start() -> None:
            stage = maybeDeferred(self._dispatcher.run, hook, servers, request, budget)
            stage.addCallbacks(answer.set_result, lambda failure: _set_failure(answer, failure))

        self._reactor.callFromThread(start)
        try:
            return answer.result(bound + _SLACK_SECONDS)
        except concurrent.futures.TimeoutError:
            raise HookStageTimeout(f"{hook.value} did not finish within {bound + _SLACK_SECONDS:g}s") from None


class BlockingStages:
    """``koordrp.flows.Stages`` for one CRI call: each stage blocks the worker until the reactor ran it."""

    def __init__(self, bridge: HookBridge, remaining: Callable[[], float | None]) -> None:
        self._bridge = bridge
        self._remaining = remaining

    async def run(self, hook: HookType, servers: Subscribers, request: HookRequest) -> StageOutcome:
        return self._bridge.run(hook, servers, request, self._remaining())


def _set_failure(answer: "concurrent.futures.Future[StageOutcome]", failure: Failure) -> None:
    answer.set_exception(failure.value)
