"""Decide, the third stage: the policy's verdict on each changed event, with the fleet view it needs.

Takes the event records ``fold`` has just merged (or the timer re-reads); gives each a ``DecisionRecord`` (a new
one, and a Decision history row, only when the rule, verdict, hold or reason changed) and, for an approval, an
``ApprovalRecord`` for ``act`` to send. The rules themselves are pure (coordinator/rules.py); this module adds the
I/O they need: the fleet view for budget rules and the fleet-wide budget claims (``Fleet``), and the pending deletes
of a scale set, decided as one unit. Runs inside the caller's ETag-checked write, so a decision commits once.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta

from coordinator import rules, telemetry
from coordinator.commit import COMMIT_ATTEMPTS, commit
from coordinator.context import Context, Work
from coordinator.events import commit_event
from coordinator.model import ApprovalRecord, BudgetClaim, BudgetRecord, DecisionRecord, EventRecord
from coordinator.record import decision_row
from coordinator.sightings import REMOVING_EVENTS, EventChange, clone, leaving_vms, raise_alert
from coordinator.tables import ConcurrencyConflict, Stored, TableStateStore

log = logging.getLogger("coordinator")

# The instance that decides sends at once; the timer takes over only if no outcome was recorded by then (the
# sender crashed between its deciding write and the send).
IN_FLIGHT_GRACE = timedelta(seconds=90)
# A budget claim counts unconditionally this long (its approval is written right after it); then only while its
# event holds an approval.
CLAIM_LEASE = timedelta(seconds=90)


def holds_budget(record: EventRecord) -> bool:
    """An event impacts its VMs from the approval until it is gone. An Expired event whose approval was decided
    keeps its slots too: the platform starts it at NotBefore anyway."""
    return record.open and (record.state in ("Approved", "Started") or record.approval is not None)


class Fleet:
    """The fleet view for budget rules, loaded at most once per batch/tick and updated as approvals are decided,
    and the fleet-wide budget claims (I/O; the rules themselves stay pure)."""

    def __init__(self, store: TableStateStore) -> None:
        self._store = store
        self._view: rules.FleetView | None = None
        self._open: list[EventRecord] | None = None
        self._deletes: dict[str, EventRecord] | None = None
        self._removals: dict[str, EventRecord] = {}

    def _open_events(self) -> list[EventRecord]:
        if self._open is None:
            self._open = [stored.record for stored in self._store.open_events()]
        return self._open

    def view(self) -> rules.FleetView:
        if self._view is None:
            view = rules.FleetView()
            for record in self._open_events():
                if holds_budget(record):
                    view = view.with_event(record)
            self._view = view
        return self._view

    def deletes(self) -> dict[str, EventRecord]:
        """The open Terminate events, as this batch/tick last decided them (delete coupling reads these)."""
        if self._deletes is None:
            self._deletes = {r.eventId: r for r in self._open_events() if r.eventType == "Terminate"}
        return self._deletes

    def seed(self, records: list[EventRecord]) -> None:
        """The open events the caller has just read (saves reading them again)."""
        self._open = records

    def note(self, record: EventRecord) -> None:
        """Keeps the delete registry and the removals current as events change within a batch or tick."""
        if record.eventType == "Terminate":
            self.deletes()[record.eventId] = record
        if record.eventType in REMOVING_EVENTS:
            self._removals[record.eventId] = record

    def leaving(self, now: datetime) -> dict[str, str]:
        """The VMs an open Terminate/Preempt is removing now (sightings.leaving_vms): the open events as read, then
        as this batch/tick changed them (a later version of a record wins)."""
        latest = {r.eventId: r for r in self._open_events()} | self.deletes() | self._removals
        return leaving_vms(latest.values(), now)

    def held_in(self, scale_sets: Iterable[str], now: datetime) -> list[str]:
        """Pending deletes of these scale sets that are held back by another one (to re-decide)."""
        wanted = set(scale_sets)
        if not wanted:
            return []
        return sorted(
            r.eventId
            for r in self.deletes().values()
            if r.open
            and r.decision is not None
            and r.decision.heldBy
            and wanted & set(r.scaleSets)
            and r.approval is None
        )

    def add(self, record: EventRecord) -> None:
        if self._view is not None:
            self._view = self._view.with_event(record)

    def claim(self, record: EventRecord, limit: int, now: datetime) -> str:
        """Takes this event's slots in every scale set it impacts, or none. Returns "" when claimed, else why not.

        Each scale set's claims are one entity written with its ETag: of two instances that see the last slot
        free, one write fails, and that instance re-reads and sees the slot taken. A claim is made before the
        approval is written, so a crash in between can leave a claim without an approval: claims older than
        CLAIM_LEASE count only while their event still holds an approval (checked fresh), so none leaks."""
        taken: list[str] = []
        for scale_set, names in sorted(rules.impacted_by(record).items()):
            refused = self._claim_one(scale_set, names, record.eventId, limit, now)
            if refused:
                for held in taken:
                    self.release(held, record.eventId)
                return refused
            taken.append(scale_set)
        return ""

    def _claim_one(self, scale_set: str, names: set[str], event_id: str, limit: int, now: datetime) -> str:
        refused = ""

        def claimed(stored: Stored[BudgetRecord] | None) -> BudgetRecord | None:
            nonlocal refused
            claims = dict(stored.record.claims) if stored else {}
            if event_id in claims:
                return None
            live = self._live(claims, now)
            impacted = set(names) | self.view().impacted.get(scale_set, frozenset())
            for claim in live.values():
                impacted.update(claim.vms)
            if len(impacted) > limit:
                holders = ", ".join(sorted(live)[:5]) or "approved events"
                refused = (
                    f"scale set {scale_set or '(none)'!r} would have {len(impacted)} impacted instances (limit "
                    f"{limit}); held fleet-wide by {holders}"
                )
                return None
            live[event_id] = BudgetClaim(eventId=event_id, vms=sorted(names), claimedAt=now)
            return BudgetRecord(scaleSet=scale_set, claims=live)

        try:
            # A conflict means another instance claimed or released meanwhile: decide again on what it wrote.
            commit(
                lambda _attempt: self._store.get_budget(scale_set),
                claimed,
                lambda record, stored: self._store.save_budget(record, stored.etag if stored else None),
                what=f"budget of {scale_set}",
            )
        except ConcurrencyConflict:
            return f"scale set {scale_set!r}: budget contended for {COMMIT_ATTEMPTS} attempts; retried by the timer"
        return refused

    def _live(self, claims: dict[str, BudgetClaim], now: datetime) -> dict[str, BudgetClaim]:
        old = [event_id for event_id, claim in claims.items() if claim.claimedAt < now - CLAIM_LEASE]
        events = self._store.get_events(old) if old else {}
        return {
            event_id: claim
            for event_id, claim in claims.items()
            if event_id not in old or (event_id in events and holds_budget(events[event_id].record))
        }

    def release(self, scale_set: str, event_id: str) -> None:
        def released(stored: Stored[BudgetRecord] | None) -> BudgetRecord | None:
            if stored is None or event_id not in stored.record.claims:
                return None
            claims = {k: v for k, v in stored.record.claims.items() if k != event_id}
            return BudgetRecord(scaleSet=scale_set, claims=claims)

        try:
            commit(
                lambda _attempt: self._store.get_budget(scale_set),
                released,
                lambda record, stored: self._store.save_budget(record, stored.etag if stored else None),
                what=f"budget of {scale_set}",
            )
        except ConcurrencyConflict:
            log.warning("budget of %s: claim of %s not released (contended); it lapses by itself", scale_set, event_id)


def decide_all(ctx: Context, changes: Sequence[EventChange], now: datetime, fleet: Fleet) -> None:
    """Decides the changed events of a batch or tick. The pending deletes among them are decided as one unit
    with those of their scale sets: each one's own verdict is noted first, so that simultaneous deletes
    arriving together are approved together rather than one held by the other. A failure deciding one event
    costs only that event's decision (its observations are still written; the timer decides it again)."""
    for change in changes:
        record = change.record
        if record.eventType == "Terminate" and record.state == "Scheduled" and record.approval is None:
            try:
                own = rules.evaluate(ctx.policy, record, rules.FleetView(), now)
            except Exception:
                log.exception("event %s: its rule could not be evaluated", record.eventId)
                continue
            provisional = DecisionRecord(
                decisionId="",
                rule=own.rule,
                action=own.action,
                verdict=own.verdict,
                reason=own.reason,
                decidedAt=now,
            )
            fleet.note(record.model_copy(update={"decision": provisional}))
        else:
            fleet.note(record)
    for change in changes:
        try:
            decide(ctx, change, now, fleet)
        except Exception:
            log.exception("event %s: deciding failed; the timer decides it again", change.record.eventId)
        fleet.note(change.record)


