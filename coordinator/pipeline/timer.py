"""The timer (every minute): what no envelope triggers. Takes what changed since the last tick (the instance's fleet
cache, pipeline/fleet.py) and the records of what is due.

Re-evaluates waiting events (``decide``), expires events past NotBefore, retires VMs a Terminate/Preempt removed and
concludes their events, concludes events whose VMs fell silent, retries approvals and cards that failed (``act``,
``outbox``), notices VMs whose heartbeat stopped, hourly runs the housekeeping (retention, hybrid connections), and
sets the fleet's gauges (VMs by condition, open events by type and state).
Counts into the run's ``Report``; every change goes through ``commit_event`` or a VM group's ETag. Ends with the
tail every run ends with (pipeline/tail.py).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from datetime import datetime

from coordinator.adapters import telemetry
from coordinator.adapters.gates import GatesPending
from coordinator.domain.approvals import start_overdue
from coordinator.domain.cards import raise_vm_alert
from coordinator.domain.deletes import Removal, removals
from coordinator.domain.history_rows import heartbeat_row, impact_row, position_of
from coordinator.domain.lifecycle import EventChange, advance, approval_step, clone, raise_alert, sender_gone
from coordinator.domain.model import EventRecord, Retirement, VmGroupRecord, VmRecord
from coordinator.domain.rows import HistoryRow
from coordinator.pipeline import act, attempt, decide, outbox, repairs, returns, tail
from coordinator.pipeline.fleet_cache import KnownVm, by_not_before
from coordinator.pipeline.housekeeping import Housekeeping, run_housekeeping
from coordinator.pipeline.record import adopt
from coordinator.pipeline.run import Run
from coordinator.pipeline.unanswered import concluded_unanswered, retry_due
from coordinator.state.events import assemble, commit_event
from coordinator.state.store import ConcurrencyConflict, Stored

log = logging.getLogger("coordinator")

Mutate = Callable[[EventRecord | None], EventChange | None]
Cards = dict[str, list[str]]  # the event cards the batches' logs say were sent, by EventId (outbox.sent_logs)


def tick(run: Run, housekeeping: Housekeeping) -> None:
    """Re-evaluates waiting events, expires, retires VMs that a Terminate/Preempt removed and concludes their
    events, concludes events whose VMs fell silent, retries approvals and alerts that failed, and notices VMs
    whose heartbeat stopped; then the tail."""
    run.enter("timer")
    now, store, report, work, fleet = run.now, run.parts.store, run.report, run.work, run.fleet
    # Rows a run stored in the outbox and did not write (it stopped, or its sink failed): written by this tick's tail.
    adopt(run)
    # What changed since the last tick, not the whole fleet: the instance's cache of every VM (a summary each) and
    # of the open events is refreshed by change (reading every VM group each minute cost 9.1 s per tick at 50,000
    # VMs); whole records are read only for what is due here, mostly from the store's cache.
    known = fleet.cache.vms(force=True)
    last_seen: dict[str, datetime] = {}
    for vm in known:
        last_seen[vm.name] = max(vm.last_seen, last_seen.get(vm.name, vm.last_seen))
    run.heard = last_seen  # an approval this tick decides is planned (attempt.intend) by these
    # A VM known only from Event Grid has no heartbeat to miss: its statuses (Completed, Canceled) say when it is done.
    agentless = {vm.name for vm in known if vm.agentless}
    heard = {vm.name: last_seen[vm.name] for vm in known if not vm.agentless}  # the VMs with a forwarder
    silent = frozenset(
        name
        for name, seen in last_seen.items()
        if seen < now - run.options.heartbeat_timeout and not (name in agentless and name not in heard)
    )
    open_ids = sorted(fleet.cache.open_events(force=True))
    read = store.get_events(open_ids, cached=True)
    fleet.cache.absorb(s.record for s in read.values())  # one the cache still held open may have concluded
    stored_open = {event_id: s for event_id, s in read.items() if s.record.open}
    found = removals([s.record for s in stored_open.values()], last_seen, now, run.options.retire_grace)
    groups = due_groups(run, known, stored_open, {r.vm for r in found})
    open_events = assemble(stored_open, {g.record.group: g for g in groups})
    report.open_events = len(open_events)
    groups = retire(run, groups, found, {event_id: s.record for event_id, s in stored_open.items()})
    retired = {vm.name: vm.retired_by for vm in known if vm.retired_by}
    retired.update({vm.identity.name: vm.retired.eventId for g in groups for vm in g.record.vms.values() if vm.retired})
    report.vms_retired = sum(1 for row in work.rows if row.Outcome == "retired")
    logs, settled, settled_vms = outbox.sent_logs(run)
    # Concluded events with work left; VMs back in service first: their budget is free for what this tick decides.
    closed = returns.watch(run, store.closed_events_with_pending_alerts())
    changes = reconsider_open(
        run,
        list(open_events.values()),
        lambda r: reconsider(run, r, silent=silent, retired=retired, last_seen=last_seen, heard=heard),
        settled=settled,
        last_seen=last_seen,
    )
    report.events_changed += decide.release_held(run, [c.record for c in changes])
    for stored in closed:
        outbox.queue_pending(concluded_unanswered(run, stored), now, work, settled)
    newest = {vm.vm_id: vm.group for vm in known}
    queue_vm_cards(run, groups, newest, settled_vms)
    heartbeats(run, groups, newest)
    repairs.reconcile(run, [work.records.get(s.record.eventId, s.record) for s in (*open_events.values(), *closed)])
    run_housekeeping(run, known, housekeeping)
    tail.finish(run, last_seen=last_seen, settled=tail.Settled(settled, settled_vms))
    if logs:
        store.delete_sent_alert_logs([key for key, _ in logs])
    census(run, known, [work.records.get(s.record.eventId, s.record) for s in open_events.values()])


def reconsider_open(
    run: Run,
    events: list[Stored[EventRecord]],
    mutate: Mutate,
    *,
    settled: Cards,
    last_seen: dict[str, datetime],
) -> list[EventChange]:
    """Each open event reconsidered (``mutate``) in its own write, closest to NotBefore first: when budget is short,
    the event that would start unapproved soonest gets it. Gates are read once per tick, each in a thread of its own:
    an event whose gates are still being read is reconsidered after the others, once what they approved is sent,
    so that a slow gate holds only the events that need it. Returns the committed changes."""
    changes, waiting = list[EventChange](), list[Stored[EventRecord]]()
    with run.fleet.gates_in_background():
        for stored in sorted(events, key=lambda s: by_not_before(s.record)):
            try:
                changes += _reconsidered(run, stored, mutate, settled)
            except GatesPending:
                waiting.append(stored)
    if waiting:
        act.send_decided(run, last_seen=last_seen)
        decide.after_gates(run)
    for stored in waiting:
        changes += _reconsidered(run, stored, mutate, settled)
    return changes


def _reconsidered(run: Run, stored: Stored[EventRecord], mutate: Mutate, settled: Cards) -> list[EventChange]:
    record, work = stored.record, run.work
    try:
        change = commit_event(
            run.parts.store, record.eventId, mutate, read=stored, etags=work.etags, outbox=run.outbox()
        )
    except ConcurrencyConflict:
        log.warning("event %s: contended; the next tick tries again", record.eventId)
        return []
    if change is not None:
        run.report.events_changed += 1
        work.collect(change)
        run.fleet.note(change.record)
        record = change.record
    retry_due(run, record)
    outbox.queue_pending(record, run.now, work, settled)
    return [change] if change is not None else []


def due_groups(
    run: Run, known: list[KnownVm], events: dict[str, Stored[EventRecord]], retiring: set[str]
) -> list[Stored[VmGroupRecord]]:
    """The VM groups this tick needs whole: those of the open events (their sightings), of the VMs to retire, of
    the VMs whose heartbeat is now lost, and of the VMs with cards pending. Read from the store's cache, which the
    refresh has just brought up to date; a group changed since fails its ETag when written."""
    timeout = run.now - run.options.heartbeat_timeout
    keys = {key for stored in events.values() for key in stored.record.groups}
    for vm in known:
        lost = not vm.heartbeat_lost and not vm.agentless and not vm.retired_by and vm.last_seen < timeout
        if lost or vm.pending or (vm.name in retiring and not vm.retired_by):
            keys.add(vm.group)
    return list(run.parts.store.get_vm_groups(keys, cached=True).values())


def census(run: Run, known: list[KnownVm], events: list[EventRecord]) -> None:
    """The fleet as this tick found it, for the gauges: VMs by condition (each counted once, the first that holds of
    retired, silent, unhealthy, reporting) and open events by type and state."""
    vms: Counter[str] = Counter()
    for vm in known:
        if vm.agentless:
            vms["agentless"] += 1
        elif vm.retired_by:
            vms["retired"] += 1
        elif vm.last_seen < run.now - run.options.heartbeat_timeout:
            vms["silent"] += 1
        elif vm.imds_failing:
            vms["unhealthy"] += 1
        else:
            vms["reporting"] += 1
    telemetry.census(vms, Counter((e.eventType, e.state) for e in events if e.open))


def reconsider(
    run: Run,
    record: EventRecord | None,
    *,
    silent: frozenset[str],
    retired: dict[str, str],
    last_seen: dict[str, datetime],
    heard: dict[str, datetime],
) -> EventChange | None:
    if record is None:
        return None
    now = run.now
    change = EventChange(record=clone(record))
    advance(change, now, silent_vms=silent, retired=retired, heard=heard)
    if not run.dry_run:
        sender_gone(change, now)
    if record.eventType == "Terminate" and record.approval is not None and record.approval.delivered:
        attempt.update_hold(run, change)
    if "not-started" not in change.record.alerts and start_overdue(change.record, now, last_seen):
        not_started(change, now)
    decide.decide(run, change)
    return attempt.intend(run, change)


def not_started(change: EventChange, now: datetime) -> None:
    """A listener answered "approved" and no VM saw the event Started or gone in time: an Approval row that says so
    (Actor platform) and one card naming the listener's answer."""
    approval = change.record.approval
    assert approval is not None
    by = approval.confirmBy.isoformat() if approval.confirmBy else "?"
    change.rows.append(
        approval_step(
            change.record,
            now,
            vm=approval.executor,
            actor="platform",
            outcome="not-started",
            reason=f"{approval.executor}'s listener answered '{approval.outcome}' but no VM saw the event Started or "
            f"gone by {by}",
        )
    )
    raise_alert(change, "not-started", now)


