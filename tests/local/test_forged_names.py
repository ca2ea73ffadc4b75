"""No VM speaks for another by name (issue 34), over the whole local stack: attested forwarders, ARM's census from the
IMDS emulator's ARM face. A process with root on web_1 keeps web_1's own vmId, its own resource id as partition key
and its own IMDS's attested document, and writes web_0's name: it lists web_0's 5 s Freeze while web_0's forwarder is
stopped (its approval would go to web_1's hybrid connection under web_0's name), lists web_0's Reboot at sequence
2^62 and drops it (web_0 would be silenced, its Reboot Canceled), reports web_0's prepare hooks succeeded for a
delete whose real hook failed, and an hour's impact of the Freeze.

Measured before the fix, this run: the Freeze recorded approved through web_0 while web_1 executed it, the Reboot
Canceled and web_0's later sightings of it dropped, the delete decided ``approve`` on the forged report (web_0's
listener refused it), and an Impact row of 3600 s for web_0. Now each forged envelope is dead-lettered as not its
resource id's name, the history names the VM that executed the Freeze, the Reboot stays web_0's, nothing is decided
on the forged report, and the run's own judge, from the truthful scenario, finds nothing amiss."""

from __future__ import annotations

import sqlite3
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from azure.eventhub import EventData, EventHubProducerClient

from contracts.document import ScheduledEventsDocument
from contracts.envelope import Envelope, HookReport, HookStep, ImpactReport, VmIdentity
from emulators.imds import Scenario
from forwarder.imds import identity_of
from local.forgeries import FORGED_SEQUENCE, attestation_of
from local.runner import wait_until
from local.stack import HUB, LocalStack
from tests.local.conftest import Runner
from tests.local.test_forged import _policy

TABLE = "ScheduledEventsHistory_CL"


def _scenario() -> Scenario:
    return Scenario.from_mapping(
        {
            "name": "e2e-forged-names",
            "scaleSets": {"web": {"terminateNotification": True, "terminateNotBeforeSeconds": 900}},
            "vms": [
                {
                    "name": "web_0",
                    "vmScaleSetName": "web",
                    "placementGroupId": "pg-1",
                    "hooks": {"prepare": [{"name": "10-drain", "exitCode": 1}]},
                },
                # The attacker: same placement group, so its own IMDS shows web_0's events.
                {"name": "web_1", "vmScaleSetName": "web", "placementGroupId": "pg-1"},
            ],
            "steps": [
                # web_0's forwarder stopped for 6 s: the forged listing of its Freeze comes first.
                {"at": 0, "signal": {"vm": "web_0", "signal": "STOP", "seconds": 6}},
                {
                    "at": 0,
                    "create": {
                        "ref": "freeze",
                        "EventType": "Freeze",
                        "Resources": ["web_0"],
                        "DurationInSeconds": 5,
                        "NoticeSeconds": 1800,
                    },
                },
                {
                    "at": 0,
                    "create": {"ref": "reboot", "EventType": "Reboot", "Resources": ["web_0"], "NoticeSeconds": 1800},
                },
                {"at": 1200, "create": {"ref": "scale-in", "EventType": "Terminate", "Resources": ["web_0"]}},
            ],
        }
    )


def _rows(stack: LocalStack, where: str, *args: Any) -> list[tuple[Any, ...]]:
    with sqlite3.connect(f"file:{stack.history_path}?mode=ro", uri=True) as db:
        return db.execute(f'SELECT * FROM "{TABLE}" WHERE {where}', args).fetchall()


class Spoofer:
    """web_1 with root: its own identity under web_0's name, a state of its own attested by its own IMDS."""

    def __init__(self, stack: LocalStack) -> None:
        assert stack.imds is not None
        assert stack.eventhubs is not None
        self.imds = stack.imds
        vms = {spec.name: VmIdentity.of(identity_of(spec.compute())) for spec in stack.imds.vms()}
        self.web_0, self.web_1 = vms["web_0"], vms["web_1"]
        self.as_web_0 = self.web_1.model_copy(update={"name": "web_0"})
        self.state = uuid.uuid4().hex
        self.attestation = attestation_of(self.imds.url_for("web_1"), self.state)
        self.sequence = FORGED_SEQUENCE
        self.producer = EventHubProducerClient.from_connection_string(stack.eventhubs.connection_string(HUB))
        self.sent = 0

    def send(self, **fields: Any) -> None:
        self.sequence += 1
        envelope = Envelope(
            vm=self.as_web_0,
            attestation=self.attestation,
            observedAt=datetime.now(UTC),
            sequence=self.sequence,
            forwarder="scheduled-events-forwarder/0.1.0",
            stateId=self.state,
            **fields,
        )
        batch = self.producer.create_batch(partition_key=self.as_web_0.partition_key)  # its own resource id
        batch.add(EventData(envelope.to_json_bytes()))
        self.producer.send_batch(batch)
        self.sent += 1

    def listing(self, event_ids: set[str]) -> ScheduledEventsDocument:
        document = self.imds.document("web_1")
        events = [e for e in document["Events"] if e["EventId"] in event_ids]
        return ScheduledEventsDocument.model_validate({"DocumentIncarnation": 7, "Events": events})


