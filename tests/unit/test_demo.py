"""scripts/demo's command line (the pod it makes, the image it names, help without a bootstrap) and its summary."""

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

from cri_api.v1 import api_pb2
from twisted.trial.unittest import SynchronousTestCase

from scripts import demo
from tests.support.koordrp_process import KoordrpProcess
from tests.support.modules import ROOT
from tests.support.tempdirs import short_tempdir


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


class HookChangesTests(SynchronousTestCase):
    """What the summary says of the hooks' changes to the container's resources, from the runtime's spec as created
    and at the end."""

    ASKED = demo.asked_resources(api_pb2.LinuxContainerResources(cpuset_cpus="1", cpu_shares=512))

    def spec(self, **cpu: object) -> demo.Resources:
        return demo.resources_in({"linux": {"resources": {"cpu": cpu}}})

    def test_a_change_kubelets_update_put_back_is_undone(self) -> None:
        undone, kept = demo.hooks_changes(self.ASKED, self.spec(cpus="0", shares=512), self.spec(cpus="1", shares=512))
        self.assertEqual(undone, ['resources.cpuset_cpus: the hooks made it "0" (kubelet asked "1"); the runtime has "1" at the end'])
        self.assertEqual(kept, [])

    def test_a_change_the_update_kept_is_named_as_kept(self) -> None:
        undone, kept = demo.hooks_changes(self.ASKED, self.spec(cpus="0", shares=512), self.spec(cpus="0", shares=512))
        self.assertEqual((undone, kept), ([], ['resources.cpuset_cpus "0" (kubelet asked "1")']))

    def test_a_cleared_cpuset_is_a_change_and_kubelets_value_coming_back_undoes_it(self) -> None:
        undone, _ = demo.hooks_changes(self.ASKED, self.spec(shares=256), self.spec(cpus="1", shares=512))
        self.assertEqual(undone, [
            'resources.cpuset_cpus: the hooks made it none (kubelet asked "1"); the runtime has "1" at the end',
            "resources.cpu_shares: the hooks made it 256 (kubelet asked 512); the runtime has 512 at the end",
        ])

    def test_a_value_a_later_hook_set_again_is_not_undone(self) -> None:
        # The server's PreUpdateContainerResources answer moved it on: its own doing, not kubelet's.
        undone, kept = demo.hooks_changes(self.ASKED, self.spec(cpus="0", shares=512), self.spec(cpus="2", shares=512))
        self.assertEqual((undone, kept), ([], []))

    def test_what_kubelet_did_not_ask_for_is_none(self) -> None:
        asked = demo.asked_resources(api_pb2.LinuxContainerResources())
        undone, kept = demo.hooks_changes(asked, self.spec(cpus="0"), self.spec(cpus="0"))
        self.assertEqual((undone, kept), ([], ['resources.cpuset_cpus "0" (kubelet asked for none)']))

    def test_nothing_is_said_without_both_snapshots(self) -> None:
        self.assertEqual(demo.hooks_changes(self.ASKED, None, self.spec(cpus="1")), ([], []))
        self.assertEqual(demo.hooks_changes(self.ASKED, self.spec(cpus="0"), None), ([], []))


