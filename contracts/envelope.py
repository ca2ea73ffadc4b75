"""The envelope contract (forwarder -> Event Hubs -> coordinator), version 1. Both sides import this module.

JSON, UTF-8, one envelope per event-hub message; partition key = the VM's resource id, so that one VM's
envelopes stay in order. Unknown fields are kept; a newer schema version is refused with a clear error.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from contracts import wire_rules
from contracts.attestation import Attestation
from contracts.document import ScheduledEventsDocument

# The kinds and bounds are declared once, in contracts/wire_rules.py (which the forwarder imports without pydantic),
# and exported here as well.
from contracts.wire_rules import (
    MAX_HOOK_STEPS,
    MAX_SECONDS,
    MAX_TAG_NAME,
    MAX_TAG_VALUE,
    MAX_TAGS,
    SCHEMA,
    SCHEMA_VERSION,
    STEP_OUTPUT_TAIL,
    EnvelopeKind,
    HookOutcome,
    HookPhase,
    ImpactClock,
    ImpactMeasure,
)

__all__ = [
    "MAX_HOOK_STEPS",
    "MAX_SECONDS",
    "MAX_TAGS",
    "MAX_TAG_NAME",
    "MAX_TAG_VALUE",
    "SCHEMA",
    "SCHEMA_VERSION",
    "STEP_OUTPUT_TAIL",
    "Envelope",
    "EnvelopeKind",
    "ForwarderHealth",
    "HookOutcome",
    "HookPhase",
    "HookReport",
    "HookStep",
    "ImpactClock",
    "ImpactMeasure",
    "ImpactReport",
    "UnsupportedEnvelopeVersion",
    "VmIdentity",
]


class _Mapped(Protocol):
    def to_mapping(self) -> dict[str, Any]: ...


class UnsupportedEnvelopeVersion(ValueError):
    """The envelope was written by a newer forwarder than this code understands."""


_TagName = Annotated[str, StringConstraints(min_length=1, max_length=MAX_TAG_NAME)]
_TagValue = Annotated[str, StringConstraints(max_length=MAX_TAG_VALUE)]


class VmIdentity(BaseModel):
    """Who the VM is, from IMDS instance metadata (compute.*), never from the hostname. ``platformUpdateDomain``
    and ``tags`` are optional (v1-compatible: older forwarders leave them out); tags are what the VM says, so the
    policy only lets them restrict what it approves unless a rule trusts them (docs/coordinator.md, "Tags")."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: str = Field(min_length=1, max_length=256)
    vmId: str = Field(min_length=1, max_length=64)
    resourceId: str = Field(min_length=1, max_length=1024)
    subscriptionId: str = ""
    resourceGroupName: str = ""
    vmScaleSetName: str = ""
    location: str = ""
    zone: str = ""
    platformFaultDomain: str = ""
    platformUpdateDomain: str = Field(default="", max_length=16)
    placementGroupId: str = ""
    # Bounded in the schema itself (propertyNames, additionalProperties), so that the VM's validator, compiled from
    # it, holds the same bounds.
    tags: dict[_TagName, _TagValue] = Field(default_factory=dict, max_length=MAX_TAGS)

    def __hash__(self) -> int:
        # Frozen but holding a dict: hashed by who the VM is.
        return hash((self.resourceId.lower(), self.vmId))

    @classmethod
    def of(cls, identity: _Mapped) -> VmIdentity:
        """The identity a forwarder read (contracts/wire.py's record), as the coordinator's model."""
        return cls.model_validate(identity.to_mapping())

    @property
    def partition_key(self) -> str:
        return self.resourceId.lower()

    @property
    def hybrid_connection_name(self) -> str:
        """The VM's own Azure Relay hybrid connection (one per VM: a connection spreads requests among its
        listeners at random, so a shared one cannot address a VM). vmId is unique and stable for the VM's life."""
        return f"vm-{self.vmId.lower()}"


