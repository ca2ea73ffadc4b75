"""Builders for envelopes and Event Hubs events used by the coordinator tests and the wave benchmark, and for the
records the coordinator stores (the state tests)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import azure.functions as func

from contracts.envelope import SCHEMA
from coordinator.domain.model import ApprovalRecord, DecisionRecord, EventRecord, VmRecord
from coordinator.domain.rows import HistoryRow
from coordinator.pipeline.ingest import RawMessage

DOC_EVENT_ID = "C7061BAC-AFDC-4513-B24B-AA5F13A16123"
DOC_NOT_BEFORE = "Mon, 11 Apr 2022 22:26:58 GMT"
# The documented example: scheduled a quarter of an hour before NotBefore.
DOC_NOW = datetime(2022, 4, 11, 22, 11, 58, tzinfo=UTC)

# Every VM the builders make is in this subscription (resource group rg-fleet).
SUBSCRIPTION = "00000000-0000-0000-0000-000000000001"
GRID_EVENT_TYPE = "Microsoft.ResourceNotifications.MaintenanceResources.ScheduledEventEmitted"

# The scale set "web" of four VMs in one placement group (the fleet_imds fixture).
WEB_FLEET = ("web_0", "web_1", "web_2", "web_3")


def web_vms(*names: str) -> list[dict[str, str]]:
    """The IMDS emulator's VMs ``names`` of scale set web, in its placement group pg-web."""
    return [{"name": name, "vmScaleSetName": "web", "placementGroupId": "pg-web"} for name in names]


# A policy's first rules when a VM's scheduled-events tag decides (issue 21): "manual" waits for a person, "auto" (a
# tag these rules trust) approves at once. A policy goes on with rules of its own.
BY_TAG = """
version: 1
rules:
  - name: manual-by-tag
    match: {tags: {scheduled-events: manual}}
    action: wait-for-person
  - name: auto-by-tag
    match: {tags: {scheduled-events: auto}}
    action: approve-now
    trustTags: true
"""


def vm(name: str, *, group: str = "avset-westno", scale_set: str = "", index: int | None = None) -> dict[str, Any]:
    number = index if index is not None else abs(hash(name)) % 10**8
    vm_id = f"{number:08x}-0000-4000-8000-{number:012x}"
    rg = "rg-fleet"
    resource = f"/subscriptions/{SUBSCRIPTION}/resourceGroups/{rg}/providers/" + (
        f"Microsoft.Compute/virtualMachineScaleSets/{scale_set}/virtualMachines/{name.rsplit('_', 1)[-1]}"
        if scale_set
        else f"Microsoft.Compute/virtualMachines/{name}"
    )
    return {
        "name": name,
        "vmId": vm_id,
        "resourceId": resource,
        "subscriptionId": SUBSCRIPTION,
        "resourceGroupName": rg,
        "vmScaleSetName": scale_set,
        "location": "norwayeast",
        "placementGroupId": group,
    }


def scheduled_event(
    event_id: str = DOC_EVENT_ID,
    *,
    event_type: str = "Freeze",
    status: str = "Scheduled",
    resources: list[str] | None = None,
    not_before: str = DOC_NOT_BEFORE,
    source: str = "Platform",
    duration: int = 5,
) -> dict[str, Any]:
    return {
        "EventId": event_id,
        "EventType": event_type,
        "ResourceType": "VirtualMachine",
        "Resources": resources if resources is not None else ["WestNO_0", "WestNO_1"],
        "EventStatus": status,
        "NotBefore": "" if status == "Started" else not_before,
        "Description": "Virtual machine is being paused because of a memory-preserving Live Migration operation.",
        "EventSource": source,
        "DurationInSeconds": duration,
    }


def envelope(
    identity: dict[str, Any],
    *,
    sequence: int,
    incarnation: int | None = None,
    events: list[dict[str, Any]] | None = None,
    observed_at: datetime = DOC_NOW,
    kind: str = "incarnation",
    hook: dict[str, Any] | None = None,
) -> dict[str, Any]:
    data: dict[str, Any] = {
        "schema": SCHEMA,
        "kind": kind,
        "vm": identity,
        "observedAt": observed_at.isoformat(),
        "sequence": sequence,
        "forwarder": "test/1.0",
    }
    if kind == "incarnation":
        data["document"] = {"DocumentIncarnation": incarnation or 0, "Events": events or []}
    if hook is not None:
        data["hook"] = hook
    return data


