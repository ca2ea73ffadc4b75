"""IMDS attested data (``GET /metadata/attested/document``) as both sides carry it. Both sides import this module.

IMDS answers ``{"encoding": "pkcs7", "signature": "<base64 DER>"}``: a CMS SignedData whose content is a JSON
document (``nonce``, ``vmId``, ``subscriptionId``, ``timeStamp.createdOn/expiresOn``, ``sku``, ``plan``…) signed by
a certificate of ``*.metadata.azure.com`` (Microsoft's chain in Azure; the IMDS emulator's own CA locally). The
caller may give a ``nonce``: a string of exactly 10 digits, which the signed document repeats.

A forwarder binds its state to its VM with a nonce derived from its ``stateId`` (``state_nonce``); a listener
proves which VM answered an approval with a nonce derived from the decision (``decision_nonce``). The forwarder
passes the document through unverified (``read_content`` only reads what it asked for, to notice a cached
answer and when to ask again); the coordinator verifies it (coordinator/domain/attestation.py).
"""

from __future__ import annotations

import base64
import binascii
import json
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from contracts.attested import (
    ATTESTED_API_VERSION,
    MAX_SIGNATURE_CHARS,
    NONCE_DIGITS,
    NONCE_PATTERN,
    AttestationError,
    decision_nonce,
    format_timestamp,
    parse_timestamp,
    signed_content,
    state_nonce,
)

__all__ = [
    "ATTESTED_API_VERSION",
    "MAX_SIGNATURE_CHARS",
    "NONCE_DIGITS",
    "NONCE_PATTERN",
    "Attestation",
    "AttestationError",
    "AttestedContent",
    "AttestedTimes",
    "decision_nonce",
    "format_timestamp",
    "parse_timestamp",
    "read_content",
    "signed_content",
    "state_nonce",
]


class Attestation(BaseModel):
    """What IMDS answers, passed through unchanged (only IMDS's key can sign it)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    encoding: Literal["pkcs7"]
    signature: str = Field(min_length=1, max_length=MAX_SIGNATURE_CHARS)

    def der(self) -> bytes:
        try:
            return base64.b64decode(self.signature, validate=True)
        except (binascii.Error, ValueError) as error:
            raise AttestationError(f"attested signature is not base64: {error}") from error


class AttestedTimes(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    createdOn: str
    expiresOn: str


class AttestedContent(BaseModel):
    """The signed JSON. Only what the project checks is required; the rest (plan, sku, licenseType…) is kept."""

    model_config = ConfigDict(extra="allow", frozen=True)

    nonce: str
    vmId: str
    subscriptionId: str = ""
    timeStamp: AttestedTimes

    def created_on(self) -> datetime:
        return parse_timestamp(self.timeStamp.createdOn, "createdOn")

    def expires_on(self) -> datetime:
        return parse_timestamp(self.timeStamp.expiresOn, "expiresOn")


def read_content(attestation: Attestation) -> AttestedContent:
    """The signed document's content, **not verified**: what a forwarder needs to see that IMDS signed the nonce it
    asked for (IMDS may answer from its cache with an earlier one) and when the document expires."""
    content = signed_content(attestation.der())
    try:
        return AttestedContent.model_validate(json.loads(content))
    except (ValueError, ValidationError) as error:
        raise AttestationError(f"the signed content is not IMDS's attested document: {str(error)[:300]}") from error
