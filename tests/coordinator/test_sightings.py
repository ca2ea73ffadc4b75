"""The state machine without I/O: per-VM ordering, merging across VMs, gone/Completed/Canceled, Expired."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from coordinator.model import EventRecord, VmRecord
from coordinator.sightings import advance, apply_observations, choose_executor, vm_observations
from forwarder.envelope import Envelope
from tests.coordinator.helpers import DOC_EVENT_ID, DOC_NOW, documented_example, envelope, scheduled_event, vm


def envelopes(items: list[dict[str, Any]]) -> list[Envelope]:
    return [Envelope.model_validate(e) for e in items]


def run(
    items: list[dict[str, Any]],
    now: datetime = DOC_NOW,
    vm_records: dict[str, VmRecord] | None = None,
    record: EventRecord | None = None,
) -> tuple[Any, dict[str, VmRecord]]:
    """Feeds envelopes VM by VM through the pure functions, as the service does per batch."""
    vm_records = dict(vm_records or {})
    by_vm: dict[str, list[Envelope]] = {}
    for e in envelopes(items):
        by_vm.setdefault(e.vm.vmId, []).append(e)
    observations = []
    for vm_id, group in by_vm.items():
        update = vm_observations(vm_records.get(vm_id), group)
        vm_records[vm_id] = update.record
        observations += update.observations
    change = apply_observations(record, [o for o in observations if o.event_id == DOC_EVENT_ID], now)
    return change, vm_records


def test_documented_example_ends_as_one_completed_event():
    change, vms = run(documented_example(), now=DOC_NOW + timedelta(minutes=3))
    assert change is not None
    record = change.record
    assert record.state == "Completed"
    assert sorted(record.vms) == ["WestNO_0", "WestNO_1"]
    assert {s.status for s in record.vms.values()} == {"Gone"}
    transitions = [(r.PreviousState, r.State) for r in change.rows if r.RecordType == "Transition"]
    assert transitions == [("Scheduled", "Started"), ("Started", "Completed")]
    observations = [
        (r.VmName, r.EventStatus, r.DocumentIncarnation) for r in change.rows if r.RecordType == "Observation"
    ]
    assert len(observations) == 6  # two VMs x (Scheduled, Started, Gone)
    assert change.alerts == ["new-event"]
    assert all(v.lastSequence == 13 and v.lastIncarnation == 4 and v.listed == [] for v in vms.values())


def test_duplicates_and_stale_envelopes_change_nothing():
    items = documented_example()
    first, vms = run(items[:2] + items[4:6])  # both VMs: incarnations 1 and 2
    again, _ = run(items[:2] + items[4:6], vm_records=vms, record=first.record)
    assert again is not None
    assert not again.changed
    assert again.rows == []
    # The record itself also ignores an envelope it already holds (a replay after a crash before the VM write).
    replay, _ = run(items[1:2], record=first.record)
    assert not replay.changed
    # Out of order: incarnation 3 (Started) seen before a late incarnation 2 of the same VM.
    started, vms2 = run(items[2:3])
    assert started.record.state == "Started"
    late = vm_observations(vms2[items[2]["vm"]["vmId"]], envelopes(items[1:2]))
    assert late.duplicates == 1
    assert late.observations == []


def test_started_without_notice_and_gone_from_the_vms_that_report_again():
    wnO, wn1 = vm("WestNO_0", index=1), vm("WestNO_1", index=2)
    hw = scheduled_event(event_type="Reboot", status="Started", duration=-1)
    change, vms = run(
        [envelope(wnO, sequence=1, incarnation=7, events=[hw]), envelope(wn1, sequence=1, incarnation=3, events=[hw])]
    )
    assert change.record.state == "Started"
    assert change.alerts == ["started-without-notice"]
    assert "appeared directly as Started" in next(r.Reason for r in change.rows if r.RecordType == "Transition")
    # WestNO_0 comes back with an empty document; WestNO_1 never reports again (its forwarder died).
    gone, _ = run([envelope(wnO, sequence=2, incarnation=8, events=[])], vm_records=vms, record=change.record)
    assert gone.record.state == "Started"
    advance(gone, DOC_NOW, silent_vms=frozenset({"WestNO_1"}))
    assert gone.record.state == "Completed"


def test_canceled_when_gone_without_starting_and_expired_when_not_before_passes():
    items = documented_example()
    scheduled, vms = run(items[:2] + items[4:6])
    assert scheduled.record.state == "Scheduled"
    later = DOC_NOW + timedelta(minutes=16)  # NotBefore 22:26:58 passed, nobody approved
    advance(scheduled, later)
    assert scheduled.record.state == "Expired"
    assert "expired" in scheduled.alerts
    canceled, _ = run([items[3], items[7]], vm_records=vms, record=scheduled.record, now=later)
    assert canceled.record.state == "Canceled"
    assert "canceled" in canceled.alerts


def test_hook_reports_are_recorded_once_per_vm():
    items = documented_example()
    scheduled, vms = run(items[:2])
    identity = items[0]["vm"]
    hook = {"eventId": DOC_EVENT_ID, "phase": "prepare", "outcome": "succeeded", "durationSeconds": 1.5, "exitCode": 0}
    hooked, vms = run(
        [envelope(identity, sequence=20, kind="hook", hook=hook)], vm_records=vms, record=scheduled.record
    )
    assert hooked.record.vms["WestNO_0"].hooks == {"prepare": "succeeded"}
    assert [r.RecordType for r in hooked.rows] == ["Hook"]
    replay = apply_observations(hooked.record, [], DOC_NOW)
    assert replay is not None
    assert not replay.changed


def test_leader_is_the_first_live_vm_in_resources():
    change, _ = run(documented_example()[1:2] + documented_example()[5:6])
    record = change.record
    seen = {"WestNO_0": DOC_NOW, "WestNO_1": DOC_NOW}
    leader = choose_executor(record, seen, DOC_NOW - timedelta(minutes=5))
    assert leader is not None
    assert leader.name == "WestNO_0"
    seen["WestNO_0"] = DOC_NOW - timedelta(hours=1)
    fallback = choose_executor(record, seen, DOC_NOW - timedelta(minutes=5))
    assert fallback is not None
    assert fallback.name == "WestNO_1"
    seen["WestNO_1"] = DOC_NOW - timedelta(hours=1)
    assert choose_executor(record, seen, DOC_NOW - timedelta(minutes=5)) is None


def test_a_terminate_is_never_executed_by_a_peer():
    change, _ = run(
        [
            envelope(
                vm("WestNO_1", index=2),
                sequence=1,
                incarnation=2,
                events=[scheduled_event(event_type="Terminate", resources=["WestNO_0"])],
            )
        ]
    )
    record = change.record
    assert choose_executor(record, {}, DOC_NOW - timedelta(minutes=5)) is None
    freeze = record.model_copy(update={"eventType": "Freeze"})
    executor = choose_executor(freeze, {}, DOC_NOW - timedelta(minutes=5))
    assert executor is not None
    assert executor.name == "WestNO_1"


def test_envelopes_are_read_in_arrival_order_and_a_new_state_restarts_the_position():
    identity = vm("WestNO_0", index=1)

    def item(state: str, sequence: int) -> dict[str, Any]:
        data = envelope(identity, sequence=sequence, incarnation=sequence, events=[])
        data["stateId"] = state
        return data

    first = vm_observations(None, envelopes([item("a", 5), item("a", 6)]))
    assert (first.record.stateId, first.record.lastSequence, first.record.epoch) == ("a", 6, 0)
    # Arrival order: b's 1 and 2, then a replay of a's 7 (after a crash): dropped as from a past state.
    second = vm_observations(first.record, envelopes([item("b", 1), item("b", 2), item("a", 7), item("b", 2)]))
    assert (second.applied, second.duplicates) == (2, 2)
    assert (second.record.stateId, second.record.lastSequence, second.record.epoch) == ("b", 2, 1)
    assert second.record.pastStates == ["a"]
    assert [r.Outcome for r in second.rows] == ["reset"]
    # Without a stateId (older forwarders), as before: by sequence.
    legacy = vm_observations(None, envelopes([item("", 3), item("", 2), item("", 4)]))
    assert (legacy.applied, legacy.duplicates, legacy.record.lastSequence) == (2, 1, 4)
