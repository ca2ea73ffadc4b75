"""No VM speaks for another by name (issue 34): a VM with root on itself, its own vmId, its own resource id as partition
key and its own valid attested document, writes another VM's name. Its envelopes are dead-lettered at the door (ARM's
census, or without one the name's binding to the vmId that attested it first), and an event's sightings move only
with their own VM's observations. Fast: the in-memory store, documents signed in-process by the IMDS emulator's
signer, a coordinator that requires them, the census from a stub of ARM's lists.

Measured before (each test here failed): the spoofer's 5 s Freeze under web_0's name, reported first, was approved
through the spoofer's hybrid connection; its listing of web_0's Reboot at sequence 2^62 and its drop made the Reboot
Canceled and silenced web_0's later listing; its "prepare hooks succeeded" decided web_0's delete ``approve``; its
impact report wrote an Impact row for web_0; a peer's Started dated the event's start.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from contracts.approval import ApprovalRequest, ApprovalResult
from contracts.attestation import Attestation, decision_nonce, state_nonce
from contracts.document import ScheduledEvent
from contracts.envelope import HookReport, VmIdentity
from coordinator.adapters.census import Census
from coordinator.domain.attestation import Attestations
from coordinator.domain.census import CensusEntry
from coordinator.domain.controls import VmFacts
from coordinator.domain.event_merge import apply_observations
from coordinator.domain.model import EventRecord, VmGroupRecord, VmRecord, VmSighting
from coordinator.domain.observations import Observation
from coordinator.domain.rows import HistoryRow
from coordinator.pipeline.act import send
from coordinator.pipeline.attest import answer_problem
from coordinator.pipeline.bindings import name_claim, vm_name_claim
from coordinator.pipeline.ingest import RawMessage
from coordinator.service import Coordinator
from coordinator.state.entities import claim_partition, safe_key
from coordinator.state.events import assemble
from coordinator.state.store import Stored
from tests.coordinator.attested import DOCUMENTS, attested_coordinator, proven_approval, verifier
from tests.coordinator.helpers import DOC_NOW, MemoryHistory, envelope, scheduled_event, vm
from tests.coordinator.memory_store import MemoryStateStore
from tests.coordinator.runs import AnswersInTurn

WEB_0 = vm("web_0", index=1, group="pg-web", scale_set="web")
WEB_1 = vm("web_1", index=2, group="pg-web", scale_set="web")
# web_1 with root on itself: its own vmId and resource id (the partition key), another VM's name.
AS_WEB_0 = {**WEB_1, "name": "web_0"}
FORGED = 2**62


class Listeners:
    """Every VM's listener, in process: approves what it is asked, with the proof of the VM it was sent to, and
    remembers which hybrid connection (vmId) each request went to."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, str]] = []

    def send(self, request: ApprovalRequest, *, vm: VmIdentity) -> ApprovalResult:
        self.sent.append((request.eventId, vm.name, vm.hybrid_connection_name))
        return proven_approval(request, vm)


class Arm:
    """ARM's lists as the census reads them: web_0 and web_1 of scale set web."""

    scopes = ("/subscriptions/s/resourceGroups/rg-fleet",)

    def read(self) -> list[CensusEntry]:
        return [
            CensusEntry(
                name=identity["name"],
                vmId=identity["vmId"],
                resourceId=identity["resourceId"],
                facts=VmFacts(scaleSet="web", placementGroup="pg-web", location="norwayeast"),
            )
            for identity in (WEB_0, WEB_1)
        ]


