"""The docs say what the code does: the hook table plugin authors read is the flows' own."""

import re
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from koordrp.flows import METHOD_HOOKS
from koordrp.hooks.types import HOOKS_BY_NAME

DOCS = Path(__file__).resolve().parents[2] / "docs"


class HookTableTests(SynchronousTestCase):
    def test_the_hook_table_names_the_cri_methods_the_flows_call_each_hook_at(self) -> None:
        section = (DOCS / "hook-server.md").read_text().split("\n## The hooks\n", 1)[1].split("\n## ", 1)[0]
        rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", section, re.MULTILINE)
        documented: dict[str, set[str]] = {}
        for hook, methods in rows:
            self.assertIn(hook, HOOKS_BY_NAME)
            for method in re.findall(r"`(\w+)`", methods):
                documented.setdefault(method, set()).add(hook)
        flows = {method: {hook.value for hook in hooks} for method, hooks in METHOD_HOOKS.items() if hooks}
        self.assertEqual(documented, flows)
