"""Running one hook stage: every subscribed server in order, each seeing the request as changed so far."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

from twisted.internet.defer import CancelledError, Deferred, ensureDeferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from koordrp.drain import Drain
from koordrp.hooks.answering import Answering
from koordrp.hooks.client import HookCallError, HookClients, HookTimedOut
from koordrp.hooks.messages import HookRequest, HookResponse, merge_response, subject_text
from koordrp.hooks.types import (
    ERROR,
    NOT_ANSWERING,
    NOT_MADE,
    OK,
    TIMEOUT,
    HookCall,
    HookFailure,
    HookServerConfig,
    HookType,
    PostStage,
    StageOutcome,
    Subscribers,
)

if TYPE_CHECKING:
    # Only --metrics-endpoint loads prometheus_client: it costs a node daemon ~6 MB of RSS.
    from koordrp.metrics import Metrics


def _not_made(count: int) -> str:
    return "" if count == 0 else f"; {count} more post hook {'call' if count == 1 else 'calls'} of the same call not made"


class Dispatcher:
    log = Logger()

    def __init__(self, clients: HookClients, reactor: IReactorTime, metrics: Metrics | None = None) -> None:
        self._clients = clients
        self._reactor = reactor
        self._metrics = metrics
        self._announced: set[Deferred[None]] = set()
        self._drain = Drain(reactor)
        self._answering = Answering(reactor, self._ask)

    def _ask(self, endpoint: str, hook: HookType, request: HookRequest, timeout: float) -> "Deferred[HookResponse]":
        return self._clients.get(endpoint).call(hook, request, timeout)

    def retain(self, endpoints: Iterable[str]) -> None:
        """The servers registered now: the channels and silences of others are let go."""
        kept = list(endpoints)
        self._clients.retain(kept)
        self._answering.retain(kept)

    def announce(self, stages: Sequence[PostStage]) -> None:
        """Start the post hook stages one call owes, without waiting for them.

        The runtime has answered and nothing a post hook says can change that answer, so the caller
        does not wait. One call's stages run one after another, so a server hears of a pod's
        containers stopping before it hears of the pod; the stages of different calls start in the
        order the calls answered and may overlap. Stopping waits for the ones still running (drain),
        up to its bound.
        """
        announced = ensureDeferred(self._in_order(stages))
        self._announced.add(announced)
        announced.addErrback(self._post_failed).addBoth(self._post_over, announced)

    async def _in_order(self, stages: Sequence[PostStage]) -> None:
        # A post hook's answer changes nothing, so each server is called on its own: a stop that cuts
        # the calls can name the one it cut.
        calls = [(stage, server) for stage in stages for server in stage.servers]
        for made, (stage, server) in enumerate(calls):
            try:
                await self.run(stage.hook, (server,), stage.request)
            except CancelledError:
                self.log.warn(
                    "stopping: post hook {hook} on {server} for {subject} cut at the stop's bound{rest}",
                    hook=stage.hook.value,
                    server=server.name,
                    subject=subject_text(stage.request),
                    rest=_not_made(len(calls) - made - 1),
                )
                raise

    def _post_failed(self, failure: Failure) -> None:
        if not isinstance(failure.value, CancelledError):
            self.log.failure("post hook stages failed inside koordrp", failure)

    def _post_over(self, _: object, announced: "Deferred[None]") -> None:
        self._announced.discard(announced)
        if not self._announced:
            self._drain.idle()

    def drain(self, timeout: float) -> "Deferred[None]":
        """Fire once no post hook stage runs (those announced meanwhile included), or after ``timeout`` seconds,
        when the hook calls still running are cut, one line each."""
        if self._announced and not self._drain.waiting:
            self.log.info(
                "stopping: post hooks are still running for {count} call(s); they get {timeout:.3g}s, then are cut",
                count=len(self._announced),
                timeout=timeout,
            )
        return self._drain.wait(bool(self._announced), timeout, self._cut_all)

    def _cut_all(self) -> None:
        for announced in list(self._announced):
            announced.cancel()

    def close(self) -> None:
        """koordrp stops: no more background questions to silent servers, and every hook channel closed."""
        self._answering.stop()
        self._clients.close_all()

    def count_not_made(self, calls: Iterable[HookCall]) -> None:
        """Count the hook calls a CRI call spared (SKIPPED, UNREADABLE); the others (NOT_ANSWERING included)
        are counted as they are made."""
        if self._metrics is not None:
            for call in calls:
                if call.result in NOT_MADE:
                    self._metrics.hook_call(call.server.name, call.hook.value, call.result, None)

    def _count(self, server: HookServerConfig, hook: HookType, result: str, started: float) -> float:
        seconds = self._reactor.seconds() - started
        if self._metrics is not None:
            self._metrics.hook_call(server.name, hook.value, result, seconds)
        return seconds

    def run(
        self, hook: HookType, servers: Subscribers, request: HookRequest, budget: float | None = None
    ) -> "Deferred[StageOutcome]":
        """Run ``hook`` on ``servers`` in order; ``budget`` is what is left of the CRI call's deadline.

        The flows (``koordrp.flows``) await them on the reactor, whichever front end the call came
        through; cancelling the stage (the caller went away) cancels the hook call in flight.

        Pre hooks chain: each response is merged into ``request`` before the next server is called.
        Post hook answers are not used, and their failures never fail the CRI call.
        """
        return ensureDeferred(self._chain(hook, servers, request, budget))

    async def _chain(
        self, hook: HookType, servers: Subscribers, request: HookRequest, budget: float | None
    ) -> StageOutcome:
        outcome = StageOutcome(request)
        deadline = None if budget is None else self._reactor.seconds() + budget
        changed_by: dict[str, str] = {}
        for server in servers:
            silence = self._answering.silence(server)
            if silence is not None:
                # It let an earlier call time out: skipped at once until it answers again.
                reason = silence.describe(self._reactor.seconds())
                if self._metrics is not None:  # counted, but no call was made: no duration
                    self._metrics.hook_call(server.name, hook.value, NOT_ANSWERING, None)
                outcome.calls.append(HookCall(server, hook, NOT_ANSWERING, reason=reason))
                if server.must_be_heard(hook):
                    outcome.failure = HookFailure(server, hook, reason)
                    return outcome
                continue
            timeout = server.timeout
            if deadline is not None:
                timeout = min(timeout, deadline - self._reactor.seconds())
            started = self._reactor.seconds()
            try:
                if timeout <= 0:
                    raise HookTimedOut("the CRI call's deadline had passed")
                response = await self._clients.get(server.endpoint).call(hook, request, timeout)
            except CancelledError:
                raise  # the call itself was given up (its client went away): not the server's failure
            except Exception as error:
                timed_out = isinstance(error, HookTimedOut)
                result = TIMEOUT if timed_out else ERROR
                seconds = self._count(server, hook, result, started)
                reason = str(error) or type(error).__name__
                outcome.calls.append(HookCall(server, hook, result, seconds, reason=reason))
                if timed_out and timeout > 0:
                    self._answering.timed_out(server, hook, request, reason)
                elif isinstance(error, HookCallError) and error.sent_back:
                    self._answering.answered(server)
                if server.must_be_heard(hook):
                    outcome.failure = HookFailure(server, hook, reason)
                    self.log.warn(
                        "hook {hook} on {server} failed: {reason}; policy Fail, the CRI call fails",
                        hook=hook.value,
                        server=server.name,
                        reason=reason,
                    )
                    return outcome
                self.log.warn(
                    "hook {hook} on {server} failed: {reason}; going on without it",
                    hook=hook.value,
                    server=server.name,
                    reason=reason,
                )
                continue
            self._answering.answered(server)
            seconds = self._count(server, hook, OK, started)
            changes = merge_response(request, response, server.apply_pod_resources) if hook.is_pre else []
            outcome.calls.append(HookCall(server, hook, OK, seconds, tuple(changes)))
            for change in changes:
                if not change.applied:
                    continue
                earlier = changed_by.get(change.path)
                if earlier is not None:
                    self.log.debug(
                        "hook {hook}: {field} set by {earlier}, then changed by {server}",
                        hook=hook.value,
                        field=change.path,
                        earlier=earlier,
                        server=server.name,
                    )
                changed_by[change.path] = server.name
        return outcome
