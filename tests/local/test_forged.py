"""One fleet VM lies (issue 11): over the whole local stack, a process on web_1 holds the fleet's shared Event Hubs
identity and sends forged but schema-valid envelopes: web_0's events relabelled (a platform Reboot as a 5 s Freeze,
a platform Redeploy as user-initiated), under web_0's identity with a state of its own and a sequence of 2**62, its
own relabelled sightings, a forged "prepare hooks succeeded" for web_0's delete whose real hook failed, and an
envelope without a partition key. The judge's expectations come from the truthful scenario and policy: the run
passes only with zero approvals the truthful inputs would not have produced, every truthful one made (web_0 is
still heard after the hijack), every envelope web_0's forwarder sent applied, and the one keyless envelope set
aside."""

from __future__ import annotations

import sqlite3
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from azure.eventhub import EventData, EventHubProducerClient

from contracts.document import ScheduledEventsDocument
from contracts.envelope import Envelope, HookReport, HookStep
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
        self.vms = {spec.name: identity_of(spec.compute()) for spec in stack.imds.vms()}
        self.producer = EventHubProducerClient.from_connection_string(stack.eventhubs.connection_string(HUB))
        # A state of its own (it cannot read web_0's), with a sequence no forwarder reaches.
        self.state = uuid.uuid4().hex
        self.sequence = 2**62
        self.sent = 0

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

    def envelope(self, vm: str, **fields: Any) -> Envelope:
        self.sequence += 1
        return Envelope(
            vm=self.vms[vm],
            observedAt=datetime.now(UTC),
            sequence=self.sequence,
            forwarder="scheduled-events-forwarder/0.1.0",
            stateId=self.state,
            **fields,
        )


@pytest.mark.slow
def test_one_vms_forged_envelopes_approve_nothing_and_silence_no_one(run_pipeline: Runner, tmp_path: Path) -> None:
    ids: dict[str, str] = {}

    def attack(stack: LocalStack) -> None:
        attacker = Attacker(stack)
        with attacker.producer:
            ids["reboot"] = _event_id(stack, "reboot")
            ids["redeploy"] = _event_id(stack, "redeploy")
            # Type flip, under web_0's identity with a huge sequence (identity and sequence hijack)...
            flipped = attacker.relabelled({ids["reboot"]}, EventType="Freeze", DurationInSeconds=5)
            attacker.send(attacker.envelope("web_0", kind="incarnation", document=flipped))
            # ... and under its own: the Redeploy claimed user-initiated (approve-now if believed).
            user = attacker.relabelled({ids["redeploy"]}, EventSource="User")
            attacker.send(attacker.envelope("web_1", kind="incarnation", document=user))
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
            attacker.send(attacker.envelope("web_0", kind="hook", hook=hook))
        assert attacker.sent == 4

    outcome = run_pipeline(
        _scenario(), during=attack, expected_dead_letters=1, timeout=150.0, policy_path=_policy(tmp_path)
    )
    summary, stack = outcome.summary, outcome.stack
    assert outcome.finished, f"the run did not finish: open {outcome.follower.timeline.open_events()}"
    # The judge's expectations come from the truthful scenario: no approval the truth would not make, every one it
    # makes (the user Reboot after the hijack: web_0 still heard), every envelope web_0 sent applied, one dead letter.
    assert summary.ok, summary.failures
    assert summary.approvals_expected == summary.approvals_expected_made == 1
    assert stack.imds is not None
    approved = {str(a["EventId"]) for a in stack.imds.approvals()}
    assert ids["reboot"] not in approved
    assert ids["redeploy"] not in approved
    assert ids["scale-in"] not in approved
    # What each lie left in the history.
    conflicts = _rows(stack, "RecordType = 'Observation' AND Outcome = 'conflict'")
    assert {row[2] for row in conflicts} >= {ids["reboot"], ids["redeploy"]}, "the relabelled sightings are conflicts"
    assert _rows(stack, "RecordType = 'Heartbeat' AND Outcome = 'conflict' AND VmName = 'web_0'"), "two writers"
    refused = _rows(stack, "RecordType = 'Approval' AND Outcome = 'rejected' AND EventId = ?", ids["scale-in"])
    assert refused, "the forged hook report fooled the coordinator; web_0's listener, with its own ledger, refused"
    assert "10-drain" in str(refused[0]) or "ledger" in str(refused[0])
    kinds = {(card["kind"], card["eventId"] or card["vm"]) for card in summary.cards}
    assert ("facts-conflict", ids["reboot"]) in kinds
    assert ("approval-refused", ids["scale-in"]) in kinds
    assert ("forwarder-conflict", "web_0") in kinds
    print(f"figures: forged 4, dead letters {summary.dead_letters}, conflicts {len(conflicts)}, refused {len(refused)}")
