"""A VM's envelopes read against its position: what is new becomes observations, the rest is dropped.

Pure: takes a VM's stored record (``VmRecord``: its forwarder state, sequence, the events it lists) and its envelopes
in arrival order; gives a ``VmUpdate``: the observations (an event listed, gone from the list, a hook report) for
coordinator/domain/event_merge.py, the VM's new position, and the history rows about the VM itself (a forwarder
state reset, two states speaking in turn). Re-reading an envelope the position already holds changes nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

from contracts.document import ScheduledEvent
from contracts.envelope import Envelope, ForwarderHealth, HookReport, ImpactReport, VmIdentity
from coordinator.domain.history_rows import heartbeat_row
from coordinator.domain.model import ForwarderState, VmRecord
from coordinator.domain.rows import HistoryRow

__all__ = [
    "Observation",
    "ObservationKind",
    "VmUpdate",
    "merge_vm_records",
    "minus",
    "state_tag",
    "vm_observations",
    "vm_position",
]

ObservationKind = Literal["listed", "gone", "hook", "impact"]
SIGHTING_RETENTION = timedelta(days=7)
# Forwarder states a VM left that are remembered with their positions (a late delivery from one is dropped).
PAST_STATES = 4


@dataclass(frozen=True)
class Observation:
    kind: ObservationKind
    event_id: str
    vm: VmIdentity
    sequence: int
    observed_at: datetime
    incarnation: int = 0
    event: ScheduledEvent | None = None
    hook: HookReport | None = None
    impact: ImpactReport | None = None
    # The VM's forwarder-state epoch (VmRecord.epoch) the sequence belongs to.
    epoch: int = 0
    # When the service heard it (the message's Event Hubs enqueued time), which a VM's freshness is judged by:
    # observed_at is the VM's own clock, and a VM whose clock runs 6 minutes slow is not 6 minutes silent. None
    # when observed_at is the platform's clock already (an Event Grid eventTime).
    heard_at: datetime | None = None
    # From the platform (an Event Grid event on the platform's own hub), not from a VM: its facts outrank a VM's
    # (event_merge.py).
    platform: bool = False

    @property
    def position(self) -> tuple[int, int]:
        return (self.epoch, self.sequence)

    @property
    def seen_at(self) -> datetime:
        """When the service last heard of this VM through this observation, by the service's clock."""
        return self.heard_at or self.observed_at


@dataclass
class VmUpdate:
    """The result of reading one VM's envelopes against its last-seen position."""

    record: VmRecord
    observations: list[Observation]
    applied: int
    duplicates: int
    resumed: bool
    # History rows about the VM itself (forwarder state resets and conflicts).
    rows: list[HistoryRow] = field(default_factory=list)
    # A new pair of forwarder states was found speaking for this VM in turn: alert once.
    conflict: bool = False
    # The latest applied envelope's forwarder health and when it was observed (heartbeats of forwarders that report
    # it; coordinator/pipeline/health.py judges it).
    health: tuple[ForwarderHealth, datetime] | None = None


def state_tag(state_id: str) -> str:
    """A forwarder state as the history shows it: a digest, never the identifier itself. The identifier is what
    keeps one forwarder's sequence apart from envelopes that others send under the VM's name (the fleet shares one
    sender identity), so it stays between the VM and the coordinator."""
    return hashlib.sha256(state_id.encode()).hexdigest()[:12] if state_id else "(none)"


def _state_row(envelope: Envelope, outcome: str, left: str, last_sequence: int, epoch: int) -> HistoryRow:
    """The row of a VM's forwarder state change, which the envelope speaks for (its time and sequence): ``reset``, a
    new state after ``left`` (at ``last_sequence``), or ``conflict``, a state the VM had left at ``last_sequence``
    speaking again after ``left``. ``epoch``: the VM's epoch after it."""
    old, new = state_tag(left), state_tag(envelope.stateId)
    if outcome == "reset":
        reason = (
            f"forwarder state changed from {old} to {new} after sequence {last_sequence}: a forwarder that lost "
            f"its state; its position restarts at sequence {envelope.sequence}"
        )
        states = {"oldState": old, "newState": new}
    else:
        reason = (
            f"forwarder state {new}, which this VM had left at sequence {last_sequence}, speaks again (sequence "
            f"{envelope.sequence}) after state {old}: two forwarders send as {envelope.vm.name} (a forged identity "
            "or a cloned disk); each is heard at its own position, neither can silence the other"
        )
        states = {"state": new, "otherState": old}
    return heartbeat_row(
        vm=envelope.vm,
        now=envelope.observedAt,
        observed_at=envelope.observedAt,
        sequence=envelope.sequence,
        actor="forwarder",
        outcome=outcome,
        reason=reason,
        details={**states, "lastSequence": last_sequence, "newSequence": envelope.sequence, "epoch": epoch},
    )


