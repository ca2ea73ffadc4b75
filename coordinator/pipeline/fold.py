"""Fold, the second stage: each VM's envelopes -> observations -> event records and VM positions, committed.

Takes what ``ingest`` gave (the envelopes per VM, the Event Grid events); reads each VM's position (its VM group),
derives its observations with the pure ``observations.vm_observations`` (duplicates and stale envelopes dropped by
(stateId, sequence)) and adds the Event Grid sightings (``event_grid.sightings``); sets aside, as dead letters, the
messages of a VM whose envelopes could not be read against its position; folds the observations into the event
records with ``event_merge.apply_observations``, has each changed event decided (``decide.decide_all``, inside the
same ETag-checked write, so that of two instances only one decision commits; an approval it decides is planned
there too: attempt.intend), and writes the events, each with its rows in the outbox, then the VM positions, with
theirs. The committed ``EventChange``s go into the run's ``Work`` for the tail. VMs whose cached position turned
out stale (another instance moved them) are redone from a fresh read.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from coordinator.adapters import telemetry
from coordinator.domain.cards import raise_vm_alert
from coordinator.domain.census import describe
from coordinator.domain.deletes import ready_to_go
from coordinator.domain.event_merge import apply_observations
from coordinator.domain.history_rows import dead_letter_row, heartbeat_row, position_of
from coordinator.domain.lifecycle import EventChange
from coordinator.domain.model import EventRecord, VmRecord
from coordinator.domain.observations import Observation, VmUpdate, vm_position
from coordinator.pipeline import act, attempt, decide, event_grid, health
from coordinator.pipeline.ingest import Arrivals, dead_letter
from coordinator.pipeline.positions import VmBatch, save_vm_updates, unstorable, vm_updates
from coordinator.pipeline.run import Run
from coordinator.state.commit import BULK_ATTEMPTS, commit
from coordinator.state.events import aggregate, assemble, commit_event
from coordinator.state.store import ConcurrencyConflict, RecordTooLarge, Staged, Stored

log = logging.getLogger("coordinator")

# The rows an event's write leaves to the VM positions: they describe sightings, which are stored there. A replay of
# envelopes whose positions were not written makes them again, and only them.
SIGHTINGS = frozenset({"Observation"})


def fold(run: Run, arrivals: Arrivals) -> VmBatch:
    """The batch's arrivals folded into events and VM positions, committed. Returns the VMs' updates (who is new,
    who resumed)."""
    run.enter("fold")
    report = run.report
    updates = vm_updates(run, arrivals.by_vm, cached=True, traces=arrivals.traces, heard=heard_times(run, arrivals))
    add_grid_sightings(run, updates, arrivals.grid)
    report.duplicates += arrivals.grid_duplicates
    report.dead_lettered = set_aside(run, arrivals, updates.failed)
    stale = fold_updates(run, updates)
    for _attempt in range(BULK_ATTEMPTS):
        # Their sightings were not written with their positions: what the run derived for them goes.
        run.work.forget(stale)
        if stale - arrivals.by_vm.keys():
            # Only Event Grid spoke for these in this batch: nothing to redo them from; the platform's next
            # event for them (or their forwarder) writes their sightings.
            log.warning("Event Grid sightings of %s not written (contended)", sorted(stale - arrivals.by_vm.keys()))
            stale &= arrivals.by_vm.keys()
        if not stale:
            break
        # Another instance moved these VMs since this one cached their group (a partition changed hands):
        # what was derived from the old positions may miss a 'gone'. Redo them from the fresh positions: the events'
        # own facts re-applied are a no-op; their sightings, stored with the positions, are derived again.
        for vm_id in stale:
            report.accepted -= updates.updates[vm_id].applied
            report.duplicates -= updates.updates[vm_id].duplicates
        redo = vm_updates(
            run,
            {vm_id: arrivals.by_vm[vm_id] for vm_id in stale},
            cached=False,
            traces=arrivals.traces,
            heard=heard_times(run, arrivals),
        )
        updates.updates.update(redo.updates)
        updates.new_vms = (updates.new_vms - stale) | redo.new_vms
        stale = fold_updates(run, redo)
        updates.too_large.update(redo.too_large)
    if stale:
        # Still moved by another instance after every redo: their next envelopes start from the stored positions.
        log.warning("positions of %s not written (contended)", sorted(stale))
        run.work.forget(stale)
    # Decided again, its sightings now in its VMs' positions: events written undecided while their gates were read
    # (by the tail if it runs after the batch), waits on VMs in other positions (spread_waits), deletes (together).
    released = 0 if run.tail_after_batch else decide.decide_awaiting(run)
    released += decide.redecide_each(run, spread_waits(run))
    deleting = {
        scale_set
        for r in run.work.records.values()
        if r.eventType == "Terminate" and r.open and (r.approval is not None or ready_to_go(r))
        for scale_set in r.scaleSets
    }
    released += decide.approve_together(run, deleting)
    if released:
        report.events_changed += released
        act.send_decided(run)
    if updates.too_large:
        for vm_id in updates.too_large:
            report.accepted -= updates.updates[vm_id].applied
        report.dead_lettered += set_aside(run, arrivals, updates.too_large, first=len(arrivals.dead))
    return updates


def spread_waits(run: Run) -> list[str]:
    """The events this run wrote that more than one VM reports and that wait on what their VMs report: their hooks,
    this run bringing a hook report, or a decision this run left alone because its read of another VM was older
    than the decision's view (EventRecord.older_view). A sighting is written with its VM's position, after the
    event, and a group's write merges VM by VM: two runs folding two of its VMs side by side each read the other's
    older sighting, so neither decided from both (a delete naming two VMs waited for the timer with both hooks
    done). Read again once this run's positions are written, the last of those runs reads every VM's newest
    sighting."""
    # Only a run that brought a hook report reads again for hooks: of two runs that each brought one, the later reads
    # both; a run that brought none decided nothing new about hooks (a wave of deletes whose VMs report no hooks
    # reads nothing more).
    hooked = {row.EventId for row in run.work.rows if row.RecordType == "Hook"}
    return [
        r.eventId
        for r in run.work.records.values()
        if r.state == "Scheduled"
        and r.approval is None
        and r.eventId not in run.work.awaiting_gates
        and len(r.vms) > 1
        and (
            r.older_view(run.now) or (r.eventId in hooked and r.decision is not None and r.decision.holdKind == "hooks")
        )
    ]


def heard_times(run: Run, arrivals: Arrivals) -> dict[str, list[datetime]]:
    """When the service heard each VM's envelopes: their messages' Event Hubs enqueued times (the run's own clock
    for a message without one). A VM's freshness is judged by these, never by the VM's observedAt."""
    return {
        vm_id: [message.enqueued_time or run.now for message in messages] for vm_id, messages in arrivals.raw_of.items()
    }


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


def set_aside(run: Run, arrivals: Arrivals, failed: dict[str, str], *, first: int = 0) -> int:
    """Dead-letters the messages of the VMs whose envelopes could not be processed (``failed``: vmId -> why), then
    stores the batch's dead letters from the ``first`` on (those before were stored already). Returns how many it
    stored."""
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
    letters = arrivals.dead[first:]
    if letters:
        try:
            run.parts.store.put_dead_letters(letters)
        except Exception:  # the history rows and log lines keep them; the batch's good messages go on
            log.exception("could not store %d dead letters", len(letters))
    return len(letters)


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
                    **position_of(update.record),
                    now=now,
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
    flag_census(run, updates)
    committed = commit_events(run, observations, batch=updates)
    for change in committed:
        work.collect(change)
        keep_sightings(change, observations[change.record.eventId], updates)
        if change.created_from is not None:
            telemetry.event_detected(change.record.eventType)
    report.events_changed += len(committed) + decide.release_held(run, [c.record for c in committed])
    # The approvals just decided leave now, before anything else is written: the VM positions follow the send.
    # A VM whose position cannot be stored (set aside below) is no executor: its sightings are not written.
    deciding = {name for event_id in work.deliveries if (r := work.records.get(event_id)) for name in r.vms}
    act.send_decided(run, unstorable=unstorable(updates, deciding))
    # VM positions are written after the events: a crash in between replays the envelopes, which the
    # events' per-VM sequence makes harmless.
    return save_vm_updates(run, updates)


def flag_census(run: Run, batch: VmBatch) -> None:
    """What a VM's envelopes say of it that ARM's census does not (zone, domains, placement group, scale set, tags,
    vmId, or the VM itself) is kept as it said it (its identity, for display) and flagged: a Heartbeat row
    ``census-mismatch`` each time the difference changes (``VmRecord.censusMismatch``). Budgets and tag rules read
    ARM's facts either way."""
    for update in batch.updates.values():
        record = update.record
        if record.agentless or not update.applied:
            continue  # an Event Grid sighting says nothing of the VM itself
        found = run.fleet.disagreements(record.identity)
        if found is None:
            return  # no ARM census, or none usable now: nothing to hold the VMs' reports to
        summary = describe(found) if found else ""
        if summary == record.censusMismatch:
            continue
        update.record = record.model_copy(update={"censusMismatch": summary})
        if not found:
            continue
        run.work.rows.append(
            heartbeat_row(
                **position_of(record),
                now=run.now,
                outcome="census-mismatch",
                reason=(
                    f"{record.identity.name} reports {summary}: kept as it said, not counted: budgets and tag "
                    "rules read ARM's census"
                )[:4000],
                details={
                    "arm": {fact: arm for fact, (arm, _) in found.items()},
                    "reported": {f: r for f, (_, r) in found.items()},
                },
            )
        )


