"""The shared channel to one backend socket, and what koordrp says when the backend is away."""

from typing import Callable

import grpc

from koordrp.cri.reachability import Reachability, ReachabilityTracker
from koordrp.unix import grpc_target

# A backend that comes back must be used again within about a second, so grpc's reconnect backoff
# (120 s at most by default) is capped; message sizes are left to the backend and to kubelet, so
# that koordrp never refuses something containerd would accept.
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    ("grpc.enable_retries", 0),
]

ReachabilityReport = Callable[[Reachability, str], None]


class BackendChannel:
    """One grpc channel to a backend, reused by every call, watched for outages."""

    def __init__(self, path: str, report: ReachabilityReport) -> None:
        self.path = path
        self.channel = grpc.insecure_channel(grpc_target(path), options=CHANNEL_OPTIONS)
        self._tracker = ReachabilityTracker()
        self._report = report
        self.channel.subscribe(self._on_connectivity, try_to_connect=True)

    @property
    def reachable(self) -> bool:
        return self._tracker.reachable

    def _on_connectivity(self, state: grpc.ChannelConnectivity) -> None:
        change = self._tracker.observe(state)
        if change is not None:
            self._report(change, self.path)

    def outage_details(self, details: str | None) -> str:
        """The message a caller gets when the backend itself could not be reached."""
        return f"koordrp: backend unix://{self.path} is unavailable: {details or 'no connection'}"

    def close(self) -> None:
        self.channel.unsubscribe(self._on_connectivity)
        self.channel.close()
