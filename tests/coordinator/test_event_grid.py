"""Event Grid as a source (preview): ScheduledEventEmitted events on the platform's own hub (``channel="platform"``),
folded into the same records as the envelopes of the VMs' hub.

The real coordinator on Azurite; the IMDS emulator's ARM face approves the agentless VM's event (remote acknowledge
as the fallback when no VM's listener can execute it). The platform's facts outrank a VM's, and an Event Grid event
on the VMs' hub is a forgery, set aside. The last test runs the whole path over the Event Hubs emulator: the IMDS
emulator publishes its events as Event Grid would (arrays, duplicates) to the platform's hub, the local Functions
host consumes them."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import azure.functions as func
import pytest
from azure.identity import ManagedIdentityCredential

import function_app
from contracts.envelope import VmIdentity
from coordinator.adapters.remote_acknowledge import RemoteAcknowledgeSender
from coordinator.domain.policy_file import parse_policy
from coordinator.pipeline.ingest import GRID_ON_VM_HUB, Channel, RawMessage
from coordinator.service import Coordinator
from emulators.azurite import AzuriteEndpoints
from emulators.eventhubs import EventHubsEmulator
from emulators.imds import ImdsEmulator
from emulators.imds.event_grid import EVENT_TYPE, EventGridPublisher
from local.runner import FunctionHost
from tests.coordinator.conftest import Clock
from tests.coordinator.helpers import DOC_NOW, MemoryHistory, envelope, web_vms
from tests.coordinator.runs import imds_serving, table_coordinator
from tests.polling import poll

POLICY = """
version: 1
rules:
  - name: freeze-now
    match: {eventType: [Freeze]}
    action: approve-now
  - name: rest-wait
    action: wait-for-person
"""
PLATFORM_HUB = "scheduled-events-platform"


@pytest.fixture
def imds() -> Iterator[ImdsEmulator]:
    with imds_serving("event-grid", web_vms("web_0", "web_1")) as emulator:
        yield emulator


@pytest.fixture
def coordinator(
    azurite: AzuriteEndpoints, imds: ImdsEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Coordinator, MemoryHistory]:
    for name, value in imds.identity_environment("web_0").items():
        monkeypatch.setenv(name, value)
    clock = Clock(DOC_NOW)
    return table_coordinator(
        azurite,
        imds,
        "t" + uuid.uuid4().hex[:16],
        tmp_path / "cards",
        clock,
        policy=parse_policy(POLICY),
        # The same clock as the coordinator's: it checks the requests' notAfter.
        remote_acknowledge=RemoteAcknowledgeSender(
            credential=ManagedIdentityCredential(),
            endpoint=imds.arm_url,
            deadline_seconds=3,
            backoff=(0.05, 0.1),
            clock=clock,
        ),
        remote_acknowledge_fallback=True,
    )


@pytest.fixture
def waiting(coordinator: tuple[Coordinator, MemoryHistory]) -> tuple[Coordinator, MemoryHistory]:
    """The coordinator on a policy of one rule: every event waits for a person."""
    service, _ = coordinator
    service.policy = parse_policy("version: 1\nrules:\n  - name: wait\n    action: wait-for-person\n")
    return coordinator


def create(imds: ImdsEmulator, event_type: str, vm: str) -> str:
    """An event of ``event_type`` for ``vm``, with a quarter of an hour's notice: its id."""
    return str(imds.create_event(EventType=event_type, Resources=[vm], NoticeSeconds=900)["EventId"])


def scheduled(imds: ImdsEmulator, event_type: str, vm: str) -> tuple[str, dict[str, Any]]:
    """``create``'s event, and the platform's Event Grid event listing it Scheduled at DOC_NOW."""
    event_id = create(imds, event_type, vm)
    return event_id, grid(imds, event_id, "Scheduled", DOC_NOW)


def identity(imds: ImdsEmulator, name: str) -> VmIdentity:
    spec = next(v for v in imds.vms() if v.name == name)
    return VmIdentity.model_validate(spec.model_dump(include=set(VmIdentity.model_fields)))