def keep_sightings(change: EventChange, observations: list[Observation], batch: VmBatch) -> None:
    for observation in observations:
        update = batch.updates.get(observation.vm.vmId.lower())
        sighting = change.record.vms.get(observation.vm.name)
        # Only the VM's own sighting goes with its position: the name may hold another VM's (event_merge.py).
        if update is not None and sighting is not None and sighting.vmId.lower() in ("", observation.vm.vmId.lower()):
            # Stored without the identity fields: the VM's position says them once.
            compact = sighting.model_copy(
                update={"name": "", "vmId": "", "resourceId": "", "scaleSet": "", "placementGroup": ""}
            )
            sightings = {**update.record.sightings, change.record.eventId: compact}
            update.record = update.record.model_copy(update={"sightings": sightings})


def start_trace(change: EventChange | None, batch: VmBatch) -> EventChange | None:
    """A new event's trace is the one of the envelope that first reported it (the forwarder's detection)."""
    first = change.created_from if change is not None else None
    if change is not None and first is not None:
        change.record.traceparent = batch.traces.get((first.vm.vmId.lower(), first.sequence), "")
    return change


def save_events(run: Run, writes: list[tuple[EventRecord, str | None]], staged: Sequence[Staged] = ()) -> None:
    """Writes the batch's events in transactions, each with its rows (``staged``), and keeps the ETag each deciding
    write gave: what the approval's outcome is written against, with no re-read."""
    for (record, _), etag in zip(writes, run.parts.store.save_events(writes, staged=staged), strict=True):
        run.work.etags[record.eventId] = etag


