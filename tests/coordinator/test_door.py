"""The door (issue 33): one boundary per message. Whatever one message breaks while it is read, verified or bound
sets that message aside with its reason, and the rest of its batch goes on; a state store that fails is the one
thing that fails a batch, and it says so. Fast: the in-memory store, documents signed in-process by the IMDS
emulator's signer, a coordinator that requires them.

Measured before: a VM's own valid document with one byte changed inside its certificate's Authority Information
Access, or with its signed message digest written as an INTEGER, made ``process_batch`` raise ``ValueError``
(asn1crypto and cryptography parse lazily, outside the verifier's ``try``): in a batch with 3 good 5 s Freezes,
0 history rows and 0 approvals, on every retry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from contracts.attestation import Attestation, state_nonce
from coordinator.domain.attestation import AttestationRefused
from coordinator.pipeline.attest import StoreOutage
from tests.coordinator import attested
from tests.coordinator.attested import door, freeze, identity, message, with_der
from tests.coordinator.helpers import DOC_NOW
from tests.coordinator.memory_store import MemoryStateStore

GOOD = [identity(f"good_{n}", 100 + n) for n in range(3)]
BAD = identity("bad_0", 200)


def damaged_aia(data: dict[str, object]) -> bytes:
    return attested.aia_byte_changed(attested.der_of(data))


def damaged_digest(data: dict[str, object]) -> bytes:
    return attested.digest_as_integer(attested.with_signed_attributes(BAD, "bad-state"))


DAMAGES: dict[str, Callable[[dict[str, object]], bytes]] = {
    "aia-byte-changed": damaged_aia,
    "digest-as-integer": damaged_digest,
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_the_verifier_refuses_a_damaged_document_saying_what_cannot_be_read(damage: str) -> None:
    data = freeze(BAD, "EV-BAD", state="bad-state")
    document = Attestation.model_validate(with_der(data, DAMAGES[damage](data))["attestation"])
    with pytest.raises(AttestationRefused, match="cannot be read"):
        attested.verifier().verify(document, vm_id=BAD["vmId"], nonce=state_nonce("bad-state"), at=DOC_NOW)


def test_the_same_documents_undamaged_verify() -> None:
    """What the damages start from is valid: the refusal is the damage's."""
    data = freeze(BAD, "EV-BAD", state="bad-state")
    for der in (attested.der_of(data), attested.with_signed_attributes(BAD, "bad-state")):
        document = Attestation.model_validate(with_der(data, der)["attestation"])
        attested.verifier().verify(document, vm_id=BAD["vmId"], nonce=state_nonce("bad-state"), at=DOC_NOW)


@pytest.mark.parametrize("under", ["its-own-name", "another-vms-name"])
@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_document_costs_only_its_message(tmp_path: Path, damage: str, under: str) -> None:
    """3 good 5 s Freezes and, before, between and after them, envelopes carrying a damaged document: under the
    sender's own name, and under another VM's resource id (the issue's whole-stack run: one VM failed 38 batches
    on every retry that way)."""
    gate = door(tmp_path / "cards")
    bad = freeze(BAD, "EV-BAD", state="bad-state")
    forged = with_der(bad, DAMAGES[damage](bad))
    if under == "another-vms-name":
        forged = {**forged, "vm": {**BAD, "resourceId": GOOD[0]["resourceId"]}}
    good = [message(freeze(who, f"EV-GOOD-{n}", state=f"good-state-{n}")) for n, who in enumerate(GOOD)]
    messages = [message(forged), good[0], message(forged), good[1], good[2], message(forged)]

    report = gate.coordinator.process_batch(messages)

    assert report.dead_lettered == 3
    assert report.accepted == 3
    reasons = gate.dead_reasons()
    assert len(reasons) == 3
    assert all(r.startswith("attestation refused: ") and "cannot be read" in r for r in reasons), reasons
    assert sorted(gate.listeners.approved) == [(f"EV-GOOD-{n}", who["name"]) for n, who in enumerate(GOOD)]
    assert len([r for r in gate.history.rows if r.RecordType == "DeadLetter"]) == 3
    assert {r.EventId for r in gate.history.rows if r.RecordType == "Approval"} >= {f"EV-GOOD-{n}" for n in range(3)}
    # A refused envelope binds nothing: the name it used is still free for the VM it belongs to.
    assert gate.store.claimed(f"vm-resource:{BAD['resourceId'].lower()}") is None


class FailingClaims(MemoryStateStore):
    """A state store whose bindings cannot be read (Table Storage unreachable)."""

    def claimed(self, name: str) -> str | None:
        raise ConnectionError("the table endpoint refused the connection (stand-in)")

    def claims_in(self, partition: str) -> dict[str, str]:
        raise ConnectionError("the table endpoint refused the connection (stand-in)")


def test_a_state_store_that_fails_fails_the_batch_and_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Nothing is dead-lettered for want of a read: the batch fails, to be delivered again, and the log says
    that the store failed, where."""
    gate = door(tmp_path / "cards", store=FailingClaims())
    messages = [message(freeze(who, f"EV-GOOD-{n}", state=f"good-state-{n}")) for n, who in enumerate(GOOD)]

    with caplog.at_level(logging.ERROR, logger="coordinator"), pytest.raises(StoreOutage, match="state store failed"):
        gate.coordinator.process_batch(messages)

    assert gate.store.dead_letters() == []
    assert gate.listeners.approved == []
    assert any("delivered again" in r.getMessage() and "message 0" in r.getMessage() for r in caplog.records)
