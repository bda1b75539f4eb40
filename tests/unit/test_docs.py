"""The docs say what the code does, and a reader can follow them: the hook table plugin authors read is the flows'
own, every example runs, every relative link and #anchor in the repository's markdown leads somewhere, no page
grows past what a reader finishes, and nothing cites an issue tracker a reader cannot see."""

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

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

MOST_BYTES = 20_000
"""A page of docs/ a reader finishes; architecture.md, the map of the code, may take more."""
MOST_BYTES_OF = {DOCS / "architecture.md": 25_000, ROOT / "README.md": 10_000}

_NOT_THE_REPOSITORY = {".git", ".venv", ".deps", "build", "dist", "node_modules"}


def doc_pages() -> list[Path]:
    """docs/*.md and the pages under its directories."""
    return sorted([*DOCS.glob("*.md"), *DOCS.glob("*/*.md")])


def markdown_files() -> list[Path]:
    """Every markdown file of the repository (not what tools and builds put beside it)."""
    return sorted(
        path
        for path in ROOT.rglob("*.md")
        if not _NOT_THE_REPOSITORY & set(path.relative_to(ROOT).parts)
        and not any(part.startswith("_trial_temp") or part.endswith(".egg-info") for part in path.relative_to(ROOT).parts)
    )


def prose(text: str) -> str:
    """Markdown without its fenced code blocks and inline code, where a bracket is not a link."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(path: Path) -> set[str]:
    """The #anchors GitHub makes of a markdown file's headings: lower case, punctuation dropped, spaces as
    hyphens, a repeated one numbered."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower()).replace(" ", "-")
        candidate, number = slug, 0
        while candidate in found:
            number += 1
            candidate = f"{slug}-{number}"
        found.add(candidate)
    return found


def links(path: Path) -> list[str]:
    """The targets of a markdown file's inline links, outside code."""
    return re.findall(r"\]\(([^)\s]+)(?: \"[^\"]*\")?\)", prose(path.read_text()))


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
    for path in [ROOT / "README.md", *doc_pages()]:
        for index, block in enumerate(re.findall(r"^```python\n(.*?)^```", path.read_text(), re.MULTILINE | re.DOTALL)):
            found.append((f"{path.relative_to(ROOT)} example {index + 1}", block))
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

    def test_the_first_example_of_the_hook_server_page_is_the_one_the_demo_test_serves(self) -> None:
        """tests/e2e/test_tools.py serves the first ```python block of docs/hook-server.md as pin_me.py."""
        first = (DOCS / "hook-server.md").read_text().split("```python\n", 1)[1].split("```", 1)[0]
        self.assertIn("class PinMe(HookServer)", first)


class LinkTests(SynchronousTestCase):
    def test_the_markdown_is_found(self) -> None:
        found = {path.relative_to(ROOT).as_posix() for path in markdown_files()}
        self.assertLessEqual({"README.md", "docs/operating.md", "docs/hook-server.md", "benchmarks/README.md"}, found)

    def test_the_anchors_are_githubs(self) -> None:
        path = Path(self.mktemp())
        path.write_text("# Writing `a` hook server\n## koordrp and Koordinator's proxy\n## Notes\n## Notes\n"
                        "## passthrough.py: the pass-through path\n```sh\n# not a heading\n```\n")
        self.assertEqual(
            anchors(path),
            {"writing-a-hook-server", "koordrp-and-koordinators-proxy", "notes", "notes-1",
             "passthroughpy-the-pass-through-path"},
        )

    def test_every_relative_link_and_anchor_leads_somewhere(self) -> None:
        broken = []
        for path in markdown_files():
            for target in links(path):
                if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not this repository's
                    continue
                file, _, anchor = target.partition("#")
                linked = (path.parent / file).resolve() if file else path
                where = f"{path.relative_to(ROOT)}: ({target})"
                if not linked.exists():
                    broken.append(f"{where}: no {file}")
                elif anchor and (linked.is_dir() or linked.suffix != ".md" or anchor not in anchors(linked)):
                    broken.append(f"{where}: no #{anchor} in {file or path.name}")
        self.assertEqual(broken, [])


class SizeTests(SynchronousTestCase):
    def test_every_page_is_one_a_reader_finishes(self) -> None:
        for path in [*doc_pages(), ROOT / "README.md"]:
            most = MOST_BYTES_OF.get(path, MOST_BYTES)
            self.assertLessEqual(len(path.read_bytes()), most, f"{path.relative_to(ROOT)} is over {most} bytes")


class IssueNumberTests(SynchronousTestCase):
    def test_nothing_cites_an_issue_by_its_number(self) -> None:
        """A reader of the code, the docs or a benchmark cannot look up an issue by its number: say what it meant instead."""
        cited = re.compile(r"\bissues? #?[0-9]+", re.IGNORECASE)
        found = []
        for top in ("koordrp", "benchmarks", "tests", "docs"):
            for path in sorted((ROOT / top).rglob("*")):
                if path.suffix in (".py", ".md") and "api" not in path.relative_to(ROOT).parts:
                    for number, line in enumerate(path.read_text().splitlines(), 1):
                        if cited.search(line):
                            found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
        for number, line in enumerate((ROOT / "README.md").read_text().splitlines(), 1):
            if cited.search(line):
                found.append(f"README.md:{number}: {line.strip()}")
        self.assertEqual(found, [])
