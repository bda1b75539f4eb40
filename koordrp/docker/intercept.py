"""The Docker calls with hooks: create, start, stop, update and remove of Kubernetes containers.

cri-dockerd makes a pod's sandbox and its containers with ``POST /containers/create``, telling them
apart by labels; the hook requests, the merge rules and the store are the CRI mode's own
(koordrp.lifecycle, koordrp.store), only the JSON mapping is Docker's (koordrp.docker.translate).
Everything runs on the reactor.
"""

import copy
import json
import re
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from twisted.internet.defer import Deferred, ensureDeferred
from twisted.logger import Logger
from zope.interface import implementer

from koordrp import calllog, lifecycle
from koordrp.calllog import CallRecord
from koordrp.docker import translate
from koordrp.docker.http import HTTPError, RequestHead, Response, json_response, parse_response
from koordrp.docker.proxy import IDockerInterceptor, exchange
from koordrp.hooks.dispatcher import Dispatcher, StageOutcome
from koordrp.hooks.types import HookServerConfig, HookServers, HookType
from koordrp.lifecycle import HookRequest, PodHookRequest
from koordrp.logtext import shortened
from koordrp.store import Store, StoredContainer

_VERSION = r"(?:/v[0-9.]+)?"
_CREATE = re.compile(rf"^{_VERSION}/containers/create$")
_ACTION = re.compile(rf"^{_VERSION}/containers/([^/]+)/(start|stop|update)$")
_REMOVE = re.compile(rf"^{_VERSION}/containers/([^/]+)$")


@dataclass
class _Call:
    """One intercepted Docker call: the hook servers in force when it arrived, and its log record."""

    servers: HookServers
    record: CallRecord


class DockerHookFailure(Exception):
    """A Fail-policy hook server could not be heard: the Docker call fails with this message."""


