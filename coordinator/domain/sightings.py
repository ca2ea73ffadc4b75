"""The state machine, as pure functions: envelopes -> per-VM observations -> merged event records -> transitions.

No I/O here: the stages (coordinator/pipeline/fold.py for a batch, timer.py for the timer) read records, call these
functions and write the results with ETags. Everything is idempotent: re-applying an envelope whose sequence a record
already holds changes nothing. Longer than 400 lines on purpose: it is one state machine (a VM's position, an
event's merge, its transitions and conclusion), whose rules read best side by side.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Literal

from contracts.document import ScheduledEvent
from contracts.envelope import Envelope, ForwarderHealth, HookReport, VmIdentity
from coordinator.domain.model import (
    AlertKind,
    EventRecord,
    FactConflict,
    ForwarderState,
    PlatformHold,
    State,
    VmRecord,
    VmSighting,
)
from coordinator.domain.rows import HistoryRow

ObservationKind = Literal["listed", "gone", "hook"]
SIGHTING_RETENTION = timedelta(days=7)
# Forwarder states a VM left that are remembered with their positions (a late delivery from one is dropped).
PAST_STATES = 4
# The events that remove the VMs they name (a deleted or evicted VM stops answering IMDS for good).
REMOVING_EVENTS = frozenset({"Terminate", "Preempt"})
FAILED_OUTCOMES = frozenset({"failed", "timed-out"})
# Fact conflicts kept on an event record (the count goes on).
MAX_CONFLICTS = 8


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
    # The VM's forwarder-state epoch (VmRecord.epoch) the sequence belongs to.
    epoch: int = 0

    @property
    def position(self) -> tuple[int, int]:
        return (self.epoch, self.sequence)


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


def _state_row(vm: VmIdentity, envelope: Envelope, outcome: str, reason: str, details: dict[str, object]) -> HistoryRow:
    return HistoryRow(
        TimeGenerated=envelope.observedAt,
        RecordType="Heartbeat",
        ObservedAt=envelope.observedAt,
        Sequence=envelope.sequence,
        Outcome=outcome,
        Actor="forwarder",
        Reason=reason,
        Details=details,
        **_vm_columns(vm),
    )


def _reset_row(vm: VmIdentity, envelope: Envelope, old_state: str, last_sequence: int, epoch: int) -> HistoryRow:
    old, new = state_tag(old_state), state_tag(envelope.stateId)
    return _state_row(
        vm,
        envelope,
        "reset",
        f"forwarder state changed from {old} to {new} after sequence {last_sequence}: a forwarder that lost its "
        f"state; its position restarts at sequence {envelope.sequence}",
        {
            "oldState": old,
            "newState": new,
            "lastSequence": last_sequence,
            "newSequence": envelope.sequence,
            "epoch": epoch,
        },
    )


def _conflict_row(vm: VmIdentity, envelope: Envelope, current: str, known: ForwarderState, epoch: int) -> HistoryRow:
    old, new = state_tag(current), state_tag(envelope.stateId)
    return _state_row(
        vm,
        envelope,
        "conflict",
        f"forwarder state {new}, which this VM had left at sequence {known.lastSequence}, speaks again (sequence "
        f"{envelope.sequence}) after state {old}: two forwarders send as {vm.name} (a forged identity or a cloned "
        "disk); each is heard at its own position, neither can silence the other",
        {
            "state": new,
            "otherState": old,
            "lastSequence": known.lastSequence,
            "newSequence": envelope.sequence,
            "epoch": epoch,
        },
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
            rows.append(_reset_row(envelope.vm, envelope, self.state_id, self.last_sequence, self.epoch))
            self.last_sequence = -1  # the events the old state listed are 'gone' if the new one does not list them
        else:
            rows.append(_conflict_row(envelope.vm, envelope, self.state_id, known, self.epoch))
            pair = sorted({state_tag(self.state_id), state_tag(envelope.stateId)})
            self.conflict = self.conflict or pair != self.state_conflict
            self.state_conflict = pair
            self.last_sequence, self.listed = known.lastSequence, list(known.listed)
            del self.others[envelope.stateId]
        self.state_id = envelope.stateId
        # The states left longest ago are forgotten first (one that speaks again later counts as new).
        self.others = dict(list(self.others.items())[-PAST_STATES:])
        return True


def vm_observations(previous: VmRecord | None, envelopes: Iterable[Envelope]) -> VmUpdate:
    """Reads one VM's envelopes in arrival order (the Event Hubs partition's order: partition key = the VM), drops
    what the VM record already holds (duplicates by (stateId, sequence), stale deliveries), and turns the rest into
    observations, including 'gone' for events that a newer document of the same forwarder state no longer lists.

    Every VM of a fleet holds the same Event Hubs sender identity, so an envelope only claims to come from its VM.
    Sequences therefore compare only within their forwarder state: an envelope under a new stateId is a forwarder
    that lost its state (accepted, its position starts there, a history row says so), and one under a state the VM
    had left is accepted when its sequence is new for that state: two states speaking in turn is a conflict
    (a history row and a card), never a reason to drop either. No sequence, however large, under one state moves
    another state's position."""
    ordered = list(envelopes)
    if not ordered:
        raise ValueError("vm_observations needs at least one envelope")
    record = previous or VmRecord(identity=ordered[0].vm, lastSeen=ordered[0].observedAt, stateId=ordered[0].stateId)
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
    for envelope in ordered:
        if not position.enter(envelope, rows):
            duplicates += 1
            continue
        applied += 1
        if envelope.health is not None:
            health = (envelope.health, envelope.observedAt)
        position.last_sequence = envelope.sequence
        position.last_seen = max(position.last_seen, envelope.observedAt)
        identity = envelope.vm
        epoch = position.epoch
        if envelope.kind == "incarnation" and envelope.document is not None:
            document = envelope.document
            last_incarnation = document.DocumentIncarnation
            now_listed: list[str] = []
            for event in document.Events:
                if event.EventId in now_listed:
                    continue
                now_listed.append(event.EventId)
                observations.append(
                    Observation(
                        kind="listed",
                        event_id=event.EventId,
                        vm=envelope.vm,
                        sequence=envelope.sequence,
                        observed_at=envelope.observedAt,
                        incarnation=document.DocumentIncarnation,
                        event=event,
                        epoch=epoch,
                    )
                )
            for event_id in position.listed:
                if event_id not in now_listed:
                    observations.append(
                        Observation(
                            kind="gone",
                            event_id=event_id,
                            vm=envelope.vm,
                            sequence=envelope.sequence,
                            observed_at=envelope.observedAt,
                            incarnation=document.DocumentIncarnation,
                            epoch=epoch,
                        )
                    )
            position.listed = now_listed
        elif envelope.kind == "hook" and envelope.hook is not None:
            observations.append(
                Observation(
                    kind="hook",
                    event_id=envelope.hook.eventId,
                    vm=envelope.vm,
                    sequence=envelope.sequence,
                    observed_at=envelope.observedAt,
                    hook=envelope.hook,
                    epoch=epoch,
                )
            )
    # Sightings of events this VM no longer lists are kept a week (the event concludes long before) for the
    # record's "gone from every VM" check, then dropped.
    keep_after = _minus(position.last_seen, SIGHTING_RETENTION)
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


