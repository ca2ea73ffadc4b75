"""An approval outlives nothing it rested on, through the whole local pipeline (real processes and protocols): a
Reboot is approved while its health gate passes, but the Relay is down, so its delivery fails; the gate then fails
and the Relay comes back. The timer's retry decides the approval again instead of sending it: withdrawn, with a
Decision row saying why, and never executed, while a Freeze of another VM after it is approved as usual."""

from __future__ import annotations

from pathlib import Path

import pytest

from emulators.imds import Scenario
from emulators.relay import RelayEmulator
from local.runner import wait_until
from local.stack import LocalStack
from tests.health_page import HealthPage
from tests.local.conftest import Runner, history_rows

POLICY = """
gates:
  app-health: {http: {url: "URL", expectStatus: [200], timeoutSeconds: 2}}
rules:
  - {name: gated-reboot, match: {eventType: [Reboot]}, action: approve-now, gates: [app-health]}
  - {name: short-freeze, match: {eventType: [Freeze]}, action: approve-now}
"""
# Azure seconds; at time scale 60 the Reboot's NotBefore is 20 s after it appears, the Freeze comes 10 s later.
SCENARIO = {
    "name": "expiry",
    "vms": [{"name": "app_0", "placementGroupId": "app"}, {"name": "web_0", "placementGroupId": "web"}],
    "steps": [
        {"at": 0, "create": {"ref": "gated", "EventType": "Reboot", "Resources": ["app_0"], "NoticeSeconds": 1200}},
        {
            "at": 600,
            "create": {"ref": "control", "EventType": "Freeze", "Resources": ["web_0"], "DurationInSeconds": 5},
        },
    ],
}


@pytest.mark.slow
def test_an_approval_decided_before_its_gate_failed_is_not_executed_after_it(
    run_pipeline: Runner, health: tuple[str, type[HealthPage]], tmp_path: Path
) -> None:
    url, page = health
    policy_path = tmp_path / "expiry.yaml"
    policy_path.write_text(POLICY.replace("URL", url), encoding="utf-8")

    def gate_fails_while_the_relay_is_down(stack: LocalStack) -> None:
        relay = stack.relay
        assert relay is not None
        port = relay.port
        relay.stop()
        # The Reboot is approved (the gate passes) and its delivery fails: nobody can be reached through the Relay.
        assert wait_until(
            lambda: bool(
                history_rows(stack, "RecordType = 'Approval' AND EventType = 'Reboot' AND Outcome = 'failed'")
            ),
            timeout=30,
            interval=0.05,
        ), "the Reboot's first delivery did not fail"
        page.status = 503
        restarted = RelayEmulator(port=port)
        restarted.start()
        stack.relay = restarted

    outcome = run_pipeline(
        Scenario.from_mapping(SCENARIO),
        time_scale=60.0,
        timeout=90.0,
        policy_path=policy_path,
        during=gate_fails_while_the_relay_is_down,
        # A delivery fails within 4 s (the sender gives up 2 s before), so that the retry comes while the Reboot is
        # still pending.
        coordinator_env={"COORDINATOR_APPROVAL_DEADLINE_SECONDS": "4"},
    )
    events = outcome.judged_ok()
    gated, control = events["gated"], events["control"]
    assert gated["approvedThrough"] is None  # never executed
    assert control["approvedThrough"] == "web_0"  # the Relay path works again

    decisions = history_rows(outcome.stack, "RecordType = 'Decision' AND EventId = ?", gated["eventId"])
    assert [(row["Outcome"], row["HoldKind"]) for row in decisions] == [("approve", None), ("wait", "gate")]
    first, withdrawal = decisions
    assert withdrawal["Reason"].startswith(f"approval {first['DecisionId']} by rule 'gated-reboot'")
    assert "withdrawn, decided again: gate 'app-health' is failing (HTTP 503" in withdrawal["Reason"]
    approvals = history_rows(outcome.stack, "RecordType = 'Approval' AND EventId = ?", gated["eventId"])
    assert "approved" not in {row["Outcome"] for row in approvals}
    assert {row["DecisionId"] for row in approvals} == {first["DecisionId"]}
    print(f"figures: the gated Reboot's approval rows {[row['Outcome'] for row in approvals]}; withdrawn, not executed")
