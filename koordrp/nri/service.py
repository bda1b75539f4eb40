"""NRI mode as a Twisted service: koordrp connected to containerd's NRI socket as a plugin, reconnecting.

containerd may start after koordrp, restart, or drop the plugin (it does when an answer comes after
its deadline), or refuse it: koordrp connects again until it is back, a second after the first
failure and less often after each next one (``koordrp.trouble``: one line when that starts, one for
each new reason, one when it is over). While it is not connected, containerd runs pods without
koordrp's hooks, as it runs them without any plugin that is not there.

Stopping keeps the plugin registered while calls in flight and post hooks end (within the stop's
bound): pods created meanwhile still get their hooks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable

from twisted.application import service
from twisted.internet.defer import Deferred, ensureDeferred, fail, succeed
from twisted.internet.endpoints import UNIXClientEndpoint
from twisted.internet.interfaces import IReactorTime, IReactorUNIX
from twisted.internet.protocol import Factory
from twisted.logger import Logger, LogLevel
from twisted.python.failure import Failure
from zope.interface import implementer

from koordrp.call import Parts
from koordrp.frontend import IFrontEnd
from koordrp.hooks.limit import PreHookLimit
from koordrp.nri import registration
from koordrp.nri.connection import NRIConnection
from koordrp.nri.plugin import NRIPlugin, PluginIdentity
from koordrp.nri.told import ToldPods, socket_file
from koordrp.store import ContainerState
from koordrp.text import shortened
from koordrp.trouble import RETRY_CAP_SECONDS, RETRY_SECONDS, Backoff, Retrying, Trouble

CONNECT_RETRY_CAP_SECONDS = 5.0
"""A socket nobody serves costs nothing to try: koordrp finds containerd within seconds once it is back."""

UNAVAILABLE = (
    "koordrp is not a plugin of containerd's NRI at {socket}: {problem}; pods run without koordrp's hooks until it "
    "is; trying again in {retry:g}s, then less often (at most every {cap:g}s)"
)
AVAILABLE_AGAIN = "koordrp is a plugin of containerd's NRI again, after {failures} failed attempts: its hooks run"


@dataclass(frozen=True)
class NRISettings:
    socket_path: str
    identity: PluginIdentity
    state_dir: str | None = None
    """Where koordrp says it is registered (``koordrp.nri.registration``); None: nowhere."""
    grace_period: float = 10.0
    """The stop's bound: how long calls in flight and post hooks get, the plugin still registered."""


class NRIUnavailable(Exception):
    """koordrp is not a plugin of containerd's NRI now; the text says why."""


class _Session(NRIPlugin):
    """The plugin of one connection, telling the service how the connection goes."""

    def __init__(self, owner: NRIService) -> None:
        super().__init__(
            owner.parts,
            owner.settings.identity,
            on_synchronized=owner.synchronized,
            on_configured=owner.on_configured,
            catching_up=owner.catching_up,
            told=owner.told,
        )
        self._owner = owner

    def made(self, connection: NRIConnection) -> Deferred[None]:
        self._owner.session = self
        return super().made(connection)

    def lost(self, reason: Failure) -> None:
        super().lost(reason)
        self._owner.lost(self, reason)


