"""koordrp.sdk and the example hook server on it, through real grpc calls on unix sockets.

Handlers that are not ``async def`` run on the reactor, which in these tests is trial's own: the
grpc client therefore always runs in a thread (deferToThread), so that the reactor stays free to run
the handler while the test waits for the answer.
"""

import asyncio
import json
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from typing import Any, Callable, TypeVar

import grpc
import txaio
from google.protobuf.message import Message
from twisted.internet import reactor, task
from twisted.internet.defer import Deferred
from twisted.internet.threads import deferToThread
from twisted.python import threadable
from twisted.trial.unittest import SynchronousTestCase, TestCase

from koordrp import sdk
from koordrp.api.runtime.v1alpha1 import api_pb2
from koordrp.examples.cpuset_qos import CpusetQoS
from koordrp.hooks.config import parse_hook_server_config, permission_problem
from koordrp.hooks.messages import merge_response
from koordrp.hooks.types import FailurePolicy, HookType
from koordrp.sdk import HookServer, RunningServer, advice, reply
from koordrp.unix import SocketInUse, grpc_target
from tests.support.tempdirs import short_tempdir

REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def call(path: str, hook: HookType, request: Any, timeout: float = 5.0) -> Any:
    """One blocking hook call, as koordrp makes it."""
    response_type = api_pb2.PodSandboxHookResponse if hook.is_pod_hook else api_pb2.ContainerResourceHookResponse
    with grpc.insecure_channel(grpc_target(path)) as channel:
        method = channel.unary_unary(
            f"/{sdk.SERVICE}/{hook.rpc_name}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=response_type.FromString,
        )
        return method(request, timeout=timeout)


def container_request(**fields: Any) -> api_pb2.ContainerResourceHookRequest:
    return api_pb2.ContainerResourceHookRequest(
        pod_meta=api_pb2.PodSandboxMetadata(name="web", namespace="default", uid="uid-1"),
        container_meta=api_pb2.ContainerMetadata(name="app"),
        **fields,
    )


def pod_request() -> api_pb2.PodSandboxHookRequest:
    return api_pb2.PodSandboxHookRequest(pod_meta=api_pb2.PodSandboxMetadata(name="web", namespace="default"))


_Message = TypeVar("_Message", bound=Message)


def copied(message: _Message) -> _Message:
    """A new message equal to ``message``."""
    copy = type(message)()
    copy.CopyFrom(message)
    return copy


def pinned(cpus: str) -> api_pb2.ContainerResourceHookResponse:
    return api_pb2.ContainerResourceHookResponse(container_resources=api_pb2.LinuxContainerResources(cpuset_cpus=cpus))


class ServingTestCase(TestCase):
    def setUp(self) -> None:
        self.dir = short_tempdir(self)
        self.socket = os.path.join(self.dir, "hooks.sock")
        # What the SDK logs (a failing handler's traceback) is kept here rather than printed.
        self.logged: list[logging.LogRecord] = []
        handler = ListHandler(self.logged)
        logger = logging.getLogger(sdk.__name__)
        logger.addHandler(handler)
        self.patch(logger, "propagate", False)
        self.patch(logger, "level", logging.INFO)  # as a server started by koordrp.sdk.command logs
        self.addCleanup(logger.removeHandler, handler)

    def serve(self, server: HookServer, **options: Any) -> RunningServer:
        running = server.serve(self.socket, **options)
        self.addCleanup(running.stop, 0)
        return running

    def call(self, hook: HookType, request: Any, timeout: float = 5.0) -> "Deferred[Any]":
        return deferToThread(call, self.socket, hook, request, timeout)

    async def failed_call(self, hook: HookType, request: Any, timeout: float = 5.0) -> grpc.RpcError:
        try:
            await self.call(hook, request, timeout)
        except grpc.RpcError as error:
            return error
        raise AssertionError("the call succeeded")


