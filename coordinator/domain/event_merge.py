"""Observations merged into event records: one record per EventId from every VM that reports it.

Pure: takes an event's record (or none yet) and its observations from any number of VMs (coordinator/domain/
observations.py); gives an ``EventChange`` (coordinator/domain/lifecycle.py) with the VMs' sightings, hook outcomes
and history rows merged in, and the state advanced. An event's facts come from its first sighting: a sighting that
contradicts them is kept beside the record as a conflict, never merged over it (every VM of a fleet shares one
sender identity, so an envelope only claims to be its VM's). One exception: the platform outranks the VMs. The
first Event Grid sighting (``Observation.platform``: from the hub only the system topic may send to) that
contradicts facts a VM reported replaces them, and the VM's claim becomes the conflict; from then on the facts are
the platform's (``EventRecord.factsFrom``).

An event's sightings are kept by VM name, and each belongs to one VM: the vmId whose envelopes made it. Only that
VM's observations move it (its position, hooks, impact, "gone"): the door admits a VM under a name only when ARM's
census or the name's binding says the name is that vmId's (pipeline/attest.py), so an observation of another vmId
under a held name is that name's VM now (a VM created again, or a name ARM gave its real VM after another had
claimed it), whose listing starts its own sighting; positions of two VMs never compare.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from contracts.document import ScheduledEvent
from coordinator.domain.deletes import REMOVING_EVENTS
from coordinator.domain.history_rows import hook_row, impact_row, observation_row
from coordinator.domain.lifecycle import EventChange, advance, clone, raise_alert, transition
from coordinator.domain.model import EventRecord, FactConflict, VmSighting
from coordinator.domain.observations import Observation
from coordinator.domain.rows import HistoryRow

__all__ = ["apply_observations", "contradictions", "is_impactful", "new_record", "not_before", "scale_sets_of"]

FAILED_OUTCOMES = frozenset({"failed", "timed-out"})
# Fact conflicts kept on an event record (the count goes on).
MAX_CONFLICTS = 8


def is_impactful(record: EventRecord) -> bool:
    """DurationInSeconds 0 means 'no interruption' (documented); anything else deserves a person's attention."""
    return record.durationInSeconds != 0


