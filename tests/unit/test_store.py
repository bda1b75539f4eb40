"""The store: copies in and out, forgetting pods with their containers, reconciling with the runtime."""

import os
import socket
from typing import Callable, cast

from twisted.logger import ILogObserver, LogEvent, LogLevel, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from koordrp.checkpoint import CheckpointError, DirectoryCheckpoint, Kind, Parsed
from koordrp.hooks.messages import ContainerHookRequest, PodHookRequest, Resources, copied
from koordrp.store import ContainerState, OwedStops, Store, StoredContainer, StoredPod
from tests.support.logs import logged_events
from tests.unit.test_checkpoint import FifoWriter


def pod(name: str) -> PodHookRequest:
    request = PodHookRequest()
    request.pod_meta.name = name
    return request


def container(name: str) -> ContainerHookRequest:
    request = ContainerHookRequest()
    request.container_meta.name = name
    return request


def given(stored: StoredPod | None) -> PodHookRequest | None:
    return None if stored is None else stored.given


class StoreTests(SynchronousTestCase):
    def test_what_goes_in_is_a_copy_and_an_entry_read_is_replaced_not_changed(self) -> None:
        store = Store()
        original = pod("a")
        store.put_pod("p1", original, original)
        original.pod_meta.name = "changed by the caller"
        read = store.pod("p1")
        self.assertEqual(read, StoredPod(pod("a"), pod("a")))
        store.resize_pod("p1", Resources(cpu_shares=2), None)
        self.assertEqual(read, StoredPod(pod("a"), pod("a")))  # what a call read stays as it read it

    def test_forgetting_a_pod_forgets_its_containers(self) -> None:
        store = Store()
        store.put_pod("p1", pod("a"), pod("a"))
        store.put_pod("p2", pod("b"), pod("b"))
        store.put_container("c1", "p1", container("x"), container("x"))
        store.put_container("c2", "p2", container("y"), container("y"))
        store.forget_pod("p1")
        self.assertIsNone(store.container("c1"))
        self.assertEqual(store.sizes(), (1, 1))

    def test_learn_keeps_what_calls_wrote(self) -> None:
        store = Store()
        store.put_pod("p1", pod("from a call"), pod("from a call"))
        store.learn([("p1", StoredPod.read_back(pod("from the runtime"), False)), ("p2", StoredPod.read_back(pod("new"), False))], [])
        self.assertEqual(given(store.pod("p1")), pod("from a call"))
        self.assertEqual(given(store.pod("p2")), pod("new"))

    def test_reconcile_forgets_what_went_and_learns_what_came(self) -> None:
        store = Store()
        store.put_pod("gone", pod("gone"), pod("gone"))
        store.put_pod("kept", pod("kept"), pod("kept"))
        store.put_container("gone-c", "gone", container("gone"), container("gone"))
        before = store.ids()
        store.put_pod("created-during-listing", pod("new"), pod("new"))
        forgotten, learnt = store.reconcile(
            ({"kept", "appeared"}, {"appeared-c"}),
            [("kept", StoredPod.read_back(pod("kept, as the runtime says"), False)), ("appeared", StoredPod.read_back(pod("appeared"), False))],
            [("appeared-c", StoredContainer.read_back("appeared", container("c"), ContainerState.CREATED))],
            before,
        )
        self.assertEqual((forgotten, learnt), (2, 2))
        self.assertIsNone(store.pod("gone"))
        self.assertIsNone(store.container("gone-c"))
        self.assertEqual(given(store.pod("kept")), pod("kept"))
        self.assertEqual(given(store.pod("created-during-listing")), pod("new"))
        self.assertEqual(given(store.pod("appeared")), pod("appeared"))

    def test_what_is_listed_but_not_read_back_is_kept_and_not_learnt(self) -> None:
        store = Store()
        store.put_pod("known", pod("known"), pod("known"))
        forgotten, learnt = store.reconcile(({"known", "unread"}, set()), [], [], store.ids())
        self.assertEqual((forgotten, learnt, store.sizes()), (0, 0, (1, 0)))

    def test_a_container_starts_and_stops_once_until_it_starts_again(self) -> None:
        store = Store()
        store.put_container("c1", "p1", container("x"), container("x"))
        self.assertEqual((store.started("c1"), store.started("c1")), (True, False))
        self.assertEqual((store.stopped("c1"), store.stopped("c1")), (True, False))
        self.assertEqual((store.started("c1"), store.stopped("c1")), (True, True))
        self.assertEqual((store.started("unknown"), store.stopped("unknown")), (False, False))

    def test_a_stopped_pod_stops_its_containers_once(self) -> None:
        store = Store()
        store.put_pod("p1", pod("a"), pod("a"))
        for name in ("c1", "c2", "c3"):
            store.put_container(name, "p1", container(name), container(name))
        store.put_container("other", "p2", container("other"), container("other"))
        store.started("c1")
        store.stopped("c2")
        newly, containers = store.pod_stopped("p1")
        self.assertTrue(newly)
        self.assertEqual([stored.asked.container_meta.name for stored in containers], ["c1", "c3"])
        self.assertEqual(store.pod_stopped("p1"), (False, []))
        self.assertEqual(store.container("other").state, ContainerState.CREATED)  # type: ignore[union-attr]

    def test_a_revision_keeps_the_state_and_what_was_forgotten_stays_forgotten(self) -> None:
        store = Store()
        store.put_container("c1", "p1", container("x"), container("x"))
        store.started("c1")
        store.revise_container("c1", container("y"), container("y, given"))
        self.assertEqual(store.container("c1"), StoredContainer("p1", container("y"), container("y, given"), ContainerState.RUNNING))
        store.forget_container("c1")
        store.revise_container("c1", container("z"), container("z"))
        self.assertIsNone(store.container("c1"))


