"""Keeping the store in agreement with the runtime (koordrp.resync.StoreSync), on a Clock: when it reads,
what it forgets and learns, what it asks the runtime, and what it logs."""

import os

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.logger import LogEvent
from twisted.trial.unittest import SynchronousTestCase

from koordrp import adapters
from koordrp.checkpoint import DirectoryCheckpoint
from koordrp.hooks.messages import ContainerHookRequest, PodHookRequest
from koordrp.resync import StoreSync
from koordrp.trouble import RETRY_SECONDS
from koordrp.store import ContainerState, Store, StoredContainer, StoredPod
from tests.fake.flows import RecordingRuntime
from tests.support.logs import logged_events

INTERVAL = 5.0


def pod(name: str) -> PodHookRequest:
    request = PodHookRequest(cgroup_parent=f"/{name}")
    request.pod_meta.name = name
    return request


class HeldRuntime(RecordingRuntime):
    """A runtime whose listings wait, while ``held``, for the test to fire them (``listings``)."""

    def __init__(self) -> None:
        super().__init__()
        self.held = False
        self.listings: list[Deferred[None]] = []
        self.listed_times = 0

    async def listed(self, timeout: float | None) -> tuple[list[str], list[str]]:
        self.listed_times += 1
        if self.held:
            waiting: Deferred[None] = Deferred()
            self.listings.append(waiting)
            await waiting
        return await super().listed(timeout)

    def add(self, sandbox_id: str, *container_ids: str) -> None:
        self.pods[sandbox_id] = pod(sandbox_id)
        for container_id in container_ids:
            self.containers[container_id] = StoredContainer.read_back(
                sandbox_id, ContainerHookRequest(), ContainerState.RUNNING
            )

    def remove(self, sandbox_id: str) -> None:
        """Gone behind koordrp's back (crictl rmp on containerd itself)."""
        del self.pods[sandbox_id]
        for container_id in [cid for cid, stored in self.containers.items() if stored.sandbox_id == sandbox_id]:
            del self.containers[container_id]


def opened_checkpoint(directory: str) -> DirectoryCheckpoint:
    checkpoint = DirectoryCheckpoint(directory)
    checkpoint.open()
    return checkpoint


class ListingOnly:
    """The runtime's listing, and nothing that reads back (``adapters.RuntimeListing``)."""

    def __init__(self, runtime: HeldRuntime) -> None:
        self.listed = runtime.listed


class StoreSyncTestCase(SynchronousTestCase):
    learns = True

    def setUp(self) -> None:
        self.clock = Clock()
        self.store = Store()
        self.runtime = HeldRuntime()
        inventory = self.runtime if self.learns else ListingOnly(self.runtime)
        self.due = True
        self.sync = StoreSync(self.store, inventory, self.clock, "the runtime", INTERVAL, due=lambda: self.due)
        self.addCleanup(self.sync.stop)
        self.events = logged_events(self)

    def lines(self, start: str) -> list[LogEvent]:
        return [event for event in self.events if event.get("log_format", "").startswith(start)]

    def put(self, sandbox_id: str, *container_ids: str) -> None:
        """What a call through koordrp does: the runtime has it, and so has the store."""
        self.runtime.add(sandbox_id, *container_ids)
        self.store.put_pod(sandbox_id, pod(sandbox_id), pod(sandbox_id))
        for container_id in container_ids:
            self.store.put_container(container_id, sandbox_id, ContainerHookRequest(), ContainerHookRequest())