def grid(imds: ImdsEmulator, event_id: str, status: str, at: datetime, *, grid_id: str | None = None) -> dict[str, Any]:
    """The Event Grid event for the emulator's event in ``status`` at ``at`` (the documented sample's shape)."""
    summary = next(e for e in imds.events() if e["EventId"] == event_id)
    vm = identity(imds, summary["Resources"][0])
    resource = (
        f"/subscriptions/{vm.subscriptionId}/resourceGroups/{vm.resourceGroupName}/providers/Microsoft.Compute/"
        f"virtualMachineScaleSets/{vm.vmScaleSetName}/providers/microsoft.maintenance/scheduledevents/{event_id}"
    )
    return {
        "id": grid_id or str(uuid.uuid4()),
        "topic": f"/subscriptions/{vm.subscriptionId}",
        "subject": resource,
        "eventType": EVENT_TYPE,
        "eventTime": at.isoformat(),
        "dataVersion": "3.0",
        "metadataVersion": "1",
        "data": {
            "apiVersion": "2024-07-01",
            "resourceInfo": {
                "id": resource,
                "name": event_id,
                "type": "microsoft.maintenance/scheduledEvents",
                "location": vm.location,
                "properties": {
                    "EventId": event_id,
                    "EventType": summary["EventType"],
                    "ResourceType": "VirtualMachine",
                    "Resources": summary["Resources"],
                    "EventStatus": status,
                    "NotBefore": summary["NotBefore"],
                    "Description": summary["Description"],
                    "EventSource": summary["EventSource"],
                    "DurationInSeconds": summary["DurationInSeconds"],
                },
            },
        },
    }


def raw(body: Any, *, partition_key: str | None = None) -> RawMessage:
    return RawMessage(body=json.dumps(body).encode(), partition_key=partition_key)


def report(imds: ImdsEmulator, name: str, sequence: int) -> RawMessage:
    vm = identity(imds, name)
    document = imds.document(name)
    data = envelope(
        vm.model_dump(), sequence=sequence, incarnation=document["DocumentIncarnation"], events=document["Events"]
    )
    return raw(data, partition_key=vm.resourceId.lower())


def test_an_agentless_vm_gets_a_record_a_decision_history_and_an_approval_through_remote_acknowledge(
    coordinator: tuple[Coordinator, MemoryHistory], imds: ImdsEmulator
) -> None:
    service, history = coordinator
    event_id, listed = scheduled(imds, "Freeze", "web_0")
    batch = service.process_batch([raw(listed)], channel="platform")
    assert batch.dead_lettered == 0
    stored = service.event(event_id)
    assert stored is not None
    assert list(stored.record.vms) == ["web_0"]
    assert stored.record.vms["web_0"].vmId.startswith("arm-")
    assert stored.record.decision is not None
    assert stored.record.decision.rule == "freeze-now"
    rows = [r for r in history.rows if r.EventId == event_id]
    assert {"Observation", "Decision", "Approval"} <= {r.RecordType for r in rows}
    # No forwarder reported as web_0: the fallback acknowledged it through ARM, on the scale set.
    assert [(a["EventId"], a["resource"].rsplit("/", 1)[-1]) for a in imds.arm_status()["acknowledged"]] == [
        (event_id, "web")
    ]
    assert stored.record.state == "Approved"
    imds.clock.advance(1)  # type: ignore[attr-defined]
    assert next(e for e in imds.events() if e["EventId"] == event_id)["state"] == "Started"
    service.process_batch([raw(grid(imds, event_id, "Started", DOC_NOW + timedelta(seconds=1)))], channel="platform")
    started = service.event(event_id)
    assert started is not None
    assert started.record.state == "Started"
    service.process_batch([raw(grid(imds, event_id, "Completed", DOC_NOW + timedelta(seconds=30)))], channel="platform")
    completed = service.event(event_id)
    assert completed is not None
    assert completed.record.state == "Completed"
    # No heartbeat is expected of an agentless VM: the timer raises no heartbeat-lost card for it.
    service.parts.clock.now = DOC_NOW + timedelta(hours=1)  # type: ignore[attr-defined]
    service.tick()
    assert not [p.name for p in service.parts.alerts.folder.glob("*heartbeat-lost*")]  # type: ignore[attr-defined]


@pytest.mark.parametrize("grid_first", [False, True])
def test_a_vm_seen_on_both_paths_is_one_vm_with_one_record(
    waiting: tuple[Coordinator, MemoryHistory], imds: ImdsEmulator, grid_first: bool
) -> None:
    service, _ = waiting
    event_id = create(imds, "Reboot", "web_1")
    messages: list[tuple[RawMessage, Channel]] = [
        (raw(grid(imds, event_id, "Scheduled", DOC_NOW)), "platform"),
        (report(imds, "web_1", 1), "vms"),
    ]
    for message, channel in reversed(messages) if not grid_first else messages:
        service.process_batch([message], channel=channel)
    stored = service.event(event_id)
    assert stored is not None
    assert list(stored.record.vms) == ["web_1"]
    # The forwarder's sighting, with the VM's own vmId, is the record's.
    assert stored.record.vms["web_1"].vmId == identity(imds, "web_1").vmId
    assert stored.record.vms["web_1"].epoch >= 0
    # A VM whose very first envelope comes right after the Event Grid event: the forwarder's identity wins.
    first = create(imds, "Reboot", "web_0")
    service.process_batch([report(imds, "web_0", 1)])
    service.process_batch([raw(grid(imds, first, "Scheduled", DOC_NOW))], channel="platform")
    vms = [vm for group in service.parts.store.all_vm_groups() for vm in group.record.vms.values()]
    assert sorted((vm.identity.name, vm.agentless) for vm in vms if vm.identity.name == "web_0") == [("web_0", False)]
    if not grid_first:  # web_1's forwarder reported before Event Grid ever named it: no agentless twin either
        assert [vm.agentless for vm in vms if vm.identity.name == "web_1"] == [False]