class AnswerTests(ServingTestCase):
    """Each kind of value a handler may return reaches koordrp as the response."""

    async def test_message(self) -> None:
        server = HookServer()
        server.hook(HookType.PRE_CREATE_CONTAINER)(lambda request: pinned("0-1"))
        self.serve(server)
        response = await self.call(HookType.PRE_CREATE_CONTAINER, container_request())
        self.assertEqual(response, pinned("0-1"))

    async def test_none_is_the_empty_answer(self) -> None:
        server = HookServer()

        @server.hook("PreRunPodSandbox")
        def nothing(request: api_pb2.PodSandboxHookRequest) -> None:
            return None

        self.serve(server)
        response = await self.call(HookType.PRE_RUN_POD_SANDBOX, pod_request())
        self.assertEqual(response, api_pb2.PodSandboxHookResponse())
        self.assertEqual(response.ByteSize(), 0)

    async def test_deferred_is_resolved_on_the_reactor(self) -> None:
        threads: list[bool] = []
        server = HookServer()

        @server.hook(HookType.PRE_START_CONTAINER)
        def later(request: api_pb2.ContainerResourceHookRequest) -> "Deferred[api_pb2.ContainerResourceHookResponse]":
            threads.append(threadable.isInIOThread())
            # A reactor API: only safe because plain handlers are called on the reactor thread.
            return task.deferLater(reactor, 0.05, lambda: pinned(request.container_meta.name))

        self.serve(server)
        response = await self.call(HookType.PRE_START_CONTAINER, container_request())
        self.assertEqual(response, pinned("app"))
        self.assertEqual(threads, [True])

    async def test_coroutine_runs_on_the_sdk_asyncio_loop(self) -> None:
        where: list[tuple[bool, bool]] = []
        server = HookServer()

        @server.hook(HookType.PRE_UPDATE_CONTAINER_RESOURCES)
        async def slow(request: api_pb2.ContainerResourceHookRequest) -> api_pb2.ContainerResourceHookResponse:
            await asyncio.sleep(0.05)
            where.append((asyncio.get_running_loop().is_running(), threadable.isInIOThread()))
            return pinned("3")

        self.serve(server)
        response = await self.call(HookType.PRE_UPDATE_CONTAINER_RESOURCES, container_request())
        self.assertEqual(response, pinned("3"))
        self.assertEqual(where, [(True, False)])

    async def test_coroutine_returned_by_a_plain_handler_is_twisted(self) -> None:
        async def answer() -> api_pb2.ContainerResourceHookResponse:
            await task.deferLater(reactor, 0.01, lambda: None)
            return pinned("1")

        server = HookServer()
        server.hook(HookType.PRE_CREATE_CONTAINER)(lambda request: answer())
        self.serve(server)
        self.assertEqual(await self.call(HookType.PRE_CREATE_CONTAINER, container_request()), pinned("1"))

    async def test_with_txaio_twisted_coroutines_run_on_the_reactor(self) -> None:
        self.patch(txaio, "using_twisted", True)
        server = HookServer()

        @server.hook(HookType.PRE_CREATE_CONTAINER)
        async def twisted_coroutine(request: api_pb2.ContainerResourceHookRequest) -> api_pb2.ContainerResourceHookResponse:
            self.assertTrue(threadable.isInIOThread())
            await task.deferLater(reactor, 0.01, lambda: None)
            return pinned("2")

        self.serve(server)
        self.assertEqual(await self.call(HookType.PRE_CREATE_CONTAINER, container_request()), pinned("2"))

    async def test_with_txaio_asyncio_everything_runs_on_the_asyncio_loop(self) -> None:
        self.patch(txaio, "using_asyncio", True)
        server = HookServer()

        @server.hook(HookType.PRE_CREATE_CONTAINER)
        def asyncio_future(request: api_pb2.ContainerResourceHookRequest) -> "asyncio.Future[Any]":
            loop = asyncio.get_running_loop()  # raises off the loop
            future = loop.create_future()
            loop.call_later(0.01, future.set_result, pinned("4"))
            return future

        self.serve(server)
        self.assertEqual(await self.call(HookType.PRE_CREATE_CONTAINER, container_request()), pinned("4"))

    async def test_subclass_methods_named_after_hooks(self) -> None:
        class Both(HookServer):
            def PreRunPodSandbox(self, request: api_pb2.PodSandboxHookRequest) -> api_pb2.PodSandboxHookResponse:
                return api_pb2.PodSandboxHookResponse(cgroup_parent="/kubepods/" + request.pod_meta.name)

            async def PostStopContainer(self, request: api_pb2.ContainerResourceHookRequest) -> None:
                return None

        server = Both()
        self.assertEqual(server.hooks, {HookType.PRE_RUN_POD_SANDBOX, HookType.POST_STOP_CONTAINER})
        self.serve(server)
        response = await self.call(HookType.PRE_RUN_POD_SANDBOX, pod_request())
        self.assertEqual(response.cgroup_parent, "/kubepods/web")
        empty = await self.call(HookType.POST_STOP_CONTAINER, container_request())
        self.assertEqual(empty, api_pb2.ContainerResourceHookResponse())

    async def test_concurrent_calls(self) -> None:
        server = HookServer()
        names = [str(n) for n in range(8)]
        arrived: list[str] = []
        everyone: list[asyncio.Event] = []

        @server.hook(HookType.PRE_CREATE_CONTAINER)
        async def echo(request: api_pb2.ContainerResourceHookRequest) -> api_pb2.ContainerResourceHookResponse:
            # Each answers only once all eight are in: served one at a time, the first would never answer.
            if not everyone:
                everyone.append(asyncio.Event())
            arrived.append(request.container_meta.name)
            if len(arrived) == len(names):
                everyone[0].set()
            await everyone[0].wait()
            return pinned(request.container_meta.name)

        self.serve(server)
        requests = [container_request() for _ in names]
        for request, name in zip(requests, names):
            request.container_meta.name = name
        calls = [self.call(HookType.PRE_CREATE_CONTAINER, request, timeout=30) for request in requests]
        responses = [await call for call in calls]
        self.assertEqual([r.container_resources.cpuset_cpus for r in responses], names)


