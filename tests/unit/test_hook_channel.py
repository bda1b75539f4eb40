"""HookClient's calls on the real reactor, over koordrp.hooks.channel's HTTP/2 connection, to real servers on unix
sockets: grpcio's (as a hook server is), and hand-written ones that misbehave, where each call must still end, once."""

from __future__ import annotations

import os
import socket
import struct
import threading
from typing import Callable

import grpc
from twisted.internet import reactor
from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.interfaces import IAddress, IListeningPort, IReactorUNIX
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase

from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from koordrp.hooks.channel import HTTP2Channel
from koordrp.hooks.client import MAX_ANSWER, HookCallError, HookClient, HookTimedOut
from koordrp.hooks.messages import HookResponse
from koordrp.hooks.types import HookType
from koordrp.http2 import END_STREAM, ErrorCode, Frame, Setting, request_headers
from tests.fake import FakeGrpcServer
from tests.fake.hook_server import FakeHookServer
from tests.support.tempdirs import short_tempdir
from tests.support.waiting import until
from tests.unit.test_http2 import ServerEnd, Written, frame, message, settings_frame

CREATE = HookType.PRE_CREATE_CONTAINER
LONG = 30.0
"""A timeout for calls that must end by other means: only a bound, should they not."""


def echo_env(request: hook.ContainerResourceHookRequest) -> hook.ContainerResourceHookResponse:
    return hook.ContainerResourceHookResponse(container_envs={"SEEN": ",".join(sorted(request.container_envs))})


def request(**envs: str) -> hook.ContainerResourceHookRequest:
    return hook.ContainerResourceHookRequest(container_envs=envs)


class ClientTest(TestCase):
    def setUp(self) -> None:
        self.path = os.path.join(short_tempdir(self), "hook.sock")

    def client(self) -> HookClient:
        client = HookClient(self.path, reactor)
        self.addCleanup(client.close)
        return client

    async def failed(self, answered: Deferred[HookResponse]) -> HookCallError:
        """The one HookCallError ``answered`` fails with."""
        try:
            response = await answered
        except HookCallError as error:
            return error
        raise AssertionError(f"answered: {response}")


