"""The shared channel to one backend socket, what koordrp says when the backend is away, and unary calls
to it as Deferreds."""

import threading
import time
from dataclasses import dataclass
from typing import Callable, cast

import grpc
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorFromThreads

from koordrp.cri.reachability import Reachability, ReachabilityTracker
from koordrp.grpcdefer import failed_call, when_done
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

# grpc health's Watch: a stream the runtime keeps open, telling only of health changes (containerd serves it).
_WATCH = "/grpc.health.v1.Health/Watch"
_REWATCH_SECONDS = 1.0


class BackendChannel:
    """One grpc channel to a backend, reused by every call, watched for outages."""

    def __init__(self, path: str, report: ReachabilityReport) -> None:
        self.path = path
        self.channel = grpc.insecure_channel(grpc_target(path), options=CHANNEL_OPTIONS)
        self._tracker = ReachabilityTracker()
        self._report = report
        self._closed = False
        self._held: grpc.Future[bytes] | None = None
        self.channel.subscribe(self._on_connectivity, try_to_connect=True)
        threading.Thread(target=self._hold_open, name=f"koordrp-watch {path}", daemon=True).start()

    def _hold_open(self) -> None:
        """Keep one call open on the channel, so that its calls as futures find grpc's completion thread running.

        grpcio starts a thread for a channel's futures when none is in flight, and lets it end with
        the last one: on a channel with no other call open, every call would pay for starting a
        thread (~0.3 ms). A watch of the runtime's health stays open, so the thread does too; it is
        read here (its status only arrives once its messages are read), and opened again when the
        runtime went away. Any other end is final: a runtime that does not serve the watch answers
        UNIMPLEMENTED, and then costs only that.
        """
        watch = self.channel.unary_stream(_WATCH, _registered_method=True)  # type: ignore[call-arg]
        while not self._closed:
            opened = time.monotonic()
            held = watch(b"", wait_for_ready=True)  # waits while the runtime is away
            self._held = cast("grpc.Future[bytes]", held)
            try:
                for _ in held:
                    pass
            except grpc.RpcError as error:
                if cast(grpc.Call, error).code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    return
            # Never faster than once a second, whatever the runtime does with the watch.
            time.sleep(max(0.0, _REWATCH_SECONDS - (time.monotonic() - opened)))

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
        self._closed = True
        if self._held is not None:
            self._held.cancel()
        self.channel.unsubscribe(self._on_connectivity)
        self.channel.close()


Metadata = tuple[tuple[str, str | bytes], ...]


@dataclass(frozen=True)
class Answer:
    """What the runtime answered one unary call: its bytes, or its status; its trailing metadata either way."""

    code: grpc.StatusCode
    raw: bytes = b""
    details: str = ""
    trailing: Metadata = ()

    @property
    def ok(self) -> bool:
        return self.code is grpc.StatusCode.OK


def call_unary(
    reactor: IReactorFromThreads,
    method: "grpc.UnaryUnaryMultiCallable[bytes, bytes]",
    request: bytes,
    timeout: float | None,
    metadata: Metadata | None = None,
    handed: Callable[[Answer, Callable[[], None]], None] | None = None,
) -> "Deferred[Answer]":
    """Call ``method`` with ``request``; fires on the reactor with the Answer, whatever it is.

    ``handed`` is handed the Answer on grpc's thread, with what fires the Deferred on the reactor (``when_done``).
    Cancelling the Deferred cancels the call upstream at once.
    """
    future = method.future(request, timeout=timeout, metadata=metadata)
    return when_done(future, reactor, _answer, handed)


def _answer(done: "grpc.Future[bytes]") -> Answer:
    error = done.exception()
    if error is None:
        call = cast(grpc.Call, done)
        return Answer(grpc.StatusCode.OK, bytes(done.result()), trailing=tuple(call.trailing_metadata() or ()))
    failed = failed_call(error)
    if failed is None:
        return Answer(grpc.StatusCode.UNKNOWN, details=str(error))
    return Answer(failed.code(), details=failed.details() or "", trailing=tuple(failed.trailing_metadata() or ()))
