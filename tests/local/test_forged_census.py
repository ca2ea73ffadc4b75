"""One fleet VM lies about where VMs sit and how they are tagged (issue 21): over the whole local stack, a process on
web_1 holds the fleet's shared Event Hubs identity and sends schema-valid envelopes that claim web_1 is in another
zone (to slip out of a one-Reboot-per-zone budget) and placement group (to be kept in that group's entity), that
db_0 has lost its "ask a person" tag and that batch_0 carries a tag a rule trusts to approve at once, and an Event
Grid event naming 1,000 VMs on the VMs' hub. The census comes from the IMDS emulator's ARM face (as from ARM in
Azure), the Event Grid publisher has its own hub: the judge's expectations come from the truthful scenario and its
policy (each event's ``expect``), so the run passes only with zero approvals the truth would not make, every one it
makes, and the forged Event Grid event set aside."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from azure.eventhub import EventData

from coordinator.pipeline.ingest import GRID_ON_VM_HUB
from coordinator.state.tables import TableStateStore
from emulators.imds import Scenario
from emulators.imds.event_grid import EVENT_TYPE
from local.runner import wait_until
from local.stack import LocalStack
from tests.coordinator.helpers import BY_TAG
from tests.local.conftest import Runner, history_rows
from tests.local.forging import Forger

SCENARIO = """
name: forged-census
policy: policy.yaml
vms:
  # One placement group: web_1 (the attacker) sees every VM's events in its own IMDS document.
  - {name: web_0, vmScaleSetName: web, placementGroupId: pg-1, zone: "1"}
  - {name: web_1, vmScaleSetName: web, placementGroupId: pg-1, zone: "1"}
  - {name: db_0, vmScaleSetName: db, placementGroupId: pg-1, zone: "2", tags: {scheduled-events: manual}}
  - {name: batch_0, vmScaleSetName: batch, placementGroupId: pg-1, zone: "3"}
steps:
  - at: 0
    create: {ref: zone-first, EventType: Reboot, Resources: [web_0], DurationInSeconds: 1200}
    expect: approve
  - at: 0
    create: {ref: manual-tag, EventType: Reboot, Resources: [db_0]}
    expect: no-approval
  - at: 0
    create: {ref: untagged, EventType: Redeploy, Resources: [batch_0]}
    expect: no-approval
  # While web_0's 20-minute Reboot holds zone 1: held to NotBefore, unless web_1 were believed to be elsewhere.
  - at: 360
    create: {ref: zone-second, EventType: Reboot, Resources: [web_1], NoticeSeconds: 600}
    expect: no-approval
"""
POLICY = (
    BY_TAG
    + """  - name: one-reboot-per-zone
    match: {eventType: [Reboot]}
    action: approve-within-budget
    budget: {maxImpacted: 1, per: [zone]}
  - name: everything-else-waits
    action: wait-for-person