def _minus(moment: datetime, delta: timedelta) -> datetime:
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


@dataclass
class EventChange:
    record: EventRecord
    rows: list[HistoryRow] = field(default_factory=list)
    alerts: list[AlertKind] = field(default_factory=list)
    changed: bool = False
    # This change (not an earlier write it re-read) decided the approval: only its writer sends it.
    approval_decided: bool = False
    # The observation that created the record (None: the record existed): its envelope's trace is the event's.
    created_from: Observation | None = None


def event_row(record: EventRecord, now: datetime, record_type: str, **values: object) -> HistoryRow:
    """A history row about one event: its identifying columns, then ``values``."""
    base: dict[str, object] = {
        "TimeGenerated": now,
        "RecordType": record_type,
        "EventId": record.eventId,
        "EventType": record.eventType,
        "EventSource": record.eventSource,
        "State": record.state,
        "NotBefore": record.notBefore,
        "DurationInSeconds": record.durationInSeconds,
        "Resources": list(record.resources),
    }
    base.update(values)
    return HistoryRow.model_validate(base)


def _vm_columns(vm: VmIdentity) -> dict[str, object]:
    return {
        "VmName": vm.name,
        "VmId": vm.vmId,
        "VmResourceId": vm.resourceId,
        "ScaleSetName": vm.vmScaleSetName,
        "PlacementGroupId": vm.placementGroupId,
    }


