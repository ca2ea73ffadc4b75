"""Event Grid as a second source (coordinator/pipeline/event_grid.py): each event read on its own, the VMs it names
keyed to the VMs forwarders reported (one VM, one record) or made agentless, and the observations each status
gives, below every forwarder's."""

from __future__ import annotations

import hashlib
from datetime import timedelta
from typing import Any

import pytest

from coordinator.domain.model import VmGroupRecord, VmRecord, group_key
from coordinator.pipeline import event_grid
from coordinator.state.store import Stored
from tests.coordinator.helpers import DOC_NOW, SUBSCRIPTION
from tests.coordinator.helpers import grid_event as grid
from tests.coordinator.memory_store import MemoryStateStore
from tests.coordinator.runs import identity, put_vm


def parsed(data: dict[str, Any]) -> event_grid.GridEvent:
    [event] = event_grid.read_events(data)
    assert isinstance(event, event_grid.GridEvent), event
    return event


def test_what_is_event_grid_and_what_is_an_envelope():
    assert event_grid.is_event_grid([grid()])
    assert event_grid.is_event_grid(grid())
    assert not event_grid.is_event_grid({"schema": "scheduled-events.envelope/1", "eventType": "x"})
    assert not event_grid.is_event_grid("text")


def test_each_event_of_a_message_is_read_on_its_own():
    wrong_id = grid("EV-A")
    wrong_id["data"]["resourceInfo"]["properties"]["EventId"] = "EV-B"
    not_a_vm = grid()
    not_a_vm["data"]["resourceInfo"]["id"] = "/subscriptions/x/resourceGroups/y/providers/Microsoft.Storage/z"
    read = event_grid.read_events([grid(grid_id="g-good"), wrong_id, not_a_vm, {"id": "g-bad"}])
    assert isinstance(read[0], event_grid.GridEvent)
    assert read[0].id == "g-good"
    assert [type(r).__name__ for r in read[1:]] == ["ValueError", "ValueError", "ValidationError"]
    assert "names event 'EV-A', its properties 'EV-B'" in str(read[1])
    assert "is not a VM's or scale set's scheduled event" in str(read[2])
    assert event_grid.describe(read[3]).startswith("eventType: ")  # type: ignore[arg-type]
    assert [str(e) for e in event_grid.read_events([])] == ["an empty array (no Event Grid event)"]


def test_a_vm_a_forwarder_reported_is_that_vm():
    store = MemoryStateStore()
    reported = put_vm(store, "web_0", scale_set="web")
    per_vm = event_grid.sightings(store, [parsed(grid(resources=["WEB_0"]))], speaking={})
    # Matched by subscription, resource group and name (any case): the forwarder's vmId, its group.
    assert list(per_vm) == [reported.identity.vmId.lower()]
    sighting, observations = per_vm[reported.identity.vmId.lower()]
    assert sighting.identity == reported.identity
    assert sighting.key == group_key(reported.identity)
    assert [(o.kind, o.event_id, o.epoch) for o in observations] == [("listed", "EV-G", event_grid.EVENT_GRID_EPOCH)]


def test_a_vm_no_forwarder_reported_is_agentless_with_an_identity_from_its_arm_id():
    store = MemoryStateStore()
    put_vm(store, "web_0", scale_set="web")  # another resource group's web_0 is another VM
    per_vm = event_grid.sightings(store, [parsed(grid(resources=["web_0"], resource_group="rg-other"))], speaking={})
    [(vm_id, (sighting, _))] = per_vm.items()
    arm_id = f"/subscriptions/{SUBSCRIPTION}/resourceGroups/rg-other/providers/Microsoft.Compute/virtualMachines/web_0"
    assert vm_id == "arm-" + hashlib.sha256(arm_id.lower().encode()).hexdigest()[:32]
    assert sighting.identity.vmScaleSetName == "web"
    assert sighting.identity.resourceId == arm_id
    assert sighting.key == group_key(sighting.identity)
    # The same VM named again gets the same identity: one record, however often Event Grid speaks of it.
    again = event_grid.sightings(
        store, [parsed(grid("EV-H", resources=["web_0"], resource_group="rg-other"))], speaking={}
    )
    assert list(again) == [vm_id]