"""
)


def _event_id(stack: LocalStack, ref: str) -> str:
    assert stack.imds is not None
    imds = stack.imds
    assert wait_until(lambda: any(e.get("ref") == ref for e in imds.events()), timeout=30)
    return next(str(e["EventId"]) for e in imds.events() if e.get("ref") == ref)


class Liar(Forger):
    """A forger with root on web_1, lying about VMs' identities rather than events' facts."""

    def claim(self, vm: str, event_ids: set[str], **identity: Any) -> None:
        """An envelope under ``vm``'s name listing those events, with ``identity`` put over the VM's."""
        envelope = self.envelope(self.vms[vm], kind="incarnation", document=self.listing(event_ids))
        self.send(envelope.model_copy(update={"vm": envelope.vm.model_copy(update=identity)}))

    def grid_on_the_vms_hub(self, event_id: str) -> None:
        """A ScheduledEventEmitted-shaped message naming web_1 and 999 VMs nobody has, as Event Grid would send it
        (no partition key), on the hub the VMs send to."""
        spec = next(vm for vm in self.imds.vms() if vm.name == "web_1")
        resource = (
            f"/subscriptions/{spec.subscriptionId}/resourceGroups/{spec.resourceGroupName}/providers/"
            f"Microsoft.Compute/virtualMachineScaleSets/web/providers/microsoft.maintenance/scheduledevents/{event_id}"
        )
        properties = {
            "EventId": event_id,
            "EventType": "Freeze",
            "ResourceType": "VirtualMachine",
            "Resources": ["web_1", *(f"web_{n}" for n in range(100, 1099))],
            "EventStatus": "Scheduled",
            "NotBefore": "",
            "EventSource": "Platform",
            "DurationInSeconds": 5,
        }
        event = {
            "id": str(uuid.uuid4()),
            "subject": resource,
            "eventType": EVENT_TYPE,
            "eventTime": "2026-01-05T12:00:00+00:00",
            "data": {"resourceInfo": {"id": resource, "properties": properties}},
        }
        batch = self.producer.create_batch()
        batch.add(EventData(json.dumps(event)))
        self.producer.send_batch(batch)
        self.sent += 1


@pytest.mark.slow
def test_forged_zones_tags_and_event_grid_events_approve_nothing(run_pipeline: Runner, tmp_path: Path) -> None:
    (tmp_path / "policy.yaml").write_text(POLICY, encoding="utf-8")
    (tmp_path / "forged-census.yaml").write_text(SCENARIO, encoding="utf-8")
    ids: dict[str, str] = {}

    def attack(stack: LocalStack) -> None:
        liar = Liar(stack, on="web_1")
        with liar.producer:
            for ref in ("zone-first", "manual-tag", "untagged"):
                ids[ref] = _event_id(stack, ref)
            # Another VM's tags, both ways: db_0 without its "ask a person" tag, batch_0 with one a rule trusts.
            liar.claim("db_0", {ids["manual-tag"]}, tags={})
            liar.claim("batch_0", {ids["untagged"]}, tags={"scheduled-events": "auto"})
            liar.grid_on_the_vms_hub(str(uuid.uuid4()).upper())
            # Its own zone, the moment its own Reboot appears (before its forwarder's next poll), and again while
            # it waits: believed, zone 1's budget would not hold it.
            ids["zone-second"] = _event_id(stack, "zone-second")
            for _ in range(5):
                liar.claim("web_1", {ids["zone-second"]}, zone="2", placementGroupId="pg-2")
                time.sleep(0.5)

    scenario = Scenario.from_file(tmp_path / "forged-census.yaml")
    # Three dead letters: the forged Event Grid event, and the two claims in other VMs' names, which their attested
    # documents (the liar's own VM's) refuse at the door; its claim about its own zone is attested and accepted.
    outcome = run_pipeline(scenario, during=attack, expected_dead_letters=3, time_scale=120.0, timeout=120.0)
    # The judge's expectations are the truthful scenario's: only zone-first approved, nothing more.
    outcome.judged_ok()
    stack = outcome.stack
    assert stack.imds is not None
    assert {str(a["EventId"]) for a in stack.imds.approvals()} == {ids["zone-first"]}
    # What each lie left: the VMs' claims kept as said and flagged against ARM's census; the decisions on ARM's.
    flagged = {row["VmName"]: row["Reason"] for row in history_rows(stack, "RecordType = 'Heartbeat' AND Outcome = ?",
                                                           "census-mismatch")}  # fmt: skip
    assert "zone '2' (ARM: '1')" in flagged["web_1"]
    assert set(flagged) == {"web_1"}  # the claims in db_0's and batch_0's names never got past attestation
    held = history_rows(stack, "RecordType = 'Decision' AND EventId = ? AND HoldKind = 'budget'", ids["zone-second"])
    assert {row["HoldName"] for row in held} == {"zone:westeurope/1"}
    rules = {row["Rule"] for row in history_rows(stack, "RecordType = 'Decision' AND EventId = ?", ids["manual-tag"])}
    assert rules == {"manual-by-tag"}
    reasons = [str(row["Reason"]) for row in history_rows(stack, "RecordType = 'DeadLetter'")]
    assert reasons.count(GRID_ON_VM_HUB) == 1, reasons
    assert all(reason.startswith("attestation refused: ") for reason in reasons if reason != GRID_ON_VM_HUB), reasons
    # No VM was added by the forged Event Grid event: the census is ARM's four, and no agentless twin was made.
    assert not history_rows(stack, "RecordType = 'Observation' AND VmName LIKE 'web_1%' AND VmName != 'web_1'")
    # Nor is a position kept where its VM says: web_1's is in ARM's placement group, pg-2 has no entity.
    assert stack.storage is not None
    store = TableStateStore.from_connection_string(stack.storage.connection_string, table_name="scheduledevents")
    groups = {g.record.group: {vm.identity.name for vm in g.record.vms.values()} for g in store.all_vm_groups()}
    assert groups == {"pg:pg-1": {"web_0", "web_1", "db_0", "batch_0"}}, groups