@implementer(IFrontEnd)
class NRIService(service.Service):
    log = Logger()

    def __init__(
        self,
        settings: NRISettings,
        reactor: IReactorUNIX,
        parts: Parts,
        on_configured: Callable[[PreHookLimit], None] = lambda limit: None,
    ) -> None:
        """``reactor`` also provides IReactorTime; ``on_configured`` is told what pre hooks get of containerd's
        deadline, at each connection."""
        self.settings = settings
        self.parts = parts
        self.on_configured = on_configured
        self._reactor = reactor
        self._clock = IReactorTime(reactor)
        self._connecting: Deferred[NRIConnection] | None = None
        self._connection: NRIConnection | None = None
        self.session: NRIPlugin | None = None
        """The plugin of the connection that is up."""
        self.catching_up: set[str] = set()
        """What is being caught up, whichever connection's synchronization began it (nri.catchup.CatchUp)."""
        self.told = ToldPods()
        self._retrying = Retrying(
            self._clock,
            self.log,
            Trouble(AVAILABLE_AGAIN, started=UNAVAILABLE),
            Backoff(RETRY_SECONDS, RETRY_CAP_SECONDS),
            "nri-registration",
            parts.metrics,
        )
        self._synchronized = False
        self._stopping = False

    def probe(self) -> Deferred[object]:
        if self._connection is not None and self._synchronized:
            return succeed(None)
        return fail(NRIUnavailable(self._retrying.failing or "koordrp is not registered with containerd's NRI yet"))

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self._stopping = False
        self._connect()

    def _connect(self) -> None:
        endpoint = UNIXClientEndpoint(self._reactor, self.settings.socket_path, timeout=5)  # type: ignore[no-untyped-call]
        factory = Factory.forProtocol(lambda: NRIConnection(_Session(self), self._clock))
        factory.noisy = False  # not a line per attempt
        self._connecting = connecting = endpoint.connect(factory)  # type: ignore[no-untyped-call]
        connecting.addCallbacks(self._connected, self._not_connected)

    def _connected(self, connection: NRIConnection) -> None:
        self._connecting = None
        self._connection = connection
        # The socket connected to is the one at the path now: a containerd that restarts since drops the connection.
        self.told.connected(socket_file(self.settings.socket_path))

    def going_untold(self) -> set[str]:
        """The store's pods that may be gone without containerd telling of it (``koordrp.nri.told``): untold ones
        none of whose containers is created or running. A pod goes only after its containers, and containerd
        tells of their stops. None while koordrp is not its plugin: its next Synchronize tells of every pod."""
        if self.session is None or not self._synchronized:
            return set()
        store = self.parts.store
        pods, containers = store.ids()
        untold = self.told.untold(pods)
        if untold:
            for stored in map(store.container, containers):
                if stored is not None and stored.state is not ContainerState.STOPPED:
                    untold.discard(stored.sandbox_id)
        return untold

    def _not_connected(self, failure: Failure) -> None:
        self._connecting = None
        if self._stopping:
            return
        reason = f"cannot connect: {shortened(failure.getErrorMessage()).rstrip('.')}"
        self._unavailable(reason, LogLevel.warn, most=CONNECT_RETRY_CAP_SECONDS)

    def synchronized(self, runtime: str, deadline: str) -> None:
        self._synchronized = True
        self.log.info(
            "registered with {runtime}'s NRI at {socket} as plugin {plugin}; it gives each call {deadline}",
            runtime=runtime,
            socket=self.settings.socket_path,
            plugin=self.settings.identity.full_name,
            deadline=deadline,
        )
        self._retrying.succeeded()
        if self.settings.state_dir is not None:
            since = datetime.fromtimestamp(self._clock.seconds(), timezone.utc).isoformat(timespec="seconds")
            found = registration.Registration(
                self.settings.identity.full_name, self.settings.socket_path, runtime, os.getpid(), since
            )
            try:
                registration.write(self.settings.state_dir, found)
            except OSError as error:
                self.log.warn(
                    "cannot say in {directory} that koordrp is registered (koordrp check reads it): {reason}",
                    directory=self.settings.state_dir,
                    reason=error.strerror,
                )

    def _unregistered(self) -> None:
        if self.settings.state_dir is not None:
            registration.remove(self.settings.state_dir)

    def lost(self, session: NRIPlugin, reason: Failure) -> None:
        self._connection = None
        self.session = None
        self._synchronized = False
        self._unregistered()
        if self._stopping:
            return
        if session.given_up is not None:
            self._unavailable(session.given_up.reason, session.given_up.level)
        else:
            self._unavailable(f"the connection was lost: {shortened(reason.getErrorMessage()).rstrip('.')}", LogLevel.warn)

    def _unavailable(self, reason: str, level: LogLevel, most: float | None = None) -> None:
        self._retrying.failed(reason, self._connect, level, most, socket=self.settings.socket_path)

    def stopService(self) -> Deferred[None]:
        super().stopService()  # type: ignore[no-untyped-call]
        self._stopping = True
        self._retrying.cancel()
        if self._connecting is not None:
            self._connecting.cancel()
        return ensureDeferred(self._drain())

    async def _drain(self) -> None:
        """Calls in flight and post hooks end, within the stop's bound, the plugin still registered; then it is not."""
        deadline = self._clock.seconds() + self.settings.grace_period
        if self.session is not None:
            await self.session.quiet(self.settings.grace_period)
        await self.parts.dispatcher.drain(deadline - self._clock.seconds())
        if self._connection is not None:
            self._connection.close()
        self._unregistered()
