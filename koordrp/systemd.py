"""systemd's service notifications: ready, stopping, and a watchdog fed by the reactor.

With ``Type=notify`` systemd starts kubelet (ordered after koordrp) only once koordrp says
``READY=1``, which it does when its socket serves. ``STOPPING=1`` says the orderly stop began. With
``WatchdogSec=`` systemd sets ``$WATCHDOG_USEC``, and koordrp sends ``WATCHDOG=1`` from the reactor
thread at half that interval: pass-through calls would go on answering from grpc's threads while a
stalled reactor holds every hook call until its timeout, so the reactor is what proves liveness.

Each notification is one datagram to ``$NOTIFY_SOCKET`` (a path, or ``@name`` in the abstract
namespace). Without it, nothing is sent.
"""

import os
import socket
from typing import Mapping

from twisted.application import service
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

READY = b"READY=1"
STOPPING = b"STOPPING=1"
WATCHDOG = b"WATCHDOG=1"


def notify_address(environ: Mapping[str, str]) -> str | None:
    """Where ``$NOTIFY_SOCKET`` says systemd listens, as ``socket.sendto`` takes it."""
    path = environ.get("NOTIFY_SOCKET")
    if not path:
        return None
    return "\0" + path[1:] if path.startswith("@") else path


def watchdog_interval(environ: Mapping[str, str], pid: int) -> float | None:
    """Seconds between pings: half of ``$WATCHDOG_USEC``, when systemd watches this very process."""
    watched_pid = environ.get("WATCHDOG_PID")
    if watched_pid and watched_pid != str(pid):
        return None
    try:
        microseconds = int(environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return microseconds / 2_000_000 if microseconds > 0 else None


class SystemdNotifier(service.Service):
    """Placed after the front end in the service tree: starts once it serves, stops before it drains."""

    log = Logger()

    def __init__(self, clock: IReactorTime, environ: Mapping[str, str] = os.environ) -> None:
        self._address = notify_address(environ)
        self._interval = watchdog_interval(environ, os.getpid())
        self._watchdog = LoopingCall(self._send, WATCHDOG)
        self._watchdog.clock = clock
        self._complained = False

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self._send(READY)
        if self._address is not None and self._interval is not None:
            self._watchdog.start(self._interval, now=False)

    def stopService(self) -> None:
        super().stopService()  # type: ignore[no-untyped-call]
        if self._watchdog.running:
            self._watchdog.stop()
        self._send(STOPPING)

    def _send(self, message: bytes) -> None:
        if self._address is None:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as notifier:
                notifier.sendto(message, self._address)
        except OSError as error:
            if not self._complained:  # once: a watchdog ping every few seconds must not flood the log
                self._complained = True
                self.log.warn(
                    "cannot notify systemd at {address}: {reason}", address=self._address, reason=error.strerror
                )
