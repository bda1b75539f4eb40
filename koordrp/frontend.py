"""The seam between the daemon and its front end: CRI mode's grpc server, Docker mode's HTTP proxy, or NRI
mode's plugin connection to containerd."""

from twisted.application.service import IService
from twisted.internet.defer import Deferred


class IFrontEnd(IService):
    """A service through which the lifecycle calls reach koordrp: kubelet's (or cri-dockerd's) on koordrp's
    socket in front of a runtime, or containerd's NRI events."""

    def probe() -> Deferred:  # type: ignore[type-arg]
        """Ask the runtime whether it answers now (for /healthz): fires if it does, fails with the reason if not."""
