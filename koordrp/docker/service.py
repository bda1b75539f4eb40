"""Docker mode as a Twisted service: the Docker API proxy on koordrp's socket, on the reactor."""

from dataclasses import dataclass
from typing import Any

from twisted.application import service
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.interfaces import IDelayedCall, IListeningPort
from twisted.logger import Logger
from twisted.python.failure import Failure

from koordrp.docker.http import json_response
from koordrp.docker.intercept import DockerInterceptor
from koordrp.docker.proxy import DockerProxyFactory
from koordrp.unixsocket import SOCKET_MODE, prepare_listening_path, remove_socket, restrict_socket

_REBUILD_RETRY_SECONDS = 1.0


@dataclass(frozen=True)
class DockerProxySettings:
    listen_path: str
    backend_path: str
    socket_gid: int | None = None


class DockerProxyService(service.Service):
    log = Logger()

    def __init__(self, settings: DockerProxySettings, reactor: Any, interceptor: DockerInterceptor) -> None:
        self.settings = settings
        self._reactor = reactor
        self._interceptor = interceptor
        self._port: IListeningPort | None = None
        self._rebuild_call: IDelayedCall | None = None

    def unavailable(self, reason: str) -> bytes:
        message = f"koordrp: backend unix://{self.settings.backend_path} is unavailable: {reason}"
        return json_response(503, "Service Unavailable", message)

    def startService(self) -> None:
        settings = self.settings
        prepare_listening_path(settings.listen_path)
        factory = DockerProxyFactory(settings.backend_path, self._reactor, self._interceptor, self.unavailable)
        self._port = self._reactor.listenUNIX(settings.listen_path, factory, mode=SOCKET_MODE, wantPID=False)
        restrict_socket(settings.listen_path, settings.socket_gid)
        super().startService()  # type: ignore[no-untyped-call]
        self.log.info(
            "serving the Docker API on unix://{listen}, backend unix://{backend}",
            listen=settings.listen_path,
            backend=settings.backend_path,
        )
        self._rebuild_store()

    def _rebuild_store(self) -> None:
        """Learn what dockerd already runs; while dockerd is away, try again every second."""
        self._rebuild_call = None
        rebuilding = ensureDeferred(self._interceptor.rebuild())

        def learnt(count: int) -> None:
            self.log.info("store rebuilt from dockerd: {count} Kubernetes containers", count=count)

        def retry(failure: Failure) -> None:
            if self.running:
                self._rebuild_call = self._reactor.callLater(_REBUILD_RETRY_SECONDS, self._rebuild_store)

        rebuilding.addCallbacks(learnt, retry)

    def stopService(self) -> "Deferred[None] | None":
        super().stopService()  # type: ignore[no-untyped-call]
        if self._rebuild_call is not None and self._rebuild_call.active():
            self._rebuild_call.cancel()
        port, self._port = self._port, None
        if port is None:
            return None
        stopped: Deferred[None] = port.stopListening()  # type: ignore[assignment]
        # Post hooks of calls that were answered are still owed to their servers.
        stopped.addCallback(lambda _: self._interceptor.drain())

        def release(_: object) -> None:
            remove_socket(self.settings.listen_path)
            self.log.info("stopped; removed unix://{listen}", listen=self.settings.listen_path)

        return stopped.addCallback(release)
