"""Fold, the second stage: each VM's envelopes -> observations -> event records and VM positions, committed.

Takes what ``ingest`` gave (the envelopes per VM, the Event Grid events); reads each VM's position (its VM group),
derives its observations with the pure ``observations.vm_observations`` (duplicates and stale envelopes dropped by
(stateId, sequence)) and adds the Event Grid sightings (``event_grid.sightings``); sets aside, as dead letters, the
messages of a VM whose envelopes could not be read against its position; folds the observations into the event
records with ``event_merge.apply_observations``, has each changed event decided (``decide.decide_all``, inside the
same ETag-checked write, so that of two instances only one decision commits), and writes the events, then the VM
positions. The committed ``EventChange``s go into the run's ``Work`` for the tail. VMs whose cached position turned
out stale (another instance moved them) are redone from a fresh read.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from contracts.envelope import Envelope
from coordinator.adapters import telemetry
from coordinator.domain.cards import raise_vm_alert
from coordinator.domain.event_merge import apply_observations
from coordinator.domain.history_rows import dead_letter_row, heartbeat_row
from coordinator.domain.lifecycle import EventChange
from coordinator.domain.model import EventRecord, VmGroupRecord, VmRecord, group_key
from coordinator.domain.observations import Observation, VmUpdate, merge_vm_records, vm_observations, vm_position
from coordinator.pipeline import act, decide, event_grid, health
from coordinator.pipeline.ingest import Arrivals, dead_letter
from coordinator.pipeline.run import Run
from coordinator.state.commit import BULK_ATTEMPTS, commit
from coordinator.state.events import aggregate, assemble, commit_event
from coordinator.state.store import ConcurrencyConflict, Stored

log = logging.getLogger("coordinator")


@dataclass
class VmBatch:
    groups: dict[str, Stored[VmGroupRecord]]
    key_of: dict[str, str]
    updates: dict[str, VmUpdate] = field(default_factory=dict)
    new_vms: set[str] = field(default_factory=set)
    # VMs whose envelopes could not be processed, and why (dead-lettered by the caller).
    failed: dict[str, str] = field(default_factory=dict)
    # Each VM's (epoch, lastSequence) in the position its observations were derived from (None: no position).
    base: dict[str, tuple[int, int] | None] = field(default_factory=dict)
    # The trace context each envelope arrived with, by (vmId, sequence) (ingest.Arrivals.traces).
    traces: dict[tuple[str, int], str] = field(default_factory=dict)


def _etag(stored: Stored[Any] | None) -> str | None:
    return stored.etag if stored else None


def _set_aside(
    mine: dict[str, VmRecord], current: Stored[VmGroupRecord] | None, base: dict[str, tuple[int, int] | None]
) -> set[str]:
    """After a conflict on a VM group: takes out of ``mine`` the VMs not to write. Those already at this batch's
    position (written by an earlier part of this batch, or by an instance that processed the same envelopes), and
    those another instance moved since the position this batch started from: returned, to be redone."""
    stale = set()
    for vm_id, record in list(mine.items()):
        fresh = current.record.vms.get(vm_id) if current else None
        if fresh is None:
            continue
        if vm_position(fresh) == vm_position(record):
            del mine[vm_id]
        elif vm_position(fresh) != base.get(vm_id):
            stale.add(vm_id)
            del mine[vm_id]
    return stale


def fold(run: Run, arrivals: Arrivals) -> VmBatch:
    """The batch's arrivals folded into events and VM positions, committed. Returns the VMs' updates (who is new,
    who resumed)."""
    run.enter("fold")
    report = run.report
    updates = vm_updates(run, arrivals.by_vm, cached=True, traces=arrivals.traces)
    add_grid_sightings(run, updates, arrivals.grid)
    report.duplicates += arrivals.grid_duplicates
    report.dead_lettered = set_aside(run, arrivals, updates.failed)
    stale = fold_updates(run, updates)
    for _attempt in range(BULK_ATTEMPTS):
        if stale - arrivals.by_vm.keys():
            # Only Event Grid spoke for these in this batch: nothing to redo them from; the platform's next
            # event for them (or their forwarder) writes their sightings.
            log.warning("Event Grid sightings of %s not written (contended)", sorted(stale - arrivals.by_vm.keys()))
            stale &= arrivals.by_vm.keys()
        if not stale:
            break
        # Another instance moved these VMs since this one cached their group (a partition changed hands):
        # what was derived from the old positions may miss a 'gone'. Redo them from the fresh positions;
        # re-applying what was already applied is a no-op.
        for vm_id in stale:
            report.accepted -= updates.updates[vm_id].applied
            report.duplicates -= updates.updates[vm_id].duplicates
        redo = vm_updates(run, {vm_id: arrivals.by_vm[vm_id] for vm_id in stale}, cached=False, traces=arrivals.traces)
        updates.updates.update(redo.updates)
        updates.new_vms = (updates.new_vms - stale) | redo.new_vms
        stale = fold_updates(run, redo)
    return updates


def vm_updates(
    run: Run, by_vm: dict[str, list[Envelope]], *, cached: bool, traces: dict[tuple[str, int], str]
) -> VmBatch:
    """Each VM's envelopes read against its stored position: its observations and its new position."""
    key_of = {vm_id: group_key(envelopes[-1].vm) for vm_id, envelopes in by_vm.items()}
    groups = run.parts.store.get_vm_groups(set(key_of.values()), cached=cached)
    batch = VmBatch(groups=groups, key_of=key_of, traces=traces)
    for vm_id, envelopes in by_vm.items():
        stored = groups.get(key_of[vm_id])
        previous = stored.record.vms.get(vm_id) if stored else None
        try:
            batch.updates[vm_id] = vm_observations(previous, envelopes)
        except Exception as error:  # contained to this VM; the caller dead-letters its envelopes
            log.exception("VM %s: its envelopes could not be read against its position", vm_id)
            batch.failed[vm_id] = f"{type(error).__name__}: {str(error)[:500]}"
            del key_of[vm_id]
            continue
        batch.base[vm_id] = vm_position(previous) if previous else None
        if previous is None:
            batch.new_vms.add(vm_id)
    return batch


