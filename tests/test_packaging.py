"""The Functions package holds everything function_app imports: staged alone, it indexes the same functions."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Every coordinator module is imported too: some are loaded only when a setting turns them on (the Relay sender).
INDEX = """
import importlib, json, pkgutil, sys
sys.path.insert(0, ".")
import coordinator, function_app
for module in pkgutil.walk_packages(coordinator.__path__, "coordinator."):
    importlib.import_module(module.name)
print(json.dumps(sorted(f.get_function_name() for f in function_app.app.get_functions())))
"""


def test_the_staged_app_imports_on_its_own_and_indexes_every_function(tmp_path: Path) -> None:
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "package-functions.sh"), str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    archive = Path(done.stdout.strip().splitlines()[-1])
    names = set(zipfile.ZipFile(archive).namelist())
    assert {"function_app.py", "host.json", "requirements.txt", "contracts/envelope.py"} <= names
    # The coordinator shares only the contracts with the forwarder: no forwarder module and no operator tool ships.
    assert not any(name.startswith(("forwarder/", "ops/")) for name in names)
    contracts = {n for n in names if n.startswith("contracts/") and n.endswith(".py")}
    assert contracts == {f"contracts/{p.name}" for p in (ROOT / "contracts").glob("*.py")}
    assert not any(name.startswith(("tests/", "emulators/", "local/")) or "__pycache__" in name for name in names)
    # -I: neither the repository (cwd of pytest) nor PYTHONPATH may leak in; only the staged folder is on the path.
    indexed = subprocess.run(
        [sys.executable, "-I", "-c", INDEX],
        check=False,
        cwd=tmp_path / "app",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert indexed.returncode == 0, indexed.stderr
    assert json.loads(indexed.stdout.splitlines()[-1]) == [
        "approve_event",
        "continue_approval",
        "ingest_envelopes",
        "ingest_platform_events",
        "pending_events",
        "reevaluate",
    ]
