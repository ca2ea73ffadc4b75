"""python -m benchmarks [--quick] [--only NAME ...] [--runs N] [--record] — every figure the README quotes.

Runs each benchmark (benchmarks/catalog.py: what each runs and what each figure and ratio means, with its target)
in its own process, one after another (the machine is small and shared), several times, and prints ONE JSON object:
the headline figures (medians over runs), ``ratios`` (each the median over rounds of the ratio within one round,
with its target and whether it was met), ``details`` (every figure of every benchmark), ``errors``.

**A run that is not what it claims to measure fails**: each benchmark prints ``problems`` (envelopes not accepted,
unexpected dead letters, approvals or decisions not the expected ones...) and exits 1 with them; the benchmark is
then an error naming them, and this command exits 1.

``--quick`` runs every benchmark once, short: a validity check (every benchmark runs, its keys exist, its run is
valid), no figure to quote; the test command runs it. ``--record`` writes benchmarks/results.json (the commit, the
date, the load average, every figure and ratio with its target) and the README's figures table from it
(``python -m benchmarks.results`` redraws the table from the file alone).

Benchmarks of one group run in turns (one run of each, then the next round), so that a ratio between them is taken
under the same load of this shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.catalog import BENCHES, RATIOS, Bench
from benchmarks.checks import KEEP
from benchmarks.results import record

ROOT = Path(__file__).resolve().parents[1]
# Each run's output and work folder, deleted once the run was valid (.local/ is not in git).
KEPT = ROOT / ".local" / "benchmarks"


class BenchmarkFailed(Exception):
    """A benchmark that did not run, or whose run is not what it claims to measure."""


def ratios(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each ratio whose benchmarks ran: per round (the i-th run of each), then the median."""
    out: dict[str, dict[str, Any]] = {}
    for ratio in RATIOS:
        over = (ratio.numerator, *ratio.worst_of)
        # Each member's own denominator figures (paired), else every member over the one denominator.
        unders = ratio.paired or (ratio.denominator,) * len(over)
        named = (*over, *(figure for under in unders for figure in under))
        rounds = min([len(runs.get(name, [])) for name, _ in named])
        values = []
        for i in range(rounds):
            quotients = [_quotient(runs, i, top, under, ratio.factor) for top, under in zip(over, unders, strict=True)]
            if quotients and all(q is not None for q in quotients):
                values.append(round(max(q for q in quotients if q is not None), 4))
        if values:
            median = round(statistics.median(values), 3)
            out[ratio.key] = {"value": median, "target": ratio.target, "met": median <= ratio.target, "rounds": values}
    return out


def _quotient(
    runs: dict[str, list[dict[str, Any]]],
    i: int,
    top: tuple[str, str],
    under: tuple[tuple[str, str], ...],
    factor: float,
) -> float | None:
    """Round ``i``'s ``top`` figure ÷ (``factor`` × the sum of its ``under`` figures; none: 1); None when one is
    missing or the denominator is 0."""
    value = runs[top[0]][i].get(top[1])
    parts = [runs[name][i].get(key) for name, key in under]
    numbers = [float(p) for p in parts if isinstance(p, int | float)]
    if not isinstance(value, int | float) or len(numbers) < len(parts):
        return None
    base = sum(numbers) if numbers else 1.0
    return float(value) / (factor * base) if base else None


def run_once(bench: Bench, *, quick: bool) -> dict[str, Any]:
    """One run in its own process. Its output and work folder are kept under ``.local/benchmarks/`` and deleted when
    the run was valid: an invalid one is named with the folder that holds its evidence."""
    keep = KEPT / f"{bench.name}-{datetime.now(UTC):%Y%m%dT%H%M%S%f}"
    try:
        result = _run_once(bench, quick=quick, keep=keep)
    except BenchmarkFailed as error:
        raise BenchmarkFailed(f"{error} (its output and files: {keep.relative_to(ROOT)})") from error
    shutil.rmtree(keep, ignore_errors=True)
    return result


