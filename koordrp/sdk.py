"""Writing a runtime hook server in Python: handlers per hook, served on a unix socket, registered.

A hook server answers koordrp's ``RuntimeHookService`` calls. With this module it is a class or a
handful of functions::

    from koordrp.sdk import HookServer

    class Pinning(HookServer):
        def PreCreateContainer(self, request):
            response = ContainerResourceHookResponse()
            response.container_resources.cpuset_cpus = "0-1"
            return response

    with Pinning().serve("/run/pinning/pinning.sock", register_in="/etc/runtime/hookserver.d") as running:
        running.wait()

Handlers are named after the hook exactly as hookserver.d files spell it (``PreCreateContainer``,
not ``pre_create_container`` nor the RPC's ``PreCreateContainerHook``), or registered with
``@server.hook(HookType.PRE_CREATE_CONTAINER)`` / ``@server.hook("PreCreateContainer")``.

Where a handler runs, and how its answer is awaited
---------------------------------------------------
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

A handler that raises (or whose Deferred or coroutine fails) fails the call with ``INTERNAL`` and
the exception's message; koordrp then applies the registration's failure policy. A hook with no
handler answers ``UNIMPLEMENTED``. When the caller gives up (koordrp's timeout), the handler's
Deferred or task is cancelled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import logging
import math
import os
import signal
import stat
import tempfile
import threading
from types import FrameType, TracebackType
from typing import Any, Awaitable, Callable, Literal, Mapping, Protocol, TypeVar, Union, overload

import grpc
import txaio.aio
import txaio.tx
from twisted.internet.defer import Deferred

from koordrp.api.runtime.v1alpha1 import api_pb2
from koordrp.endpoints import EndpointError, grpc_target, parse_unix_endpoint
from koordrp.hooks.config import MAX_SOCKET_PATH_BYTES
from koordrp.hooks.types import FailurePolicy, HookType
from koordrp.unixsocket import prepare_listening_path, umask

__all__ = [
    "ContainerHandler",
    "HookServer",
    "PodHandler",
    "RunningServer",
    "hook_type",
]

log = logging.getLogger(__name__)

SERVICE = "runtime.v1alpha1.RuntimeHookService"

REGISTRATION_MODE = 0o644
"""koordrp refuses registrations others can write; it must be able to read them (it may not be root)."""

SOCKET_UMASK = 0o177
"""The socket is 0600: only its owner and root (koordrp) can call the hook server."""

PodAnswer = Union[api_pb2.PodSandboxHookResponse, None, Awaitable[Union[api_pb2.PodSandboxHookResponse, None]]]
ContainerAnswer = Union[
    api_pb2.ContainerResourceHookResponse, None, Awaitable[Union[api_pb2.ContainerResourceHookResponse, None]]
]
# A Deferred is an Awaitable, so Deferred-returning handlers fit these too.
PodHandler = Callable[[api_pb2.PodSandboxHookRequest], PodAnswer]
ContainerHandler = Callable[[api_pb2.ContainerResourceHookRequest], ContainerAnswer]

_PodH = TypeVar("_PodH", bound=PodHandler)
_ContainerH = TypeVar("_ContainerH", bound=ContainerHandler)
_AnyH = TypeVar("_AnyH", bound=Callable[[Any], object])

PodHookName = Literal[
    HookType.PRE_RUN_POD_SANDBOX,
    HookType.POST_STOP_POD_SANDBOX,
    "PreRunPodSandbox",
    "PostStopPodSandbox",
]
ContainerHookName = Literal[
    HookType.PRE_CREATE_CONTAINER,
    HookType.PRE_START_CONTAINER,
    HookType.POST_START_CONTAINER,
    HookType.POST_STOP_CONTAINER,
    HookType.PRE_UPDATE_CONTAINER_RESOURCES,
    "PreCreateContainer",
    "PreStartContainer",
    "PostStartContainer",
    "PostStopContainer",
    "PreUpdateContainerResources",
]

_HOOKS_BY_NAME = {hook.value: hook for hook in HookType}


def _squashed(name: str) -> str:
    return name.replace("_", "").lower().removesuffix("hook")


_HOOKS_BY_SQUASHED_NAME = {_squashed(hook.value): hook for hook in HookType}


def hook_type(hook: HookType | str) -> HookType:
    """``hook`` as a HookType; a string must be the name hookserver.d files use."""
    if isinstance(hook, HookType):
        return hook
    found = _HOOKS_BY_NAME.get(hook)
    if found is None:
        raise ValueError(f"unknown hook {hook!r} (known: {', '.join(_HOOKS_BY_NAME)})")
    return found


def response_type(hook: HookType) -> type[api_pb2.PodSandboxHookResponse] | type[api_pb2.ContainerResourceHookResponse]:
    return api_pb2.PodSandboxHookResponse if hook.is_pod_hook else api_pb2.ContainerResourceHookResponse


def request_type(hook: HookType) -> type[api_pb2.PodSandboxHookRequest] | type[api_pb2.ContainerResourceHookRequest]:
    return api_pb2.PodSandboxHookRequest if hook.is_pod_hook else api_pb2.ContainerResourceHookRequest


class HookServer:
    """A hook server's handlers, one per hook it answers; ``serve()`` puts them on a socket.

    Either subclass and define methods named after hooks (``def PreCreateContainer(self,
    request)``), or register functions on an instance with :meth:`hook`. A subclass method whose
    name is a hook spelt another way (``pre_create_container``, ``PreCreateContainerHook``) is an
    error at class creation: silently never being called would be worse.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for attribute, value in vars(cls).items():
            if attribute in _HOOKS_BY_NAME or not callable(value):
                continue
            meant = _HOOKS_BY_SQUASHED_NAME.get(_squashed(attribute))
            if meant is not None:
                raise TypeError(
                    f"{cls.__name__}.{attribute} looks like a handler for {meant.value}, "
                    f"but handlers are named exactly after the hook: {meant.value}"
                )

    @property
    def _handlers(self) -> dict[HookType, Callable[[Any], object]]:
        # Kept in the instance's dict rather than set by __init__, so that a subclass defining its
        # own __init__ works whether or not it calls super().__init__().
        registered: dict[HookType, Callable[[Any], object]] = vars(self).setdefault("_registered_handlers", {})
        return {
            **{hook: getattr(self, hook.value) for hook in HookType if callable(getattr(type(self), hook.value, None))},
            **registered,
        }

    # A hook named literally gets its handler checked against its own request and response types;
    # one known only at run time falls through to the last overload. That the first two overlap
    # with it is the point, hence the ignores.
    @overload
    def hook(self, hook: PodHookName) -> Callable[[_PodH], _PodH]: ...  # type: ignore[overload-overlap]

    @overload
    def hook(self, hook: ContainerHookName) -> Callable[[_ContainerH], _ContainerH]: ...  # type: ignore[overload-overlap]

    @overload
    def hook(self, hook: HookType | str) -> Callable[[_AnyH], _AnyH]: ...

    def hook(self, hook: HookType | str) -> Callable[[_AnyH], _AnyH]:
        """Decorator: ``handler`` answers ``hook`` (a HookType or its hookserver.d name)."""
        chosen = hook_type(hook)

        def register(handler: _AnyH) -> _AnyH:
            existing = self._handlers.get(chosen)
            if existing is not None:
                raise ValueError(f"{chosen.value} already has a handler: {existing!r}")
            vars(self).setdefault("_registered_handlers", {})[chosen] = handler
            return handler

        return register

    @property
    def hooks(self) -> frozenset[HookType]:
        """The hooks this server answers: exactly those its registration will list."""
        return frozenset(self._handlers)

    def serve(
        self,
        socket_path: str,
        *,
        register_in: str | None = None,
        name: str | None = None,
        failure_policy: FailurePolicy | str = "Ignore",
        timeout_seconds: float | None = None,
        max_workers: int = 16,
    ) -> RunningServer:
        """Serve the handlers on the unix socket ``socket_path`` (a path or ``unix://`` URL).

        The socket's directory is created if missing and a stale socket left by a dead server is
        replaced; a socket another live process serves is not (``koordrp.unixsocket.SocketInUse``).
        With ``register_in`` (a hookserver.d directory), ``<name>.json`` is written there once the
        socket accepts calls, listing the hooks that have handlers; ``name`` defaults to the
        socket's file name without its extension. Handlers registered after this call are not
        served by this server.
        """
        if not self._handlers:
            raise ValueError("this hook server has no handlers: define or register at least one")
        path = _socket_path(socket_path)
        registration = None
        if register_in is not None:
            registration = _Registration(
                directory=register_in,
                name=_registration_name(name, path),
                document=_registration_document(path, self._handlers, failure_policy, timeout_seconds),
            )
        return RunningServer(path, dict(self._handlers), registration, max_workers)


