"""An escalation ladder through the whole local pipeline (real processes and protocols), with the escalation-ladder
scenario as it ships and under the oracle, which judges each step's time by its own reading of the policy: nobody
approves a Reboot or a Redeploy; 70 s before NotBefore each ladder tells the owner, 60 s before it the Reboot's
approves it anyway (its VM checks NotBefore is that near on its own clock) and the Redeploy's holds it. The history
has one Decision row per step, at its time; each step has its card. A candidate that would approve both at once
runs in the shadow: its verdicts are rows, nothing it decides is sent, and the counterfactual report
(``ops.policy shadow-report``) sets them beside what the live policy and the platform did."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

import pytest

from emulators.imds import Scenario
from ops.policy.exports import read_history
from ops.policy.shadow import counterfactuals
from tests.local.conftest import SCENARIOS, Runner, history_rows

# A step is taken by the first run at or after its time: the local timer ticks each second; a run takes a moment.
TAKEN_WITHIN = timedelta(seconds=5)


def steps_taken(rows: list[dict[str, Any]]) -> list[tuple[int, str, list[str], datetime, datetime]]:
    """Each step a Decision row took: its number, action, owners, its time and the row's."""
    taken = []
    for row in rows:
        details = row["Details"] if isinstance(row["Details"], dict) else json.loads(row["Details"] or "{}")
        for step in details.get("escalation", []):
            at = datetime.fromisoformat(step["at"])
            taken.append((step["step"], step["do"], step["owners"], at, datetime.fromisoformat(row["TimeGenerated"])))
    return taken


@pytest.mark.slow
def test_each_step_is_taken_once_at_its_time_the_reboot_approved_anyway_the_redeploy_held(
    run_pipeline: Runner,
) -> None:
    outcome = run_pipeline(
        Scenario.from_file(SCENARIOS / "escalation-ladder.yaml"), time_scale=120.0, timeout=150.0, oracle=True
    )
    events = outcome.judged_ok()
    assert {label: row["expected"] for label, row in events.items()} == {
        "reboot-approved-anyway": "approve",
        "redeploy-held": "no-approval",
    }
    reboot, redeploy = events["reboot-approved-anyway"], events["redeploy-held"]
    assert reboot["approvedThrough"] == "web_0"

    for event, owner, last in ((reboot, "team-web", "approve"), (redeploy, "dba-oncall", "hold")):
        rows = history_rows(outcome.stack, "RecordType = 'Decision' AND EventId = ?", event["eventId"])
        taken = steps_taken(rows)
        assert [(step, do, owners) for step, do, owners, _, _ in taken] == [(1, "notify", [owner]), (2, last, [])]
        for _, _, _, at, when in taken:
            assert at <= when <= at + TAKEN_WITHIN, (at, when)
        cards = {p.name for p in outcome.stack.cards_dir.iterdir() if p.name.startswith(event["eventId"])}
        assert f"{event['eventId']}-escalation-1.json" in cards, cards
        # The last step's card: its own, or (one card per event per run) the card of an alert raised in the same
        # run, naming the step: an approving step's alert rides on the approval's card.
        said = [(outcome.stack.cards_dir / name).read_text() for name in sorted(cards)]
        assert any(f"Escalation step 2 of 2: {last}" in text for text in said), cards
        if last == "approve":
            assert f"{event['eventId']}-escalation-2.json" not in cards, cards

    approvals = history_rows(
        outcome.stack, "RecordType = 'Approval' AND EventId = ? AND Outcome = 'approved'", reboot["eventId"]
    )
    assert len(approvals) == 1
    assert (
        "approved anyway"
        in history_rows(
            outcome.stack, "RecordType = 'Decision' AND EventId = ? AND Outcome = 'approve'", reboot["eventId"]
        )[0]["Reason"]
    )

    # The candidate in the shadow: each event once, "approve" from first sight; nothing of it sent (one approval in
    # all, the ladder's), and the report puts it beside the live policy's and the platform's times.
    shadows = history_rows(outcome.stack, "RecordType = 'Shadow'")
    assert sorted((row["EventId"], row["Outcome"], row["Actor"]) for row in shadows) == sorted(
        (event["eventId"], "approve", "shadow:reboots-and-redeploys-now") for event in (reboot, redeploy)
    )
    report = {item.eventId: item for item in counterfactuals(read_history(outcome.stack.history_path).rows)}
    approved_live, held_live = report[reboot["eventId"]], report[redeploy["eventId"]]
    assert approved_live.wouldApproveAt is not None
    assert approved_live.liveApprovedAt is not None
    assert approved_live.wouldApproveAt < approved_live.liveApprovedAt  # the candidate at once, the ladder 60 s before
    assert held_live.wouldApproveAt is not None
    assert held_live.liveApprovedAt is None
    assert held_live.expiredAt is not None
    assert held_live.startedAt is not None
    assert held_live.differs
    assert not approved_live.differs


@pytest.mark.slow
def test_a_force_step_starts_the_reboot_only_where_the_vms_own_force_hook_succeeded(run_pipeline: Runner) -> None:
    outcome = run_pipeline(
        Scenario.from_file(SCENARIOS / "escalation-force.yaml"), time_scale=120.0, timeout=150.0, oracle=True
    )
    events = outcome.judged_ok()
    assert {label: row["expected"] for label, row in events.items()} == {
        "reboot-forced": "approve",
        "reboot-force-failed": "no-approval",
    }
    forced, failed = events["reboot-forced"], events["reboot-force-failed"]
    assert forced["approvedThrough"] == "api_0"
    for event, vm, ran in ((forced, "api_0", "succeeded"), (failed, "api_1", "failed")):
        event_id = event["eventId"]
        decisions = history_rows(outcome.stack, "RecordType = 'Decision' AND EventId = ?", event_id)
        assert [(step, do) for step, do, _, _, _ in steps_taken(decisions)] == [(1, "force")]
        accepted = "RecordType = 'Approval' AND EventId = ? AND Outcome = 'accepted'"
        answers = history_rows(outcome.stack, accepted, event_id)
        assert [row["VmName"] for row in answers] == [vm]
        hooks = history_rows(outcome.stack, "RecordType = 'Hook' AND EventId = ? AND HookPhase = 'force'", event_id)
        assert [(row["VmName"], row["Outcome"]) for row in hooks] == [(vm, ran)]
        [started] = history_rows(
            outcome.stack, "RecordType = 'Transition' AND EventId = ? AND State = 'Started'", event_id
        )
        not_before = datetime.fromisoformat(decisions[0]["NotBefore"])
        assert f"force hook drain-force {'ran' if ran == 'succeeded' else 'failed'}" in started["Reason"]
        if ran == "succeeded":
            # Started by its own VM once the hook had run: before NotBefore (the platform's own start is at it).
            assert datetime.fromisoformat(started["TimeGenerated"]) < not_before