@dataclass
class _Applier:
    """Applies a batch's observations to one event at a time; an event whose observations cannot be applied, or
    whose record would be too large to store, is set aside for the rest of the batch (logged, a DeadLetter row)
    and the others go on."""

    run: Run
    batch: VmBatch
    failed: set[str] = field(default_factory=set)

    def set_aside(self, event_id: str, items: list[Observation], what: str, error: Exception) -> None:
        self.failed.add(event_id)
        vms = sorted({o.vm.name for o in items})
        log.error("event %s: observations from %s %s: %s", event_id, vms, what, error, exc_info=error)
        self.run.work.rows.append(
            dead_letter_row(
                now=self.run.now,
                event_id=event_id[:128],
                reason=f"observations {what}: {type(error).__name__}: {str(error)[:500]}",
                details={"vms": vms[:20]},
            )
        )

    def apply(self, record: EventRecord | None, event_id: str, items: list[Observation]) -> EventChange | None:
        if event_id in self.failed:
            return None
        batch = self.batch
        try:
            change = start_trace(apply_observations(record, items, self.run.now), batch)
        except Exception as error:
            self.set_aside(event_id, items, "could not be applied", error)
            return None
        if change is not None:
            reporting = {batch.key_of[o.vm.vmId.lower()] for o in items if o.vm.vmId.lower() in batch.key_of}
            if not reporting <= set(change.record.groups):
                change.record.groups = sorted(set(change.record.groups) | reporting)
                change.changed = True
            azure = self.run.fleet.scale_sets(change.record.resources)
            if azure is not None and azure != change.record.scaleSets:
                change.record.scaleSets, change.changed = azure, True
        return change