class HookStep(BaseModel):
    """One hook (one executable of a phase's folder) and how it ended."""

    model_config = ConfigDict(extra="allow", frozen=True)

    hook: str = Field(min_length=1, max_length=256)
    outcome: HookOutcome
    durationSeconds: float = Field(ge=0, le=MAX_SECONDS, allow_inf_nan=False)
    exitCode: int | None = None
    outputTail: str = Field(default="", max_length=STEP_OUTPUT_TAIL)
    # The seconds the hook was given (its time to the event's NotBefore less the forwarder's margin, at most the
    # configured maximum) and the share of them it used (>= 1: it was stopped at its budget). None from forwarders
    # older than budgets (v1-compatible).
    budgetSeconds: float | None = Field(default=None, ge=0, le=MAX_SECONDS, allow_inf_nan=False)
    budgetUsed: float | None = Field(default=None, ge=0, allow_inf_nan=False)


class HookReport(BaseModel):
    """A phase's outcome on one VM for one event.

    Forwarders from this version send one report per phase, with ``steps`` (every hook, in the order run): then
    ``outcome`` is the phase's outcome, ``succeeded`` only when every step succeeded (``not-run`` when the phase
    has no hooks). Older forwarders sent one report per hook, without ``steps``: such a report says how one hook
    ended, not the phase (the coordinator keeps a failure among them, see coordinator/domain/event_merge.py).
    """

    model_config = ConfigDict(extra="allow", frozen=True)

    eventId: str = Field(min_length=1, max_length=128)
    phase: HookPhase
    outcome: HookOutcome
    hook: str = ""
    durationSeconds: float = Field(ge=0, le=MAX_SECONDS, allow_inf_nan=False)
    exitCode: int | None = None
    outputTail: str = Field(default="", max_length=4096)
    steps: list[HookStep] | None = Field(default=None, max_length=MAX_HOOK_STEPS)
    # The phase's budget when it started (its first hook's) and the share of it the phase's hooks used together.
    budgetSeconds: float | None = Field(default=None, ge=0, le=MAX_SECONDS, allow_inf_nan=False)
    budgetUsed: float | None = Field(default=None, ge=0, allow_inf_nan=False)

    @property
    def phase_complete(self) -> bool:
        """Whether this report closes its phase (it lists every hook), rather than tell of one hook."""
        return self.steps is not None

    @property
    def failed_hook(self) -> str:
        """The first hook that did not succeed ("" when none did not), for the history and the cards."""
        if self.steps is None:
            return self.hook if self.outcome in ("failed", "timed-out") else ""
        return next((s.hook for s in self.steps if s.outcome != "succeeded"), "")


