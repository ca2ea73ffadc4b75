"""python -m local — the whole pipeline on this machine, no Azure account.

Plays a scenario in the IMDS emulator for several simulated VMs, runs one forwarder process per VM (AMQP to the
Event Hubs emulator), feeds Event Hubs batches and timer ticks to the same function_app functions the Functions host
would call (state in Azurite, history in SQLite, cards in a folder), sends approvals through the Relay emulator back
to the forwarders, prints a live timeline and a summary with each approval's trace, and writes the run's telemetry
(spans and metrics, local/telemetry.py) to telemetry.json in the work folder. Exit 0 when every expectation of the run
held, 1 when one failed or the run did not finish in time, 2 on bad arguments (a scenario or policy that cannot be
used is one: it is refused before anything starts). With --json, stdout holds exactly one JSON document, the
summary; everything else goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from pathlib import Path

from emulators.azurite import AzuriteError
from emulators.imds import Scenario, ScenarioError
from local.child import interrupt_on
from local.run import follow, history_command, judge, policy_problem, settle_forwarders
from local.stack import REPO_ROOT, LocalStack
from local.stack_options import StackOptions
from local.telemetry import REPORT_FILE, Collector
from local.workdir import WorkdirBusy

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
DEFAULT_SCENARIO = REPO_ROOT / "emulators" / "scenarios" / "fleet-demo.yaml"


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m local", description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", type=Path, default=DEFAULT_SCENARIO, help="IMDS emulator scenario (YAML/JSON)")
    parser.add_argument("--time-scale", type=float, default=60.0, help="60: a 15-minute notice lasts 15 s")
    parser.add_argument("--poll-interval", type=float, default=1.0, help="forwarder IMDS poll interval, seconds")
    parser.add_argument("--timer-interval", type=float, default=2.0, help="seconds between reevaluate ticks")
    parser.add_argument("--timeout", type=float, default=240.0, help="give up (exit 1) after this many seconds")
    parser.add_argument("--workdir", type=Path, default=REPO_ROOT / ".local", help="runtime files (default .local/)")
    parser.add_argument(
        "--policy",
        type=Path,
        default=None,
        help="approval policy (default: the scenario's own, else the coordinator's)",
    )
    parser.add_argument("--no-prepare-hooks", action="store_true", help="give the forwarders no prepare hook")
    parser.add_argument(
        "--http-port",
        type=int,
        default=0,
        help="the people's pages (approval links, /api/events) behind the sign-in stand-in; 0: a free port",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the summary as one JSON document on stdout (the rest on stderr)"
    )
    parser.add_argument("--quiet", action="store_true", help="no live timeline")
    arguments = parser.parse_args(argv)
    if arguments.time_scale <= 0:
        parser.error("--time-scale must be > 0")
    if arguments.timeout <= 0:
        parser.error("--timeout must be > 0")
    if not 0 <= arguments.http_port <= 65535:
        parser.error("--http-port must be 0..65535")
    return arguments


def main(argv: list[str] | None = None) -> int:
    arguments = _arguments(argv)
    logging.basicConfig(level=logging.ERROR, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        scenario = Scenario.from_file(arguments.scenario)
    except ScenarioError as error:
        print(f"local: {error}", file=sys.stderr)
        return EXIT_USAGE
    options = StackOptions(
        scenario=scenario,
        workdir=arguments.workdir,
        time_scale=arguments.time_scale,
        poll_interval=arguments.poll_interval,
        timer_interval=arguments.timer_interval,
        prepare_hooks=not arguments.no_prepare_hooks,
        policy_path=arguments.policy,
        http_port=arguments.http_port,
    )
    # Refused before anything starts: a coordinator given a policy it cannot load fails every batch until --timeout.
    problem = policy_problem(options)
    if problem is not None:
        print(f"local: {problem}", file=sys.stderr)
        return EXIT_USAGE
    if scenario.policy is not None and not options.scenario_policy:
        print(
            f"local: --policy {options.policy} replaces the scenario's own {scenario.policy}: the expectations are "
            "its rules' alone (the scenario's expect: are for its own)",
            file=sys.stderr,
        )
    # With --json, stdout is the summary's JSON document alone, so that it pipes into jq; people read stderr.
    human = sys.stderr if arguments.json else sys.stdout

    def say(line: str) -> None:
        print(line, file=human, flush=True)

    interrupt_on(signal.SIGINT, signal.SIGTERM)  # a child being started is held first (local/child.py)
    started = time.monotonic()
    printer = None if arguments.quiet else say
    # Before the stack starts: the coordinator records from its first batch on.
    collector = Collector.install()
    collector.begin()
    try:
        with LocalStack(options) as stack:
            assert stack.imds is not None
            say(
                f"local: scenario {scenario.name!r}, {len(scenario.vms)} VMs, time scale {arguments.time_scale:g}, "
                f"policy {options.policy}; runtime files in {stack.workdir}; forwarder logs in {stack.logs_dir}"
            )
            people = ", ".join(person.upn for person in options.people)
            say(f"local: open events at {stack.people_url}/api/events (sign in as: {people})")
            if printer is not None:
                say(f"{'time':<14}{'event':<19}{'type':<10}{'step':<11}{'since seen':>11}  detail")
            follower, finished = follow(stack, timeout=arguments.timeout, printer=printer)
            settle_forwarders(stack)
            follower.pump()
            follower.flush()
            summary, _facts = judge(stack, follower)
            if not finished:
                summary.failures.append(
                    f"the run did not finish within --timeout {arguments.timeout:g} s; open: "
                    + ", ".join(follower.timeline.label(e) for e in follower.timeline.open_events())
                )
            for line in summary.render():
                say(line)
            telemetry = collector.finish(stack.workdir)
            for line in telemetry.render():
                say(line)
            say(f"telemetry (spans of each approval, metrics): {stack.workdir / REPORT_FILE}")
            say(f"cards: {stack.cards_dir} ({len(list(stack.cards_dir.glob('*')))} files)")
            say(f"query the history: {history_command(stack)}")
            say(f"run took {time.monotonic() - started:.1f} s")
            if arguments.json:
                print(json.dumps(summary.as_dict(), indent=2, sort_keys=True, default=str), flush=True)
            return EXIT_OK if summary.ok else EXIT_FAILED
    except KeyboardInterrupt:
        print("local: interrupted; every child process was stopped", file=sys.stderr)
        return 130
    except (AzuriteError, WorkdirBusy) as error:
        print(f"local: {error}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
