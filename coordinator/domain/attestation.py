"""Verifying IMDS attested documents: which VM (vmId) signed what (the nonce), when, under whose key.

An attested document (contracts/attestation.py) is a PKCS7 SignedData from IMDS. It proves something only if:

1. the signature over its content verifies with the signing certificate it carries (Azure's documents have no
   signed attributes and sign the content itself; signed attributes, if a document has them, are checked too);
2. that certificate names a host of the configured signer domain (``*.metadata.azure.com`` in Azure's public
   cloud; ``metadata.azure.us``, ``metadata.azure.cn`` in the sovereign ones) and chains, at the document's
   creation time, to a configured root: Microsoft's in Azure, the IMDS emulator's own locally (``TrustAnchors``).
   The PKCS7 holds only the signing certificate: its issuer comes from the configured intermediates or, failing
   those, from ``IssuerSource`` (coordinator/adapters/issuers.py fetches the certificate's CA Issuers URL, only
   from allowed prefixes); a fetched certificate is trusted only if it chains to a root;
3. its vmId, nonce and validity are the expected ones (``AttestationVerifier.verify``): the nonce ties the document
   to one forwarder state or one decision, so a document made for anything else proves nothing here.

Pure apart from the injected ``IssuerSource``; verified signatures are cached by their bytes (a forwarder sends the
same document with every envelope until it renews it), and a signing certificate's chain once proven holds for every
document created within that chain's validity (a fleet's documents share a few signers: a cold wave of 10,000 VMs
builds one chain, not 10,000). Whatever fails while a document is read or checked, however
deep in the DER (asn1crypto and cryptography parse parts only when they are first used), is an
``AttestationRefused`` saying what could not be read: a document is evidence, and evidence that cannot be read
proves nothing, so it never raises anything else.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from asn1crypto import cms as asn1_cms
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.x509 import DNSName
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from contracts.attestation import Attestation, AttestationError, AttestedContent, signed_content
from coordinator.domain.bindings import BindingBacklog, BindingCache
from coordinator.domain.lru import Lru

__all__ = [
    "AttestationRefused",
    "AttestationVerifier",
    "Attestations",
    "Attested",
    "IssuerSource",
    "TrustAnchors",
    "load_pem_certificates",
]

# Clocks of the VM, IMDS, Event Hubs and the coordinator disagree by seconds; this is generous for them and still
# short beside a document's life.
CLOCK_SKEW = timedelta(minutes=5)
# A document valid longer than this is not one IMDS gives (its documents live from seconds to a few hours).
MAX_VALIDITY = timedelta(hours=24)
# Verified documents kept: one a VM (a forwarder sends the same document until it renews it), for a fleet of 100,000.
# Fewer than the fleet, a wave evicted each VM's document before its VM spoke again and verified every one again.
CACHE_SIZE = 100_000
# Signing certificates (and the chains proven for them) kept: IMDS signs with one certificate per region and cloud,
# renewed a few times a year; a fleet meets a handful.
CERTIFICATES_KEPT = 64

# What a SignerInfo may name as its digest: the digests, and (as Azure writes it) sha256WithRSAEncryption.
_DIGESTS: dict[str, hashes.HashAlgorithm] = {
    "2.16.840.1.101.3.4.2.1": hashes.SHA256(),
    "2.16.840.1.101.3.4.2.2": hashes.SHA384(),
    "2.16.840.1.101.3.4.2.3": hashes.SHA512(),
    "1.2.840.113549.1.1.11": hashes.SHA256(),
    "1.2.840.113549.1.1.12": hashes.SHA384(),
    "1.2.840.113549.1.1.13": hashes.SHA512(),
}

IssuerSource = Callable[[x509.Certificate], Sequence[x509.Certificate]]


class AttestationRefused(AttestationError):
    """The document does not prove what it must; the message says what and, where it helps, what to check."""


def load_pem_certificates(data: bytes, what: str) -> tuple[x509.Certificate, ...]:
    try:
        certificates = tuple(x509.load_pem_x509_certificates(data))
    except ValueError as error:
        raise ValueError(f"{what} is not a PEM bundle of certificates: {error}") from error
    return certificates


@dataclass(frozen=True)
class TrustAnchors:
    """The roots an attested document must chain to, intermediates known ahead, and the signer's DNS domain."""

    roots: tuple[x509.Certificate, ...]
    intermediates: tuple[x509.Certificate, ...] = ()
    signer_domain: str = "metadata.azure.com"

    def __post_init__(self) -> None:
        if not self.roots:
            raise ValueError("attestation trust anchors need at least one root certificate")

    def signer_name(self, certificate: x509.Certificate) -> str | None:
        """The certificate's DNS name within the signer domain (None: it is not a signer of that domain)."""
        try:
            names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except x509.ExtensionNotFound:
            return None
        domain = self.signer_domain.lower()
        for name in names.get_values_for_type(x509.DNSName):
            lowered = name.lower()
            if lowered == domain or lowered.endswith("." + domain):
                return name
        return None


