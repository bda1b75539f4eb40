"""The docs say what the code does: the hook table plugin authors read is the flows' own."""

import re
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from koordrp.flows import METHOD_HOOKS
from koordrp.hooks.types import HOOKS_BY_NAME
from koordrp.sdk import (
    ContainerResourceHookRequest,
    ContainerResourceHookResponse,
    HookServer,
    PodSandboxHookRequest,
    PodSandboxHookResponse,
)

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


def python_examples() -> list[tuple[str, str]]:
    """Every ```python block of the docs and the README, with where it is."""
    found = []
    for path in [DOCS.parent / "README.md", *sorted(DOCS.glob("*.md"))]:
        for index, block in enumerate(re.findall(r"^```python\n(.*?)^```", path.read_text(), re.MULTILINE | re.DOTALL)):
            found.append((f"{path.name} example {index + 1}", block))
    return found


class ExampleTests(SynchronousTestCase):
    """The docs' examples run as written: each imports what it uses, and its handlers answer."""

    def test_every_example_runs_and_its_handlers_answer_a_request(self) -> None:
        examples = python_examples()
        self.assertGreaterEqual(len(examples), 2)
        for where, source in examples:
            namespace: dict[str, object] = {"__name__": "docs_example"}  # not __main__: nothing is served
            exec(compile(source, where, "exec"), namespace)
            servers = [value() if isinstance(value, type) else value for value in namespace.values()
                       if isinstance(value, HookServer) or (isinstance(value, type) and issubclass(value, HookServer) and value is not HookServer)]
            self.assertTrue(servers, f"{where} defines no hook server")
            for server in servers:
                for hook, handler in server._handlers.items():
                    request = PodSandboxHookRequest() if hook.is_pod_hook else ContainerResourceHookRequest()
                    answer = handler(request)
                    expected = PodSandboxHookResponse if hook.is_pod_hook else ContainerResourceHookResponse
                    self.assertTrue(answer is None or isinstance(answer, expected), f"{where} {hook.value}: {answer!r}")
