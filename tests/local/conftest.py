"""End-to-end helpers: run the whole local pipeline (real processes and protocols) on a scenario and judge it."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from emulators.imds import Scenario
from local.observe import TABLE
from local.run import Follower, follow, judge, settle_forwarders
from local.stack import LocalStack
from local.stack_options import StackOptions
from local.summary import RunFacts, Summary
from local.telemetry import Collector, Report
from oracle.check import check
from oracle.collect import collect

# What the oracle's judgement of a run must not find (late approvals are printed, not asserted: tests/oracle).
PROMISE_BROKEN = ("wrong", "missed", "duplicate", "lost")

SCENARIOS = Path(__file__).resolve().parents[2] / "emulators" / "scenarios"
FLEET_DEMO = SCENARIOS / "fleet-demo.yaml"


def history_rows(stack: LocalStack, where: str, *args: Any) -> list[dict[str, Any]]:
    """The history's rows matching ``where``, in the order written; none while the history has no file or table yet
    (a test that polls it may look before the first row)."""
    if not stack.history_path.exists():
        return []
    try:
        with sqlite3.connect(f"file:{stack.history_path}?mode=ro", uri=True) as db:
            db.row_factory = sqlite3.Row
            query = f'SELECT * FROM "{TABLE}" WHERE {where} ORDER BY rowid'
            return [dict(row) for row in db.execute(query, args).fetchall()]
    except sqlite3.OperationalError as error:
        if "no such table" in str(error):  # the file is there, its table not yet
            return []
        raise


def compact_scenario(
    *, evict_at: int = 120, redeploy_at: int = 180, terminate_notice: int = 600, **extra_steps: Any
) -> Scenario:
    """Three VMs and four events, each of a different fate, in about 10 s at time scale 120: a short Freeze on a
    placement group (approve now), a scale-in Terminate (approve after the prepare hook), a Spot eviction (a person
    would decide; it starts at NotBefore) and a Redeploy canceled before it starts (240 scenario seconds later).
    ``evict_at``, ``redeploy_at``: when the Spot eviction and the Redeploy appear (scenario seconds);
    ``terminate_notice``: the scale set's terminateNotBeforeSeconds (Azure allows 300 to 900)."""
    return Scenario.from_mapping(
        {
            "name": "e2e-compact",
            "scaleSets": {"web": {"terminateNotification": True, "terminateNotBeforeSeconds": terminate_notice}},
            "vms": [
                {"name": "web_0", "vmScaleSetName": "web", "placementGroupId": "pg-1"},
                # Same placement group as web_0: web_1 also sees web_0's Freeze while its own scale-in removes it
                # (the coordinator approves through a VM no delete is removing, and a removed reporter alone does not
                # conclude an event web_0 has not reported yet, e.g. during an Event Hubs outage).
                {"name": "web_1", "vmScaleSetName": "web", "placementGroupId": "pg-1"},
                {"name": "spot-0", "priority": "Spot", "isolated": True},
            ],
            "steps": [
                {
                    "at": 0,
                    "create": {"ref": "freeze", "EventType": "Freeze", "Resources": ["web_0"], "DurationInSeconds": 5},
                },
                {
                    "at": 60,
                    "create": {
                        "ref": "scale-in",
                        "EventType": "Terminate",
                        "Resources": ["web_1"],
                        "EventSource": "Platform",
                    },
                },
                # Azure's 30 s Spot notice is ~30 one-second polls; scaled it would be less than one poll of the
                # forwarders, so 240 Azure seconds keep a few polls inside it (docs/local-mode.md, short notices).
                {
                    "at": evict_at,
                    "create": {"ref": "evict", "EventType": "Preempt", "Resources": ["spot-0"], "NoticeSeconds": 240},
                },
                {"at": redeploy_at, "create": {"ref": "redeploy", "EventType": "Redeploy", "Resources": ["web_0"]}},
                {"at": redeploy_at + 240, "cancel": "redeploy"},
            ],
        }
    )


@dataclass
class Outcome:
    stack: LocalStack
    follower: Follower
    finished: bool
    summary: Summary
    facts: RunFacts
    # The run's spans (each approval's trace) and metrics, as written to telemetry.json.
    telemetry: Report

    def judged_ok(self) -> dict[str, dict[str, Any]]:
        """Asserts the run finished in time and held every expectation; its events (the summary's rows) by label."""
        assert self.finished, f"the scenario did not finish in time: waiting for {self.follower.waits}"
        assert self.summary.ok, self.summary.failures
        return {row["label"]: row for row in self.summary.events}

    def figures(self) -> str:
        s = self.summary
        return (
            f"approvals expected {s.approvals_expected} made {s.approvals_made}; envelopes sent {s.envelopes_sent} "
            f"delivered {s.envelopes_delivered}; sightings sent {s.sightings_sent} logged {s.sightings_logged}; "
            f"dead letters {s.dead_letters}"
        )


Runner = Callable[..., Outcome]


@pytest.fixture
def run_pipeline(tmp_path: Path) -> Iterator[Runner]:
    """``run_pipeline(scenario, during=fn(stack), ...)`` starts the stack, calls ``during`` on a thread while the
    scenario plays, follows the history until every event is over, settles the forwarders and judges."""
    stacks: list[LocalStack] = []

    def run(
        scenario: Scenario,
        *,
        time_scale: float = 120.0,
        timeout: float = 90.0,
        during: Callable[[LocalStack], None] | None = None,
        expected_dead_letters: int = 0,
        oracle: bool = False,
        **options: Any,
    ) -> Outcome:
        stack = LocalStack(
            StackOptions(
                scenario=scenario,
                workdir=tmp_path / f"run{len(stacks)}",
                time_scale=time_scale,
                timer_interval=options.pop("timer_interval", 1.0),
                # 2 s heartbeats: the coordinator retires a removed VM after three (local.stack), within a short run.
                heartbeat_interval=options.pop("heartbeat_interval", 2.0),
                **options,
            )
        )
        stacks.append(stack)
        collector = Collector.install()
        collector.begin()
        started = datetime.now(UTC)
        stack.start()
        errors: list[BaseException] = []
        worker = None
        if during is not None:

            def guarded() -> None:
                try:
                    during(stack)
                except BaseException as error:
                    errors.append(error)

            worker = threading.Thread(target=guarded, name="e2e-during", daemon=True)
            worker.start()
        follower, finished = follow(stack, timeout=timeout, printer=print)
        if worker is not None:
            worker.join(timeout=60)
        if errors:
            raise errors[0]
        settle_forwarders(stack)
        if oracle:
            # The oracle's own reading of the run (oracle/check.py), beside the scenario's exact expectations: the
            # shipped scenarios each run once in the suite, here or in tests/oracle.
            report = check(collect(stack, started=started, scenario=scenario))
            print("\n".join(report.lines()))
            broken = [finding.line() for finding in report.findings if finding.kind in PROMISE_BROKEN]
            assert broken == [], "the oracle found the promise broken:\n" + "\n".join(broken)
        follower.pump()
        follower.flush()
        summary, facts = judge(stack, follower, expected_dead_letters=expected_dead_letters)
        outcome = Outcome(stack, follower, finished, summary, facts, collector.finish(stack.workdir))
        print("\n".join(summary.render()))
        print("\n".join(outcome.telemetry.render()))
        print("figures:", outcome.figures())
        return outcome

    yield run
    for stack in stacks:
        stack.stop()
