"""No VM chooses where its position is kept (``Fleet.group_of``): a VM with root on itself, its own vmId, resource
id, name and attested document, writes another placement group and scale set beside them. With ARM's census its
position is kept in the group ARM places it in, never in the one it names, so it can neither contend on another
group's entity nor fill it towards the table's 1 MiB; a position kept where a VM said before (an older coordinator,
or before ARM listed it) moves to ARM's group at its next envelope, its sequence and sightings kept. Fast: the
in-memory store, documents signed in-process by the IMDS emulator's signer, the census from a stub of ARM's lists.

Measured before (the first two tests failed): web_1's position was written into db_0's group ``pg:pg-db``.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from contracts.attestation import state_nonce
from contracts.envelope import VmIdentity
from coordinator.adapters.census import Census, CensusView
from coordinator.domain.census import CensusEntry
from coordinator.domain.controls import VmFacts
from coordinator.domain.model import SCALE_SET_BUCKETS, VmRecord
from coordinator.pipeline.fleet import Fleet
from coordinator.pipeline.ingest import RawMessage
from coordinator.service import Coordinator
from tests.coordinator.attested import DOCUMENTS, attested_coordinator, proven_approval
from tests.coordinator.helpers import DOC_NOW, MemoryHistory, envelope, scheduled_event, vm
from tests.coordinator.memory_store import MemoryStateStore

WEB_0 = vm("web_0", index=1, group="pg-web", scale_set="web")
WEB_1 = vm("web_1", index=2, group="pg-web", scale_set="web")
DB_0 = vm("db_0", index=3, group="pg-db", scale_set="db")
# web_1 with root on itself: its own identity, db_0's placement group and scale set beside it.
WEB_1_AS_DB = {**WEB_1, "placementGroupId": "pg-db", "vmScaleSetName": "db"}


def listed(identity: dict[str, Any]) -> CensusEntry:
    """``identity`` as ARM lists it: where it truly is."""
    facts = VmFacts(scaleSet=identity["vmScaleSetName"], placementGroup=identity["placementGroupId"], location="x")
    return CensusEntry(name=identity["name"], vmId=identity["vmId"], resourceId=identity["resourceId"], facts=facts)


class Listed:
    """ARM's lists as the census reads them (a stand-in for ARM's VM lists at the census' reader seam; the local
    stack's tests read the IMDS emulator's ARM face)."""

    scopes = ("/subscriptions/s/resourceGroups/rg-fleet",)

    def __init__(self, *entries: CensusEntry) -> None:
        self.entries = list(entries)

    def read(self) -> list[CensusEntry]:
        return self.entries


class Listeners:
    def send(self, request: Any, *, vm: VmIdentity) -> Any:
        return proven_approval(request, vm)


@dataclass
class Run:
    coordinator: Coordinator
    store: MemoryStateStore
    sequences: dict[str, int] = field(default_factory=dict)

    def send(self, identity: dict[str, Any], events: list[dict[str, Any]] | None = None) -> None:
        """One attested envelope of ``identity``'s forwarder (partition key: its own resource id)."""
        state = hashlib.sha256(f"{identity['resourceId']}|{identity['vmId']}".encode()).hexdigest()
        sequence = self.sequences[state] = self.sequences.get(state, 0) + 1
        data = envelope(identity, sequence=sequence, incarnation=sequence, events=events)
        data["stateId"] = state
        data["attestation"] = DOCUMENTS.document(identity, nonce=state_nonce(state), now=DOC_NOW)
        body = json.dumps(data).encode()
        self.coordinator.process_batch([RawMessage(body=body, partition_key=str(identity["resourceId"]).lower())])

    def groups(self) -> dict[str, list[str]]:
        """Every VM group the store holds -> the names of its VMs."""
        return {
            stored.record.group: sorted(vm.identity.name for vm in stored.record.vms.values())
            for stored in self.store.all_vm_groups()
        }

    def position(self, name: str) -> VmRecord:
        (found,) = [vm for s in self.store.all_vm_groups() for vm in s.record.vms.values() if vm.identity.name == name]
        return found


def run(tmp_path: Path, *, arm: bool, store: MemoryStateStore | None = None) -> Run:
    store = store or MemoryStateStore()
    census = Census(Listed(*map(listed, (WEB_0, WEB_1, DB_0)))) if arm else None
    coordinator = attested_coordinator(tmp_path / "cards", store, MemoryHistory(), Listeners(), census=census)
    return Run(coordinator, store)


def test_a_vm_naming_another_placement_group_keeps_its_position_in_its_own(tmp_path: Path) -> None:
    fleet = run(tmp_path, arm=True)
    fleet.send(DB_0)
    fleet.send(WEB_1_AS_DB)
    fleet.send(WEB_1_AS_DB, [scheduled_event("EV-1", resources=["web_1"])])
    assert fleet.groups() == {"pg:pg-db": ["db_0"], "pg:pg-web": ["web_1"]}
    # Its own word is kept as its word (the census' disagreement is reported from it), not as where it is kept.
    assert fleet.position("web_1").identity.placementGroupId == "pg-db"
    assert "EV-1" in fleet.position("web_1").sightings


