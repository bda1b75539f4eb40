"""The one way a grpc worker thread reaches the reactor: run a hook stage there and wait for it."""

import concurrent.futures
from typing import Any, Callable

from twisted.internet.defer import Deferred, maybeDeferred
from twisted.python.failure import Failure

from koordrp.hooks.dispatcher import Dispatcher, StageOutcome
from koordrp.hooks.types import HookServers, HookType
from koordrp.lifecycle import HookRequest

# Beyond the hook timeouts themselves: the reactor may be busy for a moment.
_SLACK_SECONDS = 1.0


class HookStageTimeout(Exception):
    """The reactor did not finish a hook stage in time (it is stopping, or stuck)."""


class HookBridge:
    """Hook stages for CRI worker threads: no reactor crossing at all when nobody subscribed."""

    def __init__(self, reactor: Any, dispatcher: Dispatcher, current_servers: Callable[[], HookServers]) -> None:
        self._reactor = reactor
        self._dispatcher = dispatcher
        self.current_servers = current_servers

    def in_reactor(self, function: Callable[..., object], *args: object) -> None:
        self._reactor.callFromThread(function, *args)

    def skipped(self, hook: HookType, servers: HookServers) -> None:
        subscribed = servers.subscribed(hook)
        if subscribed:
            self._reactor.callFromThread(self._dispatcher.skipped, hook, subscribed)

    def notify(self, hook: HookType, servers: HookServers, request: HookRequest) -> None:
        """Start a post hook stage in the reactor and return at once (Dispatcher.announce)."""
        subscribed = servers.subscribed(hook)
        if subscribed:
            self._reactor.callFromThread(self._dispatcher.announce, hook, subscribed, request)

    def drain(self) -> "Deferred[list[StageOutcome]]":
        return self._dispatcher.drain()

    def run(self, hook: HookType, servers: HookServers, request: HookRequest, budget: float | None) -> StageOutcome:
        subscribed = servers.subscribed(hook)
        if not subscribed:
            return StageOutcome(request)
        # Every hook call is bounded by its own timeout (and by the budget), so the stage is too; the
        # wait here only guards against a reactor that is no longer running.
        bound = sum(server.timeout for server in subscribed)
        if budget is not None:
            bound = min(bound, budget)
        answer: concurrent.futures.Future[StageOutcome] = concurrent.futures.Future()

        def start() -> None:
            stage = maybeDeferred(self._dispatcher.dispatch, hook, subscribed, request, budget)
            stage.addCallbacks(answer.set_result, lambda failure: _set_failure(answer, failure))

        self._reactor.callFromThread(start)
        try:
            return answer.result(bound + _SLACK_SECONDS)
        except concurrent.futures.TimeoutError:
            raise HookStageTimeout(f"{hook.value} did not finish within {bound + _SLACK_SECONDS:g}s") from None


def _set_failure(answer: "concurrent.futures.Future[StageOutcome]", failure: Failure) -> None:
    answer.set_exception(failure.value)
