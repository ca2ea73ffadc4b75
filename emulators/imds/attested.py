"""The IMDS emulator's attested data: ``GET /metadata/attested/document``, signed the way Azure signs it, by a CA of
the emulator's own.

Azure's answer is ``{"encoding": "pkcs7", "signature": base64(DER)}``: a CMS SignedData holding the JSON document
(``nonce``, ``plan``, ``sku``, ``subscriptionId``, ``timeStamp`` {createdOn, expiresOn} as ``MM/DD/YY HH:MM:SS
-0000``, ``vmId``), with **no signed attributes** (the RSA signature is over the content itself, SHA-256), the
digest algorithm written as sha256WithRSAEncryption, and only the signing certificate (``*.metadata.azure.com``
in its SubjectAltName). The intermediate that issued it is not in the PKCS7: a verifier fetches it from the
certificate's Authority Information Access "CA Issuers" URL and chains it to a root it trusts (Microsoft's docs:
"Signature Validation Guidance"). The emulator does the same with its own chain: a root (``root_pem``: what a
coordinator is configured to trust locally, as it trusts Microsoft's roots in Azure), an issuing CA served at
``/_emulator/pki/issuer.cer`` (the leaf's CA Issuers URL), and a signing certificate for
``emulator.metadata.azure.com``.

Keys are RSA 2048 like Azure's, made once per process on first use (shared by the emulators of a test session);
each emulator has a signing certificate of its own, since it names that emulator's URL.
"""

from __future__ import annotations

import base64
import functools
import json
import threading
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from asn1crypto import cms as asn1_cms
from asn1crypto import x509 as asn1_x509
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509.oid import AuthorityInformationAccessOID, ExtendedKeyUsageOID, NameOID

from contracts.attestation import NONCE_PATTERN, format_timestamp

SIGNER_NAMES = ("emulator.metadata.azure.com", "metadata.azure.com")
ISSUER_PATH = "/_emulator/pki/issuer.cer"
ROOT_PATH = "/_emulator/pki/root.pem"
# Microsoft's sample documents show lifetimes from seconds to 6 hours; 6 hours is the documented sample's.
DEFAULT_VALIDITY_SECONDS = 6 * 3600.0
# The emulator's certificates are valid this long before they are made, so that a document dated by a test's
# hand-driven clock (emulators/imds/clock.py) still falls within them.
BACKDATED = timedelta(days=3650)
# sha256WithRSAEncryption, where CMS expects a digest algorithm: what Azure's attested documents carry.
_AZURE_DIGEST_OID = "1.2.840.113549.1.1.11"


class NonceError(ValueError):
    """A nonce IMDS would not sign."""


def check_nonce(nonce: str) -> None:
    if not NONCE_PATTERN.match(nonce):
        raise NonceError(f"nonce {nonce[:40]!r} is invalid: the nonce is an optional string of exactly 10 digits (0-9)")


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.COUNTRY_NAME, "US"),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "IMDS Emulator (not Microsoft)"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@functools.cache
def _signing_key() -> rsa.RSAPrivateKey:
    # One key for every emulator of the process (each has a certificate of its own): making an RSA key holds the
    # interpreter for a noticeable time, which an emulator running beside the code under test must not do often.
    return _key()


# What a CA's key may sign: certificates and CRLs (and its own signatures).
_CA_USAGE = x509.KeyUsage(
    digital_signature=True,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    key_cert_sign=True,
    crl_sign=True,
    encipher_only=False,
    decipher_only=False,
)


def _certificate(
    subject: x509.Name, issuer: x509.Name, key: rsa.RSAPublicKey, *, now: datetime, days: int
) -> x509.CertificateBuilder:
    """``key``'s certificate for ``subject`` by ``issuer``, valid from ``BACKDATED`` before ``now`` to ``days`` after
    it; the extensions are the caller's."""
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATED)
        .not_valid_after(now + timedelta(days=days))
    )