def is_impactful(record: EventRecord) -> bool:
    """DurationInSeconds 0 means 'no interruption' (documented); anything else deserves a person's attention."""
    return record.durationInSeconds != 0


def new_record(observation: Observation, now: datetime) -> EventRecord:
    event = observation.event
    if event is None:
        raise ValueError("a record starts from a 'listed' observation")
    return EventRecord(
        eventId=event.EventId,
        eventType=event.EventType,
        eventSource=event.EventSource,
        resourceType=event.ResourceType,
        resources=list(event.Resources),
        description=event.Description,
        durationInSeconds=event.DurationInSeconds,
        notBefore=not_before(event),
        state="Scheduled",
        stateSince=now,
        createdAt=now,
    )


def clone(record: EventRecord) -> EventRecord:
    """A copy safe to change: containers copied, sightings and decisions shared (they are replaced, never
    changed in place), the approval copied (its attempt counters are). Much cheaper than a deep copy."""
    return record.model_copy(
        update={
            "resources": list(record.resources),
            "vms": dict(record.vms),
            "alerts": list(record.alerts),
            "pendingAlerts": list(record.pendingAlerts),
            "groups": list(record.groups),
            "approval": record.approval.model_copy() if record.approval else None,
        }
    )


def apply_observations(
    record: EventRecord | None, observations: Sequence[Observation], now: datetime
) -> EventChange | None:
    """Merges one event's observations (from any number of VMs) into its record. Returns None when there is
    no record and nothing could start one (a 'gone' or hook report for an event never seen listed)."""
    ordered = sorted(observations, key=lambda o: (o.observed_at, o.sequence))
    created: Observation | None = None
    if record is None:
        created = next((o for o in ordered if o.kind == "listed"), None)
        if created is None:
            return None
        record = new_record(created, now)
    record = clone(record)
    change = EventChange(record=record, changed=created is not None, created_from=created)
    for observation in ordered:
        sighting = record.vms.get(observation.vm.name)
        if observation.kind == "listed":
            _apply_listed(change, sighting, observation, now)
        elif observation.kind == "gone":
            _apply_gone(change, sighting, observation, now)
        else:
            _apply_hook(change, sighting, observation, now)
    if created is not None:
        if not record.seenScheduled and record.everStarted:
            raise_alert(change, "started-without-notice", now)
        elif is_impactful(record):
            raise_alert(change, "new-event", now)
    advance(change, now)
    return change


def _observation_row(record: EventRecord, now: datetime, observation: Observation, status: str) -> HistoryRow:
    return event_row(
        record,
        now,
        "Observation",
        EventStatus=status,
        DocumentIncarnation=observation.incarnation,
        ObservedAt=observation.observed_at,
        Sequence=observation.sequence,
        Actor="platform",
        **_vm_columns(observation.vm),
    )


