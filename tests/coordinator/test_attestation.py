"""IMDS attested documents: the verifier (signature, chain, signer domain, vmId, nonce, validity), the nonces, the
shipped Azure roots, and what the coordinator accepts with them (pipeline/attest.py: envelopes, bindings, answers).
Fast: documents are signed in-process by the IMDS emulator's own signer; the store is the in-memory one."""

from __future__ import annotations

import base64
import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.serialization import Encoding, pkcs7
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.approval import ApprovalRequest, ApprovalResult
from contracts.attestation import (
    Attestation,
    AttestationError,
    decision_nonce,
    format_timestamp,
    parse_timestamp,
    read_content,
    state_nonce,
)
from contracts.envelope import Envelope, VmIdentity
from coordinator.adapters.callback import ApprovalDeliveryError
from coordinator.domain.attestation import AttestationRefused, Attestations, AttestationVerifier, TrustAnchors
from coordinator.pipeline.act import PROOF_ATTEMPTS, send
from coordinator.pipeline.attest import answer_problem, envelope_problem
from coordinator.pipeline.bindings import remember
from coordinator.settings import AZURE_IMDS_ROOTS
from emulators.imds.attested import AttestedDocuments, CertificateAuthority, Signer, default_authority
from tests.coordinator.helpers import envelope, vm
from tests.coordinator.memory_store import MemoryStateStore
from tests.coordinator.runs import AnswersInTurn

NOW = datetime(2026, 3, 2, 10, 0, 0, tzinfo=UTC)
CA = default_authority()
ISSUER_URL = "http://127.0.0.1:9/_emulator/pki/issuer.cer"
WEB_0 = vm("web_0", scale_set="web", index=10)
WEB_1 = vm("web_1", scale_set="web", index=11)
STATE = "5f0c8e3a9b2d4c7e8a1f6b3d2c9e0a7b"


@pytest.fixture(scope="module")
def documents() -> AttestedDocuments:
    return AttestedDocuments(issuer_url=ISSUER_URL, authority=CA)


def verifier(authority: CertificateAuthority = CA, **anchors: Any) -> AttestationVerifier:
    return AttestationVerifier(TrustAnchors(roots=(authority.root,), **anchors), issuers=lambda _c: [authority.issuer])


def attested(documents: AttestedDocuments, identity: dict[str, Any], nonce: str, at: datetime = NOW) -> Attestation:
    return Attestation.model_validate(documents.document(identity, nonce=nonce, now=at))


def signed(signer: Signer, content: dict[str, Any]) -> Attestation:
    der = signer.sign(json.dumps(content, separators=(",", ":")).encode())
    return Attestation(encoding="pkcs7", signature=base64.b64encode(der).decode())


def content(vm_id: str, nonce: str, created: datetime, lifetime: timedelta) -> dict[str, Any]:
    return {
        "nonce": nonce,
        "vmId": vm_id,
        "timeStamp": {"createdOn": format_timestamp(created), "expiresOn": format_timestamp(created + lifetime)},
    }


# --- nonces ---------------------------------------------------------------------------------------------------


def test_nonces_are_ten_digits_fixed_per_value_and_apart_per_use() -> None:
    assert state_nonce(STATE) == state_nonce(STATE)
    assert len(state_nonce(STATE)) == 10
    assert state_nonce(STATE).isdigit()
    assert state_nonce(STATE) != state_nonce(STATE + "x")
    # A document asked for a decision proves nothing about a state with the same text, and the other way round.
    assert state_nonce("d-1") != decision_nonce("d-1")
    with pytest.raises(AttestationError, match="without a stateId"):
        state_nonce("")


# --- the verifier ---------------------------------------------------------------------------------------------


def test_a_good_document_verifies_and_says_who_signed_what(documents: AttestedDocuments) -> None:
    document = attested(documents, WEB_0, state_nonce(STATE))
    result = verifier().verify(document, vm_id=WEB_0["vmId"].upper(), nonce=state_nonce(STATE), at=NOW)
    assert (result.vm_id, result.nonce, result.signer) == (
        WEB_0["vmId"],
        state_nonce(STATE),
        "emulator.metadata.azure.com",
    )
    assert result.expires_on - result.created_on == timedelta(hours=6)


