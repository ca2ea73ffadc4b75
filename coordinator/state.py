"""The state machine, as pure functions: envelopes -> per-VM observations -> merged event records -> transitions.

No I/O here: the service (service.py) reads records, calls these functions and writes the results with ETags.
Everything is idempotent: re-applying an envelope whose sequence a record already holds changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal

from coordinator.model import AlertKind, EventRecord, State, VmRecord, VmSighting
from coordinator.rows import HistoryRow
from forwarder.document import ScheduledEvent
from forwarder.envelope import Envelope, HookReport, VmIdentity

ObservationKind = Literal["listed", "gone", "hook"]
SIGHTING_RETENTION = timedelta(days=7)


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


@dataclass
class VmUpdate:
    """The result of reading one VM's envelopes against its last-seen position."""

    record: VmRecord
    observations: list[Observation]
    applied: int
    duplicates: int
    resumed: bool


def vm_observations(previous: VmRecord | None, envelopes: Iterable[Envelope]) -> VmUpdate:
    """Orders one VM's envelopes by sequence, drops what the VM record already holds (duplicates, stale
    out-of-order deliveries), and turns the rest into observations, including 'gone' for events that a newer
    document no longer lists."""
    ordered = sorted(envelopes, key=lambda e: e.sequence)
    if not ordered:
        raise ValueError("vm_observations needs at least one envelope")
    record = previous or VmRecord(identity=ordered[0].vm, lastSeen=ordered[0].observedAt)
    listed = list(record.listed)
    last_sequence = record.lastSequence
    last_incarnation = record.lastIncarnation
    last_seen = record.lastSeen
    identity = record.identity
    observations: list[Observation] = []
    applied = duplicates = 0
    for envelope in ordered:
        if envelope.sequence <= last_sequence:
            duplicates += 1
            continue
        applied += 1
        last_sequence = envelope.sequence
        last_seen = max(last_seen, envelope.observedAt)
        identity = envelope.vm
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
                    )
                )
            for event_id in listed:
                if event_id not in now_listed:
                    observations.append(
                        Observation(
                            kind="gone",
                            event_id=event_id,
                            vm=envelope.vm,
                            sequence=envelope.sequence,
                            observed_at=envelope.observedAt,
                            incarnation=document.DocumentIncarnation,
                        )
                    )
            listed = now_listed
        elif envelope.kind == "hook" and envelope.hook is not None:
            observations.append(
                Observation(
                    kind="hook",
                    event_id=envelope.hook.eventId,
                    vm=envelope.vm,
                    sequence=envelope.sequence,
                    observed_at=envelope.observedAt,
                    hook=envelope.hook,
                )
            )
    # Sightings of events this VM no longer lists are kept a week (the event concludes long before) for the
    # record's "gone from every VM" check, then dropped.
    keep_after = last_seen - SIGHTING_RETENTION
    sightings = {k: v for k, v in record.sightings.items() if k in listed or v.lastSeen >= keep_after}
    updated = record.model_copy(
        update={
            "sightings": sightings,
            "identity": identity,
            "lastSequence": last_sequence,
            "lastIncarnation": last_incarnation,
            "lastSeen": last_seen,
            "listed": listed,
            "heartbeatLost": record.heartbeatLost and applied == 0,
        }
    )
    return VmUpdate(
        record=updated,
        observations=observations,
        applied=applied,
        duplicates=duplicates,
        resumed=record.heartbeatLost and applied > 0,
    )


def merge_vm_records(mine: VmRecord, theirs: VmRecord) -> VmRecord:
    """Two instances wrote the same VM: the record with the higher sequence is the VM's latest position."""
    return mine if mine.lastSequence >= theirs.lastSequence else theirs


@dataclass
class EventChange:
    record: EventRecord
    rows: list[HistoryRow] = field(default_factory=list)
    alerts: list[AlertKind] = field(default_factory=list)
    changed: bool = False
    # This change (not an earlier write it re-read) decided the approval: only its writer sends it.
    approval_decided: bool = False


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
        notBefore=event.not_before(),
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
    created = False
    if record is None:
        first_listed = next((o for o in ordered if o.kind == "listed"), None)
        if first_listed is None:
            return None
        record = new_record(first_listed, now)
        created = True
    record = clone(record)
    change = EventChange(record=record, changed=created)
    for observation in ordered:
        sighting = record.vms.get(observation.vm.name)
        if observation.kind == "listed":
            _apply_listed(change, sighting, observation, now)
        elif observation.kind == "gone":
            _apply_gone(change, sighting, observation, now)
        else:
            _apply_hook(change, sighting, observation, now)
    if created:
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