class PeriodicTests(StoreSyncTestCase):
    def test_the_runtime_is_read_at_start_and_every_interval(self) -> None:
        self.sync.start()
        self.assertEqual(self.runtime.listed_times, 1)
        self.clock.advance(INTERVAL - 0.1)
        self.assertEqual(self.runtime.listed_times, 1)
        self.clock.advance(0.1)
        self.clock.advance(INTERVAL)
        self.assertEqual(self.runtime.listed_times, 3)
        self.assertEqual(len(self.clock.getDelayedCalls()), 1)

    def test_what_is_removed_behind_koordrps_back_is_forgotten_with_one_line(self) -> None:
        for index in range(5):
            self.put(f"pod-{index}", f"container-{index}")
        self.sync.start()
        self.clock.advance(INTERVAL)
        self.assertEqual(self.store.sizes(), (5, 5))
        for index in range(3):
            self.runtime.remove(f"pod-{index}")
        self.clock.advance(INTERVAL)
        self.assertEqual(self.store.sizes(), (2, 2))
        self.clock.advance(INTERVAL * 3)
        told = [(line["done"], line["forgotten"], line["pods"], line["containers"]) for line in self.lines("store {done}")]
        self.assertEqual(told, [("rebuilt from", 0, 5, 5), ("reconciled with", 6, 2, 2)])

    def test_a_reading_that_changes_nothing_says_nothing_and_asks_only_for_the_listing(self) -> None:
        self.put("kept", "kept-c")
        self.sync.start()
        self.runtime.read_back.clear()
        for _ in range(10):
            self.clock.advance(INTERVAL)
        self.assertEqual(self.runtime.read_back, [])
        self.assertEqual([line["done"] for line in self.lines("store {done}")], ["rebuilt from"])

    def test_what_appears_behind_koordrps_back_is_read_once_and_learnt(self) -> None:
        self.put("known")
        self.sync.start()
        self.runtime.add("appeared", "appeared-c")
        self.runtime.add("known")
        self.runtime.containers["new-in-known"] = StoredContainer.read_back(
            "known", ContainerHookRequest(), ContainerState.CREATED
        )
        self.runtime.read_back.clear()
        self.clock.advance(INTERVAL)
        self.assertEqual(sorted(self.runtime.read_back), ["appeared", "appeared-c", "new-in-known"])
        self.assertEqual(self.store.sizes(), (2, 2))
        stored = self.store.container("new-in-known")
        assert stored is not None
        self.assertEqual(stored.given.pod_cgroup_parent, "/known")  # placed in its pod as the store has it
        self.runtime.read_back.clear()
        self.clock.advance(INTERVAL)
        self.assertEqual(self.runtime.read_back, [])

    def test_a_pod_removed_right_after_a_call_made_it_is_forgotten_at_the_next_reading(self) -> None:
        """The proxies hear of a pod only once the runtime lists it."""
        self.sync.start()
        self.put("short-lived")
        self.runtime.remove("short-lived")
        self.clock.advance(INTERVAL)
        self.assertFalse(self.store.has_pod("short-lived"))

    def test_a_call_in_flight_keeps_what_it_creates(self) -> None:
        self.put("old")
        self.sync.start()
        self.clock.advance(INTERVAL)
        self.runtime.held = True
        self.clock.advance(INTERVAL)  # a reading begins, and waits for the runtime's listing
        self.runtime.remove("old")
        self.store.put_pod("created-meanwhile", pod("new"), pod("new"))  # the listing may have missed it
        self.runtime.listings.pop().callback(None)
        self.assertEqual((self.store.has_pod("old"), self.store.has_pod("created-meanwhile")), (False, True))

    def test_an_answer_that_cannot_be_read_is_told_once_and_not_asked_again(self) -> None:
        class HalfReadable(HeldRuntime):
            async def read_pod(self, sandbox_id: str, timeout: float | None) -> StoredPod | None:
                self.read_back.append(sandbox_id)
                raise adapters.Unreadable("verbose info is not JSON")

        self.runtime = HalfReadable()
        self.runtime.add("odd")
        self.sync = StoreSync(self.store, self.runtime, self.clock, "the runtime", INTERVAL)
        self.addCleanup(self.sync.stop)
        self.sync.start()
        for _ in range(5):
            self.clock.advance(INTERVAL)
        self.assertEqual((self.runtime.read_back, len(self.lines("{kind} {id} cannot be read"))), (["odd"], 1))

    def test_told_to_read_while_reading_it_reads_once_and_keeps_its_pace(self) -> None:
        self.runtime.held = True
        self.sync.start()
        self.sync.sync()  # the runtime is back: a reading under way stands for it
        self.assertEqual(self.runtime.listed_times, 1)
        self.runtime.listings.pop().callback(None)
        self.assertEqual([call.getTime() for call in self.clock.getDelayedCalls()], [INTERVAL])

    def test_told_to_read_it_reads_at_once_and_the_next_reading_is_an_interval_later(self) -> None:
        self.sync.start()
        self.clock.advance(INTERVAL / 2)
        self.sync.sync()
        self.assertEqual(self.runtime.listed_times, 2)
        self.assertEqual([call.getTime() for call in self.clock.getDelayedCalls()], [INTERVAL / 2 + INTERVAL])

    def test_stopping_ends_the_readings(self) -> None:
        self.runtime.held = True
        self.sync.start()
        self.sync.stop()
        self.assertTrue(self.runtime.listings[0].called)  # cancelled
        self.assertEqual(self.clock.getDelayedCalls(), [])