@dataclass(frozen=True)
class Attested:
    """What a verified document says."""

    vm_id: str
    nonce: str
    created_on: datetime
    expires_on: datetime
    subscription_id: str
    signer: str


def _unreadable(what: str, error: Exception) -> AttestationRefused:
    return AttestationRefused(f"{what} cannot be read: {type(error).__name__}: {str(error)[:200]}")


def _certificate(der: bytes, what: str) -> x509.Certificate:
    """A carried certificate, every part of it read now: cryptography reads extensions only when first asked for
    them, so a damaged one (a byte changed inside its Authority Information Access) is refused here as this
    certificate's, not raised later from the signer-name or chain check."""
    try:
        return _load_certificate(der)
    except Exception as error:
        raise _unreadable(what, error) from error


@functools.lru_cache(maxsize=CERTIFICATES_KEPT)
def _load_certificate(der: bytes) -> x509.Certificate:
    # Every document of a region carries the same signing certificate: read once, not once per VM (a failure is
    # raised again each time: lru_cache keeps only what returned).
    certificate = x509.load_der_x509_certificate(der)
    for extension in certificate.extensions:
        _ = extension.value
    return certificate


@dataclass(frozen=True)
class _Carried:
    """A certificate a PKCS7 carries: what a SignerInfo names it by, and its DER."""

    issuer: bytes
    serial: int
    key_id: bytes | None
    der: bytes


# The certificate sets read, by their DER: every document one region's IMDS signs carries the same set, and reading it
# (issuer, serial number, key identifier of each certificate) was more than half of a document's first verification.
_carried_sets: Lru[bytes, tuple[_Carried, ...]] = Lru(CERTIFICATES_KEPT)


def _carried(certificates: asn1_cms.CertificateSet) -> tuple[_Carried, ...]:
    key = certificates.contents or b""
    if (hit := _carried_sets.get(key)) is not None:
        return hit
    found = tuple(
        _Carried(c.chosen.issuer.dump(), c.chosen.serial_number, c.chosen.key_identifier, c.chosen.dump())
        for c in certificates
        if c.name == "certificate"
    )
    _carried_sets.put(key, found)
    return found


def _signer_info(der: bytes) -> tuple[bytes, x509.Certificate, tuple[x509.Certificate, ...]]:
    """(content, signing certificate, other certificates carried) of a SignedData whose signature verifies."""
    try:
        return _read_signer_info(der)
    except AttestationError:
        raise
    except Exception as error:  # asn1crypto parses each part when first used: any of them may be damaged
        raise _unreadable("the PKCS7", error) from error


