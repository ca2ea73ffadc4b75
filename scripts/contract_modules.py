"""Prints the forwarder's contract modules, one a line (e.g. ``envelope``): the forwarder modules the Functions app
may import, read from their one declaration, the ``forwarder-contracts`` import-linter contract in pyproject.toml.

scripts/package-functions.sh ships exactly these (with ``forwarder/__init__.py``); tests/test_packaging.py checks
the staged app against them; ``lint-imports`` (scripts/test.sh) refuses any other forwarder import.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONTRACT_ID = "forwarder-contracts"


def contract_modules(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    config = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    contracts = config["tool"]["importlinter"]["contracts"]
    contract = next(c for c in contracts if c.get("id") == CONTRACT_ID)
    modules = []
    for rule in contract["ignore_imports"]:
        target = rule.split("->")[1].strip()
        package, _, module = target.partition(".")
        if package != "forwarder" or not module or "." in module:
            raise ValueError(f"{CONTRACT_ID}: {rule!r} must name one module of the forwarder package")
        modules.append(module)
    return modules


if __name__ == "__main__":
    sys.stdout.write("".join(f"{module}\n" for module in contract_modules()))
