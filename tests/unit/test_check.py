"""``koordrp check``'s NRI deadline: containerd's plugin_request_timeout against each hook server's timeout."""

from twisted.trial.unittest import SynchronousTestCase

from koordrp.check import go_duration, nri_deadline_findings
from koordrp.hooks.types import FailurePolicy, HookServerConfig, HookType

SLOW = HookServerConfig("slow.json", "/run/slow.sock", FailurePolicy.IGNORE, frozenset({HookType.PRE_CREATE_CONTAINER}), 10.0)
QUICK = HookServerConfig("quick.json", "/run/quick.sock", FailurePolicy.IGNORE, frozenset({HookType.PRE_CREATE_CONTAINER}), 1.0)
POST = HookServerConfig("post.json", "/run/post.sock", FailurePolicy.IGNORE, frozenset({HookType.POST_STOP_CONTAINER}), 60.0)


class NRIDeadlineTests(SynchronousTestCase):
    def config(self, nri_section: str) -> str:
        path: str = self.mktemp()
        with open(path, "w", encoding="utf-8") as stream:
            stream.write(f'version = 2\n[plugins."io.containerd.nri.v1.nri"]\n  disable = false\n{nri_section}')
        return path

    def test_go_durations_as_containerds_config_writes_them(self) -> None:
        self.assertEqual([go_duration(text) for text in ("2s", "500ms", "1m30s", "1.5s", "1h")], [2, 0.5, 90, 1.5, 3600])
        for bad in ("2", "s", "2 s", "2sec", ""):
            self.assertRaises(ValueError, go_duration, bad)

    def test_a_server_that_may_take_longer_than_containerd_gives_is_a_finding_with_what_to_do(self) -> None:
        path = self.config('  plugin_request_timeout = "2s"\n')
        [finding] = nri_deadline_findings(path, [SLOW, QUICK, POST])
        self.assertFalse(finding.ok)
        self.assertEqual(
            finding.text,
            f"hook server slow.json may take 10s to answer, but its pre hooks get 1.9s: containerd's NRI gives each "
            f"call 2s (plugin_request_timeout in {path}) and koordrp keeps 0.1s of it to answer",
        )
        self.assertTrue(finding.fix.startswith("set its timeout-seconds (in a file without one, as koordlet writes it: koordrp's --hook-timeout) to 1.9 or less, or raise plugin_request_timeout"))

    def test_servers_that_fit_and_containerds_default(self) -> None:
        [finding] = nri_deadline_findings(self.config('  plugin_request_timeout = "11s"\n'), [SLOW, QUICK, POST])
        self.assertTrue(finding.ok)
        self.assertIn("every hook server's pre hooks fit in the 10.9s", finding.text)
        [default] = nri_deadline_findings(self.config(""), [QUICK])
        self.assertTrue(default.ok)
        self.assertIn("gives each call 2s (NRI's default", default.text)
        [missing] = nri_deadline_findings(self.mktemp(), [SLOW])
        self.assertFalse(missing.ok)
        self.assertIn("NRI's default: there is no", missing.text)

    def test_a_value_that_is_no_duration_is_said(self) -> None:
        [finding] = nri_deadline_findings(self.config("  plugin_request_timeout = 2\n"), [SLOW])
        self.assertFalse(finding.ok)
        self.assertIn("cannot read plugin_request_timeout", finding.text)