@dataclass
class _Position:
    """A VM's position while its envelopes are read: the forwarder state it is in and the states it left."""

    state_id: str
    epoch: int
    last_sequence: int
    listed: list[str]
    last_seen: datetime
    others: dict[str, ForwarderState]
    state_conflict: list[str]
    conflict: bool = False

    def enter(self, envelope: Envelope, rows: list[HistoryRow]) -> bool:
        """Moves to the envelope's forwarder state if it is another one; False when the envelope is not new there."""
        if envelope.stateId == self.state_id:
            return envelope.sequence > self.last_sequence
        known = self.others.get(envelope.stateId)
        if known is not None and envelope.sequence <= known.lastSequence:
            return False  # a late delivery from a state this VM has left
        # The state left is kept with its position and list; the state entered takes the next epoch.
        self.others[self.state_id] = ForwarderState(
            epoch=self.epoch, lastSequence=self.last_sequence, lastSeen=self.last_seen, listed=self.listed
        )
        self.epoch += 1
        if known is None:
            rows.append(_state_row(envelope, "reset", self.state_id, self.last_sequence, self.epoch))
            self.last_sequence = -1  # the events the old state listed are 'gone' if the new one does not list them
        else:
            rows.append(_state_row(envelope, "conflict", self.state_id, known.lastSequence, self.epoch))
            pair = sorted({state_tag(self.state_id), state_tag(envelope.stateId)})
            self.conflict = self.conflict or pair != self.state_conflict
            self.state_conflict = pair
            self.last_sequence, self.listed = known.lastSequence, list(known.listed)
            del self.others[envelope.stateId]
        self.state_id = envelope.stateId
        # The states left longest ago are forgotten first (one that speaks again later counts as new).
        self.others = dict(list(self.others.items())[-PAST_STATES:])
        return True


