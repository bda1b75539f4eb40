"""The seam between the daemon and its front end: CRI mode's grpc server or Docker mode's HTTP proxy."""

from twisted.application.service import IService
from twisted.internet.defer import Deferred


class IFrontEnd(IService):
    """A service serving kubelet's (or cri-dockerd's) calls on koordrp's socket, in front of a runtime."""

    def probe() -> Deferred:  # type: ignore[type-arg]
        """Ask the runtime whether it answers now (for /healthz): fires if it does, fails with the reason if not."""