def add_grid_sightings(run: Run, batch: VmBatch, events: list[event_grid.GridEvent]) -> None:
    """Adds the Event Grid events' observations to the batch's VM updates, each under the VM it names (an update of
    its own for a VM no envelope of the batch spoke for)."""
    speaking = {vm_id: (batch.key_of[vm_id], update.record) for vm_id, update in batch.updates.items()}
    per_vm = event_grid.sightings(run.parts.store, events, speaking=speaking)
    if not per_vm:
        return
    groups = run.parts.store.get_vm_groups({s.key for s, _ in per_vm.values()} - set(batch.groups), cached=True)
    batch.groups.update(groups)
    for vm_id, (sighting, observations) in per_vm.items():
        update: VmUpdate | None = batch.updates.get(vm_id)
        if update is not None:  # its forwarder reported in this batch too: one VM, one update
            update.observations.extend(observations)
            update.applied += len(observations)
            continue
        stored = batch.groups.get(sighting.key)
        previous = stored.record.vms.get(vm_id) if stored else None
        record = previous or VmRecord(
            identity=sighting.identity, lastSeen=min(o.observed_at for o in observations), agentless=True
        )
        batch.updates[vm_id] = VmUpdate(
            record=record, observations=observations, applied=len(observations), duplicates=0, resumed=False
        )
        batch.key_of[vm_id] = sighting.key
        batch.base[vm_id] = vm_position(previous) if previous else None


def set_aside(run: Run, arrivals: Arrivals, failed: dict[str, str]) -> int:
    """Dead-letters the messages of the VMs whose envelopes could not be read against their position (``failed``:
    vmId -> why), then stores every dead letter of the batch. Returns how many were dead-lettered."""
    for vm_id, problem in failed.items():
        # Whatever broke on this VM's envelopes costs only this VM (its position does not move).
        for message in arrivals.raw_of.pop(vm_id, []):
            dead_letter(
                message,
                f"processing failed: {problem}",
                run.now,
                dead=arrivals.dead,
                work=run.work,
                where=f"an envelope of VM {vm_id}",
            )
    if arrivals.dead:
        try:
            run.parts.store.put_dead_letters(arrivals.dead)
        except Exception:  # the history rows and log lines keep them; the batch's good messages go on
            log.exception("could not store %d dead letters", len(arrivals.dead))
    return len(arrivals.dead)