def contradictions(record: EventRecord, event: ScheduledEvent) -> dict[str, tuple[str, str]]:
    """The facts a sighting claims differently from the record, as {fact: (recorded, claimed)}. The facts are what
    an approval rests on and what IMDS keeps for an event's life: EventType, EventSource, DurationInSeconds,
    Resources (as a set) and NotBefore while Scheduled (it is "" once Started)."""
    found: dict[str, tuple[str, str]] = {}
    if event.EventType != record.eventType:
        found["EventType"] = (record.eventType, event.EventType)
    if event.EventSource != record.eventSource:
        found["EventSource"] = (record.eventSource, event.EventSource)
    if event.DurationInSeconds != record.durationInSeconds:
        found["DurationInSeconds"] = (str(record.durationInSeconds), str(event.DurationInSeconds))
    if event.Resources and set(event.Resources) != set(record.resources):
        found["Resources"] = (", ".join(sorted(record.resources)), ", ".join(sorted(event.Resources)))
    claimed = not_before(event)
    if claimed is not None and record.notBefore is not None and claimed != record.notBefore:
        found["NotBefore"] = (record.notBefore.isoformat(), claimed.isoformat())
    return found


def _keep_conflict(
    change: EventChange, observation: Observation, found: dict[str, tuple[str, str]], now: datetime
) -> None:
    """A sighting that contradicts the record's facts is kept beside it (once per envelope), logged and alerted;
    the record, the VM's sighting and the state stay as they were."""
    record = change.record
    where = (observation.vm.name, observation.epoch, observation.sequence)
    if any((c.vm, c.epoch, c.sequence) == where for c in record.conflicts):
        return
    record.conflicts = [
        *record.conflicts,
        FactConflict(
            vm=observation.vm.name,
            observedAt=observation.observed_at,
            epoch=observation.epoch,
            sequence=observation.sequence,
            facts=found,
        ),
    ][-MAX_CONFLICTS:]
    record.conflictCount += 1
    claims = "; ".join(f"{fact} {claimed!r} (recorded {recorded!r})" for fact, (recorded, claimed) in found.items())
    row = _observation_row(record, now, observation, observation.event.EventStatus if observation.event else "")
    change.rows.append(
        row.model_copy(
            update={
                "Outcome": "conflict",
                "Reason": (
                    f"{observation.vm.name} claims {claims}: kept as a conflict, not merged (the record's facts come "
                    "from the first sighting; the VM that executes an approval checks them against its own IMDS)"
                )[:4000],
                "Details": {"claimed": {fact: claimed for fact, (_, claimed) in found.items()}},
            }
        )
    )
    change.changed = True
    raise_alert(change, "facts-conflict", now)


def _apply_listed(change: EventChange, sighting: VmSighting | None, observation: Observation, now: datetime) -> None:
    event, record = observation.event, change.record
    if event is None or (sighting is not None and observation.position <= _seen_at(sighting)):
        return
    found = contradictions(record, event)
    if found:
        _keep_conflict(change, observation, found, now)
        return
    if record.state == "Canceled" and not record.everStarted and sighting is not None and sighting.status == "Gone":
        # An event left for good does not come back (EventIds are not reused): a VM that lists it again after its
        # 'gone' concluded the event shows that 'gone' was not true (another forwarder state sent it as this VM).
        # Opened again as Scheduled; a Started sighting moves it on (advance).
        transition(
            change,
            "Scheduled",
            now,
            f"listed again by {observation.vm.name} after it was concluded gone: that 'gone' was not its forwarder's",
        )
    record.description = event.Description or record.description
    # NotBefore is "" once Started: keep the one announced while Scheduled.
    record.notBefore = record.notBefore or not_before(event)
    if event.EventStatus == "Started":
        record.everStarted = True
    else:
        record.seenScheduled = True
    record.vms[observation.vm.name] = VmSighting(
        name=observation.vm.name,
        vmId=observation.vm.vmId,
        resourceId=observation.vm.resourceId,
        scaleSet=observation.vm.vmScaleSetName,
        placementGroup=observation.vm.placementGroupId,
        firstSeen=sighting.firstSeen if sighting else observation.observed_at,
        lastSeen=observation.observed_at,
        lastSequence=observation.sequence,
        epoch=observation.epoch,
        incarnation=observation.incarnation,
        status=event.EventStatus,
        hooks=dict(sighting.hooks) if sighting else {},
        failedHooks=dict(sighting.failedHooks) if sighting else {},
        hookSequence=sighting.hookSequence if sighting else -1,
        hookEpoch=sighting.hookEpoch if sighting else 0,
    )
    record.scaleSets = scale_sets_of(record)
    change.rows.append(_observation_row(record, now, observation, event.EventStatus))
    change.changed = True


