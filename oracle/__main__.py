"""python -m oracle — the promise checked: approve exactly when the policy allows, never otherwise, in time, once,
and lose no document a forwarder read.

  python -m oracle --seeds N [--start S]     N generated runs (fleets, policies, events, hooks, faults, forgeries,
                                             attackers with root on a VM; --no-attackers: without them)
  python -m oracle --seed S                  one generated run again (the reproduction of a finding)
  python -m oracle --scenario FILE [--policy FILE]   one scenario (its policy: policies/<name> beside it)
  python -m oracle --all-scenarios           every scenario in emulators/scenarios/
  python -m oracle check truth.json          judge a saved run again

Prints per run the events with what the oracle allowed and when each approval was due and made, then the counts per
class (wrong, missed, duplicate, late, lost) and each finding with its seed and the command that reproduces it.
Exit 0 with no finding, 1 with some (or a run that could not be played), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections import Counter
from pathlib import Path

from emulators.imds import Scenario, ScenarioError
from local.stack import REPO_ROOT
from oracle import attacks
from oracle.check import check
from oracle.generate import generate
from oracle.run import SCENARIOS, RunResult, policy_for, run_scenario
from oracle.truth import Truth
from oracle.verdict import KINDS, Bounds

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
DEFAULT_WORKDIR = REPO_ROOT / ".local" / "oracle"


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m oracle", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("command", nargs="?", choices=["check"], help="check: judge a saved truth.json again")
    parser.add_argument("truth", nargs="?", type=Path, help="with check: the truth.json to judge")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--seeds", type=int, help="how many generated runs")
    what.add_argument("--seed", type=int, help="one generated run")
    what.add_argument("--scenario", type=Path, help="one scenario file")
    what.add_argument("--all-scenarios", action="store_true", help="every scenario in emulators/scenarios/")
    parser.add_argument("--start", type=int, default=0, help="with --seeds: the first seed (default 0)")
    parser.add_argument("--policy", type=Path, help="with --scenario: the policy (default: its own, or the default)")
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="runtime files, one folder per run")
    parser.add_argument("--save", type=Path, help="write each generated run's scenario and policy to this folder")
    parser.add_argument("--time-scale", type=float, default=120.0, help="scenario runs: the time scale (120)")
    parser.add_argument("--json", action="store_true", help="end with the counts and findings as JSON")
    parser.add_argument(
        "--no-attackers", action="store_true", help="generated runs without the attackers with root on a VM"
    )
    parser.add_argument("--quiet", action="store_true", help="no per-event table")
    parser.add_argument("--explain", action="store_true", help="each event's facts, states and allowed sets too")
    arguments = parser.parse_args(argv)
    if arguments.command == "check" and arguments.truth is None:
        parser.error("check needs the truth.json to judge")
    if arguments.command is None and not (
        arguments.seeds or arguments.seed is not None or arguments.scenario or arguments.all_scenarios
    ):
        parser.error("give --seeds N, --seed S, --scenario FILE, --all-scenarios or check FILE")
    if arguments.seeds is not None and arguments.seeds < 1:
        parser.error("--seeds must be at least 1")
    return arguments


class Tally:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter({kind: 0 for kind in KINDS})
        self.findings: list[dict[str, str]] = []
        self.runs = 0
        self.unfinished: list[str] = []
        self.seconds: list[float] = []
        self.attacks: list[attacks.AttackOutcome] = []

    def add(self, name: str, result: RunResult, reproduce: str, *, quiet: bool, explain: bool = False) -> None:
        self.runs += 1
        self.seconds.append(result.seconds)
        report = result.report
        header = f"── {name}: {result.seconds:.1f} s" + ("" if result.finished else " (did not finish in time)")
        print(header + " " + "─" * max(0, 100 - len(header)), flush=True)
        if not result.finished:
            self.unfinished.append(name)
            print(f"still waiting for: {'; '.join(result.waiting) or '?'}", flush=True)
        lines = report.lines(explain=explain)
        for line in lines if not quiet else lines[-len(report.findings) - 1 :]:
            print(line, flush=True)
        for outcome in (played := attacks.outcomes(result.truth, report)):
            print(outcome.line(report.start), flush=True)
        self.attacks.extend(played)
        self.counts.update(report.counts())
        for finding in report.findings:
            self.findings.append(
                {
                    "run": name,
                    "kind": finding.kind,
                    "event": finding.label,
                    "detail": finding.detail,
                    "reproduce": reproduce,
                }
            )
        print(f"reproduce: {reproduce}   (truth: {result.workdir / 'truth.json'})", flush=True)

    def render(self) -> list[str]:
        total = sum(self.seconds)
        lines = [
            "",
            f"oracle: {self.runs} runs in {total:.0f} s ({total / max(1, self.runs):.1f} s per run, "
            f"max {max(self.seconds, default=0.0):.1f} s)",
            "counts: " + ", ".join(f"{kind} {self.counts[kind]}" for kind in KINDS),
            attacks.summary(self.attacks),
        ]
        if self.unfinished:
            lines.append(f"runs that did not finish in time: {', '.join(self.unfinished)}")
        for f in self.findings:
            lines.append(f"  {f['kind'].upper():<9} {f['run']:<22} {f['event']:<22} {f['detail']}")
            lines.append(f"            reproduce: {f['reproduce']}")
        return lines

    @property
    def ok(self) -> bool:
        return not self.findings and not self.unfinished and not any(o.breach for o in self.attacks)


def _scenario_run(path: Path, policy: Path | None, arguments: argparse.Namespace, tally: Tally) -> None:
    scenario = Scenario.from_file(path)
    policy = policy or policy_for(path)
    result = run_scenario(
        scenario, workdir=arguments.workdir / path.stem, policy_path=policy, time_scale=arguments.time_scale
    )
    command = f"python -m oracle --scenario {path}" + (f" --policy {policy}" if policy else "")
    tally.add(path.stem, result, command, quiet=arguments.quiet, explain=arguments.explain)


def _seed_run(seed: int, arguments: argparse.Namespace, tally: Tally) -> None:
    plan = generate(seed, attackers=not arguments.no_attackers)
    folder = arguments.workdir / f"seed-{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    policy = plan.write(arguments.save or folder)
    result = run_scenario(
        plan.scenario, workdir=folder / "run", policy_path=policy, time_scale=plan.time_scale, timeout=plan.timeout
    )
    tally.add(
        f"seed {seed}", result, f"python -m oracle --seed {seed}", quiet=arguments.quiet, explain=arguments.explain
    )


def main(argv: list[str] | None = None) -> int:
    arguments = _arguments(argv)
    # The pipeline's own logs (a batch that failed, a listener that left) go to a file: the output is the verdict.
    arguments.workdir.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        level=logging.WARNING,
        filename=arguments.workdir / "oracle.log",
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    if arguments.command == "check":
        report = check(Truth.read(arguments.truth), Bounds())
        for line in report.lines(explain=arguments.explain):
            print(line)
        return EXIT_OK if report.ok else EXIT_FAILED
    tally = Tally()
    started = time.monotonic()
    try:
        if arguments.scenario is not None:
            _scenario_run(arguments.scenario, arguments.policy, arguments, tally)
        elif arguments.all_scenarios:
            for path in sorted(SCENARIOS.glob("*.yaml")):
                _scenario_run(path, None, arguments, tally)
        else:
            first = arguments.seed if arguments.seed is not None else arguments.start
            for seed in range(first, first + (arguments.seeds or 1)):
                _seed_run(seed, arguments, tally)
    except ScenarioError as error:
        print(f"oracle: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("oracle: interrupted", file=sys.stderr)
    for line in tally.render():
        print(line)
    print(f"took {time.monotonic() - started:.0f} s")
    if arguments.json:
        played = [
            {"kind": o.forgery.kind, "by": o.forgery.by, "about": o.forgery.about, "sent": o.forgery.sent,
             "refused": len(o.refused), "answered": len(o.forgery.answered), "breach": o.breach,
             "harmless": o.harmless}
            for o in tally.attacks
        ]  # fmt: skip
        verdict = {"counts": dict(tally.counts), "runs": tally.runs, "findings": tally.findings, "attacks": played}
        print(json.dumps(verdict, indent=1))
    return EXIT_OK if tally.ok else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
