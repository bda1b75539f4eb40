"""koordrp as an NRI plugin, for one connection to containerd: registration, configuration, and each
lifecycle event run through its flow (``koordrp.flows``), the third front end beside CRI and Docker.

NRI tells a plugin of a lifecycle call at the point where containerd is about to do it (create,
start, update: the answer may change it) or has done it (run a sandbox, stop, remove). The flows
are written for a front end that forwards the call and hears how it went; here "forwarding" is
answering containerd, and how it went is containerd's next event about the same container: its
PostCreateContainer, PostStartContainer or PostUpdateContainer (``koordrp.nri.confirmations``). So a
PostStartContainer hook runs once the container has started, as in the proxy, and a create that
containerd then failed is not stored.

What the plugin handles is one table, ``HANDLERS``: each of containerd's calls and events with its
handler. The events containerd is asked to send are those the table handles (``subscription``), as
containerd/nri's Go stub subscribes a plugin to the events whose handlers it implements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Coroutine, Iterable

from google.protobuf.message import DecodeError
from twisted.internet.defer import Deferred, TimeoutError as DeferredTimeout, ensureDeferred, fail, maybeDeferred, succeed
from twisted.logger import Logger, LogLevel
from twisted.python.failure import Failure

from koordrp import adapters
from koordrp.call import Call, Parts
from koordrp.drain import Drain
from koordrp import resync
from koordrp import flows
from koordrp.api.nri.v1alpha1 import api_pb2 as nri
from koordrp.hooks.limit import ANSWER_MARGIN, PreHookLimit, pre_hook_limit
from koordrp.hooks.messages import subject_text
from koordrp.nri import translate
from koordrp.nri.adapters import LateAnswers, NRIBackend, NRIReply, Synchronized, not_done
from koordrp.nri.catchup import REPLY_SLACK as CATCH_UP_REPLY_SLACK, CatchUp
from koordrp.nri.confirmations import UNDONE_CREATE, Confirmations
from koordrp.nri.connection import UNKNOWN, UNIMPLEMENTED, NRIConnection, NRIConnectionLost, NRIError
from koordrp.nri.told import ToldPods
from koordrp.nri.wire import MAX_TTRPC_MESSAGE
from koordrp.text import shortened

REGISTER_SECONDS = 5.0

STATE_CHANGE = "StateChange"
"""The Plugin method by which containerd tells of an event that needs no answer but its receipt."""

_EMPTY = nri.Empty().SerializeToString()

NOT_DONE = "containerd did not do the call"
"""Why the changes of a call containerd did not do are not applied (the call's line names them)."""


@dataclass
class _Synchronization:
    """A synchronization whose parts are still coming."""

    known_before: tuple[set[str], set[str]]
    """The store's ids when it began: what the runtime no longer has among them is forgotten."""
    began: float
    timeout: float | None
    """What containerd gave its first part: the time for all of them."""
    parts: list[nri.SynchronizeRequest] = field(default_factory=list)

    def late(self, now: float) -> bool:
        """Whether an answer now comes too late for containerd's deadline (koordrp keeps ANSWER_MARGIN of it)."""
        reply_by = self.reply_by(0.0)
        return reply_by is not None and now > reply_by

    def reply_by(self, slack: float) -> float | None:
        """When the answer must be on its way, keeping ``slack`` seconds to write it (None: containerd set no deadline)."""
        return None if self.timeout is None else self.began + self.timeout - ANSWER_MARGIN - slack


@dataclass(frozen=True)
class GivenUp:
    """Why a connection will not make koordrp a plugin, and how loud that is."""

    reason: str
    level: LogLevel


@dataclass(frozen=True)
class PluginIdentity:
    name: str
    index: str

    @property
    def full_name(self) -> str:
        return f"{self.index}-{self.name}"


class NRIPlugin:
    """One connection's plugin: registers, answers containerd's calls, and runs each event's flow."""

    log = Logger()

    def __init__(
        self,
        parts: Parts,
        identity: PluginIdentity,
        on_synchronized: Callable[[str, str], None] = lambda runtime, deadline: None,
        on_configured: Callable[[PreHookLimit], None] = lambda limit: None,
        catching_up: set[str] | None = None,
        told: ToldPods | None = None,
    ) -> None:
        """``on_synchronized`` is told containerd's name and version, and the deadline it gives each call, once it
        has synchronized the plugin;
        ``on_configured``, what pre hooks get of containerd's deadline, once it has configured it;
        ``catching_up``, the ids of what is being caught up (``CatchUp``), shared by every connection's plugin;
        ``told``, the pods containerd tells of, kept up by every connection's plugin."""
        self._parts = parts
        self._told = ToldPods() if told is None else told
        self._identity = identity
        self._catching_up = set() if catching_up is None else catching_up
        self._on_configured = on_configured
        self._confirmations = Confirmations(parts.clock)
        self._calls: set[Call[NRIReply]] = set()
        self._on_synchronized = on_synchronized
        self._connection: NRIConnection | None = None
        self._runtime = "containerd"
        self._deadline = "no deadline"
        self._synchronizing: _Synchronization | None = None
        self._synchronized = False
        self.given_up: GivenUp | None = None
        """Why this connection will not make koordrp a plugin, if it will not."""
        self._told_of_undone_creates = False
        self._quiet = Drain(parts.clock)

    # the connection

    def made(self, connection: NRIConnection) -> Deferred[None]:
        """Register with containerd (which then configures and synchronizes the plugin)."""
        self._connection = connection
        request = nri.RegisterPluginRequest(plugin_name=self._identity.name, plugin_idx=self._identity.index)
        registering = connection.call("RegisterPlugin", request.SerializeToString(), REGISTER_SECONDS)

        def failed(failure: Failure) -> None:
            if isinstance(failure.value, NRIConnectionLost):
                return  # the connection's loss is the reason
            if isinstance(failure.value, DeferredTimeout):
                why = f"containerd's NRI did not answer within {REGISTER_SECONDS:g}s"
            elif isinstance(failure.value, NRIError):
                why = f"containerd's NRI refused it: {shortened(failure.getErrorMessage())}"
            else:
                why = shortened(failure.getErrorMessage())
            self._give_up(f"cannot register as plugin {self._identity.full_name}: {why}", LogLevel.error)

        return registering.addCallbacks(lambda _: None, failed)

    def _give_up(self, reason: str, level: LogLevel) -> None:
        """This connection will not make koordrp containerd's plugin: it is closed, and ``reason`` is why."""
        if self.given_up is None:
            self.given_up = GivenUp(reason, level)
        if self._connection is not None:
            self._connection.close()

    def oversized(self, length: int) -> None:
        if not self._synchronized:
            # NRI 0.8 splits a synchronization that does not fit one message; NRI 0.6 sends it whole, and
            # then neither calls nor drops a plugin that could not take it.
            self._give_up(
                f"{self._runtime}'s NRI sent its synchronization (every pod and container on the node) as one "
                f"message beyond the {MAX_TTRPC_MESSAGE >> 20} MiB ttrpc carries, which NRI 0.6 cannot split: no NRI plugin "
                "can register while the node holds this much; containerd 1.7.26 or later (NRI 0.8) splits it, or run "
                "koordrp as the proxy (--backend-runtime-mode=Containerd)",
                LogLevel.error,
            )
        else:
            self.log.error(
                "containerd's NRI sent a request of {length} bytes, beyond the {limit} MiB ttrpc carries: it was answered "
                "RESOURCE_EXHAUSTED (containerd fails that call)",
                length=length,
                limit=MAX_TTRPC_MESSAGE >> 20,
            )

    def quiet(self, timeout: float) -> Deferred[None]:
        """Fires once none of containerd's calls is in flight (those that come meanwhile included), or after
        ``timeout`` seconds, whichever is first."""
        if self._calls and not self._quiet.waiting:
            self.log.info(
                "stopping: {count} of containerd's NRI calls in flight get up to {timeout:.3g}s; koordrp stays its plugin meanwhile",
                count=len(self._calls),
                timeout=timeout,
            )
        return self._quiet.wait(bool(self._calls), timeout)

    def lost(self, reason: Failure) -> None:
        self._confirmations.cancel_all()
        for call in list(self._calls):
            call.cancel()

    # containerd's calls

    def called(self, method: str, payload: bytes, timeout: float | None) -> Deferred[bytes]:
        handler = _REQUESTS.get(method)
        if handler is None:
            return fail(NRIError(UNIMPLEMENTED, f"koordrp does not handle {method}"))
        try:
            return handler.answer(self, payload, timeout)
        except DecodeError as error:
            return self._unreadable(method, handler.lifecycle, timeout, str(error))
        except Exception:
            return fail()  # the connection answers it, and says it (``koordrp.nri.connection``)

    def _unreadable(self, method: str, lifecycle: str | None, timeout: float | None, reason: str) -> Deferred[bytes]:
        """A request koordrp cannot read: a lifecycle call goes on as containerd has it (``flows.unreadable``)."""
        if lifecycle is None:
            # Which event a StateChange is cannot be known; the plugin's own calls are not for hooks.
            self.log.warn("cannot read containerd's NRI {method} request: {reason}", method=method, reason=shortened(reason))
            if method == STATE_CHANGE:
                return succeed(_EMPTY)
            return fail(NRIError(UNKNOWN, f"koordrp cannot read the {method} request: {shortened(reason)}"))
        return self._run(
            lifecycle,
            timeout,
            lambda answer: NRIBackend(answer, _EMPTY, None, None, None),
            lambda call: flows.unreadable(call, lifecycle, reason),
        )

    def _configure(self, payload: bytes, timeout: float | None) -> Deferred[bytes]:
        request = nri.ConfigureRequest.FromString(payload)
        self._runtime = f"{request.runtime_name} {request.runtime_version}"
        # NRI 0.8 (containerd 2.x) says its request timeout; NRI 0.6 (1.7) gives Configure that deadline.
        if request.request_timeout > 0:
            request_timeout: float | None = request.request_timeout / 1000
        else:
            request_timeout = None if timeout is None else math.ceil(timeout * 100) / 100
        if request_timeout is None:
            self._deadline = "no deadline"
        else:
            self._deadline = f"{request_timeout:g}s (plugin_request_timeout)"
            self._on_configured(pre_hook_limit(request_timeout))
        return succeed(nri.ConfigureResponse(events=EVENT_MASK).SerializeToString())

    def _synchronize(self, payload: bytes, timeout: float | None) -> Deferred[bytes]:
        """Collect containerd's synchronization (in parts, NRI 0.8: each answered at once); the store agrees
        with the whole of it once the last part has come, within the deadline the first part gave."""
        if self._synchronizing is None:
            self._synchronizing = _Synchronization(self._parts.store.ids(), self._parts.clock.seconds(), timeout)
        synchronizing = self._synchronizing

        async def collected(part: nri.SynchronizeRequest) -> bytes:
            synchronizing.parts.append(part)
            if part.more:
                return nri.SynchronizeResponse(more=True).SerializeToString()
            self._synchronizing = None
            whole = translate.synchronization(synchronizing.parts)
            found = await resync.read_everything(Synchronized(whole), None)
            resync.agree(self._parts.store, found, synchronizing.known_before, "containerd's NRI")
            self._told.synchronized(found.pod_ids)
            # What was made while koordrp was away gets the pre hooks it missed; what they change goes in the reply,
            # or follows it (the reply never waits past containerd's deadline).
            reply_by = synchronizing.reply_by(CATCH_UP_REPLY_SLACK)
            catch_up = CatchUp(self._parts, LateAnswers(self._connection), self._catching_up)
            updates = await catch_up.reply(whole, reply_by)
            if synchronizing.late(self._parts.clock.seconds()):
                catch_up.not_replied()
                raise NRIError(UNKNOWN, f"koordrp synchronized after containerd's deadline ({synchronizing.timeout:g}s from its first part)")
            self._synchronized = True
            self._on_synchronized(self._runtime, self._deadline)
            return nri.SynchronizeResponse(update=updates).SerializeToString()

        def not_synchronized(failure: Failure) -> bytes:
            # containerd keeps a plugin it could not synchronize connected, but never calls it: only a
            # new connection makes koordrp a plugin again.
            self._synchronizing = None
            reason = shortened(failure.getErrorMessage())
            self._give_up(f"cannot synchronize with {self._runtime}'s NRI: {reason}", LogLevel.error)
            raise NRIError(UNKNOWN, f"koordrp cannot synchronize: {reason}")

        reading = maybeDeferred(nri.SynchronizeRequest.FromString, payload).addCallback(lambda part: ensureDeferred(collected(part)))
        return reading.addErrback(not_synchronized)

    def _shutdown(self, payload: bytes, timeout: float | None) -> Deferred[bytes]:
        self.log.info("containerd's NRI is shutting down")
        return succeed(_EMPTY)

    def _create_container(self, payload: bytes, timeout: float | None) -> Deferred[bytes]:
        request = nri.CreateContainerRequest.FromString(payload)
        empty = nri.CreateContainerResponse().SerializeToString()
        return self._run(
            "CreateContainer",
            timeout,
            lambda answer: NRIBackend(answer, empty, request.pod, request.container, self._expect("create", request.container.id)),
            lambda call: flows.create_container(call, translate.CreateContainer(request.pod, request.container), request.container.id),
            late=LateAnswers(self._connection),
        )

    def _update_container(self, payload: bytes, timeout: float | None) -> Deferred[bytes]:
        request = nri.UpdateContainerRequest.FromString(payload)
        empty = nri.UpdateContainerResponse().SerializeToString()
        resources = request.linux_resources if request.HasField("linux_resources") else None
        return self._run(
            "UpdateContainerResources",
            timeout,
            lambda answer: NRIBackend(answer, empty, request.pod, request.container, self._expect("update", request.container.id)),
            lambda call: flows.update_container_resources(call, translate.UpdateContainer(request.container, resources)),
        )

    def _stop_container(self, payload: bytes, timeout: float | None) -> Deferred[bytes]:
        request = nri.StopContainerRequest.FromString(payload)
        self._confirmations.happened(nri.STOP_CONTAINER, request.container)
        empty = nri.StopContainerResponse().SerializeToString()
        # Not read back when the store lacks it: after Synchronize the store has every container koordrp
        # could be told of, so this is one whose create failed (containerd tells of its undoing as a stop).
        return self._run(
            "StopContainer",
            timeout,
            lambda answer: NRIBackend(answer, empty, request.pod, None, None),
            lambda call: flows.stop_container(call, request.container.id),
        )

    def _state_change(self, payload: bytes, timeout: float | None) -> Deferred[bytes]:
        event = nri.StateChangeEvent.FromString(payload)
        self._confirmations.happened(event.event, event.container)
        handler = _EVENTS.get(event.event)
        if handler is None:
            return succeed(_EMPTY)  # an event no handler takes: containerd sends none it was not asked for
        return handler.take(self, event, timeout)

    # the events containerd tells of once done

    def _run_pod_sandbox(self, event: nri.StateChangeEvent, timeout: float | None) -> Deferred[bytes]:
        pod = event.pod
        self._told.ran(pod.id)
        return self._done(event, timeout, "RunPodSandbox", lambda call: flows.run_pod_sandbox(call, translate.RunPodSandbox(pod), pod.id))

    def _start_container(self, event: nri.StateChangeEvent, timeout: float | None) -> Deferred[bytes]:
        container_id = event.container.id
        return self._done(
            event, timeout, "StartContainer", lambda call: flows.start_container(call, container_id), self._expect("start", container_id)
        )

    def _stop_pod_sandbox(self, event: nri.StateChangeEvent, timeout: float | None) -> Deferred[bytes]:
        sandbox_id = event.pod.id
        # Not read back, like StopContainer: after Synchronize, a pod the store lacks is one whose run failed.
        return self._done(event, timeout, "StopPodSandbox", lambda call: flows.stop_pod_sandbox(call, sandbox_id), readable=False)

    def _remove_container(self, event: nri.StateChangeEvent, timeout: float | None) -> Deferred[bytes]:
        container_id = event.container.id
        return self._done(event, timeout, "RemoveContainer", lambda call: flows.remove_container(call, container_id))

    def _remove_pod_sandbox(self, event: nri.StateChangeEvent, timeout: float | None) -> Deferred[bytes]:
        sandbox_id = event.pod.id
        self._told.removed(sandbox_id)
        return self._done(event, timeout, "RemovePodSandbox", lambda call: flows.remove_pod_sandbox(call, sandbox_id))

    def _confirmed(self, event: nri.StateChangeEvent, timeout: float | None) -> Deferred[bytes]:
        """A Post event: the confirmation ``_state_change`` gave it is all it is for."""
        return succeed(_EMPTY)

    def _done(
        self,
        event: nri.StateChangeEvent,
        timeout: float | None,
        method: str,
        flow: Callable[[Call[NRIReply]], Coroutine[Any, Any, NRIReply]],
        confirm: Callable[[], Deferred[str | None]] | None = None,
        readable: bool = True,
    ) -> Deferred[bytes]:
        """Run ``method``'s flow for an event containerd has done; ``readable``: the flow may read the pod from it."""
        pod = event.pod if readable else None
        container = event.container if event.HasField("container") else None
        return self._run(method, timeout, lambda answer: NRIBackend(answer, _EMPTY, pod, container, confirm), flow)

    # running a flow

    def _not_done(self, call: Call[NRIReply], why: str) -> None:
        """containerd did not do what it told koordrp of: the call's line says why, and that its hooks' changes
        were not applied."""
        not_done(call, why, NOT_DONE)
        changed = next(call.record.left_alone(), None) is not None
        if why == UNDONE_CREATE and changed and not self._told_of_undone_creates:
            self._told_of_undone_creates = True
            subject = call.record.subject
            self.log.warn(
                "containerd undid a create that koordrp's hooks changed ({subject}): it failed after koordrp answered. "
                "If another NRI plugin sets a field koordrp's hooks set, NRI fails every such create (kubelet's event "
                "and containerd's log say 'plugins \"…\" and \"…\" both tried to set …'); koordlet's own NRI plugin "
                "(-enable-nri-runtime-hook) beside koordrp does (said once per connection to containerd).",
                subject="?" if subject is None else subject_text(subject),
            )

    def _expect(self, kind: str, container_id: str) -> Callable[[], Deferred[str | None]]:
        return lambda: self._confirmations.expect(kind, container_id)

    def _run(
        self,
        method: str,
        timeout: float | None,
        backend: Callable[[Deferred[bytes]], NRIBackend],
        flow: Callable[[Call[NRIReply]], Coroutine[Any, Any, NRIReply]],
        late: LateAnswers | None = None,
    ) -> Deferred[bytes]:
        """Run ``flow`` for containerd's request; the Deferred is containerd's answer (the flow may go on after it).

        ``late``: how an answer that comes after containerd's deadline is still applied.
        """
        answer: Deferred[bytes] = Deferred(lambda _: call.cancel())
        call = Call(
            self._parts,
            method,
            backend(answer),
            None if timeout is None else max(timeout - ANSWER_MARGIN, 0.0),
            # Nothing is forwarded after the hooks: they may take what containerd gives.
            hooks_share=1.0,
            late=late,
            # containerd logs its events; koordlet's own NRI plugin logs those it handles only at a raised verbosity.
            uneventful_line=False,
        )
        self._calls.add(call)

        def over(outcome: adapters.Outcome[NRIReply]) -> None:
            self._calls.discard(call)
            if isinstance(outcome, NRIReply) and not outcome.ok:
                self._not_done(call, outcome.why_not)
            if not answer.called:
                if isinstance(outcome, adapters.Refusal):
                    answer.errback(NRIError(outcome.status_code, outcome.message))
                else:
                    answer.errback(NRIError(UNKNOWN, "koordrp: the call was given up"))
            call.ended()  # its post stages are announced: a stop that waited for the calls drains them next
            if not self._calls:
                self._quiet.idle()

        call.run(flow(call)).addCallback(over)
        return answer


@dataclass(frozen=True)
class RequestHandler:
    """How the plugin answers one of containerd's requests: ``answer`` gets its payload, unread, and what is left
    of containerd's deadline."""

    answer: Callable[[NRIPlugin, bytes, float | None], Deferred[bytes]]
    event: int | None = None
    """The event that subscribes the plugin to the request; None: containerd makes it of every plugin."""
    lifecycle: str | None = None
    """The lifecycle call it tells of (as flows and hooks name it): an unreadable request goes on as that call."""


@dataclass(frozen=True)
class EventHandler:
    """How the plugin takes an event containerd tells of once done (a StateChange), ``event`` being subscribed to."""

    event: int
    take: Callable[[NRIPlugin, nri.StateChangeEvent, float | None], Deferred[bytes]]


HANDLERS: dict[str, RequestHandler | EventHandler] = {
    # containerd's calls of every plugin
    "Configure": RequestHandler(NRIPlugin._configure),
    "Synchronize": RequestHandler(NRIPlugin._synchronize),
    "Shutdown": RequestHandler(NRIPlugin._shutdown),
    STATE_CHANGE: RequestHandler(NRIPlugin._state_change),
    # what containerd is about to do: the answer may change it
    "CreateContainer": RequestHandler(NRIPlugin._create_container, nri.CREATE_CONTAINER, "CreateContainer"),
    "UpdateContainer": RequestHandler(NRIPlugin._update_container, nri.UPDATE_CONTAINER, "UpdateContainerResources"),
    "StopContainer": RequestHandler(NRIPlugin._stop_container, nri.STOP_CONTAINER, "StopContainer"),
    # what containerd has done: every event the store needs to follow pods and containers, and the Post events
    # that confirm what the plugin was told of
    "RunPodSandbox": EventHandler(nri.RUN_POD_SANDBOX, NRIPlugin._run_pod_sandbox),
    "StartContainer": EventHandler(nri.START_CONTAINER, NRIPlugin._start_container),
    "StopPodSandbox": EventHandler(nri.STOP_POD_SANDBOX, NRIPlugin._stop_pod_sandbox),
    "RemoveContainer": EventHandler(nri.REMOVE_CONTAINER, NRIPlugin._remove_container),
    "RemovePodSandbox": EventHandler(nri.REMOVE_POD_SANDBOX, NRIPlugin._remove_pod_sandbox),
    "PostCreateContainer": EventHandler(nri.POST_CREATE_CONTAINER, NRIPlugin._confirmed),
    "PostStartContainer": EventHandler(nri.POST_START_CONTAINER, NRIPlugin._confirmed),
    "PostUpdateContainer": EventHandler(nri.POST_UPDATE_CONTAINER, NRIPlugin._confirmed),
}
"""What the plugin handles, by the name containerd/nri's Go stub gives each handler: a request's is its method;
the events come by StateChange."""


def subscription(handlers: Iterable[RequestHandler | EventHandler]) -> int:
    """The events to ask containerd for (Configure's mask): those ``handlers`` handle."""
    return sum(1 << (handler.event - 1) for handler in handlers if handler.event is not None)


EVENT_MASK = subscription(HANDLERS.values())
_REQUESTS = {method: handler for method, handler in HANDLERS.items() if isinstance(handler, RequestHandler)}
_EVENTS = {handler.event: handler for handler in HANDLERS.values() if isinstance(handler, EventHandler)}