@dataclass
class Fleet:
    coordinator: Coordinator
    store: MemoryStateStore
    history: MemoryHistory
    listeners: Listeners
    sequences: dict[str, int] = field(default_factory=dict)

    def send(self, identity: dict[str, Any], events: list[dict[str, Any]] | None = None, **fields: Any) -> None:
        """One envelope of ``identity``'s forwarder (its state is its partition key's: the VM that sends it), with
        the attested document IMDS signs for that VM's own vmId."""
        state = hashlib.sha256(f"{identity['resourceId']}|{identity['name']}|{identity['vmId']}".encode()).hexdigest()
        sequence = self.sequences[state] = self.sequences.get(state, FORGED if identity is AS_WEB_0 else 0) + 1
        kind = str(fields.pop("kind", "incarnation"))
        data = envelope(identity, sequence=sequence, incarnation=sequence, events=events, kind=kind)
        data.update(fields)
        data["stateId"] = state
        data["attestation"] = DOCUMENTS.document(identity, nonce=state_nonce(state), now=DOC_NOW)
        body = json.dumps(data).encode()
        self.coordinator.process_batch([RawMessage(body=body, partition_key=str(identity["resourceId"]).lower())])

    def dead(self) -> list[str]:
        return [str(letter["Reason"]) for letter in self.store.dead_letters()]

    def rows(self, record_type: str) -> list[HistoryRow]:
        return [row for row in self.history.rows if row.RecordType == record_type]

    def event(self, event_id: str) -> EventRecord:
        stored = self.store.get_events([event_id])[event_id]
        groups = self.store.get_vm_groups(stored.record.groups)
        return assemble({event_id: stored}, groups)[event_id].record


def fleet(tmp_path: Path, *, arm: bool = True, store: MemoryStateStore | None = None) -> Fleet:
    store, history, listeners = store or MemoryStateStore(), MemoryHistory(), Listeners()
    coordinator = attested_coordinator(
        tmp_path / "cards", store, history, listeners, census=Census(Arm()) if arm else None
    )
    return Fleet(coordinator, store, history, listeners)


def freeze(event_id: str, on: str = "web_0", *, duration: int = 5, status: str = "Scheduled") -> dict[str, Any]:
    return scheduled_event(event_id, resources=[on], duration=duration, status=status)


@pytest.mark.parametrize("arm", [True, False], ids=["arms-census", "bindings"])
def test_a_vm_writing_another_vms_name_first_steals_no_approval(tmp_path: Path, arm: bool) -> None:
    """web_1 reports web_0's 5 s Freeze first, under web_0's name with its own identity: dead-lettered (ARM names
    web_1's resource id web_1; without a census, web_1's vmId is bound to its own name). web_0's own sighting is
    approved through web_0's hybrid connection."""
    run = fleet(tmp_path, arm=arm)
    run.send(WEB_1)  # web_1's forwarder: its vmId, resource id and name bound (without a census)
    run.send(AS_WEB_0, [freeze("EV-FREEZE")])
    (reason,) = run.dead()
    assert "speaks under another VM's name" in reason, reason
    assert ("ARM names" in reason) if arm else ("is named 'web_1'" in reason), reason
    assert run.listeners.sent == []
    run.send(WEB_0, [freeze("EV-FREEZE")])
    assert run.listeners.sent == [("EV-FREEZE", "web_0", f"vm-{WEB_0['vmId']}")]


def test_without_a_census_a_name_is_bound_to_the_vm_that_attested_it_first(tmp_path: Path) -> None:
    """web_0 spoke first: its name is its vmId's, so web_1's envelope in that name is refused, and binds nothing."""
    run = fleet(tmp_path, arm=False)
    run.send(WEB_0)
    run.send({**WEB_1, "name": "web_0", "vmId": "0000beef-0000-4000-8000-00000000beef"})
    run.send(AS_WEB_0, [freeze("EV-FREEZE")])
    reasons = run.dead()
    assert len(reasons) == 2, reasons
    assert all("another VM speaks under its name" in r for r in reasons), reasons
    assert run.store.claimed("vm-name:web_0") == WEB_0["vmId"]
    assert run.store.claimed(f"vm-id-name:{WEB_1['vmId']}") is None


