"""NRI mode's store from NRI alone: which pods containerd tells of (koordrp.nri.told), and the listing that finds
the others gone (koordrp.nri.listing), against containerd's side of the wire (tests/fake/nri.py) on a fake reactor."""

import os
from typing import Any

from twisted.internet.defer import ensureDeferred
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from koordrp.adapters import LookupFailed
from koordrp.api.nri.v1alpha1 import api_pb2 as nri
from koordrp.call import Parts
from koordrp.hooks.messages import ContainerHookRequest, PodHookRequest
from koordrp.hooks.types import HookServers
from koordrp.nri.connection import UNKNOWN
from koordrp.nri.wire import RUNTIME_SERVICE_CONNECTION
from koordrp.nri.listing import LINGER_SECONDS, NOT_STAYING, QUESTION_SECONDS, NRIListing, NRIListingService
from koordrp.nri.plugin import PluginIdentity
from koordrp.nri.service import NRIService, NRISettings
from koordrp.nri.told import ToldPods, socket_file
from koordrp.store import Store
from tests.fake.flows import ScriptedStages
from tests.fake.nri import FakeContainerd
from tests.unit.test_nri import SKIP, event, nri_container, nri_pod
from tests.unit.test_resync import opened_checkpoint

SOCKET = "/run/nri/nri.sock"
IDENTITY = PluginIdentity("koordrp", "10")


def stored(*sandbox_ids: str) -> Store:
    store = Store()
    for sandbox_id in sandbox_ids:
        store.put_pod(sandbox_id, PodHookRequest(), PodHookRequest())
    return store


class ToldPodsTests(SynchronousTestCase):
    def test_a_pod_heard_run_is_told_until_containerd_is_another(self) -> None:
        told = ToldPods()
        told.connected((1, 100, 7))
        told.ran("heard")
        self.assertEqual(told.untold({"heard", "synchronized"}), {"synchronized"})
        told.connected((1, 100, 7))  # koordrp reconnected to the same containerd
        self.assertEqual(told.untold({"heard"}), set())
        told.connected((1, 100, 8))  # containerd restarted: its socket is a new file (the same inode, reused)
        self.assertEqual(told.untold({"heard"}), {"heard"})

    def test_a_socket_that_cannot_be_looked_at_tells_containerds_apart_from_none(self) -> None:
        told = ToldPods()
        told.connected(None)
        told.ran("heard")
        told.connected(None)
        self.assertEqual(told.untold({"heard"}), {"heard"})

    def test_removed_and_left_out_of_a_synchronization_are_told_no_more(self) -> None:
        told = ToldPods()
        told.connected((1, 100, 7))
        for sandbox_id in ("removed", "gone-meanwhile", "kept"):
            told.ran(sandbox_id)
        told.removed("removed")
        told.synchronized({"kept"})
        self.assertEqual(told.untold({"removed", "gone-meanwhile", "kept"}), {"removed", "gone-meanwhile"})

    def test_the_socket_file_is_its_device_inode_and_change_time(self) -> None:
        path = self.mktemp()
        open(path, "w").close()
        before = socket_file(path)
        found = os.stat(path)
        self.assertEqual(before, (found.st_dev, found.st_ino, found.st_ctime_ns))
        replacement = path + ".new"
        open(replacement, "w").close()
        os.rename(replacement, path)  # both existed at once: another inode
        self.assertNotEqual(socket_file(path), before)
        self.assertIsNone(socket_file(path + ".missing"))


class ListingTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()
        self.store = stored("s-old", "s-kept")
        self.store.put_container("c-kept", "s-kept", ContainerHookRequest(), ContainerHookRequest())

    def listed(self) -> Any:
        listing = NRIListing(self.reactor, SOCKET, IDENTITY, self.store)
        return ensureDeferred(listing.listed(QUESTION_SECONDS))

    def containerd(self) -> FakeContainerd:
        address, factory, _, _ = self.reactor.unixClients[-1]
        self.assertEqual(address, SOCKET)
        return FakeContainerd(factory.buildProtocol(None))

    def test_it_registers_takes_the_synchronization_in_parts_refuses_it_and_leaves(self) -> None:
        listed = self.listed()
        containerd = self.containerd()
        [registration] = containerd.sent()
        assert registration.request is not None
        self.assertEqual((registration.connection, registration.request.method), (RUNTIME_SERVICE_CONNECTION, "RegisterPlugin"))
        request = nri.RegisterPluginRequest.FromString(registration.request.payload)
        self.assertEqual((request.plugin_name, request.plugin_idx), ("koordrp-listing", "10"))
        containerd.answer(registration.stream_id, nri.Empty())
        configured = containerd.call("Configure", nri.ConfigureRequest(runtime_name="containerd", runtime_version="2.1.9"))
        self.assertEqual(containerd.answers()[configured].status.code, 0)
        first = containerd.call("Synchronize", nri.SynchronizeRequest(pods=[nri_pod(sandbox_id="s-kept")], more=True))
        self.assertEqual(nri.SynchronizeResponse.FromString(containerd.answers()[first].payload).more, True)
        self.assertNoResult(listed)
        last = containerd.call("Synchronize", nri.SynchronizeRequest(pods=[nri_pod(sandbox_id="s-new")]))
        refusal = containerd.answers()[last]
        self.assertEqual((refusal.status.code, refusal.status.message), (UNKNOWN, NOT_STAYING))
        pods, containers = self.successResultOf(listed)
        self.assertEqual((sorted(pods), containers), (["s-kept", "s-new"], ["c-kept"]))
        self.reactor.advance(LINGER_SECONDS - 0.1)
        self.assertFalse(containerd.transport.disconnecting)  # containerd reads the refusal first
        self.reactor.advance(0.1)
        self.assertTrue(containerd.transport.disconnecting)

    def test_a_refused_registration_or_connection_is_a_failed_reading(self) -> None:
        listed = self.listed()
        containerd = self.containerd()
        [registration] = containerd.sent()
        containerd.answer(registration.stream_id, code=3, error="plugin registration refused")
        self.assertIn("cannot register: plugin registration refused", str(self.failureResultOf(listed, LookupFailed).value))
        self.assertTrue(containerd.transport.disconnecting)
        listed = self.listed()
        _, factory, _, _ = self.reactor.unixClients[-1]
        factory.clientConnectionFailed(None, Failure(ConnectionRefusedError("no one listens")))
        self.assertIn("cannot connect", str(self.failureResultOf(listed, LookupFailed).value))

    def test_a_synchronization_that_does_not_come_is_given_up_and_its_connection_closed(self) -> None:
        listed = self.listed()
        containerd = self.containerd()
        [registration] = containerd.sent()
        containerd.answer(registration.stream_id, nri.Empty())
        self.reactor.advance(QUESTION_SECONDS)
        self.assertIn("did not synchronize the listing within 30s", str(self.failureResultOf(listed, LookupFailed).value))
        self.assertTrue(containerd.transport.disconnecting)

    def test_cancelling_the_reading_closes_its_connection(self) -> None:
        listed = self.listed()
        containerd = self.containerd()
        listed.cancel()
        self.failureResultOf(listed)
        self.assertTrue(containerd.transport.disconnecting)


class NRIStack(SynchronousTestCase):
    """koordrp's NRI plugin on a memory reactor, and its listing service once asked for."""

    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()
        self.store = self.made_store()
        parts = Parts(self.store, ScriptedStages(), HookServers, SKIP, self.reactor, None)
        self.socket = self.mktemp()
        open(self.socket, "w").close()  # containerd's socket, as a file to tell containerds apart by
        self.plugin = NRIService(NRISettings(self.socket, IDENTITY), self.reactor, parts)
        self.plugin.startService()
        self.addCleanup(self.plugin.stopService)

    def made_store(self) -> Store:
        return Store()

    def plugin_synchronized(self, *sandbox_ids: str, containers: tuple[nri.Container, ...] = ()) -> FakeContainerd:
        _, factory, _, _ = self.reactor.unixClients[-1]
        containerd = FakeContainerd(factory.buildProtocol(None))
        containerd.call("Configure", nri.ConfigureRequest(runtime_name="containerd", runtime_version="2.1.9"))
        pods = [nri_pod(sandbox_id=i) for i in sandbox_ids]
        containerd.call("Synchronize", nri.SynchronizeRequest(pods=pods, containers=containers))
        return containerd

    def listing(self) -> NRIListingService:
        listing = NRIListingService(self.reactor, self.socket, IDENTITY, self.store, self.plugin.going_untold, interval=60)
        listing.startService()
        self.addCleanup(listing.stopService)
        return listing


