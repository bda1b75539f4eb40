"""``koordrp check``'s NRI deadline (containerd's plugin_request_timeout against each hook server's timeout), and
what an NRI-mode koordrp is given beyond what it needs."""

import os

from twisted.trial.unittest import SynchronousTestCase

from koordrp.check import go_duration, mount_points, nri_deadline_findings, reach_findings
from koordrp.nri import registration
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


KOORDLET = HookServerConfig("koordlet.json", "/var/run/koordlet/koordlet.sock", FailurePolicy.IGNORE, frozenset({HookType.PRE_CREATE_CONTAINER}), 3.0)
# A DaemonSet's container as containerd's runc mounts it (trimmed), with deploy/daemonset.yaml's volumes.
POD_MOUNTS = """\
1190 1100 0:70 / / ro,relatime - overlay overlay rw,lowerdir=/l
1191 1190 0:73 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw
1192 1190 0:74 / /dev rw,nosuid - tmpfs tmpfs rw,size=65536k
1193 1192 0:75 / /dev/pts rw,nosuid,noexec,relatime - devpts devpts rw
1194 1190 0:72 / /sys ro,nosuid,nodev,noexec,relatime - sysfs sysfs ro
1195 1194 0:30 / /sys/fs/cgroup ro,nosuid,nodev,noexec,relatime - cgroup2 cgroup rw
1196 1190 0:25 /nri /var/run/nri rw,nosuid,nodev - tmpfs tmpfs rw
1197 1190 8:1 /etc/runtime/hookserver.d /etc/runtime/hookserver.d ro,relatime - ext4 /dev/sda1 rw
1198 1190 0:25 /koord-runtimeproxy/state /var/run/koord-runtimeproxy/state rw,nosuid,nodev - tmpfs tmpfs rw
1199 1190 0:25 /koordlet /var/run/koordlet rw,nosuid,nodev - tmpfs tmpfs rw
1200 1190 8:1 /var/lib/containerd/sandboxes/a/hosts /etc/hosts rw,relatime - ext4 /dev/sda1 rw
1201 1190 8:1 /var/lib/kubelet/pods/b/containers/koordrp/c /dev/termination-log rw,relatime - ext4 /dev/sda1 rw
1202 1190 0:25 /containerd/io.containerd.grpc.v1.cri/sandboxes/a/resolv.conf /etc/resolv.conf rw - tmpfs tmpfs rw
1203 1191 0:74 /null /proc/kcore rw,nosuid - tmpfs tmpfs rw
"""
DAEMONSET_ARGS = (
    "--backend-runtime-mode=NRI", "--nri-socket=/var/run/nri/nri.sock", "--hook-config-dir=/etc/runtime/hookserver.d",
    "--state-dir=/var/run/koord-runtimeproxy/state", "--grace-period=8",
)


class ReachTests(SynchronousTestCase):
    """What the live NRI-mode koordrp is given beyond what it needs, read from its /proc."""

    def proc(self, pid: int, args: tuple[str, ...], mounts: str = POD_MOUNTS, capabilities: int = 0, own_namespace: bool = True) -> str:
        proc: str = self.mktemp()
        for each in {pid, 1}:
            os.makedirs(os.path.join(proc, str(each), "ns"))
            os.symlink("mnt:[4026532000]" if each == pid and own_namespace else "mnt:[4026531841]", os.path.join(proc, str(each), "ns", "mnt"))
        base = os.path.join(proc, str(pid))
        with open(os.path.join(base, "cmdline"), "wb") as cmdline:
            cmdline.write(b"\0".join(word.encode() for word in ("/opt/koordrp/venv/bin/python3", "twistd", "-n", "koordrp", *args)) + b"\0")
        with open(os.path.join(base, "mountinfo"), "w") as mountinfo:
            mountinfo.write(mounts)
        with open(os.path.join(base, "status"), "w") as status:
            status.write(f"Name:\ttwistd\nCapInh:\t0000000000000000\nCapEff:\t{capabilities:016x}\n")
        return proc

    def findings(self, proc: str, pid: int) -> list[tuple[bool, str]]:
        said = registration.Registration("10-koordrp", "/var/run/nri/nri.sock", "containerd 2.1.9", pid, "2026-11-28T10:00:00+00:00")
        return [(finding.ok, finding.text) for finding in reach_findings(proc, said, [KOORDLET])]

    def test_the_daemonsets_pod_has_what_nri_mode_needs_and_nothing_more(self) -> None:
        [(ok, text)] = self.findings(self.proc(1, DAEMONSET_ARGS), 1)
        self.assertTrue(ok, text)
        needed = ("/etc/runtime/hookserver.d", "/var/run/koord-runtimeproxy/state", "/var/run/koordlet", "/var/run/nri")
        self.assertIn(", ".join(sorted(os.path.realpath(path) for path in needed)), text)

    def test_containerds_socket_mounted_and_named_is_two_findings_a_capability_a_third(self) -> None:
        mounts = POD_MOUNTS + "1210 1190 0:25 /containerd /var/run/containerd rw,nosuid,nodev - tmpfs tmpfs rw\n"
        mounts += "1211 1190 0:80 / /run/secrets/kubernetes.io/serviceaccount ro,relatime - tmpfs tmpfs rw\n"
        args = (*DAEMONSET_ARGS, "--remote-runtime-service-endpoint=/var/run/containerd/containerd.sock")
        findings = self.findings(self.proc(1, args, mounts, capabilities=0x400), 1)
        self.assertEqual([ok for ok, _ in findings], [False, False, False])
        self.assertEqual(findings[0][1], "koordrp (pid 1) is given --remote-runtime-service-endpoint, which NRI mode does not use")
        containerd = os.path.realpath("/var/run/containerd")  # as the kernel names it
        extra = ", ".join(sorted((containerd, "/run/secrets/kubernetes.io/serviceaccount")))
        self.assertIn(f"mounts {extra}: more than NRI mode needs", findings[1][1])
        self.assertIn("CapEff 0x400", findings[2][1])

    def test_a_mount_point_with_a_space_is_read_as_the_kernel_wrote_it(self) -> None:
        self.assertEqual(mount_points("1 0 0:1 / /var/run/my\\040dir rw - tmpfs tmpfs rw\n"), ["/var/run/my dir"])

    def test_installed_on_the_node_koordrps_mounts_and_capabilities_are_the_units_to_judge(self) -> None:
        proc = self.proc(4242, DAEMONSET_ARGS, POD_MOUNTS + "9 1 8:1 /home /home rw - ext4 /dev/sda1 rw\n", 0x1FF, own_namespace=False)
        self.assertEqual(self.findings(proc, 4242), [])

    def test_mounts_inside_a_needed_directory_and_var_run_as_the_kernel_names_it_give_no_more(self) -> None:
        mounts = POD_MOUNTS.replace(" /var/run/", " /run/")  # /var/run is a link to /run: the kernel says /run
        mounts += "1220 1196 0:90 / /run/nri/state/io.containerd.runtime.v2.task/k8s.io/ab/rootfs rw - overlay overlay rw\n"
        [(ok, text)] = self.findings(self.proc(1, DAEMONSET_ARGS, mounts), 1)
        self.assertTrue(ok, text)
