"""The files in tap/ say what koordrp accepts."""

import json
import shlex
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from koordrp import tap
from koordrp.hooks.config import parse_hook_server_config

TAP = Path(__file__).resolve().parents[2] / "tap"


class TapFilesTests(SynchronousTestCase):
    def test_the_unit_runs_options_koordrp_accepts(self) -> None:
        unit = (TAP / "koordrp.service").read_text()
        command = unit.split("ExecStart=", 1)[1].split("\n#", 1)[0].replace("\\\n", " ")
        argv = shlex.split(command)
        self.assertEqual(argv[1:4], ["-n", "--pidfile=", "--logfile=-"])
        options = tap.Options()
        options.parseOptions(argv[argv.index("koordrp") + 1 :])
        self.assertEqual(options["metrics-endpoint"], "tcp:9316:interface=127.0.0.1")

    def test_the_kubelet_drop_in_points_both_endpoints_at_koordrp(self) -> None:
        drop_in = (TAP / "20-koordrp.conf").read_text()
        socket = "unix://" + tap.DEFAULT_PROXY_ENDPOINT
        self.assertIn(f"--container-runtime-endpoint={socket}", drop_in)
        self.assertIn(f"--image-service-endpoint={socket}", drop_in)

    def test_example_registrations_parse(self) -> None:
        for path in sorted((TAP / "hookserver.d").glob("*.json")):
            config = parse_hook_server_config(path.name, path.read_bytes(), 2.0)
            self.assertTrue(config.hooks, path)
            json.loads(path.read_text())
