"""Containment (issue 22): one bad input, record or entity costs only itself. Fast: the in-memory store, the real
pipeline, an in-process listener that approves what it is asked.

- a document nested 20,000 deep, or larger than a message, is dead-lettered with the bound it broke, in a batch
  whose other messages go on (json.loads raised RecursionError on an Event Grid body and failed the batch);
- an event entity that cannot be read is set aside, and the timer goes on for the rest of the fleet (it raised at
  every tick);
- a VM's position longer than a table property is split (it failed the batch), one too large to keep even
  trimmed costs only its VM, and an event record too large costs only that event: the other VMs of the batch keep
  their sightings and their approvals.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from contracts.approval import ApprovalRequest, ApprovalResult
from contracts.envelope import VmIdentity
from coordinator.pipeline.ingest import MAX_MESSAGE_BYTES, RawMessage
from coordinator.service import Coordinator
from coordinator.state.entities import event_partition
from tests.coordinator.helpers import DOC_NOW, MemoryHistory, envelope, scheduled_event, vm
from tests.coordinator.memory_store import MemoryStateStore
from tests.coordinator.runs import folder_coordinator


class Approves:
    """Every VM's listener, in process: approves what it is asked, and remembers it."""

    def __init__(self) -> None:
        self.approved: list[tuple[str, str]] = []

    def send(self, request: ApprovalRequest, *, vm: VmIdentity) -> ApprovalResult:
        self.approved.append((request.eventId, vm.name))
        return ApprovalResult(outcome="approved", eventId=request.eventId, decisionId=request.decisionId)


class Clock:
    def __init__(self) -> None:
        self.now = DOC_NOW

    def __call__(self) -> datetime:
        return self.now


def build(tmp_path: Path, clock: Clock | None = None) -> tuple[Coordinator, MemoryStateStore, MemoryHistory, Approves]:
    store, history, listeners = MemoryStateStore(), MemoryHistory(), Approves()
    coordinator = folder_coordinator(
        tmp_path / "cards",
        store=store,
        history=history,
        callback=listeners,
        clock=clock or Clock(),
    )
    return coordinator, store, history, listeners


def message(data: dict[str, Any] | list[Any] | bytes, *, partition_key: str | None = None) -> RawMessage:
    if isinstance(data, bytes):
        return RawMessage(body=data, partition_key=partition_key)
    key = partition_key or (str(data["vm"]["resourceId"]).lower() if isinstance(data, dict) else None)
    return RawMessage(body=json.dumps(data).encode(), partition_key=key)


def user_reboot(name: str, index: int, event_id: str, *, sequence: int = 1) -> dict[str, Any]:
    """A user's Reboot of one VM, which the default policy approves at once."""
    event = scheduled_event(event_id, source="User", event_type="Reboot", resources=[name], duration=-1)
    return envelope(vm(name, index=index), sequence=sequence, incarnation=2, events=[event])


