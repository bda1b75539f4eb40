"""The files in tap/ say what koordrp accepts."""

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from koordrp import defaults
from koordrp.hooks.config import parse_hook_server_config
from tests.support.tempdirs import short_tempdir

ROOT = Path(__file__).resolve().parents[2]
TAP = ROOT / "tap"
KUBEADM = ROOT / "tests" / "fixtures" / "kubeadm"
DROP_IN = TAP / "kubeadm" / "20-koordrp.conf"
NRI_DROP_IN = TAP / "nri" / "10-nri-mode.conf"


class TapFilesTests(SynchronousTestCase):
    def options_of(self, unit: Path) -> defaults.Options:
        """The options the unit's (last) ExecStart= gives koordrp, the node's own (KOORDRP_ARGS) last."""
        command = unit.read_text().rsplit("ExecStart=", 1)[1].split("\n#", 1)[0].replace("\\\n", " ")
        argv = shlex.split(command)
        self.assertEqual(argv[1:4], ["-n", "--pidfile=", "--logfile=-"])
        self.assertEqual(argv[-1], "$KOORDRP_ARGS")
        options = defaults.Options()
        options.parseOptions(argv[argv.index("koordrp") + 1 : -1])
        return options

    def test_the_nodes_own_options_come_from_the_packages_conffile_if_there_is_one(self) -> None:
        self.assertIn("\nEnvironmentFile=-/etc/default/koordrp\n", (TAP / "koordrp.service").read_text())
        conffile = (ROOT / "packaging" / "deb" / "default").read_text()
        [setting] = [line for line in conffile.splitlines() if not line.startswith("#")]
        self.assertEqual(setting, 'KOORDRP_ARGS=""')

    def test_the_unit_runs_options_koordrp_accepts(self) -> None:
        options = self.options_of(TAP / "koordrp.service")
        self.assertEqual(options["metrics-endpoint"], "tcp:9316:interface=127.0.0.1")

    def test_koordrp_has_descriptors_to_spare_and_its_metrics_stay_on_the_node(self) -> None:
        """systemd's default soft limit, 1024, is what two slow clients exhausted before the metrics endpoint was bounded."""
        unit = (TAP / "koordrp.service").read_text()
        [limit] = [line.split("=", 1)[1] for line in unit.splitlines() if line.startswith("LimitNOFILE=")]
        self.assertGreaterEqual(int(limit), 65536)
        self.assertIn("interface=127.0.0.1", self.options_of(TAP / "koordrp.service")["metrics-endpoint"])

    def test_the_stops_bound_ends_well_before_systemd_kills_koordrp(self) -> None:
        """Calls in flight and post hooks are cut at --grace-period, each with a line: systemd's kill would cut
        them with none. The rest of a stop (closing sockets and channels) takes well under a second."""
        unit = (TAP / "koordrp.service").read_text()
        timeout_stop = float(unit.split("\nTimeoutStopSec=", 1)[1].split("\n", 1)[0])
        for drop_in in (TAP / "koordrp.service", NRI_DROP_IN):
            self.assertLessEqual(self.options_of(drop_in)["grace-period"] + 10, timeout_stop)

    def test_the_nri_drop_in_runs_koordrp_as_containerds_plugin(self) -> None:
        options = self.options_of(NRI_DROP_IN)
        self.assertEqual((options["backend-runtime-mode"], options["nri-socket"]), ("NRI", defaults.DEFAULT_NRI_SOCKET))
        self.assertIn("\nExecStart=\nExecStart=", NRI_DROP_IN.read_text())

    def test_the_kubelet_drop_in_points_both_endpoints_at_koordrp(self) -> None:
        drop_in = DROP_IN.read_text()
        socket = "unix://" + defaults.DEFAULT_PROXY_ENDPOINT
        self.assertIn(f"--container-runtime-endpoint={socket}", drop_in)
        self.assertIn(f"--image-service-endpoint={socket}", drop_in)

    def test_the_kubelet_drop_in_runs_kubeadms_command_with_koordrps_flags_last(self) -> None:
        kubeadm = [line for line in (KUBEADM / "10-kubeadm.conf").read_text().splitlines() if line.startswith("ExecStart=")]
        ours = [line for line in DROP_IN.read_text().splitlines() if line.startswith("ExecStart=")]
        self.assertEqual(ours, [kubeadm[0], kubeadm[1] + " $KOORDRP_KUBELET_ARGS"])

    def test_koordrp_and_kubelet_are_ordered_but_not_bound(self) -> None:
        for text in (DROP_IN.read_text(), (TAP / "koordrp.service").read_text()):
            settings = [line.split("=", 1)[0] for line in text.splitlines() if "=" in line and not line.startswith("#")]
            self.assertFalse({"Requires", "RequiredBy", "BindsTo", "PartOf"} & set(settings), settings)
        unit = (TAP / "koordrp.service").read_text()
        for setting in ("Type=notify", "WatchdogSec=30", "Before=kubelet.service", "After=containerd.service"):
            self.assertIn(setting + "\n", unit)

    def test_systemd_finds_nothing_to_say_about_the_unit_and_the_drop_in(self) -> None:
        verify = shutil.which("systemd-analyze")
        if verify is None:
            if os.environ.get("CI") == "true":
                self.fail("CI must verify the units: systemd-analyze is missing (Debian package systemd)")
            raise SkipTest("systemd-analyze is not installed")
        root = Path(short_tempdir(self))
        units, drop_ins = root / "etc/systemd/system", root / "etc/systemd/system/kubelet.service.d"
        drop_ins.mkdir(parents=True)
        (units / "koordrp.service.d").mkdir()
        shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
        for source, target in (
            (KUBEADM / "kubelet.service", units), (TAP / "koordrp.service", units),
            (KUBEADM / "10-kubeadm.conf", drop_ins), (DROP_IN, drop_ins), (NRI_DROP_IN, units / "koordrp.service.d"),
        ):
            shutil.copy(source, target)
        for executable in ("usr/bin/kubelet", "opt/koordrp/venv/bin/twistd"):
            (root / executable).parent.mkdir(parents=True, exist_ok=True)
            (root / executable).write_text("#!/bin/sh\n")
            (root / executable).chmod(0o755)
        result = subprocess.run(
            [verify, "verify", "--man=no", f"--root={root}", "kubelet.service", "koordrp.service"],
            capture_output=True, text=True,
        )
        self.assertEqual((result.returncode, result.stdout + result.stderr), (0, ""))

    def test_example_registrations_parse(self) -> None:
        for path in sorted((TAP / "hookserver.d").glob("*.json")):
            config = parse_hook_server_config(path.name, path.read_bytes(), 2.0)
            self.assertTrue(config.hooks, path)
            json.loads(path.read_text())