class FailureTests(ServingTestCase):
    """What koordrp sees when a handler fails, and when a hook has no handler."""

    async def test_raising_handler_is_internal_with_its_message(self) -> None:
        server = HookServer()

        @server.hook(HookType.PRE_CREATE_CONTAINER)
        def broken(request: api_pb2.ContainerResourceHookRequest) -> None:
            raise ValueError("no CPUs left")

        self.serve(server)
        error = await self.failed_call(HookType.PRE_CREATE_CONTAINER, container_request())
        self.assertEqual(error.code(), grpc.StatusCode.INTERNAL)
        self.assertIn("no CPUs left", error.details())
        self.assertIn("PreCreateContainer", error.details())
        [record] = self.logged
        self.assertEqual(record.levelno, logging.ERROR)
        assert record.exc_info is not None
        self.assertIsInstance(record.exc_info[1], ValueError)

    async def test_a_refusal_is_failed_precondition_with_the_reason_and_one_line_without_traceback(self) -> None:
        class Strict(HookServer):
            def PreCreateContainer(self, request: api_pb2.ContainerResourceHookRequest) -> None:
                raise sdk.Refuse("image forbidden/app:1 is not allowed on this node")

            def PreStartContainer(self, request: api_pb2.ContainerResourceHookRequest) -> "Deferred[None]":
                def refuse() -> None:
                    raise sdk.Refuse("later, from a Deferred")

                return task.deferLater(reactor, 0, refuse)

            async def PreRunPodSandbox(self, request: api_pb2.PodSandboxHookRequest) -> None:
                await asyncio.sleep(0)
                raise sdk.Refuse("from a coroutine")

        self.serve(Strict())
        for hook, request, reason in [
            (HookType.PRE_CREATE_CONTAINER, container_request(), "image forbidden/app:1 is not allowed on this node"),
            (HookType.PRE_START_CONTAINER, container_request(), "later, from a Deferred"),
            (HookType.PRE_RUN_POD_SANDBOX, pod_request(), "from a coroutine"),
        ]:
            error = await self.failed_call(hook, request)
            self.assertEqual((error.code(), error.details()), (grpc.StatusCode.FAILED_PRECONDITION, reason))
        self.assertIs(sdk.REFUSED, grpc.StatusCode.FAILED_PRECONDITION)
        self.assertEqual(
            [(record.levelno, record.getMessage(), record.exc_info) for record in self.logged],
            [
                (logging.INFO, "PreCreateContainer refused for pod default/web container app: "
                 "image forbidden/app:1 is not allowed on this node", None),
                (logging.INFO, "PreStartContainer refused for pod default/web container app: later, from a Deferred", None),
                (logging.INFO, "PreRunPodSandbox refused for pod default/web: from a coroutine", None),
            ],
        )

    async def test_failing_deferred_and_coroutine(self) -> None:
        server = HookServer()

        @server.hook(HookType.PRE_START_CONTAINER)
        def refuses(request: api_pb2.ContainerResourceHookRequest) -> "Deferred[None]":
            def divide() -> None:
                1 / 0

            return task.deferLater(reactor, 0.01, divide)

        @server.hook(HookType.PRE_RUN_POD_SANDBOX)
        async def also(request: api_pb2.PodSandboxHookRequest) -> None:
            await asyncio.sleep(0)
            raise RuntimeError("asyncio says no")

        self.serve(server)
        error = await self.failed_call(HookType.PRE_START_CONTAINER, container_request())
        self.assertEqual(error.code(), grpc.StatusCode.INTERNAL)
        self.assertIn("ZeroDivisionError", error.details())
        error = await self.failed_call(HookType.PRE_RUN_POD_SANDBOX, pod_request())
        self.assertEqual(error.code(), grpc.StatusCode.INTERNAL)
        self.assertIn("asyncio says no", error.details())

    async def test_wrong_answer_type_is_internal(self) -> None:
        server = HookServer()
        # The wrong answer on purpose: what a handler the type checker never saw could do.
        server.hook(HookType.PRE_RUN_POD_SANDBOX)(lambda request: api_pb2.ContainerResourceHookResponse())  # type: ignore[type-var]
        self.serve(server)
        error = await self.failed_call(HookType.PRE_RUN_POD_SANDBOX, pod_request())
        self.assertEqual(error.code(), grpc.StatusCode.INTERNAL)
        self.assertIn("PodSandboxHookResponse", error.details())

    async def test_unregistered_hook_is_unimplemented(self) -> None:
        server = HookServer()
        server.hook(HookType.PRE_CREATE_CONTAINER)(lambda request: None)
        self.serve(server)
        for hook, request in [
            (HookType.PRE_START_CONTAINER, container_request()),
            (HookType.POST_STOP_POD_SANDBOX, pod_request()),
        ]:
            error = await self.failed_call(hook, request)
            self.assertEqual(error.code(), grpc.StatusCode.UNIMPLEMENTED)
            self.assertIn(hook.value, error.details())

    async def test_deadline_cancels_the_deferred(self) -> None:
        cancelled: Deferred[None] = Deferred()
        server = HookServer()

        @server.hook(HookType.PRE_CREATE_CONTAINER)
        def never(request: api_pb2.ContainerResourceHookRequest) -> "Deferred[None]":
            return Deferred(lambda d: cancelled.callback(None))

        self.serve(server)
        error = await self.failed_call(HookType.PRE_CREATE_CONTAINER, container_request(), timeout=0.3)
        self.assertEqual(error.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        await cancelled

    async def test_deadline_cancels_the_coroutine(self) -> None:
        unwound = threading.Event()
        server = HookServer()

        @server.hook(HookType.PRE_CREATE_CONTAINER)
        async def never(request: api_pb2.ContainerResourceHookRequest) -> None:
            try:
                await asyncio.Event().wait()
            finally:
                unwound.set()

        self.serve(server)
        error = await self.failed_call(HookType.PRE_CREATE_CONTAINER, container_request(), timeout=0.3)
        self.assertEqual(error.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        self.assertTrue(await deferToThread(unwound.wait, 5))


class MisnamedHandlerTests(ServingTestCase):
    def test_a_public_method_named_like_a_hook_but_none_is_warned_about_at_start_up(self) -> None:
        class Releasing(HookServer):
            def PostStopContainers(self, request: Any) -> None:  # never called: the hook has no "s"
                pass

            def PreCreateContainer(self, request: Any) -> None:
                pass

        self.serve(Releasing())
        self.assertEqual(
            [record.getMessage() for record in self.logged],
            ["Releasing.PostStopContainers looks like a handler but is no hook, so it is never called; "
             "did you mean PostStopContainer?"],
        )


class AnswerAdviceTests(ServingTestCase):
    """An answer built from scratch clears kubelet's cpuset without meaning to: the author is told, once."""

    def kubelets(self) -> api_pb2.ContainerResourceHookRequest:
        return container_request(
            container_resources=api_pb2.LinuxContainerResources(cpu_period=100000, cpu_quota=50000, cpu_shares=512, cpuset_cpus="1"),
            container_envs={"A": "1"},
        )

    def advice(self) -> list[str]:
        return [record.getMessage() for record in self.logged if record.levelno == logging.WARNING]

    async def test_a_fresh_answer_that_clears_the_cpuset_is_warned_about_once_naming_the_fix(self) -> None:
        class Fresh(HookServer):
            def PreCreateContainer(self, request: Any) -> api_pb2.ContainerResourceHookResponse:
                return api_pb2.ContainerResourceHookResponse(
                    container_resources=api_pb2.LinuxContainerResources(cpu_shares=1024), container_envs={"SET": "1"}
                )

        self.serve(Fresh())
        for _ in range(2):
            await self.call(HookType.PRE_CREATE_CONTAINER, self.kubelets())
        [warning] = self.advice()
        self.assertIn('the PreCreateContainer answer clears cpuset_cpus "1" that the request had', warning)
        self.assertIn("Start from koordrp.sdk.reply(request)", warning)

    async def test_a_copy_of_the_request_that_clears_the_cpuset_on_purpose_is_not(self) -> None:
        class Koordlet(HookServer):
            def PreCreateContainer(self, request: api_pb2.ContainerResourceHookRequest) -> api_pb2.ContainerResourceHookResponse:
                answer = reply(request)
                answer.container_resources.cpuset_cpus = ""  # a best-effort pod: kubelet's cpuset goes
                return answer

        self.serve(Koordlet())
        await self.call(HookType.PRE_CREATE_CONTAINER, self.kubelets())
        self.assertEqual(self.advice(), [])

    async def test_a_copy_that_changes_every_number_the_request_had_is_still_a_copy(self) -> None:
        class Batch(HookServer):
            def PreCreateContainer(self, request: api_pb2.ContainerResourceHookRequest) -> api_pb2.ContainerResourceHookResponse:
                answer = reply(request)
                answer.container_resources.cpu_shares = 256
                answer.container_resources.cpuset_cpus = ""
                return answer

        self.serve(Batch())
        request = container_request(container_resources=api_pb2.LinuxContainerResources(cpu_shares=512, cpuset_cpus="1"))
        response = await self.call(HookType.PRE_CREATE_CONTAINER, request)
        self.assertEqual(response.container_resources, api_pb2.LinuxContainerResources(cpu_shares=256))
        self.assertEqual(self.advice(), [])

    async def test_a_fresh_answer_is_warned_about_whatever_else_the_request_had(self) -> None:
        class Fresh(HookServer):
            def PreCreateContainer(self, request: api_pb2.ContainerResourceHookRequest) -> api_pb2.ContainerResourceHookResponse:
                return api_pb2.ContainerResourceHookResponse(container_resources=api_pb2.LinuxContainerResources(cpu_shares=256))

        self.serve(Fresh())
        only_a_cpuset = container_request(container_resources=api_pb2.LinuxContainerResources(cpuset_cpus="1"))
        await self.call(HookType.PRE_CREATE_CONTAINER, only_a_cpuset)
        [warning] = self.advice()
        self.assertIn('the PreCreateContainer answer clears cpuset_cpus "1" that the request had', warning)

    async def test_a_reply_built_in_a_coroutine_or_for_another_call_is_told_apart(self) -> None:
        kept: list[api_pb2.ContainerResourceHookResponse] = []

        class Mixed(HookServer):
            async def PreCreateContainer(self, request: api_pb2.ContainerResourceHookRequest) -> api_pb2.ContainerResourceHookResponse:
                await asyncio.sleep(0)
                answer = reply(request)
                answer.container_resources.cpuset_cpus = ""
                return answer

            def PreUpdateContainerResources(self, request: api_pb2.ContainerResourceHookRequest) -> api_pb2.ContainerResourceHookResponse:
                if kept:  # the second call answers with what reply() built for the first one's request
                    return kept[0]
                kept.append(reply(request))
                kept[0].container_resources.cpuset_cpus = ""
                return kept[0]

        self.serve(Mixed())
        await self.call(HookType.PRE_CREATE_CONTAINER, self.kubelets())
        self.assertEqual(self.advice(), [])
        await self.call(HookType.PRE_UPDATE_CONTAINER_RESOURCES, self.kubelets())
        self.assertEqual(self.advice(), [])
        await self.call(HookType.PRE_UPDATE_CONTAINER_RESOURCES, self.kubelets())
        [warning] = self.advice()
        self.assertIn("PreUpdateContainerResources answer clears", warning)

    def test_outside_a_call_every_answer_counts_as_fresh(self) -> None:
        request = self.kubelets()
        fresh = api_pb2.ContainerResourceHookResponse(container_resources=api_pb2.LinuxContainerResources(cpu_shares=2))
        self.assertEqual(advice.cleared(request, fresh), ['cpuset_cpus "1"'])
        fresh.container_resources.cpuset_cpus = "0"
        self.assertEqual(advice.cleared(request, fresh), [])  # it sets the cpuset it means
        self.assertEqual(advice.cleared(request, api_pb2.ContainerResourceHookResponse(container_envs={"A": "2"})), [])
        copy = reply(request)
        copy.container_resources.cpuset_cpus = ""
        self.assertEqual(advice.cleared(request, copy), ['cpuset_cpus "1"'])  # no handler held the request
        with advice.handed(request):
            copy = reply(request)
            copy.container_resources.cpuset_cpus = ""
            self.assertEqual(advice.cleared(request, copy), [])
            self.assertEqual(advice.cleared(request, copied(copy)), ['cpuset_cpus "1"'])
        self.assertEqual(advice.cleared(request, copy), ['cpuset_cpus "1"'])


class ExampleServerTests(ServingTestCase):
    """koordrp.examples.cpuset_qos answers with the request as it came, plus its changes."""

    def setUp(self) -> None:
        super().setUp()
        self.running = self.serve(CpusetQoS())

    def test_subscribes_to_its_three_hooks(self) -> None:
        self.assertEqual(self.running.hooks, {HookType.PRE_RUN_POD_SANDBOX, HookType.PRE_CREATE_CONTAINER, HookType.POST_STOP_CONTAINER})

    async def test_pins_to_annotated_cpus_and_names_the_qos_class(self) -> None:
        request = container_request(
            pod_annotations={"demo.koordrp.io/cpuset": "0-1"},
            pod_labels={"koordinator.sh/qosClass": "LSR"},
            container_envs={"PATH": "/bin"},
            container_resources={"cpu_shares": 512},
        )
        response = await self.call(HookType.PRE_CREATE_CONTAINER, request)
        self.assertEqual(
            response,
            api_pb2.ContainerResourceHookResponse(
                container_resources=api_pb2.LinuxContainerResources(cpu_shares=512, cpuset_cpus="0-1"),
                container_envs={"PATH": "/bin", "POD_QOS_CLASS": "LSR"},
            ),
        )

    async def test_without_annotation_or_label(self) -> None:
        response = await self.call(HookType.PRE_CREATE_CONTAINER, container_request())
        self.assertEqual(response, api_pb2.ContainerResourceHookResponse(container_envs={"POD_QOS_CLASS": "NONE"}))
        self.assertFalse(response.HasField("container_resources"))

    async def test_malformed_cpuset_is_refused(self) -> None:
        request = container_request(pod_annotations={"demo.koordrp.io/cpuset": "all of them"})
        error = await self.failed_call(HookType.PRE_CREATE_CONTAINER, request)
        self.assertEqual(error.code(), sdk.REFUSED)
        self.assertEqual(
            error.details(), "annotation demo.koordrp.io/cpuset='all of them' is not a CPU list like 0-1 or 0,2"
        )

    async def test_pod_sandbox_changes_nothing(self) -> None:
        response = await self.call(HookType.PRE_RUN_POD_SANDBOX, pod_request())
        self.assertEqual(response.ByteSize(), 0)


class ReplyTests(SynchronousTestCase):
    def test_a_reply_is_the_request_as_an_answer_that_changes_nothing(self) -> None:
        resources = api_pb2.LinuxContainerResources(cpu_shares=2, cpuset_cpus="0-3", cpuset_mems="0")
        container = container_request(
            container_annotations={"a": "1"}, container_resources=resources, pod_cgroup_parent="/kubepods/p",
            container_envs={"A": "1"},
        )
        pod = api_pb2.PodSandboxHookRequest(labels={"l": "1"}, annotations={"a": "1"}, cgroup_parent="/p", resources=resources)
        for request in (container, pod):
            merged = copied(request)
            merge_response(merged, sdk.reply(request))
            self.assertEqual(merged, request)
        self.assertEqual(sdk.reply(container).container_resources, resources)
        self.assertEqual((sdk.reply(pod).cgroup_parent, dict(sdk.reply(pod).labels)), ("/p", {"l": "1"}))
        self.assertFalse(sdk.reply(container_request()).HasField("container_resources"))


class NamingTests(SynchronousTestCase):
    def test_hook_names_spelt_otherwise_are_refused(self) -> None:
        for name in ("pre_create_container", "PreCreateContainerHook", "precreatecontainer"):
            with self.assertRaises(TypeError) as raised:
                type("Misnamed", (HookServer,), {name: lambda self, request: None})
            self.assertIn("PreCreateContainer", str(raised.exception))

    def test_unknown_hook(self) -> None:
        with self.assertRaises(ValueError):
            HookServer().hook("PreDeleteContainer")

    def test_one_handler_per_hook(self) -> None:
        class Server(HookServer):
            def PreStartContainer(self, request: api_pb2.ContainerResourceHookRequest) -> None:
                return None

        server = Server()
        with self.assertRaises(ValueError):
            server.hook(HookType.PRE_START_CONTAINER)(lambda request: None)
        server.hook("PostStartContainer")(lambda request: None)
        with self.assertRaises(ValueError):
            server.hook(HookType.POST_START_CONTAINER)(lambda request: None)

    def test_decorator_returns_the_handler(self) -> None:
        server = HookServer()

        def handler(request: api_pb2.ContainerResourceHookRequest) -> None:
            return None

        self.assertIs(server.hook(HookType.PRE_CREATE_CONTAINER)(handler), handler)

    def test_subclass_with_own_init(self) -> None:
        class Configured(HookServer):
            def __init__(self, cpus: str) -> None:  # no super().__init__(): still works
                self.cpus = cpus

            def PreCreateContainer(self, request: api_pb2.ContainerResourceHookRequest) -> None:
                return None

        server = Configured("0")
        server.hook(HookType.PRE_START_CONTAINER)(lambda request: None)
        self.assertEqual(server.hooks, {HookType.PRE_CREATE_CONTAINER, HookType.PRE_START_CONTAINER})


class RegistrationTests(SynchronousTestCase):
    """serve() registers the server in hookserver.d the way koordrp wants to read it."""

    def setUp(self) -> None:
        self.dir = short_tempdir(self)
        self.socket = os.path.join(self.dir, "run", "pinning.sock")
        self.hookserver_d = os.path.join(self.dir, "hookserver.d")
        self.server = HookServer()
        self.server.hook(HookType.PRE_RUN_POD_SANDBOX)(lambda request: None)
        self.server.hook(HookType.PRE_CREATE_CONTAINER)(lambda request: None)

    def serve(self, **options: Any) -> RunningServer:
        running = self.server.serve(self.socket, register_in=self.hookserver_d, **options)
        self.addCleanup(running.stop, 0)
        return running

    def registration(self, name: str = "pinning") -> dict[str, Any]:
        with open(os.path.join(self.hookserver_d, f"{name}.json"), "rb") as stream:
            document: dict[str, Any] = json.load(stream)
        return document

    def test_lists_exactly_the_hooks_with_handlers(self) -> None:
        running = self.serve(failure_policy="Fail", timeout_seconds=3)
        self.assertEqual(running.registration_path, os.path.join(self.hookserver_d, "pinning.json"))
        self.assertEqual(
            self.registration(),
            {
                "remote-endpoint": self.socket,
                "failure-policy": "Fail",
                "runtime-hooks": ["PreRunPodSandbox", "PreCreateContainer"],
                "timeout-seconds": 3,
            },
        )
        self.assertEqual(os.listdir(self.hookserver_d), ["pinning.json"])

    def test_defaults(self) -> None:
        self.serve(name="koord-pinning")
        document = self.registration("koord-pinning")
        self.assertEqual(document["failure-policy"], "Ignore")
        self.assertNotIn("timeout-seconds", document)

    def test_a_server_declares_its_policy_and_timeout_and_serve_overrides_them(self) -> None:
        class Strict(HookServer):
            failure_policy = "Fail"
            timeout_seconds = 2.0

            def PreCreateContainer(self, request: api_pb2.ContainerResourceHookRequest) -> None:
                return None

        self.server = Strict()
        running = self.serve()
        self.assertEqual((self.registration()["failure-policy"], self.registration()["timeout-seconds"]), ("Fail", 2))
        running.stop(0)
        self.server.timeout_seconds = 0.5  # an instance's own, over its class's
        running = self.serve(failure_policy=FailurePolicy.IGNORE)
        self.assertEqual((self.registration()["failure-policy"], self.registration()["timeout-seconds"]), ("Ignore", 0.5))

    def test_a_bad_declared_policy_or_timeout_is_an_error_where_it_is_written(self) -> None:
        with self.assertRaises(TypeError) as raised:
            type("Typo", (HookServer,), {"failure_policy": "Fial"})
        self.assertEqual(str(raised.exception), "Typo: failure_policy must be 'Fail' or 'Ignore', not 'Fial'")
        with self.assertRaises(TypeError):
            type("Forever", (HookServer,), {"timeout_seconds": float("inf")})
        server = HookServer()
        server.hook(HookType.PRE_CREATE_CONTAINER)(lambda request: None)
        server.failure_policy = "fail"  # an instance's own is checked when it is served, registered or not
        with self.assertRaises(ValueError):
            server.serve(self.socket)

    def test_koordrp_accepts_it(self) -> None:
        running = self.serve(failure_policy=FailurePolicy.FAIL, timeout_seconds=1.5)
        assert running.registration_path is not None
        with open(running.registration_path, "rb") as stream:
            config = parse_hook_server_config("pinning.json", stream.read(), default_timeout=2.0)
        self.assertEqual(config.endpoint, self.socket)
        self.assertEqual(config.failure_policy, FailurePolicy.FAIL)
        self.assertEqual(config.hooks, {HookType.PRE_RUN_POD_SANDBOX, HookType.PRE_CREATE_CONTAINER})
        self.assertEqual(config.timeout, 1.5)
        info = os.stat(running.registration_path)
        self.assertEqual(stat.S_IMODE(info.st_mode), 0o644)
        self.assertIsNone(permission_problem(info.st_mode, info.st_uid, os.geteuid()))
        self.assertEqual(stat.S_IMODE(os.stat(self.hookserver_d).st_mode), 0o755)

    def test_written_atomically(self) -> None:
        """koordrp never sees a partial file: it is complete, 0644 and synced before its rename."""
        seen: list[tuple[str, str, bool, int, Any]] = []
        real_replace = os.replace
        synced: list[int] = []
        real_fsync = os.fsync

        def fsync(descriptor: int) -> None:
            synced.append(descriptor)
            real_fsync(descriptor)

        def replace(source: str, target: str) -> None:
            with open(source, "rb") as stream:
                content = json.load(stream)
            seen.append((source, target, os.path.exists(target), stat.S_IMODE(os.stat(source).st_mode), content))
            self.assertTrue(synced, "renamed before fsync")
            real_replace(source, target)

        self.patch(os, "replace", replace)
        self.patch(os, "fsync", fsync)
        self.serve()
        [(source, target, existed, mode, content)] = seen
        self.assertEqual(os.path.dirname(source), self.hookserver_d)
        self.assertFalse(source.endswith(".json"), "koordrp would read the temporary file")
        self.assertEqual(target, os.path.join(self.hookserver_d, "pinning.json"))
        self.assertFalse(existed)
        self.assertEqual(mode, 0o644)
        self.assertEqual(content["runtime-hooks"], ["PreRunPodSandbox", "PreCreateContainer"])

    def test_registered_only_once_the_socket_answers(self) -> None:
        answering: list[bool] = []
        real_replace = os.replace

        def replace(source: str, target: str) -> None:
            probe = socket.socket(socket.AF_UNIX)
            with probe:
                answering.append(probe.connect_ex(self.socket) == 0)
            real_replace(source, target)

        self.patch(os, "replace", replace)
        self.serve()
        self.assertEqual(answering, [True])

    def test_stop_unregisters_first_then_removes_the_socket(self) -> None:
        running = self.serve()
        socket_present: list[bool] = []
        real_remove = sdk.registration.remove_registration

        def remove(path: str) -> None:
            socket_present.append(os.path.exists(self.socket))
            real_remove(path)

        self.patch(sdk.registration, "remove_registration", remove)
        running.stop(0)
        self.assertEqual(socket_present, [True])
        self.assertEqual(os.listdir(self.hookserver_d), [])
        self.assertFalse(os.path.exists(self.socket))
        running.stop(0)  # again: nothing to do

    def test_context_manager(self) -> None:
        with self.server.serve(self.socket, register_in=self.hookserver_d) as running:
            self.assertTrue(stat.S_ISSOCK(os.stat(self.socket).st_mode))
            self.assertIsNotNone(running.registration_path)
        self.assertFalse(os.path.exists(self.socket))
        self.assertEqual(os.listdir(self.hookserver_d), [])

    def test_without_register_in_nothing_is_written(self) -> None:
        running = self.server.serve(self.socket)
        self.addCleanup(running.stop, 0)
        self.assertIsNone(running.registration_path)
        self.assertFalse(os.path.exists(self.hookserver_d))

    def test_replaces_a_stale_socket_and_creates_the_directory(self) -> None:
        os.makedirs(os.path.dirname(self.socket))
        stale = socket.socket(socket.AF_UNIX)
        stale.bind(self.socket)
        stale.close()
        self.serve()
        self.assertTrue(stat.S_ISSOCK(os.stat(self.socket).st_mode))

    def test_refuses_a_socket_another_server_serves(self) -> None:
        self.serve()
        with self.assertRaises(SocketInUse):
            self.server.serve(self.socket, register_in=self.hookserver_d, name="second")
        self.assertEqual(os.listdir(self.hookserver_d), ["pinning.json"])

    def test_bad_arguments(self) -> None:
        for options in (
            {"failure_policy": "Sometimes"},
            {"timeout_seconds": 0},
            {"timeout_seconds": float("inf")},
            {"name": ".hidden"},
            {"name": "a/b"},
        ):
            with self.assertRaises(ValueError, msg=repr(options)):
                self.server.serve(self.socket, register_in=self.hookserver_d, **options)
        with self.assertRaises(ValueError):
            self.server.serve("relative.sock")
        with self.assertRaises(ValueError):
            HookServer().serve(self.socket)
        self.assertFalse(os.path.exists(self.hookserver_d))

    def test_unix_url(self) -> None:
        running = self.server.serve("unix://" + self.socket, register_in=self.hookserver_d)
        self.addCleanup(running.stop, 0)
        self.assertEqual(self.registration()["remote-endpoint"], self.socket)

    def test_wait_returns_when_stopped_from_another_thread(self) -> None:
        running = self.serve()
        stopper = threading.Timer(0.2, running.stop, args=(0,))
        stopper.start()
        self.addCleanup(stopper.join)
        self.assertIsNone(running.wait())
        self.assertEqual(os.listdir(self.hookserver_d), [])


class ExampleProcessTests(SynchronousTestCase):
    """``python -m koordrp.examples.cpuset_qos`` as a node runs it: registers, answers, stops on SIGTERM."""

    def test_runs_registers_and_stops_on_sigterm(self) -> None:
        directory = short_tempdir(self)
        socket_path = os.path.join(directory, "run", "cpuset-qos.sock")
        hookserver_d = os.path.join(directory, "hookserver.d")
        registration = os.path.join(hookserver_d, "cpuset-qos.json")
        process = subprocess.Popen(
            [sys.executable, "-m", "koordrp.examples.cpuset_qos", "--socket", socket_path, "--register-in", hookserver_d],
            cwd=REPOSITORY,
            env={**os.environ, "PYTHONPATH": REPOSITORY},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )

        def kill() -> None:
            if process.poll() is None:
                process.kill()

        self.addCleanup(kill)
        self.addCleanup(lambda: process.stdout and process.stdout.close())
        wait_for(lambda: os.path.exists(registration) or process.poll() is not None, 15)
        self.assertIsNone(process.poll(), "the example exited")
        with open(registration, "rb") as stream:
            config = parse_hook_server_config("cpuset-qos.json", stream.read(), default_timeout=2.0)
        self.assertEqual(config.hooks, {HookType.PRE_RUN_POD_SANDBOX, HookType.PRE_CREATE_CONTAINER, HookType.POST_STOP_CONTAINER})
        request = container_request(
            pod_annotations={"demo.koordrp.io/cpuset": "0"}, pod_labels={"koordinator.sh/qosClass": "BE"}
        )
        response = call(socket_path, HookType.PRE_CREATE_CONTAINER, request)
        self.assertEqual(response.container_resources.cpuset_cpus, "0")
        self.assertEqual(dict(response.container_envs), {"POD_QOS_CLASS": "BE"})
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=15)
        self.assertEqual(process.returncode, 0, output.decode(errors="replace"))
        self.assertFalse(os.path.exists(registration))
        self.assertFalse(os.path.exists(socket_path))


class ServedFileTests(SynchronousTestCase):
    """``python -m koordrp.sdk file.py``: the file's own policy unless a flag says otherwise, its module named after it."""

    def serve_file(self, *flags: str) -> tuple[dict[str, Any], str]:
        directory = short_tempdir(self)
        server = os.path.join(directory, "strict_images.py")
        with open(server, "w") as stream:
            stream.write(
                "import logging\n"
                "from koordrp.sdk import HookServer\n\n"
                "class StrictImages(HookServer):\n"
                "    failure_policy = 'Fail'\n\n"
                "    def PreCreateContainer(self, request):\n"
                "        return None\n\n"
                "logging.getLogger(__name__).warning('loaded as %s', StrictImages.__module__)\n"
            )
        hookserver_d = os.path.join(directory, "hookserver.d")
        registration = os.path.join(hookserver_d, "strict.json")
        command = [sys.executable, "-m", "koordrp.sdk", server, "--socket", os.path.join(directory, "strict.sock")]
        process = subprocess.Popen(
            [*command, "--register-in", hookserver_d, *flags],
            cwd=REPOSITORY,
            env={**os.environ, "PYTHONPATH": REPOSITORY},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.addCleanup(lambda: None if process.poll() is not None else process.kill())
        wait_for(lambda: os.path.exists(registration) or process.poll() is not None, 15)
        self.assertIsNone(process.poll(), "the server exited")
        with open(registration, "rb") as stream:
            document: dict[str, Any] = json.load(stream)
        process.send_signal(signal.SIGTERM)
        _, output = process.communicate(timeout=15)
        return document, output

    def test_the_servers_own_policy_is_registered(self) -> None:
        document, output = self.serve_file()
        self.assertEqual(document["failure-policy"], "Fail")
        self.assertNotIn("timeout-seconds", document)
        self.assertIn("strict_images WARNING loaded as strict_images", output)

    def test_the_command_line_overrides_it(self) -> None:
        document, _ = self.serve_file("--failure-policy", "Ignore", "--timeout-seconds", "3")
        self.assertEqual((document["failure-policy"], document["timeout-seconds"]), ("Ignore", 3))


class ListHandler(logging.Handler):
    def __init__(self, records: list[logging.LogRecord]) -> None:
        super().__init__()
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def wait_for(condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.05)