def test_a_document_with_signed_attributes_verifies_too(documents: AttestedDocuments) -> None:
    """Azure's documents sign the content itself; a CMS signer with signed attributes is checked as CMS says."""
    signer = documents.signer()
    body = json.dumps(content(WEB_0["vmId"], "1234567890", NOW, timedelta(hours=1))).encode()
    der = (
        pkcs7.PKCS7SignatureBuilder()
        .set_data(body)
        .add_signer(signer.certificate, signer.key, hashes.SHA256())
        .sign(Encoding.DER, [pkcs7.PKCS7Options.Binary])
    )
    document = Attestation(encoding="pkcs7", signature=base64.b64encode(der).decode())
    assert verifier().verify(document, vm_id=WEB_0["vmId"], nonce="1234567890", at=NOW).nonce == "1234567890"


def test_a_changed_document_is_refused(documents: AttestedDocuments) -> None:
    document = attested(documents, WEB_0, state_nonce(STATE))
    der = document.der()
    forged = der.replace(WEB_0["vmId"].encode(), WEB_1["vmId"].encode())
    assert forged != der
    changed = Attestation(encoding="pkcs7", signature=base64.b64encode(forged).decode())
    with pytest.raises(AttestationRefused, match="signature does not verify"):
        verifier().verify(changed, vm_id=WEB_1["vmId"], nonce=state_nonce(STATE), at=NOW)


def test_a_document_signed_under_another_ca_is_refused(documents: AttestedDocuments) -> None:
    other = CertificateAuthority.create(label="Impostor")
    forged = signed(other.signer(issuer_url=ISSUER_URL), content(WEB_0["vmId"], "1234567890", NOW, timedelta(hours=1)))
    # Trusting only the emulator's root (the impostor's issuer is even handed over): not a chain to a trusted root.
    with pytest.raises(AttestationRefused, match="does not chain to a configured root"):
        AttestationVerifier(TrustAnchors(roots=(CA.root,)), issuers=lambda _c: [other.issuer]).verify(
            forged, vm_id=WEB_0["vmId"], nonce="1234567890", at=NOW
        )
    # And the emulator's own document, checked against Azure's roots, is refused the same way.
    azure = AttestationVerifier(
        TrustAnchors(roots=tuple(x509.load_pem_x509_certificates(AZURE_IMDS_ROOTS.read_bytes())))
    )
    with pytest.raises(AttestationRefused, match="COORDINATOR_ATTESTATION_TRUST_ANCHORS"):
        azure.verify(attested(documents, WEB_0, "1234567890"), vm_id=WEB_0["vmId"], nonce="1234567890", at=NOW)


def test_a_signer_met_again_is_not_chained_again() -> None:
    fetched: list[x509.Certificate] = []

    def issuers(certificate: x509.Certificate) -> list[x509.Certificate]:
        fetched.append(certificate)
        return [CA.issuer]

    check = AttestationVerifier(TrustAnchors(roots=(CA.root,)), issuers=issuers)
    signer = CA.signer(issuer_url=ISSUER_URL)
    for index in range(3):
        vm_id = f"00000000-0000-0000-0000-00000000000{index}"
        check.verify(signed(signer, content(vm_id, "1234567890", NOW, timedelta(hours=1))), vm_id=vm_id,
                     nonce="1234567890", at=NOW)  # fmt: skip
    # The chain was built (and the issuer fetched) for the first document only: a fleet's documents share a signer.
    assert fetched == [signer.certificate]


