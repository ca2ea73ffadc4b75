"""Issue 10 over the real stack (Azurite, the IMDS emulator through DirectImdsCallback): every hook counts, deletes
are approved as Azure couples them, VMs that a Terminate/Preempt removed are retired, a forwarder that lost its
state is heard at once."""

from __future__ import annotations

import json
import uuid
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from contracts.approval import ApprovalRequest, ApprovalResult
from contracts.envelope import VmIdentity
from coordinator.adapters.teams import FolderCardSink
from coordinator.domain.observations import state_tag
from coordinator.domain.policy import Policy
from coordinator.domain.policy_file import DEFAULT_POLICY_PATH, load_policy, parse_policy
from coordinator.pipeline.ingest import RawMessage
from coordinator.state.tables import TableStateStore
from emulators.azurite import AzuriteEndpoints
from emulators.imds import ImdsEmulator
from forwarder.approver import Approver
from forwarder.imds import ImdsClient
from forwarder.relay_protocol import RelayRequest
from local.direct_callback import DirectImdsCallback
from tests.coordinator.helpers import DOC_NOW, MemoryHistory, envelope, vm
from tests.coordinator.helpers import WEB_FLEET as NAMES
from tests.coordinator.runs import make_coordinator

IDENTITY = {name: vm(name, scale_set="web", group="pg-web", index=100 + i) for i, name in enumerate(NAMES)}


class Clock:
    def __init__(self) -> None:
        self.now = DOC_NOW

    def __call__(self) -> Any:
        return self.now


class Harness:
    def __init__(
        self, azurite: AzuriteEndpoints, imds: ImdsEmulator, tmp: Path, policy: Policy | None = None, **options: Any
    ) -> None:
        self.imds = imds
        self.clock = Clock()
        self.history = MemoryHistory()
        self.cards = tmp / "cards"
        self.cleanups: list[dict[str, Any]] = []
        self.sequence: dict[str, int] = dict.fromkeys(NAMES, 0)
        # Each VM's own hook ledger (what its listener checks before approving on the strength of its hooks): the
        # outcome its reports told, a failure sticking as in the forwarder's ledger.
        self.ledger: dict[tuple[str, str], str] = {}
        self.coordinator = make_coordinator(
            store=TableStateStore.from_connection_string(
                azurite.connection_string, table_name="d" + uuid.uuid4().hex[:12]
            ),
            history=self.history,
            alerts=FolderCardSink(self.cards),
            callback=DirectImdsCallback(base_url=imds.url, hook_ledger=lambda vm, ev: self.ledger.get((vm, ev))),
            policy=policy or load_policy(DEFAULT_POLICY_PATH),
            clock=self.clock,
            housekeeping=lambda last_seen, now: self.cleanups.append(dict(last_seen)),
            **options,
        )

    def _next(self, name: str) -> int:
        self.sequence[name] += 1
        return self.sequence[name]

    def document(self, name: str, event_ids: set[str] | None = None) -> RawMessage:
        """The VM's current document as the emulator serves it (optionally only some of its events)."""
        document = self.imds.document(name)
        events = [e for e in document["Events"] if event_ids is None or e["EventId"] in event_ids]
        data = envelope(
            IDENTITY[name],
            sequence=self._next(name),
            incarnation=document["DocumentIncarnation"],
            events=events,
            observed_at=self.clock.now,
        )
        return raw(data)

    def phase(self, name: str, event_id: str, steps: list[tuple[str, str]]) -> RawMessage:
        """A phase report listing every hook (the forwarder's new shape)."""
        hook_steps = [
            {"hook": h, "outcome": o, "durationSeconds": 1.0, "exitCode": 0 if o == "succeeded" else 1}
            for h, o in steps
        ]
        failed = next((o for _, o in steps if o != "succeeded"), "succeeded") if steps else "not-run"
        hook = {"eventId": event_id, "phase": "prepare", "outcome": failed, "durationSeconds": 2.0, "steps": hook_steps}
        self.ledger[(name, event_id)] = failed
        return raw(self._hook_envelope(name, hook))

    def legacy_hook(self, name: str, event_id: str, hook_name: str, outcome: str) -> RawMessage:
        """A per-hook report from an older forwarder (no steps)."""
        hook = {"eventId": event_id, "phase": "prepare", "outcome": outcome, "durationSeconds": 1.0, "hook": hook_name}
        if self.ledger.get((name, event_id)) != "failed":
            self.ledger[(name, event_id)] = outcome
        return raw(self._hook_envelope(name, hook))

    def _hook_envelope(self, name: str, hook: dict[str, Any]) -> dict[str, Any]:
        return envelope(IDENTITY[name], sequence=self._next(name), kind="hook", hook=hook, observed_at=self.clock.now)

    def record(self, event_id: str) -> Any:
        stored = self.coordinator.event(event_id)
        assert stored is not None
        return stored.record

    def approvals(self, event_id: str) -> list[dict[str, Any]]:
        return [a for a in self.imds.approvals() if a["EventId"] == event_id]

    def rows(self, record_type: str, event_id: str | None = None) -> list[Any]:
        return [r for r in self.history.rows if r.RecordType == record_type and event_id in (None, r.EventId)]

    def card(self, event_id: str, kind: str) -> str:
        return (self.cards / f"{event_id}-{kind}.json").read_text(encoding="utf-8")


