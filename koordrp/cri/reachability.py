"""Turns a channel's connectivity changes into one report per outage and one per recovery."""

from enum import Enum

import grpc


class Reachability(Enum):
    FIRST_CONNECTED = "connected"
    UNREACHABLE = "unreachable"
    RECOVERED = "recovered"


class ReachabilityTracker:
    """Pure bookkeeping for a backend's reachability.

    grpc flips between CONNECTING and TRANSIENT_FAILURE on every reconnection attempt while the
    backend is away; an operator wants one line when it goes and one when it is back, not one per
    attempt, so only the edges of an outage are reported.
    """

    def __init__(self) -> None:
        self.state: grpc.ChannelConnectivity | None = None
        self._ever_connected = False
        self._in_outage = False

    @property
    def reachable(self) -> bool:
        return self.state is grpc.ChannelConnectivity.READY

    def observe(self, state: grpc.ChannelConnectivity) -> Reachability | None:
        self.state = state
        if state is grpc.ChannelConnectivity.READY:
            if self._in_outage:
                self._in_outage = False
                self._ever_connected = True
                return Reachability.RECOVERED
            if not self._ever_connected:
                self._ever_connected = True
                return Reachability.FIRST_CONNECTED
        elif state is grpc.ChannelConnectivity.TRANSIENT_FAILURE and not self._in_outage:
            self._in_outage = True
            return Reachability.UNREACHABLE
        return None
