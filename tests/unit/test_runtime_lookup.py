"""Reading the runtime's listings the lenient way: ids only, whatever else an item holds."""

from cri_api.v1 import api_pb2 as package
from twisted.trial.unittest import SynchronousTestCase

from koordrp.cri.runtime_lookup import listed_ids


class ListedIdsTests(SynchronousTestCase):
    def test_an_item_with_text_that_is_not_utf8_hides_no_other(self) -> None:
        listing = package.ListPodSandboxResponse(
            items=[package.PodSandbox(id="a1", labels={"odd": "ODD"}), package.PodSandbox(id="b2")]
        ).SerializeToString()
        odd = listing.replace(b"ODD", b"\xff\xfe\xfd")
        with self.assertRaises(Exception):
            package.ListPodSandboxResponse.FromString(odd)
        self.assertEqual(listed_ids(odd), ["a1", "b2"])

    def test_containers_and_an_empty_listing(self) -> None:
        listing = package.ListContainersResponse(containers=[package.Container(id="c1", pod_sandbox_id="a1")])
        self.assertEqual(listed_ids(listing.SerializeToString()), ["c1"])
        self.assertEqual(listed_ids(b""), [])
