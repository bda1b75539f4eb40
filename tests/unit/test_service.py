"""The CRI proxy service: where and how it listens, and how it stops."""

import os
import socket
import stat
import threading

import grpc
from cri_api.v1 import api_pb2, api_pb2_grpc
from twisted.trial.unittest import SynchronousTestCase

from koordrp.cri.server import CRIProxyService, CRIProxySettings
from koordrp.call import Parts, SkipLabel
from koordrp.hooks.client import HookClients
from koordrp.hooks.dispatcher import Dispatcher
from koordrp.hooks.types import HookServers
from koordrp.store import Store
from koordrp.unix import NotASocket, SocketInUse, UnsafeDirectory, grpc_target
from tests.fake.cri_backend import FakeCRIBackend
from tests.fake.reactor import InlineThreadsReactor
from tests.support.logs import logged_events
from tests.support.tempdirs import short_tempdir


def no_hooks(reactor: InlineThreadsReactor) -> Parts:
    return Parts(Store(), Dispatcher(HookClients(reactor), reactor), HookServers, SkipLabel("skip", "true"), reactor)


class CRIProxyServiceTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = short_tempdir(self)
        self.listen = os.path.join(self.dir, "run", "koordrp", "proxy.sock")
        self.backend = FakeCRIBackend(os.path.join(self.dir, "backend.sock"), name="backend").start()
        self.addCleanup(self.backend.stop)
        self.reactor = InlineThreadsReactor()
        self.events = logged_events(self)

    def make_service(self, grace: float = 5.0, socket_gid: int | None = None) -> CRIProxyService:
        settings = CRIProxySettings(
            listen_path=self.listen,
            runtime_path=self.backend.path,
            image_path=self.backend.path,
            grace_period=grace,
            max_workers=4,
            socket_gid=socket_gid,
        )
        return CRIProxyService(settings, self.reactor, no_hooks(self.reactor))

    def start(self, grace: float = 5.0, socket_gid: int | None = None) -> CRIProxyService:
        proxy = self.make_service(grace, socket_gid)
        proxy.startService()
        self.addCleanup(lambda: proxy.running and proxy.stopService())
        return proxy

    def stub(self) -> api_pb2_grpc.RuntimeServiceStub:
        channel = grpc.insecure_channel(grpc_target(self.listen))
        self.addCleanup(channel.close)
        return api_pb2_grpc.RuntimeServiceStub(channel)

    def test_listens_with_mode_0660_in_a_created_0755_directory(self) -> None:
        self.start()
        self.assertEqual(stat.S_IMODE(os.stat(self.listen).st_mode), 0o660)
        self.assertEqual(stat.S_IMODE(os.stat(os.path.dirname(self.listen)).st_mode), 0o755)
        self.assertEqual(self.stub().Version(api_pb2.VersionRequest(), timeout=5).runtime_name, "backend")

    def test_socket_group_is_configurable(self) -> None:
        self.start(socket_gid=4242)
        self.assertEqual(os.stat(self.listen).st_gid, 4242)
        self.assertEqual(stat.S_IMODE(os.stat(self.listen).st_mode), 0o660)

    def test_created_directory_is_0755_whatever_the_umask(self) -> None:
        previous = os.umask(0o077)
        try:
            self.start()
        finally:
            os.umask(previous)
        self.assertEqual(stat.S_IMODE(os.stat(os.path.dirname(self.listen)).st_mode), 0o755)

    def test_a_directory_others_can_write_or_own_is_refused(self) -> None:
        directory = os.path.dirname(self.listen)
        os.makedirs(directory)
        os.chmod(directory, 0o777)
        self.assertRaises(UnsafeDirectory, self.make_service().startService)
        os.chmod(directory, 0o755)
        os.chown(directory, 4242, -1)
        self.assertRaises(UnsafeDirectory, self.make_service().startService)

    def test_stale_socket_is_replaced(self) -> None:
        os.makedirs(os.path.dirname(self.listen))
        stale = socket.socket(socket.AF_UNIX)
        stale.bind(self.listen)
        stale.close()
        self.start()
        self.assertEqual(self.stub().Version(api_pb2.VersionRequest(), timeout=5).runtime_name, "backend")

    def test_socket_served_by_another_process_is_refused(self) -> None:
        os.makedirs(os.path.dirname(self.listen))
        live = socket.socket(socket.AF_UNIX)
        live.bind(self.listen)
        live.listen(1)
        self.addCleanup(live.close)
        self.assertRaises(SocketInUse, self.make_service().startService)

    def test_regular_file_in_the_way_is_refused_and_kept(self) -> None:
        os.makedirs(os.path.dirname(self.listen))
        with open(self.listen, "w") as f:
            f.write("operator's file")
        self.assertRaises(NotASocket, self.make_service().startService)
        with open(self.listen) as f:
            self.assertEqual(f.read(), "operator's file")

    def test_stop_lets_an_in_flight_call_finish_then_removes_the_socket(self) -> None:
        proxy = self.start(grace=5.0)
        self.backend.slow_call_seconds = 0.5
        stub = self.stub()
        outcome: list[object] = []
        call = threading.Thread(
            target=lambda: outcome.append(stub.ExecSync(api_pb2.ExecSyncRequest(container_id="c"), timeout=5))
        )
        call.start()
        while not [c for c in self.backend.calls if c.method.endswith("/ExecSync")]:
            threading.Event().wait(0.01)
        stopped = proxy.stopService()
        self.successResultOf(stopped)
        call.join(5)
        self.assertEqual([response.stdout for response in outcome], [b"late"])  # type: ignore[attr-defined]
        self.assertFalse(os.path.exists(self.listen))

    def test_stop_cancels_calls_that_outlive_the_grace_period(self) -> None:
        proxy = self.start(grace=0.1)
        self.backend.slow_call_seconds = 3
        stub = self.stub()
        errors: list[grpc.RpcError] = []

        def slow_call() -> None:
            try:
                stub.ExecSync(api_pb2.ExecSyncRequest(container_id="c"), timeout=10)
            except grpc.RpcError as error:
                errors.append(error)

        call = threading.Thread(target=slow_call)
        call.start()
        while not [c for c in self.backend.calls if c.method.endswith("/ExecSync")]:
            threading.Event().wait(0.01)
        self.successResultOf(proxy.stopService())
        call.join(5)
        self.assertEqual([error.code() for error in errors], [grpc.StatusCode.UNAVAILABLE])

    def test_reachability_is_logged_from_the_reactor(self) -> None:
        self.start()
        self.stub().Version(api_pb2.VersionRequest(), timeout=5)
        messages = [event.get("log_format") for event in self.events]
        self.assertIn("backend unix://{endpoint} is reachable", messages)
        self.assertTrue(self.reactor.from_threads)