def test_a_chain_proven_once_proves_nothing_after_its_signer_expired() -> None:
    check = verifier()
    signer = CA.signer(issuer_url=ISSUER_URL, now=NOW - timedelta(days=364))  # expires a day after NOW
    check.verify(signed(signer, content(WEB_0["vmId"], "1234567890", NOW, timedelta(hours=1))), vm_id=WEB_0["vmId"],
                 nonce="1234567890", at=NOW)  # fmt: skip
    later = NOW + timedelta(days=2)
    with pytest.raises(AttestationRefused, match="does not chain to a configured root"):
        check.verify(signed(signer, content(WEB_0["vmId"], "1234567890", later, timedelta(hours=1))),
                     vm_id=WEB_0["vmId"], nonce="1234567890", at=later)  # fmt: skip


def test_a_document_framed_otherwise_than_in_der_is_refused_though_its_content_verifies(
    documents: AttestedDocuments,
) -> None:
    der = attested(documents, WEB_0, "1234567890").der()
    content = der.index(b'{"licenseType"')
    # eContent [0] (A0 82 len len) holding the OCTET STRING (04 82 len len) of the content, as IMDS frames it.
    header = der[content - 8 : content - 4]
    length = int.from_bytes(header[2:], "big")
    assert header[:2] == bytes([0xA0, 0x82])
    assert length > 0xFF
    for framing, why in (
        (bytes([0xA0, 0x82, 0x00, length & 0xFF]), "shortest form"),  # a long form with a leading zero byte
        (bytes([0xA0, 0x82]) + (length - 1).to_bytes(2, "big"), "runs past"),  # the OCTET STRING outruns its [0]
    ):
        changed = der[: content - 8] + framing + der[content - 4 :]
        document = Attestation(encoding="pkcs7", signature=base64.b64encode(changed).decode())
        with pytest.raises(AttestationError, match=why):
            verifier().verify(document, vm_id=WEB_0["vmId"], nonce="1234567890", at=NOW)


def test_a_signer_outside_the_signer_domain_is_refused(documents: AttestedDocuments) -> None:
    stranger = CA.signer(issuer_url=ISSUER_URL, names=("metadata.example.com",))
    document = signed(stranger, content(WEB_0["vmId"], "1234567890", NOW, timedelta(hours=1)))
    with pytest.raises(AttestationRefused, match=r"not by a certificate of \*\.metadata\.azure\.com"):
        verifier().verify(document, vm_id=WEB_0["vmId"], nonce="1234567890", at=NOW)
    # A sovereign cloud's domain is a setting: the emulator's certificate is not of it.
    with pytest.raises(AttestationRefused, match=r"\*\.metadata\.azure\.us"):
        verifier(signer_domain="metadata.azure.us").verify(
            attested(documents, WEB_0, "1234567890"), vm_id=WEB_0["vmId"], nonce="1234567890", at=NOW
        )


def test_another_vms_document_is_refused(documents: AttestedDocuments) -> None:
    document = attested(documents, WEB_1, state_nonce(STATE))
    with pytest.raises(AttestationRefused, match=f"of VM {WEB_1['vmId']}, not of VM {WEB_0['vmId']}"):
        verifier().verify(document, vm_id=WEB_0["vmId"], nonce=state_nonce(STATE), at=NOW)


def test_a_document_for_another_nonce_is_refused(documents: AttestedDocuments) -> None:
    document = attested(documents, WEB_0, state_nonce("another state"))
    with pytest.raises(AttestationRefused, match="made for another forwarder state or decision"):
        verifier().verify(document, vm_id=WEB_0["vmId"], nonce=state_nonce(STATE), at=NOW)


def test_an_expired_document_is_refused_past_the_clock_skew(documents: AttestedDocuments) -> None:
    document = attested(documents, WEB_0, "1234567890", at=NOW)
    check = verifier()
    check.verify(document, vm_id=WEB_0["vmId"], nonce="1234567890", at=NOW + timedelta(hours=6, minutes=4))
    with pytest.raises(AttestationRefused, match="expired at"):
        check.verify(document, vm_id=WEB_0["vmId"], nonce="1234567890", at=NOW + timedelta(hours=6, minutes=6))