def deep(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


# documents beyond their bounds --------------------------------------------------------------------------------------
def test_a_document_too_deep_or_too_large_is_dead_lettered_with_its_bound_and_the_batch_goes_on(tmp_path):
    coordinator, store, history, listeners = build(tmp_path)
    good = user_reboot("good_0", 1, "GOOD-1")
    grid_event = {"id": "g1", "eventType": "Microsoft.Maintenance.ScheduledEventStatusChanged", "data": {}}
    nested_grid = [{**grid_event, "data": json.loads(b'{"x": ' + deep(70) + b"}")}]
    messages = [
        message(deep(20_000)),  # an "Event Grid array" 20,000 deep: RecursionError, the whole batch failed
        message(b'{"eventType": "x", "data": ' + deep(20_000) + b"}"),
        message(nested_grid),  # JSON, but deeper than Event Grid's events are
        message(b'{"schema": ' + deep(20_000) + b"}", partition_key="x"),  # an envelope: pydantic-core's 200
        message(b"[" + b" " * MAX_MESSAGE_BYTES + b"]"),
        message(good),
    ]

    report = coordinator.process_batch(messages)

    assert report.dead_lettered == 5
    assert report.accepted == 1
    reasons = [str(letter["Reason"]) for letter in store.dead_letters()]
    assert sum(r == "refused: nested deeper than 64 levels" for r in reasons) == 3, reasons
    assert any("recursion limit exceeded" in r for r in reasons), reasons
    assert any(f"more than the {MAX_MESSAGE_BYTES} allowed" in r for r in reasons), reasons
    assert len([r for r in history.rows if r.RecordType == "DeadLetter"]) == 5
    assert listeners.approved == [("GOOD-1", "good_0")]


# state entities that cannot be read --------------------------------------------------------------------------------
def test_an_event_entity_that_cannot_be_read_is_set_aside_and_the_timer_goes_on_for_the_fleet(tmp_path):
    clock = Clock()
    coordinator, store, history, _ = build(tmp_path, clock)
    reboots = []
    for index, name in enumerate(("web_0", "web_1")):  # a platform Reboot each: the default policy waits
        event = scheduled_event(f"EV-{name}", event_type="Reboot", resources=[name], duration=-1)
        reboots.append(message(envelope(vm(name, index=index + 1), sequence=1, incarnation=2, events=[event])))
    coordinator.process_batch(reboots)
    key = (event_partition("EV-web_0"), "EV-web_0")
    entity, _ = store._entities[key]
    store._entities[key] = ({**entity, "Data0": entity["Data0"].replace('"eventType":"Reboot"', '"eventType":7')}, "x")

    clock.now = DOC_NOW + timedelta(hours=1)  # past both NotBefores
    report = coordinator.tick()  # raised ValidationError, every tick, for the whole fleet

    assert report.set_aside == 1
    other = coordinator.event("EV-web_1")
    assert other is not None
    assert other.record.state == "Expired"  # the rest of the fleet went on
    assert key not in store._entities
    (letter,) = store.dead_letters()
    assert str(letter["Reason"]).startswith(f"state entity {key[0]}/EV-web_0 set aside: ValidationError")
    (row,) = [r for r in history.rows if r.RecordType == "DeadLetter"]
    assert row.Reason is not None
    assert row.Reason.startswith(f"state entity {key[0]}/EV-web_0 cannot be read and was set aside: ValidationError")
    assert coordinator.tick().set_aside == 0  # once


# records larger than a table holds ---------------------------------------------------------------------------------
def test_records_too_large_for_the_table_cost_only_their_own_vm_or_event(tmp_path):
    coordinator, store, history, listeners = build(tmp_path)
    # Within every bound of the door: 50 tags of 512 + 256 characters and 100 events. Its position is four
    # properties long: the batch used to fail at the VM-group write, after the events were written.
    large = vm("large_0", index=1)
    large["tags"] = {f"t{i:02}" + "n" * 509: "v" * 256 for i in range(50)}
    listed = [scheduled_event(f"{i:03}" + "E" * 125, event_type="Reboot", resources=["large_0"]) for i in range(100)]
    # Tags of control characters, six times longer as JSON: no position can hold them (a VM beyond its bounds).
    poison = vm("poison_0", index=2)
    poison["tags"] = {f"t{i:02}" + "\x01" * 509: "\x01" * 256 for i in range(50)}
    # An event whose 600 resource names (of control characters) make a record larger than an entity holds.
    names = [f"{i:03}" + "\x02" * 253 for i in range(600)]
    huge = scheduled_event("HUGE", event_type="Reboot", resources=names)
    messages = [
        message(envelope(large, sequence=1, incarnation=2, events=listed)),
        message(
            envelope(poison, sequence=1, incarnation=2, events=[scheduled_event("POISON", resources=["poison_0"])])
        ),
        message(envelope(vm("huge_0", index=3), sequence=1, incarnation=2, events=[huge])),
        message(user_reboot("good_0", 4, "GOOD-1")),
    ]

    report = coordinator.process_batch(messages)  # raised RecordTooLarge: every VM lost its sightings

    assert listeners.approved == [("GOOD-1", "good_0")]
    good = coordinator.event("GOOD-1")
    assert good is not None
    assert good.record.state == "Approved"
    assert "good_0" in good.record.vms  # its sighting, written with its position
    kept = coordinator.event(listed[99]["EventId"])
    assert kept is not None
    assert set(kept.record.vms) == {"large_0"}  # the large VM's position and sightings: split, not refused
    assert report.dead_lettered == 1
    (letter,) = store.dead_letters()
    assert str(letter["Reason"]).startswith("processing failed: its position cannot be stored: VM poison_0's position")
    assert coordinator.event("HUGE") is None  # set aside, with a DeadLetter row naming it
    reasons = [r.Reason or "" for r in history.rows if r.RecordType == "DeadLetter"]
    assert any(r.startswith("observations make a record too large to store: RecordTooLarge") for r in reasons)
    assert report.accepted == 3  # the poison VM's envelope is not counted as accepted
