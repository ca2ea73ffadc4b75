"""One run of the whole local stack under the oracle: play a scenario (its local steps included: faults, hostile
senders, gate pages), follow it until every event is over, settle the forwarders, gather the truth and judge it."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from emulators.imds import Scenario
from local.run import follow, settle_forwarders
from local.stack import REPO_ROOT, LocalStack
from local.stack_options import StackOptions
from oracle.check import check
from oracle.collect import collect
from oracle.truth import Truth
from oracle.verdict import Bounds, Report

__all__ = ["SCENARIOS", "RunResult", "policy_for", "run_scenario"]

SCENARIOS = REPO_ROOT / "emulators" / "scenarios"
TRUTH_FILE = "truth.json"
# The coordinator's and runner's warnings and errors during the run (a batch that failed, a delivery that did not
# arrive): what a finding's diagnosis starts from.
PIPELINE_LOG = "pipeline.log"


@contextlib.contextmanager
def _pipeline_log(path: Path) -> Iterator[None]:
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        handler.close()


def policy_for(scenario_path: Path) -> Path | None:
    """A scenario's own policy: its ``policy:`` field (relative to its file), else the default."""
    named = Scenario.from_file(scenario_path).policy
    return Path(named) if named is not None else None


@dataclass
class RunResult:
    truth: Truth
    report: Report
    finished: bool
    seconds: float
    workdir: Path
    # What the run still waited for when it timed out (local.run.Follower.waiting_for); empty when it finished.
    waiting: tuple[str, ...] = ()


def run_scenario(
    scenario: Scenario,
    *,
    workdir: Path,
    policy_path: Path | None = None,
    time_scale: float = 120.0,
    timeout: float = 90.0,
    bounds: Bounds | None = None,
    prepare_hooks: bool = True,
) -> RunResult:
    """Plays ``scenario`` on a fresh stack in ``workdir`` and judges it; ``truth.json`` is left there."""
    began = time.monotonic()
    options = StackOptions(
        scenario=scenario,
        workdir=workdir,
        time_scale=time_scale,
        # As the end-to-end tests run: a tick a second; 2 s heartbeats, so a removed VM retires within the run.
        timer_interval=1.0,
        heartbeat_interval=2.0,
        policy_path=policy_path,
        prepare_hooks=prepare_hooks,
        forwarder_log_level="WARNING",
    )
    started = datetime.now(UTC)
    with LocalStack(options) as stack, _pipeline_log(stack.workdir / PIPELINE_LOG):
        follower, finished = follow(stack, timeout=timeout)
        waiting = () if finished else tuple(follower.waits)
        settle_forwarders(stack)
        truth = collect(stack, started=started, scenario=scenario)
    truth.write(stack.workdir / TRUTH_FILE)
    report = check(truth, bounds)
    return RunResult(truth, report, finished, time.monotonic() - began, stack.workdir, waiting)