def raw(data: dict[str, Any]) -> RawMessage:
    return RawMessage(body=json.dumps(data).encode(), partition_key=data["vm"]["resourceId"].lower())


def terminate(imds: ImdsEmulator, name: str, notice: float = 600) -> str:
    return str(imds.create_event(EventType="Terminate", Resources=[name], NoticeSeconds=notice)["EventId"])


def test_every_hook_counts_and_the_failing_one_is_named(azurite, fleet_imds, tmp_path):
    h = Harness(azurite, fleet_imds, tmp_path)
    event_id = terminate(fleet_imds, "web_0")
    h.coordinator.process_batch([h.document("web_0", {event_id})])
    # 10-check fails, 20-drain succeeds after it: the phase failed.
    h.coordinator.process_batch([h.phase("web_0", event_id, [("10-check", "failed"), ("20-drain", "succeeded")])])
    record = h.record(event_id)
    assert record.vms["web_0"].hooks["prepare"] == "failed"
    assert record.vms["web_0"].failedHooks["prepare"] == "10-check"
    assert record.decision.verdict == "wait"
    assert "web_0=failed (10-check)" in record.decision.reason
    hook_row = h.rows("Hook", event_id)[-1]
    assert hook_row.Actor == "10-check"
    assert "10-check failed (exit 1, 1.0 s); 20-drain succeeded (exit 0, 1.0 s)" in hook_row.Reason
    assert [s["hook"] for s in hook_row.Details["steps"]] == ["10-check", "20-drain"]
    # An older forwarder's per-hook success cannot turn the failure back into success.
    h.coordinator.process_batch([h.legacy_hook("web_0", event_id, "20-drain", "succeeded")])
    assert h.record(event_id).vms["web_0"].hooks["prepare"] == "failed"
    assert "stays failed" in h.rows("Hook", event_id)[-1].Reason
    assert h.approvals(event_id) == []
    assert h.coordinator.summarize(h.record(event_id))["failedHooks"] == {"web_0": {"prepare": "10-check"}}
    # The deadline passes (onDeadline: approve): the approved card names the hook that failed.
    h.clock.now = DOC_NOW + timedelta(seconds=241)
    h.coordinator.tick()
    assert h.record(event_id).state == "Approved"
    assert "web_0: prepare hook '10-check' failed" in h.card(event_id, "approved")


def test_a_new_phase_report_sets_the_outcome_and_no_hooks_waits_by_default(azurite, fleet_imds, tmp_path):
    h = Harness(azurite, fleet_imds, tmp_path)
    event_id = terminate(fleet_imds, "web_3")
    h.coordinator.process_batch([h.document("web_3", {event_id}), h.phase("web_3", event_id, [])])
    record = h.record(event_id)
    assert record.vms["web_3"].hooks["prepare"] == "not-run"
    assert record.decision.verdict == "wait"
    assert "no hooks installed; noHooks=wait" in record.decision.reason
    h.coordinator.process_batch([h.phase("web_3", event_id, [("10-drain", "succeeded")])])
    record = h.record(event_id)
    assert record.state == "Approved"
    assert record.approval.executor == "web_3"