def new_record(observation: Observation, now: datetime) -> EventRecord:
    event = observation.event
    if event is None:
        raise ValueError("a record starts from a 'listed' observation")
    return EventRecord(
        factsFrom="platform" if observation.platform else "vm",
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
        elif observation.kind == "impact":
            _apply_impact(change, sighting, observation, now)
        else:
            _apply_hook(change, sighting, observation, now)
    if created is not None:
        if not record.seenScheduled and record.everStarted:
            raise_alert(change, "started-without-notice", now)
        elif is_impactful(record):
            raise_alert(change, "new-event", now)
    advance(change, now)
    return change


def _observation_row(
    record: EventRecord,
    now: datetime,
    observation: Observation,
    status: str,
    conflict: tuple[str, dict[str, Any]] | None = None,
) -> HistoryRow:
    """The Observation row of ``observation``: its VM and its position (sequence, incarnation) as the VM sent it.
    ``conflict``: the reason and details of a sighting kept as a conflict (Outcome conflict)."""
    reason, details = conflict or ("", None)
    return observation_row(
        record=record,
        now=now,
        vm=observation.vm,
        status=status,
        incarnation=observation.incarnation,
        observed_at=observation.observed_at,
        sequence=observation.sequence,
        outcome="conflict" if conflict else "",
        reason=reason[:4000],
        details=details,
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
    claims = "; ".join(f"{fact} {claimed!r} (recorded {recorded!r})" for fact, (recorded, claimed) in found.items())
    _conflict(
        change,
        observation,
        now,
        FactConflict(
            vm=observation.vm.name,
            observedAt=observation.observed_at,
            epoch=observation.epoch,
            sequence=observation.sequence,
            facts=found,
        ),
        reason=f"{observation.vm.name} claims {claims}: kept as a conflict, not merged (the record's facts come "
        "from the first sighting; the VM that executes an approval checks them against its own IMDS)",
        details={"claimed": {fact: claimed for fact, (_, claimed) in found.items()}},
    )


def _platform_facts(
    change: EventChange, observation: Observation, found: dict[str, tuple[str, str]], now: datetime
) -> None:
    """The platform's facts replace those a VM reported first; the VMs' claim is kept as the conflict (with the
    facts as (recorded, claimed): the platform's now, the VMs' before), logged and alerted like any other."""
    event, record = observation.event, change.record
    assert event is not None
    reporters = sorted(name for name, sighting in record.vms.items() if sighting.epoch >= 0) or ["a VM"]
    record.eventType = event.EventType
    record.eventSource = event.EventSource
    record.durationInSeconds = event.DurationInSeconds
    record.resources = list(event.Resources) or record.resources
    record.notBefore = not_before(event) or record.notBefore
    record.factsFrom = "platform"
    facts = {fact: (claimed, recorded) for fact, (recorded, claimed) in found.items()}
    claims = "; ".join(f"{fact} {vms!r} (platform {platform!r})" for fact, (platform, vms) in facts.items())
    _conflict(
        change,
        observation,
        now,
        FactConflict(
            vm=", ".join(reporters)[:256],
            observedAt=record.createdAt,
            epoch=observation.epoch,
            sequence=observation.sequence,
            facts=facts,
        ),
        reason=f"Event Grid (the platform) contradicts the facts {', '.join(reporters)} reported first: {claims}; "
        "the platform's replace them and the VMs' claim is kept as the conflict",
        details={"replaced": {fact: vms for fact, (_, vms) in facts.items()}, "source": "event-grid"},
    )


def _conflict(
    change: EventChange,
    observation: Observation,
    now: datetime,
    conflict: FactConflict,
    *,
    reason: str,
    details: dict[str, Any],
) -> None:
    """Keeps ``conflict`` on the record (the latest MAX_CONFLICTS, and the count of them all), with the sighting's
    Observation row (Outcome conflict: ``reason`` and ``details`` say what was claimed) and the card."""
    record = change.record
    record.conflicts = [*record.conflicts, conflict][-MAX_CONFLICTS:]
    record.conflictCount += 1
    change.rows.append(
        _observation_row(
            record, now, observation, observation.event.EventStatus if observation.event else "", (reason, details)
        )
    )
    change.changed = True
    raise_alert(change, "facts-conflict", now)


def _same_vm(sighting: VmSighting, observation: Observation) -> bool:
    """Whether ``sighting`` is the observation's VM's (a sighting read without its identity counts as its own)."""
    return not sighting.vmId or sighting.vmId.lower() == observation.vm.vmId.lower()


def _apply_listed(change: EventChange, sighting: VmSighting | None, observation: Observation, now: datetime) -> None:
    event, record = observation.event, change.record
    if event is None:
        return
    if sighting is not None and not _same_vm(sighting, observation):
        if observation.epoch < 0 and sighting.epoch >= 0:
            return  # an Event Grid sighting is below every forwarder's, whoever it is taken for
        sighting = None  # another VM's sighting under this name: this VM's starts here (module docstring)
    elif sighting is not None and observation.position <= _seen_at(sighting):
        # Behind the VM's sighting (merged by time, a state it left can come after it): nothing to merge, but a lie
        # is still a lie, kept as a conflict (once per envelope).
        if found := contradictions(record, event):
            _keep_conflict(change, observation, found, now)
        return
    found = contradictions(record, event)
    if found and observation.platform and record.factsFrom == "vm":
        _platform_facts(change, observation, found, now)
    elif found:
        _keep_conflict(change, observation, found, now)
        return
    if _wrongly_concluded(record, observation):
        # An event left for good does not come back (EventIds are not reused): a VM it names that lists it after it
        # was concluded gone shows that some 'gone' was not true (sent under its name, or by a VM it does not name
        # before the ones it names had spoken). Opened again; a Started sighting moves it on (advance).
        approved = record.approval is not None and record.approval.delivered
        transition(
            change,
            "Approved" if approved else "Scheduled",
            now,
            f"listed again by {observation.vm.name}, which it names, after it was concluded "
            f"{record.state}: that conclusion rested on a 'gone' that was not true",
        )
    record.description = event.Description or record.description
    # NotBefore is "" once Started: keep the one announced while Scheduled.
    record.notBefore = record.notBefore or not_before(event)
    if event.EventStatus == "Started":
        record.everStarted = True
        if observation.vm.name in record.resources or record.eventType in REMOVING_EVENTS:
            # When it started is the named VMs' to say: a peer's Started (it may lie) would date an early start, which
            # the history then ties to a lost answer (lifecycle.started_unanswered). A delete or an eviction is the
            # exception: the VM it names is gone as it starts, and only its peers see it Started.
            record.startedSeenAt = record.startedSeenAt or observation.seen_at
    else:
        record.seenScheduled = True
    record.vms[observation.vm.name] = VmSighting(
        name=observation.vm.name,
        vmId=observation.vm.vmId,
        resourceId=observation.vm.resourceId,
        scaleSet=observation.vm.vmScaleSetName,
        placementGroup=observation.vm.placementGroupId,
        # The service's clock, not the VM's: a sighting's freshness says whether its VM can execute an approval.
        firstSeen=sighting.firstSeen if sighting else observation.seen_at,
        lastSeen=observation.seen_at,
        lastSequence=observation.sequence,
        epoch=observation.epoch,
        incarnation=observation.incarnation,
        status=event.EventStatus,
        hooks=dict(sighting.hooks) if sighting else {},
        failedHooks=dict(sighting.failedHooks) if sighting else {},
        hookSequence=sighting.hookSequence if sighting else -1,
        hookEpoch=sighting.hookEpoch if sighting else 0,
        impactSeconds=sighting.impactSeconds if sighting else None,
        impactMeasure=sighting.impactMeasure if sighting else "",
    )
    record.scaleSets = scale_sets_of(record)
    change.rows.append(_observation_row(record, now, observation, event.EventStatus))
    change.changed = True


def _wrongly_concluded(record: EventRecord, observation: Observation) -> bool:
    """A concluded event that never started, listed again by a VM it names, from that VM's forwarder (not an Event
    Grid sighting, epoch -1). One that started may still be listed Started by a VM that lags: that is no reopening."""
    return (
        record.state in ("Canceled", "Completed")
        and not record.everStarted
        and not record.removed
        and observation.epoch >= 0
        and observation.vm.name in record.resources
    )


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
    if sighting is None or not _same_vm(sighting, observation) or observation.position <= _seen_at(sighting):
        return
    change.record.vms[observation.vm.name] = sighting.model_copy(
        update={
            "status": "Gone",
            "epoch": observation.epoch,
            "lastSequence": observation.sequence,
            "lastSeen": observation.seen_at,
            "incarnation": observation.incarnation,
        }
    )
    change.rows.append(_observation_row(change.record, now, observation, "Gone"))
    change.changed = True


def _apply_hook(change: EventChange, sighting: VmSighting | None, observation: Observation, now: datetime) -> None:
    """A phase report (``steps``) sets the VM's phase outcome. A per-hook report from an older forwarder tells of
    one hook only: it can fail the phase, but never turn a failure in the same phase back into success."""
    hook = observation.hook
    if (
        hook is None
        or sighting is None
        or not _same_vm(sighting, observation)
        or observation.position <= (sighting.hookEpoch, sighting.hookSequence)
    ):
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
    change.rows.append(
        hook_row(
            record=change.record,
            now=now,
            vm=observation.vm,
            observed_at=observation.observed_at,
            sequence=observation.sequence,
            hook=hook,
            phase_outcome=hooks[hook.phase],
        )
    )
    change.changed = True


def _apply_impact(change: EventChange, sighting: VmSighting | None, observation: Observation, now: datetime) -> None:
    """A VM's measure of what the event did to it: the largest it reported is kept on its sighting (a Freeze that
    paused it twice is reported as each longer pause is seen), each report kept as an Impact row."""
    impact = observation.impact
    if impact is None or sighting is None or not _same_vm(sighting, observation):
        return
    if sighting.impactSeconds is not None and impact.measuredSeconds <= sighting.impactSeconds:
        return  # a replay, or a shorter pause than one already reported
    change.record.vms[observation.vm.name] = sighting.model_copy(
        update={"impactSeconds": impact.measuredSeconds, "impactMeasure": impact.measure}
    )
    change.rows.append(
        impact_row(
            record=change.record,
            now=now,
            vm=observation.vm,
            measure=impact.measure,
            measured_seconds=impact.measuredSeconds,
            start=impact.start,
            end=impact.end,
            observed_at=observation.observed_at,
            sequence=observation.sequence,
            actor="forwarder",
            details=impact.model_dump(
                mode="json", include={"clock", "monotonicGapSeconds", "wallGapSeconds", "bootTime", "announcedSeconds"}
            ),
        )
    )
    change.changed = True
