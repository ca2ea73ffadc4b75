"""The contracts as the on-VM forwarder reads and writes them, without pydantic: the records generated from the
pydantic models (contracts/wire_records.py, by ``python -m contracts.generate``; contracts/schema_record.py says
how they are read), the names and bounds and the rules no JSON schema states (contracts/wire_rules.py).

To add an envelope kind: its name in ``EnvelopeKind`` (contracts/wire_rules.py), its payload model and an optional
field on ``Envelope`` in contracts/envelope.py, its line in both ``Envelope`` rules (the model's validator and
``EnvelopeRules.validate``); then ``python -m contracts.generate``.
"""

from __future__ import annotations

from contracts.attested import AttestationError, signed_content
from contracts.checks import Invalid
from contracts.wire_records import (
    ApprovalFacts,
    ApprovalRequest,
    ApprovalResult,
    Attestation,
    AttestedContent,
    Envelope,
    ForwarderHealth,
    HookReport,
    HookStep,
    ImpactReport,
    ScheduledEvent,
    ScheduledEventsDocument,
    VmIdentity,
)
from contracts.wire_rules import (
    ENVELOPE_KINDS,
    EVENT_TYPES,
    HOOK_NAME,
    MAX_HOOK_STEPS,
    MAX_SECONDS,
    MAX_TAG_NAME,
    MAX_TAG_VALUE,
    MAX_TAGS,
    NOT_AFTER_TOLERANCE,
    SCHEMA,
    SCHEMA_VERSION,
    STEP_OUTPUT_TAIL,
    ApprovalOutcome,
    EnvelopeKind,
    EventStatus,
    HookOutcome,
    HookPhase,
    ImpactClock,
    ImpactMeasure,
    facts_differences,
    facts_of,
    parse_not_before,
    phase_outcome,
)


def read_content(attestation: Attestation) -> AttestedContent:
    """The signed document's content, not verified (contracts.attestation.read_content)."""
    import base64  # noqa: PLC0415 - only when an attested document is read
    import binascii  # noqa: PLC0415

    try:
        der = base64.b64decode(attestation.signature, validate=True)
    except (binascii.Error, ValueError) as error:
        raise AttestationError(f"attested signature is not base64: {error}") from error
    try:
        return AttestedContent.from_json_bytes(signed_content(der))
    except Invalid as error:
        raise AttestationError(f"the signed content is not IMDS's attested document: {str(error)[:300]}") from error


__all__ = [
    "ENVELOPE_KINDS",
    "EVENT_TYPES",
    "HOOK_NAME",
    "MAX_HOOK_STEPS",
    "MAX_SECONDS",
    "MAX_TAGS",
    "MAX_TAG_NAME",
    "MAX_TAG_VALUE",
    "NOT_AFTER_TOLERANCE",
    "SCHEMA",
    "SCHEMA_VERSION",
    "STEP_OUTPUT_TAIL",
    "ApprovalFacts",
    "ApprovalOutcome",
    "ApprovalRequest",
    "ApprovalResult",
    "Attestation",
    "AttestedContent",
    "Envelope",
    "EnvelopeKind",
    "EventStatus",
    "ForwarderHealth",
    "HookOutcome",
    "HookPhase",
    "HookReport",
    "HookStep",
    "ImpactClock",
    "ImpactMeasure",
    "ImpactReport",
    "Invalid",
    "ScheduledEvent",
    "ScheduledEventsDocument",
    "VmIdentity",
    "facts_differences",
    "facts_of",
    "parse_not_before",
    "phase_outcome",
    "read_content",
]
