"""deploy/prometheus/: the alerting rules pass promtool's check and their own unit tests, in Prometheus 2 and 3;
every alert has a case that fires it and one that does not, says what to do, and is in docs/operating/metrics.md; and
the rules use only metrics koordrp exports, so that none can rot into an alert that never fires."""

import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.core import Metric
from twisted.internet.defer import succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from koordrp import bounds
from koordrp.checkpoint import NoCheckpoint
from koordrp.hooks import types
from koordrp.metrics import Metrics
from koordrp.store import Store
from koordrp.web import metrics_service
from tests.unit.test_deploy import DEPLOY, ROOT, unpacked

RULES = DEPLOY / "prometheus" / "koordrp.rules.yaml"
RULE_TESTS = DEPLOY / "prometheus" / "koordrp.rules.test.yaml"
OPERATING = ROOT / "docs" / "operating" / "metrics.md"
"""The operator's page that lists the alerts; each alert's description names a section of one of docs/operating/'s pages."""

PROMTOOL_SUITES = ("trixie", "sid")
"""Debian 13's promtool (Prometheus 2.53) and sid's (3.5): Prometheus 3 changed how a range selects its samples,
and the rules hold in both. scripts/bootstrap unpacks them."""

HOOK_RESULTS = {types.HOOK_OK, types.ERROR, types.TIMEOUT, types.LATE, types.NOT_ANSWERING, types.SKIPPED, types.UNREADABLE}
"""The results ``koordrp_hook_calls_total`` counts (``koordrp.metrics``)."""

_SAMPLE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
}
_NOT_NAMES = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset", "bool"}


def rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def alerts() -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for rule in rules() if "alert" in rule}


def promtool(test: SynchronousTestCase, suite: str, *arguments: str) -> str:
    """promtool's output; a failure with all of it when it fails."""
    command = [str(unpacked("promtool", suite)), *arguments]
    result = subprocess.run(command, capture_output=True, text=True)
    said = result.stdout + result.stderr
    test.assertEqual(result.returncode, 0, f"{shlex.join(command)}:\n{said}")
    return said


def exported() -> set[str]:
    """The names of the samples koordrp's /metrics can hold: its registry as ``koordrp.tap.makeService`` builds it
    with --metrics-endpoint (the store, the state files, the endpoint's own collectors), by each family's type, so
    that a labelled metric nothing has counted yet is there too."""
    metrics = Metrics()
    metrics.watch_store(Store())
    metrics.watch_checkpoint(NoCheckpoint())
    metrics_service("tcp:0", metrics, lambda: succeed(None), Clock())
    families: list[Metric] = list(metrics.registry.collect())
    return {family.name + suffix for family in families for suffix in _SAMPLE_SUFFIXES.get(family.type, ("",))}


def metric_names(expression: str) -> set[str]:
    """The metric names a PromQL expression selects: what is left once strings, label matchers, ranges, label lists,
    functions and keywords are taken out."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expression)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for found in re.finditer(r"(?<![\w.])[A-Za-z_:][\w:]*", text):
        if found.group() not in _NOT_NAMES and not text[found.end():].lstrip().startswith("("):
            names.add(found.group())
    return names


def alerts_section() -> str:
    return OPERATING.read_text().split("\n## Alerts\n", 1)[1].split("\n## ", 1)[0]


def hook_results(expression: str) -> set[str]:
    """The values the expression's ``result`` matchers name."""
    return {value for values in re.findall(r'\bresult=~?"([^"]*)"', expression) for value in values.split("|")}