def test_a_vm_is_where_its_resource_id_says_not_where_its_other_fields_say():
    """web_0 of rg-fleet writes rg-other in its resourceGroupName: Event Grid's events about rg-other's web_0 (another
    VM) are not its sightings, and its own group's still are."""
    store = MemoryStateStore()
    lying = identity("web_0", scale_set="web").model_copy(update={"resourceGroupName": "rg-other"})
    liar = VmRecord(identity=lying, lastSeen=DOC_NOW)
    store.save_vm_group(VmGroupRecord(group=group_key(lying), vms={lying.vmId.lower(): liar}), None)
    other = event_grid.sightings(store, [parsed(grid(resources=["web_0"], resource_group="rg-other"))], speaking={})
    [(vm_id, (sighting, _))] = other.items()
    assert vm_id.startswith("arm-"), "rg-other's web_0 is another VM: agentless, not the liar"
    assert sighting.identity.resourceGroupName == "rg-other"
    own = event_grid.sightings(store, [parsed(grid(resources=["web_0"]))], speaking={})
    assert list(own) == [liar.identity.vmId.lower()]
    speaking = {liar.identity.vmId.lower(): (group_key(liar.identity), liar)}
    assert list(event_grid.sightings(MemoryStateStore(), [parsed(grid())], speaking=speaking)) == list(own)
    assert event_grid.where(liar.identity) == (SUBSCRIPTION.lower(), "rg-fleet", "web_0")


def agentless_record_of_web_0(store: MemoryStateStore) -> str:
    """Stores web_0 as Event Grid made it before its forwarder first reported; gives its vmId."""
    [(vm_id, (sighting, _))] = event_grid.sightings(store, [parsed(grid())], speaking={}).items()
    record = VmRecord(identity=sighting.identity, lastSeen=DOC_NOW, agentless=True)
    store.save_vm_group(VmGroupRecord(group=sighting.key, vms={vm_id: record}), None)
    return vm_id


def test_a_forwarders_record_of_a_vm_wins_over_an_agentless_one():
    store = MemoryStateStore()
    agentless = agentless_record_of_web_0(store)
    reported = put_vm(store, "web_0", scale_set="web")
    per_vm = event_grid.sightings(store, [parsed(grid())], speaking={})
    assert list(per_vm) == [reported.identity.vmId.lower()] != [agentless]


def test_a_forwarder_speaking_in_this_batch_wins_over_an_agentless_record():
    store = MemoryStateStore()
    agentless_record_of_web_0(store)
    new = identity("web_0", scale_set="web")  # its first envelope is in this batch: no position stored yet
    speaking = {new.vmId.lower(): (group_key(new), VmRecord(identity=new, lastSeen=DOC_NOW))}
    per_vm = event_grid.sightings(store, [parsed(grid())], speaking=speaking)
    assert list(per_vm) == [new.vmId.lower()]
    assert per_vm[new.vmId.lower()][0].key == group_key(new)


def test_events_naming_one_vm_are_gathered_under_it():
    store = MemoryStateStore()
    reported = put_vm(store, "web_0", scale_set="web")
    events = [parsed(grid("EV-1", resources=["web_0", "web_9"])), parsed(grid("EV-2", grid_id="g-2"))]
    per_vm = event_grid.sightings(store, events, speaking={})
    assert len(per_vm) == 2
    assert [o.event_id for o in per_vm[reported.identity.vmId.lower()][1]] == ["EV-1", "EV-2"]


def test_no_events_read_nothing():
    class Unreadable(MemoryStateStore):
        def all_vm_groups(self) -> list[Stored[VmGroupRecord]]:
            raise AssertionError("read the VM groups for no event")

    assert event_grid.sightings(Unreadable(), [], speaking={}) == {}


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        ("Scheduled", [("listed", "Scheduled", 0)]),
        ("Started", [("listed", "Started", 0)]),
        # It ran: seen Started, then gone (the record concludes Completed, not Canceled).
        ("Completed", [("listed", "Started", -1), ("gone", None, 0)]),
        ("Canceled", [("gone", None, 0)]),
    ],
)
def test_each_status_gives_its_observations_ordered_by_event_time(status, expected):
    event = parsed(grid(status=status))
    observations = event_grid.observations_of(event, identity("web_0", scale_set="web"))
    micros = int(DOC_NOW.timestamp() * 1_000_000)
    assert [(o.kind, o.event.EventStatus if o.event else None, o.sequence - micros) for o in observations] == expected
    assert all(o.epoch == event_grid.EVENT_GRID_EPOCH < 0 for o in observations)
    listed = [o.event for o in observations if o.event is not None]
    # NotBefore is "" once Started, as IMDS shows it.
    assert all((e.NotBefore == "") == (e.EventStatus == "Started") for e in listed)


def test_a_later_status_has_a_later_sequence():
    first = event_grid.observations_of(parsed(grid()), identity("web_0"))
    later = event_grid.observations_of(parsed(grid(at=DOC_NOW + timedelta(seconds=1))), identity("web_0"))
    assert later[0].sequence - first[0].sequence == 1_000_000
