"""Which hook servers answer in time: a server that let a call's budget pass is skipped, and tried again
by a real call after a pause.

A hook call waits as long as its call's budget allows: the server's own timeout, or less when the
call has less to give (the proxy: its share of kubelet's deadline; NRI mode: what containerd gives
the plugin). A server that did not answer in that time would cost every later call the same wait,
so from then on calls skip it at once (its failure policy decides what that means). After a pause
(``FIRST_PAUSE_SECONDS``), the next call that would reach it is sent to it as a trial, with that
call's own budget, while other calls go on skipping it: an answer within the budget (an error the
server sends back included) brings it back; no answer within it silences it again, for twice as long
(up to ``LONGEST_PAUSE_SECONDS``). Nothing is ever asked twice: the server sees each call at most
once, and a trial is a real call whose answer is used like any other.

A trial that ends without an answer and without waiting (the server is not there, or the call was
given up) says nothing about the server's speed: the next call is a trial again. A server that
restarted (a new socket at its endpoint) gets the next call as its trial at once, pause or not.
"""

from dataclasses import dataclass
from typing import Callable, Hashable, Iterable

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from koordrp.hooks.types import HookServerConfig, HookType

FIRST_PAUSE_SECONDS = 5.0
"""How long calls skip a server after it first let one pass its budget."""

LONGEST_PAUSE_SECONDS = 300.0
"""What the pause doubles up to with each trial the server lets pass its budget."""


@dataclass
class Silence:
    """A server that has not answered in time since ``since`` (the reactor's clock)."""

    server: HookServerConfig
    since: float
    reason: str
    pause: float
    trial_after: float
    """When the next call that would reach it becomes its trial."""
    socket: Hashable
    """The server's socket when it was last tried: a new one is a restarted server."""
    trying: bool = False
    """A trial is under way: other calls skip it until the trial ends."""

    def describe(self, now: float) -> str:
        if self.trying:
            then = "a call is trying it now"
        else:
            then = f"the first call after {max(self.trial_after - now, 0.0):.0f}s tries it again"
        return f"not answering in time for {now - self.since:.0f}s (last: {self.reason}); {then}"


@dataclass(frozen=True)
class Admitted:
    """The call goes to the server: as usual, or as the trial of a silenced one."""

    trial: bool = False


CALL = Admitted()
TRIAL = Admitted(trial=True)


class Answering:
    """Silences by endpoint: which calls skip a server, which call is its trial, and what ends a silence."""

    log = Logger()

    def __init__(self, clock: IReactorTime, socket: Callable[[str], Hashable] = lambda endpoint: None) -> None:
        """``socket`` tells which socket is at an endpoint now (``koordrp.unix.socket_identity``)."""
        self._clock = clock
        self._socket = socket
        self._silences: dict[str, Silence] = {}

    def admit(self, server: HookServerConfig) -> Silence | Admitted:
        """Whether a call goes to ``server`` (``Admitted``: a trial, if it is silenced), or skips it (its Silence).

        Every call admitted must be followed by one of ``answered``, ``timed_out`` or ``unheard``.
        """
        silence = self._silences.get(server.endpoint)
        if silence is None:
            return CALL
        if silence.trying:
            return silence
        socket = self._socket(server.endpoint)
        if self._clock.seconds() < silence.trial_after and socket == silence.socket:
            return silence
        silence.trying, silence.socket = True, socket
        return TRIAL

    def answered(self, server: HookServerConfig, hook: HookType, budget: float) -> None:
        """``server`` answered ``hook`` within ``budget`` seconds (an error it sent back included): calls reach it again."""
        silence = self._silences.pop(server.endpoint, None)
        if silence is not None:
            self.log.info(
                "hook server {server} ({endpoint}) answered {hook} within {budget:g}s, after {seconds:.0f}s of not "
                "answering in time; calls reach it again",
                server=server.name,
                endpoint=server.endpoint,
                hook=hook.value,
                budget=budget,
                seconds=self._clock.seconds() - silence.since,
            )

    def timed_out(self, server: HookServerConfig, hook: HookType, reason: str) -> None:
        """A call to ``server`` got no answer within its budget: later calls skip it, and a trial after a pause
        that doubles with each trial it lets pass."""
        now = self._clock.seconds()
        silence = self._silences.get(server.endpoint)
        if silence is None:
            socket = self._socket(server.endpoint)
            self._silences[server.endpoint] = Silence(server, now, reason, FIRST_PAUSE_SECONDS, now + FIRST_PAUSE_SECONDS, socket)
            self.log.warn(
                "hook server {server} ({endpoint}) did not answer {hook} in time: {reason}; later calls skip it, "
                "and the first call after {pause:g}s tries it again (the pause doubles, up to {longest:g}s, while it "
                "does not answer in time)",
                server=server.name,
                endpoint=server.endpoint,
                hook=hook.value,
                reason=reason,
                pause=FIRST_PAUSE_SECONDS,
                longest=LONGEST_PAUSE_SECONDS,
            )
        elif silence.trying:
            silence.trying = False
            silence.reason = reason
            silence.pause = min(silence.pause * 2, LONGEST_PAUSE_SECONDS)
            silence.trial_after = now + silence.pause
            self.log.debug(
                "hook server {server}: its trial got no answer in time either ({reason}); the next in {pause:g}s",
                server=server.name,
                reason=reason,
                pause=silence.pause,
            )
        # Otherwise a call made before the silence began timed out too: that is no trial.

    def unheard(self, server: HookServerConfig) -> None:
        """A call ended without an answer and without waiting out its budget: if it was the server's trial, the
        next call is one again."""
        silence = self._silences.get(server.endpoint)
        if silence is not None:
            silence.trying = False

    def retain(self, endpoints: Iterable[str]) -> None:
        """Forget the silences of servers no registration names any more."""
        keep = set(endpoints)
        for endpoint in [endpoint for endpoint in self._silences if endpoint not in keep]:
            del self._silences[endpoint]
