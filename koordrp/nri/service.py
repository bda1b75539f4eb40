"""NRI mode as a Twisted service: koordrp connected to containerd's NRI socket as a plugin, reconnecting.

containerd may start after koordrp, restart, or drop the plugin (it does when an answer comes after
its deadline): koordrp connects again every second until it is back, with one log line when it
cannot (or its reason changes) and one when it can again. While it is not connected, containerd runs
pods without koordrp's hooks, as it runs them without any plugin that is not there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable

from twisted.application import service
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.endpoints import UNIXClientEndpoint
from twisted.internet.interfaces import IDelayedCall, IReactorTime, IReactorUNIX
from twisted.internet.protocol import Factory
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from koordrp.call import Parts
from koordrp.frontend import IFrontEnd
from koordrp.hooks.limit import PreHookLimit
from koordrp.nri import registration
from koordrp.nri.connection import NRIConnection
from koordrp.nri.plugin import NRIPlugin, PluginIdentity
from koordrp.text import shortened

RETRY_SECONDS = 1.0


@dataclass(frozen=True)
class NRISettings:
    socket_path: str
    identity: PluginIdentity
    state_dir: str | None = None
    """Where koordrp says it is registered (``koordrp.nri.registration``); None: nowhere."""


class NRIUnavailable(Exception):
    """koordrp is not a plugin of containerd's NRI now; the text says why."""


class _Session(NRIPlugin):
    """The plugin of one connection, telling the service how the connection goes."""

    def __init__(self, owner: NRIService) -> None:
        super().__init__(owner.parts, owner.settings.identity, on_synchronized=owner.synchronized, on_configured=owner.on_configured)
        self._owner = owner

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
        self._retry: IDelayedCall | None = None
        self._synchronized = False
        self._failing: str | None = None
        self._stopping = False

    def probe(self) -> Deferred[object]:
        if self._connection is not None and self._synchronized:
            return succeed(None)
        return fail(NRIUnavailable(self._failing or "koordrp is not registered with containerd's NRI yet"))

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self._stopping = False
        self._connect()

    def _connect(self) -> None:
        self._retry = None
        endpoint = UNIXClientEndpoint(self._reactor, self.settings.socket_path, timeout=5)  # type: ignore[no-untyped-call]
        factory = Factory.forProtocol(lambda: NRIConnection(_Session(self), self._clock))
        self._connecting = connecting = endpoint.connect(factory)  # type: ignore[no-untyped-call]
        connecting.addCallbacks(self._connected, self._not_connected)

    def _connected(self, connection: NRIConnection) -> None:
        self._connecting = None
        self._connection = connection
        self.log.info("connected to containerd's NRI at {socket}", socket=self.settings.socket_path)

    def _not_connected(self, failure: Failure) -> None:
        self._connecting = None
        if self._stopping:
            return
        self._unavailable(f"cannot connect: {shortened(failure.getErrorMessage()).rstrip('.')}")

    def synchronized(self, runtime: str) -> None:
        self._synchronized = True
        if self._failing is not None:
            self.log.info("koordrp is a plugin of containerd's NRI again: its hooks run")
        self._failing = None
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
        self._synchronized = False
        self._unregistered()
        if not self._stopping:
            self._unavailable(f"the connection was lost: {shortened(reason.getErrorMessage()).rstrip('.')}")

    def _unavailable(self, reason: str) -> None:
        if reason != self._failing:
            self.log.warn(
                "containerd's NRI at {socket}: {reason}; pods run without koordrp's hooks until it is back; "
                "trying again every {retry:g}s",
                socket=self.settings.socket_path,
                reason=reason,
                retry=RETRY_SECONDS,
            )
        self._failing = reason
        self._retry = self._clock.callLater(RETRY_SECONDS, self._connect)

    def stopService(self) -> Deferred[object]:
        super().stopService()  # type: ignore[no-untyped-call]
        self._stopping = True
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
        if self._connecting is not None:
            self._connecting.cancel()
        if self._connection is not None:
            self._connection.close()
        self._unregistered()
        # Post hooks of calls that were answered are still owed to their servers.
        drained: Deferred[object] = self.parts.dispatcher.drain()
        return drained
