"""Which hook servers answer in time: a server that let a call's budget pass is skipped by the calls that
could wait no longer, and tried again by a real call after a pause.

A hook call waits as long as its call's budget allows: the server's own timeout, or less when the
call has less to give (the proxy: its share of kubelet's deadline; NRI mode: what containerd gives
the plugin). A server that did not answer in that time would cost every later call that can wait no
longer the same wait, so from then on such calls skip it at once (its failure policy decides what
that means). The silence remembers the longest wait the server let pass (``Silence.missed``):

- missed less than its own timeout (it is slow: in NRI mode, slower than containerd's limit), the
  silence skips the calls that give it less than its own timeout, its pre hooks; a call that may wait
  its whole timeout (a post hook, which nobody waits for) still goes to it, since it may well answer
  within that;
- missed its own timeout, or all but a little of it (``ALL_BUT``: it is wedged), the silence skips every
  call, post hooks included.

After a pause (``FIRST_PAUSE_SECONDS``), the next call the silence would skip is sent to it as a
trial, with that call's own budget, while other such calls go on skipping it: an answer within the
budget (an error the server sends back included) brings it back; no answer within it silences it
again, for twice as long (up to ``LONGEST_PAUSE_SECONDS``). Only an answer to a call the silence
skips ends it, so a slow server is brought back only by a call with less than its own timeout to give
(in NRI mode, containerd's budget again): a post hook's answer within the server's own timeout, or a
late answer, says nothing of whether it answers a pre hook in time (a server may answer a post hook
at once and take seconds over a PreCreateContainer). A call that gets no answer within the server's
own timeout makes any silence skip every call, from then on for a whole pause. Nothing is ever asked
twice: the server sees each call at most once, and a trial is a real call whose answer is used like
any other.

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

ALL_BUT = 0.9
"""A call that waited this share of a server's own timeout in vain shows it wedged as much as one that waited
all of it: the proxy's share of kubelet's two minutes falls a hair short of the default 60 s."""


def waited_its_own(server: HookServerConfig, waited: float) -> bool:
    """Whether waiting ``waited`` seconds in vain says ``server`` does not answer within its own timeout."""
    return waited >= server.timeout * ALL_BUT


@dataclass
class Silence:
    """A server that has not answered in time since ``since`` (the reactor's clock)."""

    server: HookServerConfig
    since: float
    reason: str
    missed: float
    """The longest a call waited for it in vain since the silence began: its own timeout, or a budget shorter than that."""
    pause: float
    trial_after: float
    """When the next call it skips becomes its trial."""
    socket: Hashable
    """The server's socket when it was last tried: a new one is a restarted server."""
    trying: bool = False
    """A trial is under way: other calls skip it until the trial ends."""

    def skips(self, server: HookServerConfig, limit: float) -> bool:
        """Whether a call to ``server`` that may wait ``limit`` seconds is one this silence skips (or tries)."""
        return limit < server.timeout or waited_its_own(server, self.missed)

    def describe(self, now: float) -> str:
        if self.trying:
            then = "a call is trying it now"
        else:
            then = f"the first call after {max(self.trial_after - now, 0.0):.0f}s tries it again"
        return f"not answering in time for {now - self.since:.0f}s (last: {self.reason}); {then}"


@dataclass(frozen=True)
class Admitted:
    """The call goes to the server, which it may wait for ``limit`` seconds: as usual, or as the trial of a silenced one."""

    limit: float
    trial: bool = False


class Answering:
    """Silences by endpoint: which calls skip a server, which call is its trial, and what ends a silence."""

    log = Logger()

    def __init__(self, clock: IReactorTime, socket: Callable[[str], Hashable] = lambda endpoint: None) -> None:
        """``socket`` tells which socket is at an endpoint now (``koordrp.unix.socket_identity``)."""
        self._clock = clock
        self._socket = socket
        self._silences: dict[str, Silence] = {}

    def skipping(self, server: HookServerConfig, limit: float) -> Silence | None:
        """The silence that makes a call to ``server`` that may wait ``limit`` seconds skip it now (None: the call
        would be made, as a trial or not); asking changes nothing."""
        silence = self._silences.get(server.endpoint)
        if silence is None or not silence.skips(server, limit) or not self._skipped(silence, server):
            return None
        return silence

    def _skipped(self, silence: Silence, server: HookServerConfig) -> bool:
        """Whether a call the silence skips is skipped (else it would be the trial)."""
        if silence.trying:
            return True
        return self._clock.seconds() < silence.trial_after and self._socket(server.endpoint) == silence.socket

    def admit(self, server: HookServerConfig, limit: float) -> Silence | Admitted:
        """Whether a call that may wait ``limit`` seconds goes to ``server`` (``Admitted``: a trial, if a silence
        skips such calls), or skips it (its Silence).

        Every call admitted must be followed by one of ``answered``, ``timed_out`` or ``unheard``, with its Admitted.
        """
        silence = self._silences.get(server.endpoint)
        if silence is None or not silence.skips(server, limit):
            return Admitted(limit)
        if self._skipped(silence, server):
            return silence
        silence.trying, silence.socket = True, self._socket(server.endpoint)
        return Admitted(limit, trial=True)

    def answered(self, server: HookServerConfig, hook: HookType, call: Admitted) -> None:
        """``server`` answered ``hook`` within ``call.limit`` seconds (an error it sent back included): if its silence
        skips such calls, calls reach it again."""
        silence = self._silences.get(server.endpoint)
        if silence is None or not silence.skips(server, call.limit):
            return
        del self._silences[server.endpoint]
        self.log.info(
            "hook server {server} ({endpoint}) answered {hook} within {budget:g}s, after {seconds:.0f}s of not "
            "answering in time; calls reach it again",
            server=server.name,
            endpoint=server.endpoint,
            hook=hook.value,
            budget=call.limit,
            seconds=self._clock.seconds() - silence.since,
        )

    def timed_out(self, server: HookServerConfig, hook: HookType, reason: str, call: Admitted) -> None:
        """A call to ``server`` got no answer within ``call.limit`` seconds: later calls that may wait no longer
        skip it (every call, if that was its own timeout), and a trial after a pause that doubles with each trial
        it lets pass."""
        now = self._clock.seconds()
        silence = self._silences.get(server.endpoint)
        if silence is None:
            socket = self._socket(server.endpoint)
            pause = FIRST_PAUSE_SECONDS
            if waited_its_own(server, call.limit):
                skipping, posts = "later calls skip it, its post hooks included", ""
            else:
                skipping = f"later pre hook calls with less than its own {server.timeout:g}s to give skip it"
                posts = f"; its post hooks, which nobody waits for, still get those {server.timeout:g}s"
            self._silences[server.endpoint] = Silence(server, now, reason, call.limit, pause, now + pause, socket)
            self.log.warn(
                "hook server {server} ({endpoint}) did not answer {hook} in time: {reason}; {skipping}, and the first "
                "such call after {pause:g}s tries it again (the pause doubles, up to {longest:g}s, while it does not "
                "answer in time){posts}",
                server=server.name,
                endpoint=server.endpoint,
                hook=hook.value,
                reason=reason,
                skipping=skipping,
                pause=pause,
                longest=LONGEST_PAUSE_SECONDS,
                posts=posts,
            )
            return
        # A trial that gets no answer doubles the pause; another call (a post hook the silence does not skip, one
        # made before the silence began) is no trial, but one that waited the server's own timeout in vain shows
        # it wedged.
        wedged = not waited_its_own(server, silence.missed) and waited_its_own(server, call.limit)
        silence.missed = max(silence.missed, call.limit)
        if call.trial and silence.trying:
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
        if wedged:
            silence.reason = reason
            # Its post hooks skip it from now on too: none is its trial before the pause is over.
            silence.trial_after = max(silence.trial_after, now + silence.pause)
            self.log.warn(
                "hook server {server} ({endpoint}) did not answer {hook} within its own {timeout:g}s either: later "
                "calls skip it, its post hooks included, until one answers in time",
                server=server.name,
                endpoint=server.endpoint,
                hook=hook.value,
                timeout=server.timeout,
            )

    def unheard(self, server: HookServerConfig, call: Admitted) -> None:
        """A call ended without an answer and without waiting out its limit: if it was the server's trial, the
        next call is one again."""
        silence = self._silences.get(server.endpoint)
        if silence is not None and call.trial:
            silence.trying = False

    def retain(self, endpoints: Iterable[str]) -> None:
        """Forget the silences of servers no registration names any more."""
        keep = set(endpoints)
        for endpoint in [endpoint for endpoint in self._silences if endpoint not in keep]:
            del self._silences[endpoint]
