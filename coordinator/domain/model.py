"""The coordinator's own records: one per EventId (merged from every reporting VM) and one per VM.

Stored as JSON in Table Storage (see coordinator/state/entities.py); pydantic at this boundary so that a record
written by an older coordinator still loads (new fields have defaults) and a corrupt one fails loudly.
"""

from __future__ import annotations

import zlib
from datetime import datetime, timedelta
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from contracts.envelope import VmIdentity
from coordinator.domain.side_records import EscalationTaken, ReturnWatch, ShadowVerdict

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
    "completed",
    "approval-failed",
    "approval-refused",
    "not-started",
    "facts-conflict",
    "heartbeat-lost",
    "forwarder-conflict",
    "imds-failing",
    # One per step of a rule's escalation ladder (policy.MAX_STEPS), so that each step's card goes once.
    "escalation-1",
    "escalation-2",
    "escalation-3",
    "escalation-4",
    "escalation-5",
    "escalation-6",
    "escalation-7",
    "escalation-8",
    "return-late",
]
ESCALATION_KINDS: tuple[AlertKind, ...] = get_args(AlertKind)[-9:-1]  # escalation-1 ... escalation-8


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
    # The forwarder state (VmRecord.epoch) ``lastSequence`` belongs to: positions compare as (epoch, sequence), so
    # a forwarder that lost its state and counts from 0 again is not taken for a replay.
    epoch: int = 0
    # Per phase (prepare|recover): the phase's outcome on this VM, and the hook that failed it ("" if none).
    hooks: dict[str, str] = Field(default_factory=dict)
    failedHooks: dict[str, str] = Field(default_factory=dict)
    hookSequence: int = -1
    hookEpoch: int = 0
    # What the event did to this VM as the VM measured it (forwarder/impact.py): the largest report's seconds and
    # how it was measured (pause | restart); None: no report (yet).
    impactSeconds: float | None = None
    impactMeasure: str = ""

    @property
    def position(self) -> tuple[int, int]:
        """How far this sighting has come: its latest envelope, a listing's or a hook report's, as (epoch, sequence)."""
        return max((self.epoch, self.lastSequence), (self.hookEpoch, self.hookSequence))

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
    # A Terminate whose own rule approves, held back because another pending delete of its scale set is not ready
    # (the platform couples them): that event's id, its VM and NotBefore (the latest the hold can last).
    heldBy: str = ""
    heldByVm: str = ""
    heldUntil: datetime | None = None
    # What held the event back: blackout | window | gate | budget | hooks | delete ("" when nothing did), its name
    # (the blackout, the rule whose window, the gate, the budget domain, the VMs whose hooks, the holding delete),
    # since when that same hold has held it, and until when (heldUntil; None when not known, e.g. a failing gate).
    holdKind: str = ""
    holdName: str = ""
    holdSince: datetime | None = None
    # Set when this decision withdrew an approval that was never delivered (it was decided again before being sent
    # again, and its conditions no longer held): which, and why. The Decision row's Reason starts with it; kept apart
    # from ``reason`` so that the next decision alike writes no row.
    withdrawal: str = ""
    # The view it was taken from: each VM's sighting position (``VmSighting.position``) by vmId. A VM's sighting
    # lives in its position, written after the event by the batch that brought it; a run reading in between sees the
    # event decided from a newer sighting than the one it reads, and must not replace that decision
    # (``EventRecord.older_view``).
    viewed: dict[str, tuple[int, int]] = Field(default_factory=dict)


