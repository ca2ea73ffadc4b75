"""Microsoft's Kusto language service (tools/node/kql-check.js, npm @kusto/language-service-next) from Python: parse
and semantic analysis of KQL against the history table of coordinator/history_columns.json, one Node process for
any number of queries."""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECKER = ROOT / "tools" / "node" / "kql-check.js"


@dataclass(frozen=True)
class Diagnostic:
    severity: str
    code: str
    message: str
    line: int
    column: int


@dataclass(frozen=True)
class Analysis:
    name: str
    diagnostics: tuple[Diagnostic, ...]
    # The result's schema as the binder infers it: (name, KQL type) in order.
    columns: tuple[tuple[str, str], ...]

    def problems(self) -> list[str]:
        """Each diagnostic as 'NAME:LINE:COLUMN: severity code message'."""
        return [f"{self.name}:{d.line}:{d.column}: {d.severity} {d.code} {d.message}" for d in self.diagnostics]


def analyze(queries: dict[str, str]) -> dict[str, Analysis]:
    """{name: KQL text} -> {name: Analysis}."""
    node = shutil.which("node")
    assert node, "node is not on PATH: the Kusto language service runs in Node (scripts/bootstrap.sh)"
    assert (ROOT / "tools" / "node" / "node_modules" / "@kusto" / "language-service-next").is_dir(), (
        "tools/node/node_modules lacks @kusto/language-service-next: run bash scripts/bootstrap.sh"
    )
    request = {"queries": [{"name": name, "text": text} for name, text in queries.items()]}
    done = subprocess.run(
        [node, str(CHECKER), "--json"],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, f"kql-check.js failed: {done.stderr}"
    results = {}
    for item in json.loads(done.stdout):
        results[item["name"]] = Analysis(
            name=item["name"],
            diagnostics=tuple(Diagnostic(**d) for d in item["diagnostics"]),
            columns=tuple((c["name"], c["type"]) for c in item["columns"]),
        )
    return results


def analyze_one(name: str, text: str) -> Analysis:
    return analyze({name: text})[name]