def test_an_event_grid_event_on_the_vms_hub_is_a_forgery_set_aside_and_adds_no_vm(
    coordinator: tuple[Coordinator, MemoryHistory], imds: ImdsEmulator
) -> None:
    service, history = coordinator
    event_id, forged = scheduled(imds, "Freeze", "web_0")
    forged["data"]["resourceInfo"]["properties"]["Resources"] = [f"web_{n}" for n in range(1000)]
    web_1 = identity(imds, "web_1").resourceId.lower()
    batch = service.process_batch([raw(forged, partition_key=web_1), raw([forged])])
    assert batch.dead_lettered == 2
    assert [r.Reason for r in history.rows if r.RecordType == "DeadLetter"] == [GRID_ON_VM_HUB, GRID_ON_VM_HUB]
    assert service.event(event_id) is None
    assert list(service.parts.store.all_vm_groups()) == [], "no VM added, agentless or not"
    assert imds.approvals() == []
    assert imds.arm_status()["acknowledged"] == []


def test_the_platforms_facts_outrank_what_a_vm_reported_first(
    coordinator: tuple[Coordinator, MemoryHistory], imds: ImdsEmulator
) -> None:
    service, history = coordinator
    event_id = create(imds, "Freeze", "web_0")
    # web_1 sees web_0's short Freeze (one placement group) and reports it first, as a Reboot: a person would wait.
    vm = identity(imds, "web_1")
    document = imds.document("web_1")
    lie = [{**e, "EventType": "Reboot", "DurationInSeconds": -1} for e in document["Events"]]
    data = envelope(vm.model_dump(), sequence=1, incarnation=document["DocumentIncarnation"], events=lie)
    service.process_batch([raw(data, partition_key=vm.resourceId.lower())])
    believed = service.event(event_id)
    assert believed is not None
    assert (believed.record.eventType, believed.record.factsFrom) == ("Reboot", "vm")
    assert believed.record.decision is not None
    assert believed.record.decision.verdict == "wait"
    # The platform's event, on its own hub: its facts replace the VM's, the VM's claim is the conflict, the truth is
    # decided again and approved (through the VM it concerns, whose IMDS shows the same Freeze).
    service.process_batch([raw(grid(imds, event_id, "Scheduled", DOC_NOW))], channel="platform")
    stored = service.event(event_id)
    assert stored is not None
    record = stored.record
    assert (record.eventType, record.durationInSeconds, record.factsFrom) == ("Freeze", 5, "platform")
    assert record.conflicts[-1].vm == "web_1"
    assert record.conflicts[-1].facts["EventType"] == ("Freeze", "Reboot")
    assert record.decision is not None
    assert record.decision.rule == "freeze-now"
    assert [a["EventId"] for a in imds.approvals()] == [event_id]
    [row] = [r for r in history.rows if r.RecordType == "Observation" and r.Outcome == "conflict"]
    assert (row.Reason or "").startswith("Event Grid (the platform) contradicts the facts web_1 reported first")
    # A VM repeating the lie later is a conflict against the platform's facts, which stay.
    again = envelope(vm.model_dump(), sequence=2, incarnation=document["DocumentIncarnation"] + 1, events=lie)
    service.process_batch([raw(again, partition_key=vm.resourceId.lower())])
    after = service.event(event_id)
    assert after is not None
    assert (after.record.eventType, after.record.conflictCount) == ("Freeze", 2)


def test_duplicates_are_ignored_and_canceled_concludes(
    waiting: tuple[Coordinator, MemoryHistory], imds: ImdsEmulator
) -> None:
    service, history = waiting
    event_id, listed = scheduled(imds, "Reboot", "web_0")
    first = service.process_batch([raw(listed), raw([listed])], channel="platform")
    assert first.duplicates == 1
    service.process_batch([raw(listed)], channel="platform")  # again in a later batch: not newer
    observations = [r for r in history.rows if r.EventId == event_id and r.RecordType == "Observation"]
    assert len(observations) == 1
    # An older status arriving late changes nothing either.
    service.process_batch([raw(grid(imds, event_id, "Canceled", DOC_NOW + timedelta(seconds=5)))], channel="platform")
    service.process_batch([raw(grid(imds, event_id, "Scheduled", DOC_NOW + timedelta(seconds=2)))], channel="platform")
    stored = service.event(event_id)
    assert stored is not None
    assert stored.record.state == "Canceled"
    assert not stored.record.everStarted