class PromtoolTests(SynchronousTestCase):
    def test_promtool_finds_the_rules_sound(self) -> None:
        for suite in PROMTOOL_SUITES:
            said = promtool(self, suite, "check", "rules", str(RULES))
            self.assertIn(f"SUCCESS: {len(rules())} rules found", said)

    def test_the_rules_pass_their_unit_tests(self) -> None:
        for suite in PROMTOOL_SUITES:
            promtool(self, suite, "test", "rules", str(RULE_TESTS))

    def test_descriptors_alert_while_livez_still_answers_200(self) -> None:
        """At the most descriptors /livez lets koordrp have open under the smallest limit koordrp is given (1024,
        systemd's soft limit, which it raises), the alert has fired: the restart comes after it."""
        limit = 1024
        most = limit - bounds.DESCRIPTOR_RESERVE
        self.assertIsNone(bounds.descriptor_shortage(lambda: (most, limit)))
        self.assertIsNotNone(bounds.descriptor_shortage(lambda: (most + 1, limit)))
        target = 'instance="10.0.0.7:9316", job="koordrp"'
        case = {
            "rule_files": [str(RULES)],
            "evaluation_interval": "1m",
            "tests": [
                {
                    "interval": "1m",
                    "input_series": [
                        # /proc/self/fd, as prometheus_client lists it, has the listing's own descriptor too.
                        {"series": f"process_open_fds{{{target}}}", "values": f"{most + 1}x20"},
                        {"series": f"process_max_fds{{{target}}}", "values": f"{limit}x20"},
                        {"series": f"koordrp_hook_servers{{{target}}}", "values": "1x20"},
                    ],
                    "promql_expr_test": [
                        {
                            "expr": 'ALERTS{alertname="KoordrpFileDescriptorsNearLimit", alertstate="firing"}',
                            "eval_time": "10m",
                            "exp_samples": [
                                {
                                    "labels": 'ALERTS{alertname="KoordrpFileDescriptorsNearLimit", alertstate="firing", '
                                    f'severity="warning", {target}}}',
                                    "value": 1,
                                }
                            ],
                        }
                    ],
                }
            ],
        }
        path = Path(self.mktemp())
        path.write_text(yaml.safe_dump(case))
        for suite in PROMTOOL_SUITES:
            promtool(self, suite, "test", "rules", str(path))


class RuleTests(SynchronousTestCase):
    def test_every_alert_has_a_case_that_fires_it_and_one_where_it_stays_quiet(self) -> None:
        fires: set[str] = set()
        quiet: set[str] = set()
        for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
            for expected in case.get("alert_rule_test", []):
                (fires if expected["exp_alerts"] else quiet).add(expected["alertname"])
        self.assertEqual((fires, quiet), (set(alerts()), set(alerts())))

    def test_the_rules_use_only_metrics_koordrp_exports(self) -> None:
        names = exported()
        self.assertIn("koordrp_ready", names)
        self.assertLessEqual({"process_open_fds", "process_max_fds"}, names)
        for rule in rules():
            used = metric_names(rule["expr"])
            self.assertTrue(used, rule["expr"])
            self.assertLessEqual(used, names, f"{rule['alert']} uses what koordrp does not export: {sorted(used - names)}")
            self.assertLessEqual(hook_results(rule["expr"]), HOOK_RESULTS, rule["alert"])

    def test_the_names_are_read_from_an_expression(self) -> None:
        expression = (
            'sum without (hook) (rate(a_total{result=~"x|y"}[5m])) / on (job) group_left b > 0.8 and c offset 10m'
        )
        self.assertEqual(metric_names(expression), {"a_total", "b", "c"})
        self.assertEqual(hook_results(expression), {"x", "y"})

    def test_every_alert_says_how_bad_what_happened_and_where_to_read_on(self) -> None:
        for name, alert in alerts().items():
            self.assertIn(alert["labels"]["severity"], ("critical", "warning", "info"), name)
            self.assertEqual(set(alert["annotations"]), {"summary", "description"}, name)
            sections = re.findall(r'(docs/operating/[\w-]+\.md), "([^"]+)"', alert["annotations"]["description"])
            self.assertTrue(sections, f"{name}'s description names no section of a page of docs/operating/")
            for page, section in sections:
                path = ROOT / page
                self.assertTrue(path.exists(), f"{name}: no {page}")
                self.assertIn(section, set(re.findall(r"^#+ (.+)$", path.read_text(), re.MULTILINE)), f"{name}: {page}")

    def test_docs_list_every_alert(self) -> None:
        listed = re.findall(r"^\| `(Koordrp\w+)` \|", alerts_section(), re.MULTILINE)
        self.assertEqual(sorted(listed), sorted(alerts()))

    def test_the_docs_scrape_job_and_the_rules_make_a_configuration_prometheus_takes(self) -> None:
        [example] = re.findall(r"^```yaml\n(.*?)^```", alerts_section(), re.MULTILINE | re.DOTALL)
        configuration = {**yaml.safe_load(example), "rule_files": [str(RULES)]}
        path = Path(self.mktemp())
        path.write_text(yaml.safe_dump(configuration))
        for suite in PROMTOOL_SUITES:
            promtool(self, suite, "check", "config", str(path))