def test_no_hooks_ready_is_the_policys_choice(azurite, fleet_imds, tmp_path):
    policy = parse_policy(
        "rules:\n  - name: deletes\n    match: {eventType: [Terminate]}\n    action: approve-after-hooks\n"
        "    hooks: {deadlineSeconds: 240, onDeadline: approve, noHooks: ready}\n"
    )
    h = Harness(azurite, fleet_imds, tmp_path, policy=policy)
    event_id = terminate(fleet_imds, "web_3")
    h.coordinator.process_batch([h.document("web_3", {event_id}), h.phase("web_3", event_id, [])])
    assert h.record(event_id).state == "Approved"


def test_pending_deletes_of_a_scale_set_are_approved_together(azurite, fleet_imds, tmp_path):
    h = Harness(azurite, fleet_imds, tmp_path)
    first, second = terminate(fleet_imds, "web_1"), terminate(fleet_imds, "web_2")
    both = {first, second}
    h.coordinator.process_batch([h.document("web_1", both), h.document("web_2", both)])
    # web_1 is drained; web_2 is not: web_1's own rule approves, but it is held by web_2's delete.
    h.coordinator.process_batch([h.phase("web_1", first, [("10-drain", "succeeded")])])
    held = h.record(first)
    assert held.state == "Scheduled"
    assert held.approval is None
    assert held.decision.verdict == "wait"
    assert held.decision.heldBy == second
    second_record = h.record(second)
    assert f"delete of web_2 ({second})" in held.decision.reason
    assert f"pending until {second_record.notBefore.isoformat()}" in held.decision.reason
    decision_row = h.rows("Decision", first)[-1]
    assert decision_row.Details["heldBy"] == second
    summary = h.coordinator.summarize(held)
    assert summary["heldBy"]["by"] == "coordinator"
    assert summary["heldBy"]["eventId"] == second
    assert h.approvals(first) == []
    # web_2 drained: both approved in that same batch, each through the VM it deletes.
    report = h.coordinator.process_batch([h.phase("web_2", second, [("10-drain", "succeeded")])])
    assert report.approvals_sent == 2
    for event_id, name in ((first, "web_1"), (second, "web_2")):
        record = h.record(event_id)
        assert record.state == "Approved"
        assert record.approval.executor == name
        assert [a["vm"] for a in h.approvals(event_id)] == [name]  # StartRequests posted by that VM, no peer
        assert h.coordinator.summarize(record)["heldBy"] is None


def test_simultaneous_deletes_ready_in_one_batch_are_not_held(azurite, fleet_imds, tmp_path):
    h = Harness(azurite, fleet_imds, tmp_path)
    first, second = terminate(fleet_imds, "web_1"), terminate(fleet_imds, "web_2")
    both = {first, second}
    h.coordinator.process_batch(
        [
            h.document("web_1", both),
            h.document("web_2", both),
            h.phase("web_1", first, [("10-drain", "succeeded")]),
            h.phase("web_2", second, [("10-drain", "succeeded")]),
        ]
    )
    assert {h.record(first).state, h.record(second).state} == {"Approved"}
    assert not [r for r in h.rows("Decision") if r.Outcome == "wait"]


