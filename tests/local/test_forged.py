"""One fleet VM lies (issues 11 and 21): over the whole local stack, with attested forwarders, a process on web_1
holds the fleet's shared Event Hubs identity and root on web_1 (so its own IMDS: it attests a state of its own as
web_1, the most it can get signed). It sends schema-valid forgeries: web_0's Reboot relabelled as a 5 s Freeze under
web_0's name (with web_1's vmId and document; with web_0's vmId and web_1's document; with no document), a forged
"prepare hooks succeeded" for web_0's delete whose real hook failed, a forged "gone" of web_0's Reboot under web_0's
name, web_0's Redeploy claimed user-initiated under its own attested name, its own "gone" of web_0's Reboot (a peer
that sees it), and an envelope without a partition key. The judge's expectations come from the truthful scenario
and policy: the run passes only with zero approvals the truthful inputs would not have produced, every truthful one
made without delay (web_0's user Reboot after the attack, approved within a second of being seen), every envelope
web_0's forwarder sent applied, and each forgery in another VM's name set aside at the door with its reason."""

from __future__ import annotations

import sqlite3
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import requests
from azure.eventhub import EventData, EventHubProducerClient

from contracts.attestation import ATTESTED_API_VERSION, Attestation, state_nonce
from contracts.document import ScheduledEventsDocument
from contracts.envelope import Envelope, HookReport, HookStep, VmIdentity
from coordinator.domain.policy_file import DEFAULT_POLICY_PATH
from emulators.imds import Scenario
from forwarder.imds import identity_of
from local.runner import wait_until
from local.stack import HUB, LocalStack
from tests.local.conftest import Runner

TABLE = "ScheduledEventsHistory_CL"


def _scenario() -> Scenario:
    return Scenario.from_mapping(
        {
            "name": "e2e-forged",
            "scaleSets": {"web": {"terminateNotification": True, "terminateNotBeforeSeconds": 900}},
            "vms": [
                {
                    "name": "web_0",
                    "vmScaleSetName": "web",
                    "placementGroupId": "pg-1",
                    "hooks": {"prepare": [{"name": "10-drain", "exitCode": 1}]},
                },
                # The attacker: same placement group, so it sees web_0's events in its own IMDS document.
                {"name": "web_1", "vmScaleSetName": "web", "placementGroupId": "pg-1"},
            ],
            "steps": [
                {
                    "at": 0,
                    "create": {"ref": "reboot", "EventType": "Reboot", "Resources": ["web_0"], "NoticeSeconds": 1800},
                },
                {
                    "at": 0,
                    "create": {
                        "ref": "redeploy",
                        "EventType": "Redeploy",
                        "Resources": ["web_0"],
                        "NoticeSeconds": 1800,
                    },
                },
                # After the hijack: web_0's own forwarder must still be heard for this to be approved.
                {
                    "at": 600,
                    "create": {
                        "ref": "user-reboot",
                        "EventType": "Reboot",
                        "EventSource": "User",
                        "Resources": ["web_0"],
                        "NoticeSeconds": 900,
                    },
                },
                {"at": 1200, "create": {"ref": "scale-in", "EventType": "Terminate", "Resources": ["web_0"]}},
            ],
        }
    )


def _policy(tmp_path: Path) -> Path:
    """The default policy, but a delete whose prepare hook failed is never approved before NotBefore (the truthful
    run makes no approval of it, so an early one could only come from the forged hook report)."""
    text = DEFAULT_POLICY_PATH.read_text(encoding="utf-8")
    old = "hooks: {deadlineSeconds: 240, onDeadline: approve, noHooks: wait}"
    assert old in text
    path = tmp_path / "policy.yaml"
    path.write_text(text.replace(old, "hooks: {deadlineSeconds: 3600, onDeadline: wait, noHooks: wait}"), "utf-8")
    return path


def _rows(stack: LocalStack, where: str, *args: Any) -> list[tuple[Any, ...]]:
    with sqlite3.connect(f"file:{stack.history_path}?mode=ro", uri=True) as db:
        return db.execute(f'SELECT * FROM "{TABLE}" WHERE {where}', args).fetchall()