class LostAnswer(BaseModel):
    """A request that reached its executor's listener and whose answer never came back: the listener went away with
    it outstanding (the VM deleted by the Terminate it had just executed, for one). Which VM, when the run sent it
    (its time), and what the sender saw."""

    model_config = ConfigDict(extra="ignore")

    executor: str
    sentAt: datetime
    reason: str = ""


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
    # A listener's "approved" says IMDS accepted StartRequests, not that the event started: the event must be seen
    # Started or gone by this time (set on delivery, and again when a platform hold is lifted), else an alert.
    confirmBy: datetime | None = None
    # The budget entities this approval claimed (coordinator/controls.claim_key), released when the event concludes.
    budgetKeys: list[str] = Field(default_factory=list)
    # Until when the conditions it was decided on hold, and which condition ends first (domain/expiry.py): the
    # request's notAfter is this or the delivery's deadline. Set again each time a retry is decided again. None in an
    # approval written before this field: its event's NotBefore bounds it.
    notAfter: datetime | None = None
    notAfterReason: str = ""
    # The policy it was decided under (Policy.fingerprint; "" for a person's approval).
    policyVersion: str = ""
    # Made by an escalation step (domain/escalation.py): NotBefore must be this near for the VM to execute it.
    nearNotBeforeSeconds: int | None = None
    # Made by an escalation's force step: the VM runs its own force hook of this name first ("accepted" meanwhile).
    forceHook: str = ""
    # Set when a request of this decision reached its executor's listener, which went away before answering (the
    # relay's 502): its outcome is unknown, IMDS may have accepted it (domain/lifecycle.py, ``lost_answer``).
    lostAnswer: LostAnswer | None = None


class OpenRequest(BaseModel):
    """A request sent to a VM's listener (or to ARM) and not answered: that VM may still execute it until ``until``
    (the request's notAfter, the coordinator's clock). No other VM, and no other decision, is sent the event before
    then (domain/approvals.py, ``reroute_at``): two executors never hold a valid approval for one event at once."""

    model_config = ConfigDict(extra="ignore")

    executor: str
    decisionId: str
    until: datetime


class PlatformHold(BaseModel):
    """An approved delete the platform does not start while another delete of its scale set is pending."""

    model_config = ConfigDict(extra="ignore")

    eventId: str
    vm: str = ""
    until: datetime | None = None
    since: datetime

    def describe(self) -> str:
        until = self.until.isoformat() if self.until else "its NotBefore"
        return f"held by the platform: delete of {self.vm or self.eventId} ({self.eventId}) pending until {until}"


class FactConflict(BaseModel):
    """A sighting whose facts contradict the record's (kept, never merged over it): the VM that claimed it, where,
    and each differing fact as (recorded, claimed)."""

    model_config = ConfigDict(extra="ignore")

    vm: str
    observedAt: datetime
    epoch: int = 0
    sequence: int
    facts: dict[str, tuple[str, str]]


