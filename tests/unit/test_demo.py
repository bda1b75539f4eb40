"""scripts/demo's command line: the pod it makes and the image it names, before anything runs."""

import io
import sys
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from scripts import demo


class ImageNameTests(SynchronousTestCase):
    def test_names_are_completed_as_containerd_completes_them(self) -> None:
        for given, full in [
            ("busybox", "docker.io/library/busybox:latest"),
            ("team/app:1", "docker.io/team/app:1"),
            ("registry.example/forbidden/app:1", "registry.example/forbidden/app:1"),
            ("registry.example:5000/app", "registry.example:5000/app:latest"),
            ("localhost/koordrp/busybox:1", "localhost/koordrp/busybox:1"),
        ]:
            self.assertEqual(demo.full_reference(given), full)

    def test_a_name_no_pod_spec_could_hold_is_a_usage_error(self) -> None:
        self.patch(sys, "stderr", io.StringIO())  # argparse's usage message
        for bad in ("Upper/app", "app@sha256:" + "0" * 64, "a b", ""):
            with self.assertRaises(SystemExit, msg=bad):
                demo.options(["--image", bad])


class PodTests(SynchronousTestCase):
    def test_the_example_gets_what_it_acts_on_and_an_authors_server_only_what_the_flags_give(self) -> None:
        _, example = demo.options([])
        self.assertEqual((example.labels, example.annotations, example.env), (
            demo.EXAMPLE_POD.labels, demo.EXAMPLE_POD.annotations, demo.EXAMPLE_POD.env))
        parsed, own = demo.options(["--hook-server", "mine.py", "--pod-label", "team=batch", "--image", "forbidden"])
        self.assertEqual((own.labels, own.annotations, own.env, own.image), ({"team": "batch"}, {}, {}, "forbidden"))
        self.assertEqual(parsed.hook_server, Path("mine.py"))
        self.assertIsNone(parsed.failure_policy)  # the server's own, unless the flag is given