def _event_id(stack: LocalStack, ref: str) -> str:
    assert stack.imds is not None
    imds = stack.imds
    assert wait_until(lambda: any(e.get("ref") == ref for e in imds.events()), timeout=30)
    event_id = next(str(e["EventId"]) for e in imds.events() if e.get("ref") == ref)
    # The coordinator has heard the truth first: its record's facts come from web_0's own forwarder.
    assert wait_until(lambda: bool(_rows(stack, "EventId = ? AND RecordType = 'Observation'", event_id)), timeout=30)
    return event_id


class Attacker:
    """A process on web_1 with the fleet's sender identity (here: the emulator's connection string)."""

    def __init__(self, stack: LocalStack) -> None:
        assert stack.imds is not None
        assert stack.eventhubs is not None
        self.stack = stack
        self.imds = stack.imds
        self.vms = {spec.name: VmIdentity.of(identity_of(spec.compute())) for spec in stack.imds.vms()}
        self.producer = EventHubProducerClient.from_connection_string(stack.eventhubs.connection_string(HUB))
        # A state of its own (it cannot read web_0's), with a sequence no forwarder reaches, attested by its own
        # IMDS: a document naming web_1's vmId (no IMDS signs another VM's).
        self.state = uuid.uuid4().hex
        self.sequence = 2**62
        self.sent = 0
        answer = requests.get(
            f"{self.imds.url_for('web_1')}/metadata/attested/document",
            params={"api-version": ATTESTED_API_VERSION, "nonce": state_nonce(self.state)},
            headers={"Metadata": "true"},
            timeout=10,
        )
        self.attestation = Attestation.model_validate(answer.json())

    def relabelled(self, event_ids: set[str], **changes: Any) -> ScheduledEventsDocument:
        """web_1's real document (it sees web_0's events), with those events' facts changed."""
        document = self.imds.document("web_1")
        events = [{**e, **changes} for e in document["Events"] if e["EventId"] in event_ids]
        return ScheduledEventsDocument.model_validate(
            {"DocumentIncarnation": document["DocumentIncarnation"], "Events": events}
        )

    def send(self, envelope: Envelope, *, keyed: bool = True) -> None:
        batch = (
            self.producer.create_batch(partition_key=envelope.vm.partition_key)
            if keyed
            else self.producer.create_batch()
        )
        batch.add(EventData(envelope.to_json_bytes()))
        self.producer.send_batch(batch)
        self.sent += 1

    def envelope(self, vm: str, *, vm_id: str | None = None, attested: bool = True, **fields: Any) -> Envelope:
        """An envelope in ``vm``'s name (with ``vm_id`` when given), carrying its own attested document."""
        self.sequence += 1
        identity = self.vms[vm] if vm_id is None else self.vms[vm].model_copy(update={"vmId": vm_id})
        return Envelope(
            vm=identity,
            attestation=self.attestation if attested else None,
            observedAt=datetime.now(UTC),
            sequence=self.sequence,
            forwarder="scheduled-events-forwarder/0.1.0",
            stateId=self.state,
            **fields,
        )


