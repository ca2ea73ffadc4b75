"""Return to service through the whole local pipeline (real processes and protocols; each VM's readiness page is a
local gate page), with the return-to-service scenario as it ships and under the oracle: web_0's Reboot is approved,
completes, and web_0 is back once its recover hook ran and its page passes; only then is web_1's Reboot approved (web_0
held the scale set's one slot until it was back); web_1's page fails, so it is late at the bound (one row, one card)
and back once the page passes, each with an Impact row (return-to-service) saying how long it took."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest

from emulators.imds import Scenario
from tests.local.conftest import SCENARIOS, Runner, history_rows
from tests.polling import poll

# The bound of policies/return-to-service.yaml, and how late a row may come after its time: the local timer ticks
# every 2 s and a page is read within its 2 s deadline.
BOUND = timedelta(seconds=60)
WITHIN = timedelta(seconds=8)
RECOVER = timedelta(seconds=8)  # web_0's recover hook


def at(row: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(row["TimeGenerated"])


@pytest.mark.slow
def test_the_next_reboot_waits_until_the_vm_is_back_and_a_late_vm_is_said_once(run_pipeline: Runner) -> None:
    outcome = run_pipeline(
        Scenario.from_file(SCENARIOS / "return-to-service.yaml"), time_scale=120.0, timeout=150.0, oracle=True
    )
    events = outcome.judged_ok()
    assert {label: row["expected"] for label, row in events.items()} == {
        "reboot-first": "approve",
        "reboot-when-web-0-is-back": "approve",
    }
    first, second = events["reboot-first"]["eventId"], events["reboot-when-web-0-is-back"]["eventId"]
    stack = outcome.stack

    def returns() -> list[dict[str, Any]]:
        return history_rows(stack, "ImpactMeasure = 'return-to-service'")

    assert poll(lambda: len(returns()) >= 3, timeout=20, interval=0.2), returns()
    rows = returns()
    assert [(r["EventId"], r["VmName"], r["Outcome"]) for r in rows] == [
        (first, "web_0", "back"),
        (second, "web_1", "late"),
        (second, "web_1", "back"),
    ]

    def transition(event_id: str, state: str) -> datetime:
        [row] = history_rows(stack, "RecordType = 'Transition' AND EventId = ? AND State = ?", event_id, state)
        return at(row)

    web_0_back, web_1_late, web_1_back = rows
    # web_0: back once its recover hook (8 s) ran after its Reboot completed, and the seconds say so.
    completed = transition(first, "Completed")
    assert completed + RECOVER <= at(web_0_back) <= completed + RECOVER + WITHIN
    assert web_0_back["ReturnToServiceSeconds"] == pytest.approx((at(web_0_back) - completed).total_seconds(), abs=0.01)
    # web_1's Reboot, created while web_0 recovered, was held by the budget and approved only once web_0 was back:
    # until then web_0 held the scale set's one slot.
    held = history_rows(stack, "RecordType = 'Decision' AND EventId = ? AND HoldKind = 'budget'", second)
    assert held, "web_1's Reboot was never held by the budget"
    assert at(held[0]) < at(web_0_back) < transition(second, "Approved")
    # web_1: late at the bound (its page failing, said in the row), then back once the page passed.
    completed = transition(second, "Completed")
    assert completed + BOUND <= at(web_1_late) <= completed + BOUND + WITHIN
    assert web_1_late["ReturnToServiceSeconds"] is None
    assert "gate ready failing (HTTP 503" in web_1_late["Reason"]
    assert web_1_back["ReturnToServiceSeconds"] > BOUND.total_seconds()
    assert stack.gates is not None
    passing = next(c for c in stack.gates.log if c.name == "ready/web_1" and c.behaviour == "passing")
    assert passing.at <= at(web_1_back)
    # One card for the late VM's event, none for the other.
    cards = {p.name for p in stack.cards_dir.iterdir() if p.name.endswith("-return-late.json")}
    assert cards == {f"{second}-return-late.json"}