def commit_events(run: Run, observations: dict[str, list[Observation]], *, batch: VmBatch) -> list[EventChange]:
    if not observations:
        return []
    store, applier = run.parts.store, _Applier(run, batch)

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
    outbox, staging, awaiting = run.outbox(leave=SIGHTINGS), list[Staged](), list[str]()

    def applied_and_decided(assembled: dict[str, Stored[EventRecord]]) -> list[tuple[EventRecord, str | None]]:
        applied: list[tuple[EventChange, Stored[EventRecord] | None]] = []
        for event_id, items in observations.items():
            current = assembled.get(event_id)
            change = applier.apply(current.record if current else None, event_id, items)
            if change is not None:
                applied.append((change, current))
        with run.fleet.budgets.deferred(), run.fleet.gates_in_background():  # claims: written before the events
            awaiting[:] = [c.record.eventId for c in decide.decide_all(run, [c for c, _ in applied])]
        changes.clear()
        staging.clear()
        writes = []
        # One pass over the batch's VMs for all its approvals (one per approval cost approvals × the batch's VMs).
        too_large = unstorable(batch, {n for c, _ in applied if c.approval_decided for n in c.record.vms})
        for change, current in applied:
            if not change.changed:
                continue
            if change.approval_decided:
                # Planned before the write, so that its intent row is committed with it (attempt.intend).
                attempt.intend(run, change, unstorable=too_large)
            changes.append(change)
            # Only the event itself is written here, with the rows of what it records (transitions, decisions, the
            # intent); new sightings go with the VM positions, and their Observation rows with them (SIGHTINGS).
            if current is None or aggregate(change.record) != aggregate(current.record):
                writes.append((change.record, current.etag if current else None))
                staging.extend(outbox.pieces(f"event:{change.record.eventId}", change.rows))
        return writes

    # Another instance may write some of these events meanwhile (a placement group's VMs sit on several
    # Event Hubs partitions): re-read them all fresh and retry the transaction a few times, then one by one.
    try:
        commit(
            events_now,
            applied_and_decided,
            lambda writes, _assembled: written(run, writes, staging),
            what="events of the batch",
            attempts=BULK_ATTEMPTS,
            on_conflict=run.report.count_conflict,
        )
        outbox.written.extend(staging)
        run.work.awaiting_gates.extend(awaiting)
        return changes
    except ConcurrencyConflict:
        pass
    except RecordTooLarge:
        pass  # an event too large for its entity: each on its own, where it is set aside
    return _commit_one_by_one(run, applier, changes, observations)


def written(run: Run, writes: list[tuple[EventRecord, str | None]], staging: list[Staged]) -> None:
    """The batch's budget claims (deferred while deciding: one transaction, not one request per approval), then
    its events: an approval's claim is always written before the approval is."""
    run.fleet.budgets.flush()
    save_events(run, writes, staging)


def _commit_one_by_one(
    run: Run, applier: _Applier, changes: list[EventChange], observations: dict[str, list[Observation]]
) -> list[EventChange]:
    """Each event redone on its own from a fresh read: another instance keeps writing some of them, or one of them
    is too large to store (set aside)."""
    committed = []
    for change in list(changes):
        event_id = change.record.eventId

        def redo(
            record: EventRecord | None, event_id: str = event_id, items: list[Observation] = observations[event_id]
        ) -> EventChange | None:
            redone = applier.apply(record, event_id, items)
            if redone is not None:
                decide.decide_all(run, [redone])
                if redone.approval_decided:
                    attempt.intend(run, redone, unstorable=unstorable(applier.batch, set(redone.record.vms)))
            return redone

        try:
            result = commit_event(
                run.parts.store,
                event_id,
                redo,
                on_conflict=run.report.count_conflict,
                etags=run.work.etags,
                outbox=run.outbox(leave=SIGHTINGS),
            )
        except RecordTooLarge as error:
            applier.set_aside(event_id, observations[event_id], "make a record too large to store", error)
            continue
        if result is not None:
            committed.append(result)
    return committed