class GrpcServerTests(ClientTest):
    """Against grpcio's server, as koordlet's is grpc-go's: what a hook server answers, as koordrp reads it."""

    def server(self) -> FakeHookServer:
        fake = FakeHookServer(self.path).start()
        self.addCleanup(fake.stop)
        return fake

    async def test_a_call_is_answered(self) -> None:
        fake = self.server()
        fake.behaviours["PreCreateContainerHook"] = echo_env
        response = await self.client().call(CREATE, request(A="1", B="2"), LONG)
        assert isinstance(response, hook.ContainerResourceHookResponse)
        self.assertEqual(dict(response.container_envs), {"SEEN": "A,B"})
        self.assertEqual(fake.calls("PreCreateContainerHook"), [request(A="1", B="2")])

    async def test_an_error_status_is_sent_back(self) -> None:
        fake = self.server()
        fake.failures["PreCreateContainerHook"] = grpc.StatusCode.FAILED_PRECONDITION
        error = await self.failed(self.client().call(CREATE, request(), LONG))
        self.assertEqual(str(error), "FAILED_PRECONDITION: PreCreateContainerHook refused by the test")
        self.assertEqual((error.sent_back, str(error).startswith("UNAVAILABLE: "), error.timed_out), (True, False, False))

    async def test_an_unknown_method_is_unimplemented(self) -> None:
        """A server of another service (its own handlers only) says so with a status, which is sent back."""
        server = _CancelSeen(self.path, "other.Service")
        server.start()
        self.addCleanup(server.stop)
        error = await self.failed(self.client().call(CREATE, request(), LONG))
        self.assertTrue(str(error).startswith("UNIMPLEMENTED"), str(error))
        self.assertTrue(error.sent_back)

    async def test_concurrent_calls_are_each_answered_with_their_own_answer(self) -> None:
        fake = self.server()
        fake.behaviours["PreCreateContainerHook"] = echo_env
        client = self.client()
        calls = [client.call(CREATE, request(**{f"E{i}": "1"}), LONG) for i in range(50)]
        results = await DeferredList(calls, fireOnOneErrback=True, consumeErrors=True)
        envs = [dict(response.container_envs) for _, response in results]  # type: ignore[union-attr]
        self.assertEqual(envs, [{"SEEN": f"E{i}"} for i in range(50)])
        self.assertFalse(client.busy)

    async def test_a_large_request_and_answer_pass_whole(self) -> None:
        """Past every window's and frame's default size, both ways."""
        fake = self.server()
        fake.behaviours["PreCreateContainerHook"] = lambda request: hook.ContainerResourceHookResponse(container_envs=dict(request.container_envs))
        big = {f"K{i}": "v" * 1000 for i in range(300)}
        client = self.client()
        for _ in range(3):
            response = await client.call(CREATE, request(**big), LONG)
            self.assertEqual(dict(response.container_envs), big)  # type: ignore[union-attr]

    async def test_a_call_timed_out_is_cancelled_at_the_server(self) -> None:
        server = _CancelSeen(self.path)
        server.start()
        self.addCleanup(server.stop)
        error = await self.failed(self.client().call(CREATE, request(), 0.3))
        self.assertIsInstance(error, HookTimedOut)
        self.assertEqual(str(error), "no answer within 0.3s")
        await server.cancelled  # fires when the server's call ends unanswered: the stream's reset reached it

    async def test_a_call_in_flight_when_its_server_stops_fails_and_the_restarted_server_answers_the_next(self) -> None:
        fake = self.server()
        fake.behaviours["PreCreateContainerHook"] = echo_env
        client = self.client()
        await client.call(CREATE, request(), LONG)
        # Its handler is still busy when the server stops (let go after, so that stopping cannot answer it).
        release = threading.Event()
        self.addCleanup(release.set)
        fake.behaviours["PreCreateContainerHook"] = lambda request: release.wait(LONG) and echo_env(request)
        in_flight = client.call(CREATE, request(), LONG)
        await until(lambda: len(fake.calls()) == 2)
        fake.stop()
        release.set()
        error = await self.failed(in_flight)
        # grpcio's server aborts the calls it has as it stops: the status it sends says so.
        self.assertTrue(str(error).startswith("UNAVAILABLE"), str(error))
        self.assertEqual((error.sent_back, error.timed_out), (True, False))
        # Stopped, grpcio's server took its socket away: the call fails at once, with no connection tried.
        stopped = await self.failed(client.call(CREATE, request(), LONG))
        self.assertIn("does not exist", str(stopped))
        self.assertFalse(stopped.sent_back)
        fake.behaviours["PreCreateContainerHook"] = echo_env
        fake.start()
        response = await client.call(CREATE, request(A="1"), LONG)
        self.assertEqual(dict(response.container_envs), {"SEEN": "A"})  # type: ignore[union-attr]

    async def test_closing_the_client_fails_its_calls_in_flight(self) -> None:
        fake = self.server()
        fake.delays["PreCreateContainerHook"] = 3600
        client = self.client()
        calls = [client.call(CREATE, request(), LONG) for _ in range(3)]
        await until(lambda: len(fake.calls()) == 3)
        client.close()
        for call in calls:
            error = await self.failed(call)
            self.assertFalse(error.timed_out)
        self.assertFalse(client.busy)

    async def test_closing_the_client_before_it_connected_fails_its_calls_as_lost(self) -> None:
        self.server()
        client = self.client()
        call = client.call(CREATE, request(), LONG)
        client.close()  # on the reactor's next turn the connection would have been made
        error = await self.failed(call)
        self.assertTrue(str(error).startswith("UNAVAILABLE: "), str(error))


class NothingListeningTests(ClientTest):
    async def test_a_socket_nothing_listens_on_fails_each_call_as_lost(self) -> None:
        bound = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bound.bind(self.path)
        bound.close()  # the file stays; connecting to it is refused
        client = self.client()
        for _ in range(2):
            error = await self.failed(client.call(CREATE, request(), LONG))
            self.assertTrue(str(error).startswith("UNAVAILABLE: "), str(error))
            self.assertTrue(str(error).startswith("UNAVAILABLE: no connection"), str(error))

    async def test_no_socket_fails_at_once(self) -> None:
        error = await self.failed(self.client().call(CREATE, request(), LONG))
        self.assertIn("does not exist", str(error))


class RawServer(Protocol):
    """A hand-written server's end of one connection: each batch of frames the client writes is given to ``script``."""

    def __init__(self, script: Callable[[RawServer, list[Written]], None]) -> None:
        self.script = script
        self.end = ServerEnd()
        self.frames: list[Written] = []
        self.body = b""
        """The DATA frames' payloads the client wrote, in order."""
        self.ended: Deferred[None] = Deferred()
        self.reset: Deferred[int] = Deferred()
        """Fires with the first RST_STREAM's code the client sends."""

    def dataReceived(self, data: bytes) -> None:
        frames = self.end.read(data)
        self.frames += frames
        for written in frames:
            if written.kind == Frame.DATA:
                self.body += written.payload
            if written.kind == Frame.RST_STREAM and not self.reset.called:
                self.reset.callback(written.error_code)
        if frames:
            self.script(self, frames)

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.ended.callback(None)


