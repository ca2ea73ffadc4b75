"""What the local forgers send (local/forgeries.py), pure: a forger with root on web_1 keeps its own vmId, its own
resource id as partition key and its own document, and writes web_0's name (or, squatting, web_0's resource id); a
forger without root sends no document; every sequence is past any forwarder's."""

from __future__ import annotations

import json
from typing import Any

import pytest

from contracts.attestation import Attestation
from contracts.envelope import Envelope, VmIdentity
from emulators.imds.local_steps import ForgeStep
from local.forgeries import ATTESTED, FORGED_SEQUENCE, forged
from tests.coordinator.helpers import vm

WEB_0 = VmIdentity.model_validate(vm("web_0", index=1, group="pg-web", scale_set="web"))
WEB_1 = VmIdentity.model_validate(vm("web_1", index=2, group="pg-web", scale_set="web"))
PROOF = Attestation(encoding="pkcs7", signature="TUlJQg==")
EVENT: dict[str, Any] = {
    "EventId": "E-1",
    "EventType": "Reboot",
    "ResourceType": "VirtualMachine",
    "Resources": ["web_0"],
    "EventStatus": "Scheduled",
    "NotBefore": "Mon, 11 Apr 2022 22:26:58 GMT",
    "Description": "",
    "EventSource": "Platform",
    "DurationInSeconds": -1,
}


def sent(kind: str) -> list[tuple[Envelope, str]]:
    step = ForgeStep.model_validate({"by": "web_1", "about": "web_0", "kind": kind})
    messages = forged(step, victim=WEB_0, forger=WEB_1, incarnation=3, events=[EVENT], attest=lambda _state: PROOF)
    return [(Envelope.model_validate(json.loads(body)), key) for body, key in messages]


@pytest.mark.parametrize("kind", ["name", "silence", "name-hook", "name-impact"])
def test_another_vms_name_with_the_forgers_own_identity_and_document(kind: str) -> None:
    messages = sent(kind)
    assert messages
    for envelope, key in messages:
        assert (envelope.vm.name, envelope.vm.vmId, key) == ("web_0", WEB_1.vmId, WEB_1.partition_key)
        assert envelope.attestation == PROOF
        assert envelope.sequence >= FORGED_SEQUENCE
    if kind == "silence":
        assert [len(e.document.Events) for e, _ in messages if e.document] == [1, 0]


def test_a_squatter_takes_the_name_and_resource_id_with_its_own_vmid() -> None:
    ((envelope, key),) = sent("squat")
    assert (envelope.vm.name, envelope.vm.vmId, key) == ("web_0", WEB_1.vmId, WEB_0.partition_key)


def test_a_damaged_document_and_the_forgers_without_root() -> None:
    ((envelope, key),) = sent("malformed")
    assert (envelope.vm.name, key) == ("web_1", WEB_1.partition_key)
    assert envelope.attestation is not None
    assert envelope.attestation.signature != PROOF.signature
    for kind in ("relabel", "hook", "gone", "sequence"):
        assert kind not in ATTESTED
        assert all(e.attestation is None for e, _ in sent(kind))