def vm_observations(
    previous: VmRecord | None, envelopes: Iterable[Envelope], *, heard_at: Sequence[datetime]
) -> VmUpdate:
    """Reads one VM's envelopes in arrival order (the Event Hubs partition's order: partition key = the VM), drops
    what the VM record already holds (duplicates by (stateId, sequence), stale deliveries), and turns the rest into
    observations, including 'gone' for events that a newer document of the same forwarder state no longer lists.

    Every VM of a fleet holds the same Event Hubs sender identity, so an envelope only claims to come from its VM.
    Sequences therefore compare only within their forwarder state: an envelope under a new stateId is a forwarder
    that lost its state (accepted, its position starts there, a history row says so), and one under a state the VM
    had left is accepted when its sequence is new for that state: two states speaking in turn is a conflict
    (a history row and a card), never a reason to drop either. No sequence, however large, under one state moves
    another state's position.

    ``heard_at`` gives, for each envelope, when the service heard it (its message's Event Hubs enqueued time): the
    VM's ``lastSeen`` and its sightings' are those times, so that its freshness is judged by the service's clock,
    never by the VM's ``observedAt`` (kept in the history as what the VM said)."""
    ordered = list(envelopes)
    if not ordered:
        raise ValueError("vm_observations needs at least one envelope")
    record = previous or VmRecord(identity=ordered[0].vm, lastSeen=heard_at[0], stateId=ordered[0].stateId)
    position = _Position(
        state_id=record.stateId,
        epoch=record.epoch,
        last_sequence=record.lastSequence,
        listed=list(record.listed),
        last_seen=record.lastSeen,
        others=dict(record.otherStates),
        state_conflict=list(record.stateConflict),
    )
    last_incarnation = record.lastIncarnation
    identity = record.identity
    observations: list[Observation] = []
    rows: list[HistoryRow] = []
    applied = duplicates = 0
    health: tuple[ForwarderHealth, datetime] | None = None
    for envelope, heard in zip(ordered, heard_at, strict=True):
        if not position.enter(envelope, rows):
            duplicates += 1
            continue
        applied += 1
        if envelope.health is not None:
            health = (envelope.health, envelope.observedAt)
        position.last_sequence = envelope.sequence
        position.last_seen = max(position.last_seen, heard)
        identity = envelope.vm
        if envelope.kind == "incarnation" and envelope.document is not None:
            last_incarnation = envelope.document.DocumentIncarnation
        observations.extend(_observed(envelope, position, heard))
    # Sightings of events this VM no longer lists are kept a week (the event concludes long before) for the
    # record's "gone from every VM" check, then dropped.
    keep_after = minus(position.last_seen, SIGHTING_RETENTION)
    still_listed = set(position.listed).union(*(state.listed for state in position.others.values()))
    sightings = {k: v for k, v in record.sightings.items() if k in still_listed or v.lastSeen >= keep_after}
    back = applied > 0 and (record.heartbeatLost or record.retired is not None)
    updated = record.model_copy(
        update={
            "sightings": sightings,
            "identity": identity,
            "lastSequence": position.last_sequence,
            "lastIncarnation": last_incarnation,
            "lastSeen": position.last_seen,
            "listed": position.listed,
            "heartbeatLost": record.heartbeatLost and applied == 0,
            "stateId": position.state_id,
            "epoch": position.epoch,
            "otherStates": position.others,
            "stateConflict": position.state_conflict,
            # A retired VM that speaks again was not deleted after all (e.g. a Spot VM deallocated, then started).
            "retired": record.retired if applied == 0 else None,
        }
    )
    return VmUpdate(
        record=updated,
        observations=observations,
        applied=applied,
        duplicates=duplicates,
        resumed=back,
        rows=rows,
        conflict=position.conflict,
        health=health,
    )


def _observed(envelope: Envelope, position: _Position, heard: datetime) -> list[Observation]:
    """One applied envelope's observations at the VM's position: each event its document lists, each event its
    state listed before and no longer does ('gone'; the position's list moves on), or its hook or impact report."""

    def observation(kind: ObservationKind, event_id: str, **extra: Any) -> Observation:
        return Observation(
            kind=kind,
            event_id=event_id,
            vm=envelope.vm,
            sequence=envelope.sequence,
            observed_at=envelope.observedAt,
            epoch=position.epoch,
            heard_at=heard,
            **extra,
        )

    if envelope.kind == "hook" and envelope.hook is not None:
        return [observation("hook", envelope.hook.eventId, hook=envelope.hook)]
    if envelope.kind == "impact" and envelope.impact is not None:
        return [observation("impact", envelope.impact.eventId, impact=envelope.impact)]
    if envelope.kind != "incarnation" or envelope.document is None:
        return []
    document = envelope.document
    found: list[Observation] = []
    now_listed: list[str] = []
    for event in document.Events:
        if event.EventId not in now_listed:
            now_listed.append(event.EventId)
            found.append(observation("listed", event.EventId, incarnation=document.DocumentIncarnation, event=event))
    gone = [event_id for event_id in position.listed if event_id not in now_listed]
    found += [observation("gone", e, incarnation=document.DocumentIncarnation) for e in gone]
    position.listed = now_listed
    return found


def minus(moment: datetime, delta: timedelta) -> datetime:
    """``moment - delta`` that stays representable (a year-1 timestamp from a bad clock must not raise)."""
    try:
        return moment - delta
    except OverflowError:
        return datetime.min.replace(tzinfo=moment.tzinfo)


def vm_position(vm: VmRecord) -> tuple[int, int]:
    return (vm.epoch, vm.lastSequence)


def merge_vm_records(mine: VmRecord, theirs: VmRecord) -> VmRecord:
    """Two instances wrote the same VM: the record with the later (epoch, sequence) is the VM's latest position."""
    return mine if vm_position(mine) >= vm_position(theirs) else theirs
