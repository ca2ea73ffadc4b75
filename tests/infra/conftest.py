"""End-of-run sections for the infra checks: pytest hides a passing test's output, and the Bicep type check must
say what it checked and what it skipped on every run, not only when it fails."""

from __future__ import annotations

from collections.abc import Callable

import pytest

_SECTIONS = pytest.StashKey[dict[str, str]]()


@pytest.fixture(scope="session")
def end_of_run_section(pytestconfig: pytest.Config) -> Callable[[str, str], None]:
    """Call with (title, text): the text is printed under that title at the end of the run."""

    def add(title: str, text: str) -> None:
        pytestconfig.stash.setdefault(_SECTIONS, {})[title] = text

    return add


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    for title, text in config.stash.get(_SECTIONS, {}).items():
        terminalreporter.write_sep("-", title)
        terminalreporter.write_line(text)