# How long a decision's view outranks an older read of its VMs (EventRecord.older_view): the gap between a batch's
# event write and its VM positions' write is its sends' hand-off and one transaction, seconds at most.
VIEW_GRACE = timedelta(seconds=30)


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
    # When the coordinator first heard a VM list the event Started (the service's clock: the sighting's Event Hubs
    # enqueued time); None until then, and in a record written before this field.
    startedSeenAt: datetime | None = None
    seenScheduled: bool = False
    vms: dict[str, VmSighting] = Field(default_factory=dict)
    decision: DecisionRecord | None = None
    approval: ApprovalRecord | None = None
    # The steps of its rule's escalation ladder taken so far, each once (appended by pipeline/decide.py).
    escalation: list[EscalationTaken] = Field(default_factory=list)
    # The shadow policy's verdict, when one is configured (pipeline/shadow.py): recorded, never sent.
    shadow: ShadowVerdict | None = None
    # Once Completed, its VMs' way back in service (domain/returns.py); None when its rule asks for none.
    returnToService: ReturnWatch | None = None
    alerts: list[str] = Field(default_factory=list)
    # The alert outbox: kinds recorded by the write that made their transition, cleared once the card is sent.
    # ``pendingSince`` (when the oldest was recorded) lets the timer take over from a sender that crashed.
    pendingAlerts: list[str] = Field(default_factory=list)
    pendingSince: datetime | None = None
    # Where the reporting VMs' sightings are kept (their VM groups); ``vms`` is assembled from them on read.
    groups: list[str] = Field(default_factory=list)
    # The scale sets of the VMs in Resources (state.scale_set_key), kept on the event so that the pending deletes
    # of a scale set can be found without reading every VM group.
    scaleSets: list[str] = Field(default_factory=list)
    # Set while an approved delete waits for another pending delete of its scale set (the platform holds it).
    platformHold: PlatformHold | None = None
    # The VMs this event removed (Terminate/Preempt, then silent): they will never report it gone.
    removed: list[str] = Field(default_factory=list)
    # Where the facts on record come from: "vm" (a VM's first sighting) until Event Grid, the platform, reports the
    # event; its facts then replace a VM's (event_merge.py), "platform".
    factsFrom: Literal["vm", "platform"] = "vm"
    # Sightings that contradicted the facts on record (the latest MAX_CONFLICTS kept; ``conflictCount`` counts all).
    conflicts: list[FactConflict] = Field(default_factory=list)
    conflictCount: int = 0
    # The W3C traceparent of the envelope that first reported the event ("" if it carried none, or from a
    # coordinator older than this field): the decision's and the approval's spans continue that trace.
    traceparent: str = ""
    # The last request sent that its executor did not answer, while it may still be executed (OpenRequest).
    openRequest: OpenRequest | None = None
    # How many times the record was written (the store counts each write: state/entities.py, ``revised``): of two
    # copies of one event, the one with the higher revision is the newer (pipeline/fleet_cache.py keeps only it).
    revision: int = 0

    @property
    def open(self) -> bool:
        return self.state not in TERMINAL_STATES

    @property
    def awaiting_outcome(self) -> bool:
        """An approval decided whose outcome no run has recorded yet (lifecycle.sender_gone says what became of it
        once the event has left Scheduled): the timer keeps such an event in view after it concluded."""
        approval = self.approval
        return approval is not None and not approval.delivered and not approval.outcome

    @property
    def returning(self) -> list[str]:
        """Its VMs not back in service yet: the event concluded, and they still count as impacted."""
        watch = self.returnToService
        return watch.watched if watch is not None and watch.doneAt is None else []

    @property
    def impacting(self) -> list[str]:
        """The VMs it impacts while it holds a budget (``fleet_cache.holds_budget``): those it names while open, then
        those not back in service."""
        return self.resources if self.open else self.returning

    @property
    def scale_sets(self) -> set[str]:
        return {s.scaleSet for s in self.vms.values() if s.scaleSet}

    def view(self) -> dict[str, tuple[int, int]]:
        """Each sighting's position by vmId: what a decision taken now is taken from (``DecisionRecord.viewed``)."""
        return {s.vmId.lower(): s.position for s in self.vms.values() if s.vmId}

    def older_view(self, now: datetime) -> str:
        """The VM whose sighting, as read, is older than the one the standing decision was taken from ("" if none):
        the VM's position is not yet written by the batch that decided (or not yet read), so deciding from this
        record would take that decision back from a stale view. Only within ``VIEW_GRACE`` of the decision: a
        position that was never written (contended past its retries, or too large to store) holds no decision for
        longer; the VM's next envelope would have moved it past the view anyway."""
        decision = self.decision
        if decision is None or not decision.viewed or now - decision.decidedAt >= VIEW_GRACE:
            return ""
        viewed = decision.viewed
        for sighting in self.vms.values():
            if sighting.vmId and sighting.position < viewed.get(sighting.vmId.lower(), (-2, -2)):
                return sighting.name
        return ""


class Retirement(BaseModel):
    """Why a VM is gone: the event that removed it (a Terminate or Preempt naming it), and when it was retired."""

    model_config = ConfigDict(extra="ignore")

    eventId: str
    eventType: str
    at: datetime
    reason: str = ""


class ForwarderState(BaseModel):
    """Where a forwarder state (Envelope.stateId) this VM left stood: its own position and the events its last
    document listed. Sequences compare only within their state, so no envelope under another state, whatever its
    sequence, can make this one's later envelopes look old."""

    model_config = ConfigDict(extra="ignore")

    epoch: int
    lastSequence: int
    lastSeen: datetime
    listed: list[str] = Field(default_factory=list)


