"""A VM without the forwarder through the whole local pipeline (real processes and protocols): the IMDS emulator
publishes its events to the Event Hubs emulator as Event Grid would, the coordinator folds them into records,
decides, and approves through the IMDS emulator's ARM face (remote acknowledge as the fallback); the VMs with the
forwarder keep the Relay path."""

from __future__ import annotations

import pytest

from emulators.imds import Scenario
from tests.local.conftest import SCENARIOS, Runner, history_rows


@pytest.mark.slow
def test_an_agentless_vm_is_approved_through_remote_acknowledge(run_pipeline: Runner) -> None:
    outcome = run_pipeline(
        Scenario.from_file(SCENARIOS / "agentless-vm.yaml"), time_scale=120.0, timeout=90.0, oracle=True
    )
    events = outcome.judged_ok()
    agentless, relayed = events["agentless-freeze"], events["shared-freeze"]
    assert "web_1" not in outcome.stack.forwarders
    assert agentless["approvedThrough"] == "web_1"
    assert agentless["coordinator"] == "Completed"
    imds = outcome.stack.imds
    assert imds is not None
    assert [a["EventId"] for a in imds.arm_status()["acknowledged"]] == [agentless["eventId"]]
    assert relayed["approvedThrough"] in ("web_0", "web_2")
    approval = history_rows(
        outcome.stack, "RecordType = 'Approval' AND EventId = ? AND Outcome = 'approved'", agentless["eventId"]
    )
    assert approval
    assert "Maintenance RP" in approval[-1]["Reason"]
    observed = history_rows(outcome.stack, "RecordType = 'Observation' AND EventId = ?", agentless["eventId"])
    assert {row["VmName"] for row in observed} == {"web_1"}
    assert not [card for card in outcome.summary.cards if card["kind"] == "heartbeat-lost"]