def fold_updates(run: Run, updates: VmBatch) -> set[str]:
    """Observations -> events -> VM positions. Returns the VMs whose cached position turned out stale (not
    written: the caller redoes them)."""
    now, report, work, fleet = run.now, run.report, run.work, run.fleet
    observations: dict[str, list[Observation]] = defaultdict(list)
    for update in updates.updates.values():
        report.accepted += update.applied
        report.duplicates += update.duplicates
        for observation in update.observations:
            observations[observation.event_id].append(observation)
        if update.resumed:
            work.rows.append(
                heartbeat_row(
                    vm=update.record.identity,
                    now=now,
                    observed_at=update.record.lastSeen,
                    sequence=update.record.lastSequence,
                    incarnation=update.record.lastIncarnation,
                    outcome="resumed",
                    reason="heartbeat resumed",
                )
            )
        work.rows.extend(update.rows)
        if update.conflict:
            update.record = raise_vm_alert(update.record, "forwarder-conflict", now)
            work.vm_alerts.append((update.record, "forwarder-conflict"))
        health.assess(update, now, work, after=run.options.imds_failing_after, errors=run.options.imds_failing_errors)
    fleet.note_vms(update.record for update in updates.updates.values())
    committed = commit_events(run, observations, batch=updates)
    for change in committed:
        work.collect(change)
        keep_sightings(change, observations[change.record.eventId], updates)
        if change.created_from is not None:
            telemetry.event_detected(change.record.eventType)
    report.events_changed += len(committed) + decide.release_held(run, committed)
    # The approvals just decided leave now, before anything else is written: the VM positions follow the send.
    act.send_decided(run)
    # VM positions are written after the events: a crash in between replays the envelopes, which the
    # events' per-VM sequence makes harmless.
    return save_vm_updates(run, updates)


def keep_sightings(change: EventChange, observations: list[Observation], batch: VmBatch) -> None:
    for observation in observations:
        update = batch.updates.get(observation.vm.vmId.lower())
        sighting = change.record.vms.get(observation.vm.name)
        if update is not None and sighting is not None:
            # Stored without the identity fields: the VM's position says them once.
            compact = sighting.model_copy(
                update={"name": "", "vmId": "", "resourceId": "", "scaleSet": "", "placementGroup": ""}
            )
            sightings = {**update.record.sightings, change.record.eventId: compact}
            update.record = update.record.model_copy(update={"sightings": sightings})


def save_vm_updates(run: Run, batch: VmBatch) -> set[str]:
    mine: dict[str, dict[str, VmRecord]] = defaultdict(dict)
    for vm_id, update in batch.updates.items():
        if update.applied:
            mine[batch.key_of[vm_id]][vm_id] = update.record
    stale: set[str] = set()
    if not mine:
        return stale
    store = run.parts.store

    def merged(key: str, current: Stored[VmGroupRecord] | None) -> VmGroupRecord:
        vms = dict(current.record.vms) if current else {}
        for vm_id, record in mine[key].items():
            vms[vm_id] = merge_vm_records(record, vms[vm_id]) if vm_id in vms else record
        return VmGroupRecord(group=key, vms=vms)

    def groups_now(attempt: int) -> dict[str, Stored[VmGroupRecord]]:
        if attempt == 0:
            return batch.groups
        groups = store.get_vm_groups(mine)
        for key, vms in mine.items():
            stale.update(_set_aside(vms, groups.get(key), batch.base))
        return groups

    def all_groups(
        groups: dict[str, Stored[VmGroupRecord]],
    ) -> list[tuple[VmGroupRecord, str | None, Iterable[str] | None]]:
        return [(merged(key, groups.get(key)), _etag(groups.get(key)), vms) for key, vms in mine.items() if vms]

    count = run.report.count_conflict
    try:
        commit(
            groups_now,
            all_groups,
            lambda items, _groups: store.save_vm_groups(items),
            what="VM groups",
            attempts=BULK_ATTEMPTS,
            on_conflict=count,
        )
        return stale
    except ConcurrencyConflict:
        pass
    # Another instance wrote one of these groups (its VMs sit on other Event Hubs partitions): merge per VM.
    for key, vms in mine.items():

        def group_now(_attempt: int, key: str = key, vms: dict[str, VmRecord] = vms) -> Stored[VmGroupRecord] | None:
            current = store.get_vm_groups([key]).get(key)
            stale.update(_set_aside(vms, current, batch.base))
            return current

        def moved(
            current: Stored[VmGroupRecord] | None, key: str = key, vms: dict[str, VmRecord] = vms
        ) -> tuple[VmGroupRecord, dict[str, VmRecord]] | None:
            return (merged(key, current), vms) if vms else None

        try:
            commit(
                group_now,
                moved,
                lambda write, current: store.save_vm_group(write[0], _etag(current), vm_ids=write[1]),
                what=f"VM group {key}",
                on_conflict=count,
            )
        except ConcurrencyConflict:
            log.warning("VM group %s: not written (contended); its VMs' next envelopes move it", key)
    return stale