class RunningServer:
    """A hook server being served; stop it with :meth:`stop` or by leaving a ``with`` block."""

    def __init__(
        self,
        socket_path: str,
        handlers: dict[HookType, Callable[[Any], object]],
        registration: _Registration | None,
        max_workers: int,
    ) -> None:
        self.socket_path = socket_path
        self.hooks = frozenset(handlers)
        self.registration_path: str | None = None
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()
        self._socket_identity: tuple[int, int] | None = None
        prepare_listening_path(socket_path)
        self._asyncio = _AsyncioThread()
        self._server = grpc.server(
            concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="koordrp-sdk"),
            handlers=[_Calls(handlers, self._asyncio).generic_handler()],
        )
        try:
            with umask(SOCKET_UMASK):
                if not self._server.add_insecure_port(grpc_target(socket_path)):
                    raise OSError(f"cannot listen on {socket_path}")
                self._server.start()
            # Remembered so that stop() removes this socket, not one a successor bound since.
            self._socket_identity = _identity(socket_path)
            # Registered only once calls can be answered: koordrp may call as soon as it sees the file.
            if registration is not None:
                self.registration_path = registration.write()
        except BaseException:
            self._server.stop(None)
            self._remove_socket()
            self._asyncio.stop()
            raise

    def stop(self, grace: float | None = 1.0) -> None:
        """Unregister, stop serving (calls in flight get ``grace`` seconds), remove the socket.

        The registration goes first, so that koordrp stops calling before the socket disappears.
        Calling stop() again does nothing.
        """
        with self._stop_lock:
            if self._stopped.is_set():
                return
            try:
                if self.registration_path is not None:
                    _remove_registration(self.registration_path)
                self._server.stop(grace).wait()
                self._remove_socket()
                self._asyncio.stop()
            finally:
                self._stopped.set()

    def _remove_socket(self) -> None:
        if self._socket_identity is not None and _identity(self.socket_path) == self._socket_identity:
            os.unlink(self.socket_path)

    def wait(self) -> int | None:
        """Block until SIGTERM or SIGINT arrives (returning its number) or stop() is called (None).

        Signals can only be caught in the main thread; called from another thread this waits for
        stop() alone. The previous signal handlers are restored on return.
        """
        if threading.current_thread() is not threading.main_thread():
            self._stopped.wait()
            return None
        received: list[int] = []

        def on_signal(signum: int, frame: FrameType | None) -> None:
            received.append(signum)
            woken.set()

        woken = threading.Event()
        previous = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGTERM, signal.SIGINT)}
        try:
            # Short waits: the main thread runs Python signal handlers only between them, and
            # stop() from another thread must end the wait too.
            while not woken.is_set() and not self._stopped.is_set():
                woken.wait(0.2)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return received[0] if received else None

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()