class ImdsFailure(BaseModel):
    """A forwarder that still sends heartbeats but cannot read IMDS (its health says no good poll for too long):
    since when (the heartbeat that showed it) and what it said."""

    model_config = ConfigDict(extra="ignore")

    since: datetime
    reason: str = ""


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
    # The forwarder's state identifier (Envelope.stateId) the position belongs to, and its epoch: every change of
    # state (a new one, or an earlier one speaking again) takes the next epoch, so positions, compared as
    # (epoch, sequence), grow in the order envelopes were applied. The states left are kept with their positions.
    stateId: str = ""
    epoch: int = 0
    otherStates: dict[str, ForwarderState] = Field(default_factory=dict)
    # Set while two forwarder states speak for this VM (a state it had left spoke again): one of them is not the
    # VM's forwarder (a forged identity, or a cloned disk). The pair alerted, as sorted state tags.
    stateConflict: list[str] = Field(default_factory=list)
    # Set when a Terminate/Preempt naming the VM concluded it and the VM fell silent: it is gone, not lost.
    retired: Retirement | None = None
    # Set while the VM's heartbeats say its forwarder cannot read IMDS (pipeline/health.py): one card when it is
    # set, none while it lasts, another only after a heartbeat showed it recovered.
    imdsFailing: ImdsFailure | None = None
    # The VM's card outbox, as the event's: kinds recorded by the write that set their condition (heartbeatLost,
    # stateConflict, imdsFailing), cleared once the card was sent; the timer sends those left after ALERT_GRACE.
    pendingAlerts: list[str] = Field(default_factory=list)
    pendingSince: datetime | None = None
    # Known only from Event Grid (pipeline/event_grid.py): no forwarder reported as this VM, so no heartbeat is
    # expected of it and no listener can execute its approvals (remote acknowledge can).
    agentless: bool = False
    # What this VM says of itself (its identity above, kept for display) that ARM's census does not, as last flagged
    # (domain/census.describe; "" while they agree): a Heartbeat row census-mismatch is written when it changes.
    censusMismatch: str = ""
    # This VM's sighting of each event it reported (the event record's ``vms`` entries live here, so that a
    # batch writes an event only when the event itself changes, and a VM's sightings with its position).
    sightings: dict[str, VmSighting] = Field(default_factory=dict)


class VmGroupRecord(BaseModel):
    """The VMs of one placement group (or scale set, or a lone VM) in one entity: the VMs that report an event
    together are read and written together, one operation per group instead of one per VM."""

    model_config = ConfigDict(extra="ignore")

    group: str
    vms: dict[str, VmRecord] = Field(default_factory=dict)


class SentAlerts(BaseModel):
    """Cards one batch sent, by event: the outbox entries they settle (the timer clears them in bulk)."""

    model_config = ConfigDict(extra="ignore")

    sentAt: datetime
    events: dict[str, list[str]]
    # VM cards, by the group their VM is kept in, then vmId (lower case).
    vms: dict[str, dict[str, list[str]]] = Field(default_factory=dict)


SCALE_SET_BUCKETS = 8


def group_key(identity: VmIdentity) -> str:
    """Where a VM's position is kept, from ``identity`` as given: its placement group (events reach a whole placement
    group; at most 100 VMs), else its scale set split in buckets (a scale set can hold 1,000 VMs and an entity
    1 MiB), else the VM alone. The coordinator places a VM by where ARM lists it (``pipeline/fleet.Fleet.group_of``),
    never by what the VM writes of itself when ARM lists it: a VM naming another placement group would otherwise
    write its position into that group's entity (contend on it, fill it towards 1 MiB)."""
    return placement_key(
        identity.vmId,
        placement_group=identity.placementGroupId,
        scale_set=identity.vmScaleSetName,
        subscription=identity.subscriptionId,
        resource_group=identity.resourceGroupName,
    )


def placement_key(vm_id: str, *, placement_group: str, scale_set: str, subscription: str, resource_group: str) -> str:
    """``group_key`` from the facts themselves (the caller says whose they are)."""
    if placement_group:
        return f"pg:{placement_group.lower()}"
    if scale_set:
        bucket = zlib.crc32(vm_id.lower().encode()) % SCALE_SET_BUCKETS
        return f"vmss:{subscription}/{resource_group}/{scale_set}#{bucket}".lower()
    return f"vm:{vm_id.lower()}"