class CheckpointTests(SynchronousTestCase):
    """What kubelet asked, where hooks changed it, survives koordrp's restart; nothing else is written."""

    def setUp(self) -> None:
        self.directory = self.mktemp()

    def opened(self) -> DirectoryCheckpoint:
        checkpoint = DirectoryCheckpoint(self.directory)
        checkpoint.open()
        return checkpoint

    def files(self, kind: str) -> list[str]:
        return sorted(os.listdir(os.path.join(self.directory, kind)))

    def test_kubelets_values_come_back_after_a_restart_beside_what_the_runtime_has(self) -> None:
        store = Store(self.opened())
        store.put_pod("p1", pod("asked"), pod("given"))
        store.put_container("c1", "p1", container("asked"), container("given"))
        store.put_container("c2", "p1", container("same"), container("same"))
        self.assertEqual((self.files("pods"), self.files("containers")), (["p1"], ["c1", "c2"]))
        mode = os.stat(self.directory).st_mode & 0o777
        self.assertEqual((mode, os.stat(os.path.join(self.directory, "containers", "c1")).st_mode & 0o777), (0o700, 0o600))

        restarted = Store(self.opened())
        restarted.reconcile(
            ({"p1"}, {"c1", "c2"}),
            [("p1", StoredPod.read_back(pod("given"), False))],
            [
                ("c1", StoredContainer.read_back("p1", container("given"), ContainerState.RUNNING)),
                ("c2", StoredContainer.read_back("p1", container("same"), ContainerState.RUNNING)),
            ],
            restarted.ids(),
        )
        self.assertEqual(restarted.pod("p1"), StoredPod(pod("asked"), pod("given")))
        self.assertEqual(
            restarted.container("c1"), StoredContainer("p1", container("asked"), container("given"), ContainerState.RUNNING)
        )
        self.assertEqual(restarted.container("c2"), StoredContainer("p1", container("same"), container("same"), ContainerState.RUNNING))

    def test_what_koordrp_saw_made_is_kept_until_it_is_forgotten(self) -> None:
        store = Store(self.opened())
        store.put_pod("p1", pod("asked"), pod("given"))
        store.put_container("c1", "p1", container("asked"), container("given"))
        store.put_container("c2", "p1", container("asked"), container("given"))
        store.revise_container("c1", container("now the same"), container("now the same"))
        self.assertEqual(self.files("containers"), ["c1", "c2"])
        store.forget_pod("p1")
        self.assertEqual((self.files("pods"), self.files("containers")), ([], []))

    def test_a_file_that_cannot_be_written_or_removed_is_one_warning_and_nothing_is_left_half_done(self) -> None:
        events = logged_events(self)
        store = Store(self.opened())
        store.put_container("c1", "p1", container("asked"), container("given"))
        # Something in the way of both (a directory where the file goes): the rename and the removal fail.
        blocked = os.path.join(self.directory, "containers", "c2")
        os.makedirs(os.path.join(blocked, "in-the-way"))
        store.put_container("c2", "p1", container("asked"), container("given"))
        store.put_container("c2", "p1", container("asked again"), container("given"))
        self.assertEqual(self.files("containers"), ["c1", "c2"])  # no .c2.new left behind
        os.unlink(os.path.join(self.directory, "containers", "c1"))
        os.makedirs(os.path.join(self.directory, "containers", "c1", "in-the-way"))
        store.forget_container("c1")  # the runtime removed it: koordrp forgets it all the same
        self.assertIsNone(store.container("c1"))
        warnings = [event["log_format"] for event in events if event.get("log_level") is LogLevel.warn]
        self.assertEqual(len(warnings), 2, warnings)
        self.assertTrue(warnings[0].startswith("cannot write {path}: "))
        self.assertTrue(warnings[1].startswith("cannot remove what was kept"))

    def test_what_was_kept_for_things_removed_while_koordrp_was_away_goes(self) -> None:
        Store(self.opened()).put_container("gone", "p1", container("asked"), container("given"))
        restarted = Store(self.opened())
        restarted.reconcile((set(), set()), [], [], restarted.ids())
        self.assertEqual(self.files("containers"), [])

    def test_what_was_kept_for_what_the_runtime_lists_stays_until_it_is_learnt(self) -> None:
        """NRI mode's listing runs before containerd's synchronization has told the store anything."""
        Store(self.opened()).put_container("c1", "p1", container("asked"), container("given"))
        restarted = Store(self.opened())
        restarted.reconcile((set(), {"c1"}), [], [], restarted.ids())
        self.assertEqual(self.files("containers"), ["c1"])
        restarted.learn([], [("c1", StoredContainer.read_back("p1", container("given"), ContainerState.RUNNING))])
        self.assertEqual(restarted.container("c1").asked, container("asked"))  # type: ignore[union-attr]

    def test_a_file_that_cannot_be_read_leaves_what_the_runtime_has_and_says_so_once(self) -> None:
        self.opened()
        path = os.path.join(self.directory, "containers", "c1")
        with open(path, "wb") as garbage:
            garbage.write(b"\xff\xff\xff")
        store = Store(self.opened())
        events = self.observed()
        store.learn([], [("c1", StoredContainer.read_back("p1", container("given"), ContainerState.RUNNING))])
        stored = store.container("c1")
        assert stored is not None
        self.assertEqual((stored.asked, stored.asked_lost), (container("given"), True))
        [warning] = events
        self.assertIn(path, warning["error"])
        self.assertEqual((warning["kind"], warning["id"]), ("container", "c1"))
        self.assertEqual(store.unreadable_state_files, 1)
        store.learn([], [("c1", StoredContainer.read_back("p1", container("given"), ContainerState.RUNNING))])
        self.assertEqual((len(events), store.unreadable_state_files), (1, 1))

    def test_what_parses_but_koordrp_did_not_write_for_that_entry_cannot_be_read(self) -> None:
        written = Store(self.opened())
        elsewhere = container("asked")
        elsewhere.pod_meta.uid = "uid-other"
        written.put_container("c-other", "p1", elsewhere, container("given"))
        written.put_pod("p1", pod("asked"), pod("given"))
        with open(os.path.join(self.directory, "pods", "p1"), "ab") as extended:
            extended.write(b"\xf8\x07\x01")  # field 127, which no hook request has
        os.rename(os.path.join(self.directory, "containers", "c-other"), os.path.join(self.directory, "containers", "c1"))
        restarted = Store(self.opened())
        events = self.observed()
        restarted.learn(
            [("p1", StoredPod.read_back(pod("given"), False))],
            [("c1", StoredContainer.read_back("p1", container("given"), ContainerState.RUNNING))],
        )
        self.assertEqual([event["kind"] for event in events], ["pod", "container"])
        self.assertIn("not a PodSandboxHookRequest as koordrp writes it", events[0]["error"])
        self.assertIn("about pod uid 'uid-other', not ''", events[1]["error"])

    def test_a_file_that_cannot_be_opened_cannot_be_read(self) -> None:
        self.opened()
        os.mkdir(os.path.join(self.directory, "pods", "p1"))
        store = Store(self.opened())
        events = self.observed()
        store.learn([("p1", StoredPod.read_back(pod("given"), False))], [])
        self.assertIn("Is a directory", events[0]["error"])
        self.assertTrue(store.pod("p1").asked_lost)  # type: ignore[union-attr]

    def test_a_fifo_or_socket_kept_as_a_state_file_is_one_warning_naming_it_and_never_waited_for(self) -> None:
        # A FIFO's open would wait for a writer: on the reactor, every call and /livez with it.
        self.opened()
        fifo = os.path.join(self.directory, "pods", "p1")
        os.mkfifo(fifo)
        FifoWriter(self, fifo)  # a read that waited would end, and fail this test, rather than hang it
        listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.addCleanup(listening.close)
        listening.bind(os.path.join(self.directory, "containers", "c1"))
        store = Store(self.opened())
        events = self.observed()
        store.learn(
            [("p1", StoredPod.read_back(pod("given"), False))],
            [("c1", StoredContainer.read_back("p1", container("given"), ContainerState.RUNNING))],
        )
        self.assertEqual(
            [(event["kind"], event["error"]) for event in events],
            [
                ("pod", f"{fifo}: is a FIFO, not a regular file"),
                ("container", f"{os.path.join(self.directory, 'containers', 'c1')}: is a socket, not a regular file"),
            ],
        )
        self.assertEqual((store.pod("p1").asked_lost, store.unreadable_state_files), (True, 2))  # type: ignore[union-attr]
        store.learn([("p1", StoredPod.read_back(pod("given"), False))], [])
        self.assertEqual(len(events), 2)

    def test_the_state_files_are_counted(self) -> None:
        store = Store(self.opened())
        store.put_pod("p1", pod("asked"), pod("given"))
        store.put_container("c1", "p1", container("asked"), container("given"))
        store.put_container("c2", "p1", container("same"), container("same"))
        self.assertEqual(store.state_files(), 3)
        store.forget_pod("p1")
        self.assertEqual((store.state_files(), Store().state_files()), (0, 0))

    def observed(self) -> list[LogEvent]:
        """The warnings about state files from now on."""
        events: list[LogEvent] = []

        def observe(event: LogEvent) -> None:
            if "cannot read what kubelet asked" in event.get("log_format", ""):
                events.append(event)

        observer = cast(ILogObserver, observe)
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        return events

    def test_a_resync_reads_nothing_kept_for_what_the_store_has(self) -> None:
        reads: list[str] = []

        class Counting(DirectoryCheckpoint):
            def read(self, kind: Kind, identifier: str, parse: Callable[[bytes], Parsed]) -> Parsed | None:
                reads.append(identifier)
                return super().read(kind, identifier, parse)

        checkpoint = Counting(self.directory)
        checkpoint.open()
        store = Store(checkpoint)
        store.put_container("c1", "p1", container("asked"), container("given"))
        store.learn([], [])  # the first reading looks once at every file, for an earlier koordrp's
        reads.clear()
        listed = [(cid, StoredContainer.read_back("p1", container("given"), ContainerState.RUNNING)) for cid in ("c1", "c2")]
        store.reconcile((set(), {"c1", "c2"}), [], listed, store.ids())
        self.assertEqual(reads[0], "c2")
        self.assertNotIn("c1", reads)
        self.assertEqual(store.container("c1").asked, container("asked"))  # type: ignore[union-attr]

    def test_a_directory_others_may_write_is_refused(self) -> None:
        os.makedirs(self.directory)
        os.chmod(self.directory, 0o777)
        self.assertRaises(CheckpointError, DirectoryCheckpoint(self.directory).open)

    def test_ids_that_are_no_file_names_are_not_kept(self) -> None:
        checkpoint = self.opened()
        checkpoint.write("containers", "../escape", b"x")
        checkpoint.write("containers", "", b"x")
        self.assertEqual((self.files("containers"), sorted(os.listdir(self.directory))), ([], ["containers", "pending", "pods"]))


