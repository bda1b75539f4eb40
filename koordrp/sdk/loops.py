"""How the SDK answers a hook call: grpc worker threads waiting for handlers run on an event loop.

grpcio serves each call on a worker thread, which waits for the handler's answer, at most until
the call's deadline. The handler itself runs on an event loop, so that it may use that loop's APIs
without thinking about threads. Which loop follows txaio's process-wide choice of framework:

* by default (the program chose none), a plain handler runs on the Twisted reactor's thread and an
  ``async def`` handler on an asyncio event loop the SDK owns (one thread per running server);
* after ``txaio.use_twisted()``, every handler runs on the reactor, and ``async def`` handlers are
  Twisted coroutines (they await Deferreds);
* after ``txaio.use_asyncio()``, every handler runs on the SDK's asyncio loop.

If nothing runs the reactor when a handler needs it, the SDK runs it in a daemon thread. A program
that runs the reactor itself should call serve() once it is running.

On the reactor, a handler may return a message, ``None``, a Deferred firing with one of them, or a
coroutine (run by Twisted, as ``maybeDeferred`` does). On the asyncio loop it may return the same
values, an asyncio future or a coroutine. The SDK uses txaio's per-framework APIs (``txaio.tx``, and
``txaio.aio`` configured for its own loop): ``as_future`` turns whatever the handler returns or
raises into a future of that framework, and ``add_callbacks`` hands the outcome to the waiting grpc
thread. The SDK never makes txaio's choice itself.

A handler that raises ``Refuse(reason)`` refuses the call: it fails with ``FAILED_PRECONDITION`` and
the reason as its message, logged in one line. Any other exception (or a Deferred or coroutine that
fails so) is a bug in the handler: ``INTERNAL``, the exception's type and message, and its traceback
in the log. koordrp applies the registration's failure policy to both. A hook with no handler
answers ``UNIMPLEMENTED``. When the caller gives up (koordrp's timeout), the handler's Deferred or
task is cancelled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import threading
from typing import Any, Callable, Protocol

import grpc
import txaio.aio
import txaio.tx
from twisted.internet.defer import Deferred

from koordrp.api.runtime.v1alpha1 import api_pb2
from koordrp.hooks.messages import HookRequest, subject_text
from koordrp.hooks.types import HookType
from koordrp.sdk import advice

log = logging.getLogger("koordrp.sdk")

SERVICE = "runtime.v1alpha1.RuntimeHookService"

REFUSED = grpc.StatusCode.FAILED_PRECONDITION
"""The status of a refused call. The request is well formed and koordrp may call (not INVALID_ARGUMENT,
not PERMISSION_DENIED, which would send an operator after koordrp's rights on the socket): the pod or
container does not meet the server's condition, and asking again will not change that until the pod
or the server does, which is what FAILED_PRECONDITION says."""


class Refuse(Exception):
    """Raised by a handler to refuse the call: ``reason`` reaches koordrp as the message of a
    FAILED_PRECONDITION status, and the server logs one line (no traceback: it is an answer, not a bug).

    What follows is the registration's failure policy: with ``Fail`` the CRI call fails with the
    reason in its message and the runtime is not called; with ``Ignore`` koordrp logs a warning and
    the call goes on without this server's answer. Post hooks cannot refuse: their failures are only
    logged.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def response_type(hook: HookType) -> type[api_pb2.PodSandboxHookResponse] | type[api_pb2.ContainerResourceHookResponse]:
    return api_pb2.PodSandboxHookResponse if hook.is_pod_hook else api_pb2.ContainerResourceHookResponse


def request_type(hook: HookType) -> type[api_pb2.PodSandboxHookRequest] | type[api_pb2.ContainerResourceHookRequest]:
    return api_pb2.PodSandboxHookRequest if hook.is_pod_hook else api_pb2.ContainerResourceHookRequest


class _FutureApi(Protocol):
    """The part of txaio's per-framework API the SDK uses (txaio itself is unannotated)."""

    def as_future(self, fun: Callable[..., object], *args: object) -> Any: ...

    def add_callbacks(self, future: Any, callback: Callable[[Any], None], errback: Callable[[Any], None]) -> Any: ...

    def cancel(self, future: Any) -> None: ...


class _EventLoop(Protocol):
    api: _FutureApi

    def call_from_thread(self, call: Callable[[], None]) -> None: ...


class _Call:
    """One handler invocation on an event loop, awaited from a grpc thread."""

    def __init__(self, loop: _EventLoop, function: Callable[..., object], *args: object) -> None:
        self.outcome: concurrent.futures.Future[object] = concurrent.futures.Future()
        self._loop = loop
        self._future: Any = None
        self._cancelled = False
        # Both run on the loop in the order they were queued, so a cancel always finds the future.
        loop.call_from_thread(lambda: self._start(function, args))

    def _start(self, function: Callable[..., object], args: tuple[object, ...]) -> None:
        api = self._loop.api
        try:
            self._future = api.as_future(function, *args)
            api.add_callbacks(self._future, self._settle, self._fail)
        except Exception as error:  # txaio refusing the result: the grpc thread must not wait in vain
            self.outcome.set_exception(error)

    def _settle(self, result: object) -> None:
        if not self.outcome.done():
            self.outcome.set_result(result)

    def _fail(self, failure: Any) -> None:
        # Returning None marks a Twisted failure as handled: the grpc thread reports it instead.
        if not self.outcome.done():
            self.outcome.set_exception(failure.value)

    def cancel(self) -> None:
        """Thread-safe; a call already answered is left alone."""
        if self.outcome.done() or self._cancelled:
            return
        self._cancelled = True
        self._loop.call_from_thread(self._cancel_on_loop)

    def _cancel_on_loop(self) -> None:
        if self._future is not None:
            self._loop.api.cancel(self._future)


class _Reactor:
    """The Twisted reactor, as an event loop handlers run on."""

    _lock = threading.Lock()

    def __init__(self) -> None:
        from twisted.internet import reactor

        # Any: run(installSignalHandlers=...) is the global reactor's own, in no interface.
        self._reactor: Any = reactor
        self.api: _FutureApi = txaio.tx.with_config()  # type: ignore[no-untyped-call]

    def call_from_thread(self, call: Callable[[], None]) -> None:
        self._ensure_running()
        self._reactor.callFromThread(call)

    def _ensure_running(self) -> None:
        """Run the reactor in a daemon thread if nobody runs it.

        Decided at call time, not when serving starts: a program (or trial) that runs the reactor
        itself may not have started it yet when it calls serve().
        """
        if self._reactor.running:
            return
        with self._lock:
            if self._reactor.running:
                return
            started = threading.Event()
            self._reactor.callWhenRunning(started.set)
            thread = threading.Thread(target=self._run, args=(started,), name="koordrp-sdk-reactor", daemon=True)
            thread.start()
            started.wait()
            if not self._reactor.running:
                raise RuntimeError("the Twisted reactor is not running and could not be started")

    def _run(self, started: threading.Event) -> None:
        try:
            # Signals belong to the main thread (RunningServer.wait), not to a reactor in a thread.
            self._reactor.run(installSignalHandlers=False)
        except Exception:
            log.exception("the Twisted reactor failed")
        finally:
            started.set()


class AsyncioThread:
    """A private asyncio event loop in a thread of its own, for ``async def`` handlers."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self.api: _FutureApi = txaio.aio.with_config(loop=self._loop)  # type: ignore[no-untyped-call]
        self._thread = threading.Thread(target=self._run, name="koordrp-sdk-asyncio", daemon=True)
        self._thread.start()

    def call_from_thread(self, call: Callable[[], None]) -> None:
        self._loop.call_soon_threadsafe(call)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
            # Handlers still running when the server stops are cancelled and given a turn to unwind.
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
        finally:
            self._loop.close()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()


class HandlerError(Exception):
    """A handler's answer that is not one koordrp can take."""


class Calls:
    """The grpc side: one method handler per hook, each waiting for its handler's answer."""

    _reactor: _Reactor | None = None

    def __init__(self, handlers: dict[HookType, Callable[[Any], object]], asyncio_loop: AsyncioThread) -> None:
        """``handlers`` take their own hook's request type (pod or container), hence Any."""
        self._handlers = handlers
        self._asyncio = asyncio_loop
        self._advised: set[HookType] = set()

    def generic_handler(self) -> grpc.GenericRpcHandler:  # type: ignore[type-arg]
        methods = {
            hook.rpc_name: grpc.unary_unary_rpc_method_handler(
                self._behaviour(hook),
                request_deserializer=request_type(hook).FromString,
                response_serializer=response_type(hook).SerializeToString,
            )
            for hook in HookType
        }
        return grpc.method_handlers_generic_handler(SERVICE, methods)

    def _behaviour(self, hook: HookType) -> Callable[[Any, grpc.ServicerContext], object]:
        handler = self._handlers.get(hook)
        if handler is None:

            def unimplemented(request: HookRequest, context: grpc.ServicerContext) -> object:
                context.abort(grpc.StatusCode.UNIMPLEMENTED, f"this hook server does not handle {hook.value}")

            return unimplemented

        def answer(request: HookRequest, context: grpc.ServicerContext) -> object:
            return self._answer(hook, handler, request, context)

        return answer

    def _answer(
        self, hook: HookType, handler: Callable[[Any], object], request: HookRequest, context: grpc.ServicerContext
    ) -> object:
        try:
            with advice.handed(request):
                answer = _checked(hook, self._run(self._loop_for(handler), handler, request, context))
                self._advise(hook, request, answer)
            return answer
        except Refuse as refusal:
            log.info("%s refused for %s: %s", hook.value, subject_text(request), refusal.reason)
            context.abort(REFUSED, refusal.reason)
        except concurrent.futures.TimeoutError:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"{hook.value} handler did not answer in time")
        except (concurrent.futures.CancelledError, asyncio.CancelledError):
            context.abort(grpc.StatusCode.CANCELLED, f"{hook.value} handler was cancelled")
        except Exception as error:
            if not isinstance(error, HandlerError):
                log.error("%s handler failed", hook.value, exc_info=error)
            context.abort(grpc.StatusCode.INTERNAL, f"{hook.value} handler failed: {_describe(error)}")

    def _advise(self, hook: HookType, request: HookRequest, answer: object) -> None:
        """Warn, once per handler, of an answer that clears what the request had without meaning to."""
        if hook in self._advised or not isinstance(answer, api_pb2.ContainerResourceHookResponse):
            return
        assert isinstance(request, api_pb2.ContainerResourceHookRequest)
        fields = advice.cleared(request, answer)
        if fields:
            self._advised.add(hook)
            log.warning("%s", advice.advice(hook.value, fields))

    def _loop_for(self, handler: Callable[..., object]) -> _EventLoop:
        # Read at each call rather than at serve(): txaio's choice may be made after serving starts.
        # getattr: use_twisted()/use_asyncio() set these flags, which txaio does not declare.
        if getattr(txaio, "using_asyncio", False):
            return self._asyncio
        if getattr(txaio, "using_twisted", False) or not inspect.iscoroutinefunction(handler):
            return self._twisted()
        return self._asyncio

    def _run(self, loop: _EventLoop, function: Callable[..., object], argument: object, context: grpc.ServicerContext) -> object:
        call = _Call(loop, function, argument)
        # Called when the RPC ends for any reason; for one that ended early (koordrp's timeout, or
        # koordrp stopping), the handler's Deferred or task is cancelled rather than left running.
        context.add_callback(call.cancel)
        try:
            return call.outcome.result(timeout=context.time_remaining())
        except concurrent.futures.TimeoutError:
            call.cancel()
            raise

    @classmethod
    def _twisted(cls) -> _Reactor:
        # Created on first use: importing twisted.internet.reactor installs the default reactor,
        # which a program choosing another reactor must be able to do first.
        if cls._reactor is None:
            cls._reactor = _Reactor()
        return cls._reactor


def _checked(hook: HookType, result: object) -> object:
    expected = response_type(hook)
    if result is None:
        return expected()
    if isinstance(result, expected):
        return result
    if isinstance(result, Deferred):
        raise HandlerError("returned a Deferred on the asyncio loop; Deferreds need the reactor (see koordrp.sdk)")
    if inspect.isawaitable(result):
        raise HandlerError(f"returned {type(result).__name__}, which the reactor cannot await; use async def")
    raise HandlerError(f"returned {type(result).__name__}; {hook.value} answers {expected.__name__} or None")


def _describe(error: BaseException) -> str:
    if isinstance(error, HandlerError):
        return str(error)
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
