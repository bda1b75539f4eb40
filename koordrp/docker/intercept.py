"""The Docker calls with hooks: create, start, stop, update and remove of Kubernetes containers.

cri-dockerd makes a pod's sandbox and its containers with ``POST /containers/create``, telling them
apart by labels; each such call runs through the lifecycle flow of the CRI method it stands for
(``koordrp.flows``), with the JSON body as its request (``koordrp.docker.translate``). Everything
runs on the reactor; a client that goes away cancels its call, and the exchange with dockerd with it.
``answer`` is the one place an outcome becomes an HTTP answer.
"""

import json
import re
from dataclasses import dataclass
from typing import Any, Coroutine

from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectError
from zope.interface import implementer

from koordrp import adapters
from koordrp.call import Call, Parts
from koordrp import flows
from koordrp.docker import translate
from koordrp.docker.dockerd import AnswerTooLarge, Dockerd
from koordrp.docker.inspect import kind_of_inspect
from koordrp.docker.http import HTTPError, RequestHead, Response, json_response, parse_response
from koordrp.docker.proxy import IDockerInterceptor, Intercepted
from koordrp.store import StoredContainer, StoredPod

_VERSION = r"(?:/v[0-9.]+)?"
_CREATE = re.compile(rf"^{_VERSION}/containers/create$")
_ACTION = re.compile(rf"^{_VERSION}/containers/([^/]+)/(start|stop|update)$")
_REMOVE = re.compile(rf"^{_VERSION}/containers/([^/]+)$")

# What dockerd answers when it did what it was asked (304: the container was started or stopped already).
_DONE = {"create": (201,), "start": (204, 304), "stop": (204, 304), "update": (200,), "remove": (204,)}


@dataclass(frozen=True)
class DockerReply:
    raw: bytes
    response: Response | None
    done: tuple[int, ...]

    @property
    def ok(self) -> bool:
        return self.response is not None and self.response.status in self.done

    @property
    def created_id(self) -> str:
        document = self.response.json() if self.response is not None else None
        return str(document.get("Id", "")) if isinstance(document, dict) else ""

    @property
    def label(self) -> str:
        """dockerd's HTTP status."""
        return self.raw[9:12].decode("latin-1", "replace")


class DockerBackend:
    """``adapters.Backend`` for one Docker call: its request forwarded to dockerd, read-backs from dockerd."""

    def __init__(self, dockerd: Dockerd, head: RequestHead, body: bytes, action: str) -> None:
        self._dockerd = dockerd
        self._head = head
        self._body = body
        self._done = _DONE[action]
        self._inspected: dict[str, dict[str, Any]] = {}

    async def forward(self, rewritten: bytes | None, timeout: float | None) -> DockerReply:
        """Sent to dockerd, bounded by the client alone (``timeout`` is None): it may wait for a long stop.

        When dockerd cannot be reached, or its answer is too large to read, the client is told so
        the way a passed-through call would be (503, 502), naming dockerd.
        """
        body = self._body if rewritten is None else rewritten
        try:
            raw = await self._dockerd.exchange(self._head.serialize(len(body)) + body)
        except ConnectError as error:
            raw = self._dockerd.unavailable(str(error))
        except AnswerTooLarge as error:
            raw = json_response(502, "Bad Gateway", f"koordrp: backend unix://{self._dockerd.path}: {error}")
        try:
            response: Response | None = parse_response(raw)
        except HTTPError:
            response = None
        return DockerReply(raw, response, self._done)

    async def inspect(self, identifier: str) -> dict[str, Any] | None:
        """The container behind ``identifier`` (an id, a short id or a name), remembered for read-backs."""
        found = await self._dockerd.inspect(identifier)
        if found is not None:
            self._inspected[str(found.get("Id", identifier))] = found
        return found

    async def _inspect_once(self, identifier: str, timeout: float | None) -> dict[str, Any] | None:
        found = self._inspected.pop(identifier, None)
        return found if found is not None else await self._dockerd.inspect(identifier, timeout)

    async def read_pod(self, sandbox_id: str, timeout: float | None) -> StoredPod | None:
        return await self._dockerd.pod_from(await self._inspect_once(sandbox_id, timeout))

    async def read_container(self, container_id: str, pods: adapters.PodSource, timeout: float | None) -> StoredContainer | None:
        return await self._dockerd.container_from(await self._inspect_once(container_id, timeout), pods)


