"""Repair-aware maintenance through the whole local pipeline (real processes and protocols; ARM is the IMDS
emulator's ARM face over TLS), with the repair-aware-maintenance scenario as it ships and under the oracle: web's
automatic repairs are suspended while web_0's Reboot is in flight and resumed after it completes, each call a
Repairs history row; db, which has no repairs, is never asked about."""

from __future__ import annotations

from datetime import datetime

import pytest

from emulators.imds import Scenario
from tests.local.conftest import SCENARIOS, Runner, history_rows
from tests.polling import poll


@pytest.mark.slow
def test_repairs_suspended_while_the_reboot_is_in_flight_and_resumed_after_it(run_pipeline: Runner) -> None:
    outcome = run_pipeline(
        Scenario.from_file(SCENARIOS / "repair-aware-maintenance.yaml"), time_scale=120.0, timeout=90.0, oracle=True
    )
    events = outcome.judged_ok()
    assert {label: row["expected"] for label, row in events.items()} == {
        "reboot-web": "approve",
        "redeploy-db": "approve",
    }
    imds = outcome.stack.imds
    assert imds is not None
    # The run ends once every event is over; the resume comes with the next timer tick after the Reboot completed.
    resumed = poll(lambda: len(imds.arm_status()["orchestrationServiceCalls"]) >= 2, timeout=20, interval=0.2)
    assert resumed, imds.arm_status()
    poll(lambda: len(history_rows(outcome.stack, "RecordType = 'Repairs'")) >= 2, timeout=20, interval=0.2)
    arm = imds.arm_status()
    assert [(c["scaleSet"], c["action"], c["status"]) for c in arm["orchestrationServiceCalls"]] == [
        ("web", "Suspend", 202),
        ("web", "Resume", 202),
    ]
    assert arm["automaticRepairs"]["web"] == "Running"
    repairs = history_rows(outcome.stack, "RecordType = 'Repairs'")
    assert [(r["ScaleSetName"], r["Action"], r["Outcome"]) for r in repairs] == [
        ("web", "Suspend", "suspended"),
        ("web", "Resume", "resumed"),
    ]
    reboot = events["reboot-web"]["eventId"]
    assert reboot in repairs[0]["Details"]
    approved = history_rows(outcome.stack, "RecordType = 'Transition' AND EventId = ? AND State = 'Approved'", reboot)
    completed = history_rows(outcome.stack, "RecordType = 'Transition' AND EventId = ? AND State = 'Completed'", reboot)
    at = [datetime.fromisoformat(rows[0]["TimeGenerated"]) for rows in (approved, repairs[:1], completed, repairs[1:])]
    assert at == sorted(at), "approved, suspended, completed, resumed: in that order"