def test_an_approved_delete_held_by_the_platform_says_so(azurite, fleet_imds, tmp_path):
    h = Harness(azurite, fleet_imds, tmp_path)
    first, second = terminate(fleet_imds, "web_1"), terminate(fleet_imds, "web_2")
    both = {first, second}
    h.coordinator.process_batch([h.document("web_1", both), h.document("web_2", both)])
    # A person approves web_1's delete while web_2's is still pending.
    assert h.coordinator.approve_manually(first, person="ops@example.com").status == "approved"
    record = h.record(first)
    second_not_before = h.record(second).notBefore.isoformat()
    expected = f"held by the platform: delete of web_2 ({second}) pending until {second_not_before}"
    assert record.platformHold is not None
    assert record.platformHold.describe() == expected
    held_rows = [r for r in h.rows("Approval", first) if r.Outcome == "held"]
    assert [(r.Actor, r.Reason) for r in held_rows] == [("platform", expected)]
    assert expected in h.card(first, "approved")
    assert h.coordinator.summarize(record)["heldBy"]["by"] == "platform"
    # web_2's delete is approved too: the timer lifts the hold.
    h.coordinator.approve_manually(second, person="ops@example.com")
    h.clock.now += timedelta(seconds=30)
    h.coordinator.tick()
    assert h.record(first).platformHold is None
    assert [r.Outcome for r in h.rows("Approval", first) if r.Actor == "platform"] == ["held", "released"]


def test_a_terminate_is_approved_only_through_the_vm_it_deletes(azurite, fleet_imds, tmp_path):
    h = Harness(azurite, fleet_imds, tmp_path)
    event_id = terminate(fleet_imds, "web_3")
    # Only a peer of the placement group reports it; web_3's forwarder is silent.
    h.coordinator.process_batch([h.document("web_0", {event_id})])
    result = h.coordinator.approve_manually(event_id, person="ops@example.com")
    assert result.status == "sent"
    record = h.record(event_id)
    assert record.approval.outcome == "failed"
    assert "approved only through the VM it deletes" in record.approval.reason
    assert h.approvals(event_id) == []


def test_a_removed_vm_is_retired_and_its_events_conclude(azurite, fleet_imds, tmp_path):
    policy = parse_policy(
        "rules:\n"
        "  - name: deletes\n    match: {eventType: [Terminate]}\n    action: approve-now\n"
        "  - name: reboots\n    match: {eventType: [Reboot]}\n    action: approve-within-budget\n"
        "    budget: {maxImpacted: 1}\n"
        "  - name: rest\n    action: wait-for-person\n"
    )
    h = Harness(azurite, fleet_imds, tmp_path, policy=policy)
    reboot = str(fleet_imds.create_event(EventType="Reboot", Resources=["web_1"], NoticeSeconds=900)["EventId"])
    redeploy = str(fleet_imds.create_event(EventType="Redeploy", Resources=["web_1"], NoticeSeconds=900)["EventId"])
    h.coordinator.process_batch([h.document("web_1", {reboot, redeploy})])
    assert h.record(reboot).state == "Approved"  # within budget: web_1 holds the scale set's one slot
    other = str(fleet_imds.create_event(EventType="Reboot", Resources=["web_2"], NoticeSeconds=900)["EventId"])
    h.coordinator.process_batch([h.document("web_2", {other})])
    assert h.record(other).decision.verdict == "wait"
    # web_1 is deleted: its Terminate is approved (through web_1) and web_1 falls silent for good.
    delete = terminate(fleet_imds, "web_1")
    h.coordinator.process_batch([h.document("web_1", {reboot, redeploy, delete})])
    assert h.record(delete).state == "Approved"
    h.clock.now = DOC_NOW + timedelta(seconds=200)
    h.coordinator.process_batch([h.document("web_2", {other})])  # web_2 is alive
    report = h.coordinator.tick()
    assert report.vms_retired == 1
    retired = [r for r in h.history.rows if r.RecordType == "Heartbeat" and r.Outcome == "retired"]
    assert [(r.VmName, r.EventId) for r in retired] == [("web_1", delete)]
    assert h.record(delete).state == "Completed"
    assert h.record(delete).removed == ["web_1"]
    assert "VM removed" in [r for r in h.rows("Transition", delete)][-1].Reason
    assert h.record(reboot).state == "Completed"  # approved, then its VM left
    assert h.record(redeploy).state == "Canceled"
    assert "VM removed by " + delete in [r for r in h.rows("Transition", redeploy)][-1].Reason
    # The budget slot is free again: web_2's Reboot is approved by the same tick or the next one.
    h.clock.now += timedelta(seconds=5)
    h.coordinator.tick()
    assert h.record(other).state == "Approved"
    # Much later: no heartbeat-lost for web_1, nothing of it open, and its hybrid connection is not kept.
    h.clock.now = DOC_NOW + timedelta(hours=2)
    h.coordinator.process_batch([h.document("web_2", {other})])
    h.coordinator.tick()
    assert not [c for c in h.cards.glob("*heartbeat-lost*") if IDENTITY["web_1"]["vmId"] in c.name]
    assert not [
        r for r in h.history.rows if r.RecordType == "Heartbeat" and r.VmName == "web_1" and r.Outcome == "lost"
    ]
    assert all(delete != e["eventId"] and reboot != e["eventId"] for e in h.coordinator.pending())
    assert h.cleanups
    assert f"vm-{IDENTITY['web_1']['vmId']}" not in h.cleanups[-1]
    assert f"vm-{IDENTITY['web_2']['vmId']}" in h.cleanups[-1]