def answer(outcome: "adapters.Outcome[DockerReply]") -> bytes | None:
    """What the client is sent for ``outcome`` (None: it is gone)."""
    if isinstance(outcome, DockerReply):
        return outcome.raw
    if isinstance(outcome, adapters.Refusal):
        return json_response(*outcome.status_code.http, outcome.message)
    return None


@implementer(IDockerInterceptor)
class DockerInterceptor:
    def __init__(self, dockerd: Dockerd, parts: Parts) -> None:
        self._dockerd = dockerd
        self._parts = parts

    def wants(self, head: RequestHead) -> bool:
        return _action(head) is not None

    def handle(self, head: RequestHead, body: bytes) -> "Deferred[Intercepted]":
        action = _action(head)
        assert action is not None
        backend = DockerBackend(self._dockerd, head, body, action)
        call = Call(self._parts, f"{head.method} {head.path}", backend)
        running = call.run(self._answer(action, head, body, call, backend))
        return running.addCallback(_intercepted, call)

    async def _answer(
        self, action: str, head: RequestHead, body: bytes, call: "Call[DockerReply]", backend: DockerBackend
    ) -> DockerReply:
        flow = await self._flow(action, head, body, call, backend)
        if flow is None:
            call.logged = False  # not a Kubernetes container: dockerd's own business
            return await call.forward()
        return await flow

    async def _flow(
        self, action: str, head: RequestHead, body: bytes, call: "Call[DockerReply]", backend: DockerBackend
    ) -> Coroutine[Any, Any, DockerReply] | None:
        """The flow this call takes; None: it is not about a Kubernetes pod, and goes to dockerd as it is."""
        if action == "create":
            document = _json_object(body)
            kind = translate.kind_of(document)
            if document is None or kind is None:
                return None
            name = head.query("name") or ""
            driver = await self._dockerd.cgroup_driver.current()
            if kind == "sandbox":
                try:
                    return flows.run_pod_sandbox(call, translate.SandboxCreate(name, document, driver))
                except translate.DockerShapeError as error:
                    return flows.unreadable(call, "RunPodSandbox", str(error))
            try:
                return flows.create_container(call, translate.ContainerCreate(name, document, driver))
            except translate.DockerShapeError as error:
                return flows.unreadable(call, "CreateContainer", str(error))
        found = await self._resolve(_target(head), backend)
        if found is None:
            return None
        kind, identifier = found
        if kind == "sandbox":
            if action == "stop":
                return flows.stop_pod_sandbox(call, identifier)
            if action == "remove":
                return flows.remove_pod_sandbox(call, identifier)
            return None
        if action == "start":
            return flows.start_container(call, identifier)
        if action == "stop":
            return flows.stop_container(call, identifier)
        if action == "remove":
            return flows.remove_container(call, identifier)
        try:
            update = translate.ContainerUpdate(identifier, _json(body, "update body"))
        except translate.DockerShapeError as error:
            return flows.unreadable(call, "UpdateContainerResources", str(error))
        return flows.update_container_resources(call, update)

    async def _resolve(self, identifier: str, backend: DockerBackend) -> tuple[translate.Kind, str] | None:
        """Whether ``identifier`` (an id, a short id or a name) is a Kubernetes sandbox or container, and its id."""
        store = self._parts.store
        if store.has_container(identifier):
            return "container", identifier
        if store.has_pod(identifier):
            return "sandbox", identifier
        try:
            inspect = await backend.inspect(identifier)
        except adapters.LookupFailed:
            return None  # dockerd gives its own answer to the call itself
        kind = kind_of_inspect(inspect)
        if inspect is None or kind is None:
            return None
        return kind, str(inspect.get("Id", identifier))


def _intercepted(outcome: "adapters.Outcome[DockerReply]", call: "Call[DockerReply]") -> Intercepted:
    return Intercepted(answer(outcome), call.ended)


def _action(head: RequestHead) -> str | None:
    path = head.path
    if head.method == "POST":
        if _CREATE.match(path):
            return "create"
        action = _ACTION.match(path)
        return action.group(2) if action else None
    if head.method == "DELETE" and _REMOVE.match(path):
        return "remove"
    return None


def _target(head: RequestHead) -> str:
    match = _ACTION.match(head.path) or _REMOVE.match(head.path)
    assert match is not None
    return match.group(1)


def _json(body: bytes, what: str) -> object:
    try:
        return json.loads(body or b"{}")
    except ValueError as error:
        raise translate.DockerShapeError(f"{what} is not JSON: {error}") from None


def _json_object(body: bytes) -> translate.JSONObject | None:
    try:
        document = _json(body, "body")
    except translate.DockerShapeError:
        return None
    return document if isinstance(document, dict) else None