def retire(
    run: Run, groups: list[Stored[VmGroupRecord]], found: list[Removal], events: dict[str, EventRecord]
) -> list[Stored[VmGroupRecord]]:
    """Marks each removed VM as gone, with the event that removed it (a Heartbeat row, Outcome retired): no
    'heartbeat lost' for it, its events conclude, its hybrid connection goes with the next housekeeping. The end
    of the VM is that event's impact on it, measured here since the VM cannot: an Impact row (``removed``) and the
    VM's sighting of the event, for the card when the event concludes. Returns the groups as written (a group
    another instance changed meanwhile is left for the next tick)."""
    if not found:
        return groups
    now = run.now
    by_name = {r.vm: r for r in found}
    out = []
    for stored in groups:
        retiring = {
            vm_id: _retired(vm, by_name[vm.identity.name], now)
            for vm_id, vm in stored.record.vms.items()
            if vm.retired is None and vm.identity.name in by_name
        }
        if not retiring:
            out.append(stored)
            continue
        updated = stored.record.model_copy(update={"vms": {**stored.record.vms, **retiring}})
        rows = [row for vm in retiring.values() for row in _retired_rows(vm, events, by_name, now)]
        outbox = run.outbox()
        staged = outbox.pieces(f"group:{updated.group}", rows)
        try:
            etag = run.parts.store.save_vm_group(updated, stored.etag, vm_ids=retiring, staged=staged)
        except ConcurrencyConflict:
            out.append(stored)  # a VM of the group reported meanwhile: decided again next tick
            continue
        outbox.written.extend(staged)
        out.append(Stored(updated, etag))
        run.fleet.cache.groups_written([updated])
        run.work.rows.extend(rows)
    return out


