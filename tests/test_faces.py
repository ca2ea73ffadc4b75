"""The coordinator's face (coordinator/__init__.py): the names it exports, pinned here so that a change to the face is
a visible diff, each resolving to its module's own object; outside the coordinator only the face is imported (the
import-linter contract ``coordinator-face`` says so for the packages, this test for function_app.py too); and the
face stays lazy, so that importing one coordinator module loads no more than before."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import coordinator

ROOT = Path(__file__).resolve().parent.parent
FACE = ROOT / "coordinator" / "__init__.py"
# Code outside the coordinator that imports it (tests may import its modules: they test them).
OUTSIDE = ("function_app.py", "ops", "local", "oracle", "emulators", "benchmarks")

EXPORTED = [
    "APPROVE_ROLE",
    "ARM_ENDPOINT",
    "Access",
    "AlertKind",
    "ApprovalCallback",
    "ApprovalDeliveryError",
    "ArmClient",
    "ArmOptions",
    "BudgetRecord",
    "CLAIM_PARTITION",
    "Coordinator",
    "CoordinatorSettings",
    "DEFAULT_POLICY_PATH",
    "DEFAULT_SQLITE_PATH",
    "DELIVERY_QUEUE",
    "Decision",
    "DecisionRecord",
    "EVENT_ID",
    "EventRecord",
    "FORM_KEY_NAME",
    "FleetView",
    "FolderCardSink",
    "GateResult",
    "GateState",
    "HistoryRow",
    "HooksOption",
    "IN_RUN_DELIVERY",
    "Match",
    "Options",
    "Parts",
    "Policy",
    "PolicyError",
    "READ_ROLE",
    "RETURNING_TYPES",
    "RETURN_WATCH_LIMIT",
    "RateOption",
    "RawMessage",
    "RelayApprovalSender",
    "Report",
    "Response",
    "Rule",
    "SERVICE_NAME",
    "SequenceOption",
    "SqliteHistory",
    "StateStore",
    "TERMINAL_STATES",
    "TableStateStore",
    "TransactionTableClient",
    "UNPEERED_ALLOWANCE",
    "VmFacts",
    "VmSighting",
    "Wanted",
    "approval_bound",
    "approve",
    "build_coordinator",
    "column_types",
    "couple",
    "evaluate",
    "facts_of",
    "first_match",
    "history_schema",
    "holds_budget",
    "hooks_required",
    "load_policy",
    "needs_fleet",
    "parse_policy",
    "pending_delete",
    "pending_events",
    "remember",
    "request_bound",
    "scale_sets_of",
    "sendable",
    "set_graces",
]


def _sources(*places: str) -> list[Path]:
    paths = [ROOT / place for place in places]
    return sorted(p for path in paths for p in ([path] if path.is_file() else path.rglob("*.py")))


def _submodules() -> set[str]:
    package = ROOT / "coordinator"
    return {p.stem for p in package.glob("*.py") if p.stem != "__init__"} | {
        p.name for p in package.iterdir() if (p / "__init__.py").is_file()
    }


def _type_checking_imports() -> dict[str, tuple[str, ...]]:
    """The face's imports under ``if TYPE_CHECKING:``, module -> names (what mypy reads)."""
    found: dict[str, tuple[str, ...]] = {}
    for node in ast.parse(FACE.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imported in node.body:
                assert isinstance(imported, ast.ImportFrom)
                assert imported.module is not None
                found[imported.module] = tuple(alias.name for alias in imported.names)
    return found


def test_the_face_exports_the_pinned_names_once_each_group_sorted() -> None:
    assert sorted(coordinator.__all__) == EXPORTED
    assert len(set(coordinator.__all__)) == len(coordinator.__all__)
    assert sorted(EXPORTED) == EXPORTED


def test_each_exported_name_resolves_to_its_modules_own_object() -> None:
    homes: dict[str, str] = coordinator._HOME
    assert set(homes) == set(coordinator.__all__)
    for name in coordinator.__all__:
        assert getattr(coordinator, name) is getattr(importlib.import_module(homes[name]), name), name
    assert not hasattr(coordinator, "not_a_name_of_the_face")


def test_the_type_checking_imports_say_what_the_lazy_face_imports() -> None:
    assert _type_checking_imports() == coordinator._MODULES


def test_no_name_of_the_face_shadows_a_submodule() -> None:
    # ``import coordinator.x`` sets the attribute x to the module: a face name x would then be the module.
    assert not set(coordinator.__all__) & _submodules()


def _imports_behind_the_face(path: Path, exported: set[str]) -> list[tuple[int, str]]:
    """Each import of a coordinator module (or of a name the face does not export): its line and what it imports."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("coordinator.")]
        elif isinstance(node, ast.ImportFrom) and node.module == "coordinator":
            names = [f"coordinator.{a.name}" for a in node.names if a.name not in exported]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("coordinator."):
            names = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            first = node.args[0] if node.args else None
            text = first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else ""
            names = [text] if called in ("import_module", "__import__") and text.startswith("coordinator.") else []
        else:
            continue
        found += [(node.lineno, name) for name in names]
    return found


@pytest.mark.parametrize("place", OUTSIDE)
def test_code_outside_the_coordinator_imports_only_its_face(place: str) -> None:
    exported = set(coordinator.__all__)
    found = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in _sources(place)
        for line, name in _imports_behind_the_face(path, exported)
    ]
    assert found == []


def test_the_scan_finds_an_import_behind_the_face(tmp_path: Path) -> None:
    module = tmp_path / "tool.py"
    module.write_text(
        "import coordinator\nimport coordinator.domain.model\nfrom coordinator import Policy, http\n"
        "from coordinator.service import Coordinator\nimport importlib\n"
        "importlib.import_module('coordinator.wiring')\n",
        encoding="utf-8",
    )
    assert _imports_behind_the_face(module, set(coordinator.__all__)) == [
        (2, "coordinator.domain.model"),
        (3, "coordinator.http"),
        (4, "coordinator.service.Coordinator"),
        (6, "coordinator.wiring"),
    ]


def test_no_coordinator_module_imports_the_face() -> None:
    # Inside the coordinator, ``from coordinator import x`` names a submodule: a module importing the face would
    # import every module behind it (and cycle back).
    submodules = _submodules()
    for path in _sources("coordinator"):
        if path == FACE:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == "coordinator" and node.level == 0:
                assert {a.name for a in node.names} <= submodules, f"{path}:{node.lineno}"
            if isinstance(node, ast.Import):
                assert "coordinator" not in {a.name for a in node.names}, f"{path}:{node.lineno}"


LAZY = """
import sys
import coordinator
assert sorted(m for m in sys.modules if m.startswith("coordinator")) == ["coordinator"], sys.modules
import coordinator.domain.model
loaded = sorted(m for m in sys.modules if m.startswith(("coordinator.service", "coordinator.pipeline", "azure")))
assert loaded == [], loaded
"""


def test_the_face_is_lazy_importing_a_module_loads_no_other_wing() -> None:
    done = subprocess.run(
        [sys.executable, "-c", LAZY], check=False, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