@implementer(IDockerInterceptor)
class DockerInterceptor:
    log = Logger()

    def __init__(
        self,
        backend_path: str,
        reactor: Any,
        store: Store,
        dispatcher: Dispatcher,
        current_servers: Callable[[], HookServers],
        skip: Callable[[Any], bool],
    ) -> None:
        self.backend_path = backend_path
        self._reactor = reactor
        self.store = store
        self._dispatcher = dispatcher
        self._current_servers = current_servers
        self._skips = skip
        self._cgroup_driver: str | None = None

    def wants(self, head: RequestHead) -> bool:
        path = head.path
        if head.method == "POST":
            return bool(_CREATE.match(path) or _ACTION.match(path))
        return head.method == "DELETE" and bool(_REMOVE.match(path))

    def handle(self, head: RequestHead, body: bytes) -> "Deferred[bytes]":
        return ensureDeferred(self._handle(head, body))

    async def _handle(self, head: RequestHead, body: bytes) -> bytes:
        call = _Call(self._current_servers(), CallRecord(f"{head.method} {head.path}"))
        started = self._reactor.seconds()
        answer = await self._answer(head, body, call)
        if call.record.subject is not None:  # a Kubernetes container: one line, as in CRI mode
            status = answer[9:12].decode("latin-1", "replace")
            calllog.write(call.record, status, self._reactor.seconds() - started)
        return answer

    async def _answer(self, head: RequestHead, body: bytes, call: _Call) -> bytes:
        try:
            if _CREATE.match(head.path):
                return await self._create(head, body, call)
            removal = _REMOVE.match(head.path)
            if head.method == "DELETE" and removal:
                return await self._remove(head, body, removal.group(1))
            action = _ACTION.match(head.path)
            assert action is not None
            handlers: dict[str, Callable[[RequestHead, bytes, str, _Call], Awaitable[bytes]]] = {
                "start": self._start,
                "stop": self._stop,
                "update": self._update,
            }
            return await handlers[action.group(2)](head, body, action.group(1), call)
        except DockerHookFailure as failure:
            return json_response(500, "Internal Server Error", str(failure))

    # Talking to dockerd

    async def _forward(self, head: RequestHead, body: bytes) -> tuple[bytes, Response | None]:
        raw: bytes = await exchange(self._reactor, self.backend_path, head.serialize(len(body)) + body)
        try:
            return raw, parse_response(raw)
        except HTTPError:
            return raw, None

    async def _get_json(self, path: str) -> Any:
        request = f"GET {path} HTTP/1.1\r\nHost: docker\r\nConnection: close\r\n\r\n".encode()
        response = parse_response(await exchange(self._reactor, self.backend_path, request))
        return response.json() if response.status == 200 else None

    def probe(self) -> "Deferred[object]":
        """Whether dockerd answers /_ping now (for /healthz)."""

        async def ping() -> object:
            request = b"GET /_ping HTTP/1.1\r\nHost: docker\r\nConnection: close\r\n\r\n"
            try:
                response = parse_response(await exchange(self._reactor, self.backend_path, request))
            except Exception as error:
                raise RuntimeError(f"backend unix://{self.backend_path}: {error}") from None
            if response.status != 200:
                raise RuntimeError(f"backend unix://{self.backend_path} answered /_ping with {response.status}")
            return None

        return ensureDeferred(ping())

    async def cgroup_driver(self) -> str:
        if self._cgroup_driver is None:
            info = await self._get_json("/info")
            self._cgroup_driver = str((info or {}).get("CgroupDriver") or "cgroupfs")
        return self._cgroup_driver

    # What the store lacks is read back from dockerd

    async def pod(self, sandbox_id: str) -> PodHookRequest | None:
        """The stored sandbox, or read back from dockerd (and remembered) if the store lacks it."""
        found = await self.container(sandbox_id) if sandbox_id else None
        return found[1] if found is not None and isinstance(found[1], PodHookRequest) else None

    async def container(self, container_id: str) -> tuple[str, StoredContainer | PodHookRequest] | None:
        """The stored container or sandbox behind ``container_id`` (an id, or a name dockerd resolves)."""
        stored = self.store.container(container_id)
        if stored is not None:
            return container_id, stored
        pod = self.store.pod(container_id)
        if pod is not None:
            return container_id, pod
        inspect = await self._get_json(f"/containers/{container_id}/json")
        if inspect is None:
            return None
        identifier = str(inspect.get("Id", container_id))
        try:
            kind = translate.kind_of_inspect(inspect)
            driver = await self.cgroup_driver()
            if kind == "sandbox":
                pod = translate.stored_sandbox_from_inspect(inspect, driver)
                self.store.learn([(identifier, pod)], [])
                return identifier, pod
            if kind == "container":
                sandbox_id = translate.sandbox_id_of_inspect(inspect)
                info = translate.stored_container_from_inspect(inspect, await self.pod(sandbox_id), driver)
                stored = StoredContainer(sandbox_id, info)
                self.store.learn([], [(identifier, stored)])
                return identifier, stored
        except translate.DockerShapeError as error:
            self.log.warn("cannot read container {id} back from dockerd: {error}", id=shortened(container_id, 80), error=str(error))
        return None

    async def rebuild(self) -> int:
        """Learn every Kubernetes container dockerd has, sandboxes first; returns how many."""
        listed = await self._get_json('/containers/json?all=1&filters={"label":["io.kubernetes.docker.type"]}')
        if not isinstance(listed, list):
            raise ConnectionError("dockerd did not list its containers")
        ordered = sorted(listed, key=lambda entry: (entry.get("Labels") or {}).get(translate.TYPE_LABEL) != "podsandbox")
        learnt = 0
        for entry in ordered:
            if await self.container(str(entry.get("Id", ""))) is not None:
                learnt += 1
        return learnt

    # Hook stages

    def _skipped(self, hook: HookType, subscribed: tuple[HookServerConfig, ...], pod_labels: Any) -> bool:
        """No subscriber, or a pod with the skip label (counted): the stage does not run."""
        if subscribed and self._skips(pod_labels):
            self._dispatcher.skipped(hook, subscribed)
            return True
        return not subscribed

    async def _pre(self, hook: HookType, call: _Call, request: HookRequest, pod_labels: Any) -> HookRequest:
        call.record.subject = request
        subscribed = call.servers.subscribed(hook)
        if self._skipped(hook, subscribed, pod_labels):
            return request
        outcome: StageOutcome = await self._dispatcher.dispatch(hook, subscribed, request, None)
        call.record.ran(hook.value, outcome.called)
        if outcome.failure is not None:
            raise DockerHookFailure(outcome.failure.message)
        return outcome.request

    def _post(self, hook: HookType, call: _Call, request: HookRequest, pod_labels: Any) -> None:
        call.record.subject = request
        subscribed = call.servers.subscribed(hook)
        if not self._skipped(hook, subscribed, pod_labels):
            call.record.ran(hook.value, [server.name for server in subscribed])
            self._dispatcher.announce(hook, subscribed, request)

    def drain(self) -> "Deferred[list[StageOutcome]]":
        return self._dispatcher.drain()

    # The calls

    async def _create(self, head: RequestHead, body: bytes, call: _Call) -> bytes:
        try:
            document = json.loads(body or b"{}")
            kind = translate.kind_of(document) if isinstance(document, dict) else None
        except ValueError:
            kind = None
        if kind is None:
            return (await self._forward(head, body))[0]
        name = head.query("name") or ""
        driver = await self.cgroup_driver()
        if kind == "sandbox":
            pod = translate.sandbox_hook_request(name, document, driver)
            before = copy.deepcopy(pod)
            pod = lifecycle.as_pod_request(await self._pre(HookType.PRE_RUN_POD_SANDBOX, call, pod, pod.labels))
            if translate.apply_to_sandbox_create(document, before, pod, driver):
                body = json.dumps(document).encode()
            raw, response = await self._forward(head, body)
            if response is not None and response.status == 201:
                self.store.put_pod(str(_json_field(response, "Id")), pod)
            return raw
        sandbox_id = translate.sandbox_id_of(document)
        stored_pod = await self.pod(sandbox_id)
        if stored_pod is None:
            return (await self._forward(head, body))[0]
        container = translate.container_hook_request(name, document, stored_pod, driver)
        as_sent = copy.deepcopy(container)
        container = lifecycle.as_container_request(
            await self._pre(HookType.PRE_CREATE_CONTAINER, call, container, stored_pod.labels)
        )
        if translate.apply_to_container_create(document, as_sent, container, driver):
            body = json.dumps(document).encode()
        raw, response = await self._forward(head, body)
        if response is not None and response.status == 201:
            container_id = str(_json_field(response, "Id"))
            stored = copy.deepcopy(container)
            stored.container_meta.id = container_id
            self.store.put_container(container_id, sandbox_id, stored)
        return raw

    async def _start(self, head: RequestHead, body: bytes, container_id: str, call: _Call) -> bytes:
        found = await self.container(container_id)
        if found is None or not isinstance(found[1], StoredContainer):
            return (await self._forward(head, body))[0]
        labels = found[1].info.pod_labels
        info = lifecycle.as_container_request(await self._pre(HookType.PRE_START_CONTAINER, call, found[1].info, labels))
        raw, response = await self._forward(head, body)
        if response is not None and response.status in (204, 304):
            self._post(HookType.POST_START_CONTAINER, call, info, labels)
        return raw

    async def _stop(self, head: RequestHead, body: bytes, container_id: str, call: _Call) -> bytes:
        found = await self.container(container_id)
        raw, response = await self._forward(head, body)
        if found is None or response is None or response.status not in (204, 304):
            return raw
        stored = found[1]
        if isinstance(stored, StoredContainer):
            self._post(HookType.POST_STOP_CONTAINER, call, stored.info, stored.info.pod_labels)
        else:
            self._post(HookType.POST_STOP_POD_SANDBOX, call, stored, stored.labels)
        return raw

    async def _update(self, head: RequestHead, body: bytes, container_id: str, call: _Call) -> bytes:
        found = await self.container(container_id)
        try:
            document = json.loads(body or b"{}")
        except ValueError:
            document = None
        if found is None or not isinstance(found[1], StoredContainer) or not isinstance(document, dict):
            return (await self._forward(head, body))[0]
        identifier, stored = found[0], found[1]
        container = translate.fold_update(stored.info, document)
        before = copy.deepcopy(container)
        hook = HookType.PRE_UPDATE_CONTAINER_RESOURCES
        container = lifecycle.as_container_request(await self._pre(hook, call, container, container.pod_labels))
        if translate.apply_to_update(document, before, container):
            body = json.dumps(document).encode()
        raw, response = await self._forward(head, body)
        if response is not None and response.status == 200:
            self.store.put_container(identifier, stored.sandbox_id, container)
        return raw

    async def _remove(self, head: RequestHead, body: bytes, container_id: str) -> bytes:
        found = await self.container(container_id)
        raw, response = await self._forward(head, body)
        if found is not None and response is not None and response.status == 204:
            self.store.forget_container(found[0])
            self.store.forget_pod(found[0])
        return raw


def _json_field(response: Response, name: str) -> object:
    document = response.json()
    return document.get(name, "") if isinstance(document, dict) else ""