def _identity(path: str) -> tuple[int, int] | None:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    return (info.st_dev, info.st_ino) if stat.S_ISSOCK(info.st_mode) else None


# --- Answering calls -------------------------------------------------------------------------


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


class _AsyncioThread:
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


class _Calls:
    """The grpc side: one method handler per hook, each waiting for its handler's answer."""

    _reactor: _Reactor | None = None

    def __init__(self, handlers: dict[HookType, Callable[[Any], object]], asyncio_loop: _AsyncioThread) -> None:
        self._handlers = handlers
        self._asyncio = asyncio_loop

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

            def unimplemented(request: Any, context: grpc.ServicerContext) -> object:
                context.abort(grpc.StatusCode.UNIMPLEMENTED, f"this hook server does not handle {hook.value}")

            return unimplemented

        def answer(request: Any, context: grpc.ServicerContext) -> object:
            return self._answer(hook, handler, request, context)

        return answer

    def _answer(self, hook: HookType, handler: Callable[[Any], object], request: Any, context: grpc.ServicerContext) -> object:
        try:
            result = self._run(self._loop_for(handler), handler, request, context)
            return _checked(hook, result)
        except concurrent.futures.TimeoutError:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"{hook.value} handler did not answer in time")
        except (concurrent.futures.CancelledError, asyncio.CancelledError):
            context.abort(grpc.StatusCode.CANCELLED, f"{hook.value} handler was cancelled")
        except Exception as error:
            if not isinstance(error, HandlerError):
                log.error("%s handler failed", hook.value, exc_info=error)
            context.abort(grpc.StatusCode.INTERNAL, f"{hook.value} handler failed: {_describe(error)}")

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


