"""The IMDS emulator's attested data over real HTTP: Azure's request rules and errors, Azure's document shape, and a
signature a verifier chains to the emulator's root through the CA Issuers URL, as it does to Microsoft's in Azure."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from datetime import timedelta

import pytest
import requests
from asn1crypto import cms
from cryptography import x509

from contracts.attestation import Attestation, read_content, signed_content, state_nonce
from coordinator.adapters.issuers import AiaIssuers
from coordinator.domain.attestation import AttestationVerifier, TrustAnchors
from emulators.imds import ImdsEmulator, ManualClock, Scenario
from emulators.imds.attested import ISSUER_PATH, ROOT_PATH

ATTESTED = "/metadata/attested/document"
META = {"Metadata": "true"}
SCENARIO = Scenario.model_validate({"vms": [{"name": "web_0"}, {"name": "web_1"}]})


@pytest.fixture
def imds() -> Iterator[ImdsEmulator]:
    with ImdsEmulator(scenario=SCENARIO, throttle_rps=0, clock=ManualClock()) as emulator:
        yield emulator


def get(
    imds: ImdsEmulator, query: str, *, vm: str = "web_0", headers: dict[str, str] | None = None
) -> requests.Response:
    return requests.get(f"{imds.url_for(vm)}{ATTESTED}{query}", headers=META if headers is None else headers, timeout=5)


def test_the_document_is_azures_shape_signing_the_vm_and_the_nonce(imds: ImdsEmulator) -> None:
    nonce = state_nonce("a-state")
    answer = get(imds, f"?api-version=2021-02-01&nonce={nonce}", vm="web_1")

    assert answer.status_code == 200
    body = answer.json()
    assert set(body) == {"encoding", "signature"}
    assert body["encoding"] == "pkcs7"
    content = read_content(Attestation.model_validate(body))
    vm = imds.state.vms["web_1"]
    assert (content.vmId, content.nonce, content.subscriptionId) == (vm.vmId, nonce, vm.subscriptionId)
    assert content.created_on() == imds.clock.now().replace(microsecond=0)
    assert content.expires_on() - content.created_on() == timedelta(hours=6)
    # Azure's quirks: no signed attributes, the digest named sha256WithRSAEncryption, the signer's certificate
    # alone, the content as compact JSON with IMDS's timestamp notation.
    signed = cms.ContentInfo.load(base64.b64decode(body["signature"]))["content"]
    signer = signed["signer_infos"][0]
    assert not signer["signed_attrs"].native
    assert signer["digest_algorithm"]["algorithm"].dotted == "1.2.840.113549.1.1.11"
    assert len(signed["certificates"]) == 1
    raw = json.loads(signed_content(base64.b64decode(body["signature"])))
    assert set(raw) == {"licenseType", "nonce", "plan", "sku", "subscriptionId", "timeStamp", "vmId"}
    assert raw["timeStamp"]["createdOn"].endswith(" -0000")


def test_without_a_nonce_imds_signs_the_time(imds: ImdsEmulator) -> None:
    content = read_content(Attestation.model_validate(get(imds, "?api-version=2018-10-01").json()))
    assert content.nonce == imds.clock.now().strftime("%Y%m%d-%H%M%S")


@pytest.mark.parametrize("nonce", ["123", "12345678901", "abcdefghij", "12345 7890", ""])
def test_a_nonce_that_is_not_ten_digits_is_refused(imds: ImdsEmulator, nonce: str) -> None:
    answer = get(imds, f"?api-version=2021-02-01&nonce={nonce}")
    assert answer.status_code == 400
    assert "10 digits" in answer.json()["error"]


def test_two_nonces_are_refused(imds: ImdsEmulator) -> None:
    answer = get(imds, "?api-version=2021-02-01&nonce=1234567890&nonce=0987654321")
    assert answer.status_code == 400
    assert "duplicate query parameter" in answer.json()["error"]


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("", "api-version was not specified"),
        ("?api-version=", "api-version was not specified"),
        # The attested category came with 2018-10-01: an older instance version is not one of its versions.
        ("?api-version=2018-04-02", "api-version is invalid"),
        ("?api-version=2020-07-01", "api-version is invalid"),  # a Scheduled Events version, not an instance one
        ("?api-version=latest", "api-version is invalid"),
    ],
)
def test_api_version_errors_are_imds_errors(imds: ImdsEmulator, query: str, message: str) -> None:
    answer = get(imds, query)
    assert answer.status_code == 400
    assert message in answer.json()["error"]
    assert answer.json()["newest-versions"] == ["2023-07-01", "2023-03-01", "2023-01-01"]


def test_the_metadata_header_and_the_method_are_checked(imds: ImdsEmulator) -> None:
    assert get(imds, "?api-version=2021-02-01", headers={}).status_code == 400
    posted = requests.post(f"{imds.url}{ATTESTED}?api-version=2021-02-01", headers=META, timeout=5)
    assert posted.status_code == 405


def test_faults_apply_to_the_attested_endpoint(imds: ImdsEmulator) -> None:
    imds.inject_fault(kind="error-burst", count=1, status=503, vm="web_0", endpoint="attested")
    assert get(imds, "?api-version=2021-02-01").status_code == 503
    assert get(imds, "?api-version=2021-02-01").status_code == 200


def test_a_cached_answer_keeps_the_nonce_it_was_made_for() -> None:
    """Microsoft's docs warn that IMDS may answer from its cache with an earlier nonce."""
    clock = ManualClock()
    with ImdsEmulator(scenario=SCENARIO, throttle_rps=0, clock=clock, attested_cache_seconds=30) as imds:
        first = get(imds, "?api-version=2021-02-01&nonce=1111111111").json()
        cached = get(imds, "?api-version=2021-02-01&nonce=2222222222").json()
        clock.advance(31)
        fresh = get(imds, "?api-version=2021-02-01&nonce=2222222222").json()
    assert cached == first
    assert read_content(Attestation.model_validate(fresh)).nonce == "2222222222"


