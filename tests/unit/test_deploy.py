"""deploy/: what `kubectl apply -f deploy/` makes is valid Kubernetes for every version koordrp claims,
and runs the image scripts/package builds as koordrp's NRI mode needs it."""

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from twisted.trial.unittest import SynchronousTestCase

from koordrp import tap
from scripts import package

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"

KOORDLET = json.loads((ROOT / "tap" / "hookserver.d" / "koordlet.json").read_text())

# The Kubernetes versions README.md claims for deploy/.
KUBERNETES_VERSIONS = ("1.30", "1.31", "1.32", "1.33", "1.34")


def documents() -> list[dict[str, Any]]:
    found = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        found += [document for document in yaml.safe_load_all(path.read_text()) if document]
    return found


def daemonset() -> dict[str, Any]:
    [found] = [document for document in documents() if document["kind"] == "DaemonSet"]
    return found


class DeployTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.pod = daemonset()["spec"]["template"]["spec"]
        [self.container] = self.pod["containers"]
        self.options = tap.Options()
        self.options.parseOptions(self.container["args"])

    def test_every_file_passes_kubernetes_validate_strict_for_each_version_claimed(self) -> None:
        validate = Path(sys.executable).with_name("kubernetes-validate")
        files = sorted(str(path) for path in DEPLOY.glob("*.yaml"))
        for version in KUBERNETES_VERSIONS:
            command = [str(validate), "--strict", f"--kubernetes-version={version}.0", *files]
            result = subprocess.run(command, capture_output=True, text=True)
            said = result.stdout + result.stderr
            self.assertEqual(result.returncode, 0, f"{shlex.join(command)}:\n{said}")
            self.assertEqual(said.count(" passed for resource "), len(documents()), said)

    def test_the_daemonset_runs_koordrp_in_nri_mode_as_containerds_plugin(self) -> None:
        self.assertEqual(self.options["backend-runtime-mode"], "NRI")
        self.assertEqual(self.options["nri-socket"], tap.DEFAULT_NRI_SOCKET)
        self.assertNotIn("command", self.container)  # the image's entrypoint runs koordrp: args are its options

    def test_what_koordrp_reads_and_writes_is_the_nodes_own(self) -> None:
        mounts = {mount["mountPath"]: mount for mount in self.container["volumeMounts"]}
        volumes = {volume["name"]: volume["hostPath"]["path"] for volume in self.pod["volumes"]}
        for path in (
            str(Path(self.options["nri-socket"]).parent),
            self.options["hook-config-dir"],
            self.options["state-dir"],
            str(Path(self.options["remote-runtime-service-endpoint"]).parent),  # the reconcile's listing
            str(Path(KOORDLET["remote-endpoint"]).parent),  # koordlet's socket, as its registration names it
        ):
            self.assertIn(path, mounts)
            self.assertEqual(volumes[mounts[path]["name"]], path)
        self.assertTrue(mounts[self.options["hook-config-dir"]]["readOnly"])
        self.assertEqual(
            (self.options["hook-config-dir"], self.options["state-dir"]), (tap.DEFAULT_HOOK_CONFIG_DIR, tap.DEFAULT_STATE_DIR)
        )

    def test_ready_when_registered_alive_while_the_reactor_answers(self) -> None:
        [port] = self.container["ports"]
        self.assertEqual(self.options["metrics-endpoint"], f"tcp:{port['containerPort']}")
        for probe, path in (("readinessProbe", "/healthz"), ("livenessProbe", "/livez")):
            self.assertEqual(self.container[probe]["httpGet"], {"path": path, "port": port["name"]})

    def test_the_metrics_port_is_open_to_the_node_and_the_scrapers_namespaces_only(self) -> None:
        """kubelet's probes come from the node, which no NetworkPolicy can block: the policy needs no rule for them."""
        [policy] = [document for document in documents() if document["kind"] == "NetworkPolicy"]
        [port] = self.container["ports"]
        template = daemonset()["spec"]["template"]["metadata"]
        self.assertEqual(policy["metadata"]["namespace"], daemonset()["metadata"]["namespace"])
        selected = policy["spec"]["podSelector"]["matchLabels"]
        self.assertLessEqual(selected.items(), template["labels"].items())
        self.assertEqual(policy["spec"]["policyTypes"], ["Ingress"])  # egress left alone
        [rule] = policy["spec"]["ingress"]
        self.assertEqual(rule["ports"], [{"protocol": "TCP", "port": port["containerPort"]}])
        self.assertEqual(rule["from"], [{"namespaceSelector": {"matchLabels": {"koordrp/metrics": "scrape"}}}])
        self.assertEqual(self.container["ports"], [port])  # nothing else is served on the pod network

    def test_a_stalled_koordrp_is_replaced_within_30_s_a_hiccup_is_not_and_a_stop_has_its_grace(self) -> None:
        live, ready = self.container["livenessProbe"], self.container["readinessProbe"]
        period, timeout, failures = live["periodSeconds"], live["timeoutSeconds"], live["failureThreshold"]
        grace = self.pod["terminationGracePeriodSeconds"]
        # A stall answers no probe and no SIGTERM: the grace is paid in full after the last failed probe.
        self.assertLessEqual(period * failures + grace, 30)
        # Worst case: the stall just after a probe, the failures-th probe's answer awaited its whole timeout.
        self.assertLessEqual(period * failures + timeout + grace, 30)
        # /livez unanswered fails within its timeout, well under 5 s, and before the next probe is due.
        self.assertLess(timeout, 5)
        self.assertLess(timeout, period)
        # The shortest stall that fails every probe of a kill: a hiccup under 10 s is never one.
        self.assertGreaterEqual((failures - 1) * period + timeout, 10)
        # NotReady first: the readiness probe's worst case comes before the earliest kill.
        self.assertLess(ready["periodSeconds"] + ready["timeoutSeconds"], (failures - 1) * period + timeout)
        self.assertEqual(ready["failureThreshold"], 1)
        # koordrp's own orderly stop (--grace-period, then up to 1 s more) ends before SIGKILL.
        self.assertGreater(grace, self.options["grace-period"] + 1)

    def test_it_runs_the_image_scripts_package_builds_on_every_labelled_node(self) -> None:
        self.assertEqual(self.container["image"], f"{package.IMAGE_NAME}:{package.project_version()}")
        self.assertEqual(self.pod["priorityClassName"], "system-node-critical")
        self.assertEqual(self.pod["tolerations"], [{"operator": "Exists"}])
        self.assertEqual(list(self.pod["nodeSelector"]), ["koordrp/nri"])
        requests = self.container["resources"]["requests"]
        self.assertEqual(set(requests), {"cpu", "memory"})

    def test_root_without_privileges(self) -> None:
        security = self.container["securityContext"]
        self.assertEqual((security["runAsUser"], security["privileged"], security["allowPrivilegeEscalation"]), (0, False, False))
        self.assertEqual((security["readOnlyRootFilesystem"], security["capabilities"]), (True, {"drop": ["ALL"]}))
        [namespace] = [document for document in documents() if document["kind"] == "Namespace"]
        self.assertEqual(daemonset()["metadata"]["namespace"], namespace["metadata"]["name"])
