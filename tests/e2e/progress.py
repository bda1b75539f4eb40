"""A line on the terminal as each test module starts, and one when it ends, with its outcome and duration:

    == tests/e2e/test_hooks.py (57 tests; 63 of 420 done)
    .........................................................
       tests/e2e/test_hooks.py: 57 passed in 212 s

The end-to-end suite runs for many minutes, most tests taking seconds each: dots alone do not say where it is,
nor which module is slow. pytest's own lines (its dots, failures and summary) are left as they are.
"""

import time
from collections import Counter
from typing import Generator

import pytest

# pytest's words for a report's outcome, in the order its summary line names them.
ORDER = ("failed", "passed", "skipped", "deselected", "xfailed", "xpassed", "warnings", "error")


class ModuleProgress:
    """Registered by tests/e2e/conftest.py; says nothing without pytest's terminal (``-p no:terminal``)."""

    def __init__(self, config: pytest.Config) -> None:
        self._config = config
        self._left: Counter[str] = Counter()
        """Tests of each module not finished yet: a module ends with its last, teardown included."""
        self._total = 0
        self._done = 0
        self._outcomes: dict[str, Counter[str]] = {}
        self._started: dict[str, float] = {}
        self._ended: set[str] = set()

    def _line(self, text: str) -> None:
        terminal = self._config.pluginmanager.get_plugin("terminalreporter")
        if not isinstance(terminal, pytest.TerminalReporter):
            return
        # pytest's dots leave the line open, and under -q its write_line() does not close it. Its writer is
        # private: without it (another pytest), a line may follow dots on theirs.
        writer = getattr(terminal, "_tw", None)
        if getattr(writer, "width_of_current_line", 0):
            terminal.write("\n")
        terminal.write_line(text)

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self._left = Counter(module(item.nodeid) for item in session.items)
        self._total = len(session.items)

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        name = module(nodeid)
        if name not in self._started:
            self._started[name] = time.monotonic()
            self._outcomes.setdefault(name, Counter())
            count = self._left[name]
            self._line(f"== {name} ({count} test{'' if count == 1 else 's'}; {self._done} of {self._total} done)")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # Counted as pytest's summary counts them: a failed setup is an error, a skip in setup a skip.
        category = self._config.hook.pytest_report_teststatus(report=report, config=self._config)[0]
        if category:
            self._outcomes.setdefault(module(report.nodeid), Counter())[category] += 1

    # After pytest's terminal has written the test's dot.
    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        name = module(nodeid)
        self._left[name] -= 1
        self._done += 1
        # The last module's line waits for pytest's closing [100%], which would otherwise stand on a line of its own.
        if self._left[name] == 0 and self._done < self._total:
            self._end(name)

    # Outermost: its end comes after pytest's terminal has closed the run's last line of dots.
    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtestloop(self) -> Generator[None, object, object]:
        try:
            return (yield)
        finally:
            # The last module, and any a failure (-x) or Ctrl-C cut short.
            for name in list(self._started):
                self._end(name)

    def _end(self, name: str) -> None:
        if name in self._ended:
            return
        self._ended.add(name)
        seconds = time.monotonic() - self._started[name]
        left = self._left[name]
        cut = f" ({left} not run: the run stopped)" if left else ""
        self._line(f"   {name}: {outcome_text(self._outcomes[name])} in {seconds:.0f} s{cut}")


def module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def outcome_text(outcomes: Counter[str]) -> str:
    """As pytest's summary line says it: ``55 passed, 2 skipped``."""
    named = sorted(outcomes, key=lambda word: ORDER.index(word) if word in ORDER else len(ORDER))
    words = [f"{outcomes[word]} {'errors' if word == 'error' and outcomes[word] > 1 else word}" for word in named]
    return ", ".join(words) or "nothing run"