# --- Registration ----------------------------------------------------------------------------


def _socket_path(value: str) -> str:
    try:
        path = parse_unix_endpoint(value)
    except EndpointError as error:
        raise ValueError(f"socket path: {error}") from None
    if len(path.encode("utf-8")) > MAX_SOCKET_PATH_BYTES:
        raise ValueError(f"socket path {path!r} is longer than the {MAX_SOCKET_PATH_BYTES} bytes a unix socket allows")
    return path


def _registration_name(name: str | None, socket_path: str) -> str:
    if name is None:
        name = os.path.splitext(os.path.basename(socket_path))[0]
    # A plain file name: koordrp orders servers by it, and a dot file would hide the temporary ones.
    if not name or "/" in name or "\0" in name or name.startswith("."):
        raise ValueError(f"registration name {name!r} must be a plain file name not starting with a dot")
    return name


def _registration_document(
    socket_path: str,
    handlers: Mapping[HookType, object],
    failure_policy: FailurePolicy | str,
    timeout_seconds: float | None,
) -> dict[str, object]:
    policy = failure_policy if isinstance(failure_policy, FailurePolicy) else FailurePolicy(failure_policy)
    document: dict[str, object] = {
        "remote-endpoint": socket_path,
        "failure-policy": policy.value,
        # In HookType order, so that the file does not change from one start to the next.
        "runtime-hooks": [hook.value for hook in HookType if hook in handlers],
    }
    if timeout_seconds is not None:
        if isinstance(timeout_seconds, bool) or not (math.isfinite(timeout_seconds) and timeout_seconds > 0):
            raise ValueError(f"timeout_seconds must be a positive finite number, not {timeout_seconds!r}")
        document["timeout-seconds"] = timeout_seconds
    return document


class _Registration:
    def __init__(self, directory: str, name: str, document: dict[str, object]) -> None:
        self.directory = directory
        self.name = name
        self.document = document

    def write(self) -> str:
        """Write ``<name>.json`` so that koordrp only ever reads a complete file.

        koordrp reacts to every change in the directory; a file written in place could be caught
        half-written. The temporary file is a dot file without the ``.json`` suffix, which koordrp
        does not read, and os.replace makes the complete file appear at once.
        """
        if not os.path.isdir(self.directory):
            os.makedirs(self.directory, exist_ok=True)
            os.chmod(self.directory, 0o755)  # as koordrp creates it, whatever the umask
        target = os.path.join(self.directory, f"{self.name}.json")
        descriptor, temporary = tempfile.mkstemp(dir=self.directory, prefix=f".{self.name}.", suffix=".tmp")
        try:
            with os.fdopen(descriptor, "w", encoding="utf-8") as stream:
                os.fchmod(stream.fileno(), REGISTRATION_MODE)
                json.dump(self.document, stream, indent=1)
                stream.write("\n")
                stream.flush()
                os.fsync(stream.fileno())
            os.replace(temporary, target)
        except BaseException:
            _unlink_quietly(temporary)
            raise
        _fsync_directory(self.directory)
        return target


def _remove_registration(path: str) -> None:
    _unlink_quietly(path)
    _fsync_directory(os.path.dirname(path))


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _fsync_directory(directory: str) -> None:
    # The rename or removal itself is durable only once the directory is synced.
    try:
        descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
