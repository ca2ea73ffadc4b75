"""What one VM's word can and cannot do to the coordinator (issue 11): a listener's "approved" is not the platform's,
and an envelope without a partition key is not a forwarder's. Over Azurite and the IMDS emulator, with the real
``Approver`` as each VM's listener (tests/coordinator/test_deletes.py has the harness)."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import timedelta

from coordinator.pipeline.ingest import RawMessage
from tests.coordinator.helpers import envelope
from tests.coordinator.test_deletes import IDENTITY, Harness, _Listeners


def test_an_approval_not_followed_by_started_raises_one_card_naming_the_listeners_answer(azurite, fleet_imds, tmp_path):
    h = Harness(azurite, fleet_imds, tmp_path, start_bound=timedelta(minutes=5))
    h.coordinator.parts = replace(h.coordinator.parts, callback=_Listeners(fleet_imds, h.clock))
    # A user-initiated Reboot (approved at once by the default policy) that the platform does not start when asked:
    # IMDS answers 200 to StartRequests, the event waits for its NotBefore.
    event_id = str(
        fleet_imds.create_event(
            EventType="Reboot",
            EventSource="User",
            Resources=["web_0"],
            NoticeSeconds=900,
            StartDelaySeconds="NotBefore",
        )["EventId"]
    )
    h.coordinator.process_batch([h.document("web_0")])
    record = h.record(event_id)
    assert (record.state, record.approval.outcome) == ("Approved", "approved")
    assert len(h.approvals(event_id)) == 1
    assert record.approval.confirmBy == h.clock.now + timedelta(minutes=5)
    # Recorded as the listener's answer, not as success: the event stays Approved, never Completed, until seen.
    h.clock.now += timedelta(minutes=4)
    h.coordinator.process_batch([h.document("web_0")])
    h.coordinator.tick()
    assert h.record(event_id).state == "Approved"
    assert not (h.cards / f"{event_id}-not-started.json").exists()
    h.clock.now += timedelta(minutes=2)
    h.coordinator.tick()
    h.coordinator.tick()
    card = h.card(event_id, "not-started")
    assert "web_0's listener answered 'approved'" in card
    assert "no VM saw the event Started or gone" in card
    rows = [r for r in h.rows("Approval", event_id) if r.Outcome == "not-started"]
    assert len(rows) == 1, "one row and one card per event"
    assert (rows[0].Actor, rows[0].VmName) == ("platform", "web_0")
    assert h.record(event_id).state == "Approved"


def test_an_envelope_without_a_partition_key_is_dead_lettered_and_costs_nothing_else(azurite, fleet_imds, tmp_path):
    h = Harness(azurite, fleet_imds, tmp_path)
    event_id = str(fleet_imds.create_event(EventType="Freeze", Resources=["web_0"], DurationInSeconds=5)["EventId"])
    good = h.document("web_0")
    document = fleet_imds.document("web_1")
    keyless = RawMessage(
        body=json.dumps(envelope(IDENTITY["web_1"], sequence=1, incarnation=document["DocumentIncarnation"])).encode(),
        partition_key=None,
    )
    report = h.coordinator.process_batch([keyless, good])
    assert (report.dead_lettered, report.accepted) == (1, 1)
    (dead,) = h.rows("DeadLetter")
    assert "no partition key" in dead.Reason
    assert h.record(event_id).state == "Approved", "the good envelope beside it still approves its event"