def _retired_rows(
    vm: VmRecord, events: dict[str, EventRecord], by_name: dict[str, Removal], now: datetime
) -> list[HistoryRow]:
    """A retired VM's Heartbeat row (Outcome retired) and, when its end was measured, its Impact row."""
    assert vm.retired is not None
    rows = [
        heartbeat_row(
            **position_of(vm),
            now=now,
            outcome="retired",
            reason=vm.retired.reason,
            event_id=vm.retired.eventId,
            event_type=vm.retired.eventType,
        )
    ]
    record = events.get(vm.retired.eventId)
    sighting = vm.sightings.get(vm.retired.eventId)
    if record is not None and sighting is not None and sighting.impactSeconds is not None:
        rows.append(
            impact_row(
                record=record,
                now=now,
                vm=vm.identity,
                measure="removed",
                measured_seconds=sighting.impactSeconds,
                start=by_name[vm.identity.name].started,
                end=vm.lastSeen,
                observed_at=vm.lastSeen,
                sequence=vm.lastSequence,
                actor="coordinator",
            )
        )
    return rows


def _retired(vm: VmRecord, removal: Removal, now: datetime) -> VmRecord:
    """``vm`` retired by ``removal``, with the end it measured on the VM's sighting of the event: how long the VM
    was heard after the removal went ahead (its last envelope; 0 when it fell silent before)."""
    sightings = dict(vm.sightings)
    sighting = sightings.get(removal.event_id)
    if sighting is not None and removal.started is not None:
        lived = max(0.0, (vm.lastSeen - removal.started).total_seconds())
        sightings[removal.event_id] = sighting.model_copy(
            update={"impactSeconds": round(lived, 3), "impactMeasure": "removed"}
        )
    retirement = Retirement(eventId=removal.event_id, eventType=removal.event_type, at=now, reason=removal.reason)
    return vm.model_copy(update={"retired": retirement, "sightings": sightings})