def _seen_at(sighting: VmSighting) -> tuple[int, int]:
    return (sighting.epoch, sighting.lastSequence)


def not_before(event: ScheduledEvent) -> datetime | None:
    """NotBefore as an aware UTC datetime, or None (empty once Started, or not a time this code can hold).

    IMDS sends RFC 1123 ("Mon, 11 Apr 2022 22:26:58 GMT"); ISO 8601 is accepted too (Microsoft's mock server); a
    time without a zone is taken as UTC; a time that cannot be expressed in UTC (year 1 east of Greenwich, year
    9999 west of it) is dropped rather than allowed to raise later."""
    value = event.not_before()
    if value is None and event.NotBefore:
        try:
            value = datetime.fromisoformat(event.NotBefore.replace("Z", "+00:00"))
        except ValueError:
            return None
    if value is None:
        return None
    try:
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    except OverflowError:
        return None


def scale_sets_of(record: EventRecord) -> list[str]:
    """The scale sets of the VMs an event names (a sighting says it; else the '{scale-set}_{instance}' name)."""
    found = set()
    for name in record.resources:
        sighting = record.vms.get(name)
        if sighting is not None:
            found.add(sighting.scaleSet)
        else:
            head, sep, tail = name.rpartition("_")
            found.add(head if sep and tail.isdigit() else "")
    return sorted(found - {""})


def _apply_gone(change: EventChange, sighting: VmSighting | None, observation: Observation, now: datetime) -> None:
    if sighting is None or observation.position <= _seen_at(sighting):
        return
    change.record.vms[observation.vm.name] = sighting.model_copy(
        update={
            "status": "Gone",
            "epoch": observation.epoch,
            "lastSequence": observation.sequence,
            "lastSeen": observation.observed_at,
            "incarnation": observation.incarnation,
        }
    )
    change.rows.append(_observation_row(change.record, now, observation, "Gone"))
    change.changed = True


def _apply_hook(change: EventChange, sighting: VmSighting | None, observation: Observation, now: datetime) -> None:
    """A phase report (``steps``) sets the VM's phase outcome. A per-hook report from an older forwarder tells of
    one hook only: it can fail the phase, but never turn a failure in the same phase back into success."""
    hook = observation.hook
    if hook is None or sighting is None or observation.position <= (sighting.hookEpoch, sighting.hookSequence):
        return
    hooks, failed_hooks = dict(sighting.hooks), dict(sighting.failedHooks)
    previous = hooks.get(hook.phase, "")
    if hook.phase_complete or previous not in FAILED_OUTCOMES:
        hooks[hook.phase] = hook.outcome
        failed_hooks.pop(hook.phase, None)
        if hook.failed_hook:
            failed_hooks[hook.phase] = hook.failed_hook
    change.record.vms[observation.vm.name] = sighting.model_copy(
        update={
            "hooks": hooks,
            "failedHooks": failed_hooks,
            "hookSequence": observation.sequence,
            "hookEpoch": observation.epoch,
        }
    )
    change.rows.append(_hook_row(change.record, now, observation, hook, hooks[hook.phase]))
    change.changed = True


