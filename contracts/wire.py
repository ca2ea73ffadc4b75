"""The contracts as the on-VM forwarder reads and writes them: the standard library only (contracts/checks.py says
why). Each record restates one of the pydantic models, field for field; tests/forwarder/test_wire.py checks that
their JSON schemas are equal and that envelopes and documents round-trip alike, so the contract is still one.

To add an envelope kind: its name in ``EnvelopeKind`` (which both restatements read), its payload record here (as
``HookReport``), an optional ``spec`` on ``Envelope`` and its line in ``Envelope.validate``; then the same in
contracts/envelope.py, and the schema test tells whether the two agree.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, Protocol, get_args

from contracts.attested import MAX_SIGNATURE_CHARS, AttestationError, parse_timestamp, signed_content
from contracts.checks import Choice, Flag, Invalid, Many, Maybe, Moment, Nested, Number, Record, Text, TextMap, spec

# The contract's names, kinds and bounds, declared once: the pydantic models (contracts/envelope.py, document.py,
# approval.py) import them from here, since this module may import nothing of pydantic.
SCHEMA = "scheduled-events.envelope/1"
SCHEMA_VERSION = 1
SCHEMA_PATTERN = re.compile(r"^scheduled-events\.envelope/(\d+)$")
# "impact" was added within version 1: a coordinator older than it dead-letters an impact envelope alone (each
# message is validated on its own), and every other envelope of the VM still counts.
EnvelopeKind = Literal["incarnation", "heartbeat", "hook", "impact"]
HookPhase = Literal["prepare", "recover"]
HookOutcome = Literal["succeeded", "failed", "timed-out", "not-run"]
EventStatus = Literal["Scheduled", "Started"]
ApprovalOutcome = Literal["approved", "not-found", "not-scheduled", "rejected"]
ENVELOPE_KINDS: tuple[str, ...] = get_args(EnvelopeKind)
# Azure's own limits on a resource's tags (50 per resource; name 512, value 256 characters): a VM reporting more
# is not telling the truth, and its envelope is refused at the door.
MAX_TAGS = 50
MAX_TAG_NAME = 512
MAX_TAG_VALUE = 256
MAX_HOOK_STEPS = 32
STEP_OUTPUT_TAIL = 1024
# Every figure of seconds an envelope carries is finite and at most a week: no hook, pause or restart lasts
# longer, a larger figure is a clock that stepped, and ``Infinity`` or ``NaN`` (which Python's and pydantic's JSON
# parsers read) is not JSON for any sink the figure goes on to.
MAX_SECONDS = 7 * 24 * 3600
_COUNT = Number(integer=True, ge=0, le=2**63 - 1)
_SECONDS = Number(ge=0, le=MAX_SECONDS)


# --- the IMDS document (contracts/document.py) ---

EVENT_TYPES = ("Freeze", "Reboot", "Redeploy", "Preempt", "Terminate")


def parse_not_before(value: str) -> datetime | None:
    """An RFC 1123 or ISO 8601 time with a zone, as an aware UTC datetime; None otherwise (see ``not_before``)."""
    text = value.strip()
    if not text:
        return None
    # Here, not at the top: the email package costs an idle forwarder about 1 MiB, and NotBefore is read only when
    # an event is judged.
    from email.utils import parsedate_to_datetime  # noqa: PLC0415

    try:
        parsed = parsedate_to_datetime(text)
    except (TypeError, ValueError):
        try:
            # Python 3.11's fromisoformat takes "Z" and offsets, and more than six fractional digits (.NET's seven).
            parsed = datetime.fromisoformat(text)
        except ValueError:
            return None
    # parsedate_to_datetime gives a naive datetime for "-0000" ("UTC, but the source's zone is unknown").
    if parsed.tzinfo is None:
        return parsed.replace(tzinfo=UTC) if text.endswith("-0000") else None
    return parsed.astimezone(UTC)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScheduledEvent(Record):
    EventId: str = spec(Text(1, 128))
    EventType: str = spec(Text(1, 64))
    ResourceType: str = spec(Text(), "VirtualMachine")
    Resources: list[str] = spec(Many(Text()), factory=list)
    EventStatus: EventStatus = spec(Choice(get_args(EventStatus)))
    NotBefore: str = spec(Text(), "")
    Description: str = spec(Text(), "")
    EventSource: str = spec(Text(), "Platform")
    DurationInSeconds: int = spec(Number(integer=True), -1)

    def not_before(self) -> datetime | None:
        return parse_not_before(self.NotBefore)

    def concerns(self, vm_name: str) -> bool:
        return vm_name in self.Resources

    def executable_by(self, vm_name: str) -> bool:
        if self.EventStatus != "Scheduled" or not self.Resources:
            return False
        return self.EventType != "Terminate" or self.concerns(vm_name)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScheduledEventsDocument(Record):
    DocumentIncarnation: int = spec(Number(integer=True))
    Events: list[ScheduledEvent] = spec(Many(Nested(ScheduledEvent)), factory=list)

    def event(self, event_id: str) -> ScheduledEvent | None:
        return next((e for e in self.Events if e.EventId == event_id), None)


# --- IMDS attested data (contracts/attestation.py) ---


@dataclasses.dataclass(frozen=True, kw_only=True)
class Attestation(Record):
    encoding: str = spec(Choice(("pkcs7",)))
    signature: str = spec(Text(1, MAX_SIGNATURE_CHARS))


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttestedTimes(Record):
    createdOn: str = spec(Text())
    expiresOn: str = spec(Text())


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttestedContent(Record):
    nonce: str = spec(Text())
    vmId: str = spec(Text())
    subscriptionId: str = spec(Text(), "")
    timeStamp: AttestedTimes = spec(Nested(AttestedTimes))

    def created_on(self) -> datetime:
        return parse_timestamp(self.timeStamp.createdOn, "createdOn")

    def expires_on(self) -> datetime:
        return parse_timestamp(self.timeStamp.expiresOn, "expiresOn")


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


# --- the envelope (contracts/envelope.py) ---


@dataclasses.dataclass(frozen=True, kw_only=True)
class VmIdentity(Record):
    name: str = spec(Text(1, 256))
    vmId: str = spec(Text(1, 64))
    resourceId: str = spec(Text(1, 1024))
    subscriptionId: str = spec(Text(), "")
    resourceGroupName: str = spec(Text(), "")
    vmScaleSetName: str = spec(Text(), "")
    location: str = spec(Text(), "")
    zone: str = spec(Text(), "")
    platformFaultDomain: str = spec(Text(), "")
    platformUpdateDomain: str = spec(Text(max_length=16), "")
    placementGroupId: str = spec(Text(), "")
    tags: dict[str, str] = spec(TextMap(MAX_TAGS, MAX_TAG_NAME, MAX_TAG_VALUE), factory=dict)

    def __hash__(self) -> int:
        return hash((self.resourceId.lower(), self.vmId))

    @property
    def partition_key(self) -> str:
        return self.resourceId.lower()

    @property
    def hybrid_connection_name(self) -> str:
        return f"vm-{self.vmId.lower()}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class HookStep(Record):
    hook: str = spec(Text(1, 256))
    outcome: HookOutcome = spec(Choice(get_args(HookOutcome)))
    durationSeconds: float = spec(_SECONDS)
    exitCode: int | None = spec(Maybe(Number(integer=True)), None)
    outputTail: str = spec(Text(max_length=STEP_OUTPUT_TAIL), "")
    budgetSeconds: float | None = spec(Maybe(_SECONDS), None)
    budgetUsed: float | None = spec(Maybe(Number(ge=0)), None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HookReport(Record):
    eventId: str = spec(Text(1, 128))
    phase: HookPhase = spec(Choice(get_args(HookPhase)))
    outcome: HookOutcome = spec(Choice(get_args(HookOutcome)))
    hook: str = spec(Text(), "")
    durationSeconds: float = spec(_SECONDS)
    exitCode: int | None = spec(Maybe(Number(integer=True)), None)
    outputTail: str = spec(Text(max_length=4096), "")
    steps: list[HookStep] | None = spec(Maybe(Many(Nested(HookStep), MAX_HOOK_STEPS)), None)
    budgetSeconds: float | None = spec(Maybe(_SECONDS), None)
    budgetUsed: float | None = spec(Maybe(Number(ge=0)), None)


class _Step(Protocol):
    @property
    def outcome(self) -> HookOutcome: ...


def phase_outcome(steps: Sequence[_Step]) -> HookOutcome:
    """A phase succeeded only if every one of its hooks succeeded, whatever their order; the first hook that did
    not succeed gives the phase its outcome; no hooks at all is ``not-run`` (the policy says what that means). For
    both models' steps (contracts/envelope.py's and these)."""
    if not steps:
        return "not-run"
    return next((s.outcome for s in steps if s.outcome != "succeeded"), "succeeded")


_AWARE = "times must carry a UTC offset"
# What an event did to the VM that sends it, and by which clock (contracts.envelope.ImpactReport says how).
ImpactMeasure = Literal["pause", "restart"]
ImpactClock = Literal["monotonic", "wall"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImpactReport(Record):
    """contracts.envelope.ImpactReport: what an event did to the VM that sends it (forwarder/impact.py)."""

    eventId: str = spec(Text(1, 128))
    eventType: str = spec(Text(1, 32))
    measure: ImpactMeasure = spec(Choice(get_args(ImpactMeasure)))
    announcedSeconds: int = spec(Number(integer=True, ge=-1, le=MAX_SECONDS), -1)
    measuredSeconds: float = spec(_SECONDS)
    start: datetime = spec(Moment(_AWARE))
    end: datetime = spec(Moment(_AWARE))
    clock: ImpactClock = spec(Choice(get_args(ImpactClock)), "wall")
    monotonicGapSeconds: float | None = spec(Maybe(_SECONDS), None)
    wallGapSeconds: float | None = spec(Maybe(Number(ge=-MAX_SECONDS, le=MAX_SECONDS)), None)
    bootTime: datetime | None = spec(Maybe(Moment(_AWARE)), None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ForwarderHealth(Record):
    lastGoodPollAt: datetime | None = spec(Maybe(Moment(_AWARE)), None)
    pollErrors: int = spec(_COUNT, 0)
    consecutivePollErrors: int = spec(_COUNT, 0)
    lastPollError: str = spec(Text(max_length=256), "")
    spoolDepth: int = spec(_COUNT, 0)
    dropped: int = spec(_COUNT, 0)
    sendErrors: int = spec(_COUNT, 0)
    listenerConnected: bool | None = spec(Maybe(Flag()), None)
    stateFullSince: datetime | None = spec(Maybe(Moment(_AWARE)), None)
    stateWriteErrors: int = spec(_COUNT, 0)
    lastStateError: str = spec(Text(max_length=256), "")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Envelope(Record):
    """Written with ``to_json_bytes()``: pydantic's ``model_dump_json(by_alias=True, exclude_none=True)``."""

    schema_: str = spec(Text(), SCHEMA, alias="schema")
    kind: EnvelopeKind = spec(Choice(ENVELOPE_KINDS))
    vm: VmIdentity = spec(Nested(VmIdentity))
    observedAt: datetime = spec(Moment("observedAt must carry a UTC offset"))
    sequence: int = spec(Number(integer=True, ge=0))
    forwarder: str = spec(Text(1, 64))
    stateId: str = spec(Text(max_length=64, pattern=r"^[0-9A-Za-z._-]*$"), "")
    document: ScheduledEventsDocument | None = spec(Maybe(Nested(ScheduledEventsDocument)), None)
    hook: HookReport | None = spec(Maybe(Nested(HookReport)), None)
    impact: ImpactReport | None = spec(Maybe(Nested(ImpactReport)), None)
    health: ForwarderHealth | None = spec(Maybe(Nested(ForwarderHealth)), None)
    attestation: Attestation | None = spec(Maybe(Nested(Attestation)), None)

    def validate(self) -> None:
        match = SCHEMA_PATTERN.match(self.schema_)
        if not match or int(match.group(1)) > SCHEMA_VERSION:
            raise Invalid([("schema", f"Value error, schema {self.schema_!r} is not {SCHEMA!r} or older")])
        # The payload each kind needs (an envelope kind without one needs no line).
        needs = {
            "incarnation": ("document", self.document),
            "hook": ("hook", self.hook),
            "impact": ("impact", self.impact),
        }
        name, payload = needs.get(self.kind, ("", True))
        if payload is None:
            raise Invalid([("", f"Value error, an {self.kind!r} envelope needs {name!r}")])

    def to_json_bytes(self, *, exclude_none: bool = True) -> bytes:
        return super().to_json_bytes(exclude_none=exclude_none)


