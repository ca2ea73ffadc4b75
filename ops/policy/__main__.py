"""``python -m ops.policy``: check a policy, run its test cases, replay the history through it, report what a shadow
policy (or a dry run) would have done.

Takes a command line; prints results (text, or JSON with --json) and exits 0 when all is well, 1 when test cases
failed or the replay found decisions that would differ, 2 on bad input (a file missing or invalid, a bad option).
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

from coordinator import Decision, Policy, PolicyError, load_policy
from ops import command
from ops.history import parse_since
from ops.policy.adapters import InputError
from ops.policy.cases import CaseResult, cases_path, load_cases, run_case
from ops.policy.exports import read_history
from ops.policy.replay import LIMITS, Replay, replay
from ops.policy.shadow import counterfactuals, summary

OK, DIFFERENT, BAD_INPUT = 0, 1, 2
EPILOG = """exit codes: 0 ok (policy valid; every case passed; no decision would differ),
            1 a test case failed, or the replay found decisions that would differ,
            2 bad input (a file missing or invalid, bad options; the message names the file, line and reason)

examples:
  python -m ops.policy check coordinator/policies/default.yaml
  python -m ops.policy test coordinator/policies/default.yaml      (cases: default.tests.yaml beside it)
  python -m ops.policy simulate --policy my.yaml --history .local/history.sqlite --since 7d
  python -m ops.policy simulate --policy my.yaml --history export.json   (az ... query -o json, or CSV)
  python -m ops.policy shadow-report --history .local/history.sqlite      (COORDINATOR_SHADOW_POLICY_PATH's rows)
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=command.prog("ops.policy"),
        description="Check an approval policy, run its test cases, or replay recorded events through it (what-if).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="validate a policy; errors name the line")
    check.add_argument("policy", type=Path)
    test = commands.add_parser(
        "test", help="run policy test cases (YAML; see ops/policy/cases.py and docs/coordinator.md)"
    )
    test.add_argument("policy", type=Path)
    test.add_argument("cases", type=Path, nargs="*", help="case files (default: POLICY's NAME.tests.yaml beside it)")
    test.add_argument("--json", action="store_true", help="one JSON object per case, then a summary object")
    simulate = commands.add_parser(
        "simulate",
        help="replay the history through a policy; print the decisions that would differ",
        description="History: the local SQLite file, or the Log Analytics table exported as JSON (az monitor "
        "log-analytics query -o json, or the query API's response) or CSV (the portal's export). "
        "Not reconstructed: " + "; ".join(LIMITS) + ".",
    )
    simulate.add_argument("--policy", type=Path, required=True)
    simulate.add_argument("--history", type=Path, required=True, help="SQLite file, .json or .csv export")
    simulate.add_argument("--since", help="replay decisions from this time: 7d, 12h, or ISO-8601")
    simulate.add_argument("--until", help="replay decisions up to this time: 7d (ago), or ISO-8601")
    simulate.add_argument("--json", action="store_true", help="one JSON object per difference, then a summary")
    simulate.add_argument(
        "--gates",
        choices=("passing", "failing", "error"),
        default="passing",
        help="the state every health gate of the policy is taken to be in (the history does not record them)",
    )
    report = commands.add_parser(
        "shadow-report",
        help="what a shadow policy (or a dry run) would have approved, beside what happened",
        description="Per event: when the candidate (COORDINATOR_SHADOW_POLICY's Shadow rows, or with --dry-run the "
        "Decision rows made in dry-run mode) first would have approved it, when the live policy approved it or let "
        "it expire, when the platform started it, and the impact each VM measured. History as for simulate.",
    )
    report.add_argument("--history", type=Path, required=True, help="SQLite file, .json or .csv export")
    report.add_argument("--dry-run", action="store_true", help="the candidate is the live policy in dry-run mode")
    report.add_argument("--json", action="store_true", help="one JSON object per event, then a summary")
    args = parser.parse_args(argv)
    try:
        if args.command == "shadow-report":
            return _shadow_report(args.history, dry_run=args.dry_run, as_json=args.json)
        policy = load_policy(args.policy)
        if args.command == "check":
            print(f"{args.policy}: valid, {len(policy.rules)} rules: {', '.join(r.name for r in policy.rules)}")
            return OK
        if args.command == "test":
            return _test(policy, args.policy, args.cases, as_json=args.json)
        return _simulate(policy, args, as_json=args.json)
    except (PolicyError, InputError) as error:
        print(f"error: {error}", file=sys.stderr)
        return BAD_INPUT


def _shadow_report(path: Path, *, dry_run: bool, as_json: bool) -> int:
    history = read_history(path)
    events = counterfactuals(history.rows, dry_run=dry_run)
    for event in events:
        print(json.dumps(event.to_json()) if as_json else event.line())
    totals = {**summary(events), "setAside": len(history.set_aside)}
    print(json.dumps({"summary": totals}) if as_json else f"summary: {json.dumps(totals)}")
    return OK


def _test(policy: Policy, policy_path: Path, files: list[Path], *, as_json: bool) -> int:
    if not files:
        files = [cases_path(policy_path)]
        if not files[0].is_file():
            raise InputError(f"no test cases for {policy_path}: give CASES, or put them in {files[0]}")
    results = [(path, run_case(policy, case, line=line)) for path in files for case, line in load_cases(path)]
    for path, result in results:
        print(json.dumps(_case_json(path, result)) if as_json else _case_line(path, result))
    count = {status: sum(r.status == status for _, r in results) for status in ("PASS", "FAIL", "ERROR")}
    if as_json:
        print(json.dumps({"summary": {"cases": len(results), **{k.lower(): v for k, v in count.items()}}}))
    else:
        print(f"{len(results)} cases: {count['PASS']} passed, {count['FAIL']} failed, {count['ERROR']} errors")
    return BAD_INPUT if count["ERROR"] else DIFFERENT if count["FAIL"] else OK


def _case_line(path: Path, result: CaseResult) -> str:
    where = f"{path}:{result.line} {result.name}"
    wanted = result.expected.escalation
    expected = f"{result.expected.verdict} by {result.expected.rule}" + _ladder(wanted)
    if result.error:
        return f"ERROR {where}: {result.error}"
    assert result.got is not None
    # The steps reached are shown when there are some, or when the case names them.
    got = f"{result.got.verdict} by {result.got.rule}" + _ladder(
        result.steps if result.steps or wanted is not None else None
    )
    if result.passed:
        return f"PASS  {where}: {got}"
    reason = f" with reason containing {result.expected.reason!r}" if result.expected.reason else ""
    return f"FAIL  {where}: expected {expected}{reason}, got {got} ({result.got.reason})"


def _ladder(steps: list[int] | None) -> str:
    """The escalation steps reached as a case's expect names them (", escalation [1, 2]"); "" for None."""
    return "" if steps is None else f", escalation {steps}"


def _case_json(path: Path, result: CaseResult) -> dict[str, Any]:
    got = result.got
    return {
        "status": result.status.lower(),
        "file": str(path),
        "line": result.line,
        "case": result.name,
        "expected": result.expected.model_dump(),
        "got": _decision_json(got) if got else None,
        "error": result.error or None,
    }


def _decision_json(decision: Decision) -> dict[str, Any]:
    """A case's decision: verdict, rule, reason and the escalation steps reached, each as a Decision row's
    Details.escalation lists a step taken (step, of, do, beforeNotBeforeSeconds, at, owners)."""
    steps = [
        {
            "step": rung.step,
            "of": rung.of,
            "do": rung.do,
            "beforeNotBeforeSeconds": rung.beforeNotBeforeSeconds,
            "at": rung.at.isoformat(),
            "owners": list(rung.owners),
        }
        for rung in decision.escalation
    ]
    return {"verdict": decision.verdict, "rule": decision.rule, "reason": decision.reason, "escalation": steps}


def _simulate(policy: Policy, args: argparse.Namespace, *, as_json: bool) -> int:
    since, until = _bound("--since", args.since), _bound("--until", args.until)
    history = read_history(args.history)
    result = replay(policy, history.rows, since=since, until=until, gates=args.gates)
    for difference in result.differences:
        if as_json:
            print(json.dumps(_difference_json(difference)))
        else:
            print(
                f"{difference.at.isoformat()}  {difference.eventType} {difference.eventId} "
                f"({', '.join(difference.resources)})\n"
                f"    recorded  {difference.recorded.verdict} by {difference.recorded.rule} at "
                f"{_iso(difference.recorded.at)}: {difference.recorded.reason}\n"
                f"    simulated {difference.simulated.verdict} by {difference.simulated.rule} at "
                f"{_iso(difference.simulated.at)}: {difference.simulated.reason}"
            )
    summary = _summary(result, history.source, history.kind, len(history.rows), history.set_aside)
    if as_json:
        print(json.dumps({"summary": summary}))
    else:
        print(
            f"{summary['events']} events, {summary['compared']} decision points replayed from {summary['source']} "
            f"({summary['format']}, {summary['rows']} rows): {summary['differences']} would differ"
        )
        if result.by_person or result.never_decided:
            print(
                f"not compared: decisions by a person: {result.by_person}; events never decided (first seen Started): "
                f"{result.never_decided}"
            )
        for number, why in history.set_aside:
            print(f"set aside: row {number}: {why}")
        for event_id, why in result.failed:
            print(f"not replayed: event {event_id}: {why}")
        # The same for every run: named once here, listed by --help (a block repeated on every run goes unread).
        print(f"not reconstructed from a history ({len(LIMITS)} limits): python -m ops.policy simulate --help")
        if policy.gates:
            print(f"health gates ({', '.join(sorted(policy.gates))}) taken to be {args.gates} (--gates)")
    return DIFFERENT if result.differences else OK


def _bound(option: str, value: str | None) -> datetime | None:
    if value is None:
        return None
    try:
        return parse_since(value)
    except ValueError as error:
        raise InputError(str(error).replace("--since", option)) from error


def _iso(value: datetime | None) -> str:
    return value.isoformat() if value else "-"


def _difference_json(difference: Any) -> dict[str, Any]:
    return {
        "eventId": difference.eventId,
        "eventType": difference.eventType,
        "resources": list(difference.resources),
        "at": difference.at.isoformat(),
        "recorded": {**vars(difference.recorded), "at": _iso(difference.recorded.at)},
        "simulated": {**vars(difference.simulated), "at": _iso(difference.simulated.at)},
    }


def _summary(result: Replay, source: str, kind: str, rows: int, set_aside: list[tuple[int, str]]) -> dict[str, Any]:
    return {
        "source": source,
        "format": kind,
        "rows": rows,
        "setAside": len(set_aside),
        "events": result.events,
        "compared": result.compared,
        "differences": len(result.differences),
        "byPerson": result.by_person,
        "neverDecided": result.never_decided,
        "notReplayed": [{"eventId": e, "reason": why} for e, why in result.failed],
        "notReconstructed": list(LIMITS),
    }


def cli() -> NoReturn:
    """The console command ``sefleet-policy``."""
    command.run(main)


if __name__ == "__main__":
    cli()