def _hook_row(record: EventRecord, now: datetime, observation: Observation, hook: HookReport, phase: str) -> HistoryRow:
    """Actor is the hook that failed (else the hook, or "hook"); Reason lists every step of a phase report."""
    if hook.steps is not None:
        steps = "; ".join(
            f"{s.hook} {s.outcome} ({'' if s.exitCode is None else f'exit {s.exitCode}, '}{s.durationSeconds:.1f} s)"
            for s in hook.steps
        )
        reason = f"{hook.phase} phase {hook.outcome}: " + (steps or "no hooks installed")
        details: dict[str, object] | None = {
            "steps": [
                {
                    **s.model_dump(include={"hook", "outcome", "exitCode", "durationSeconds"}),
                    "outputTail": s.outputTail[-256:],
                }
                for s in hook.steps
            ],
            "failedHook": hook.failed_hook,
        }
    else:
        reason = f"{hook.hook or 'hook'} {hook.outcome}, exit code {hook.exitCode}, {hook.durationSeconds:.1f} s"
        if phase != hook.outcome:
            reason += f"; the {hook.phase} phase stays {phase} (an earlier hook of this phase did not succeed)"
        details = {"outputTail": hook.outputTail[-1024:]} if hook.outputTail else None
    return event_row(
        record,
        now,
        "Hook",
        HookPhase=hook.phase,
        Outcome=hook.outcome,
        ObservedAt=observation.observed_at,
        Sequence=observation.sequence,
        Actor=hook.failed_hook or hook.hook or "hook",
        Reason=reason[:4000],
        Details=details,
        **_vm_columns(observation.vm),
    )


def raise_alert(change: EventChange, kind: AlertKind, now: datetime) -> None:
    """Once per kind per event. The kind goes into the record's outbox (``pendingAlerts``) in the same write as
    the transition that causes it, so a crash before the card is sent leaves it for the timer, not lost."""
    record = change.record
    if kind not in record.alerts:
        record.alerts.append(kind)
        record.pendingAlerts.append(kind)
        record.pendingSince = record.pendingSince or now
        change.alerts.append(kind)
        change.changed = True


def transition(change: EventChange, to: State, now: datetime, reason: str, **values: object) -> None:
    record = change.record
    previous = record.state
    record.state = to
    record.stateSince = now
    change.changed = True
    change.rows.append(event_row(record, now, "Transition", PreviousState=previous, Reason=reason, **values))
    alert_for: dict[str, AlertKind] = {"Approved": "approved", "Canceled": "canceled", "Expired": "expired"}
    if to in alert_for:
        raise_alert(change, alert_for[to], now)


def advance(
    change: EventChange,
    now: datetime,
    *,
    silent_vms: frozenset[str] = frozenset(),
    retired: dict[str, str] | None = None,
) -> None:
    """Derives the state from what the VMs said. ``silent_vms`` are VMs whose forwarder stopped reporting: they
    count as 'gone' once at least one VM has seen the event leave (a deleted VM never reports again). ``retired``
    (VM name -> the event that removed it) are VMs known to be gone for good: they count as gone at once, so an
    event only they reported concludes ("VM removed")."""
    record = change.record
    if not record.open:
        return
    retired = retired or {}
    removed_here = {name for name, by in retired.items() if by == record.eventId and name in record.resources}
    if removed_here - set(record.removed):
        record.removed = sorted(set(record.removed) | removed_here)
        change.changed = True
    sightings = list(record.vms.values())
    gone = [s for s in sightings if s.status == "Gone" or s.name in retired]
    remaining = [s for s in sightings if s.status != "Gone" and s.name not in silent_vms and s.name not in retired]
    approved = record.approval is not None and record.approval.delivered
    if record.everStarted and record.state not in ("Started",):
        reason = "seen Started"
        if not record.seenScheduled:
            reason = "appeared directly as Started (no notice: e.g. hardware failure)"
        elif not approved:
            reason = "seen Started without an approval from here (NotBefore passed or approved elsewhere)"
        transition(change, "Started", now, reason)
    # A retired VM counts as gone, but not for an event that names VMs which have not reported it yet (their
    # envelopes may be held back, e.g. by an Event Hubs outage): only a VM that saw it leave can say it is over.
    unheard = [name for name in record.resources if name not in record.vms and name not in retired]
    only_retired = not any(s.status == "Gone" for s in gone)
    if gone and not remaining and not (unheard and only_retired):
        if record.removed:
            removed = ", ".join(record.removed)
            transition(change, "Completed", now, f"VM removed: {removed} left with this {record.eventType}")
        elif record.everStarted:
            transition(change, "Completed", now, f"gone from every reporting VM ({len(gone)}) after Started")
        elif approved:
            transition(
                change, "Completed", now, f"gone from every reporting VM ({len(gone)}) after approval; Started not seen"
            )
        else:
            others = sorted({retired[s.name] for s in gone if s.name in retired})
            why = f" (VM removed by {', '.join(others)})" if others else ""
            transition(change, "Canceled", now, f"gone from every reporting VM ({len(gone)}) without starting{why}")
        return
    if record.state == "Scheduled" and record.notBefore is not None and now >= record.notBefore and not approved:
        transition(change, "Expired", now, f"NotBefore {record.notBefore.isoformat()} passed without approval")


