"""The import rules of pyproject.toml (lint-imports, run by scripts/test.sh) hold here, and fail on a forbidden import.

The check runs on a copy of the repository's Python packages, once as they are and once with one forbidden import
added, so the rules are shown to catch what they forbid, not merely to pass.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("contracts", "coordinator", "forwarder", "ops", "local", "oracle", "emulators", "benchmarks", "tests")
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _copy(tmp_path: Path) -> Path:
    copy = tmp_path / "repo"
    copy.mkdir()
    for package in PACKAGES:
        shutil.copytree(ROOT / package, copy / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", copy)
    return copy


def _lint(copy: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=copy,
        env={**os.environ, "PYTHONPATH": str(copy)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    ("module", "forbidden", "broken"),
    [
        ("contracts/envelope.py", "import coordinator.service", "the contracts import nothing of the project"),
        ("forwarder/daemon.py", "import coordinator.service", "the forwarder (installed alone on each VM)"),
        ("coordinator/pipeline/act.py", "import local.direct_callback", "the Functions app imports no tool"),
        ("coordinator/pipeline/record.py", "import ops.cost", "the Functions app imports no tool"),
        ("coordinator/service.py", "import oracle.check", "the Functions app imports no tool"),
        ("forwarder/daemon.py", "import oracle.truth", "the forwarder (installed alone on each VM)"),
        ("forwarder/poller.py", "import pydantic", "the forwarder imports no pydantic"),
        ("forwarder/sender.py", "import contracts.envelope", "the forwarder imports no pydantic"),
        ("contracts/wire.py", "import azure.core", "the forwarder imports no pydantic"),
        ("oracle/check.py", "import tests.coordinator.helpers", "nothing imports tests"),
        ("coordinator/pipeline/fold.py", "import forwarder.daemon", "share only the contracts"),
        ("coordinator/domain/event_merge.py", "import coordinator.pipeline.fold", "nothing imports up"),
        ("coordinator/state/tables.py", "import coordinator.adapters.gates", "nothing imports up"),
        ("coordinator/domain/evaluation.py", "import requests", "the coordinator's domain is pure"),
        ("local/timeline.py", "import tests.coordinator.helpers", "nothing imports tests"),
        ("ops/cost.py", "import coordinator.domain.model", "outside the coordinator, only its face is imported"),
        ("local/run.py", "from coordinator import http", "outside the coordinator, only its face is imported"),
    ],
)
def test_the_import_rules_hold_and_a_forbidden_import_breaks_them(
    tmp_path: Path, module: str, forbidden: str, broken: str
) -> None:
    copy = _copy(tmp_path)
    kept = _lint(copy)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    assert "0 broken" in kept.stdout
    target = copy / module
    target.write_text(target.read_text(encoding="utf-8") + f"\n{forbidden}  # noqa\n", encoding="utf-8")
    refused = _lint(copy)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert f"{broken}" in refused.stdout
    assert "BROKEN" in refused.stdout
