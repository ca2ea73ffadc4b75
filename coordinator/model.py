"""The coordinator's own records: one per EventId (merged from every reporting VM) and one per VM.

Stored as JSON in Table Storage (see store.py); pydantic at this boundary so that a record written by an older
coordinator still loads (new fields have defaults) and a corrupt one fails loudly.
"""

from __future__ import annotations

import zlib
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from forwarder.envelope import VmIdentity

State = Literal["Scheduled", "Approved", "Started", "Completed", "Canceled", "Expired"]
TERMINAL_STATES: frozenset[str] = frozenset({"Completed", "Canceled"})
SightingStatus = Literal["Scheduled", "Started", "Gone"]
Verdict = Literal["approve", "wait", "never"]
AlertKind = Literal[
    "new-event",
    "approved",
    "started-without-notice",
    "canceled",
    "expired",
    "approval-failed",
    "heartbeat-lost",
]


class VmSighting(BaseModel):
    """What one VM last said about one event. ``lastSequence`` makes re-applying an envelope a no-op."""

    model_config = ConfigDict(extra="ignore")

    # Identity fields: empty while stored under the VM's own position (VmRecord.sightings), where the VM's
    # identity says them once; filled in when the event record is assembled.
    name: str = ""
    vmId: str = ""
    resourceId: str = ""
    scaleSet: str = ""
    placementGroup: str = ""
    firstSeen: datetime
    lastSeen: datetime
    lastSequence: int
    incarnation: int = 0
    status: SightingStatus
    hooks: dict[str, str] = Field(default_factory=dict)
    hookSequence: int = -1

    def identity(self) -> VmIdentity:
        return VmIdentity(
            name=self.name,
            vmId=self.vmId,
            resourceId=self.resourceId,
            vmScaleSetName=self.scaleSet,
            placementGroupId=self.placementGroup,
        )


class DecisionRecord(BaseModel):
    model_config = ConfigDict(extra="ignore")

    decisionId: str
    rule: str
    action: str
    verdict: Verdict
    reason: str
    decidedAt: datetime
    dryRun: bool = False
    actor: str = ""


class ApprovalRecord(BaseModel):
    """The approval being delivered. ``outcome`` is the listener's answer; delivery is retried until NotBefore."""

    model_config = ConfigDict(extra="ignore")

    decisionId: str
    rule: str
    actor: str
    decidedAt: datetime
    attempts: int = 0
    lastAttemptAt: datetime | None = None
    nextAttemptAt: datetime | None = None
    outcome: str = ""
    reason: str = ""
    executor: str = ""
    delivered: bool = False


class EventRecord(BaseModel):
    model_config = ConfigDict(extra="ignore")

    eventId: str
    eventType: str
    eventSource: str = "Platform"
    resourceType: str = "VirtualMachine"
    resources: list[str] = Field(default_factory=list)
    description: str = ""
    durationInSeconds: int = -1
    notBefore: datetime | None = None
    state: State = "Scheduled"
    stateSince: datetime
    createdAt: datetime
    everStarted: bool = False
    seenScheduled: bool = False
    vms: dict[str, VmSighting] = Field(default_factory=dict)
    decision: DecisionRecord | None = None
    approval: ApprovalRecord | None = None
    alerts: list[str] = Field(default_factory=list)
    # The alert outbox: kinds recorded by the write that made their transition, cleared once the card is sent.
    # ``pendingSince`` (when the oldest was recorded) lets the timer take over from a sender that crashed.
    pendingAlerts: list[str] = Field(default_factory=list)
    pendingSince: datetime | None = None
    # Where the reporting VMs' sightings are kept (their VM groups); ``vms`` is assembled from them on read.
    groups: list[str] = Field(default_factory=list)

    @property
    def open(self) -> bool:
        return self.state not in TERMINAL_STATES

    @property
    def scale_sets(self) -> set[str]:
        return {s.scaleSet for s in self.vms.values() if s.scaleSet}


class VmRecord(BaseModel):
    """Per-VM last-seen position: protects against duplicate and out-of-order delivery, and says which events the
    VM listed last (an event is gone for a VM when a newer document from it no longer lists it)."""

    model_config = ConfigDict(extra="ignore")

    identity: VmIdentity
    lastSequence: int = -1
    lastIncarnation: int = 0
    lastSeen: datetime
    listed: list[str] = Field(default_factory=list)
    heartbeatLost: bool = False
    # This VM's sighting of each event it reported (the event record's ``vms`` entries live here, so that a
    # batch writes an event only when the event itself changes, and a VM's sightings with its position).
    sightings: dict[str, VmSighting] = Field(default_factory=dict)


class VmGroupRecord(BaseModel):
    """The VMs of one placement group (or scale set, or a lone VM) in one entity: the VMs that report an event
    together are read and written together, one operation per group instead of one per VM."""

    model_config = ConfigDict(extra="ignore")

    group: str
    vms: dict[str, VmRecord] = Field(default_factory=dict)


class BudgetClaim(BaseModel):
    """One event's hold on a scale set's budget: its VMs count as impacted while the claim lives."""

    model_config = ConfigDict(extra="ignore")

    eventId: str
    vms: list[str]
    claimedAt: datetime


class BudgetRecord(BaseModel):
    """The claims on one scale set's "at most N impacted" budget, fleet-wide: every instance that approves
    within budget adds its claim here with an ETag-checked write first, so two instances cannot both take the
    last slot."""

    model_config = ConfigDict(extra="ignore")

    scaleSet: str
    claims: dict[str, BudgetClaim] = Field(default_factory=dict)


class SentAlerts(BaseModel):
    """Cards one batch sent, by event: the outbox entries they settle (the timer clears them in bulk)."""

    model_config = ConfigDict(extra="ignore")

    sentAt: datetime
    events: dict[str, list[str]]


SCALE_SET_BUCKETS = 8


def group_key(identity: VmIdentity) -> str:
    """Where a VM's position is kept: its placement group (events reach a whole placement group; at most 100
    VMs), else its scale set split in buckets (a scale set can hold 1,000 VMs and an entity 1 MiB), else the VM
    alone."""
    if identity.placementGroupId:
        return f"pg:{identity.placementGroupId.lower()}"
    if identity.vmScaleSetName:
        bucket = zlib.crc32(identity.vmId.lower().encode()) % SCALE_SET_BUCKETS
        scale_set = f"{identity.subscriptionId}/{identity.resourceGroupName}/{identity.vmScaleSetName}".lower()
        return f"vmss:{scale_set}#{bucket}"
    return f"vm:{identity.vmId.lower()}"