def _read_signer_info(der: bytes) -> tuple[bytes, x509.Certificate, tuple[x509.Certificate, ...]]:
    info = asn1_cms.ContentInfo.load(der, strict=True)
    if info["content_type"].native != "signed_data":
        raise AttestationRefused("the PKCS7 is not a SignedData")
    signed = info["content"]
    content = signed_content(der)
    carried = _carried(signed["certificates"])
    signer_infos = list(signed["signer_infos"])
    if len(signer_infos) != 1:
        raise AttestationRefused(f"the PKCS7 has {len(signer_infos)} signers; IMDS signs with one")
    signer_info = signer_infos[0]
    sid = signer_info["sid"]
    if sid.name == "issuer_and_serial_number":
        wanted = (sid.chosen["issuer"].dump(), sid.chosen["serial_number"].native)
        chosen = [c for c in carried if (c.issuer, c.serial) == wanted]
    else:
        chosen = [c for c in carried if c.key_id == sid.chosen.native]
    if not chosen:
        raise AttestationRefused("the PKCS7 does not carry the certificate that signed it")
    certificate = _certificate(chosen[0].der, "the signing certificate")
    others = tuple(_certificate(c.der, "a certificate the PKCS7 carries") for c in carried if c is not chosen[0])
    digest = _DIGESTS.get(signer_info["digest_algorithm"]["algorithm"].dotted)
    if digest is None:
        raise AttestationRefused(
            f"digest algorithm {signer_info['digest_algorithm']['algorithm'].dotted} is not one IMDS uses"
        )
    signed_bytes = content
    attributes = signer_info["signed_attrs"]
    try:
        values = {a["type"].native: a["values"][0].native for a in attributes} if attributes.native else None
    except Exception as error:  # e.g. the message digest written as an INTEGER, not an OCTET STRING
        raise _unreadable("the signed attributes", error) from error
    if values is not None:
        if values.get("content_type") != "data":
            raise AttestationRefused("the signed attributes do not name the content as data")
        hasher = hashes.Hash(digest)
        hasher.update(content)
        if values.get("message_digest") != hasher.finalize():
            raise AttestationRefused("the content's digest is not the one that was signed")
        # The signature covers the attributes as a SET, not as the [0] they are written with.
        signed_bytes = attributes.untag().dump(force=True)
    _check_signature(certificate, bytes(signer_info["signature"].native), signed_bytes, digest)
    return content, certificate, others


def _check_signature(
    certificate: x509.Certificate, signature: bytes, data: bytes, digest: hashes.HashAlgorithm
) -> None:
    key = certificate.public_key()
    try:
        if isinstance(key, rsa.RSAPublicKey):
            key.verify(signature, data, padding.PKCS1v15(), digest)
        elif isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(signature, data, ec.ECDSA(digest))
        else:
            raise AttestationRefused(f"the signing key is a {type(key).__name__}, not RSA or EC")
    except InvalidSignature as error:
        raise AttestationRefused(
            "the signature does not verify: the document was changed or not signed by IMDS"
        ) from error


