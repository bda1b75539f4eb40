"""Docker mode as a Twisted service: the Docker API proxy on koordrp's socket, on the reactor."""

import os
from dataclasses import dataclass
from typing import Any

from twisted.application import service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IListeningPort
from twisted.logger import Logger

from koordrp.docker.http import json_response
from koordrp.docker.proxy import DockerProxyFactory, IDockerInterceptor
from koordrp.unixsocket import prepare_listening_path, remove_socket

SOCKET_MODE = 0o660


@dataclass(frozen=True)
class DockerProxySettings:
    listen_path: str
    backend_path: str
    socket_gid: int | None = None


class DockerProxyService(service.Service):
    log = Logger()

    def __init__(self, settings: DockerProxySettings, reactor: Any, interceptor: IDockerInterceptor | None) -> None:
        self.settings = settings
        self._reactor = reactor
        self._interceptor = interceptor
        self._port: IListeningPort | None = None

    def unavailable(self, reason: str) -> bytes:
        message = f"koordrp: backend unix://{self.settings.backend_path} is unavailable: {reason}"
        return json_response(503, "Service Unavailable", message)

    def startService(self) -> None:
        settings = self.settings
        prepare_listening_path(settings.listen_path)
        factory = DockerProxyFactory(settings.backend_path, self._reactor, self._interceptor, self.unavailable)
        self._port = self._reactor.listenUNIX(settings.listen_path, factory, mode=SOCKET_MODE, wantPID=False)
        if settings.socket_gid is not None:
            os.chown(settings.listen_path, -1, settings.socket_gid)
        super().startService()  # type: ignore[no-untyped-call]
        self.log.info(
            "serving the Docker API on unix://{listen}, backend unix://{backend}",
            listen=settings.listen_path,
            backend=settings.backend_path,
        )

    def stopService(self) -> "Deferred[None] | None":
        super().stopService()  # type: ignore[no-untyped-call]
        port, self._port = self._port, None
        if port is None:
            return None
        stopped: Deferred[None] = port.stopListening()  # type: ignore[assignment]

        def release(_: object) -> None:
            remove_socket(self.settings.listen_path)
            self.log.info("stopped; removed unix://{listen}", listen=self.settings.listen_path)

        return stopped.addCallback(release)
