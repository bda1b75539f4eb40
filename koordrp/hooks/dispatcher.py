"""Running one hook stage: every subscribed server in order, each seeing the request as changed so far."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from twisted.internet.defer import CancelledError, Deferred, ensureDeferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from koordrp.drain import Drain
from koordrp.hooks.answering import Admitted, Answering, Silence
from koordrp.hooks.client import HookCallError, HookClients, HookTimedOut, no_answer_within
from koordrp.hooks.messages import HookRequest, HookResponse, copied, merge_response, subject_text
from koordrp.hooks.validation import Checked, check
from koordrp.hooks.types import (
    ERROR,
    HOOK_OK,
    LATE,
    NOT_ANSWERING,
    NOT_MADE,
    TIMEOUT,
    HookCall,
    HookFailure,
    HookServerConfig,
    HookType,
    LateAnswer,
    LateCall,
    PostStage,
    StageOutcome,
    Subscribers,
)
from koordrp.unix import socket_identity

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
        self._announced: dict[Deferred[None], int] = {}
        """Each server's sequence of one call's post hooks still running, and which call (a number) it is of."""
        self._calls_announced = 0
        self._drain = Drain(reactor)
        self._answering = Answering(reactor, socket_identity)

    def retain(self, endpoints: Iterable[str]) -> None:
        """The servers registered now: a new one's channel connects, the channels and silences of others are let go."""
        kept = list(endpoints)
        self._clients.retain(kept)
        self._answering.retain(kept)

    def announce(self, stages: Sequence[PostStage]) -> None:
        """Start the post hook stages one call owes, without waiting for them.

        The runtime has answered and nothing a post hook says can change that answer, so the caller
        does not wait. Each server hears of one call's stages one after another, so it hears of a pod's
        containers stopping before it hears of the pod; each server has a sequence of its own, so one
        that does not answer delays only itself, never another server's post hooks. The stages of
        different calls start in the order the calls answered and may overlap. Stopping waits for the
        ones still running (drain), up to its bound.
        """
        self._calls_announced += 1
        sequences: dict[str, list[tuple[PostStage, HookServerConfig]]] = {}
        for stage in stages:
            for server in stage.servers:
                sequences.setdefault(server.name, []).append((stage, server))
        for calls in sequences.values():
            sequence = ensureDeferred(self._in_order(calls))
            self._announced[sequence] = self._calls_announced
            sequence.addErrback(self._post_failed).addBoth(self._post_over, sequence)

    async def _in_order(self, calls: Sequence[tuple[PostStage, HookServerConfig]]) -> None:
        # One server's post hooks of one call. A post hook's answer changes nothing, so each is a call of its
        # own: a stop that cuts the sequence can name the one it cut.
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

    def _post_over(self, _: object, sequence: "Deferred[None]") -> None:
        self._announced.pop(sequence, None)
        if not self._announced:
            self._drain.idle()

    def drain(self, timeout: float) -> "Deferred[None]":
        """Fire once no post hook stage runs (those announced meanwhile included), or after ``timeout`` seconds,
        when the hook calls still running are cut, one line each (server, hook, pod and container)."""
        if self._announced and not self._drain.waiting:
            self.log.info(
                "stopping: post hooks are still running for {count} call(s); they get {timeout:.3g}s, then are cut",
                count=len(set(self._announced.values())),
                timeout=timeout,
            )
        return self._drain.wait(bool(self._announced), timeout, self._cut_all)

    def _cut_all(self) -> None:
        for sequence in list(self._announced):
            sequence.cancel()

    def close(self) -> None:
        """koordrp stops: every hook channel is closed."""
        self._clients.close_all()

    def count_not_made(self, calls: Iterable[HookCall]) -> None:
        """Count the hook calls a CRI call spared (SKIPPED, UNREADABLE); the others (NOT_ANSWERING included)
        are counted as they are made."""
        if self._metrics is not None:
            for call in calls:
                if call.result in NOT_MADE:
                    self._metrics.hook_call(call.server.name, call.hook.value, call.result, None)

    def skips_post(self, server: HookServerConfig) -> str | None:
        """Why a post hook call to ``server`` would be skipped now (None: it would be made): a post hook may wait
        the server's own timeout, so only a server that let that pass is skipped."""
        silence = self._answering.skipping(server, server.timeout)
        return None if silence is None else silence.describe(self._reactor.seconds())

    def _count(self, server: HookServerConfig, hook: HookType, result: str, started: float) -> float:
        seconds = self._reactor.seconds() - started
        if self._metrics is not None:
            self._metrics.hook_call(server.name, hook.value, result, seconds)
        return seconds

    async def run(
        self, hook: HookType, servers: Subscribers, request: HookRequest, budget: float | None = None, keep_late: bool = False
    ) -> StageOutcome:
        """Run ``hook`` on ``servers`` in order; ``budget`` is what is left of the CRI call's deadline.

        The flows (``koordrp.flows``) await them on the reactor, whichever front end the call came
        through; cancelling the stage (the caller went away) cancels the hook call in flight.

        Pre hooks chain: each response is merged into ``request`` before the next server is called.
        Post hook answers are not used, and their failures never fail the CRI call.

        ``keep_late``: a server whose own timeout is longer than the budget is not cancelled when the
        budget passes; the stage goes on without it, and its call is the outcome's ``late`` one.

        A coroutine, awaited in the caller's own: a stage adds no Deferred of its own between the flow and the
        hook call it waits for.
        """
        outcome = StageOutcome(request)
        deadline = None if budget is None else self._reactor.seconds() + budget
        changed_by: dict[str, str] = {}
        for server in servers:
            # What the call may wait: the server's own timeout, or less when the stage has less to give.
            timeout = server.timeout if deadline is None else min(server.timeout, deadline - self._reactor.seconds())
            admitted = self._answering.admit(server, timeout)
            if isinstance(admitted, Silence):
                # It let an earlier call that could wait no longer pass: skipped at once until its trial answers in time.
                reason = admitted.describe(self._reactor.seconds())
                if self._metrics is not None:  # counted, but no call was made: no duration
                    self._metrics.hook_call(server.name, hook.value, NOT_ANSWERING, None)
                outcome.calls.append(HookCall(server, hook, NOT_ANSWERING, reason=reason))
                if server.must_be_heard(hook):
                    outcome.failure = HookFailure(server, hook, reason)
                    return outcome
                continue
            # Kept: the server is given its own timeout, and the stage goes on without it at the budget (a server
            # that must be heard fails the call then: nothing would be left to apply its answer to).
            kept = keep_late and outcome.late is None and not server.must_be_heard(hook) and 0 < timeout < server.timeout
            started = self._reactor.seconds()
            call: Deferred[HookResponse] | None = None
            try:
                if timeout <= 0:
                    raise HookTimedOut("the CRI call's deadline had passed")
                call = self._clients.get(server.endpoint).call(hook, request, server.timeout if kept else timeout)
                response = await (_within(call, timeout, self._reactor) if kept else call)
            except CancelledError:
                # The stage was given up (its caller went away): not the server's failure. (No call is kept by then:
                # once one is, the budget is spent, and the servers after it are not called.)
                self._answering.unheard(server, admitted)
                raise
            except Exception as error:
                timed_out = isinstance(error, HookTimedOut)
                result = TIMEOUT if timed_out else ERROR
                reason = str(error) or type(error).__name__
                seconds = self._reactor.seconds() - started
                recorded = HookCall(server, hook, result, seconds, reason=reason, trial=admitted.trial)
                outcome.calls.append(recorded)
                self._heard(server, hook, error, reason, admitted)
                if kept and timed_out and call is not None and not call.called:  # still running past the budget
                    sent = copied(request)
                    ended = self._late(server, hook, call, recorded, started).addCallback(_checked_late, hook, sent, server)
                    outcome.late = LateCall(recorded, sent, ended)
                else:
                    self._count(server, hook, result, started)
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
                    "hook {hook} on {server} failed: {reason}; going on without it{later}",
                    hook=hook.value,
                    server=server.name,
                    reason=reason,
                    later=f" (its answer, if it comes within {server.timeout:g}s, is applied later)" if outcome.late and outcome.late.call is recorded else "",
                )
                continue
            self._answering.answered(server, hook, admitted)
            # Checked before any of it is used: a field koordrp refuses fails the call (Fail) or is left out of the
            # merge, the rest of the answer applied (Ignore); the runtime never sees it either way.
            checked = check(request, response, server.apply_pod_resources) if hook.is_pre else Checked(response)
            if checked.refused:
                fails = server.must_be_heard(hook)
                _say_refused(hook, server, request, checked.reason, fails)
                if fails:
                    seconds = self._count(server, hook, ERROR, started)
                    refused = tuple(checked.changes())
                    outcome.calls.append(HookCall(server, hook, ERROR, seconds, refused, reason=checked.reason, trial=admitted.trial))
                    outcome.failure = HookFailure(server, hook, checked.reason)
                    return outcome
            seconds = self._count(server, hook, HOOK_OK, started)
            changes = merge_response(request, checked.response, server.apply_pod_resources) + checked.changes() if hook.is_pre else []
            outcome.calls.append(HookCall(server, hook, HOOK_OK, seconds, tuple(changes), trial=admitted.trial))
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

    def _heard(self, server: HookServerConfig, hook: HookType, error: Exception, reason: str, call: Admitted) -> None:
        """What a call that got no answer says of its server: it let its limit pass, it sent an error back (an
        answer), or neither (it was not there)."""
        if isinstance(error, HookTimedOut) and call.limit > 0:
            self._answering.timed_out(server, hook, reason, call)
        elif isinstance(error, HookCallError) and error.sent_back:
            self._answering.answered(server, hook, call)
        else:
            self._answering.unheard(server, call)

    def _late(
        self, server: HookServerConfig, hook: HookType, call: "Deferred[HookResponse]", recorded: HookCall, started: float
    ) -> "Deferred[LateAnswer]":
        """How a call left running past its stage's budget ends (counted then, with its own result; a call cut
        with its stage, as the stage recorded it). It may wait the server's own timeout: its answer does not end
        a silence the budget began, and no answer within that timeout silences every call to the server."""
        ended: Deferred[LateAnswer] = Deferred(lambda _: call.cancel())
        own = Admitted(server.timeout)

        def answered(response: HookResponse) -> LateAnswer:
            self._answering.answered(server, hook, own)
            seconds = self._count(server, hook, LATE, started)
            return LateAnswer(replace(recorded, result=LATE, seconds=seconds), response)

        def failed(failure: Failure) -> LateAnswer | Failure:
            if isinstance(failure.value, CancelledError):
                self._count(server, hook, recorded.result, started)
                return failure
            error = failure.value
            result = TIMEOUT if isinstance(error, HookTimedOut) else ERROR
            if isinstance(error, Exception):
                self._heard(server, hook, error, failure.getErrorMessage(), own)
            seconds = self._count(server, hook, result, started)
            reason = f"{recorded.reason}, nor later: {failure.getErrorMessage()}"
            return LateAnswer(replace(recorded, result=result, seconds=seconds, reason=reason))

        call.addCallbacks(answered, failed).addBoth(_settle, ended)
        return ended