# --- the approval (contracts/approval.py) ---

NOT_AFTER_TOLERANCE = timedelta(seconds=2)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ApprovalFacts(Record):
    EXTRA = "ignore"

    eventType: str = spec(Text(1, 64))
    eventSource: str = spec(Text(max_length=64))
    durationInSeconds: int = spec(Number(integer=True))
    notBefore: datetime | None = spec(Maybe(Moment()))
    resources: list[str] = spec(Many(Text(), 1000))
    hooksRequired: list[str] = spec(Many(Text(), 1000), factory=list)

    @classmethod
    def of(cls, event: ScheduledEvent, *, hooks_required: Iterable[str] = ()) -> ApprovalFacts:
        return cls(**facts_of(event, hooks_required))

    def differences(self, event: ScheduledEvent) -> list[str]:
        """contracts.approval.ApprovalFacts.differences."""
        return facts_differences(ApprovalFacts.of(event), self)


class _Event(Protocol):
    """An IMDS event, as either model holds it (contracts/document.py's or this module's)."""

    @property
    def EventType(self) -> str: ...
    @property
    def EventSource(self) -> str: ...
    @property
    def DurationInSeconds(self) -> int: ...
    @property
    def Resources(self) -> list[str]: ...
    def not_before(self) -> datetime | None: ...


