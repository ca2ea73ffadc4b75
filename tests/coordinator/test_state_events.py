"""Event records as the stages see them (coordinator/state/events.py), on the in-memory store: sightings put back
from the VM groups, a fresh read, and ``commit_event``'s read-modify-write of one event."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from coordinator.domain.lifecycle import EventChange
from coordinator.domain.model import EventRecord, VmGroupRecord, VmRecord, VmSighting
from coordinator.state.commit import COMMIT_ATTEMPTS
from coordinator.state.events import assemble, commit_event, read_event
from coordinator.state.store import ConcurrencyConflict, Stored
from tests.coordinator.helpers import DOC_NOW, event_record, vm_position
from tests.coordinator.memory_store import MemoryStateStore


class CountingStore(MemoryStateStore):
    """Counts the reads of events."""

    def __init__(self) -> None:
        super().__init__()
        self.event_reads = 0

    def get_events(self, event_ids: Iterable[str], *, cached: bool = False) -> dict[str, Stored[EventRecord]]:
        self.event_reads += 1
        return super().get_events(event_ids, cached=cached)


def sighting(*, sequence: int = 1, epoch: int = 0) -> VmSighting:
    return VmSighting(firstSeen=DOC_NOW, lastSeen=DOC_NOW, lastSequence=sequence, status="Scheduled", epoch=epoch)


def seen(name: str, index: int, **sightings: VmSighting) -> VmRecord:
    return vm_position(name, index=index, sightings=sightings)


def stored_group(key: str, *vms: VmRecord) -> Stored[VmGroupRecord]:
    return Stored(VmGroupRecord(group=key, vms={v.identity.vmId.lower(): v for v in vms}), f"etag-{key}")


def as_assembled(vm: VmRecord, event_id: str) -> VmSighting:
    identity = vm.identity
    return vm.sightings[event_id].model_copy(
        update={
            "name": identity.name,
            "vmId": identity.vmId,
            "resourceId": identity.resourceId,
            "scaleSet": identity.vmScaleSetName,
            "placementGroup": identity.placementGroupId,
        }
    )


def current(store: MemoryStateStore) -> Stored[EventRecord]:
    stored = store.get_event("EV-1")
    assert stored is not None
    return stored


def with_alert(record: EventRecord | None, kind: str) -> EventChange:
    base = record or event_record("EV-1")
    return EventChange(record=base.model_copy(update={"alerts": [*base.alerts, kind]}), changed=True)


# assemble --------------------------------------------------------------------------------------------------------
def test_assemble_puts_each_vms_sighting_back_with_its_identity():
    vm0 = seen("WestNO_0", 1, **{"EV-1": sighting(sequence=3), "EV-2": sighting()})
    vm1 = seen("WestNO_1", 2, **{"EV-2": sighting()})  # did not see EV-1
    vm2 = seen("EastNO_0", 3, **{"EV-1": sighting(sequence=7)})
    vm3 = seen("NorthNO_0", 4, **{"EV-1": sighting()})  # in a group the event does not name
    event = Stored(event_record("EV-1", groups=["pg:a", "pg:b", "pg:gone"], vms={"stale": sighting()}), "etag-ev")
    groups = {
        "pg:a": stored_group("pg:a", vm0, vm1),
        "pg:b": stored_group("pg:b", vm2),
        "pg:c": stored_group("pg:c", vm3),
    }

    assembled = assemble({"EV-1": event}, groups)

    assert assembled == {
        "EV-1": Stored(
            event.record.model_copy(
                update={"vms": {"WestNO_0": as_assembled(vm0, "EV-1"), "EastNO_0": as_assembled(vm2, "EV-1")}}
            ),
            "etag-ev",
        )
    }
    assert assemble({"EV-3": Stored(event_record("EV-3"), None)}, groups)["EV-3"].record.vms == {}


@pytest.mark.parametrize("forwarder_first", [True, False])
def test_assemble_takes_the_later_position_of_two_records_of_one_vm_name(forwarder_first):
    # An agentless record (Event Grid, epoch -1) made before the VM's forwarder first reported: the forwarder's
    # position is above it whatever the sequences, and within one epoch the higher sequence wins.
    agentless = seen("WestNO_0", 1, **{"EV-1": sighting(sequence=100, epoch=-1)})
    forwarder = seen("WestNO_0", 2, **{"EV-1": sighting(sequence=1, epoch=0)})
    later = seen("WestNO_0", 3, **{"EV-1": sighting(sequence=2, epoch=0)})
    keys = ["pg:fwd", "pg:eg"] if forwarder_first else ["pg:eg", "pg:fwd"]
    groups = {"pg:eg": stored_group("pg:eg", agentless), "pg:fwd": stored_group("pg:fwd", forwarder)}

    vms = assemble({"EV-1": Stored(event_record("EV-1", groups=keys), None)}, groups)["EV-1"].record.vms
    assert vms == {"WestNO_0": as_assembled(forwarder, "EV-1")}

    groups["pg:later"] = stored_group("pg:later", later)
    event = Stored(event_record("EV-1", groups=[*keys, "pg:later"]), None)
    assert assemble({"EV-1": event}, groups)["EV-1"].record.vms == {"WestNO_0": as_assembled(later, "EV-1")}


# read_event ------------------------------------------------------------------------------------------------------
def test_read_event_reads_the_event_and_its_groups_fresh():
    store = MemoryStateStore()
    assert read_event(store, "EV-1") is None

    vm0 = seen("WestNO_0", 1, **{"EV-1": sighting(sequence=4)})
    store.save_vm_group(stored_group("pg:avset-westno", vm0).record, None)
    etag = store.save_event(event_record("EV-1", groups=["pg:avset-westno"]), None)

    stored = read_event(store, "EV-1")
    assert stored == Stored(
        event_record("EV-1", groups=["pg:avset-westno"], vms={"WestNO_0": as_assembled(vm0, "EV-1")}, revision=1),
        etag,
    )


# commit_event ----------------------------------------------------------------------------------------------------
def test_commit_event_creates_an_event_that_is_not_stored():
    store = MemoryStateStore()
    seen_by_mutate: list[EventRecord | None] = []

    def mutate(record: EventRecord | None) -> EventChange:
        seen_by_mutate.append(record)
        return with_alert(record, "approved")

    change = commit_event(store, "EV-1", mutate)

    assert seen_by_mutate == [None]
    assert change is not None
    assert current(store).record == change.record


def test_commit_event_writes_with_the_etag_of_the_record_just_read_without_reading_again():
    store = CountingStore()
    store.save_event(event_record("EV-1"), None)
    read = read_event(store, "EV-1")
    reads = store.event_reads

    change = commit_event(store, "EV-1", lambda r: with_alert(r, "approved"), read=read)

    assert store.event_reads == reads
    assert change is not None
    assert current(store).record.alerts == ["approved"]


def test_commit_event_redoes_on_a_fresh_read_when_the_record_it_was_given_is_stale():
    store = CountingStore()
    store.save_event(event_record("EV-1"), None)
    read = read_event(store, "EV-1")
    assert read is not None
    store.save_event(event_record("EV-1", alerts=["other"]), read.etag)  # another instance, after that read
    conflicts: list[int] = []

    commit_event(store, "EV-1", lambda r: with_alert(r, "mine"), read=read, on_conflict=lambda: conflicts.append(1))

    assert conflicts == [1]
    assert current(store).record.alerts == ["other", "mine"]  # redone on what the other wrote


def test_commit_event_writes_nothing_when_the_change_changed_nothing():
    store = MemoryStateStore()
    etag = store.save_event(event_record("EV-1"), None)

    assert commit_event(store, "EV-1", lambda r: EventChange(record=r or event_record("EV-1"))) is None
    assert commit_event(store, "EV-1", lambda _r: None) is None
    assert current(store).etag == etag


def test_commit_event_gives_up_after_every_attempt_met_a_newer_write():
    store = MemoryStateStore()
    store.save_event(event_record("EV-1"), None)
    conflicts: list[int] = []

    def meddled(record: EventRecord | None) -> EventChange:
        now = current(store)  # another instance writes first, every time
        store.save_event(now.record.model_copy(update={"conflictCount": now.record.conflictCount + 1}), now.etag)
        return with_alert(record, "mine")

    with pytest.raises(ConcurrencyConflict, match=f"event EV-1: gave up after {COMMIT_ATTEMPTS}"):
        commit_event(store, "EV-1", meddled, on_conflict=lambda: conflicts.append(1))
    assert len(conflicts) == COMMIT_ATTEMPTS
    assert current(store).record.alerts == []
