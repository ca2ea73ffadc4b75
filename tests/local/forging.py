"""What the whole-stack forgery tests share: a process on one fleet VM with root on it (the fleet's Event Hubs sender
identity, its own IMDS), the history they judge it by, the policy that makes an early delete approval show, and the
fleet of a victim and its attacker.

A forger keeps a forwarder state of its own, attested by its own IMDS (no IMDS signs another VM's vmId), with
sequences from 2^62 (no forwarder reaches them), and sends envelopes in any name it likes."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from azure.eventhub import EventData

from contracts.document import ScheduledEventsDocument
from contracts.envelope import Envelope, VmIdentity
from coordinator.domain.policy_file import DEFAULT_POLICY_PATH
from emulators.eventhubs import producer_client
from emulators.imds import Scenario
from forwarder.imds import identity_of
from local.forgeries import FORGED_SEQUENCE, attestation_of
from local.stack import HUB, LocalStack

__all__ = ["Forger", "hooks_wait_policy", "victim_and_attacker"]


def hooks_wait_policy(tmp_path: Path) -> Path:
    """The default policy, but a delete whose prepare hook failed is never approved before NotBefore (the truthful
    run makes no approval of it, so an early one could only come from a forged hook report)."""
    text = DEFAULT_POLICY_PATH.read_text(encoding="utf-8")
    old = "hooks: {deadlineSeconds: 240, onDeadline: approve, noHooks: wait}"
    assert old in text
    path = tmp_path / "policy.yaml"
    path.write_text(text.replace(old, "hooks: {deadlineSeconds: 3600, onDeadline: wait, noHooks: wait}"), "utf-8")
    return path


def victim_and_attacker(name: str, steps: list[dict[str, Any]]) -> Scenario:
    """The scenario ``name`` of ``steps`` on scale set web (its deletes with 900 s notice): web_0, whose prepare hook
    fails, and web_1, the attacker, in the same placement group, so that its own IMDS document shows web_0's
    events."""
    victim = {
        "name": "web_0",
        "vmScaleSetName": "web",
        "placementGroupId": "pg-1",
        "hooks": {"prepare": [{"name": "10-drain", "exitCode": 1}]},
    }
    attacker = {"name": "web_1", "vmScaleSetName": "web", "placementGroupId": "pg-1"}
    return Scenario.from_mapping(
        {
            "name": name,
            "scaleSets": {"web": {"terminateNotification": True, "terminateNotBeforeSeconds": 900}},
            "vms": [victim, attacker],
            "steps": steps,
        }
    )


class Forger:
    """A process with root on ``on``: a forwarder state of its own attested by ``on``'s IMDS; ``vms`` are the fleet's
    identities as Azure gives them (a forger knows its peers' names, vmIds and resource ids)."""

    def __init__(self, stack: LocalStack, on: str) -> None:
        assert stack.imds is not None
        assert stack.eventhubs is not None
        self.imds = stack.imds
        self.on = on
        self.vms = {spec.name: VmIdentity.of(identity_of(spec.compute())) for spec in stack.imds.vms()}
        self.state = uuid.uuid4().hex
        self.attestation = attestation_of(self.imds.url_for(on), self.state)
        self.sequence = FORGED_SEQUENCE
        self.producer = producer_client(stack.eventhubs.connection_string(HUB))
        self.sent = 0

    def envelope(self, identity: VmIdentity, *, attested: bool = True, **fields: Any) -> Envelope:
        """An envelope as ``identity``, carrying the forger's own attested document (or none)."""
        self.sequence += 1
        return Envelope(
            vm=identity,
            attestation=self.attestation if attested else None,
            observedAt=datetime.now(UTC),
            sequence=self.sequence,
            forwarder="scheduled-events-forwarder/0.1.0",
            stateId=self.state,
            **fields,
        )

    def send(self, envelope: Envelope, *, keyed: bool = True) -> None:
        """Sent as a forwarder sends: partitioned by the envelope's resource id (or, not ``keyed``, by none)."""
        batch = (
            self.producer.create_batch(partition_key=envelope.vm.partition_key)
            if keyed
            else self.producer.create_batch()
        )
        batch.add(EventData(envelope.to_json_bytes()))
        self.producer.send_batch(batch)
        self.sent += 1

    def listing(self, event_ids: set[str], incarnation: int | None = None, **changes: Any) -> ScheduledEventsDocument:
        """The forger's own VM's document (it sees its placement group's events) with only ``event_ids``, each with
        ``changes`` to its facts, at ``incarnation`` (default: the document's)."""
        document = self.imds.document(self.on)
        events = [{**e, **changes} for e in document["Events"] if e["EventId"] in event_ids]
        number = document["DocumentIncarnation"] if incarnation is None else incarnation
        return ScheduledEventsDocument.model_validate({"DocumentIncarnation": number, "Events": events})
