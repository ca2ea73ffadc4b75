"""The size rules, kept: no module over 450 lines and no function over 60 in any package the project ships or runs
(tests apart), except those named below, each with why it is still over and the most it may hold. A named module or
function may shrink, never grow; once it is within the rule it must leave the list (the list only shrinks)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("contracts", "coordinator", "forwarder", "ops", "local", "oracle", "emulators", "benchmarks")
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60

# Module -> (lines at most, why it is still over). To split, one role per module (issue 36).
LARGE_MODULES: dict[str, tuple[int, str]] = {}

# Function (path:qualified name) -> (lines at most, why it is still over).
LONG_FUNCTIONS: dict[str, tuple[int, str]] = {
    "benchmarks/dead_listeners.py:run": (93, "one benchmark run, its stack and its figures"),
    "benchmarks/eventhub_hop.py:run": (66, "one benchmark run, its stack and its figures"),
    "benchmarks/forwarder_footprint.py:measure": (148, "each forwarder mode started, sampled and compared"),
    "benchmarks/hop.py:figures": (62, "the whole-stack hop's figures from one run's spans"),
    "benchmarks/pipeline_latency.py:run": (83, "one benchmark run, its stack and its figures"),
    "benchmarks/wave.py:_run": (81, "one wave: prepare, send, drain, count"),
    "coordinator/domain/cards.py:build_card": (78, "one Adaptive Card's facts, in the order people read them"),
    "coordinator/domain/evaluation.py:_hold": (63, "each hold kind's reason, one branch each"),
    "coordinator/domain/event_merge.py:_apply_listed": (71, "a sighting merged: conflicts, reopening, Started"),
    "coordinator/domain/observations.py:vm_observations": (82, "one VM's envelopes read in order against its position"),
    "coordinator/pipeline/fold.py:commit_events": (66, "a batch's events committed with their outbox rows"),
    "coordinator/pipeline/people.py:approve_manually": (72, "a person's approval: checks, decision, send"),
    "coordinator/pipeline/positions.py:write_vm_groups": (69, "groups written in one transaction, else one by one"),
    "forwarder/hooks.py:HookRunner._run_one": (84, "one hook process: start, budget, kill, report"),
    "forwarder/poller.py:Poller.poll_once": (98, "one poll: read, compare, spool, queue hooks, measure impact"),
    "local/__main__.py:main": (80, "the local command's options and its run"),
}


# Code a tool writes is not read or changed by hand: contracts/wire_validators.py (fastjsonschema's, from the
# models' schemas; tests/forwarder/test_wire.py holds it to what `python -m contracts.generate` writes).
GENERATED = ("contracts/wire_validators.py",)


def _modules() -> list[Path]:
    paths = (path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))
    return sorted(path for path in paths if path.relative_to(ROOT).as_posix() not in GENERATED)


def _functions(path: Path) -> dict[str, int]:
    """Each function's lines by qualified name (a method as Class.name)."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                assert child.end_lineno is not None
                found[f"{prefix}{child.name}"] = child.end_lineno - child.lineno + 1
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(path.read_text(encoding="utf-8")), "")
    return found


def test_no_module_is_over_its_size() -> None:
    over = []
    for path in _modules():
        name = path.relative_to(ROOT).as_posix()
        lines = len(path.read_text(encoding="utf-8").splitlines())
        limit = LARGE_MODULES.get(name, (MAX_MODULE_LINES, ""))[0]
        if lines > limit:
            over.append(f"{name}: {lines} lines (at most {limit})")
    assert not over, "split by role (one role per module):\n" + "\n".join(over)


def test_no_function_is_over_its_size() -> None:
    over = []
    for path in _modules():
        name = path.relative_to(ROOT).as_posix()
        for function, lines in _functions(path).items():
            limit = LONG_FUNCTIONS.get(f"{name}:{function}", (MAX_FUNCTION_LINES, ""))[0]
            if lines > limit:
                over.append(f"{name}:{function}: {lines} lines (at most {limit})")
    assert not over, "split the function:\n" + "\n".join(over)


@pytest.mark.parametrize("table", [LARGE_MODULES, LONG_FUNCTIONS], ids=["modules", "functions"])
def test_the_exceptions_only_shrink(table: dict[str, tuple[int, str]]) -> None:
    """Every exception still exists and is still over the rule (else it leaves the list), and says why."""
    sizes: dict[str, int] = {}
    for path in _modules():
        name = path.relative_to(ROOT).as_posix()
        sizes[name] = len(path.read_text(encoding="utf-8").splitlines())
        sizes.update({f"{name}:{function}": lines for function, lines in _functions(path).items()})
    rule = MAX_MODULE_LINES if table is LARGE_MODULES else MAX_FUNCTION_LINES
    stale = [f"{name}: {sizes.get(name, 0)} lines" for name in table if sizes.get(name, 0) <= rule]
    assert not stale, "within the rule now: take these off the list:\n" + "\n".join(stale)
    assert all(reason for _, reason in table.values())


def test_the_rule_catches_a_module_that_grows(tmp_path: Path) -> None:
    """The counting itself: a function of 61 lines and a class's method are found by their qualified names."""
    body = "\n".join(f"    x{n} = {n}" for n in range(60))
    path = tmp_path / "m.py"
    path.write_text(f"def f():\n{body}\n\n\nclass C:\n    def g(self):\n        return 1\n", encoding="utf-8")
    assert _functions(path) == {"f": 61, "C.g": 2}


# The front door and the docs a newcomer reads (issue 36): the README says what, the two commands, deploy, query,
# the figures and what is not done, at length in docs/; no docs page is a book.
MAX_README_LINES = 300
MAX_DOC_PAGE_LINES = 600


def test_the_readme_and_each_docs_page_stay_readable() -> None:
    readme = _lines(ROOT / "README.md")
    over = [f"README.md: {readme} lines (at most {MAX_README_LINES})"] if readme > MAX_README_LINES else []
    over += [
        f"{page.relative_to(ROOT).as_posix()}: {_lines(page)} lines (at most {MAX_DOC_PAGE_LINES})"
        for page in sorted((ROOT / "docs").glob("*.md"))
        if _lines(page) > MAX_DOC_PAGE_LINES
    ]
    assert not over, "say it shorter, or split the page by topic:\n" + "\n".join(over)


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())