class RawServers(Factory):
    def __init__(self, script: Callable[[RawServer, list[Written]], None]) -> None:
        self.script = script
        self.connections: list[RawServer] = []

    def buildProtocol(self, addr: IAddress | None) -> RawServer:
        connection = RawServer(self.script)
        connection.factory = self
        self.connections.append(connection)
        return connection


class MisbehavingServerTests(ClientTest):
    """Servers that break HTTP/2 or gRPC, or go quiet: each call ends in one HookCallError, and nothing hangs."""

    def serve(self, script: Callable[[RawServer, list[Written]], None]) -> list[RawServer]:
        """Listen at the path; the list fills with the connections made, in order."""
        factory = RawServers(script)
        port: IListeningPort = IReactorUNIX(reactor).listenUNIX(self.path, factory)

        async def stopped() -> None:
            listening = port.stopListening()
            if listening is not None:
                await listening
            for connection in factory.connections:
                if connection.transport is not None:
                    connection.transport.loseConnection()
                await connection.ended

        self.addCleanup(lambda: Deferred.fromCoroutine(stopped()))
        return factory.connections

    async def test_a_channel_let_go_while_it_connects_closes_once_connected(self) -> None:
        # Its one call was given up before the connection was up: nothing is left holding the socket open.
        connections = self.serve(lambda server, frames: None)
        channel = HTTP2Channel(IReactorUNIX(reactor), self.path, MAX_ANSWER)
        call = channel.call(request_headers("/runtime.v1alpha1.RuntimeHookService/PreCreateContainerHook", "localhost", "koordrp"), b"")
        call.addErrback(lambda _: None)
        channel.close_when_idle()
        call.cancel()
        await until(lambda: connections)
        await connections[0].ended

    async def test_garbage_for_an_answer(self) -> None:
        def garbage(server: RawServer, frames: list[Written]) -> None:
            server.send(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

        connections = self.serve(garbage)
        error = await self.failed(self.client().call(CREATE, request(), LONG))
        self.assertIn("the server broke HTTP/2", str(error))
        self.assertEqual((str(error).startswith("UNAVAILABLE: "), error.sent_back), (False, False))
        # It was told why, and the connection closed.
        await connections[0].ended
        [away] = [written for written in connections[0].frames if written.kind == Frame.GOAWAY]
        self.assertEqual(away.error_code, ErrorCode.FRAME_SIZE_ERROR)

    async def test_a_connection_closed_mid_answer(self) -> None:
        def half(server: RawServer, frames: list[Written]) -> None:
            for written in frames:
                if written.kind == Frame.DATA and written.flags & END_STREAM:
                    answer = server.end.response_headers(written.stream_id) + frame(Frame.DATA, 0, written.stream_id, message(b"\x00" * 100))
                    server.send(settings_frame() + answer[:-30])
                    assert server.transport is not None
                    server.transport.loseConnection()

        self.serve(half)
        error = await self.failed(self.client().call(CREATE, request(), LONG))
        self.assertTrue(str(error).startswith("the connection was lost"), str(error))
        self.assertEqual((str(error).startswith("UNAVAILABLE: "), error.sent_back, error.timed_out), (False, False, False))

    async def test_a_connection_closed_on_arrival_loses_nothing_quietly(self) -> None:
        def close(server: RawServer, frames: list[Written]) -> None:
            assert server.transport is not None
            server.transport.loseConnection()

        self.serve(close)
        error = await self.failed(self.client().call(CREATE, request(), LONG))
        self.assertFalse(error.timed_out)

    async def test_a_server_that_never_answers_times_out_and_hears_the_stream_reset(self) -> None:
        connections = self.serve(lambda server, frames: None)
        error = await self.failed(self.client().call(CREATE, request(), 0.2))
        self.assertIsInstance(error, HookTimedOut)
        self.assertEqual(await connections[0].reset, ErrorCode.CANCEL)

    async def test_an_answer_that_never_ends_times_out(self) -> None:
        def headers_only(server: RawServer, frames: list[Written]) -> None:
            for written in frames:
                if written.kind == Frame.HEADERS:
                    server.send(settings_frame() + server.end.response_headers(written.stream_id))

        connections = self.serve(headers_only)
        error = await self.failed(self.client().call(CREATE, request(), 0.2))
        self.assertIsInstance(error, HookTimedOut)
        self.assertEqual(await connections[0].reset, ErrorCode.CANCEL)

    async def test_an_answer_that_is_no_hook_response_is_an_internal_error_sent_back(self) -> None:
        def nonsense(server: RawServer, frames: list[Written]) -> None:
            for written in frames:
                if written.kind == Frame.DATA and written.flags & END_STREAM:
                    body = frame(Frame.DATA, 0, written.stream_id, message(b"\xff\xff\xff"))
                    server.send(server.end.response_headers(written.stream_id) + body + server.end.trailers(written.stream_id))

        self.serve(nonsense)
        error = await self.failed(self.client().call(CREATE, request(), LONG))
        self.assertTrue(str(error).startswith("INTERNAL: an answer that is no ContainerResourceHookResponse"), str(error))
        self.assertTrue(error.sent_back)

    async def test_a_refused_stream_is_lost_and_the_next_call_goes_on_the_same_connection(self) -> None:
        refused = False

        def refuse_first(server: RawServer, frames: list[Written]) -> None:
            nonlocal refused
            for written in frames:
                if written.kind == Frame.DATA and written.flags & END_STREAM:
                    if not refused:
                        refused = True
                        server.send(frame(Frame.RST_STREAM, 0, written.stream_id, struct.pack(">L", ErrorCode.REFUSED_STREAM)))
                    else:
                        server.send(server.end.answer(written.stream_id, b""))

        connections = self.serve(refuse_first)
        client = self.client()
        error = await self.failed(client.call(CREATE, request(), LONG))
        self.assertTrue(str(error).startswith("UNAVAILABLE: "), str(error))
        self.assertEqual(await client.call(CREATE, request(), LONG), hook.ContainerResourceHookResponse())
        self.assertEqual(len(connections), 1)

    async def test_a_server_going_away_sends_the_next_call_on_a_new_connection(self) -> None:
        def answer_then_go(server: RawServer, frames: list[Written]) -> None:
            for written in frames:
                if written.kind == Frame.DATA and written.flags & END_STREAM:
                    # grpc-go's graceful stop: a first GOAWAY naming every stream, then the answer.
                    server.send(frame(Frame.GOAWAY, 0, 0, struct.pack(">LL", 2**31 - 1, 0)) + server.end.answer(written.stream_id, b""))

        connections = self.serve(answer_then_go)
        client = self.client()
        for _ in range(2):
            self.assertEqual(await client.call(CREATE, request(), LONG), hook.ContainerResourceHookResponse())
        self.assertEqual(len(connections), 2)

    async def test_a_server_with_a_tiny_window_still_gets_the_whole_request(self) -> None:
        def stingy(server: RawServer, frames: list[Written]) -> None:
            for written in frames:
                if written.kind == Frame.SETTINGS and not written.flags:
                    server.send(settings_frame((Setting.INITIAL_WINDOW_SIZE, 7)))
                elif written.kind == Frame.DATA:
                    if written.flags & END_STREAM:
                        server.send(server.end.answer(written.stream_id, b""))
                    else:
                        update = struct.pack(">L", len(written.payload))
                        server.send(frame(Frame.WINDOW_UPDATE, 0, 0, update) + frame(Frame.WINDOW_UPDATE, 0, written.stream_id, update))

        connections = self.serve(stingy)
        client = self.client()
        # The first call may go out before the server's settings arrive (with the default window); the next may not.
        await client.call(CREATE, request(), LONG)
        connections[0].body = b""
        del connections[0].frames[:]
        sent = request(A="x" * 100)
        await client.call(CREATE, sent, LONG)
        self.assertEqual(connections[0].body, message(sent.SerializeToString()))
        self.assertTrue(all(len(written.payload) <= 7 for written in connections[0].frames if written.kind == Frame.DATA))


class _CancelSeen(FakeGrpcServer):
    """A grpcio server whose hook never answers, and that tells (``cancelled``) when a call of it ends unanswered."""

    def __init__(self, path: str, service: str = "runtime.v1alpha1.RuntimeHookService") -> None:
        self.path = path
        self.service = service
        self.cancelled: Deferred[None] = Deferred()
        self._stopping = threading.Event()

    def start(self) -> None:
        def wait(request: bytes, context: grpc.ServicerContext) -> bytes:
            ended = threading.Event()
            context.add_callback(ended.set)
            # Ends when the call does (the client's reset) or the server stops, whichever first.
            while not ended.wait(0.05) and not self._stopping.is_set():
                pass
            if ended.is_set():
                reactor.callFromThread(self._ended)  # type: ignore[attr-defined]
            return b""

        handler = grpc.method_handlers_generic_handler(self.service, {CREATE.rpc_name: grpc.unary_unary_rpc_method_handler(wait)})
        self._serve(lambda server: None, [handler])

    def _ended(self) -> None:
        if not self.cancelled.called:
            self.cancelled.callback(None)

    def stop(self) -> None:
        super().stop()  # first: a call it aborts is one the client did not cancel
        self._stopping.set()


