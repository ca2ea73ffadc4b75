"""The one results file, ``benchmarks/results.json``, and the README's figures table drawn from it.

``python -m benchmarks --record`` measures and calls ``record``: every headline figure and ratio of the run goes into
the file with its target, whether it was met, and where it was measured (the commit, whether the work tree had
uncommitted changes, the date, the load average, the command). A figure a run did not measure keeps its last
record, with that record's own commit: the table says per row which commit measured it.

``python -m benchmarks.results`` redraws the README's table from the file alone; ``--check`` exits 1 when the README
disagrees with it (tests/benchmarks/test_results.py runs that check).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.catalog import RATIOS
from benchmarks.figures import FIGURES, Figure

__all__ = ["README", "RESULTS", "readme_with_table", "record", "table"]

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results.json"
README = ROOT / "README.md"
BEGIN = "<!-- figures: drawn by `python -m benchmarks.results` from benchmarks/results.json; do not edit by hand -->"
END = "<!-- end of figures -->"
_TARGETS = {figure.key: figure for figure in FIGURES}


def _git(*args: str, strip: bool = True) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True, timeout=30).stdout
        return out.strip() if strip else out
    except (OSError, subprocess.SubprocessError):
        return ""


def where_measured(argv: list[str]) -> dict[str, Any]:
    """The commit and what else was true when a run measured: uncommitted changes other than the results file and
    the README (which the record itself writes) make the record say ``dirty``."""
    # Each entry is two status letters, a space and the path; not stripped (" M README.md" would lose its first
    # letter's place and read as "EADME.md", a change).
    entries = _git("status", "--porcelain", "-z", "--untracked-files=no", strip=False).split("\0")
    changed = [entry[3:] for entry in entries if entry[3:] not in ("", "benchmarks/results.json", "README.md")]
    return {
        "commit": _git("rev-parse", "HEAD") or "unknown",
        "dirty": bool(changed),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "cores": os.cpu_count(),
        "command": " ".join(["python -m benchmarks", *argv]),
    }


def _entry(key: str, value: Any, where: dict[str, Any], ratio: dict[str, Any] | None) -> dict[str, Any]:
    figure = _TARGETS.get(key)
    target = figure.target if figure else None
    met: bool | None = None
    if ratio is not None:
        met = bool(ratio["met"])
    elif target is not None and isinstance(value, int | float):
        met = target.met(float(value))
    entry = {"value": value, "target": str(target) if target else None, "met": met, **where}
    if ratio is not None:
        entry["rounds"] = ratio["rounds"]
    return entry


def record(output: dict[str, Any], *, argv: list[str], path: Path = RESULTS, readme: Path = README) -> Path:
    """Merges a run's figures into the results file and redraws the README's table from it."""
    where = where_measured(argv)
    results: dict[str, Any] = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    figures: dict[str, Any] = results.get("figures", {})
    ratios: dict[str, Any] = output.get("ratios", {})
    skip = {"quick", "ratios", "details", "errors", "seconds"}
    for key, value in output.items():
        if key in skip or value is None:
            continue
        figures[key] = _entry(key, value, where, ratios.get(key))
    details: dict[str, Any] = results.get("details", {})
    for name, merged in output.get("details", {}).items():
        details[name] = {**merged, "commit": where["commit"], "date": where["date"]}
    runs = [*results.get("runs", []), {**where, "seconds": output.get("seconds"), "errors": output.get("errors", {})}]
    results = {
        **where,
        "figures": dict(sorted(figures.items())),
        "details": dict(sorted(details.items())),
        "runs": runs[-20:],
    }
    path.write_text(json.dumps(results, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    if readme.exists():
        readme.write_text(readme_with_table(readme.read_text(encoding="utf-8"), results), encoding="utf-8")
    return path


def _number(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, int) or float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:,.3f}".rstrip("0").rstrip(".") if abs(value) < 100 else f"{value:,.1f}"


def _row(figure: Figure, entry: dict[str, Any] | None) -> str:
    target = str(figure.target) if figure.target else "–"
    if entry is None:
        return f"| {figure.what} (`{figure.key}`) | not measured | {target} | – | – |"
    unit = f" {figure.unit}" if figure.unit and figure.unit != "×" else ""
    verdict = {True: "met", False: "**missed**", None: "–"}[entry.get("met")]
    dirty = " + changes" if entry.get("dirty") else ""
    where = f"{str(entry.get('commit', ''))[:10]}{dirty}, {str(entry.get('date', ''))[:10]}"
    rounds = entry.get("rounds")
    shown = _number(entry["value"]) + unit + (f" (rounds {', '.join(_number(r) for r in rounds)})" if rounds else "")
    target_unit = unit if figure.target else ""
    return f"| {figure.what} (`{figure.key}`) | {shown} | {target}{target_unit} | {verdict} | {where} |"


def table(results: dict[str, Any]) -> str:
    """The README's figures table: one row per catalogued figure, the measured value, the target, met or missed,
    and the commit and date that measured it."""
    figures = results.get("figures", {})
    lines = [
        BEGIN,
        "",
        "| figure (`key`) | measured | target | | measured at |",
        "|---|---|---|---|---|",
    ]
    for figure in FIGURES:
        lines.append(_row(figure, figures.get(figure.key)))
    missed = [f.key for f in FIGURES if figures.get(f.key, {}).get("met") is False]
    unmeasured = [f.key for f in FIGURES if f.key not in figures]
    lines += [
        "",
        f"Missed: {', '.join(f'`{k}`' for k in missed) if missed else 'none'}. "
        f"Not measured: {', '.join(f'`{k}`' for k in unmeasured) if unmeasured else 'none'}. "
        f"Ratios: {len(RATIOS)} (their meanings: `benchmarks/catalog.py`).",
        "",
        END,
    ]
    return "\n".join(lines)


def readme_with_table(text: str, results: dict[str, Any]) -> str:
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README.md has no figures table to redraw: put {BEGIN!r} and {END!r} where it goes")
    return text[:start] + table(results) + text[end + len(END) :]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.results", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the README's table is not the file's")
    args = parser.parse_args(argv)
    results = json.loads(RESULTS.read_text(encoding="utf-8"))
    text = README.read_text(encoding="utf-8")
    drawn = readme_with_table(text, results)
    if args.check:
        if drawn != text:
            print("README.md's figures table is not benchmarks/results.json's: run python -m benchmarks.results")
            return 1
        return 0
    README.write_text(drawn, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