def test_a_forwarder_that_lost_its_state_is_heard_at_once(azurite, fleet_imds, tmp_path):
    h = Harness(azurite, fleet_imds, tmp_path)
    event_id = str(fleet_imds.create_event(EventType="Redeploy", Resources=["web_0"], NoticeSeconds=900)["EventId"])
    identity = IDENTITY["web_0"]

    def doc(state: str, sequence: int, listed: bool) -> RawMessage:
        document = fleet_imds.document("web_0")
        events = [e for e in document["Events"] if e["EventId"] == event_id] if listed else []
        data = envelope(identity, sequence=sequence, incarnation=5, events=events, observed_at=h.clock.now)
        data["stateId"] = state
        return raw(data)

    h.coordinator.process_batch([doc("state-a", 40, True), doc("state-a", 41, True)])
    # The forwarder's state is wiped: it counts from 1 again under a new stateId, and no longer lists the event.
    h.clock.now += timedelta(seconds=10)
    report = h.coordinator.process_batch([doc("state-b", 1, False)])
    assert (report.accepted, report.duplicates) == (1, 0)
    reset = [r for r in h.history.rows if r.RecordType == "Heartbeat" and r.Outcome == "reset"]
    assert len(reset) == 1
    assert reset[0].Details == {
        "oldState": state_tag("state-a"),
        "newState": state_tag("state-b"),
        "lastSequence": 41,
        "newSequence": 1,
        "epoch": 1,
    }
    assert "state-a" not in str(reset[0].model_dump()), "the state identifiers stay out of the history"
    assert h.record(event_id).vms["web_0"].status == "Gone"
    assert h.record(event_id).state == "Canceled"
    # A late delivery from the old state is dropped, not applied.
    report = h.coordinator.process_batch([doc("state-a", 41, True)])
    assert (report.accepted, report.duplicates) == (0, 1)
    assert h.record(event_id).vms["web_0"].status == "Gone"
    # The old state speaking again with a new sequence is a second writer, not a replay: heard, a conflict row and
    # card for the VM, and the 'gone' the other state sent no longer stands: the event is open again.
    h.clock.now += timedelta(seconds=10)
    report = h.coordinator.process_batch([doc("state-a", 42, True)])
    assert (report.accepted, report.duplicates) == (1, 0)
    assert [r.Outcome for r in h.history.rows if r.RecordType == "Heartbeat" and r.Outcome == "conflict"] == [
        "conflict"
    ]
    assert [c.name for c in h.cards.glob("*forwarder-conflict*")]
    assert h.record(event_id).vms["web_0"].status == "Scheduled"
    assert h.record(event_id).state == "Scheduled"