class SummaryTests(SynchronousTestCase):
    def summary(self, calls: demo.Calls, server_log: str, koordrp_log: str) -> list[str]:
        base = Path(short_tempdir(self))
        (base / "hook-server.log").write_text(server_log)
        proxy = KoordrpProcess(base, "unix:///nowhere")
        proxy.logfile.write_text(koordrp_log)
        output = io.StringIO()
        self.patch(sys, "stdout", output)
        demo.show_summary(calls, base / "hook-server.log", demo.koordrp_warnings(proxy))
        return output.getvalue().splitlines()

    def test_koordrps_warnings_are_shown_with_their_tracebacks_and_its_other_lines_are_not(self) -> None:
        koordrp_log = (
            "2025-06-01T12:00:00+0000 [koordrp.calls#info] CreateContainer pod default/demo: OK in 1.0 ms; hooks: none\n"
            "2025-06-01T12:00:01+0000 [koordrp.hooks.registry.HookRegistry#warn] hook server pin-me.json may take 60s\n"
            "2025-06-01T12:00:02+0000 [koordrp.web#error] it broke\n"
            "\tTraceback (most recent call last):\n"
            "\tValueError: no\n"
            "2025-06-01T12:00:03+0000 [koordrp.calls#info] multi-line\n"
            "\tnot a warning's\n"
        )
        lines = self.summary(demo.Calls(), "", koordrp_log)
        self.assertEqual(lines[1:], [
            "summary:",
            "  all 0 CRI calls answered",
            "  koordrp warned (the warn and error lines of its log):",
            "    [koordrp.hooks.registry.HookRegistry#warn] hook server pin-me.json may take 60s",
            "    [koordrp.web#error] it broke",
            "      Traceback (most recent call last):",
            "      ValueError: no",
        ])

    def test_an_undone_change_follows_what_the_server_warned_of_and_says_what_to_answer(self) -> None:
        calls = demo.Calls()
        calls.undone = ['resources.cpuset_cpus: the hooks made it "0" (kubelet asked "1"); the runtime has "1" at the end']
        server_log = "2025-06-01 12:00:00,000 koordrp.sdk WARNING the PreCreateContainer answer clears cpuset_cpus\n"
        lines = self.summary(calls, server_log, "")
        self.assertEqual(lines[3:6], [
            "  the hook server warned (koordrp.sdk):",
            "    2025-06-01 12:00:00,000 koordrp.sdk WARNING the PreCreateContainer answer clears cpuset_cpus",
            "  UpdateContainerResources undid what the hooks changed at CreateContainer (kubelet sends its values again):",
        ])
        self.assertIn("answer PreUpdateContainerResources too", lines[7])


class WrapperTests(SynchronousTestCase):
    """scripts/demo, the shell script: help without the bootstrap, a real run after it. Run in a copy of the tree's
    layout whose bootstrap and virtualenv only say they ran."""

    def setUp(self) -> None:
        self.root = Path(short_tempdir(self))
        (self.root / "scripts").mkdir()
        shutil.copy(ROOT / "scripts" / "demo", self.root / "scripts" / "demo")
        self.ran = self.root / "ran"
        self.script(self.root / "python-that-works", 'echo "python $*" >>"$RAN"')
        self.script(self.root / "python-that-fails", 'echo "python $*" >>"$RAN"; exit 1')  # as a .venv without grpc
        # As the real one: the virtualenv works once it ran.
        self.script(self.root / "scripts" / "bootstrap", 'echo bootstrap >>"$RAN"; mkdir -p .venv/bin; cp python-that-works .venv/bin/python')

    def script(self, path: Path, body: str) -> None:
        path.write_text(f"#!/usr/bin/env bash\n{body}\n")
        path.chmod(0o755)

    def virtualenv(self, python: str) -> None:
        (self.root / ".venv" / "bin").mkdir(parents=True)
        shutil.copy(self.root / python, self.root / ".venv" / "bin" / "python")

    def demo(self, *args: str) -> list[str]:
        """What ran, in order, for ``scripts/demo args`` (which must exit 0)."""
        result = subprocess.run(
            [str(self.root / "scripts" / "demo"), *args], env={**os.environ, "RAN": str(self.ran)}, capture_output=True, text=True
        )
        self.assertEqual(result.returncode, 0, result.stderr)
        ran = self.ran.read_text().splitlines()
        self.ran.unlink()
        return ran

    def test_help_is_answered_by_the_virtualenv_there_is_without_the_bootstrap(self) -> None:
        self.virtualenv("python-that-works")
        self.assertEqual(self.demo("--hook-server", "mine.py", "-h"), ["python -m scripts.demo --help"])
        self.assertEqual(self.demo("--hel"), ["python -m scripts.demo --help"])  # argparse takes it for --help

    def test_a_run_is_bootstrapped_first(self) -> None:
        self.virtualenv("python-that-works")
        self.assertEqual(self.demo("--mode", "nri"), ["bootstrap", "python -m scripts.demo --mode nri"])

    def test_help_a_virtualenv_cannot_give_is_given_after_the_bootstrap(self) -> None:
        self.virtualenv("python-that-fails")
        self.assertEqual(self.demo("--help"), ["python -m scripts.demo --help", "bootstrap", "python -m scripts.demo --help"])

    def test_a_clone_without_a_virtualenv_is_bootstrapped_for_help_too(self) -> None:
        self.assertEqual(self.demo("-h"), ["bootstrap", "python -m scripts.demo -h"])