class FailureTests(StoreSyncTestCase):
    def test_failures_are_told_once_per_reason_and_retried_less_often_until_the_runtime_answers(self) -> None:
        self.runtime.broken = "GET /containers/json: no answer within 10s"
        self.sync.start()
        self.clock.advance(RETRY_SECONDS)
        self.assertEqual(self.runtime.listed_times, 2)
        self.runtime.broken = "GET /containers/json: connection refused"
        self.clock.advance(RETRY_SECONDS)
        self.assertEqual(self.runtime.listed_times, 2)  # the second wait is longer
        self.clock.advance(RETRY_SECONDS)
        self.assertEqual([event["problem"] for event in self.lines("cannot read")], [
            "GET /containers/json: no answer within 10s",
            "GET /containers/json: connection refused",
        ])
        self.runtime.broken = None
        self.clock.advance(4 * RETRY_SECONDS)
        self.assertEqual(self.runtime.listed_times, 4)
        self.assertEqual([line["done"] for line in self.lines("store {done}")], ["rebuilt from"])
        [over] = self.lines("read {runtime}'s pods and containers again")
        self.assertEqual((over["runtime"], over["failures"]), ("the runtime", 3))
        self.assertEqual([call.getTime() for call in self.clock.getDelayedCalls()], [7 * RETRY_SECONDS + INTERVAL])

    def test_without_an_interval_the_store_is_read_until_it_agrees_and_then_left(self) -> None:
        self.sync = StoreSync(self.store, self.runtime, self.clock, "the runtime")
        self.runtime.broken = "UNAVAILABLE"
        self.sync.start()
        self.runtime.broken = None
        self.clock.advance(RETRY_SECONDS)
        self.assertEqual((self.runtime.listed_times, self.clock.getDelayedCalls()), (2, []))

    def test_a_failing_periodic_reading_is_retried_and_its_end_told(self) -> None:
        self.put("gone")
        self.sync.start()
        self.clock.advance(INTERVAL)
        self.runtime.broken = "UNAVAILABLE"
        self.clock.advance(INTERVAL)
        self.runtime.remove("gone")
        self.runtime.broken = None
        self.clock.advance(RETRY_SECONDS)
        self.assertFalse(self.store.has_pod("gone"))
        self.assertEqual([line["done"] for line in self.lines("store {done}")], ["rebuilt from", "rebuilt from"])


    def test_a_failure_in_agreeing_with_a_reading_is_said_and_retried(self) -> None:
        def broken(*args: object) -> tuple[int, int]:
            raise OSError(30, "Read-only file system")

        self.patch(self.store, "reconcile", broken)
        self.sync.start()
        self.assertEqual(len(self.flushLoggedErrors(OSError)), 1)
        self.assertEqual([event["problem"] for event in self.lines("cannot read")], ["OSError: [Errno 30] Read-only file system"])
        self.assertEqual([call.getTime() for call in self.clock.getDelayedCalls()], [RETRY_SECONDS])


class ForgetOnlyTests(StoreSyncTestCase):
    """NRI mode: a listing says what is gone; what appears, NRI tells of."""

    learns = False

    def test_it_forgets_by_the_listing_and_reads_nothing_back(self) -> None:
        self.put("kept")
        self.put("gone", "gone-c")
        self.runtime.add("only-in-the-runtime", "its-container")
        self.sync.start()
        self.clock.advance(INTERVAL)
        self.runtime.remove("gone")
        self.clock.advance(INTERVAL)
        self.assertEqual((self.runtime.read_back, self.store.sizes()), ([], (1, 0)))
        [line] = self.lines("store {done}")
        self.assertEqual((line["done"], line["forgotten"]), ("reconciled with", 2))

    def test_what_a_killed_koordrp_kept_for_a_container_containerd_never_made_goes_after_two_listings(self) -> None:
        """Killed after it kept what kubelet asked under the container's id, before containerd refused the create:
        the next koordrp's listings let the file go, two readings after, as a proxy's readings do."""
        directory = self.mktemp()
        Store(opened_checkpoint(directory)).expect_container("p1", ContainerHookRequest(), None, made_id="never-made")
        sync = StoreSync(Store(opened_checkpoint(directory)), ListingOnly(self.runtime), self.clock, "the runtime", INTERVAL)
        self.addCleanup(sync.stop)
        sync.start()
        self.assertEqual(os.listdir(os.path.join(directory, "containers")), ["never-made"])  # it may be under way yet
        self.clock.advance(INTERVAL)
        self.assertEqual(os.listdir(os.path.join(directory, "containers")), [])

    def test_a_pod_younger_than_the_previous_reading_is_not_taken_for_gone(self) -> None:
        """NRI tells of a pod sandbox just before containerd lists it: it must survive a listing without it."""
        self.sync.start()
        self.store.put_pod("told-first", pod("told-first"), pod("told-first"))  # containerd lists it a moment later
        self.clock.advance(INTERVAL)
        self.assertTrue(self.store.has_pod("told-first"))
        self.clock.advance(INTERVAL)  # known before the previous reading began, and still not listed: gone
        self.assertFalse(self.store.has_pod("told-first"))

    def test_while_no_reading_is_due_nothing_is_asked_and_the_pace_is_kept(self) -> None:
        """NRI mode asks only while some pod goes untold; what was known at a skipped reading counts as known before it."""
        self.due = False
        self.put("gone")
        self.sync.start()
        self.clock.advance(INTERVAL * 3)
        self.assertEqual((self.runtime.listed_times, len(self.clock.getDelayedCalls())), (0, 1))
        self.runtime.remove("gone")
        self.due = True
        self.clock.advance(INTERVAL)
        self.assertEqual((self.runtime.listed_times, self.store.sizes()), (1, (0, 0)))

    def test_its_trouble_is_told_when_it_starts_and_when_it_ends(self) -> None:
        self.runtime.broken = "UNAVAILABLE: no such socket"
        self.sync.start()
        self.runtime.broken = None
        self.clock.advance(RETRY_SECONDS)
        self.assertEqual(len(self.lines("cannot read")), 1)
        self.assertEqual(len(self.lines("read {runtime}'s pods and containers again")), 1)
        self.assertEqual(self.lines("store {done}"), [])