@pytest.mark.slow
def test_a_vm_writing_another_vms_name_with_its_own_identity_is_refused_and_moves_nothing(
    run_pipeline: Runner, tmp_path: Path
) -> None:
    ids: dict[str, str] = {}

    def attack(stack: LocalStack) -> None:
        assert stack.imds is not None
        imds = stack.imds
        assert wait_until(lambda: {"freeze", "reboot"} <= {e.get("ref") for e in imds.events()}, timeout=30)
        ids.update({str(e["ref"]): str(e["EventId"]) for e in imds.events() if e.get("ref")})
        spoofer = Spoofer(stack)
        with spoofer.producer:
            # While web_0's forwarder is stopped: its Freeze and Reboot under its name, at 2^62, then dropped.
            spoofer.send(kind="incarnation", document=spoofer.listing({ids["freeze"], ids["reboot"]}))
            spoofer.send(kind="incarnation", document=ScheduledEventsDocument(DocumentIncarnation=8, Events=[]))
            started = datetime.now(UTC)
            spoofer.send(
                kind="impact",
                impact=ImpactReport(
                    eventId=ids["freeze"],
                    eventType="Freeze",
                    measure="pause",
                    measuredSeconds=3600,
                    start=started,
                    end=started + timedelta(hours=1),
                ),
            )
            # web_0's delete, once its real prepare hook has failed: a forged success in its name.
            assert wait_until(lambda: any(e.get("ref") == "scale-in" for e in imds.events()), timeout=60)
            ids["scale-in"] = next(str(e["EventId"]) for e in imds.events() if e.get("ref") == "scale-in")
            failed = "EventId = ? AND RecordType = 'Hook' AND Outcome = 'failed'"
            assert wait_until(lambda: bool(_rows(stack, failed, ids["scale-in"])), timeout=30)
            done = HookStep(hook="10-drain", outcome="succeeded", durationSeconds=1.0, exitCode=0)
            spoofer.send(
                kind="hook",
                hook=HookReport(
                    eventId=ids["scale-in"], phase="prepare", outcome="succeeded", durationSeconds=1.0, steps=[done]
                ),
            )
        assert spoofer.sent == 4

    outcome = run_pipeline(
        _scenario(), during=attack, expected_dead_letters=4, timeout=150.0, policy_path=_policy(tmp_path)
    )
    summary, stack = outcome.summary, outcome.stack
    assert outcome.finished, f"the run did not finish: waiting for {outcome.follower.waits}"
    assert summary.ok, summary.failures
    assert stack.imds is not None
    # Each forged envelope refused at the door: web_1's resource id is ARM's web_1.
    reasons = [str(row) for row in _rows(stack, "RecordType = 'DeadLetter'")]
    assert len(reasons) == 4, reasons
    assert all("is not its resource id's name" in r for r in reasons), reasons
    # The Freeze approved once, and the history names the VM that executed it (web_1, a peer that sees it, while
    # web_0 was stopped): before, it said "approved through web_0" for the spoofer's hybrid connection.
    approvals = [(str(a["EventId"]), str(a["vm"])) for a in stack.imds.approvals()]
    assert [event for event, _ in approvals] == [ids["freeze"]], approvals
    recorded = [(row[2], row[11]) for row in _rows(stack, "RecordType = 'Approval' AND Outcome = 'approved'")]
    assert recorded == approvals, recorded
    # web_0 was not silenced: its Reboot ran its course as web_0 saw it, and its later sightings were heard.
    reboot = _rows(stack, "EventId = ? AND RecordType = 'Transition'", ids["reboot"])
    assert not [row for row in reboot if "Canceled" in str(row)], reboot
    observed = "RecordType = 'Observation' AND VmName = 'web_0'"
    with sqlite3.connect(f"file:{stack.history_path}?mode=ro", uri=True) as db:
        heard = db.execute(
            f'SELECT DISTINCT VmId FROM "{TABLE}" WHERE EventId = ? AND {observed}',
            (ids["reboot"],),
        ).fetchall()
    assert heard == [(stack_vm_id(stack, "web_0"),)], heard
    # Nothing decided on the forged hook report, no Impact written for web_0 from the forged one.
    decided = _rows(stack, "EventId = ? AND RecordType = 'Decision' AND Outcome = 'approve'", ids["scale-in"])
    assert decided == []
    assert _rows(stack, "RecordType = 'Impact' AND MeasuredSeconds >= 3600") == []
    print(f"figures: forged 4, dead letters {summary.dead_letters}, approvals {approvals}")


def stack_vm_id(stack: LocalStack, name: str) -> str:
    assert stack.imds is not None
    return next(spec.vmId for spec in stack.imds.vms() if spec.name == name)
