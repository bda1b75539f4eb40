"""Crossing from CRI worker threads into the reactor for hook stages."""

import os

from twisted.internet import reactor
from twisted.internet.defer import inlineCallbacks
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase

from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from koordrp.cri.bridge import HookBridge
from koordrp.hooks.client import HookClients
from koordrp.hooks.dispatcher import Dispatcher
from koordrp.hooks.types import FailurePolicy, HookServerConfig, HookServers, HookType
from tests.fake.hook_server import FakeHookServer
from tests.support.tempdirs import short_tempdir


class HookBridgeTests(TestCase):
    def setUp(self) -> None:
        self.server = FakeHookServer(os.path.join(short_tempdir(self), "hook.sock")).start()
        self.addCleanup(self.server.stop)
        self.servers = HookServers(
            (HookServerConfig("hook.json", self.server.path, FailurePolicy.FAIL, frozenset(HookType), 2.0),)
        )
        clients = HookClients(reactor)
        self.addCleanup(clients.close_all)
        self.bridge = HookBridge(reactor, Dispatcher(clients, reactor))

    @inlineCallbacks
    def test_a_pre_stage_runs_in_the_reactor_and_answers_the_worker(self):  # type: ignore[no-untyped-def]
        self.server.behaviours["PreStartContainerHook"] = lambda r: hook.ContainerResourceHookResponse(
            container_envs={"SEEN": "1"}
        )
        outcome = yield deferToThread(
            self.bridge.run, HookType.PRE_START_CONTAINER, self.servers.servers, hook.ContainerResourceHookRequest(), 5.0
        )
        self.assertEqual(dict(outcome.request.container_envs), {"SEEN": "1"})