class _Facts(Protocol):
    """Approval facts, as either model holds them (contracts/approval.py's or this module's)."""

    @property
    def eventType(self) -> str: ...
    @property
    def eventSource(self) -> str: ...
    @property
    def durationInSeconds(self) -> int: ...
    @property
    def notBefore(self) -> datetime | None: ...
    @property
    def resources(self) -> list[str]: ...


def facts_of(event: _Event, hooks_required: Iterable[str]) -> dict[str, Any]:
    """The fields of ApprovalFacts for an IMDS event, for both models' ``of``."""
    return {
        "eventType": event.EventType,
        "eventSource": event.EventSource,
        "durationInSeconds": event.DurationInSeconds,
        "notBefore": event.not_before(),
        "resources": list(event.Resources),
        "hooksRequired": list(hooks_required),
    }


def facts_differences(seen: _Facts, decided: _Facts) -> list[str]:
    """Where the facts a VM sees disagree with those a decision rested on, for both models' ``differences``."""
    pairs: list[tuple[str, object, object]] = [
        ("EventType", seen.eventType, decided.eventType),
        ("EventSource", seen.eventSource, decided.eventSource),
        ("DurationInSeconds", seen.durationInSeconds, decided.durationInSeconds),
        ("NotBefore", seen.notBefore, decided.notBefore),
        ("Resources", sorted(set(seen.resources)), sorted(set(decided.resources))),
    ]
    return [f"{name} is {here!r} here, the decision rested on {rested!r}" for name, here, rested in pairs
            if here != rested]  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class ApprovalRequest(Record):
    EXTRA = "ignore"

    eventId: str = spec(Text(1, 128))
    decisionId: str = spec(Text(1, 128))
    rule: str = spec(Text(1, 256))
    issuedAt: datetime = spec(Moment())
    expiresAt: datetime = spec(Moment())
    facts: ApprovalFacts | None = spec(Maybe(Nested(ApprovalFacts)), None)
    notAfter: datetime | None = spec(Maybe(Moment()), None)
    notAfterReason: str = spec(Text(max_length=256), "")
    policyVersion: str = spec(Text(max_length=64), "")

    @property
    def deadline(self) -> datetime:
        return min(self.expiresAt, self.notAfter) if self.notAfter is not None else self.expiresAt


@dataclasses.dataclass(frozen=True, kw_only=True)
class ApprovalResult(Record):
    EXTRA = "ignore"

    outcome: ApprovalOutcome = spec(Choice(get_args(ApprovalOutcome)))
    eventId: str = spec(Text())
    decisionId: str = spec(Text())
    documentIncarnation: int | None = spec(Maybe(Number(integer=True)), None)
    reason: str = spec(Text(), "")
    attestation: Attestation | None = spec(Maybe(Nested(Attestation)), None)


__all__ = [
    "ENVELOPE_KINDS",
    "MAX_HOOK_STEPS",
    "MAX_SECONDS",
    "MAX_TAGS",
    "MAX_TAG_NAME",
    "MAX_TAG_VALUE",
    "NOT_AFTER_TOLERANCE",
    "SCHEMA",
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
    "Invalid",
    "ScheduledEvent",
    "ScheduledEventsDocument",
    "VmIdentity",
    "phase_outcome",
    "read_content",
]
