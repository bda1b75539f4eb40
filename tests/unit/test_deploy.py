"""deploy/: what `kubectl apply -k deploy/` makes is valid Kubernetes for every version koordrp claims,
and runs the image scripts/package builds as koordrp's NRI mode needs it; the example overlay changes
what it says it does, and stays as valid."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from twisted.trial.unittest import FailTest, SkipTest, SynchronousTestCase

from koordrp import defaults
from scripts import package

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"

EXAMPLE = DEPLOY / "overlays" / "example"

KOORDLET = json.loads((ROOT / "tap" / "hookserver.d" / "koordlet.json").read_text())

# The Kubernetes versions README.md claims for deploy/.
KUBERNETES_VERSIONS = ("1.30", "1.31", "1.32", "1.33", "1.34")

KUBECTL_SUITE = "trixie"
"""Debian 13's kubectl 1.32 (package kubectl), its kustomize 5.5: scripts/bootstrap unpacks it."""


def manifests() -> list[Path]:
    """deploy/'s Kubernetes objects: its YAML files but kustomize's own."""
    return sorted(path for path in DEPLOY.glob("*.yaml") if path.name != "kustomization.yaml")


def documents() -> list[dict[str, Any]]:
    found = []
    for path in manifests():
        found += [document for document in yaml.safe_load_all(path.read_text()) if document]
    return found


def unpacked(tool: str, suite: str) -> Path:
    """``tool`` as scripts/bootstrap unpacks it from Debian ``suite`` (scripts/debian-unpack); a skip without it,
    but a failure in CI, which must run every test."""
    path = ROOT / ".deps" / suite / "root" / "usr" / "bin" / tool
    if not os.access(path, os.X_OK):
        missing = f"{tool} is not unpacked in .deps/{suite} (Debian {suite}'s): run scripts/bootstrap"
        if os.environ.get("CI") == "true":
            raise FailTest(f"CI must run every test: {missing}")
        raise SkipTest(missing)
    return path


