"""The policy's fleet controls through the whole local pipeline (real processes and protocols), with the
fleet-controls scenario as it ships: its own policy, its health page served by the runner (503, then 200), and its
exact expectations (a zone budget holding a Reboot to NotBefore, a tag asking for a person, a gate holding one
Redeploy and passing the next, a closed window). Here the history's rows say which control held what."""

from __future__ import annotations

import pytest

from emulators.imds import Scenario
from tests.local.conftest import SCENARIOS, Runner, history_rows


@pytest.mark.slow
def test_budget_tag_gate_and_window_each_hold_what_they_should(run_pipeline: Runner) -> None:
    outcome = run_pipeline(
        Scenario.from_file(SCENARIOS / "fleet-controls.yaml"), time_scale=120.0, timeout=90.0, oracle=True
    )
    events = outcome.judged_ok()
    assert {label: row["expected"] for label, row in events.items()} == {
        "zone-first": "approve",
        "manual-tag": "no-approval",
        "gated": "no-approval",
        "windowed": "no-approval",
        "zone-second": "no-approval",
        "gated-healthy": "approve",
    }

    # Zones and tags are ARM's, read with the coordinator's own identity (App Service's endpoint: the Bicep's
    # coordinator-id), not through a VM's IMDS.
    identity = outcome.stack.app_identity
    assert identity is not None
    assert identity.requests >= 1

    # Budget: one Reboot at a time in zone 1. web_0's went at once; web_1's was held by the zone until NotBefore.
    first, second = events["zone-first"], events["zone-second"]
    assert first["approvedThrough"] == "web_0"
    budget_holds = history_rows(outcome.stack, "RecordType = 'Decision' AND HoldKind = 'budget'")
    assert {row["HoldName"] for row in budget_holds} == {"zone:westeurope/1"}
    assert {row["EventId"] for row in budget_holds} == {second["eventId"]}

    # Tag: db_0 asked for a person; nobody approved.
    manual = events["manual-tag"]
    manual_decisions = history_rows(outcome.stack, "RecordType = 'Decision' AND EventId = ?", manual["eventId"])
    assert {row["Rule"] for row in manual_decisions} == {"manual-by-tag"}

    # Gate: held while the page said 503 (named, with since when); the Redeploy after it recovered went at once.
    decisions = history_rows(outcome.stack, "RecordType = 'Decision' AND EventId = ?", events["gated"]["eventId"])
    assert {(row["Outcome"], row["HoldKind"], row["HoldName"]) for row in decisions} == {("wait", "gate", "app-health")}
    assert decisions[0]["HoldSince"] is not None
    assert "HTTP 503" in decisions[0]["Reason"]
    healthy = history_rows(outcome.stack, "RecordType = 'Decision' AND EventId = ?", events["gated-healthy"]["eventId"])
    assert [(row["Outcome"], row["HoldKind"]) for row in healthy] == [("approve", None)]
    assert events["gated-healthy"]["approvedThrough"] == "app_1"

    # Window: closed for the whole run; the Freeze waited, named its window and its next opening, and expired.
    held = history_rows(outcome.stack, "RecordType = 'Decision' AND EventId = ?", events["windowed"]["eventId"])
    assert [(row["HoldKind"], row["HoldName"]) for row in held] == [("window", "freeze-in-the-night")]
    assert held[0]["HeldUntil"].endswith("T00:00:00+00:00")  # 01:00 Oslo on 1 January = 00:00 UTC
    assert "left to expire (onNotBefore: expire)" in held[0]["Reason"]