def test_a_sequence_of_2_62_under_another_vms_name_silences_no_one(tmp_path: Path) -> None:
    """web_1 lists web_0's Reboot at sequence 2^62 under web_0's name, then drops it: refused; the Reboot stays
    Scheduled, and web_0's own later listing and hook report are heard."""
    run = fleet(tmp_path)
    reboot = scheduled_event("EV-REBOOT", event_type="Reboot", resources=["web_0"])
    run.send(WEB_0, [reboot])
    run.send(AS_WEB_0, [reboot])
    run.send(AS_WEB_0, [])
    assert len(run.dead()) == 2
    run.send(WEB_0, [reboot])
    run.send(WEB_0, kind="hook", hook={"eventId": "EV-REBOOT", "phase": "prepare", "outcome": "failed",
                                        "durationSeconds": 1.0, "steps": []})  # fmt: skip
    record = run.event("EV-REBOOT")
    assert record.state == "Scheduled"
    assert record.vms["web_0"].vmId == WEB_0["vmId"]
    assert record.vms["web_0"].status == "Scheduled"
    assert record.vms["web_0"].hooks == {"prepare": "failed"}


def test_a_forged_hook_report_under_another_vms_name_decides_nothing(tmp_path: Path) -> None:
    """web_0's delete waits for its prepare hooks; web_1's "prepare succeeded" under web_0's name is refused: no
    decision to approve (before: decided approve on it, and with remote acknowledge, acknowledged)."""
    run = fleet(tmp_path)
    delete = scheduled_event("EV-DELETE", event_type="Terminate", resources=["web_0"])
    run.send(WEB_0, [delete])
    step = {"hook": "10-drain", "outcome": "succeeded", "durationSeconds": 1.0, "exitCode": 0}
    hook = {"eventId": "EV-DELETE", "phase": "prepare", "outcome": "succeeded", "durationSeconds": 1.0, "steps": [step]}
    run.send(AS_WEB_0, kind="hook", hook=hook)
    assert len(run.dead()) == 1
    assert not [row for row in run.rows("Decision") if row.EventId == "EV-DELETE" and row.Outcome == "approve"]
    assert run.listeners.sent == []
    assert run.event("EV-DELETE").vms["web_0"].hooks == {}


def test_a_forged_impact_report_under_another_vms_name_writes_no_impact(tmp_path: Path) -> None:
    run = fleet(tmp_path)
    run.send(WEB_0, [freeze("EV-FREEZE")])
    impact = {
        "eventId": "EV-FREEZE",
        "eventType": "Freeze",
        "measure": "pause",
        "measuredSeconds": 3600,
        "start": DOC_NOW.isoformat(),
        "end": (DOC_NOW + timedelta(hours=1)).isoformat(),
    }
    run.send(AS_WEB_0, kind="impact", impact=impact)
    assert len(run.dead()) == 1
    assert run.rows("Impact") == []
    assert run.event("EV-FREEZE").vms["web_0"].impactSeconds is None


def test_arms_census_refuses_a_vmid_that_is_not_its_resource_ids(tmp_path: Path) -> None:
    """web_0's resource id and name with web_1's vmId (and web_1's own document): ARM lists web_0 as another VM."""
    run = fleet(tmp_path)
    run.send({**WEB_0, "vmId": WEB_1["vmId"]})
    (reason,) = run.dead()
    assert f"ARM lists {str(WEB_0['resourceId']).lower()} as VM {WEB_0['vmId']}" in reason, reason


def test_arms_census_outranks_a_name_claimed_before_its_vm_spoke(tmp_path: Path) -> None:
    """A squatter bound web_0's resource id and name to its own vmId while no census was read (first binding wins);
    with ARM's census the real web_0 is heard, and the squatter is refused."""
    store = MemoryStateStore()
    squatter = {**WEB_0, "vmId": "0000beef-0000-4000-8000-00000000beef"}
    fleet(tmp_path, arm=False, store=store).send(squatter)
    assert store.claimed(f"vm-resource:{str(WEB_0['resourceId']).lower()}") == squatter["vmId"]
    run = fleet(tmp_path, store=store)
    run.send(WEB_0, [freeze("EV-FREEZE")])
    run.send(squatter, [freeze("EV-FREEZE")])
    (reason,) = run.dead()
    assert "another VM speaks under its name" in reason
    assert run.listeners.sent == [("EV-FREEZE", "web_0", f"vm-{WEB_0['vmId']}")]


