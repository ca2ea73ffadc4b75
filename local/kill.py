"""The whole-stack kill run (issue 33): the coordinator in its own process (``StackOptions.coordinator_process``),
SIGKILLed at random moments of a scenario whose events the policy approves at once, started again each time as a new
instance, then judged against what the run truly did once everything is at rest: no history row doubled, none
missing, every approval made exactly once. ``python -m local.kill --runs 20 --seed 1`` prints one line per run and
the total; tests/local/test_kill.py runs one.

What the run must have in its history (``local/durability.py`` reads it): an Observation row for every sighting of
every envelope the forwarders stored in the hub; for every event IMDS approved, a Decision row of the decision and
its Approval rows (the intent, ``sending``, and an outcome); for every event, Transition rows that chain from its
first state to the state the coordinator stored; an Alert row for every card written. Doubled: a RecordId twice, or
one fact twice under two RecordIds (a batch replayed whose rows were made again).
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from emulators.imds import Scenario
from local.durability import KillVerdict, at_rest, judge_kills
from local.host import HostProcessOptions
from local.run import Follower
from local.stack import LocalStack
from local.stack_options import StackOptions

log = logging.getLogger("local.kill")

Printer = Callable[[str], None]
# Real seconds the run lasts at most before it is judged as it stands (the judge then names what is missing).
RUN_TIMEOUT = 150.0
# The dead instance's claims expire this fast, and a killed run's rows and cards are taken over by the timer this
# long after: shortened from the SDK's 12 s and the coordinator's 60 s and 30 s so that a run settles within a test.
HOST_OPTIONS = HostProcessOptions(ownership_expiry=3.0, outbox_grace=6.0, alert_grace=6.0)
TIME_SCALE = 15.0
# An hour's notice (240 s here): a run killed between its deciding write and its send is sent again by the timer
# once the approval's in-flight grace has passed (90 s, real seconds: decide.IN_FLIGHT_GRACE) well before NotBefore,
# as in Azure, where that grace is a tenth of a Freeze's 15 minutes. At 15x a 15-minute notice (60 s) would end
# before the grace and the event would go unapproved for a reason of the compressed clock alone.
NOTICE_SECONDS = 3600


def kill_scenario() -> Scenario:
    """Four VMs, eight events the default policy approves at once (5 s Freezes, Reboots a person asked for), one
    every 45 scenario seconds (3 s at 15x), each with ``NOTICE_SECONDS`` of notice: longer than a crashed instance
    takes to be replaced and its decided sends retried, so each is still approvable after a kill."""
    vms = [{"name": f"web_{i}", "vmScaleSetName": "web", "placementGroupId": f"pg-{i}"} for i in range(4)]
    steps = []
    for index in range(8):
        vm = f"web_{index % 4}"
        if index < 4:
            create = {"ref": f"freeze-{index}", "EventType": "Freeze", "Resources": [vm], "DurationInSeconds": 5}
        else:
            create = {"ref": f"reboot-{index}", "EventType": "Reboot", "Resources": [vm], "EventSource": "User"}
        steps.append({"at": 45 * index, "create": {**create, "NoticeSeconds": NOTICE_SECONDS}})
    return Scenario.from_mapping({"name": "kill-coordinator", "vms": vms, "steps": steps})


def kill_schedule(rng: random.Random, kills: int) -> list[tuple[float, float]]:
    """(seconds before the kill, seconds the coordinator stays dead) for each kill: the kills fall anywhere in the
    first ~16 s of the run (the events' arrival, their approvals, starts and completions)."""
    return [(round(rng.uniform(0.5, 5.0), 2), round(rng.uniform(0.0, 1.5), 2)) for _ in range(kills)]


def kill_run(
    workdir: Path, *, seed: int, kills: int = 3, printer: Printer = print, timeout: float = RUN_TIMEOUT
) -> KillVerdict:
    """One run: the scenario plays while the coordinator is killed ``kills`` times at the seed's moments."""
    rng = random.Random(seed)  # noqa: S311 -- moments of a test, not security
    schedule = kill_schedule(rng, kills)
    printer(f"seed {seed}: kills after {[delay for delay, _ in schedule]} s, dead {[down for _, down in schedule]} s")
    options = StackOptions(
        scenario=kill_scenario(),
        workdir=workdir,
        time_scale=TIME_SCALE,
        timer_interval=1.0,
        heartbeat_interval=2.0,
        forwarder_log_level="WARNING",
        coordinator_process=HOST_OPTIONS,
    )
    with LocalStack(options) as stack:
        started = time.monotonic()
        for delay, down in schedule:
            time.sleep(delay)
            stack.kill_coordinator()
            printer(f"  killed at +{time.monotonic() - started:.1f} s")
            time.sleep(down)
            stack.start_coordinator()
        follower = Follower(stack, printer=None)
        deadline = started + timeout
        while time.monotonic() < deadline:
            follower.pump()
            if follower.over():
                break
            time.sleep(0.5)
        else:
            printer(f"  not over after {timeout:g} s: {follower.waits}")
        # At rest: no more envelopes, every one the hub holds consumed, nothing left in the outboxes.
        stack.stop_platform()
        for forwarder in stack.iter_forwarders():
            forwarder.stop(timeout=10)
        waits = at_rest(stack, deadline=max(deadline, time.monotonic() + 30))
        if waits:
            printer(f"  not at rest: {waits}")
        assert stack.coordinator_process is not None
        verdict = judge_kills(stack, seed=seed, kills=stack.coordinator_process.kills, unsettled=waits)
    printer(verdict.line())
    for problem in verdict.problems() + [f"unanswered: {item}" for item in verdict.unanswered]:
        printer(f"  {problem}")
    return verdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m local.kill", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1, help="the first run's seed; run i has seed + i")
    parser.add_argument("--kills", type=int, default=3, help="kills per run")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temporary folder per run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    verdicts: list[KillVerdict] = []
    for index in range(args.runs):
        seed = args.seed + index
        if args.workdir is not None:
            verdicts.append(kill_run(args.workdir / f"kill-{seed}", seed=seed, kills=args.kills))
            continue
        with tempfile.TemporaryDirectory(prefix=f"kill-{seed}-") as folder:
            verdicts.append(kill_run(Path(folder), seed=seed, kills=args.kills))
    print(KillVerdict.total(verdicts))
    return 0 if all(not verdict.problems() for verdict in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
