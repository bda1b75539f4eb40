"""Writing a runtime hook server in Python: handlers per hook, served on a unix socket, registered.

A hook server answers koordrp's ``RuntimeHookService`` calls. With this module it is a class or a
handful of functions::

    from koordrp.sdk import HookServer, reply

    class Pinning(HookServer):
        def PreCreateContainer(self, request):
            response = reply(request)  # the request as it is: change what you want
            response.container_resources.cpuset_cpus = "0-1"
            return response

    with Pinning().serve("/run/pinning/pinning.sock", register_in="/etc/runtime/hookserver.d") as running:
        running.wait()

Handlers are named after the hook exactly as hookserver.d files spell it (``PreCreateContainer``,
not ``pre_create_container`` nor the RPC's ``PreCreateContainerHook``), or registered with
``@server.hook(HookType.PRE_CREATE_CONTAINER)`` / ``@server.hook("PreCreateContainer")``.

Answer with ``reply(request)`` changed where you want, as koordlet answers: koordrp merges an
answer into the request the way Koordinator's proxy does, so a resources message in it sets the
cpuset to what it says (the empty string clears kubelet's cpuset), and ``reply`` starts from the
request's own values. Returning ``None`` changes nothing; raising ``Refuse(reason)`` refuses the
call. A server declares its registration's failure policy and timeout as class (or instance)
attributes, ``failure_policy = "Fail"`` and ``timeout_seconds = 2``; ``serve()``'s arguments and
the command line's flags win over them.

Where a handler runs (the Twisted reactor or an asyncio loop, following txaio's choice) and how its
answer is awaited is told in ``koordrp.sdk.loops``; how the registration is written, in
``koordrp.sdk.registration``.
"""

from __future__ import annotations

import concurrent.futures
import difflib
import logging
import os
import signal
import stat
import threading
from types import FrameType, TracebackType
from typing import Any, Awaitable, Callable, Literal, TypeVar, Union, overload

import grpc

from koordrp.api.runtime.v1alpha1 import api_pb2
from koordrp.hooks.types import HOOKS_BY_NAME, FailurePolicy, HookType
from koordrp.sdk import advice, registration
from koordrp.sdk.loops import REFUSED, SERVICE, AsyncioThread, Calls, Refuse
from koordrp.unix import grpc_target, prepare_listening_path, umask

__all__ = [
    "REFUSED",
    "SERVICE",
    "ContainerHandler",
    "ContainerResourceHookRequest",
    "ContainerResourceHookResponse",
    "HookServer",
    "HookType",
    "LinuxContainerResources",
    "PodHandler",
    "PodSandboxHookRequest",
    "PodSandboxHookResponse",
    "Refuse",
    "RunningServer",
    "hook_type",
    "reply",
]

# The messages a handler takes and returns, importable from here with the rest.
PodSandboxHookRequest = api_pb2.PodSandboxHookRequest
PodSandboxHookResponse = api_pb2.PodSandboxHookResponse
ContainerResourceHookRequest = api_pb2.ContainerResourceHookRequest
ContainerResourceHookResponse = api_pb2.ContainerResourceHookResponse
LinuxContainerResources = api_pb2.LinuxContainerResources

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

def _squashed(name: str) -> str:
    return name.replace("_", "").lower().removesuffix("hook")


_HOOKS_BY_SQUASHED_NAME = {_squashed(hook.value): hook for hook in HookType}


def hook_type(hook: HookType | str) -> HookType:
    """``hook`` as a HookType; a string must be the name hookserver.d files use."""
    if isinstance(hook, HookType):
        return hook
    found = HOOKS_BY_NAME.get(hook)
    if found is None:
        raise ValueError(f"unknown hook {hook!r} (known: {', '.join(HOOKS_BY_NAME)})")
    return found


log = logging.getLogger("koordrp.sdk")


def _not_hooks(cls: type) -> list[tuple[str, str]]:
    """Public methods named like a hook (Pre..., Post...) that are none, each with the hook it most looks like."""
    found = []
    for attribute in sorted(dir(cls)):
        if attribute.startswith(("Pre", "Post")) and attribute not in HOOKS_BY_NAME and callable(getattr(cls, attribute)):
            found.append((attribute, difflib.get_close_matches(attribute, HOOKS_BY_NAME, n=1, cutoff=0)[0]))
    return found


@overload
def reply(request: api_pb2.PodSandboxHookRequest) -> api_pb2.PodSandboxHookResponse: ...


@overload
def reply(request: api_pb2.ContainerResourceHookRequest) -> api_pb2.ContainerResourceHookResponse: ...


