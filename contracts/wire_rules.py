"""The contracts' names, kinds and bounds, and what no JSON schema states: the rules across fields, the times that
must carry their offset, and the records' own methods. The standard library only.

The pydantic models (contracts/envelope.py, document.py, approval.py) import the names and bounds from here; the
records the forwarder reads (contracts/wire_records.py, generated from those models by ``python -m
contracts.generate``) take their methods and rules from the mixins below, one per record that has any, named
``<Record>Rules``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, Protocol, Self, get_args

from contracts.attested import parse_timestamp
from contracts.checks import Invalid

SCHEMA = "scheduled-events.envelope/1"
SCHEMA_VERSION = 1
SCHEMA_PATTERN = re.compile(r"^scheduled-events\.envelope/(\d+)$")
# "impact" was added within version 1: a coordinator older than it dead-letters an impact envelope alone (each
# message is validated on its own), and every other envelope of the VM still counts.
EnvelopeKind = Literal["incarnation", "heartbeat", "hook", "impact"]
# "force" was added within version 1: an escalation ladder's force hook (contracts/approval.py, ``forceHook``).
HookPhase = Literal["prepare", "recover", "force"]
HookOutcome = Literal["succeeded", "failed", "timed-out", "not-run"]
EventStatus = Literal["Scheduled", "Started"]
# "accepted": a force request judged executable, its force hook running; StartRequests follows once it succeeded.
ApprovalOutcome = Literal["approved", "not-found", "not-scheduled", "rejected", "accepted"]
# What an event did to the VM that sends it, and by which clock (contracts.envelope.ImpactReport says how).
ImpactMeasure = Literal["pause", "restart"]
ImpactClock = Literal["monotonic", "wall"]
ENVELOPE_KINDS: tuple[str, ...] = get_args(EnvelopeKind)
EVENT_TYPES = ("Freeze", "Reboot", "Redeploy", "Preempt", "Terminate")
# Azure's own limits on a resource's tags (50 per resource; name 512, value 256 characters): a VM reporting more
# is not telling the truth, and its envelope is refused at the door.
MAX_TAGS = 50
MAX_TAG_NAME = 512
MAX_TAG_VALUE = 256
MAX_HOOK_STEPS = 32
# A force hook's name (contracts/approval.py, ``forceHook``): a file name in the VM's force.d, never a path.
HOOK_NAME = r"[A-Za-z0-9_-]{1,64}"
STEP_OUTPUT_TAIL = 1024
# Every figure of seconds an envelope carries is finite and at most a week: no hook, pause or restart lasts
# longer, a larger figure is a clock that stepped, and ``Infinity`` or ``NaN`` (which Python's and pydantic's JSON
# parsers read) is not JSON for any sink the figure goes on to.
MAX_SECONDS = 7 * 24 * 3600
# How far the listener's clock and the coordinator's may disagree (contracts/approval.py says why 2 s).
NOT_AFTER_TOLERANCE = timedelta(seconds=2)
_AWARE = "times must carry a UTC offset"


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


def aware(record: Any, fields: Iterable[str], message: str = _AWARE) -> None:
    """Each of ``fields`` that is a time carries its offset (the models' field validators say the same)."""
    naive = [(name, f"Value error, {message}") for name in fields if _naive(getattr(record, name))]
    if naive:
        raise Invalid(naive)


def _naive(value: object) -> bool:
    return isinstance(value, datetime) and value.tzinfo is None


class _Event(Protocol):
    """An IMDS event, as either side holds it (contracts/document.py's model or the generated record)."""

    @property
    def EventType(self) -> str: ...
    @property
    def EventSource(self) -> str: ...
    @property
    def EventStatus(self) -> EventStatus: ...
    @property
    def DurationInSeconds(self) -> int: ...
    @property
    def NotBefore(self) -> str: ...
    @property
    def Resources(self) -> list[str]: ...
    def not_before(self) -> datetime | None: ...
    def concerns(self, vm_name: str) -> bool: ...


class ScheduledEventRules:
    def not_before(self: _Event) -> datetime | None:
        return parse_not_before(self.NotBefore)

    def concerns(self: _Event, vm_name: str) -> bool:
        return vm_name in self.Resources

    def executable_by(self: _Event, vm_name: str) -> bool:
        if self.EventStatus != "Scheduled" or not self.Resources:
            return False
        return self.EventType != "Terminate" or self.concerns(vm_name)


class _Document(Protocol):
    @property
    def Events(self) -> Sequence[Any]: ...


class ScheduledEventsDocumentRules:
    def event(self: _Document, event_id: str) -> Any:
        return next((e for e in self.Events if e.EventId == event_id), None)


class _Vm(Protocol):
    @property
    def resourceId(self) -> str: ...
    @property
    def vmId(self) -> str: ...


class VmIdentityRules:
    def __hash__(self: _Vm) -> int:
        # Frozen but holding a dict: hashed by who the VM is.
        return hash((self.resourceId.lower(), self.vmId))

    @property
    def partition_key(self: _Vm) -> str:
        return self.resourceId.lower()

    @property
    def hybrid_connection_name(self: _Vm) -> str:
        return f"vm-{self.vmId.lower()}"


class ImpactReportRules:
    def validate(self) -> None:
        aware(self, ("start", "end", "bootTime"))


class ForwarderHealthRules:
    def validate(self) -> None:
        aware(self, ("lastGoodPollAt", "stateFullSince"))


class _Times(Protocol):
    @property
    def timeStamp(self) -> Any: ...


class AttestedContentRules:
    def created_on(self: _Times) -> datetime:
        return parse_timestamp(self.timeStamp.createdOn, "createdOn")

    def expires_on(self: _Times) -> datetime:
        return parse_timestamp(self.timeStamp.expiresOn, "expiresOn")


class _Envelope(Protocol):
    @property
    def schema_(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def document(self) -> object: ...
    @property
    def hook(self) -> object: ...
    @property
    def impact(self) -> object: ...
    def to_mapping(self, *, exclude_none: bool = False) -> dict[str, Any]: ...


class EnvelopeRules:
    def validate(self: _Envelope) -> None:
        match = SCHEMA_PATTERN.match(self.schema_)
        if not match or int(match.group(1)) > SCHEMA_VERSION:
            raise Invalid([("schema", f"Value error, schema {self.schema_!r} is not {SCHEMA!r} or older")])
        aware(self, ("observedAt",), "observedAt must carry a UTC offset")
        # The payload each kind needs (an envelope kind without one needs no line).
        needs = {"incarnation": ("document", self.document), "hook": ("hook", self.hook),
                 "impact": ("impact", self.impact)}  # fmt: skip
        name, payload = needs.get(self.kind, ("", True))
        if payload is None:
            raise Invalid([("", f"Value error, an {self.kind!r} envelope needs {name!r}")])

    def to_json_bytes(self: _Envelope, *, exclude_none: bool = True) -> bytes:
        """pydantic's ``model_dump_json(by_alias=True, exclude_none=True)``."""
        import json  # noqa: PLC0415 - the json module is loaded already wherever an envelope is written

        return json.dumps(self.to_mapping(exclude_none=exclude_none), ensure_ascii=False,
                          separators=(",", ":")).encode()  # fmt: skip


class _Step(Protocol):
    @property
    def outcome(self) -> HookOutcome: ...


def phase_outcome(steps: Sequence[_Step]) -> HookOutcome:
    """A phase succeeded only if every one of its hooks succeeded, whatever their order; the first hook that did
    not succeed gives the phase its outcome; no hooks at all is ``not-run`` (the policy says what that means). For
    both sides' steps (contracts/envelope.py's and the generated records)."""
    if not steps:
        return "not-run"
    return next((s.outcome for s in steps if s.outcome != "succeeded"), "succeeded")


class _Facts(Protocol):
    """Approval facts, as either side holds them (contracts/approval.py's model or the generated record)."""

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
    """The fields of ApprovalFacts for an IMDS event, for both sides' ``of``."""
    return {
        "eventType": event.EventType,
        "eventSource": event.EventSource,
        "durationInSeconds": event.DurationInSeconds,
        "notBefore": event.not_before(),
        "resources": list(event.Resources),
        "hooksRequired": list(hooks_required),
    }


def facts_differences(seen: _Facts, decided: _Facts) -> list[str]:
    """Where the facts a VM sees disagree with those a decision rested on, for both sides' ``differences``."""
    pairs: list[tuple[str, object, object]] = [
        ("EventType", seen.eventType, decided.eventType),
        ("EventSource", seen.eventSource, decided.eventSource),
        ("DurationInSeconds", seen.durationInSeconds, decided.durationInSeconds),
        ("NotBefore", seen.notBefore, decided.notBefore),
        ("Resources", sorted(set(seen.resources)), sorted(set(decided.resources))),
    ]
    return [f"{name} is {here!r} here, the decision rested on {rested!r}" for name, here, rested in pairs
            if here != rested]  # fmt: skip


class ApprovalFactsRules:
    @classmethod
    def of(cls, event: _Event, *, hooks_required: Iterable[str] = ()) -> Self:
        return cls(**facts_of(event, hooks_required))

    def differences(self, event: _Event) -> list[str]:
        """contracts.approval.ApprovalFacts.differences."""
        seen: Any = type(self).of(event)
        return facts_differences(seen, self)  # type: ignore[arg-type]


class _Request(Protocol):
    @property
    def expiresAt(self) -> datetime: ...
    @property
    def notAfter(self) -> datetime | None: ...


class ApprovalRequestRules:
    @property
    def deadline(self: _Request) -> datetime:
        return min(self.expiresAt, self.notAfter) if self.notAfter is not None else self.expiresAt