def start_overdue(record: EventRecord, now: datetime, last_seen: dict[str, datetime]) -> bool:
    """Whether an approval a listener answered "approved" was not followed by Started (or by the event leaving) by
    its ``confirmBy``: the listener's word is not the platform's. A delete the platform holds is not overdue (its
    time starts again when the hold is lifted). A Terminate/Preempt is overdue only while a VM it removes still
    speaks after that time: a removed VM says nothing more, and its retirement concludes the event."""
    approval = record.approval
    if (
        not record.open
        or record.state != "Approved"
        or record.everStarted
        or approval is None
        or not approval.delivered
        or approval.confirmBy is None
        or now < approval.confirmBy
        or record.platformHold is not None
    ):
        return False
    if any(s.status == "Gone" for s in record.vms.values()):
        return False
    if record.eventType in REMOVING_EVENTS:
        since = approval.confirmBy
        return any(seen >= since for name in record.resources if (seen := last_seen.get(name)) is not None)
    return True


def last_seen_by_name(record: EventRecord, vm_records: Iterable[VmRecord]) -> dict[str, datetime]:
    seen = {name: s.lastSeen for name, s in record.vms.items()}
    for vm in vm_records:
        if vm.identity.name in seen:
            seen[vm.identity.name] = max(seen[vm.identity.name], vm.lastSeen)
    return seen


def choose_executor(
    record: EventRecord,
    last_seen: dict[str, datetime],
    alive_after: datetime,
    *,
    leaving: dict[str, str] | None = None,
) -> VmSighting | None:
    """Which VM executes the approval: the first VM in Resources whose forwarder reported recently (the leader
    the docs suggest); otherwise any recently reporting VM that still lists the event (same placement group,
    since the event reached it). Never a VM that another event is removing (``leaving_vms``). A Terminate is
    approved only through the VM it deletes ("every VM in the scale set is only approving the EventID relevant for
    that VM only"): never a peer, so None when that VM is silent."""
    leaving = leaving or {}
    candidates = {
        name: s
        for name, s in record.vms.items()
        if s.status != "Gone"
        # An Event Grid sighting (coordinator/pipeline/event_grid.py) is no forwarder's: no listener to execute it.
        and s.epoch >= 0
        and last_seen.get(name, s.lastSeen) >= alive_after
        and leaving.get(name, record.eventId) == record.eventId
    }
    for name in record.resources:
        if name in candidates:
            return candidates[name]
    if not candidates or record.eventType == "Terminate":
        return None
    return max(candidates.values(), key=lambda s: (last_seen.get(s.name, s.lastSeen), s.name))


@dataclass(frozen=True)
class Removal:
    """A VM that a Terminate/Preempt removed: retire it (gone for good) with this event as the reason."""

    vm: str
    event_id: str
    event_type: str
    reason: str