def reply(
    request: api_pb2.PodSandboxHookRequest | api_pb2.ContainerResourceHookRequest,
) -> api_pb2.PodSandboxHookResponse | api_pb2.ContainerResourceHookResponse:
    """The answer that changes nothing: every field the answer has, copied from ``request``.

    Change what you want in it and return it. Starting from an empty answer instead, a resources
    message you add carries an empty cpuset, which clears the container's (the SDK warns of such an
    answer: it knows the ones ``reply`` built for the request at hand).
    """
    if isinstance(request, api_pb2.PodSandboxHookRequest):
        pod = api_pb2.PodSandboxHookResponse(
            labels=request.labels, annotations=request.annotations, cgroup_parent=request.cgroup_parent
        )
        if request.HasField("resources"):
            pod.resources.CopyFrom(request.resources)
        return pod
    container = api_pb2.ContainerResourceHookResponse(
        container_annotations=request.container_annotations,
        pod_cgroup_parent=request.pod_cgroup_parent,
        container_envs=request.container_envs,
    )
    if request.HasField("container_resources"):
        container.container_resources.CopyFrom(request.container_resources)
    advice.built(request, container)
    return container


class HookServer:
    """A hook server's handlers, one per hook it answers; ``serve()`` puts them on a socket.

    Either subclass and define methods named after hooks (``def PreCreateContainer(self,
    request)``), or register functions on an instance with :meth:`hook`. A subclass method whose
    name is a hook spelt another way (``pre_create_container``, ``PreCreateContainerHook``) is an
    error at class creation: silently never being called would be worse.

    ``failure_policy`` and ``timeout_seconds`` are what the registration says unless ``serve()`` (or
    the command line, which passes them to it) says otherwise: set them on a subclass or an instance.
    """

    failure_policy: FailurePolicy | str = FailurePolicy.IGNORE
    """``Fail``: koordrp fails the CRI call when this server refuses it, fails, or does not answer in time."""
    timeout_seconds: float | None = None
    """The most one call may take (None: koordrp's --hook-timeout, within the CRI call's deadline)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A misspelt policy or a bad timeout is said where it is written, not at the first serve().
        try:
            registration.checked_policy(cls.failure_policy)
            registration.checked_timeout(cls.timeout_seconds)
        except ValueError as error:
            raise TypeError(f"{cls.__name__}: {error}") from None
        for attribute, value in vars(cls).items():
            if attribute in HOOKS_BY_NAME or not callable(value):
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
        failure_policy: FailurePolicy | str | None = None,
        timeout_seconds: float | None = None,
        max_workers: int = 16,
    ) -> RunningServer:
        """Serve the handlers on the unix socket ``socket_path`` (a path or ``unix://`` URL).

        The socket's directory is created if missing and a stale socket left by a dead server is
        replaced; a socket another live process serves is not (``koordrp.unix.SocketInUse``).
        With ``register_in`` (a hookserver.d directory), ``<name>.json`` is written there once the
        socket accepts calls, listing the hooks that have handlers, with ``failure_policy`` and
        ``timeout_seconds`` (None: the server's own attributes); ``name`` defaults to the socket's
        file name without its extension. Handlers registered after this call are not served by
        this server.
        """
        if not self._handlers:
            raise ValueError("this hook server has no handlers: define or register at least one")
        for attribute, closest in _not_hooks(type(self)):
            log.warning(
                "%s.%s looks like a handler but is no hook, so it is never called; did you mean %s?",
                type(self).__name__,
                attribute,
                closest,
            )
        path = registration.socket_path(socket_path)
        # Checked whether or not it is written: a server registered by hand is told as early.
        document = registration.registration_document(
            path,
            self._handlers,
            self.failure_policy if failure_policy is None else failure_policy,
            self.timeout_seconds if timeout_seconds is None else timeout_seconds,
        )
        written = None
        if register_in is not None:
            written = registration.Registration(register_in, registration.registration_name(name, path), document)
        return RunningServer(path, dict(self._handlers), written, max_workers)


class RunningServer:
    """A hook server being served; stop it with :meth:`stop` or by leaving a ``with`` block."""

    def __init__(
        self,
        socket_path: str,
        handlers: dict[HookType, Callable[[Any], object]],
        to_register: registration.Registration | None,
        max_workers: int,
    ) -> None:
        self.socket_path = socket_path
        self.hooks = frozenset(handlers)
        self.registration_path: str | None = None
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()
        self._socket_identity: tuple[int, int] | None = None
        prepare_listening_path(socket_path)
        self._asyncio = AsyncioThread()
        self._server = grpc.server(
            concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="koordrp-sdk"),
            handlers=[Calls(handlers, self._asyncio).generic_handler()],
        )
        try:
            with umask(SOCKET_UMASK):
                if not self._server.add_insecure_port(grpc_target(socket_path)):
                    raise OSError(f"cannot listen on {socket_path}")
                self._server.start()
            # Remembered so that stop() removes this socket, not one a successor bound since.
            self._socket_identity = _identity(socket_path)
            # Registered only once calls can be answered: koordrp may call as soon as it sees the file.
            if to_register is not None:
                self.registration_path = to_register.write()
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
                    registration.remove_registration(self.registration_path)
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