def test_a_position_kept_where_the_vm_said_moves_to_arms_group_with_its_sightings(tmp_path: Path) -> None:
    """Kept in db_0's group by a coordinator without a census (the VM's word), then web_1's next envelope reaches a
    coordinator with ARM's census: its position is read from there, written to pg:pg-web, removed from pg:pg-db
    (db_0 untouched), its sequence and its sighting of EV-1 carried over (not a new VM)."""
    store = MemoryStateStore()
    before = run(tmp_path, arm=False, store=store)
    before.send(DB_0)
    before.send(WEB_1_AS_DB, [scheduled_event("EV-1", resources=["web_1"])])
    assert before.groups() == {"pg:pg-db": ["db_0", "web_1"]}
    seen = before.position("web_1").sightings["EV-1"]

    after = run(tmp_path, arm=True, store=store)
    after.sequences = before.sequences
    after.send(WEB_1_AS_DB, [scheduled_event("EV-1", resources=["web_1"])])
    assert after.groups() == {"pg:pg-db": ["db_0"], "pg:pg-web": ["web_1"]}
    moved = after.position("web_1")
    assert moved.sightings["EV-1"].firstSeen == seen.firstSeen
    assert moved.lastSequence == 2
    assert after.position("db_0") == before.position("db_0")


def test_without_a_census_a_vm_is_kept_where_it_says(tmp_path: Path) -> None:
    """What Azure signs (the attested document) names no placement group: without ARM's census the coordinator has
    only the VM's word for it (docs/limits.md)."""
    fleet = run(tmp_path, arm=False)
    fleet.send(WEB_1_AS_DB)
    assert fleet.groups() == {"pg:pg-db": ["web_1"]}


def _entry(name: str, *, scale_set: str = "", placement: str = "", resource: str = "", vm_id: str = "") -> CensusEntry:
    identity = vm(name, index=7, scale_set=scale_set)
    return CensusEntry(
        name=name,
        vmId=vm_id or identity["vmId"],
        resourceId=resource or identity["resourceId"],
        facts=VmFacts(scaleSet=scale_set, placementGroup=placement),
    )


@pytest.mark.parametrize(
    ("listed", "expected"),
    [
        (dict(scale_set="web", placement="pg-1"), "pg:pg-1"),  # a Uniform instance: its placement group
        (dict(scale_set="web"), "vmss:{sub}/rg-fleet/web#{bucket}"),  # a Flexible member: its scale set, in buckets
        (dict(placement="avset-1"), "pg:{sub}/rg-fleet/avset-1"),  # an availability set, named with its group
        ({}, "vm:{vm_id}"),  # a VM on its own
    ],
    ids=["uniform", "flexible", "availability-set", "alone"],
)
def test_arm_places_a_listed_vm_whatever_it_says(listed: dict[str, str], expected: str) -> None:
    says = vm("web_9", index=7, group="pg-somebody-elses", scale_set="elsewhere")
    entry = _entry("web_9", **listed)
    says["resourceId"] = entry.resourceId
    fleet = Fleet(MemoryStateStore(), census=CensusView(Census(Listed(entry)), DOC_NOW))
    key = fleet.group_of(VmIdentity.model_validate(says))
    vm_id = says["vmId"].lower()
    bucket = zlib.crc32(vm_id.encode()) % SCALE_SET_BUCKETS
    assert key == expected.format(sub=says["subscriptionId"].lower(), bucket=bucket, vm_id=vm_id)


def test_a_vm_arm_does_not_list_as_it_says_is_placed_by_its_own_word() -> None:
    says = VmIdentity.model_validate(vm("web_9", index=7, group="pg-9", scale_set="web"))
    other_vm = _entry("web_9", scale_set="web", placement="pg-1", vm_id="ffffffff-0000-4000-8000-00000000ffff")
    other_vm = CensusEntry(other_vm.name, other_vm.vmId, says.resourceId, other_vm.facts)
    for census in (None, CensusView(Census(Listed()), DOC_NOW), CensusView(Census(Listed(other_vm)), DOC_NOW)):
        assert Fleet(MemoryStateStore(), census=census).group_of(says) == "pg:pg-9"


def test_a_vm_card_is_cleared_in_the_group_its_position_was_read_from(tmp_path: Path) -> None:
    """A card raised by the timer for a VM kept in another group than ARM's (its copy there not moved yet) is
    cleared there once sent: not sent again at every tick."""
    store = MemoryStateStore()
    before = run(tmp_path, arm=False, store=store)
    before.send(WEB_1_AS_DB)
    after = run(tmp_path, arm=True, store=store)
    after.coordinator.parts = replace(after.coordinator.parts, clock=lambda: DOC_NOW + timedelta(minutes=30))
    after.coordinator.tick()
    assert after.position("web_1").heartbeatLost
    assert after.position("web_1").pendingAlerts == []
