"""VMs' own attested documents, for the tests of the door (test_door.py, test_door_hostile.py): a coordinator that
requires them, each VM's envelope carrying the document the IMDS emulator's signer makes for it (as IMDS would),
and the ways a valid document can be damaged while still looking like one.

The emulator signs as Azure does: a PKCS7 SignedData without signed attributes, carrying only its signing
certificate (emulators/imds/attested.py). ``with_signed_attributes`` signs the same content the way a CMS library
does, with signed attributes, so that a digest among them can be damaged too.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from asn1crypto import cms as asn1_cms
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.serialization import Encoding, pkcs7

from contracts.approval import ApprovalRequest, ApprovalResult
from contracts.attestation import Attestation, decision_nonce, format_timestamp, state_nonce
from contracts.envelope import VmIdentity
from coordinator.domain.attestation import Attestations, AttestationVerifier, TrustAnchors
from coordinator.pipeline.ingest import RawMessage
from coordinator.service import Coordinator
from emulators.imds.attested import AttestedDocuments, default_authority
from tests.coordinator.helpers import DOC_NOW, MemoryHistory, envelope, scheduled_event, vm
from tests.coordinator.memory_store import MemoryStateStore
from tests.coordinator.runs import folder_coordinator

CA = default_authority()
ISSUER_URL = "http://127.0.0.1:9/_emulator/pki/issuer.cer"
DOCUMENTS = AttestedDocuments(issuer_url=ISSUER_URL, authority=CA)
# The Authority Information Access extension (1.3.6.1.5.5.7.1.1) and the messageDigest attribute (1.2.840.113549.1.9.4)
# as DER writes their OIDs.
AIA_OID = bytes.fromhex("06082b06010505070101")
MESSAGE_DIGEST_OID = bytes.fromhex("06092a864886f70d010904")


def verifier() -> AttestationVerifier:
    return AttestationVerifier(TrustAnchors(roots=(CA.root,)), issuers=lambda _c: [CA.issuer])


def proven_approval(request: ApprovalRequest, vm: VmIdentity) -> ApprovalResult:
    """What ``vm``'s own listener answers: approved, with the document IMDS signs for that VM and this decision."""
    proof = DOCUMENTS.document(vm.model_dump(), nonce=decision_nonce(request.decisionId), now=DOC_NOW)
    return ApprovalResult(
        outcome="approved",
        eventId=request.eventId,
        decisionId=request.decisionId,
        attestation=Attestation.model_validate(proof),
    )


class Approves:
    """Every VM's listener, in process: approves what it is asked, and remembers it; each answer carries the VM's
    document for the decision (the proof of which VM answered)."""

    def __init__(self) -> None:
        self.approved: list[tuple[str, str]] = []

    def send(self, request: ApprovalRequest, *, vm: VmIdentity) -> ApprovalResult:
        self.approved.append((request.eventId, vm.name))
        return proven_approval(request, vm)


@dataclass
class Door:
    """A coordinator that requires attested envelopes (as in Azure and locally), on the in-memory store."""

    coordinator: Coordinator
    store: MemoryStateStore = field(repr=False)
    history: MemoryHistory = field(repr=False)
    listeners: Approves = field(repr=False)

    def dead_reasons(self) -> list[str]:
        return [str(letter["Reason"]) for letter in self.store.dead_letters()]


def door(cards: Path, store: MemoryStateStore | None = None) -> Door:
    store, history, listeners = store or MemoryStateStore(), MemoryHistory(), Approves()
    return Door(attested_coordinator(cards, store, history, listeners), store, history, listeners)


def attested_coordinator(
    cards: Path, store: MemoryStateStore, history: MemoryHistory, callback: Any, **settings: Any
) -> Coordinator:
    """A coordinator on the default policy that requires attested envelopes (as in Azure and locally), at DOC_NOW;
    ``settings`` name more parts or options."""
    return folder_coordinator(
        cards,
        store=store,
        history=history,
        callback=callback,
        clock=lambda: DOC_NOW,
        attestations=Attestations(verifier()),
        require_attestation=True,
        **settings,
    )