@pytest.mark.slow
def test_one_vms_forgeries_in_another_vms_name_approve_nothing_and_delay_no_one(
    run_pipeline: Runner, tmp_path: Path
) -> None:
    ids: dict[str, str] = {}

    def attack(stack: LocalStack) -> None:
        attacker = Attacker(stack)
        web_0, web_1 = attacker.vms["web_0"], attacker.vms["web_1"]
        with attacker.producer:
            ids["reboot"] = _event_id(stack, "reboot")
            ids["redeploy"] = _event_id(stack, "redeploy")
            flipped = attacker.relabelled({ids["reboot"]}, EventType="Freeze", DurationInSeconds=5)
            # web_0's name, web_0's resource id as partition key, a sequence no forwarder reaches: with its own
            # vmId and document, with web_0's vmId and its own document, and with no document at all.
            attacker.send(attacker.envelope("web_0", vm_id=web_1.vmId, kind="incarnation", document=flipped))
            attacker.send(attacker.envelope("web_0", kind="incarnation", document=flipped))
            attacker.send(attacker.envelope("web_0", attested=False, kind="incarnation", document=flipped))
            # A "gone" of web_0's Reboot in web_0's name.
            empty = ScheduledEventsDocument(DocumentIncarnation=99, Events=[])
            attacker.send(attacker.envelope("web_0", vm_id=web_1.vmId, kind="incarnation", document=empty))
            # Under its own attested name: the Redeploy claimed user-initiated (approve-now if believed), then the
            # Reboot "gone" as a peer that sees it.
            user = attacker.relabelled({ids["redeploy"]}, EventSource="User")
            attacker.send(attacker.envelope("web_1", kind="incarnation", document=user))
            attacker.send(attacker.envelope("web_1", kind="incarnation", document=empty))
            # Without a partition key: set aside whatever it says.
            attacker.send(attacker.envelope("web_0", kind="incarnation", document=user), keyed=False)
            # A forged phase report for web_0's delete, once its real prepare hook has failed.
            ids["scale-in"] = _event_id(stack, "scale-in")
            assert wait_until(
                lambda: bool(
                    _rows(stack, "EventId = ? AND RecordType = 'Hook' AND Outcome = 'failed'", ids["scale-in"])
                ),
                timeout=30,
            )
            step = HookStep(hook="10-drain", outcome="succeeded", durationSeconds=1.0, exitCode=0)
            hook = HookReport(
                eventId=ids["scale-in"], phase="prepare", outcome="succeeded", durationSeconds=1.0, steps=[step]
            )
            attacker.send(attacker.envelope("web_0", vm_id=web_1.vmId, kind="hook", hook=hook))
            assert web_0.vmId != web_1.vmId
        assert attacker.sent == 8

    # Set aside at the door: the five in web_0's name and the keyless one (the two in its own name are heard).
    outcome = run_pipeline(
        _scenario(), during=attack, expected_dead_letters=6, timeout=150.0, policy_path=_policy(tmp_path)
    )
    summary, stack = outcome.summary, outcome.stack
    assert outcome.finished, f"the run did not finish: waiting for {outcome.follower.waits}"
    # The judge's expectations come from the truthful scenario: no approval the truth would not make, every one it
    # makes, every envelope web_0 sent applied, and the forgeries set aside.
    assert summary.ok, summary.failures
    assert summary.approvals_expected == summary.approvals_expected_made == 1
    assert stack.imds is not None
    approved = {str(a["EventId"]) for a in stack.imds.approvals()}
    assert ids["reboot"] not in approved
    assert ids["redeploy"] not in approved
    assert ids["scale-in"] not in approved
    # No delay: web_0's user Reboot, created after the attack, is approved as soon as it is seen.
    (user_reboot,) = [e for e in outcome.facts.imds_events if e.get("ref") == "user-reboot"]
    assert outcome.facts.event_details[str(user_reboot["EventId"])]["approvedAfterSeenMs"] < 2000
    # Each forgery in web_0's name, and the keyless one, set aside with its reason.
    reasons = " | ".join(str(row) for row in _rows(stack, "RecordType = 'DeadLetter'"))
    assert reasons.count("speaks under") == 3, reasons  # the Freeze, the "gone" and the hook in web_0's name
    assert "not of VM" in reasons
    assert "unattested" in reasons
    assert "no partition key" in reasons
    # web_0's Reboot was never concluded by the forged or the peer's "gone": it ran its course as web_0 saw it.
    reboot = [row for row in _rows(stack, "EventId = ? AND RecordType = 'Transition'", ids["reboot"])]
    assert not [row for row in reboot if "Canceled" in str(row)], reboot
    # What it may still do under its own attested name: its lie about a peer's event is kept as a conflict, never
    # merged, and its "gone" as a peer concludes nothing.
    conflicts = _rows(stack, "RecordType = 'Observation' AND Outcome = 'conflict'")
    assert ids["redeploy"] in {row[2] for row in conflicts}, "the relabelled sighting is a conflict"
    assert not _rows(stack, "RecordType = 'Heartbeat' AND Outcome = 'conflict' AND VmName = 'web_0'"), (
        "no second writer"
    )
    assert not _rows(stack, "RecordType = 'Approval' AND Outcome = 'rejected' AND EventId = ?", ids["scale-in"])
    kinds = {(card["kind"], card["eventId"] or card["vm"]) for card in summary.cards}
    assert ("facts-conflict", ids["redeploy"]) in kinds
    assert ("forwarder-conflict", "web_0") not in kinds
    print(f"figures: forged 8, dead letters {summary.dead_letters}, conflicts {len(conflicts)}")