def _apply_listed(change: EventChange, sighting: VmSighting | None, observation: Observation, now: datetime) -> None:
    event, record = observation.event, change.record
    if event is None or (sighting is not None and observation.sequence <= sighting.lastSequence):
        return
    record.resources = list(event.Resources) or record.resources
    record.description = event.Description or record.description
    record.durationInSeconds = event.DurationInSeconds
    record.eventType = event.EventType
    record.eventSource = event.EventSource
    # NotBefore is "" once Started: keep the one announced while Scheduled.
    record.notBefore = event.not_before() or record.notBefore
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
        incarnation=observation.incarnation,
        status=event.EventStatus,
        hooks=dict(sighting.hooks) if sighting else {},
        hookSequence=sighting.hookSequence if sighting else -1,
    )
    change.rows.append(_observation_row(record, now, observation, event.EventStatus))
    change.changed = True


def _apply_gone(change: EventChange, sighting: VmSighting | None, observation: Observation, now: datetime) -> None:
    if sighting is None or observation.sequence <= sighting.lastSequence:
        return
    change.record.vms[observation.vm.name] = sighting.model_copy(
        update={
            "status": "Gone",
            "lastSequence": observation.sequence,
            "lastSeen": observation.observed_at,
            "incarnation": observation.incarnation,
        }
    )
    change.rows.append(_observation_row(change.record, now, observation, "Gone"))
    change.changed = True


def _apply_hook(change: EventChange, sighting: VmSighting | None, observation: Observation, now: datetime) -> None:
    hook = observation.hook
    if hook is None or sighting is None or observation.sequence <= sighting.hookSequence:
        return
    change.record.vms[observation.vm.name] = sighting.model_copy(
        update={"hooks": {**sighting.hooks, hook.phase: hook.outcome}, "hookSequence": observation.sequence}
    )
    change.rows.append(
        event_row(
            change.record,
            now,
            "Hook",
            HookPhase=hook.phase,
            Outcome=hook.outcome,
            ObservedAt=observation.observed_at,
            Sequence=observation.sequence,
            Actor=hook.hook or "hook",
            Reason=f"exit code {hook.exitCode}, {hook.durationSeconds:.1f} s",
            Details={"outputTail": hook.outputTail[-1024:]} if hook.outputTail else None,
            **_vm_columns(observation.vm),
        )
    )
    change.changed = True


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


def advance(change: EventChange, now: datetime, *, silent_vms: frozenset[str] = frozenset()) -> None:
    """Derives the state from what the VMs said. ``silent_vms`` are VMs whose forwarder stopped reporting: they
    count as 'gone' once at least one VM has seen the event leave (a deleted VM never reports again)."""
    record = change.record
    if not record.open:
        return
    sightings = list(record.vms.values())
    gone = [s for s in sightings if s.status == "Gone"]
    remaining = [s for s in sightings if s.status != "Gone" and s.name not in silent_vms]
    approved = record.approval is not None and record.approval.delivered
    if record.everStarted and record.state not in ("Started",):
        reason = "seen Started"
        if not record.seenScheduled:
            reason = "appeared directly as Started (no notice: e.g. hardware failure)"
        elif not approved:
            reason = "seen Started without an approval from here (NotBefore passed or approved elsewhere)"
        transition(change, "Started", now, reason)
    if gone and not remaining:
        if record.everStarted:
            transition(change, "Completed", now, f"gone from every reporting VM ({len(gone)}) after Started")
        elif approved:
            transition(
                change, "Completed", now, f"gone from every reporting VM ({len(gone)}) after approval; Started not seen"
            )
        else:
            transition(change, "Canceled", now, f"gone from every reporting VM ({len(gone)}) without starting")
        return
    if record.state == "Scheduled" and record.notBefore is not None and now >= record.notBefore and not approved:
        transition(change, "Expired", now, f"NotBefore {record.notBefore.isoformat()} passed without approval")


def last_seen_by_name(record: EventRecord, vm_records: Iterable[VmRecord]) -> dict[str, datetime]:
    seen = {name: s.lastSeen for name, s in record.vms.items()}
    for vm in vm_records:
        if vm.identity.name in seen:
            seen[vm.identity.name] = max(seen[vm.identity.name], vm.lastSeen)
    return seen


def choose_executor(record: EventRecord, last_seen: dict[str, datetime], alive_after: datetime) -> VmSighting | None:
    """Which VM executes the approval: the first VM in Resources whose forwarder reported recently (the leader
    the docs suggest); otherwise any recently reporting VM that still lists the event (same placement group,
    since the event reached it)."""
    candidates = {
        name: s
        for name, s in record.vms.items()
        if s.status != "Gone" and last_seen.get(name, s.lastSeen) >= alive_after
    }
    for name in record.resources:
        if name in candidates:
            return candidates[name]
    if not candidates:
        return None
    return max(candidates.values(), key=lambda s: (last_seen.get(s.name, s.lastSeen), s.name))