def test_a_far_future_document_is_refused(documents: AttestedDocuments) -> None:
    signer = documents.signer()
    long_lived = signed(signer, content(WEB_0["vmId"], "1234567890", NOW, timedelta(days=3650)))
    with pytest.raises(AttestationRefused, match="longer than IMDS gives"):
        verifier().verify(long_lived, vm_id=WEB_0["vmId"], nonce="1234567890", at=NOW)
    from_the_future = signed(signer, content(WEB_0["vmId"], "1234567890", NOW + timedelta(hours=1), timedelta(hours=1)))
    with pytest.raises(AttestationRefused, match=r"ahead\): a clock far off"):
        verifier().verify(from_the_future, vm_id=WEB_0["vmId"], nonce="1234567890", at=NOW)


def test_what_is_not_a_pkcs7_is_refused_saying_so() -> None:
    not_pkcs7 = base64.b64encode(b"\x30\x03\x02\x01\x01").decode()
    for signature, message in (("not base64!", "not base64"), (not_pkcs7, "PKCS7")):
        with pytest.raises(AttestationError, match=message):
            verifier().verify(Attestation(encoding="pkcs7", signature=signature), vm_id="x", nonce="1", at=NOW)


# Microsoft's sample answer (Azure Instance Metadata Service docs, "Get Attested data"): a test certificate of its own.
DOCS_SAMPLE = (Path(__file__).parent / "data" / "imds-attested-sample.txt").read_text().strip()


def test_microsofts_documented_sample_reads_as_azure_writes_it_and_is_not_trusted() -> None:
    sample = Attestation(encoding="pkcs7", signature=DOCS_SAMPLE)
    assert read_content(sample).nonce == "1234566766"
    assert read_content(sample).created_on() == datetime(2018, 11, 20, 22, 7, 39, tzinfo=UTC)
    # Its signature verifies with the certificate it carries, but that certificate (a test one, self-signed, MD5,
    # naming its host only in the subject) is not a signer of the domain.
    with pytest.raises(AttestationRefused, match="not by a certificate of"):
        verifier(signer_domain="metadata.azure.com").signed(sample)


def test_the_shipped_azure_roots_are_the_ones_named() -> None:
    text = AZURE_IMDS_ROOTS.read_text()
    certificates = x509.load_pem_x509_certificates(text.encode())
    named = set(re.findall(r"SHA-256 ([0-9a-f]{64})", text))
    assert (
        {c.fingerprint(hashes.SHA256()).hex() for c in certificates}
        == named
        == {
            "cb3ccbb76031e5e0138f8dd39a23f9de47ffc35e43c1144cea27d46a5ab1cb5f",  # DigiCert Global Root G2
            "31ad6648f8104138c738f39ea4320133393e3a18cc02296ef97c2ac9ef6731d0",  # DigiCert Global Root G3
            "c741f70f4b2a8d88bf2e71c14122ef53ef10eba0cfa5e64cfa20f418853073e0",  # Microsoft RSA Root CA 2017
            "358df39d764af9e1b766e9c972df352ee15cfac227af6ad1d70e8e4a6edcba02",  # Microsoft ECC Root CA 2017
        }
    )


# --- what the coordinator accepts -----------------------------------------------------------------------------


def attested_envelope(
    documents: AttestedDocuments,
    identity: dict[str, Any],
    *,
    signed_for: dict[str, Any] | None = None,
    state: str = STATE,
) -> Envelope:
    data = envelope(identity, sequence=1, incarnation=1)
    data["stateId"] = state
    data["attestation"] = documents.document(signed_for or identity, nonce=state_nonce(state), now=NOW)
    return Envelope.model_validate(data)


def test_an_attested_envelope_is_accepted_and_binds_its_name_to_its_vm(documents: AttestedDocuments) -> None:
    store, attestations = MemoryStateStore(), Attestations(verifier())
    assert envelope_problem(attestations, store, attested_envelope(documents, WEB_0), at=NOW, required=True) == ""
    assert store.claimed(f"vm-resource:{WEB_0['resourceId'].lower()}") == WEB_0["vmId"]
    assert store.claimed(f"vm-id:{WEB_0['vmId']}") == WEB_0["resourceId"].lower()