def test_a_verifier_trusting_the_emulators_root_verifies_through_the_ca_issuers_url(imds: ImdsEmulator) -> None:
    root = x509.load_pem_x509_certificate(requests.get(imds.url + ROOT_PATH, timeout=5).content)
    issuers = AiaIssuers([imds.url + "/_emulator/pki/"])
    verifier = AttestationVerifier(TrustAnchors(roots=(root,)), issuers=issuers)
    nonce = state_nonce("s")
    attestation = Attestation.model_validate(get(imds, f"?api-version=2021-02-01&nonce={nonce}").json())

    attested = verifier.verify(attestation, vm_id=imds.state.vms["web_0"].vmId, nonce=nonce, at=imds.clock.now())

    assert attested.signer == "emulator.metadata.azure.com"
    signer = x509.load_der_x509_certificate(
        cms.ContentInfo.load(attestation.der())["content"]["certificates"][0].chosen.dump()
    )
    aia = signer.extensions.get_extension_for_class(x509.AuthorityInformationAccess).value
    assert [str(a.access_location.value) for a in aia] == [imds.url + ISSUER_PATH]


@pytest.mark.parametrize("size", [0, 1, 127, 128, 255, 256, 1000, 65535, 65536, 70000])
def test_the_signed_data_is_asn1cryptos_encoding_of_it_for_every_length_form(size: int) -> None:
    """The signer sets the content and the signature in a frame encoded once: the bytes must be what asn1crypto
    encodes for the whole (short, one-byte, two-byte and three-byte lengths at every level)."""
    from asn1crypto import x509 as asn1_x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import padding

    from emulators.imds.attested import _AZURE_DIGEST_OID, default_authority

    signer = default_authority().signer(issuer_url="http://127.0.0.1:1/issuer.cer")
    content = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
    certificate = asn1_x509.Certificate.load(signer.certificate.public_bytes(serialization.Encoding.DER))
    algorithm = {"algorithm": _AZURE_DIGEST_OID, "parameters": None}
    signature = signer.key.sign(content, padding.PKCS1v15(), hashes.SHA256())  # PKCS#1 v1.5: the same each time
    expected = cms.ContentInfo(
        {
            "content_type": "signed_data",
            "content": cms.SignedData(
                {
                    "version": "v1",
                    "digest_algorithms": [algorithm],
                    "encap_content_info": {"content_type": "data", "content": content},
                    "certificates": [certificate],
                    "signer_infos": [
                        {
                            "version": "v1",
                            "sid": cms.SignerIdentifier(
                                name="issuer_and_serial_number",
                                value={"issuer": certificate.issuer, "serial_number": certificate.serial_number},
                            ),
                            "digest_algorithm": algorithm,
                            "signature_algorithm": {"algorithm": "rsassa_pkcs1v15", "parameters": None},
                            "signature": signature,
                        }
                    ],
                }
            ),
        }
    ).dump()
    assert signer.sign(content) == expected
    assert cms.ContentInfo.load(expected)["content"]["encap_content_info"]["content"].native == content