def _ca_certificate(
    name: x509.Name,
    key: rsa.RSAPrivateKey,
    *,
    by: tuple[x509.Name, rsa.RSAPrivateKey],
    days: int,
    path_length: int | None,
    now: datetime,
) -> x509.Certificate:
    """A CA's certificate: ``key``'s, named ``name``, signed by ``by`` (its CA's name and key; a root's own)."""
    issuer_name, issuer_key = by
    builder = (
        _certificate(name, issuer_name, key.public_key(), now=now, days=days)
        .add_extension(x509.BasicConstraints(ca=True, path_length=path_length), critical=True)
        .add_extension(_CA_USAGE, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    if issuer_key is not key:
        authority = x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key())
        builder = builder.add_extension(authority, critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


@dataclass(frozen=True)
class CertificateAuthority:
    """A root and an issuing CA: what signs the emulator's signing certificates."""

    root: x509.Certificate
    issuer: x509.Certificate
    issuer_key: rsa.RSAPrivateKey

    @classmethod
    def create(cls, *, label: str = "IMDS Emulator", now: datetime | None = None) -> CertificateAuthority:
        now = now or datetime.now(UTC)
        root_key, issuer_key = _key(), _key()
        root_name = _name(f"{label} Root CA")
        root = _ca_certificate(root_name, root_key, by=(root_name, root_key), days=3650, path_length=None, now=now)
        issuer = _ca_certificate(
            _name(f"{label} Issuing CA 01"), issuer_key, by=(root_name, root_key), days=1825, path_length=0, now=now
        )
        return cls(root=root, issuer=issuer, issuer_key=issuer_key)

    @property
    def root_pem(self) -> bytes:
        return self.root.public_bytes(serialization.Encoding.PEM)

    @property
    def issuer_der(self) -> bytes:
        return self.issuer.public_bytes(serialization.Encoding.DER)

    def signer(self, *, issuer_url: str, names: tuple[str, ...] = SIGNER_NAMES, now: datetime | None = None) -> Signer:
        """A signing certificate for ``names`` whose CA Issuers URL is ``issuer_url``."""
        now = now or datetime.now(UTC)
        key = _signing_key()
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])])
        certificate = (
            _certificate(subject, self.issuer.subject, key.public_key(), now=now, days=365)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=True,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name) for name in names]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.issuer_key.public_key()), critical=False
            )
            .add_extension(
                x509.AuthorityInformationAccess(
                    [
                        x509.AccessDescription(
                            AuthorityInformationAccessOID.CA_ISSUERS, x509.UniformResourceIdentifier(issuer_url)
                        )
                    ]
                ),
                critical=False,
            )
            .sign(self.issuer_key, hashes.SHA256())
        )
        return Signer(certificate=certificate, key=key)


@functools.cache
def default_authority() -> CertificateAuthority:
    """The process's emulator CA (made once: two RSA keys take a noticeable fraction of a second)."""
    return CertificateAuthority.create()


@dataclass(frozen=True)
class Signer:
    certificate: x509.Certificate
    key: rsa.RSAPrivateKey

    def sign(self, content: bytes) -> bytes:
        """A DER ContentInfo/SignedData of Azure's shape: the content, this certificate alone, no signed
        attributes, an RSA PKCS#1 v1.5 signature over the content with SHA-256.

        Only the content and the signature change from one document to the next: the rest is encoded once by
        asn1crypto (``_frame``) and the two are set in it here. Encoding the whole with asn1crypto each time took
        about 2 ms of CPU a document, as much as the RSA signature, in the process that serves it (a wave's
        listeners stand-in signs 500 answers in the coordinator's process). Test: the bytes are asn1crypto's, for
        content of every length form."""
        signature = self.key.sign(content, padding.PKCS1v15(), hashes.SHA256())
        version, digests, certificates, signer_head = self._frame
        encapsulated = _der(0x30, _DATA_OID + _der(0xA0, _der(0x04, content)))
        signer_info = _der(0x30, signer_head + _der(0x04, signature))
        signed_data = _der(0x30, version + digests + encapsulated + certificates + _der(0x31, signer_info))
        return _der(0x30, _SIGNED_DATA_OID + _der(0xA0, signed_data))

    @functools.cached_property
    def _frame(self) -> tuple[bytes, bytes, bytes, bytes]:
        """The parts of the SignedData that do not change, as asn1crypto encodes them: its version, its digest
        algorithms, its certificates and the signer info up to its signature."""
        certificate = asn1_x509.Certificate.load(self.certificate.public_bytes(serialization.Encoding.DER))
        algorithm = {"algorithm": _AZURE_DIGEST_OID, "parameters": None}
        signer_info = asn1_cms.SignerInfo(
            {
                "version": "v1",
                "sid": asn1_cms.SignerIdentifier(
                    name="issuer_and_serial_number",
                    value=asn1_cms.IssuerAndSerialNumber(
                        {"issuer": certificate.issuer, "serial_number": certificate.serial_number}
                    ),
                ),
                "digest_algorithm": algorithm,
                "signature_algorithm": {"algorithm": "rsassa_pkcs1v15", "parameters": None},
            }
        )
        signed_data = asn1_cms.SignedData(
            {"version": "v1", "digest_algorithms": [algorithm], "certificates": [certificate]}
        )
        head = b"".join(signer_info[f].dump() for f in ("version", "sid", "digest_algorithm", "signature_algorithm"))
        fields = (signed_data[f].dump() for f in ("version", "digest_algorithms", "certificates"))
        version, digests, certificates = fields
        return version, digests, certificates, head


