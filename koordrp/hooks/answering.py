"""Which hook servers answer: a server that let a call time out is skipped by later calls until it answers again.

A slow server is not a dead one: a hook call waits as long as the CRI call's deadline allows
(``koordrp.flows``). But a server that did not answer in that time would cost every later call the
same wait, so from then on calls skip it at once (its failure policy decides what that means), and
koordrp asks it again in the background: the question it did not answer, one at a time, each
bounded by the server's own timeout, a second apart. The first answer (any answer: an error the
server sends back is an answer too) brings it back.
"""

from dataclasses import dataclass
from typing import Callable, Iterable

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from koordrp.hooks.client import HookCallError
from koordrp.hooks.messages import HookRequest, HookResponse, copied
from koordrp.hooks.types import HookServerConfig, HookType

PROBE_PAUSE_SECONDS = 1.0

Ask = Callable[[str, HookType, HookRequest, float], "Deferred[HookResponse]"]
"""Call a server: endpoint, hook, request, timeout."""


@dataclass
class Silence:
    """A server that has not answered since ``since`` (the reactor's clock)."""

    server: HookServerConfig
    since: float
    reason: str
    hook: HookType
    question: HookRequest
    """The call it did not answer, asked again until it does."""
    probe: "Deferred[HookResponse] | None" = None
    pause: IDelayedCall | None = None

    def describe(self, now: float) -> str:
        return f"not answering for {now - self.since:.0f}s (last: {self.reason}); asked again in the background"


class Answering:
    """Silences by endpoint, and the background questions that end them."""

    log = Logger()

    def __init__(self, clock: IReactorTime, ask: Ask) -> None:
        self._clock = clock
        self._ask = ask
        self._silences: dict[str, Silence] = {}

    def silence(self, server: HookServerConfig) -> Silence | None:
        return self._silences.get(server.endpoint)

    def timed_out(self, server: HookServerConfig, hook: HookType, question: HookRequest, reason: str) -> None:
        """A call to ``server`` got no answer in time: later calls skip it until it answers again."""
        if server.endpoint in self._silences:
            return
        silence = Silence(server, self._clock.seconds(), reason, hook, copied(question))
        self._silences[server.endpoint] = silence
        self.log.warn(
            "hook server {server} ({endpoint}) did not answer {hook}: {reason}; later calls skip it "
            "until it answers again (asked again in the background)",
            server=server.name,
            endpoint=server.endpoint,
            hook=hook.value,
            reason=reason,
        )
        self._probe(silence)

    def answered(self, server: HookServerConfig) -> None:
        silence = self._silences.pop(server.endpoint, None)
        if silence is not None:
            self._end(silence)
            self.log.info(
                "hook server {server} ({endpoint}) answers again, after {seconds:.0f}s; calls reach it again",
                server=server.name,
                endpoint=server.endpoint,
                seconds=self._clock.seconds() - silence.since,
            )

    def retain(self, endpoints: Iterable[str]) -> None:
        """Forget the silences of servers no registration names any more."""
        keep = set(endpoints)
        for endpoint in [endpoint for endpoint in self._silences if endpoint not in keep]:
            self._end(self._silences.pop(endpoint))

    def stop(self) -> None:
        self.retain(())

    def _end(self, silence: Silence) -> None:
        if silence.pause is not None and silence.pause.active():
            silence.pause.cancel()
        if silence.probe is not None:
            probe, silence.probe = silence.probe, None
            probe.cancel()

    def _probe(self, silence: Silence) -> None:
        silence.pause = None
        if self._silences.get(silence.server.endpoint) is not silence:
            return
        probe = self._ask(silence.server.endpoint, silence.hook, silence.question, silence.server.timeout)
        silence.probe = probe
        probe.addCallbacks(lambda _: self._heard(silence), lambda failure: self._not_heard(silence, failure))

    def _heard(self, silence: Silence) -> None:
        if self._silences.get(silence.server.endpoint) is silence:
            silence.probe = None
            self.answered(silence.server)

    def _not_heard(self, silence: Silence, failure: Failure) -> None:
        if silence.probe is None:  # ended meanwhile (cancelled)
            return
        silence.probe = None
        if isinstance(failure.value, HookCallError) and failure.value.sent_back:
            self._heard(silence)  # an error the server sends back is an answer: it is there, and it answers
        else:
            silence.pause = self._clock.callLater(PROBE_PAUSE_SECONDS, self._probe, silence)
