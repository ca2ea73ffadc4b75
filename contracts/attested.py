"""IMDS attested data, what needs no model: the nonces, IMDS's timestamps and the signed content of its PKCS7, read
with the standard library (the on-VM forwarder imports this without pydantic; contracts/attestation.py holds the
models and says what an attested document is).
"""

from __future__ import annotations

import hashlib
import re
from datetime import UTC, datetime

# The attested endpoint came with 2018-10-01; this version also signs subscriptionId and sku.
ATTESTED_API_VERSION = "2021-02-01"
NONCE_DIGITS = 10
NONCE_PATTERN = re.compile(r"^[0-9]{10}$")
# A PKCS7 of Azure's shape (content + the signing certificate) is about 2-3 KB of base64; this bounds what an
# envelope or an approval answer may carry.
MAX_SIGNATURE_CHARS = 16384
# IMDS writes its timestamps as "11/28/18 00:16:17 -0000" (month/day/two-digit year, UTC).
_TIMESTAMP_FORMAT = "%m/%d/%y %H:%M:%S %z"
# The same, as IMDS writes it (UTC): two-digit fields, as strptime's %y reads the year (69-99: the 1900s).
_IMDS_TIME = re.compile(r"([0-9]{2})/([0-9]{2})/([0-9]{2}) ([0-9]{2}):([0-9]{2}):([0-9]{2}) -0000")


class AttestationError(ValueError):
    """An attested document that cannot be read or does not say what it must (the message says which)."""


def _nonce(purpose: str, value: str) -> str:
    # A purpose per use, so that a document asked for one use is never the answer for another; the first 64 bits
    # of SHA-256, cut to the 10 digits IMDS takes (about 33 bits: a nonce names, it is not a secret).
    digest = hashlib.sha256(f"scheduled-events/{purpose}/v1\n{value}".encode()).digest()
    return str(int.from_bytes(digest[:8], "big") % 10**NONCE_DIGITS).zfill(NONCE_DIGITS)


def state_nonce(state_id: str) -> str:
    """The nonce a forwarder asks IMDS to sign for its state: binds ``stateId`` to the VM that holds it."""
    if not state_id:
        raise AttestationError("a forwarder state without a stateId cannot be attested")
    return _nonce("state", state_id)


def decision_nonce(decision_id: str) -> str:
    """The nonce a listener asks IMDS to sign when it answers an approval: proves which VM answered."""
    if not decision_id:
        raise AttestationError("an approval without a decisionId cannot be proven")
    return _nonce("decision", decision_id)


def format_timestamp(moment: datetime) -> str:
    """A time as IMDS writes it in the signed document (``11/28/18 00:16:17 -0000``)."""
    return moment.astimezone(UTC).strftime("%m/%d/%y %H:%M:%S -0000")


def parse_timestamp(value: str, what: str) -> datetime:
    # IMDS's own form is read directly: strptime took ~60 µs a call, two a document, and a wave of VMs new to the
    # coordinator verifies one document each. Any other form goes through strptime, as before.
    match = _IMDS_TIME.fullmatch(value)
    try:
        if match is not None:
            month, day, year, hour, minute, second = map(int, match.groups())
            return datetime(year + (2000 if year < 69 else 1900), month, day, hour, minute, second, tzinfo=UTC)
        return datetime.strptime(value, _TIMESTAMP_FORMAT).astimezone(UTC)
    except ValueError as error:
        raise AttestationError(f"timeStamp.{what} {value[:40]!r} is not IMDS's 'MM/DD/YY HH:MM:SS -0000'") from error


# A CMS ContentInfo (RFC 5652) holding a SignedData, read with the least DER it takes to reach the encapsulated
# content: the forwarder needs no ASN.1 library to read what it asked for (the coordinator parses it all).
_SEQUENCE, _SET, _OCTET_STRING, _OID, _INTEGER, _EXPLICIT_0 = 0x30, 0x31, 0x04, 0x06, 0x02, 0xA0
_SIGNED_DATA_OID = bytes.fromhex("2a864886f70d010702")  # 1.2.840.113549.1.7.2


def _tlv(data: bytes, offset: int, limit: int) -> tuple[int, int, int]:
    """(tag, start of value, end of value) of the DER element at ``offset``, which must end by ``limit`` (the end of
    the element that holds it): a length that reaches past its parent, or is not in DER's shortest form, is a
    document changed in transit or not IMDS's, whatever its signature says of the content."""
    if offset + 2 > limit:
        raise AttestationError("truncated PKCS7")
    tag, length = data[offset], data[offset + 1]
    start = offset + 2
    if length & 0x80:
        count = length & 0x7F
        if count == 0 or count > 4 or start + count > limit:
            raise AttestationError("PKCS7 is not DER (indefinite or oversized length)")
        length = int.from_bytes(data[start : start + count], "big")
        if length < 0x80 or data[start] == 0:
            raise AttestationError("PKCS7 is not DER (a length not in its shortest form)")
        start += count
    if start + length > limit:
        raise AttestationError("truncated PKCS7 (an element runs past the one that holds it)")
    return tag, start, start + length


def _expect(data: bytes, offset: int, tag: int, what: str, limit: int) -> tuple[int, int]:
    found, start, end = _tlv(data, offset, limit)
    if found != tag:
        raise AttestationError(f"PKCS7: {what} expected (tag {tag:#04x}), found tag {found:#04x}")
    return start, end


def signed_content(der: bytes) -> bytes:
    """The encapsulated content of a DER SignedData (not verified), each element read within the one that holds it."""
    start, end = _expect(der, 0, _SEQUENCE, "ContentInfo", len(der))
    oid_start, oid_end = _expect(der, start, _OID, "contentType", end)
    if der[oid_start:oid_end] != _SIGNED_DATA_OID:
        raise AttestationError("PKCS7 is not a SignedData")
    inner, inner_end = _expect(der, oid_end, _EXPLICIT_0, "content [0]", end)
    signed, signed_end = _expect(der, inner, _SEQUENCE, "SignedData", inner_end)
    _, after_version = _expect(der, signed, _INTEGER, "version", signed_end)
    _, after_digests = _expect(der, after_version, _SET, "digestAlgorithms", signed_end)
    encap, encap_end = _expect(der, after_digests, _SEQUENCE, "encapContentInfo", signed_end)
    _, after_type = _expect(der, encap, _OID, "eContentType", encap_end)
    explicit, explicit_end = _expect(der, after_type, _EXPLICIT_0, "eContent [0]", encap_end)
    value_start, value_end = _expect(der, explicit, _OCTET_STRING, "eContent", explicit_end)
    if value_end != explicit_end:
        raise AttestationError("PKCS7: eContent [0] holds more than its OCTET STRING")
    return der[value_start:value_end]