_SIGNED_DATA_OID = bytes.fromhex("06092a864886f70d010702")  # 1.2.840.113549.1.7.2
_DATA_OID = bytes.fromhex("06092a864886f70d010701")  # 1.2.840.113549.1.7.1


def _der(tag: int, body: bytes) -> bytes:
    """One DER element: its tag, its length (short form below 128, else long), its body."""
    size = len(body)
    if size < 0x80:
        return bytes((tag, size)) + body
    length = size.to_bytes((size.bit_length() + 7) // 8, "big")
    return bytes((tag, 0x80 | len(length))) + length + body


class AttestedDocuments:
    """What the emulator's attested endpoint signs, per VM; thread-safe (the signing certificate is made on first
    use). ``cache_seconds`` > 0 makes it answer a VM with the document it signed last while that is younger,
    whatever nonce was asked, as Microsoft's docs warn IMDS may ("a previously cached nonce value might be
    returned"); 0 (default) signs every request anew."""

    def __init__(
        self,
        *,
        issuer_url: str,
        authority: CertificateAuthority | None = None,
        validity_seconds: float = DEFAULT_VALIDITY_SECONDS,
        cache_seconds: float = 0.0,
        signer: Signer | None = None,
    ) -> None:
        self.authority = authority or default_authority()
        self.issuer_url = issuer_url
        self.validity = timedelta(seconds=validity_seconds)
        self.cache = timedelta(seconds=cache_seconds)
        # ``signer``: sign as another emulator's signer does (its key and certificate, e.g. in another process).
        self._signer: Signer | None = signer
        self._lock = threading.Lock()
        self._last: dict[str, tuple[datetime, dict[str, str]]] = {}
        self.signed = 0

    def signer(self) -> Signer:
        with self._lock:
            if self._signer is None:
                self._signer = self.authority.signer(issuer_url=self.issuer_url)
            return self._signer

    def document(self, vm: dict[str, Any], *, nonce: str | None, now: datetime) -> dict[str, str]:
        """The answer for a VM (its compute metadata ``vm``) and the caller's nonce (None: IMDS signs the time)."""
        if nonce is not None:
            check_nonce(nonce)
        name = str(vm["name"])
        with self._lock:
            cached = self._last.get(name)
        if cached is not None and now - cached[0] < self.cache:
            return cached[1]
        content = {
            "licenseType": "",
            # Without a nonce, IMDS puts the time of the request in its place (e.g. "20201130-211924").
            "nonce": nonce if nonce is not None else now.astimezone(UTC).strftime("%Y%m%d-%H%M%S"),
            "plan": {"name": "", "product": "", "publisher": ""},
            "sku": str(vm.get("sku", "")),
            "subscriptionId": str(vm.get("subscriptionId", "")),
            "timeStamp": {"createdOn": format_timestamp(now), "expiresOn": format_timestamp(now + self.validity)},
            "vmId": str(vm["vmId"]),
        }
        body = json.dumps(content, separators=(",", ":")).encode()
        answer = {"encoding": "pkcs7", "signature": base64.b64encode(self.signer().sign(body)).decode("ascii")}
        with self._lock:
            self._last[name] = (now, answer)
            self.signed += 1
        return answer