def test_without_a_census_a_squatter_that_speaks_first_holds_a_name_and_approves_nothing(tmp_path: Path) -> None:
    """What remains without ARM's census (docs/security.md, *What remains*): a VM whose own forwarder never spoke
    claims web_0's name and resource id first, with its own vmId and document. Every envelope of the real web_0 is
    then refused (5 of 5 here, each naming the claim rows to delete), its 5 s Freeze is not approved (it waits for
    its NotBefore, as without this project), and nothing is approved on the squatter's claim: the approval goes to the
    squatter's hybrid connection, whose listener checks its own IMDS. Deleting the claim rows ends it."""
    run = fleet(tmp_path, arm=False)
    squatter = {**WEB_0, "vmId": "0000beef-0000-4000-8000-00000000beef"}
    run.send(squatter)
    for _ in range(5):
        run.send(WEB_0, [freeze("EV-FREEZE")])
    reasons = run.dead()
    assert len(reasons) == 5, reasons
    assert all("delete the state table's 'claim' rows" in r for r in reasons), reasons
    assert run.listeners.sent == []
    # The operator deletes the squatter's claim rows (entities.claim_partition); a new instance reads them afresh.
    for name in (
        f"vm-resource:{str(WEB_0['resourceId']).lower()}",
        "vm-name:web_0",
        f"vm-id:{squatter['vmId']}",
        f"vm-id-name:{squatter['vmId']}",
    ):
        run.store._entities.pop((claim_partition(name), safe_key(name)), None)
    again = fleet(tmp_path, arm=False, store=run.store)
    again.send(WEB_0, [freeze("EV-FREEZE")])
    assert again.listeners.sent == [("EV-FREEZE", "web_0", f"vm-{WEB_0['vmId']}")]


# ---- sightings belong to vmIds (pure) ---------------------------------------------------------------------------


def _observation(identity: dict[str, Any], kind: str, sequence: int, **fields: Any) -> Observation:
    return Observation(
        kind=kind,  # type: ignore[arg-type]
        event_id="EV-REBOOT",
        vm=VmIdentity.model_validate(identity),
        sequence=sequence,
        observed_at=DOC_NOW,
        **fields,
    )


def _listed(identity: dict[str, Any], sequence: int, *, status: str = "Scheduled") -> Observation:
    event = ScheduledEvent.model_validate(
        scheduled_event("EV-REBOOT", event_type="Reboot", resources=["web_0"], status=status)
    )
    return _observation(identity, "listed", sequence, event=event)


def test_another_vmids_observation_never_moves_a_sighting() -> None:
    """A sighting under web_0 held at sequence 2^62 by another vmId (a binding that no longer holds: ARM's census
    gave the name its real VM) is not compared with web_0's positions: web_0's listing at sequence 3 is heard, and
    the other vmId's "gone" and hook report move nothing of it."""
    spoofed = apply_observations(None, [_listed(AS_WEB_0, FORGED)], DOC_NOW)
    assert spoofed is not None
    record = spoofed.record
    assert record.vms["web_0"].vmId == WEB_1["vmId"]
    change = apply_observations(record, [_listed(WEB_0, 3)], DOC_NOW)
    assert change is not None
    assert (change.record.vms["web_0"].vmId, change.record.vms["web_0"].lastSequence) == (WEB_0["vmId"], 3)
    hook = {"eventId": "EV-REBOOT", "phase": "prepare", "outcome": "succeeded", "durationSeconds": 1.0, "steps": []}
    after = apply_observations(
        change.record,
        [
            _observation(AS_WEB_0, "hook", FORGED + 2, hook=HookReport.model_validate(hook)),
            _observation(AS_WEB_0, "gone", FORGED + 3),
        ],
        DOC_NOW,
    )
    assert after is not None
    sighting = after.record.vms["web_0"]
    assert (sighting.status, sighting.hooks, sighting.lastSequence) == ("Scheduled", {}, 3)
    assert after.record.state == "Scheduled"


def test_only_a_vm_the_event_names_dates_its_start() -> None:
    """web_1 (a peer that sees web_0's Reboot) lists it Started: it may lie, so it does not date the start."""
    created = apply_observations(None, [_listed(WEB_0, 1)], DOC_NOW)
    assert created is not None
    peer = apply_observations(created.record, [_listed(WEB_1, 1, status="Started")], DOC_NOW + timedelta(seconds=5))
    assert peer is not None
    assert peer.record.startedSeenAt is None
    later = DOC_NOW + timedelta(seconds=9)
    own = replace(_listed(WEB_0, 2, status="Started"), observed_at=later)
    named = apply_observations(peer.record, [own], later)
    assert named is not None
    assert named.record.startedSeenAt == later