def test_an_instance_keeps_the_bindings_of_a_fleet_of_100k_vms() -> None:
    # Four bindings a VM: 400,000 for 100,000 VMs, none forgotten and read again.
    cache = Attestations(verifier()).bindings
    prefix = "vm-resource:/subscriptions/s/resourcegroups/g/providers/microsoft.compute/virtualmachines/vm"
    for n in range(100_000):
        for name, value in ((f"{prefix}{n}", f"id-{n}"), (f"vm-id:id-{n}", f"vm{n}")):
            remember(cache, name, value)
            remember(cache, name.replace("vm-", "vm-name-", 1), value)
    assert cache.get(f"{prefix}0") == "id-0"
    assert cache.get("vm-id:id-0") == "vm0"
    assert cache.get(f"{prefix}99999") == "id-99999"
    assert len(cache) == 400_000


def test_an_unattested_envelope_is_refused_when_required_and_taken_when_not(documents: AttestedDocuments) -> None:
    store, attestations = MemoryStateStore(), Attestations(verifier())
    plain = Envelope.model_validate({**envelope(WEB_0, sequence=1, incarnation=1), "stateId": STATE})
    problem = envelope_problem(attestations, store, plain, at=NOW, required=True)
    assert problem.startswith("unattested")
    assert "COORDINATOR_REQUIRE_ATTESTATION" in problem
    assert STATE not in problem
    assert envelope_problem(attestations, store, plain, at=NOW, required=False) == ""
    # Once web_0 attested, its name is protected from unattested envelopes of another VM even with the setting off.
    envelope_problem(attestations, store, attested_envelope(documents, WEB_0), at=NOW, required=True)
    impostor = Envelope.model_validate(
        {**envelope({**WEB_0, "vmId": WEB_1["vmId"]}, sequence=1, incarnation=1), "stateId": "other"}
    )
    assert "another VM speaks under its name" in envelope_problem(attestations, store, impostor, at=NOW, required=False)


def test_a_vm_cannot_speak_under_another_vms_name_with_its_own_document(documents: AttestedDocuments) -> None:
    store, attestations = MemoryStateStore(), Attestations(verifier())
    for identity in (WEB_0, WEB_1):
        assert (
            envelope_problem(attestations, store, attested_envelope(documents, identity), at=NOW, required=True) == ""
        )
    # web_1, with a document IMDS really signed for web_1, claims web_0's name (and its resource id as partition key).
    as_web_0 = attested_envelope(documents, {**WEB_0, "vmId": WEB_1["vmId"]}, signed_for=WEB_1, state="forger")
    problem = envelope_problem(attestations, store, as_web_0, at=NOW, required=True)
    assert "speaks under another VM's name" in problem
    # ...or web_0's vmId: IMDS signed web_1's.
    with_web_0s_id = attested_envelope(documents, WEB_0, signed_for=WEB_1, state="forger")
    assert "not of VM" in envelope_problem(attestations, store, with_web_0s_id, at=NOW, required=True)
    # A fresh store (another instance): the bindings are read, not only remembered.
    fresh = Attestations(verifier())
    assert "speaks under another VM's name" in envelope_problem(fresh, store, as_web_0, at=NOW, required=True)
    assert store.claimed(f"vm-resource:{WEB_0['resourceId'].lower()}") == WEB_0["vmId"]


def test_a_name_first_claimed_by_an_impostor_binds_nothing_of_the_real_vm(documents: AttestedDocuments) -> None:
    """web_1 speaks first under web_0's name: its own name and vmId are bound already, so it is refused and binds
    nothing; web_0's forwarder is then accepted under its own name."""
    store, attestations = MemoryStateStore(), Attestations(verifier())
    envelope_problem(attestations, store, attested_envelope(documents, WEB_1), at=NOW, required=True)
    as_web_0 = attested_envelope(documents, {**WEB_0, "vmId": WEB_1["vmId"]}, signed_for=WEB_1, state="forger")
    assert envelope_problem(attestations, store, as_web_0, at=NOW, required=True) != ""
    assert store.claimed(f"vm-resource:{WEB_0['resourceId'].lower()}") is None
    assert envelope_problem(attestations, store, attested_envelope(documents, WEB_0), at=NOW, required=True) == ""