def removal_evidence(record: EventRecord, now: datetime) -> str | None:
    """Why a Terminate/Preempt has removed (or is removing) the VMs it names, or None: it was seen Started (by any
    VM), or its NotBefore has passed (the platform goes at NotBefore whatever happens), or it was approved
    (StartRequests accepted) and is not held by another pending delete (an approved delete may go at once, before
    any poll sees Started)."""
    if record.eventType not in REMOVING_EVENTS or record.state in ("Canceled",):
        return None
    if record.everStarted:
        return "seen Started"
    if record.notBefore is not None and now >= record.notBefore:
        return f"its NotBefore {record.notBefore.isoformat()} passed"
    if record.approval is not None and record.approval.delivered and record.platformHold is None:
        return "approved through the platform and not held by another pending delete"
    return None


def leaving_vms(events: Iterable[EventRecord], now: datetime) -> dict[str, str]:
    """The VMs that an open Terminate/Preempt is removing now (VM name -> that event's id): no approval of another
    event may be sent through them, their listener may be gone before it answers. An approval decided for the
    removal counts from the deciding write, before it is delivered: approvals of one batch go out together, and a
    Freeze sent through a VM whose delete is being approved beside it would reach a listener that is leaving."""
    leaving: dict[str, str] = {}
    for record in events:
        decided = record.eventType in REMOVING_EVENTS and record.approval is not None
        if record.open and (decided or removal_evidence(record, now) is not None):
            for name in record.resources:
                leaving.setdefault(name, record.eventId)
    return leaving


def removals(
    events: Iterable[EventRecord], last_seen: dict[str, datetime], now: datetime, grace: timedelta
) -> list[Removal]:
    """Which silent VMs were removed, and by which event: a Terminate or Preempt naming the VM has removal evidence
    (``removal_evidence``), and then the VM has been silent for ``grace`` (longer than a forwarder's heartbeat
    interval: a VM that is still there keeps talking). Silence alone is never enough (that is a lost heartbeat,
    alerted)."""
    found: dict[str, Removal] = {}
    for record in events:
        evidence = removal_evidence(record, now)
        if evidence is None:
            continue
        for name in record.resources:
            seen = last_seen.get(name)
            if name in found or seen is None or seen >= _minus(now, grace):
                continue
            found[name] = Removal(
                vm=name,
                event_id=record.eventId,
                event_type=record.eventType,
                reason=(
                    f"removed by {record.eventType} {record.eventId} ({evidence}); silent since {seen.isoformat()}"
                    f" (more than {int(grace.total_seconds())} s)"
                ),
            )
    return sorted(found.values(), key=lambda r: r.vm)


def pending_delete(record: EventRecord, now: datetime) -> bool:
    """A delete the platform still waits on: an open Terminate, Scheduled, not approved, NotBefore ahead."""
    return (
        record.eventType == "Terminate"
        and record.state == "Scheduled"
        and record.approval is None
        and (record.notBefore is None or record.notBefore > now)
    )


def platform_hold(record: EventRecord, siblings: Iterable[EventRecord], now: datetime) -> PlatformHold | None:
    """An approved delete that has not started while another delete of its scale set is pending is held by the
    platform ("Approve all pending deletes"): the pending one that holds it longest (latest NotBefore)."""
    if record.eventType != "Terminate" or record.approval is None or record.everStarted or not record.open:
        return None
    mine = set(record.scaleSets)
    holders = [
        s for s in siblings if s.eventId != record.eventId and mine & set(s.scaleSets) and pending_delete(s, now)
    ]
    if not holders:
        return None
    far = datetime.max.replace(tzinfo=UTC)
    holder = max(holders, key=lambda s: (s.notBefore or far, s.eventId))
    since = record.platformHold.since if record.platformHold and record.platformHold.eventId == holder.eventId else now
    return PlatformHold(eventId=holder.eventId, vm=", ".join(holder.resources[:3]), until=holder.notBefore, since=since)