def test_a_record_is_assembled_with_the_sighting_of_the_vm_heard_last_under_a_name() -> None:
    """Two VM positions under web_0's name (one written while another vmId spoke as web_0, at sequence 2^62): the
    VM heard last holds the name; positions of two VMs are not compared."""
    sighting = {"firstSeen": DOC_NOW, "lastSeen": DOC_NOW, "status": "Scheduled"}
    old = VmRecord(
        identity=VmIdentity.model_validate(AS_WEB_0),
        lastSeen=DOC_NOW,
        sightings={"EV-REBOOT": VmSighting(lastSequence=FORGED, **{**sighting, "status": "Gone"})},
    )
    real = VmRecord(
        identity=VmIdentity.model_validate(WEB_0),
        lastSeen=DOC_NOW + timedelta(seconds=30),
        sightings={"EV-REBOOT": VmSighting(lastSequence=4, **sighting)},
    )
    group = VmGroupRecord(group="g", vms={WEB_1["vmId"]: old, WEB_0["vmId"]: real})
    event = EventRecord(
        eventId="EV-REBOOT",
        eventType="Reboot",
        resources=["web_0"],
        state="Scheduled",
        stateSince=DOC_NOW,
        createdAt=DOC_NOW,
        groups=["g"],
    )
    assembled = assemble({"EV-REBOOT": Stored(event, "e")}, {"g": Stored(group, "g")})["EV-REBOOT"].record
    assert (assembled.vms["web_0"].vmId, assembled.vms["web_0"].status) == (WEB_0["vmId"], "Scheduled")


# ---- a lying listener on another VM's hybrid connection ---------------------------------------------------------


def test_a_lying_listener_beside_the_vms_own_does_not_hold_its_approval() -> None:
    """web_1, with root, listens on web_0's hybrid connection and answers "approved" with its own proof (the best its
    IMDS signs). Relay picks one of the two listeners at random: the liar took the first 6 requests here (1 time in
    64). The approval is sent again until web_0's own answer comes (before: 4 attempts, then a failed delivery whose
    retry, 10 s later, came after a short notice's NotBefore)."""
    request = ApprovalRequest(
        eventId="E", decisionId="d-1", rule="r", issuedAt=DOC_NOW, expiresAt=DOC_NOW + timedelta(minutes=15)
    )
    attestations = Attestations(verifier())
    web_0 = VmIdentity.model_validate(WEB_0)

    def answer(identity: dict[str, Any]) -> ApprovalResult:
        proof = DOCUMENTS.document(identity, nonce=decision_nonce("d-1"), now=DOC_NOW)
        return ApprovalResult(
            outcome="approved", eventId="E", decisionId="d-1", attestation=Attestation.model_validate(proof)
        )

    def proof(result: ApprovalResult) -> str:
        return answer_problem(attestations, result, vm_id=web_0.vmId, decision_id="d-1", at=DOC_NOW, required=True)

    relay = AnswersInTurn([answer(WEB_1) for _ in range(6)] + [answer(WEB_0)])
    result = send(relay, request, web_0, "", proof, within=30)
    assert (relay.sent, proof(result)) == (7, "")


def test_with_arms_census_a_vms_bindings_are_written_by_the_timer_not_its_batch(tmp_path: Path) -> None:
    """ARM vouched for web_0: its batch writes no claim; the next tick writes its four (for an instance whose census
    cannot be read: the bindings decide then)."""
    run = fleet(tmp_path)
    run.send(WEB_0)
    assert run.store.claimed(name_claim("web_0")) is None

    report = run.coordinator.tick()

    assert report.bindings_written == 4
    assert run.store.claimed(name_claim("web_0")) == str(WEB_0["vmId"]).lower()
    assert run.store.claimed(vm_name_claim(str(WEB_0["vmId"]))) == "web_0"