def _run_once(bench: Bench, *, quick: bool, keep: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", bench.module, *(bench.quick if quick else bench.full)]
    timeout = bench.quick_timeout if quick else bench.timeout
    keep.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, KEEP: str(keep / "work")}
    try:
        completed = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False, env=env
        )
    except subprocess.TimeoutExpired as error:
        for name, output in (("stdout", error.stdout), ("stderr", error.stderr)):
            text = output.decode(errors="replace") if isinstance(output, bytes) else output or ""
            (keep / name).write_text(text, encoding="utf-8")
        raise BenchmarkFailed(f"{' '.join(command[1:])} did not finish within {timeout:.0f} s") from error
    (keep / "stdout").write_text(completed.stdout, encoding="utf-8")
    (keep / "stderr").write_text(completed.stderr, encoding="utf-8")
    lines = [line for line in completed.stdout.splitlines() if line.startswith("{")]
    result: dict[str, Any] = {}
    if lines:
        try:
            result = json.loads(lines[-1])
        except json.JSONDecodeError as error:
            raise BenchmarkFailed(f"{' '.join(command[1:])} printed no readable JSON: {error}") from error
    problems = result.get("problems")
    if problems:
        raise BenchmarkFailed(f"{' '.join(command[1:])}: its run is not what it measures: {'; '.join(problems)}")
    if completed.returncode != 0 or not lines:
        raise BenchmarkFailed(
            f"{' '.join(command[1:])} exited {completed.returncode}: {completed.stderr.strip()[-600:] or 'no JSON'}"
        )
    if problems is None:
        raise BenchmarkFailed(f"{' '.join(command[1:])} says nothing of its run's validity (no 'problems' key)")
    missing = [key for key in bench.headline if key not in result]
    if missing:
        raise BenchmarkFailed(f"{' '.join(command[1:])} gave no {', '.join(missing)}")
    return result


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Numbers: the median over the runs; anything else: the last run's value."""
    merged: dict[str, Any] = {}
    for key in runs[-1]:
        values = [run.get(key) for run in runs]
        numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
        merged[key] = round(statistics.median(numbers), 3) if len(numbers) == len(values) else values[-1]
    return merged


def headline_name(template: str, merged: dict[str, Any]) -> str:
    vms = merged.get("wave_envelopes", 10_000)
    return template.format(vms=f"{vms // 1000}k" if vms % 1000 == 0 else str(vms))


def run(chosen: list[Bench], *, quick: bool, runs: int | None) -> dict[str, Any]:
    output: dict[str, Any] = {"quick": quick}
    details: dict[str, Any] = {}
    errors: dict[str, str] = {}
    started = time.monotonic()
    runs_of: dict[str, list[dict[str, Any]]] = {b.name: [] for b in chosen}
    done: set[str] = set()
    for bench in chosen:
        if bench.name in done:
            continue
        # The benchmarks of its group, in turns: round 1 of each, then round 2...
        turn = [b for b in chosen if b.group and b.group == bench.group] or [bench]
        rounds = 1 if quick else (runs or max(b.runs for b in turn))
        for _ in range(rounds):
            for member in turn:
                if member.name in errors or (quick and member.full_only):
                    continue
                began = time.monotonic()
                try:
                    runs_of[member.name].append(run_once(member, quick=quick))
                except BenchmarkFailed as error:
                    errors[member.name] = str(error)
                    # A failed round fails the benchmark: its earlier rounds are not its figure either (a median of
                    # fewer rounds than asked, recorded as if whole).
                    runs_of[member.name].clear()
                    print(f"benchmarks: {member.name} FAILED: {error}", file=sys.stderr)
                else:
                    print(f"benchmarks: {member.name} ran in {time.monotonic() - began:.1f} s", file=sys.stderr)
        done.update(b.name for b in turn)
    for bench in chosen:
        results = runs_of[bench.name]
        if not results:
            continue
        merged = median_of(results)
        merged["runs"] = len(results)
        details[bench.name] = merged
        for source, target in bench.headline.items():
            output[headline_name(target, merged)] = merged.get(source)
    output["ratios"] = ratios(runs_of)
    for key, ratio in output["ratios"].items():
        output[key] = ratio["value"]
    output["details"] = details
    output["errors"] = errors
    output["seconds"] = round(time.monotonic() - started, 1)
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs, once each: validity only, no figures")
    parser.add_argument("--only", action="append", choices=[b.name for b in BENCHES], help="run just these")
    parser.add_argument("--runs", type=int, default=None, help="override the number of runs per benchmark")
    parser.add_argument(
        "--record", action="store_true", help="write benchmarks/results.json and the README's figures table"
    )
    args = parser.parse_args(argv)
    if args.record and args.quick:
        parser.error("--record keeps figures to quote: a --quick run has none")
    chosen = [b for b in BENCHES if not args.only or b.name in args.only]
    output = run(chosen, quick=args.quick, runs=args.runs)
    print(json.dumps(output, sort_keys=True))
    if args.record:
        written = record(output, argv=sys.argv[1:] if argv is None else argv)
        print(f"benchmarks: recorded {written}", file=sys.stderr)
    return 1 if output["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