def test_an_answer_proves_its_vm_and_its_decision(documents: AttestedDocuments) -> None:
    attestations = Attestations(verifier())
    answer = ApprovalResult(outcome="approved", eventId="E", decisionId="d-1")

    def proven(identity: dict[str, Any], nonce: str) -> ApprovalResult:
        return answer.model_copy(update={"attestation": attested(documents, identity, nonce)})

    check = {"vm_id": WEB_0["vmId"], "decision_id": "d-1", "at": NOW, "required": True}
    assert answer_problem(attestations, proven(WEB_0, decision_nonce("d-1")), **check) == ""
    assert "not of VM" in answer_problem(attestations, proven(WEB_1, decision_nonce("d-1")), **check)
    assert "another forwarder state or decision" in answer_problem(
        attestations, proven(WEB_0, state_nonce("d-1")), **check
    )
    assert "no attested document" in answer_problem(attestations, answer, **check)
    assert answer_problem(attestations, answer, **{**check, "required": False}) == ""


def test_an_answer_from_another_instance_is_sent_again_at_once(documents: AttestedDocuments) -> None:
    """Another instance listens on web_0's hybrid connection and answers "approved" with its own proof: the approval
    goes again at once, and the answer of web_0's listener is the one recorded; an approval answered only by
    impostors is a failed delivery, retried later (issue 21 item 5)."""
    attestations = Attestations(verifier())
    request = ApprovalRequest(
        eventId="E", decisionId="d-1", rule="r", issuedAt=NOW, expiresAt=NOW + timedelta(minutes=15)
    )
    web_0 = VmIdentity.model_validate(WEB_0)

    def answer(identity: dict[str, Any]) -> ApprovalResult:
        proof = attested(documents, identity, decision_nonce("d-1"))
        return ApprovalResult(outcome="approved", eventId="E", decisionId="d-1", attestation=proof)

    def proof(result: ApprovalResult) -> str:
        return answer_problem(attestations, result, vm_id=web_0.vmId, decision_id="d-1", at=NOW, required=True)

    relay = AnswersInTurn([answer(WEB_1), answer(WEB_1), answer(WEB_0)])
    result = send(relay, request, web_0, "", proof, within=30)
    assert relay.sent == 3
    assert result.attestation is not None
    assert proof(result) == ""
    impostors = AnswersInTurn([answer(WEB_1) for _ in range(PROOF_ATTEMPTS)])
    with pytest.raises(ApprovalDeliveryError, match="did not prove they came from web_0"):
        send(impostors, request, web_0, "", proof, within=30)
    assert impostors.sent == PROOF_ATTEMPTS


@settings(max_examples=300, deadline=None)
@given(
    moment=st.datetimes(min_value=datetime(1969, 1, 1), max_value=datetime(2068, 12, 31)),
    offset=st.sampled_from(["-0000", "+0000", "+0130", "-0800"]),
)
def test_a_timestamp_reads_as_strptime_reads_it(moment: datetime, offset: str) -> None:
    """IMDS's own form is read without strptime (the cold wave's cost); every form reads as strptime reads it."""
    written = moment.strftime("%m/%d/%y %H:%M:%S ") + offset
    assert parse_timestamp(written, "createdOn") == datetime.strptime(written, "%m/%d/%y %H:%M:%S %z").astimezone(UTC)
    exact = moment.replace(microsecond=0, tzinfo=UTC)
    assert parse_timestamp(format_timestamp(exact), "createdOn") == exact


@pytest.mark.parametrize("written", ["13/01/20 00:00:00 -0000", "02/30/20 00:00:00 -0000", "01/01/20 00:00:60 -0000"])
def test_a_timestamp_that_is_no_time_is_refused(written: str) -> None:
    with pytest.raises(AttestationError, match="is not IMDS's"):
        parse_timestamp(written, "createdOn")
