"""Rate and sequence budgets through the whole local pipeline (real processes and protocols), with the rate-and-zones
scenario as it ships and under the oracle, which judges them by its own reading of the policy (oracle/allowed.py): one
zone at a time for Reboots, two Freezes an hour. Every outcome is exact; the history says which budget held what."""

from __future__ import annotations

from pathlib import Path

import pytest

from emulators.imds import Scenario
from oracle.run import SCENARIOS, policy_for, run_scenario

PATH = SCENARIOS / "rate-and-zones.yaml"
SEQUENCE = "sequence:reboots-one-zone-at-a-time:zone"
RATE = "rate:two-freezes-an-hour:fleet"


@pytest.mark.slow
def test_one_zone_at_a_time_and_two_freezes_an_hour_hold_exactly(tmp_path: Path) -> None:
    result = run_scenario(Scenario.from_file(PATH), workdir=tmp_path, policy_path=policy_for(PATH), time_scale=120.0)
    print("\n".join(result.report.lines()), f"\n{result.seconds:.1f} s")
    assert result.finished, "the scenario did not finish in time"
    findings = [f.line() for f in result.report.findings if f.kind in ("wrong", "missed", "duplicate", "lost")]
    assert findings == []

    truth = result.truth
    refs = {event.eventId: event.ref for event in truth.events}
    approved = {refs[a.eventId.upper()] for a in truth.approvals if a.eventId.upper() in refs}
    assert approved == {"zone-one-first", "zone-one-goes-on", "zone-two-after", "freeze-1", "freeze-2"}

    ids = {ref: event_id for event_id, ref in refs.items()}
    holds = {
        refs[step.eventId.upper()]: step.reason
        for step in truth.history
        if step.kind == "Decision" and step.outcome == "wait" and step.eventId.upper() in refs
    }
    assert set(holds) == {"zone-two-waits", "freeze-3", "freeze-4"}, holds
    assert f"sequence {SEQUENCE!r}: zone westeurope/1 in progress" in holds["zone-two-waits"]
    assert ids["zone-one-first"] in holds["zone-two-waits"]
    for ref in ("freeze-3", "freeze-4"):
        assert f"rate {RATE!r}: 2 approvals by rule 'two-freezes-an-hour' in the last 3600 s" in holds[ref]

    # Zone 2's second Reboot was approved only after both of zone 1's had concluded in IMDS.
    after = next(a.at for a in truth.approvals if a.eventId.upper() == ids["zone-two-after"])
    for ref in ("zone-one-first", "zone-one-goes-on"):
        event = next(e for e in truth.events if e.ref == ref)
        concluded = next(t.at for t in event.transitions if t.state == "Completed")
        assert concluded < after