class AbsenceTests(SynchronousTestCase):
    """What koordrp keeps tells, after it was away, what it saw made, what it must still tell of, and what
    kubelet asked for what it was about to make when it was killed."""

    def setUp(self) -> None:
        self.directory = self.mktemp()
        self.owed: list[tuple[list[str], list[str]]] = []

    def restarted(self) -> Store:
        checkpoint = DirectoryCheckpoint(self.directory)
        checkpoint.open()

        def owed(stopped: OwedStops) -> None:
            self.owed.append(
                ([p.pod_meta.name for p in stopped.pods], [c.container_meta.name for c in stopped.containers])
            )

        return Store(checkpoint, owed)

    def test_what_koordrp_never_saw_made_is_not_hooked_and_owes_no_post_hook(self) -> None:
        store = self.restarted()
        store.put_pod("p1", pod("seen"), pod("seen"))
        store.learn(
            [("p2", StoredPod.read_back(pod("unseen"), False))],
            [("c1", StoredContainer.read_back("p2", container("unseen"), ContainerState.RUNNING))],
        )
        self.assertEqual((store.pod("p1").hooked, store.pod("p2").hooked), (True, False))  # type: ignore[union-attr]
        self.assertFalse(store.container("c1").hooked)  # type: ignore[union-attr]
        self.assertFalse(store.stopped("c1"))
        self.assertEqual(store.pod_stopped("p2"), (False, []))
        self.assertEqual(os.listdir(os.path.join(self.directory, "containers")), [])  # nothing kept: not seen after a restart

    def test_without_a_state_directory_everything_read_back_counts_as_seen(self) -> None:
        store = Store()
        store.learn([], [("c1", StoredContainer.read_back("p1", container("x"), ContainerState.RUNNING))])
        self.assertTrue(store.stopped("c1"))

    def test_a_pod_and_container_koordrp_was_killed_before_it_heard_were_made_keep_kubelets_values(self) -> None:
        store = self.restarted()
        asked_pod, asked_container = pod("web"), container("app")
        asked_pod.pod_meta.uid, asked_container.pod_meta.uid = "uid-1", "uid-1"
        asked_container.container_envs["FROM_KUBELET"] = "1"
        store.expect_pod(asked_pod)
        hooked = container("app")
        hooked.container_envs["FROM_A_HOOK"] = "1"
        store.expect_container("p1", asked_container, changed=hooked)
        # killed here: the runtime made both, with the hooks' changes
        given_pod, given_container = pod("web"), container("app")
        given_pod.pod_meta.uid, given_container.pod_meta.uid = "uid-1", "uid-1"
        given_container.container_envs["FROM_KUBELET"] = "1"
        given_container.container_envs["FROM_A_HOOK"] = "1"
        restarted = self.restarted()
        restarted.reconcile(
            ({"p1"}, {"c1"}),
            [("p1", StoredPod.read_back(given_pod, False))],
            [("c1", StoredContainer.read_back("p1", given_container, ContainerState.RUNNING))],
            restarted.ids(),
        )
        stored = restarted.container("c1")
        assert stored is not None
        self.assertEqual(dict(stored.asked.container_envs), {"FROM_KUBELET": "1"})
        self.assertEqual((stored.asked.container_meta.id, stored.hooked), ("c1", True))
        self.assertTrue(restarted.pod("p1").hooked)  # type: ignore[union-attr]
        # Kept under its id now, and nothing is left pending.
        self.assertEqual(
            (os.listdir(os.path.join(self.directory, "containers")), os.listdir(os.path.join(self.directory, "pending"))),
            (["c1"], []),
        )

    def test_a_container_made_without_the_hooks_answer_counts_as_made_while_koordrp_was_away(self) -> None:
        """NRI: containerd goes on without a plugin killed before its answer reached it."""
        asked, hooked = container("app"), container("app")
        asked.container_resources.cpu_shares, hooked.container_resources.cpu_shares = 102, 512
        self.restarted().expect_container("p1", asked, changed=hooked)
        restarted = self.restarted()
        restarted.learn([], [("c1", StoredContainer.read_back("p1", asked, ContainerState.RUNNING))])
        self.assertFalse(restarted.container("c1").hooked)  # type: ignore[union-attr]
        self.assertEqual(os.listdir(os.path.join(self.directory, "pending")), [])

    def test_what_was_about_to_be_made_and_never_was_goes_after_two_readings(self) -> None:
        store = self.restarted()
        store.expect_container("p1", container("never made"), changed=None)
        store.reconcile((set(), set()), [], [], store.ids())
        self.assertEqual(len(os.listdir(os.path.join(self.directory, "pending"))), 1)  # its call may still be under way
        store.reconcile((set(), set()), [], [], store.ids())
        self.assertEqual(os.listdir(os.path.join(self.directory, "pending")), [])

    def test_what_went_while_koordrp_was_away_owes_its_post_stops_once_with_kubelets_values(self) -> None:
        store = self.restarted()
        store.put_pod("p1", pod("running"), pod("running, given"))
        store.put_container("c1", "p1", container("running"), container("running, given"))
        store.put_pod("p2", pod("stopped"), pod("stopped"))
        store.put_container("c2", "p2", container("stopped"), container("stopped"))
        store.pod_stopped("p2")
        restarted = self.restarted()
        restarted.reconcile((set(), set()), [], [], restarted.ids())
        self.assertEqual(self.owed, [(["running"], ["running"])])
        restarted.reconcile((set(), set()), [], [], restarted.ids())
        self.assertEqual(len(self.owed), 1)

    def test_what_the_store_knew_and_is_gone_at_a_reading_owes_its_post_stops(self) -> None:
        store = self.restarted()
        store.put_pod("p1", pod("web"), pod("web"))
        store.put_container("c1", "p1", container("app"), container("app"))
        store.put_container("c2", "p1", container("done"), container("done"))
        store.stopped("c2")
        store.reconcile((set(), set()), [], [], store.ids())
        self.assertEqual(self.owed, [(["web"], ["app"])])

    def test_what_stopped_while_koordrp_was_away_owes_its_post_stop_once(self) -> None:
        store = self.restarted()
        store.put_container("c1", "p1", container("app"), container("app"))
        restarted = self.restarted()
        exited = [("c1", StoredContainer.read_back("p1", container("app"), ContainerState.STOPPED))]
        restarted.reconcile((set(), {"c1"}), [], exited, restarted.ids())
        self.assertEqual(self.owed, [([], ["app"])])
        again = self.restarted()
        again.reconcile((set(), {"c1"}), [], exited, again.ids())
        self.assertEqual(len(self.owed), 1)
        self.assertFalse(again.stopped("c1"))

    def test_what_was_kept_unreadably_for_something_gone_is_one_warning_and_no_post_stop(self) -> None:
        self.restarted()
        with open(os.path.join(self.directory, "containers", "c1"), "wb") as garbage:
            garbage.write(b"\xff\xff\xff")
        restarted = self.restarted()
        events = logged_events(self)
        restarted.reconcile((set(), set()), [], [], restarted.ids())
        [warning] = [event for event in events if event.get("log_level") is LogLevel.warn]
        self.assertEqual((warning["kind"], warning["id"]), ("container", "c1"))
        self.assertIn("its post stop cannot be told", warning["consequence"])
        self.assertEqual((self.owed, restarted.unreadable_state_files), ([], 1))
        self.assertEqual(os.listdir(os.path.join(self.directory, "containers")), [])

    def test_a_container_whose_hooks_changed_only_its_annotations_counts_as_seen_made(self) -> None:
        asked, hooked = container("app"), container("app")
        hooked.container_annotations["set-by"] = "a hook"  # the runtime shows the same resources and environment
        self.restarted().expect_container("p1", asked, changed=hooked)
        restarted = self.restarted()
        restarted.learn([], [("c1", StoredContainer.read_back("p1", asked, ContainerState.RUNNING))])
        self.assertTrue(restarted.container("c1").hooked)  # type: ignore[union-attr]

    def test_a_state_directory_of_an_earlier_koordrp_is_taken_over_without_a_stop_told_twice(self) -> None:
        """It kept a file only for what hooks changed, the request alone."""
        os.makedirs(os.path.join(self.directory, "containers"))
        with open(os.path.join(self.directory, "containers", "c1"), "wb") as earlier:
            earlier.write(container("asked").SerializeToString())
        store = self.restarted()
        store.learn(
            [],
            [
                ("c1", StoredContainer.read_back("p1", container("given"), ContainerState.STOPPED)),  # its stop was told
                ("c2", StoredContainer.read_back("p1", container("unchanged"), ContainerState.RUNNING)),  # no file
            ],
        )
        self.assertEqual(self.owed, [])
        self.assertEqual(store.container("c1").asked, container("asked"))  # type: ignore[union-attr]
        self.assertTrue(store.container("c2").hooked)  # type: ignore[union-attr]
        # Both kept as this koordrp keeps them: after its restart, nothing is taken for made while it was away.
        again = self.restarted()
        again.learn([], [("c2", StoredContainer.read_back("p1", container("unchanged"), ContainerState.RUNNING))])
        self.assertTrue(again.container("c2").hooked)  # type: ignore[union-attr]
        self.assertTrue(again.stopped("c2"))
        self.assertEqual(self.owed, [])