class _Listeners:
    """Each VM's own listener (the real ``forwarder.approver.Approver``, in process instead of behind Azure Relay):
    its fresh IMDS document from the emulator and its own hook ledger, which the tests set."""

    def __init__(self, imds: ImdsEmulator, clock: Clock) -> None:
        self.imds = imds
        self.clock = clock  # the harness's clock: the requests' issuedAt is the coordinator's (2022) time
        self.ledgers: dict[str, dict[str, str]] = {name: {} for name in NAMES}

    def send(self, request: ApprovalRequest, *, vm: VmIdentity) -> ApprovalResult:
        client = ImdsClient(base_url=self.imds.url_for(vm.name), timeout=5.0)
        approver = Approver(
            imds=client, vm_name=vm.name, prepare_outcome=self.ledgers[vm.name].get, clock=lambda: self.clock.now
        )
        try:
            body = request.model_dump_json().encode()
            relayed = RelayRequest("r1", "POST", "/approve", "/approve", {"content-type": "application/json"}, body)
            response = approver(relayed)
        finally:
            client.close()
        return ApprovalResult.model_validate_json(response.body)


def test_a_forged_hook_report_cannot_approve_a_delete_the_vm_itself_did_not_drain(azurite, fleet_imds, tmp_path):
    """Every VM holds the fleet's one Event Hubs identity: a process on web_0 can send 'web_2 drained' under web_2's
    name. The coordinator believes it, but web_2's own listener checks its own hook ledger and refuses."""
    h = Harness(azurite, fleet_imds, tmp_path)
    listeners = _Listeners(fleet_imds, h.clock)
    h.coordinator.parts = replace(h.coordinator.parts, callback=listeners)
    event_id = terminate(fleet_imds, "web_2")
    listeners.ledgers["web_2"][event_id] = "failed"  # what really happened on web_2: 10-check failed
    h.coordinator.process_batch([h.document("web_2", {event_id})])
    h.coordinator.process_batch([h.phase("web_2", event_id, [("10-drain", "succeeded")])])  # the forgery
    record = h.record(event_id)
    assert record.approval is not None
    assert record.approval.outcome == "rejected"
    assert record.approval.reason == "the decision rested on web_2's prepare hooks, and its own ledger says failed"
    assert h.approvals(event_id) == []  # nothing reached IMDS
    assert record.state == "Scheduled"
    assert [r.Outcome for r in h.rows("Approval", event_id)] == ["sending", "rejected"]
    assert "approval-refused" in record.alerts
    assert "Approval refused by the VM" in h.card(event_id, "approval-refused")
    # The truthful path still works: once web_2 really drained, its listener approves.
    listeners.ledgers["web_2"][event_id] = "succeeded"
    h.clock.now += timedelta(minutes=3)
    h.coordinator.tick()
    assert [a["vm"] for a in h.approvals(event_id)] == ["web_2"]
    assert h.record(event_id).state == "Approved"
    assert h.record(event_id).alerts.count("approval-refused") == 1  # one card per refused event


def test_a_type_flipped_by_one_vm_is_refused_by_the_vm_that_approves(azurite, fleet_imds, tmp_path):
    """web_0 lists a platform Reboot of web_1 as a 5 s Freeze; the default policy would approve a short Freeze at
    once. The approving VM's own IMDS document shows a Reboot: it refuses, naming the facts."""
    h = Harness(azurite, fleet_imds, tmp_path)
    listeners = _Listeners(fleet_imds, h.clock)
    h.coordinator.parts = replace(h.coordinator.parts, callback=listeners)
    created = fleet_imds.create_event(EventType="Reboot", Resources=["web_1"], NoticeSeconds=900, DurationInSeconds=-1)
    event_id = str(created["EventId"])
    forged = dict(h.imds.document("web_0")["Events"][0], EventType="Freeze", DurationInSeconds=5)
    data = envelope(IDENTITY["web_0"], sequence=h._next("web_0"), incarnation=9, events=[forged], observed_at=DOC_NOW)
    h.coordinator.process_batch([raw(data)])
    record = h.record(event_id)
    assert record.decision is not None
    assert record.decision.rule == "short-freeze"  # the coordinator was fooled
    assert record.approval is not None
    assert record.approval.outcome == "rejected"
    assert "EventType is 'Reboot' here, the decision rested on 'Freeze'" in record.approval.reason
    assert "DurationInSeconds is -1 here, the decision rested on 5" in record.approval.reason
    assert h.approvals(event_id) == []