def queue_vm_cards(
    run: Run, groups: list[Stored[VmGroupRecord]], newest: dict[str, str], settled: outbox.VmCards
) -> None:
    """The VMs' pending cards, to send in the tail; not those of a stray copy (a VM whose newest copy, ``newest``: its
    group by vmId, is in another group: it moved to the group ARM places it in; pipeline/housekeeping.py removes
    the copy), which is not the VM."""
    for group in groups:
        for vm_id, position in group.record.vms.items():
            if newest.get(vm_id, group.record.group) == group.record.group:
                outbox.queue_vm_pending(position, run.now, run.work, settled, group=group.record.group)


def heartbeats(run: Run, groups: list[Stored[VmGroupRecord]], newest: dict[str, str]) -> None:
    """Marks the VMs silent for the heartbeat timeout lost (a card and a row each), but not a stray copy: a VM whose
    newest copy (``newest``: its group by vmId) is in another group."""
    now, heartbeat_timeout = run.now, run.options.heartbeat_timeout
    timeout = int(heartbeat_timeout.total_seconds())
    for stored in groups:
        lost = {
            vm_id: raise_vm_alert(vm.model_copy(update={"heartbeatLost": True}), "heartbeat-lost", now)
            for vm_id, vm in stored.record.vms.items()
            if not vm.heartbeatLost
            and not vm.agentless
            and vm.retired is None
            and vm.lastSeen < now - heartbeat_timeout
            and newest.get(vm_id, stored.record.group) == stored.record.group
        }
        if not lost:
            continue
        updated = stored.record.model_copy(update={"vms": {**stored.record.vms, **lost}})
        rows = [
            heartbeat_row(**position_of(vm), now=now, outcome="lost", reason=f"no envelope for more than {timeout} s")
            for vm in lost.values()
        ]
        outbox = run.outbox()
        staged = outbox.pieces(f"group:{updated.group}", rows)
        try:
            run.parts.store.save_vm_group(updated, stored.etag, vm_ids=lost, staged=staged)
        except ConcurrencyConflict:
            continue  # a VM of the group reported meanwhile, or another instance noticed first: next tick
        outbox.written.extend(staged)
        run.work.rows.extend(rows)
        for vm in lost.values():
            run.report.heartbeats_lost += 1
            run.work.vm_alert(vm, "heartbeat-lost", group=updated.group)