class KnownIdTests(SynchronousTestCase):
    """A front end that knows the id before the runtime makes it (NRI) has what kubelet asked kept under that id at
    once: no pending file, and what changes afterwards is its flags alone, changed in place."""

    def setUp(self) -> None:
        self.directory = self.mktemp()
        self.owed: list[OwedStops] = []
        self.writes: list[tuple[str, str]] = []

    def restarted(self) -> Store:
        writes = self.writes

        class Counting(DirectoryCheckpoint):
            def write(self, kind: Kind, identifier: str, data: bytes | None) -> bool:
                writes.append((kind, identifier))
                return super().write(kind, identifier, data)

        checkpoint = Counting(self.directory)
        checkpoint.open()
        return Store(checkpoint, self.owed.append)

    def kept(self, kind: str) -> list[str]:
        return sorted(os.listdir(os.path.join(self.directory, kind)))

    def inode(self, kind: str, identifier: str) -> int:
        return os.stat(os.path.join(self.directory, kind, identifier)).st_ino

    def test_what_kubelet_asked_is_kept_under_the_id_before_it_is_made_and_nothing_goes_pending(self) -> None:
        store = self.restarted()
        store.expect_pod(pod("web"), made_id="p1")
        store.expect_container("p1", container("app"), None, made_id="c1")
        self.assertEqual((self.kept("pods"), self.kept("containers"), self.kept("pending")), (["p1"], ["c1"], []))
        made = self.inode("containers", "c1")
        store.put_pod("p1", pod("web"), pod("web"))
        store.put_container("c1", "p1", container("app"), container("app"))
        self.assertEqual(self.writes, [("pods", "p1"), ("containers", "c1")])  # each file written once, whole
        self.assertEqual(self.inode("containers", "c1"), made)
        self.assertEqual(self.kept("pending"), [])
        # Seen made: a restart that finds it gone owes its post stop.
        restarted = self.restarted()
        restarted.reconcile((set(), set()), [], [], restarted.ids())
        self.assertEqual([(len(o.pods), len(o.containers)) for o in self.owed], [(1, 1)])

    def test_what_was_kept_under_its_id_when_koordrp_was_killed_keeps_kubelets_values(self) -> None:
        asked = container("app")
        asked.container_envs["FROM_KUBELET"] = "1"
        self.restarted().expect_container("p1", asked, None, made_id="c1")
        given = container("app")
        given.container_envs["FROM_KUBELET"] = "1"
        given.container_envs["FROM_THE_IMAGE"] = "1"
        restarted = self.restarted()
        restarted.learn([], [("c1", StoredContainer.read_back("p1", given, ContainerState.RUNNING))])
        stored = restarted.container("c1")
        assert stored is not None
        self.assertEqual((dict(stored.asked.container_envs), stored.hooked), ({"FROM_KUBELET": "1"}, True))
        restarted.stopped("c1")
        self.assertEqual(self.owed, [])

    def test_a_container_made_without_the_hooks_answer_counts_as_made_while_koordrp_was_away(self) -> None:
        asked, hooked = container("app"), container("app")
        asked.container_resources.cpu_shares, hooked.container_resources.cpu_shares = 102, 512
        self.restarted().expect_container("p1", asked, hooked, made_id="c1")
        restarted = self.restarted()
        restarted.learn([], [("c1", StoredContainer.read_back("p1", asked, ContainerState.RUNNING))])
        self.assertFalse(restarted.container("c1").hooked)  # type: ignore[union-attr]
        self.assertEqual(self.kept("containers"), [])

    def test_what_was_about_to_be_made_and_never_was_owes_no_stop_and_goes_after_two_readings(self) -> None:
        self.restarted().expect_container("p1", container("never made"), None, made_id="c1")
        restarted = self.restarted()
        restarted.reconcile((set(), set()), [], [], restarted.ids())
        self.assertEqual(self.kept("containers"), ["c1"])  # its call may still be under way
        restarted.reconcile((set(), set()), [], [], restarted.ids())
        self.assertEqual((self.kept("containers"), self.owed), ([], []))

    def test_what_this_koordrp_waits_to_see_made_outlives_any_reading(self) -> None:
        store = self.restarted()
        store.expect_container("p1", container("being made"), None, made_id="c1")
        for _ in range(3):
            store.reconcile((set(), set()), [], [], store.ids())
        self.assertEqual(self.kept("containers"), ["c1"])
        self.assertFalse(store.awaits_a_reading())  # no listing is owed to it

    def test_a_pod_or_container_the_runtime_did_not_make_leaves_nothing_kept(self) -> None:
        store = self.restarted()
        store.expect_pod(pod("refused"), made_id="p1")
        store.expect_container("p1", container("refused"), None, made_id="c1")
        store.not_made("containers", "c1")
        store.not_made("pods", "p1")
        self.assertEqual((self.kept("pods"), self.kept("containers")), ([], []))

    def test_what_a_flow_stopped_waiting_for_is_left_to_the_readings(self) -> None:
        # Its caller or its connection went before the runtime said: the file stays (it may have been made), and
        # the readings settle it as one kept before a kill.
        store = self.restarted()
        store.expect_container("p1", container("given up on"), None, made_id="c1")
        store.not_waited_for("containers", "c1")
        store.reconcile((set(), set()), [], [], store.ids())
        self.assertEqual(self.kept("containers"), ["c1"])
        store.reconcile((set(), set()), [], [], store.ids())
        self.assertEqual((self.kept("containers"), self.owed), ([], []))

    def test_a_file_kept_before_its_pod_was_made_is_known_once_made_whatever_order_its_maps_are_copied_in(self) -> None:
        # A request whose copy (which the store keeps once made) lists its labels in another order: protobuf's map
        # order follows a hash seeded per process, so one is looked for among a few sizes.
        for size in range(8, 128):
            asked = pod("web")
            for index in range(size):
                asked.labels[f"label-{index}.example.com/key"] = f"value-{index}"
            if copied(asked).SerializeToString() != asked.SerializeToString():
                break
        else:
            self.fail("no request whose copy lists its labels in another order")
        store = self.restarted()
        store.expect_pod(asked, made_id="p1")
        made = self.inode("pods", "p1")
        store.put_pod("p1", asked, asked)
        self.assertEqual(self.writes, [("pods", "p1")])  # written whole once; its flags after, in place
        self.assertEqual(self.inode("pods", "p1"), made)

    def test_a_change_of_flags_alone_is_written_in_place_and_a_write_that_changes_nothing_is_skipped(self) -> None:
        store = self.restarted()
        store.put_pod("p1", pod("web"), pod("web"))
        store.put_container("c1", "p1", container("app"), container("app"))
        made = self.inode("containers", "c1"), self.inode("pods", "p1")
        store.stopped("c1")
        store.pod_stopped("p1")
        store.revise_container("c1", container("app"), container("app"))  # what kubelet asked, again
        # Each written whole once (the put's pending files were never written: nothing to remove).
        self.assertEqual([write for write in self.writes if write[0] != "pending"], [("pods", "p1"), ("containers", "c1")])
        self.assertEqual((self.inode("containers", "c1"), self.inode("pods", "p1")), made)
        restarted = self.restarted()
        restarted.reconcile((set(), set()), [], [], restarted.ids())
        self.assertEqual(self.owed, [])  # their stops were told: the flags say so