def grid_event(
    event_id: str = "EV-G",
    *,
    status: str = "Scheduled",
    resources: list[str] | None = None,
    at: datetime = DOC_NOW,
    scale_set: str = "web",
    resource_group: str = "rg-fleet",
    grid_id: str = "g-1",
) -> dict[str, Any]:
    """An Event Grid event of the Maintenance resources topic (the documented sample's shape) naming VMs of a scale
    set in the helpers' subscription."""
    resource = (
        f"/subscriptions/{SUBSCRIPTION}/resourceGroups/{resource_group}/providers/Microsoft.Compute/"
        f"virtualMachineScaleSets/{scale_set}/providers/microsoft.maintenance/scheduledevents/{event_id}"
    )
    return {
        "id": grid_id,
        "subject": resource,
        "eventType": GRID_EVENT_TYPE,
        "eventTime": at.isoformat(),
        "data": {
            "resourceInfo": {
                "id": resource,
                "location": "norwayeast",
                "properties": {
                    "EventId": event_id,
                    "EventType": "Freeze",
                    "Resources": resources or ["web_0"],
                    "EventStatus": status,
                    "NotBefore": DOC_NOT_BEFORE,
                    "DurationInSeconds": 5,
                },
            }
        },
    }


def hub_event(data: dict[str, Any] | bytes, *, partition_key: str | None = None, number: int = 0) -> func.EventHubEvent:
    if isinstance(data, dict):
        body = json.dumps(data).encode()
        partition_key = partition_key or str(data["vm"]["resourceId"]).lower()
    else:
        body = data
    return func.EventHubEvent(
        body=body,
        partition_key=partition_key,
        sequence_number=number,
        offset=str(number * 100),
        enqueued_time=DOC_NOW + timedelta(milliseconds=number),
    )


def documented_example() -> list[dict[str, Any]]:
    """Microsoft's example: two VMs of one availability set, one Freeze, DocumentIncarnation 1 to 4
    (nothing; Scheduled; Started with NotBefore ""; gone)."""
    envelopes = []
    for index, name in enumerate(("WestNO_0", "WestNO_1")):
        identity = vm(name, index=index + 1)
        t = DOC_NOW + timedelta(milliseconds=index)
        envelopes += [
            envelope(identity, sequence=10, incarnation=1, events=[], observed_at=t),
            envelope(identity, sequence=11, incarnation=2, events=[scheduled_event()], observed_at=t),
            envelope(
                identity,
                sequence=12,
                incarnation=3,
                events=[scheduled_event(status="Started")],
                observed_at=t + timedelta(minutes=1),
            ),
            envelope(identity, sequence=13, incarnation=4, events=[], observed_at=t + timedelta(minutes=2)),
        ]
    return envelopes


class MemoryHistory:
    """A ``HistorySink`` that keeps rows in a list: for tests that assert on history without a database."""

    def __init__(self) -> None:
        self.rows: list[HistoryRow] = []

    def write(self, rows: Sequence[HistoryRow]) -> None:
        self.rows.extend(rows)


def event_record(event_id: str, **fields: Any) -> EventRecord:
    """An event record as the coordinator stores it: a Reboot, Scheduled since DOC_NOW, unless ``fields`` say."""
    base: dict[str, Any] = {"eventId": event_id, "eventType": "Reboot", "stateSince": DOC_NOW, "createdAt": DOC_NOW}
    return EventRecord.model_validate({**base, **fields})


def decision_record(**fields: Any) -> DecisionRecord:
    """A decision as an event's record holds it: rule "r" (approve-now) holds the event, decided at DOC_NOW, unless
    ``fields`` say."""
    held = dict(decisionId="d", rule="r", action="approve-now", verdict="wait", reason="held", decidedAt=DOC_NOW)
    return DecisionRecord.model_validate({**held, **fields})


def approval_record(**fields: Any) -> ApprovalRecord:
    """An approval as an event's record holds it: decision "d" of rule "r", decided at DOC_NOW, unless ``fields``
    say."""
    approved = dict(decisionId="d", rule="r", actor="rule:r", decidedAt=DOC_NOW)
    return ApprovalRecord.model_validate({**approved, **fields})


def vm_position(name: str, *, index: int, **fields: Any) -> VmRecord:
    """A VM's stored position, ``vm(name, index=index)`` its identity, last seen at DOC_NOW unless ``fields`` say."""
    return VmRecord.model_validate({"identity": vm(name, index=index), "lastSeen": DOC_NOW, **fields})


def raw_message(identity: dict[str, Any], data: dict[str, Any]) -> RawMessage:
    """An envelope as the batch trigger hands it over: its body, keyed by its VM's resource id (its partition)."""
    return RawMessage(body=json.dumps(data).encode(), partition_key=identity["resourceId"].lower())