def kustomized(directory: Path, *options: str) -> str:
    """What ``kubectl kustomize`` makes of ``directory``; FailTest with kubectl's words if it cannot."""
    command = [str(unpacked("kubectl", KUBECTL_SUITE)), "kustomize", *options, str(directory)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise FailTest(f"{shlex.join(command)}:\n{result.stdout}{result.stderr}")
    return result.stdout


def rendered(directory: Path, *options: str) -> list[dict[str, Any]]:
    return [document for document in yaml.safe_load_all(kustomized(directory, *options)) if document]


def by_kind(found: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each object by kind; deploy/ has one of each."""
    kinds = {document["kind"]: document for document in found}
    assert len(kinds) == len(found), [document["kind"] for document in found]
    return kinds


def validate(test: SynchronousTestCase, files: list[str], objects: int) -> None:
    """``files``, ``objects`` Kubernetes objects in all, pass ``kubernetes-validate --strict`` for each version claimed."""
    validate = Path(sys.executable).with_name("kubernetes-validate")
    versions = [f"--kubernetes-version={version}.0" for version in KUBERNETES_VERSIONS]
    command = [str(validate), "--strict", *versions, *files]
    result = subprocess.run(command, capture_output=True, text=True)
    said = result.stdout + result.stderr
    test.assertEqual(result.returncode, 0, f"{shlex.join(command)}:\n{said}")
    test.assertEqual(said.count(" passed for resource "), objects * len(KUBERNETES_VERSIONS), said)


def daemonset() -> dict[str, Any]:
    [found] = [document for document in documents() if document["kind"] == "DaemonSet"]
    return found


class DeployTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.pod = daemonset()["spec"]["template"]["spec"]
        [self.container] = self.pod["containers"]
        self.options = defaults.Options()
        self.options.parseOptions(self.container["args"])

    def test_every_file_passes_kubernetes_validate_strict_for_each_version_claimed(self) -> None:
        validate(self, [str(path) for path in manifests()], len(documents()))

    def test_the_daemonset_runs_koordrp_in_nri_mode_as_containerds_plugin(self) -> None:
        self.assertEqual(self.options["backend-runtime-mode"], "NRI")
        self.assertEqual(self.options["nri-socket"], defaults.DEFAULT_NRI_SOCKET)
        self.assertNotIn("command", self.container)  # the image's entrypoint runs koordrp: args are its options

    def test_what_koordrp_reads_and_writes_is_the_nodes_own(self) -> None:
        mounts = {mount["mountPath"]: mount for mount in self.container["volumeMounts"]}
        volumes = {volume["name"]: volume["hostPath"]["path"] for volume in self.pod["volumes"]}
        for path in (
            str(Path(self.options["nri-socket"]).parent),
            self.options["hook-config-dir"],
            self.options["state-dir"],
            str(Path(KOORDLET["remote-endpoint"]).parent),  # koordlet's socket, as its registration names it
        ):
            self.assertIn(path, mounts)
            self.assertEqual(volumes[mounts[path]["name"]], path)
        self.assertTrue(mounts[self.options["hook-config-dir"]]["readOnly"])
        # NRI tells koordrp all it needs: nothing else of the node's, no socket of containerd's but NRI's.
        self.assertEqual(len(mounts), 4)
        self.assertEqual(self.options.unused(), [])
        self.assertEqual(
            (self.options["hook-config-dir"], self.options["state-dir"]), (defaults.DEFAULT_HOOK_CONFIG_DIR, defaults.DEFAULT_STATE_DIR)
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


class KustomizeTests(SynchronousTestCase):
    """``kubectl kustomize`` (kustomize 5.5, Debian 13's kubectl) on deploy/ and on the example overlay."""

    def test_the_kustomization_is_every_manifest_of_deploy(self) -> None:
        kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
        self.assertEqual(sorted(kustomization["resources"]), [path.name for path in manifests()])

    def test_deploy_renders_the_manifests_as_they_are_and_valid(self) -> None:
        found = rendered(DEPLOY)
        self.assertEqual(by_kind(found), by_kind(documents()))
        output = Path(self.mktemp())
        output.write_text(kustomized(DEPLOY))
        validate(self, [str(output)], len(documents()))

    def test_the_example_overlay_renders_valid(self) -> None:
        output = Path(self.mktemp())
        output.write_text(kustomized(EXAMPLE, "--load-restrictor=LoadRestrictionsNone"))
        validate(self, [str(output)], len(documents()))

    def test_the_example_overlay_changes_the_image_the_nodes_and_mounts_a_further_hook_servers_directory(self) -> None:
        """What its comments say it changes, and nothing else."""
        overlay = by_kind(rendered(EXAMPLE, "--load-restrictor=LoadRestrictionsNone"))
        base = by_kind(rendered(DEPLOY))
        [image] = yaml.safe_load((EXAMPLE / "kustomization.yaml").read_text())["images"]
        pod = overlay["DaemonSet"]["spec"]["template"]["spec"]
        [container] = pod["containers"]

        self.assertEqual(container["image"], f"{image['newName']}:{image['newTag']}")
        self.assertNotEqual(image["newName"], package.IMAGE_NAME)  # a registry's, not the one ctr import makes
        self.assertEqual(image["newTag"], package.project_version())  # this release, as pushed to that registry
        self.assertEqual(pod["nodeSelector"], {"pool": "nri"})  # replaced, not merged with koordrp/nri
        [added] = [mount for mount in container["volumeMounts"] if mount["name"] == "example-hook"]
        [volume] = [volume for volume in pod["volumes"] if volume["name"] == "example-hook"]
        self.assertEqual(volume["hostPath"]["path"], added["mountPath"])  # where the hook server's registration says

        # Undone, those changes leave the base's objects.
        base_pod = base["DaemonSet"]["spec"]["template"]["spec"]
        container["image"] = base_pod["containers"][0]["image"]
        pod["nodeSelector"] = base_pod["nodeSelector"]
        container["volumeMounts"].remove(added)
        pod["volumes"].remove(volume)
        self.assertEqual(overlay, base)
