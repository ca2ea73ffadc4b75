"""Return to service, the I/O half (the rules: coordinator/domain/returns.py).

``follow`` runs where an event is decided (``decide.decide``), so a batch that completes an event starts its watch in
the same write and a batch that brings a VM's recover report sees it back at once when its rule names no gate; no
gate is read for one VM in a batch (a slow readiness page must not hold a partition). ``watch`` is the timer's: every
tick it reads the events whose VMs are not back (the store's Pending column), the gates they name for each VM whose
recover hooks are done (at most ``MAX_VMS_PER_TICK``, closest to their bound first), and commits what moved.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from coordinator.domain import returns
from coordinator.domain.controls import GateResult
from coordinator.domain.lifecycle import EventChange, clone
from coordinator.domain.model import EventRecord
from coordinator.pipeline.run import Run
from coordinator.state.events import assemble, commit_event
from coordinator.state.store import ConcurrencyConflict, Stored

__all__ = ["MAX_VMS_PER_TICK", "follow", "watch"]

log = logging.getLogger("coordinator")

# VMs whose gates one tick reads (8 at a time, each within its gate's deadline): the rest wait for the next tick.
MAX_VMS_PER_TICK = 64


def follow(run: Run, change: EventChange) -> None:
    """An event decided by this run: its watch begun as it completes, its VMs moved on by what the run knows (their
    recover reports; no gate read here)."""
    returns.begin(run.policy, change, run.now)
    returns.follow(change, run.now)


def watch(run: Run, closed: Sequence[Stored[EventRecord]]) -> list[Stored[EventRecord]]:
    """The timer's step over the concluded events it keeps in view: those with VMs not back are read with their
    sightings, their gates read, and each committed as it moved. Returns ``closed`` with what it wrote."""
    waiting = {s.record.eventId: s for s in closed if s.record.returning}
    if not waiting:
        return list(closed)
    groups = run.parts.store.get_vm_groups({key for s in waiting.values() for key in s.record.groups}, cached=True)
    events = assemble(waiting, groups)
    gates = _gates(run, [s.record for s in events.values()])
    written: dict[str, Stored[EventRecord]] = {}
    for event_id, stored in events.items():

        def move(current: EventRecord | None, event_id: str = event_id) -> EventChange | None:
            if current is None:
                return None
            change = EventChange(record=clone(current))
            returns.follow(change, run.now, gates.get(event_id))
            return change

        try:
            change = commit_event(
                run.parts.store, event_id, move, read=stored, etags=run.work.etags, outbox=run.outbox()
            )
        except ConcurrencyConflict:
            log.warning("event %s: contended; its VMs' return is looked at again next tick", event_id)
            continue
        if change is not None:
            run.work.collect(change)
            run.fleet.note(change.record)
            written[event_id] = Stored(change.record, run.work.etags.get(event_id, stored.etag))
    return [written.get(s.record.eventId, s) for s in closed]


def _gates(run: Run, records: list[EventRecord]) -> dict[str, dict[str, dict[str, GateResult]]]:
    """The gates each event's watch names, read for its VMs whose hooks are done: by event, VM, gate."""
    due = sorted(
        (
            (record.returnToService.bound, record.eventId, vm)
            for record in records
            if record.returnToService
            for vm in returns.needs_gates(record)
        ),
    )[:MAX_VMS_PER_TICK]
    if not due:
        return {}
    gates_of = {r.eventId: r.returnToService.gates for r in records if r.returnToService is not None}
    # One read for every due VM of every event (a VM of two events returning at once: both events' gates), so that
    # the tick's per-VM reads share one pool whatever the number of events.
    wanted: dict[str, set[str]] = {}
    for _, event_id, vm in due:
        wanted.setdefault(vm, set()).update(gates_of[event_id])
    read = run.fleet.gates(run.policy, run.parts.monitor).for_vms({vm: sorted(n) for vm, n in wanted.items()})
    out: dict[str, dict[str, dict[str, GateResult]]] = {}
    for _, event_id, vm in due:
        out.setdefault(event_id, {})[vm] = {name: read[vm][name] for name in gates_of[event_id]}
    return out
