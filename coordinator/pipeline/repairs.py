"""Repair-aware maintenance: a scale set's automatic repairs suspended while a disruptive event is in flight on its
VMs, resumed once none is (or at a bound), every step a ``Repairs`` history row. A step of the timer's tick, once a
minute (repairs wait their grace period, 10 minutes at least, before they act: suspending within a tick of the
approval is in time; the batches' path makes no ARM call).

Each scale set whose repairs this coordinator holds is a claim entity (``repairs:`` + its ARM id, domain/claims.py),
written If-Match **before** the Suspend call: its claims are the events that want the suspension, ``suspendedAt``
says this coordinator suspended them. So a crash between the call and the row leaves the entity, and a later tick
(any instance) resumes them once its events are over; a crash between the write and the call leaves an entity whose
Resume is harmless. A scale set ARM shows Suspended with no entity of ours was suspended by someone else (an
operator): this coordinator neither suspends nor resumes it. ``Options.repairs_bound`` caps a suspension: at it the
repairs are resumed (and not suspended again for those events), with a row that says so.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Literal

from coordinator.adapters.repairs import RepairsClient, RepairsError
from coordinator.domain.arm_ids import scale_set_id
from coordinator.domain.claims import BudgetClaim, BudgetRecord
from coordinator.domain.history_rows import repairs_row
from coordinator.domain.model import EventRecord
from coordinator.domain.repairs import in_flight, is_repairs, repairs_key
from coordinator.pipeline.run import Run
from coordinator.state.store import ConcurrencyConflict, Stored

__all__ = ["reconcile"]

log = logging.getLogger("coordinator")


def reconcile(run: Run, events: Iterable[EventRecord]) -> None:
    """Suspends the repairs of each scale set an in-flight event of ``events`` (the tick's open events and those
    with VMs not back in service, as it left them) touches, and resumes those of scale sets no in-flight event
    touches any more. A no-op without a repairs client (``COORDINATOR_SUSPEND_REPAIRS``) or ARM's census (the scale
    sets are ARM's, never a VM's word)."""
    client, census = run.parts.repairs, run.parts.census
    if client is None or census is None:
        return
    run.enter("repairs")
    view = census.at(run.now)
    wanted: dict[str, tuple[str, set[str]]] = {}  # key -> (scale set id, the events that want it suspended)
    for record in events:
        if not in_flight(record):
            continue
        for name in record.impacting:
            entry = view.entry(name)
            scale_set = scale_set_id(entry.resourceId, entry.facts.scaleSet) if entry is not None else None
            if scale_set is not None:
                wanted.setdefault(repairs_key(scale_set), (scale_set, set()))[1].add(record.eventId)
    held = {s.record.scaleSet: s for s in run.parts.store.budgets() if is_repairs(s.record.scaleSet)}
    for key, (scale_set, event_ids) in sorted(wanted.items()):
        try:
            _keep(run, client, scale_set, event_ids, held.get(key))
        except (RepairsError, ConcurrencyConflict) as error:
            log.warning("repairs of %s: %s; the next tick tries again", scale_set, error)
    for key, stored in sorted(held.items()):
        if key not in wanted:
            try:
                _release(run, client, stored)
            except (RepairsError, ConcurrencyConflict) as error:
                log.warning("repairs of %s: %s; the next tick tries again", stored.record.resource, error)


def _keep(
    run: Run, client: RepairsClient, scale_set: str, event_ids: set[str], held: Stored[BudgetRecord] | None
) -> None:
    """The scale set's repairs held suspended for ``event_ids``: suspended now when this coordinator does not hold
    them yet and ARM shows them Running; resumed at the bound."""
    now, store = run.now, run.parts.store
    record = held.record.model_copy(deep=True) if held is not None else BudgetRecord(scaleSet=repairs_key(scale_set))
    record.resource = scale_set
    claims = {e: record.claims.get(e) or BudgetClaim(eventId=e, vms=[], claimedAt=now) for e in sorted(event_ids)}
    changed = claims != record.claims
    record.claims = claims
    if held is None or (record.suspendedAt is None and record.resumedAt is None):
        if client.state(scale_set) != "Running":
            return  # no repairs policy, or suspended by someone else: not this coordinator's to hold
        record.suspendedAt = now
        etag = store.save_budget(record, held.etag if held is not None else None)  # the intent, before the call
        try:
            client.set(scale_set, "Suspend")
        except RepairsError as error:
            record.suspendedAt = None
            store.save_budget(record, etag)
            _row(run, record, "Suspend", "failed", str(error))
            return
        _row(run, record, "Suspend", "suspended", f"{len(claims)} event(s) in flight on its VMs")
        return
    if record.suspendedAt is not None and now - record.suspendedAt >= run.options.repairs_bound:
        client.set(scale_set, "Resume")
        bound = run.options.repairs_bound.total_seconds()
        record.suspendedAt, record.resumedAt = None, now
        store.save_budget(record, held.etag)
        _row(run, record, "Resume", "resumed", f"suspended {bound:g} s, the bound; its events are still in flight")
        return
    if changed:
        store.save_budget(record, held.etag)


def _release(run: Run, client: RepairsClient, held: Stored[BudgetRecord]) -> None:
    """No in-flight event touches the scale set any more: its repairs resumed if this coordinator suspended them,
    and its entity deleted."""
    record = held.record
    if record.suspendedAt is not None:
        client.set(record.resource, "Resume")
        _row(run, record, "Resume", "resumed", "every event that wanted them suspended is over")
    run.parts.store.delete_budget(record.scaleSet, held.etag or "")


def _row(run: Run, record: BudgetRecord, action: Literal["Suspend", "Resume"], outcome: str, reason: str) -> None:
    run.work.rows.append(
        repairs_row(
            scale_set=record.resource,
            action=action,
            outcome=outcome,
            reason=reason,
            events=sorted(record.claims),
            now=run.now,
        )
    )