def identity(name: str, index: int) -> dict[str, Any]:
    # A placement group of its own: the default policy's budgets count per domain, and these VMs are strangers.
    return vm(name, index=index, group=f"pg-{name}")


def freeze(identity: dict[str, Any], event_id: str, *, state: str, sequence: int = 1) -> dict[str, Any]:
    """``identity``'s envelope reporting a 5 s Freeze of itself (the default policy approves it at once), with its
    forwarder state's attested document, signed for it at DOC_NOW."""
    event = scheduled_event(event_id, resources=[identity["name"]], duration=5)
    data = envelope(identity, sequence=sequence, incarnation=sequence, events=[event])
    data["stateId"] = state
    data["attestation"] = DOCUMENTS.document(identity, nonce=state_nonce(state), now=DOC_NOW)
    return data


def message(data: dict[str, Any] | list[Any], *, partition_key: str | None = None) -> RawMessage:
    key = partition_key or (str(data["vm"]["resourceId"]).lower() if isinstance(data, dict) else None)
    return RawMessage(body=json.dumps(data).encode(), partition_key=key)


def der_of(data: dict[str, Any]) -> bytes:
    return base64.b64decode(data["attestation"]["signature"])


def with_der(data: dict[str, Any], der: bytes) -> dict[str, Any]:
    """The envelope with its attested document's DER replaced."""
    return {**data, "attestation": {"encoding": "pkcs7", "signature": base64.b64encode(der).decode()}}


def aia_byte_changed(der: bytes, offset: int = 0) -> bytes:
    """The document with one byte inside the signing certificate's Authority Information Access changed: the
    certificate still loads, and the extension is read only when asked for."""
    at = der.index(AIA_OID) + offset
    return der[:at] + bytes([der[at] ^ 0xFF]) + der[at + 1 :]


def with_signed_attributes(identity: dict[str, Any], state: str, at: datetime = DOC_NOW) -> bytes:
    """The VM's document signed with signed attributes (content type, signing time, message digest), by the
    emulator's own signing certificate: valid, and verified as CMS says."""
    signer = DOCUMENTS.signer()
    content = {
        "nonce": state_nonce(state),
        "vmId": identity["vmId"],
        "timeStamp": {"createdOn": format_timestamp(at), "expiresOn": format_timestamp(at + timedelta(hours=6))},
    }
    return (
        pkcs7.PKCS7SignatureBuilder()
        .set_data(json.dumps(content, separators=(",", ":")).encode())
        .add_signer(signer.certificate, signer.key, hashes.SHA256())
        .sign(Encoding.DER, [pkcs7.PKCS7Options.Binary])
    )


def digest_as_integer(der: bytes) -> bytes:
    """The document with its signed message digest written as an INTEGER, not an OCTET STRING (tag 0x02 for 0x04):
    the attributes are parsed only when read."""
    at = der.index(MESSAGE_DIGEST_OID) + len(MESSAGE_DIGEST_OID) + 2  # past the OID and the SET's tag and length
    assert der[at] == 0x04, "the messageDigest value is an OCTET STRING"
    return der[:at] + b"\x02" + der[at + 1 :]


def regions(der: bytes) -> dict[str, tuple[int, int]]:
    """Where the parts a valid document's proof rests on lie in its DER, as (start, end): the signed content, the
    signing certificate, the signed attributes (when it has them), the signature. Any change inside one of them
    must be refused."""
    info = asn1_cms.ContentInfo.load(der)
    signed = info["content"]
    signer = signed["signer_infos"][0]
    parts = [
        ("content", signed["encap_content_info"]["content"]),
        ("certificate", signed["certificates"][0].chosen),
        ("signature", signer["signature"]),
    ]
    if signer["signed_attrs"].native:
        parts.append(("attributes", signer["signed_attrs"]))
    found: dict[str, tuple[int, int]] = {}
    for name, part in parts:
        encoded = part.dump()
        start = der.index(encoded)
        found[name] = (start, start + len(encoded))
    return found