class AttestationVerifier:
    """Verifies attested documents against ``anchors``; thread-safe (approval answers are read on many threads)."""

    def __init__(
        self,
        anchors: TrustAnchors,
        *,
        issuers: IssuerSource | None = None,
        skew: timedelta = CLOCK_SKEW,
        max_validity: timedelta = MAX_VALIDITY,
    ) -> None:
        self.anchors = anchors
        self._issuers = issuers
        self.skew = skew
        self.max_validity = max_validity
        self._store = Store(list(anchors.roots))
        self._cache: Lru[bytes, Attested] = Lru(CACHE_SIZE)
        # (signing certificate's SHA-256, its signer name) -> the window in which its proven chain is valid
        self._chains: Lru[tuple[bytes, str], tuple[datetime, datetime]] = Lru(CERTIFICATES_KEPT)

    def signed(self, attestation: Attestation) -> Attested:
        """What the document says, once its signature and its signer's chain are verified (no expectation checked:
        see ``verify``)."""
        key = hashlib.sha256(attestation.signature.encode()).digest()
        if (hit := self._cache.get(key)) is not None:
            return hit
        try:
            attested = self._verify_signed(attestation)
        except AttestationError:
            raise
        except Exception as error:  # whatever else a damaged document breaks: refused, never raised on
            raise _unreadable("the document", error) from error
        self._cache.put(key, attested)
        return attested

    def verify(self, attestation: Attestation, *, vm_id: str, nonce: str, at: datetime) -> Attested:
        """The document, verified, for VM ``vm_id`` with ``nonce``, valid at ``at`` (within the clock skew), and not
        valid for longer than IMDS makes documents valid. Raises ``AttestationRefused`` saying what failed."""
        attested = self.signed(attestation)
        if attested.vm_id.lower() != vm_id.lower():
            raise AttestationRefused(f"the document is IMDS's of VM {attested.vm_id}, not of VM {vm_id}")
        if attested.nonce != nonce:
            raise AttestationRefused(
                f"the document signs nonce {attested.nonce!r}, not {nonce!r}: it was made for another forwarder "
                "state or decision (or IMDS answered from its cache)"
            )
        if attested.expires_on <= attested.created_on or attested.expires_on - attested.created_on > self.max_validity:
            raise AttestationRefused(
                f"the document claims validity from {attested.created_on.isoformat()} to "
                f"{attested.expires_on.isoformat()}, longer than IMDS gives ({self.max_validity}): not IMDS's"
            )
        if attested.created_on > at + self.skew:
            raise AttestationRefused(
                f"the document was created at {attested.created_on.isoformat()}, after {at.isoformat()} (more than "
                f"{self.skew} ahead): a clock far off, or not IMDS's"
            )
        if at > attested.expires_on + self.skew:
            raise AttestationRefused(
                f"the document expired at {attested.expires_on.isoformat()} (checked at {at.isoformat()}): the "
                "forwarder must attest again before its document expires"
            )
        return attested

    def _verify_signed(self, attestation: Attestation) -> Attested:
        content_bytes, certificate, carried = _signer_info(attestation.der())
        try:
            content = AttestedContent.model_validate_json(content_bytes)
        except ValueError as error:
            raise AttestationRefused(
                f"the signed content is not IMDS's attested document: {str(error)[:200]}"
            ) from error
        created, expires = content.created_on(), content.expires_on()
        name = self.anchors.signer_name(certificate)
        if name is None:
            raise AttestationRefused(
                f"signed by {certificate.subject.rfc4514_string()[:200]}, not by a certificate of "
                f"*.{self.anchors.signer_domain} (COORDINATOR_ATTESTATION_SIGNER_DOMAIN)"
            )
        self._chained(certificate, name, carried, created)
        return Attested(
            vm_id=content.vmId,
            nonce=content.nonce,
            created_on=created,
            expires_on=expires,
            subscription_id=content.subscriptionId,
            signer=name,
        )

    def _chained(
        self, certificate: x509.Certificate, name: str, carried: Sequence[x509.Certificate], at: datetime
    ) -> None:
        """That ``certificate`` chains, at ``at``, to a root as a server certificate for ``name``. A chain once proven
        is proven at any time within the validity of each of its certificates (nothing else in the check depends
        on the time), so a signer met again costs no path building and no issuer fetch."""
        key = (certificate.fingerprint(hashes.SHA256()), name)
        window = self._chains.get(key)
        if window is not None and window[0] <= at <= window[1]:
            return
        known = (*self.anchors.intermediates, *carried)
        try:
            chain = self._chain(certificate, name, known, at)
        except VerificationError as first:
            if self._issuers is None:
                raise AttestationRefused(self._untrusted(name, first)) from first
            fetched = tuple(self._issuers(certificate))
            try:
                chain = self._chain(certificate, name, (*known, *fetched), at)
            except VerificationError as error:
                raise AttestationRefused(self._untrusted(name, error)) from error
        proven = (max(c.not_valid_before_utc for c in chain), min(c.not_valid_after_utc for c in chain))
        self._chains.put(key, proven)

    def _chain(
        self, certificate: x509.Certificate, name: str, intermediates: Sequence[x509.Certificate], at: datetime
    ) -> list[x509.Certificate]:
        verifier = PolicyBuilder().store(self._store).time(at).build_server_verifier(DNSName(name))
        return verifier.verify(certificate, list(intermediates))

    def _untrusted(self, name: str, error: VerificationError) -> str:
        return (
            f"the signing certificate {name} does not chain to a configured root ({str(error)[:200]}): check "
            "COORDINATOR_ATTESTATION_TRUST_ANCHORS (Microsoft's roots in Azure, the IMDS emulator's locally) and "
            "the issuer URLs allowed"
        )


class Attestations:
    """The verifier, and the VM bindings this instance knows (pipeline/bindings.py), kept for the process."""

    def __init__(self, verifier: AttestationVerifier, bindings: BindingCache | None = None) -> None:
        self.verifier = verifier
        self.bindings = bindings if bindings is not None else BindingCache()
        # The claims of VMs ARM's census vouched for, written by the timer (pipeline/bindings.py).
        self.backlog = BindingBacklog()