class ImpactReport(BaseModel):
    """What an event did to the VM that sends it, measured by its forwarder (forwarder/impact.py).

    ``pause`` (a Freeze): the longest stretch the forwarder's process did not run while the event was listed,
    from the gaps between its ticks on both clocks; ``clock`` says which gave the figure (the larger).
    ``restart`` (a Reboot or Redeploy): from its last poll before the VM went down to its first poll after it came
    back, by the wall clock (a monotonic clock starts again at boot), the boot between them (``bootTime``).
    ``announcedSeconds`` is the event's DurationInSeconds as IMDS said it (-1: not said)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    eventId: str = Field(min_length=1, max_length=128)
    eventType: str = Field(min_length=1, max_length=32)
    measure: ImpactMeasure
    announcedSeconds: int = Field(default=-1, ge=-1, le=MAX_SECONDS)
    measuredSeconds: float = Field(ge=0, le=MAX_SECONDS, allow_inf_nan=False)
    # The stretch measured: its last sign of life before, its first after (UTC).
    start: datetime
    end: datetime
    clock: ImpactClock = "wall"
    monotonicGapSeconds: float | None = Field(default=None, ge=0, le=MAX_SECONDS, allow_inf_nan=False)
    wallGapSeconds: float | None = Field(default=None, ge=-MAX_SECONDS, le=MAX_SECONDS, allow_inf_nan=False)
    bootTime: datetime | None = None  # restart: when the VM booted again

    @field_validator("start", "end", "bootTime")
    @classmethod
    def _aware(cls, value: datetime | None) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("times must carry a UTC offset")
        return value


class ForwarderHealth(BaseModel):
    """What a heartbeat says of the forwarder's own health (optional; v1-compatible): a forwarder that runs and
    sends heartbeats but cannot read IMDS misses every event, and only these fields show it."""

    model_config = ConfigDict(extra="allow", frozen=True)

    # The last poll that returned a valid document (None: none since the forwarder started).
    lastGoodPollAt: datetime | None = None
    pollErrors: int = Field(default=0, ge=0, le=2**63 - 1)  # failed IMDS polls since the forwarder started
    consecutivePollErrors: int = Field(default=0, ge=0, le=2**63 - 1)  # failed polls since the last good one
    lastPollError: str = Field(default="", max_length=256)
    spoolDepth: int = Field(default=0, ge=0, le=2**63 - 1)  # envelopes waiting to be sent
    dropped: int = Field(default=0, ge=0, le=2**63 - 1)  # envelopes the bounded spool evicted since it was made
    sendErrors: int = Field(default=0, ge=0, le=2**63 - 1)  # failed sends to Event Hubs since the start
    listenerConnected: bool | None = None  # the relay listener's control channel is up (None: no listener)
    # The forwarder's state directory has been full since this time (None: it can be written): nothing new is
    # spooled, changes wait in IMDS and this heartbeat was sent from memory; it resumes when there is room.
    stateFullSince: datetime | None = None
    stateWriteErrors: int = Field(default=0, ge=0, le=2**63 - 1)  # writes of its state that failed since the start
    lastStateError: str = Field(default="", max_length=256)

    @field_validator("lastGoodPollAt", "stateFullSince")
    @classmethod
    def _aware(cls, value: datetime | None) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("times must carry a UTC offset")
        return value

    def poll_age_seconds(self, at: datetime) -> float | None:
        """Seconds from the last good poll to ``at`` (the heartbeat's observedAt), None when there was none."""
        if self.lastGoodPollAt is None:
            return None
        return max(0.0, (at - self.lastGoodPollAt).total_seconds())


class Envelope(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True, populate_by_name=True)

    schema_: str = Field(default=SCHEMA, alias="schema")
    kind: EnvelopeKind
    vm: VmIdentity
    observedAt: datetime
    sequence: int = Field(ge=0)
    forwarder: str = Field(min_length=1, max_length=64)
    # The identifier of the forwarder's durable state (its spool database), new whenever that state is new: a
    # sequence that starts over under a new stateId is a forwarder that lost its state, not a replay. "" from
    # forwarders older than this field.
    stateId: str = Field(default="", max_length=64, pattern=r"^[0-9A-Za-z._-]*$")
    document: ScheduledEventsDocument | None = None
    hook: HookReport | None = None
    impact: ImpactReport | None = None
    health: ForwarderHealth | None = None  # heartbeats from forwarders that report it
    # IMDS's attested document of this VM, its nonce contracts.attestation.state_nonce(stateId): Azure's signature
    # that this forwarder state is this VM's (optional; v1-compatible: forwarders older than it send none). The
    # forwarder adds it as it sends (forwarder/sender.py), so a replayed envelope carries a document still valid.
    attestation: Attestation | None = None

    @field_validator("schema_")
    @classmethod
    def _known_version(cls, value: str) -> str:
        match = wire_rules.SCHEMA_PATTERN.match(value)
        if not match:
            raise ValueError(f"schema {value!r} is not a scheduled-events envelope")
        if int(match.group(1)) > SCHEMA_VERSION:
            raise UnsupportedEnvelopeVersion(
                f"envelope schema {value!r} is newer than {SCHEMA!r}; upgrade the coordinator"
            )
        return value

    @field_validator("observedAt")
    @classmethod
    def _aware(cls, value: datetime) -> datetime:
        if value.tzinfo is None:
            raise ValueError("observedAt must carry a UTC offset")
        return value

    @model_validator(mode="after")
    def _payload_matches_kind(self) -> Envelope:
        if self.kind == "incarnation" and self.document is None:
            raise ValueError("an 'incarnation' envelope needs 'document'")
        if self.kind == "hook" and self.hook is None:
            raise ValueError("a 'hook' envelope needs 'hook'")
        if self.kind == "impact" and self.impact is None:
            raise ValueError("an 'impact' envelope needs 'impact'")
        return self

    def to_json_bytes(self) -> bytes:
        return self.model_dump_json(by_alias=True, exclude_none=True).encode("utf-8")

    @classmethod
    def from_json_bytes(cls, data: bytes | str) -> Envelope:
        return cls.model_validate_json(data)

    @classmethod
    def from_mapping(cls, data: dict[str, Any]) -> Envelope:
        return cls.model_validate(data)