def test_malformed_event_grid_events_are_dead_lettered_with_reasons_while_the_rest_goes_on(
    waiting: tuple[Coordinator, MemoryHistory], imds: ImdsEmulator
) -> None:
    service, history = waiting
    good = create(imds, "Reboot", "web_0")
    listed = create(imds, "Reboot", "web_1")
    no_status = grid(imds, good, "Scheduled", DOC_NOW)
    del no_status["data"]["resourceInfo"]["properties"]["EventStatus"]
    exploded = grid(imds, good, "Exploded", DOC_NOW)
    other_type = {**grid(imds, good, "Scheduled", DOC_NOW), "eventType": "Microsoft.Resources.ResourceWriteSuccess"}
    wrong_id = grid(imds, good, "Scheduled", DOC_NOW)
    wrong_id["data"]["resourceInfo"]["id"] = wrong_id["data"]["resourceInfo"]["id"].replace(good, str(uuid.uuid4()))
    batch = service.process_batch(
        [raw([no_status, grid(imds, good, "Scheduled", DOC_NOW), exploded]), raw(other_type), raw(wrong_id), raw([])],
        channel="platform",
    )
    service.process_batch([report(imds, "web_1", 1)])
    assert batch.dead_lettered == 4  # one per refused message; the array's good event went on
    reasons = [r.Reason or "" for r in history.rows if r.RecordType == "DeadLetter"]
    assert all(reason.startswith("invalid Event Grid event") for reason in reasons), reasons
    joined = "\n".join(reasons)
    assert "EventStatus: Field required" in joined
    assert "EventStatus: Input should be 'Scheduled', 'Started', 'Completed' or 'Canceled'" in joined
    assert "eventType: Input should be" in joined
    assert "names event" in joined
    assert "empty array" in joined
    assert "event 0: " in joined
    assert "event 2: " in joined
    assert len(service.parts.store.dead_letters()) == 4
    for event_id in (good, listed):  # the valid event of the array and the envelope went on
        stored = service.event(event_id)
        assert stored is not None
        assert stored.record.state == "Scheduled"


def test_the_event_grid_source_end_to_end_over_the_event_hubs_emulator(
    azurite: AzuriteEndpoints, imds: ImdsEmulator, coordinator: tuple[Coordinator, MemoryHistory]
) -> None:
    service, history = coordinator
    lock = threading.Lock()
    received: list[int] = []

    def ingest(events: list[func.EventHubEvent]) -> None:
        with lock:
            service.process_batch([function_app._raw(e, {}) for e in events], channel="platform")
            received.append(len(events))

    def state(event_id: str) -> str | None:
        stored = service.event(event_id)
        return stored.record.state if stored is not None else None

    with EventHubsEmulator(hubs={PLATFORM_HUB: 2}) as eventhubs:
        publisher = EventGridPublisher(
            imds,
            connection_string=eventhubs.connection_string(),
            eventhub_name=PLATFORM_HUB,
            vms=["web_0"],
            duplicate=True,
            as_array=True,
        )
        host = FunctionHost(
            eventhub_connection_string=eventhubs.connection_string(),
            eventhub_name=PLATFORM_HUB,
            storage_connection_string=azurite.connection_string,
            ingest=ingest,
            checkpoint_container=f"grid-{uuid.uuid4().hex[:8]}",
        )
        host.start()
        try:
            event_id = create(imds, "Freeze", "web_0")
            assert publisher.publish() == 2, imds.events()  # Scheduled, twice (a platform duplicate)
            assert poll(lambda: bool(imds.arm_status()["acknowledged"]), timeout=20, interval=0.1)
            imds.clock.advance(1)  # type: ignore[attr-defined]
            assert publisher.publish() == 2, imds.events()  # Started
            assert poll(lambda: state(event_id) == "Started", timeout=20, interval=0.1)
            imds.clock.advance(700)  # type: ignore[attr-defined]  # Started stays listed 600 s (the emulator)
            assert publisher.publish() == 2, imds.events()  # Completed
            assert poll(lambda: state(event_id) == "Completed", timeout=20, interval=0.1)
        finally:
            host.stop()
            publisher.stop()
    assert [a["EventId"] for a in imds.arm_status()["acknowledged"]] == [event_id]
    assert sum(received) == 6
    observations = [r for r in history.rows if r.EventId == event_id and r.RecordType == "Observation"]
    assert [r.EventStatus for r in observations] == ["Scheduled", "Started", "Started", "Gone"]