def _say_refused(hook: HookType, server: HookServerConfig, request: HookRequest, refused: str, fails: bool) -> None:
    """One warning for what koordrp refused of an answer, and what the server's policy makes of it."""
    Dispatcher.log.warn(
        "hook {hook} on {server} for {subject}: {refused}; {policy}",
        hook=hook.value,
        server=server.name,
        subject=subject_text(request),
        refused=refused,
        policy="policy Fail, the CRI call fails" if fails else "policy Ignore, the rest of its answer applies",
    )


def _checked_late(answer: LateAnswer, hook: HookType, request: HookRequest, server: HookServerConfig) -> LateAnswer:
    """A late answer is checked as any other before it is used (a call kept past its budget is never a Fail-policy
    server's): what koordrp refuses is left out of it, and said, in a warning and the call's reason."""
    if answer.response is None:
        return answer
    checked = check(request, answer.response, server.apply_pod_resources)
    if not checked.refused:
        return answer
    _say_refused(hook, server, request, checked.reason, fails=False)
    return LateAnswer(replace(answer.call, reason=f"{answer.call.reason}; {checked.reason}"), checked.response)


def _settle(result: object, settled: "Deferred[Any]") -> None:
    """Fire ``settled`` with ``result`` (a Failure errs it), unless it has fired (been cancelled) already."""
    if settled.called:
        return
    if isinstance(result, Failure):
        settled.errback(result)
    else:
        settled.callback(result)


def _within(call: "Deferred[HookResponse]", seconds: float, clock: IReactorTime) -> "Deferred[HookResponse]":
    """``call``'s result, or HookTimedOut after ``seconds``; the call itself goes on after that (its result is
    then for whoever waits on it next). Cancelling it cancels the call."""
    bounded: Deferred[HookResponse] = Deferred(lambda _: call.cancel())
    reason = no_answer_within(seconds)

    def passed() -> None:
        if not bounded.called:
            bounded.errback(HookTimedOut(reason))

    timer = clock.callLater(seconds, passed)

    def ended(result: object) -> object:
        if timer.active():
            timer.cancel()
        if bounded.called:
            return result  # too late for the stage: for the late call's waiter
        _settle(result, bounded)
        return None

    call.addBoth(ended)
    return bounded
