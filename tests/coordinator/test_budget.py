"""The "at most N impacted per scale set" budget holds fleet-wide: instances claim slots in one ETag-checked entity
per scale set before approving, release them when the event concludes, and a claim without an approval lapses."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from functools import partial
from typing import Any

import pytest

from coordinator.domain.claims import BudgetClaim, BudgetRecord
from coordinator.domain.policy_file import parse_policy
from coordinator.pipeline.budget_claims import CLAIM_LEASE
from coordinator.pipeline.ingest import RawMessage
from coordinator.state.tables import TableStateStore
from emulators.imds import ImdsEmulator
from tests.coordinator.conftest import Clock
from tests.coordinator.helpers import DOC_NOW, envelope, scheduled_event, vm
from tests.coordinator.runs import batches_at_once, table_coordinator

POLICY = parse_policy(
    """
version: 1
rules:
  - name: westno-one-at-a-time
    match: {eventType: [Reboot], scaleSet: ["westno"]}
    action: approve-within-budget
    budget: {maxImpacted: 1}
"""
)
VMS = {name: vm(name, scale_set="westno", index=i + 1) for i, name in enumerate(("WestNO_0", "WestNO_1"))}


class ViewInterleavingStore(TableStateStore):
    """Runs ``interleave`` once, right after this instance loaded its fleet view (which still shows the budget
    free) and before it decides: the other instance approves in between."""

    interleave: Any = None

    def events_changed_since(self, since: Any) -> Any:
        result = super().events_changed_since(since)
        action, self.interleave = self.interleave, None
        if action is not None:
            action()
        return result


# Every instance in these tests shares the budget's policy.
coordinator = partial(table_coordinator, policy=POLICY)


def reboot_on(imds: ImdsEmulator, name: str) -> str:
    event_id: str = imds.create_event(EventType="Reboot", Resources=[name], NoticeSeconds=900)["EventId"]
    return event_id


def report(name: str, sequence: int, events: list[str]) -> RawMessage:
    listed = [scheduled_event(e, event_type="Reboot", resources=[name], duration=-1) for e in events]
    data = envelope(VMS[name], sequence=sequence, incarnation=sequence, events=listed)
    return RawMessage(body=json.dumps(data).encode(), partition_key=data["vm"]["resourceId"].lower())


def approved(imds: ImdsEmulator, ids: list[str]) -> list[str]:
    return [a["EventId"] for a in imds.approvals() if a["EventId"] in ids]


@pytest.fixture
def table() -> str:
    return "budget" + uuid.uuid4().hex[:12]


def test_an_instance_whose_view_is_stale_cannot_take_a_slot_another_instance_claimed(azurite, imds, table, tmp_path):
    clock = Clock(DOC_NOW)
    a, history_a = coordinator(azurite, imds, table, tmp_path / "a", clock, store_class=ViewInterleavingStore)
    b, _ = coordinator(azurite, imds, table, tmp_path / "b", clock)
    first, second = reboot_on(imds, "WestNO_0"), reboot_on(imds, "WestNO_1")
    assert isinstance(a.parts.store, ViewInterleavingStore)
    a.parts.store.interleave = lambda: b.process_batch([report("WestNO_1", 1, [second])])

    a.process_batch([report("WestNO_0", 1, [first])])

    assert approved(imds, [first, second]) == [second]  # B approved; A's view said free, its claim said no
    waiting = a.event(first)
    assert waiting is not None
    assert waiting.record.approval is None
    decision = waiting.record.decision
    assert decision is not None
    assert decision.verdict == "wait"
    assert "held fleet-wide by " + second in decision.reason
    assert [r.Outcome for r in history_a.rows if r.RecordType == "Decision"] == ["wait"]


def test_two_instances_racing_approve_one_at_a_time_and_completion_frees_the_slot(azurite, imds, table, tmp_path):
    clock = Clock(DOC_NOW)
    a, _ = coordinator(azurite, imds, table, tmp_path / "a", clock)
    b, _ = coordinator(azurite, imds, table, tmp_path / "b", clock)
    ids = {"WestNO_0": reboot_on(imds, "WestNO_0"), "WestNO_1": reboot_on(imds, "WestNO_1")}
    batches_at_once([(a, [report("WestNO_0", 1, [ids["WestNO_0"]])]), (b, [report("WestNO_1", 1, [ids["WestNO_1"]])])])
    first = approved(imds, list(ids.values()))
    assert len(first) == 1
    winner = next(name for name, event_id in ids.items() if event_id == first[0])
    loser = next(name for name in ids if name != winner)
    budget = a.parts.store.get_budget("westno")
    assert budget is not None
    assert list(budget.record.claims) == first

    clock.now += timedelta(seconds=20)
    a.tick()  # still held: the loser keeps waiting
    assert approved(imds, list(ids.values())) == first

    a.process_batch([report(winner, 2, [])])  # the approved event left the VM: Completed, slot released
    done = a.event(ids[winner])
    assert done is not None
    assert done.record.state == "Completed"
    budget = a.parts.store.get_budget("westno")
    assert budget is not None
    assert budget.record.claims == {}

    clock.now += timedelta(seconds=20)
    b.tick()
    assert approved(imds, list(ids.values())) == [*first, ids[loser]]
    budget = b.parts.store.get_budget("westno")
    assert budget is not None
    assert list(budget.record.claims) == [ids[loser]]


def test_a_claim_left_without_an_approval_lapses_after_its_lease(azurite, imds, table, tmp_path):
    clock = Clock(DOC_NOW)
    a, _ = coordinator(azurite, imds, table, tmp_path / "a", clock)
    # What a crash between the claim and the approval's write leaves behind: a claim whose event holds nothing.
    ghost = BudgetClaim(eventId="GHOST-EVENT", vms=["WestNO_1"], claimedAt=DOC_NOW)
    a.parts.store.save_budget(BudgetRecord(scaleSet="westno", claims={"GHOST-EVENT": ghost}), None)
    event_id = reboot_on(imds, "WestNO_0")

    a.process_batch([report("WestNO_0", 1, [event_id])])
    assert approved(imds, [event_id]) == []  # within the lease the claim counts

    clock.now = DOC_NOW + CLAIM_LEASE + timedelta(seconds=1)
    a.tick()
    assert approved(imds, [event_id]) == [event_id]
    budget = a.parts.store.get_budget("westno")
    assert budget is not None
    assert list(budget.record.claims) == [event_id]
