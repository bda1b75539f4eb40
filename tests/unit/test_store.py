"""The store: copies in and out, forgetting pods with their containers, reconciling with the runtime."""

import threading

from twisted.trial.unittest import SynchronousTestCase

from koordrp.hooks.messages import ContainerHookRequest, PodHookRequest
from koordrp.store import ContainerState, Store, StoredContainer, StoredPod


def pod(name: str) -> PodHookRequest:
    request = PodHookRequest()
    request.pod_meta.name = name
    return request


def container(name: str) -> ContainerHookRequest:
    request = ContainerHookRequest()
    request.container_meta.name = name
    return request


class StoreTests(SynchronousTestCase):
    def test_what_goes_in_and_out_is_a_copy(self) -> None:
        store = Store()
        original = pod("a")
        store.put_pod("p1", original)
        original.pod_meta.name = "changed by the caller"
        got = store.pod("p1")
        assert got is not None
        got.labels["x"] = "y"
        self.assertEqual(store.pod("p1"), pod("a"))

    def test_forgetting_a_pod_forgets_its_containers(self) -> None:
        store = Store()
        store.put_pod("p1", pod("a"))
        store.put_pod("p2", pod("b"))
        store.put_container("c1", "p1", container("x"))
        store.put_container("c2", "p2", container("y"))
        store.forget_pod("p1")
        self.assertIsNone(store.container("c1"))
        self.assertEqual(store.sizes(), (1, 1))

    def test_learn_keeps_what_calls_wrote(self) -> None:
        store = Store()
        store.put_pod("p1", pod("from a call"))
        store.learn([("p1", StoredPod(pod("from the runtime"))), ("p2", StoredPod(pod("new")))], [])
        self.assertEqual(store.pod("p1"), pod("from a call"))
        self.assertEqual(store.pod("p2"), pod("new"))

    def test_reconcile_forgets_what_went_and_learns_what_came(self) -> None:
        store = Store()
        store.put_pod("gone", pod("gone"))
        store.put_pod("kept", pod("kept"))
        store.put_container("gone-c", "gone", container("gone"))
        before = store.ids()
        store.put_pod("created-during-listing", pod("new"))
        forgotten, learnt = store.reconcile(
            [("kept", StoredPod(pod("kept, as the runtime says"))), ("appeared", StoredPod(pod("appeared")))],
            [("appeared-c", StoredContainer("appeared", container("c")))],
            before,
        )
        self.assertEqual((forgotten, learnt), (2, 2))
        self.assertIsNone(store.pod("gone"))
        self.assertIsNone(store.container("gone-c"))
        self.assertEqual(store.pod("kept"), pod("kept"))
        self.assertEqual(store.pod("created-during-listing"), pod("new"))
        self.assertEqual(store.pod("appeared"), pod("appeared"))

    def test_a_container_starts_and_stops_once_until_it_starts_again(self) -> None:
        store = Store()
        store.put_container("c1", "p1", container("x"))
        self.assertEqual((store.started("c1"), store.started("c1")), (True, False))
        self.assertEqual((store.stopped("c1"), store.stopped("c1")), (True, False))
        self.assertEqual((store.started("c1"), store.stopped("c1")), (True, True))
        self.assertEqual((store.started("unknown"), store.stopped("unknown")), (False, False))

    def test_a_stopped_pod_stops_its_containers_once(self) -> None:
        store = Store()
        store.put_pod("p1", pod("a"))
        for name in ("c1", "c2", "c3"):
            store.put_container(name, "p1", container(name))
        store.put_container("other", "p2", container("other"))
        store.started("c1")
        store.stopped("c2")
        newly, containers = store.pod_stopped("p1")
        self.assertTrue(newly)
        self.assertEqual([stored.info.container_meta.name for stored in containers], ["c1", "c3"])
        self.assertEqual(store.pod_stopped("p1"), (False, []))
        self.assertEqual(store.container("other").state, ContainerState.CREATED)  # type: ignore[union-attr]

    def test_a_revision_keeps_the_state_and_what_was_forgotten_stays_forgotten(self) -> None:
        store = Store()
        store.put_container("c1", "p1", container("x"))
        store.started("c1")
        store.revise_container("c1", container("y"))
        self.assertEqual(store.container("c1"), StoredContainer("p1", container("y"), ContainerState.RUNNING))
        store.forget_container("c1")
        store.revise_container("c1", container("z"))
        self.assertIsNone(store.container("c1"))

    def test_safe_from_many_threads(self) -> None:
        store = Store()

        def churn(worker: int) -> None:
            for index in range(300):
                key = f"{worker}-{index}"
                store.put_pod(key, pod(key))
                store.put_container(key, key, container(key))
                store.pod(key)
                store.forget_pod(key)

        threads = [threading.Thread(target=churn, args=(n,)) for n in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.assertEqual(store.sizes(), (0, 0))