def release_held(ctx: Context, changes: Sequence[EventChange], now: datetime, fleet: Fleet, work: Work) -> int:
    """Deletes held back by a delete that changed here (approved, ready, started, gone, expired) are decided
    again at once, not on the next timer run: once the last pending delete of a scale set is ready, all of
    them are approved in this same batch or tick."""
    touched = {scale_set for c in changes if c.record.eventType == "Terminate" for scale_set in c.record.scaleSets}
    here = {c.record.eventId for c in changes}
    released = 0
    for event_id in fleet.held_in(touched, now):
        if event_id in here:
            continue
        try:
            change = commit_event(ctx, event_id, lambda r: redecide(ctx, r, now, fleet))
        except ConcurrencyConflict:
            log.warning("held delete %s: contended; the timer decides it again", event_id)
            continue
        if change is not None:
            released += 1
            fleet.note(change.record)
            work.collect(change)
    return released


def redecide(ctx: Context, record: EventRecord | None, now: datetime, fleet: Fleet) -> EventChange | None:
    if record is None:
        return None
    change = EventChange(record=clone(record))
    decide(ctx, change, now, fleet)
    return change


def decide(ctx: Context, change: EventChange, now: datetime, fleet: Fleet) -> None:
    record = change.record
    if record.state != "Scheduled" or record.approval is not None:
        return
    started = telemetry.now_ns()
    view = fleet.view() if rules.needs_fleet(ctx.policy, record, now) else rules.FleetView()
    decision = rules.evaluate(ctx.policy, record, view, now)
    if record.eventType == "Terminate" and record.scaleSets:
        decision = rules.couple(decision, record, fleet.deletes().values(), now)
    limit = rules.budget_limit(ctx.policy, decision.rule)
    if decision.verdict == "approve" and not ctx.dry_run and limit is not None:
        # The rule saw budget left in this instance's view; the claim makes that hold across instances.
        refused = fleet.claim(record, limit, now)
        if refused:
            decision = rules.Decision(decision.rule, decision.action, "wait", refused)
    previous = record.decision
    # A new decision (and row) when the rule, verdict, hold or reason changes (e.g. a hook now failed), not on
    # every re-evaluation that finds the same.
    if previous is None or (
        previous.rule,
        previous.verdict,
        previous.dryRun,
        previous.heldBy,
        previous.reason,
    ) != (decision.rule, decision.verdict, ctx.dry_run, decision.heldBy, decision.reason):
        record.decision = DecisionRecord(
            decisionId=uuid.uuid4().hex,
            rule=decision.rule,
            action=decision.action,
            verdict=decision.verdict,
            reason=decision.reason,
            decidedAt=now,
            dryRun=ctx.dry_run,
            actor=f"rule:{decision.rule}",
            heldBy=decision.heldBy,
            heldByVm=decision.heldByVm,
            heldUntil=decision.heldUntil,
        )
        change.rows.append(decision_row(record, now))
        change.changed = True
        telemetry.decided(
            record.traceparent,
            started_ns=started,
            event_id=record.eventId,
            event_type=record.eventType,
            rule=decision.rule,
            verdict=decision.verdict,
            action=decision.action,
            dry_run=ctx.dry_run,
        )
        if decision.action == "wait-for-person":
            # Nobody else will approve it: the card that says so, with the approval link (once per event: an
            # impactful event's new-event card, raised when it was first seen, is this same card).
            raise_alert(change, "new-event", now)
    if decision.verdict == "approve" and not ctx.dry_run and record.decision is not None:
        record.approval = ApprovalRecord(
            decisionId=record.decision.decisionId,
            rule=decision.rule,
            actor=f"rule:{decision.rule}",
            decidedAt=now,
            nextAttemptAt=now + IN_FLIGHT_GRACE,
        )
        fleet.add(record)
        change.changed = True
        change.approval_decided = True


def release_budgets(ctx: Context, records: Iterable[EventRecord]) -> None:
    """Frees the budget slots of events that concluded. Best effort: a claim left behind (a crash here, or
    a conclusion by a path that does not pass here) lapses once its event no longer holds an approval."""
    fleet: Fleet | None = None
    for record in records:
        if record.open or record.approval is None or rules.budget_limit(ctx.policy, record.approval.rule) is None:
            continue
        fleet = fleet or Fleet(ctx.store)
        for scale_set in sorted(rules.impacted_by(record)):
            try:
                fleet.release(scale_set, record.eventId)
            except Exception:  # the claim lapses by itself; the batch's real work is done
                log.exception("budget of %s: releasing the claim of %s failed", scale_set, record.eventId)