class ServiceTests(NRIStack):
    """The plugin's connection says what is told; the listing service forgets what containerd no longer has."""

    def test_an_untold_pod_may_go_only_once_none_of_its_containers_is_created_or_running(self) -> None:
        running = nri_container(nri.CONTAINER_RUNNING)  # c-1 in s-1
        containerd = self.plugin_synchronized("s-1", "s-empty", containers=(running,))
        self.assertEqual(self.plugin.going_untold(), {"s-empty"})
        containerd.call("StopContainer", nri.StopContainerRequest(pod=nri_pod(), container=running))
        self.assertEqual(self.plugin.going_untold(), {"s-1", "s-empty"})

    def test_pods_of_a_synchronization_are_untold_those_heard_run_are_told_until_containerd_restarts(self) -> None:
        self.assertEqual(self.plugin.going_untold(), set())  # not its plugin yet: its Synchronize will tell
        containerd = self.plugin_synchronized("s-before")
        self.assertEqual(self.plugin.going_untold(), {"s-before"})
        run = event(nri.RUN_POD_SANDBOX)
        run.pod.CopyFrom(nri_pod(sandbox_id="s-run"))
        containerd.call("StateChange", run)
        self.assertEqual(self.plugin.going_untold(), {"s-before"})
        # containerd restarts: a new socket file, and the pod it ran before is untold too.
        replacement = self.socket + ".new"
        open(replacement, "w").close()
        os.rename(replacement, self.socket)
        containerd.protocol.connectionLost(Failure(ConnectionRefusedError("containerd restarted")))
        self.reactor.advance(60)
        self.plugin_synchronized("s-before", "s-run")
        self.assertEqual(self.plugin.going_untold(), {"s-before", "s-run"})

    def test_nothing_is_asked_before_koordrp_is_containerds_plugin_nor_while_every_pod_is_told(self) -> None:
        self.listing()
        self.reactor.advance(60)
        containerd = self.plugin_synchronized()
        run = event(nri.RUN_POD_SANDBOX)
        run.pod.CopyFrom(nri_pod(sandbox_id="s-run"))
        containerd.call("StateChange", run)
        self.reactor.advance(60)
        self.assertEqual(len(self.reactor.unixClients), 1)  # the plugin's own
        self.assertEqual(self.store.ids()[0], {"s-run"})

    def test_the_listing_forgets_an_untold_pod_containerd_no_longer_has(self) -> None:
        self.plugin_synchronized("s-gone", "s-kept")
        self.listing()
        # One at start, one an interval later: a listing forgets only what was known before the previous one began.
        for reading in range(2):
            self.assertEqual(len(self.reactor.unixClients), 2 + reading)
            address, factory, _, _ = self.reactor.unixClients[-1]
            self.assertEqual(address, self.socket)
            containerd = FakeContainerd(factory.buildProtocol(None))
            containerd.call("Configure", nri.ConfigureRequest())
            containerd.call("Synchronize", nri.SynchronizeRequest(pods=[nri_pod(sandbox_id="s-kept")]))
            self.reactor.advance(LINGER_SECONDS)
            self.assertTrue(containerd.transport.disconnecting)
            self.reactor.advance(60 - LINGER_SECONDS)
        self.assertEqual(self.store.ids()[0], {"s-kept"})
        self.assertEqual(self.plugin.going_untold(), {"s-kept"})  # listed again each interval, until it goes


class LeftByAKillTests(NRIStack):
    """What a koordrp killed before containerd refused a create left in the state directory."""

    def made_store(self) -> Store:
        self.state = self.mktemp()
        Store(opened_checkpoint(self.state)).expect_container("s-1", ContainerHookRequest(), None, made_id="never-made")
        return Store(opened_checkpoint(self.state))

    def test_a_file_kept_for_a_container_containerd_never_made_has_a_listing_let_it_go(self) -> None:
        self.plugin_synchronized("s-1")  # the first reading: the file may be for a create still under way
        self.store.put_container("c-1", "s-1", ContainerHookRequest(), ContainerHookRequest())  # s-1 stays told of
        self.listing()
        self.assertEqual(len(self.reactor.unixClients), 2)  # no pod goes untold, and a listing is due all the same
        _, factory, _, _ = self.reactor.unixClients[-1]
        containerd = FakeContainerd(factory.buildProtocol(None))
        containerd.call("Configure", nri.ConfigureRequest())
        containerd.call("Synchronize", nri.SynchronizeRequest(pods=[nri_pod(sandbox_id="s-1")]))
        self.assertEqual(os.listdir(os.path.join(self.state, "containers")), ["c-1"])
        self.assertFalse(self.store.awaits_a_reading())