def start_trace(change: EventChange | None, batch: VmBatch) -> EventChange | None:
    """A new event's trace is the one of the envelope that first reported it (the forwarder's detection)."""
    first = change.created_from if change is not None else None
    if change is not None and first is not None:
        change.record.traceparent = batch.traces.get((first.vm.vmId.lower(), first.sequence), "")
    return change


def save_events(run: Run, writes: list[tuple[EventRecord, str | None]]) -> None:
    """Writes the batch's events in transactions, and keeps the ETag each deciding write gave: what the approval's
    outcome is written against, with no re-read."""
    for (record, _), etag in zip(writes, run.parts.store.save_events(writes), strict=True):
        run.work.etags[record.eventId] = etag


def commit_events(run: Run, observations: dict[str, list[Observation]], *, batch: VmBatch) -> list[EventChange]:
    if not observations:
        return []
    now, store, work = run.now, run.parts.store, run.work

    failed: set[str] = set()

    def apply(record: EventRecord | None, event_id: str, items: list[Observation]) -> EventChange | None:
        if event_id in failed:
            return None
        try:
            change = start_trace(apply_observations(record, items, now), batch)
        except Exception as error:
            # Contained to this event: its observations are set aside (logged, a DeadLetter row); the rest
            # of the batch goes on.
            failed.add(event_id)
            vms = sorted({o.vm.name for o in items})
            log.exception("event %s: observations from %s could not be applied", event_id, vms)
            work.rows.append(
                dead_letter_row(
                    now=now,
                    event_id=event_id[:128],
                    reason=f"observations could not be applied: {type(error).__name__}: {str(error)[:500]}",
                    details={"vms": vms[:20]},
                )
            )
            return None
        if change is not None:
            reporting = {batch.key_of[o.vm.vmId.lower()] for o in items if o.vm.vmId.lower() in batch.key_of}
            if not reporting <= set(change.record.groups):
                change.record.groups = sorted(set(change.record.groups) | reporting)
                change.changed = True
        return change

    def events_now(attempt: int) -> dict[str, Stored[EventRecord]]:
        # First attempt: an event no VM of the batch's groups has sighted and that is not among the open events the
        # instance knows is taken as new and inserted without reading it first (the insert is refused if another
        # instance made it; then everything is read). That read was one of the two Table requests before a new
        # event's approval left, at about the price of the deciding write itself.
        fresh = run.fleet.cache.probably_new(observations, batch.groups.values()) if attempt == 0 else set()
        stored = store.get_events(set(observations) - fresh, cached=attempt == 0)
        wanted = {key for s in stored.values() for key in s.record.groups} - set(batch.groups)
        groups = {**store.get_vm_groups(wanted, cached=attempt == 0), **batch.groups}
        return assemble(stored, groups)

    changes: list[EventChange] = []

    def applied_and_decided(
        assembled: dict[str, Stored[EventRecord]],
    ) -> list[tuple[EventRecord, str | None]]:
        applied: list[tuple[EventChange, Stored[EventRecord] | None]] = []
        for event_id, items in observations.items():
            current = assembled.get(event_id)
            change = apply(current.record if current else None, event_id, items)
            if change is not None:
                applied.append((change, current))
        decide.decide_all(run, [c for c, _ in applied])
        changes.clear()
        writes = []
        for change, current in applied:
            if not change.changed:
                continue
            changes.append(change)
            # Only the event itself is written here; new sightings go with the VM positions.
            if current is None or aggregate(change.record) != aggregate(current.record):
                writes.append((change.record, current.etag if current else None))
        return writes

    # Another instance may write some of these events meanwhile (a placement group's VMs sit on several
    # Event Hubs partitions): re-read them all fresh and retry the transaction a few times, then one by one.
    try:
        commit(
            events_now,
            applied_and_decided,
            lambda writes, _assembled: save_events(run, writes),
            what="events of the batch",
            attempts=BULK_ATTEMPTS,
            on_conflict=run.report.count_conflict,
        )
        return changes
    except ConcurrencyConflict:
        pass
    # Another instance keeps writing these events: redo each one on its own from a fresh read.
    committed = []
    for change in list(changes):
        event_id = change.record.eventId

        def redo(
            record: EventRecord | None, event_id: str = event_id, items: list[Observation] = observations[event_id]
        ) -> EventChange | None:
            redone = apply(record, event_id, items)
            if redone is not None:
                decide.decide_all(run, [redone])
            return redone

        result = commit_event(store, event_id, redo, on_conflict=run.report.count_conflict, etags=work.etags)
        if result is not None:
            committed.append(result)
    return committed
