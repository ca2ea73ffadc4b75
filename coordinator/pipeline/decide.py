"""Decide, the third stage: the policy's verdict on each changed event, with the fleet view it needs.

Takes the event records ``fold`` has just merged (or the timer re-reads); gives each a ``DecisionRecord`` (a new
one, and a Decision history row, only when the rule, verdict, hold or reason changed) and, for an approval, an
``ApprovalRecord`` for ``act`` to send. The rules themselves are pure (domain/evaluation.py); this module adds the
I/O they need: the fleet view (impacted VMs, and the census of known VMs for tags and budget domains), the
fleet-wide budget claims per domain, the health gates' results (read once per batch/tick, adapters/gates.py),
and the pending deletes of a scale set, decided as one unit. Events compete for budget in NotBefore order (the
closest first). Runs inside the caller's ETag-checked write, so a decision commits once. Above 400 lines because
the fleet view and its claims are one piece of state per batch/tick (``Fleet``) that every decision reads.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta

from contracts.envelope import VmIdentity
from coordinator.adapters import telemetry
from coordinator.adapters.gates import GateReader
from coordinator.domain.budgets import BudgetDomain, budget_domains, budget_limit, impacted_by
from coordinator.domain.controls import GateResult, VmFacts
from coordinator.domain.deletes import REMOVING_EVENTS, couple, leaving_vms
from coordinator.domain.evaluation import Decision, evaluate, needs_fleet
from coordinator.domain.fleet_view import FleetView
from coordinator.domain.history_rows import decision_row
from coordinator.domain.lifecycle import EventChange, clone, raise_alert
from coordinator.domain.matching import first_match
from coordinator.domain.model import (
    ApprovalRecord,
    BudgetClaim,
    BudgetRecord,
    DecisionRecord,
    EventRecord,
    VmGroupRecord,
    VmRecord,
)
from coordinator.pipeline.context import Context, Work
from coordinator.state.commit import COMMIT_ATTEMPTS, commit
from coordinator.state.events import commit_event
from coordinator.state.tables import ConcurrencyConflict, Stored, TableStateStore

log = logging.getLogger("coordinator")

# The instance that decides sends at once; the timer takes over only if no outcome was recorded by then (the
# sender crashed between its deciding write and the send).
IN_FLIGHT_GRACE = timedelta(seconds=90)
# A budget claim counts unconditionally this long (its approval is written right after it); then only while its
# event holds an approval.
CLAIM_LEASE = timedelta(seconds=90)


def by_not_before(record: EventRecord) -> tuple[datetime, str]:
    """Competing events are decided closest to NotBefore first (none: last), then by EventId, so that when budget
    is short it goes to the event that would otherwise start unapproved soonest."""
    return (record.notBefore or datetime.max.replace(tzinfo=UTC), record.eventId)


def facts_of(identity: VmIdentity) -> VmFacts:
    return VmFacts(
        scaleSet=identity.vmScaleSetName,
        zone=identity.zone,
        location=identity.location,
        faultDomain=identity.platformFaultDomain,
        updateDomain=identity.platformUpdateDomain,
        placementGroup=identity.placementGroupId,
        tags=dict(identity.tags),
    )


def census(groups: Iterable[VmGroupRecord]) -> dict[str, VmFacts]:
    """The facts of every VM the coordinator knows and that is not retired (a percent budget's domain size)."""
    return census_of(vm for group in groups for vm in group.vms.values())


def census_of(vms: Iterable[VmRecord]) -> dict[str, VmFacts]:
    return {vm.identity.name: facts_of(vm.identity) for vm in vms if vm.retired is None}


def waits_for_budget(record: EventRecord) -> bool:
    """A Scheduled event whose last decision was held by a budget: it is queued for the next free slot."""
    return (
        record.state == "Scheduled"
        and record.approval is None
        and record.decision is not None
        and record.decision.holdKind == "budget"
    )


def holds_budget(record: EventRecord) -> bool:
    """An event impacts its VMs from the approval until it is gone. An Expired event whose approval was decided
    keeps its slots too: the platform starts it at NotBefore anyway."""
    return record.open and (record.state in ("Approved", "Started") or record.approval is not None)


class Fleet:
    """The fleet view for budget rules, loaded at most once per batch/tick and updated as approvals are decided,
    and the fleet-wide budget claims (I/O; the rules themselves stay pure)."""

    def __init__(self, store: TableStateStore) -> None:
        self._store = store
        self._view: FleetView | None = None
        self._open: list[EventRecord] | None = None
        self._deletes: dict[str, EventRecord] | None = None
        self._removals: dict[str, EventRecord] = {}
        self._census: dict[str, VmFacts] | None = None
        self._reported: dict[str, VmRecord] = {}
        self._gates: GateReader | None = None

    def gates(self, ctx: Context) -> GateReader:
        """The gate reader of this batch/tick: each gate read at most once."""
        if self._gates is None:
            self._gates = GateReader(ctx.policy.gates, monitor=ctx.monitor)
        return self._gates

    def seed_census(self, groups: Iterable[VmGroupRecord]) -> None:
        """The VM groups the caller has just read (saves reading them again)."""
        self._census = census(groups)

    def note_vms(self, records: Iterable[VmRecord]) -> None:
        """The VMs of this batch as their envelopes just said (their positions are written after the events are
        decided, so the stored census does not have them yet: a new VM's first event is decided with its tags)."""
        for record in records:
            self._reported[record.identity.name] = record
        self._census = None if self._census is None else self._census | census_of(self._reported.values())
        self._view = None

    def _vms(self) -> dict[str, VmFacts]:
        if self._census is None:
            stored = census(stored.record for stored in self._store.all_vm_groups())
            self._census = {name: facts for name, facts in stored.items() if name not in self._reported} | census_of(
                self._reported.values()
            )
        return self._census

    def _open_events(self) -> list[EventRecord]:
        if self._open is None:
            self._open = [stored.record for stored in self._store.open_events()]
        return self._open

    def view(self, *, census: bool = True) -> FleetView:
        """The fleet view; ``census``: with the facts of every known VM (reads the VM groups once), which only
        a policy with tags, percent or domain budgets needs (``Policy.needs_census``)."""
        if self._view is None:
            queued = tuple(
                (by_not_before(r)[0], r.eventId, frozenset(r.resources))
                for r in self._open_events()
                if waits_for_budget(r)
            )
            view = FleetView(vms=self._vms() if census else {}, queued=queued)
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
        """The VMs an open Terminate/Preempt is removing now (deletes.leaving_vms): the open events as read, then
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

    def claim(self, record: EventRecord, domains: Sequence[BudgetDomain], now: datetime) -> tuple[str, str]:
        """Takes this event's slots in every budget domain it counts in, or none. Returns ("", "") when claimed,
        else why not and the domain (claim key) that refused.

        Each domain's claims are one entity written with its ETag: of two instances that see the last slot
        free, one write fails, and that instance re-reads and sees the slot taken. A claim is made before the
        approval is written, so a crash in between can leave a claim without an approval: claims older than
        CLAIM_LEASE count only while their event still holds an approval (checked fresh), so none leaks."""
        taken: list[str] = []
        for domain in sorted(domains, key=lambda d: d.claim_key):
            refused = self._claim_one(domain, record.eventId, now)
            if refused:
                for held in taken:
                    self.release(held, record.eventId)
                return refused, domain.claim_key
            taken.append(domain.claim_key)
        return "", ""

    def _claim_one(self, domain: BudgetDomain, event_id: str, now: datetime) -> str:
        refused = ""
        key = domain.claim_key

        def claimed(stored: Stored[BudgetRecord] | None) -> BudgetRecord | None:
            nonlocal refused
            claims = dict(stored.record.claims) if stored else {}
            if event_id in claims:
                return None
            live = self._live(claims, now)
            impacted = set(domain.mine) | domain.others
            for claim in live.values():
                impacted.update(claim.vms)
            if len(impacted) > domain.limit:
                holders = ", ".join(sorted(live)[:5]) or "approved events"
                refused = f"{domain.describe(len(impacted))}; held fleet-wide by {holders}"
                return None
            live[event_id] = BudgetClaim(eventId=event_id, vms=sorted(domain.mine), claimedAt=now)
            return BudgetRecord(scaleSet=key, claims=live)

        try:
            # A conflict means another instance claimed or released meanwhile: decide again on what it wrote.
            commit(
                lambda _attempt: self._store.get_budget(key),
                claimed,
                lambda record, stored: self._store.save_budget(record, stored.etag if stored else None),
                what=f"budget of {key}",
            )
        except ConcurrencyConflict:
            return f"budget {key!r}: contended for {COMMIT_ATTEMPTS} attempts; retried by the timer"
        return refused

    def _live(self, claims: dict[str, BudgetClaim], now: datetime) -> dict[str, BudgetClaim]:
        old = [event_id for event_id, claim in claims.items() if claim.claimedAt < now - CLAIM_LEASE]
        events = self._store.get_events(old) if old else {}
        return {
            event_id: claim
            for event_id, claim in claims.items()
            if event_id not in old or (event_id in events and holds_budget(events[event_id].record))
        }

    def release(self, key: str, event_id: str) -> None:
        def released(stored: Stored[BudgetRecord] | None) -> BudgetRecord | None:
            if stored is None or event_id not in stored.record.claims:
                return None
            claims = {k: v for k, v in stored.record.claims.items() if k != event_id}
            return BudgetRecord(scaleSet=key, claims=claims)

        try:
            commit(
                lambda _attempt: self._store.get_budget(key),
                released,
                lambda record, stored: self._store.save_budget(record, stored.etag if stored else None),
                what=f"budget of {key}",
            )
        except ConcurrencyConflict:
            log.warning("budget of %s: claim of %s not released (contended); it lapses by itself", key, event_id)


def decide_all(ctx: Context, changes: Sequence[EventChange], now: datetime, fleet: Fleet) -> None:
    """Decides the changed events of a batch or tick. The pending deletes among them are decided as one unit
    with those of their scale sets: each one's own verdict is noted first, so that simultaneous deletes
    arriving together are approved together rather than one held by the other. A failure deciding one event
    costs only that event's decision (its observations are still written; the timer decides it again). Events are
    decided closest to NotBefore first (``by_not_before``): the first decided takes the budget left."""
    changes = sorted(changes, key=lambda c: by_not_before(c.record))
    for change in changes:
        record = change.record
        if record.eventType == "Terminate" and record.state == "Scheduled" and record.approval is None:
            try:
                view = fleet.view() if ctx.policy.needs_census else FleetView()
                own = evaluate(ctx.policy, record, view, now, gates=_gate_results(ctx, fleet, record, view, now))
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
            change = commit_event(ctx.store, event_id, lambda r: redecide(ctx, r, now, fleet))
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


def _gate_results(
    ctx: Context, fleet: Fleet, record: EventRecord, view: FleetView, now: datetime
) -> dict[str, GateResult]:
    """The gates of the rule the event matches (and of the rule it matches without tags, which a tag rule that may
    not widen falls back to), read once per batch/tick."""
    if not ctx.policy.gates:
        return {}
    names: set[str] = set()
    for candidate in (view, view.untagged()):
        rule = first_match(ctx.policy, record, now, candidate)
        names.update(rule.gates if rule is not None else [])
    return fleet.gates(ctx).results(sorted(names)) if names else {}


def decide(ctx: Context, change: EventChange, now: datetime, fleet: Fleet) -> None:
    record = change.record
    if record.state != "Scheduled" or record.approval is not None:
        return
    started = telemetry.now_ns()
    needed = needs_fleet(ctx.policy, record, now)
    view = fleet.view(census=ctx.policy.needs_census) if needed else FleetView()
    gates = _gate_results(ctx, fleet, record, view, now)
    decision = evaluate(ctx.policy, record, view, now, gates=gates)
    if record.eventType == "Terminate" and record.scaleSets:
        decision = couple(decision, record, fleet.deletes().values(), now)
    domains = budget_domains(ctx.policy, decision.rule, record, view)
    claimed: list[str] = []
    if decision.verdict == "approve" and not ctx.dry_run and domains:
        # The rule saw budget left in this instance's view; the claim makes that hold across instances.
        refused, full = fleet.claim(record, domains, now)
        if refused:
            decision = Decision(decision.rule, decision.action, "wait", refused, holdKind="budget", holdName=full)
        else:
            claimed = [d.claim_key for d in domains]
    previous = record.decision
    hold_since = (
        previous.holdSince or previous.decidedAt
        if previous is not None
        and decision.holdKind
        and (previous.holdKind, previous.holdName) == (decision.holdKind, decision.holdName)
        else (now if decision.holdKind else None)
    )
    # A new decision (and row) when the rule, verdict, hold or reason changes (e.g. a hook now failed), not on
    # every re-evaluation that finds the same.
    if previous is None or (
        previous.rule,
        previous.verdict,
        previous.dryRun,
        previous.heldBy,
        previous.holdKind,
        previous.holdName,
        previous.reason,
    ) != (
        decision.rule,
        decision.verdict,
        ctx.dry_run,
        decision.heldBy,
        decision.holdKind,
        decision.holdName,
        decision.reason,
    ):
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
            holdKind=decision.holdKind,
            holdName=decision.holdName,
            holdSince=hold_since,
        )
        change.rows.append(decision_row(record=record, now=now))
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
            budgetKeys=claimed,
        )
        fleet.add(record)
        change.changed = True
        change.approval_decided = True


def release_budgets(ctx: Context, records: Iterable[EventRecord]) -> None:
    """Frees the budget slots of events that concluded. Best effort: a claim left behind (a crash here, or
    a conclusion by a path that does not pass here) lapses once its event no longer holds an approval."""
    fleet: Fleet | None = None
    for record in records:
        if record.open or record.approval is None:
            continue
        # Approvals from before budget domains name no keys: their claims were on their scale sets.
        keys = record.approval.budgetKeys or (
            sorted(impacted_by(record)) if budget_limit(ctx.policy, record.approval.rule) else []
        )
        if not keys:
            continue
        fleet = fleet or Fleet(ctx.store)
        for key in keys:
            try:
                fleet.release(key, record.eventId)
            except Exception:  # the claim lapses by itself; the batch's real work is done
                log.exception("budget of %s: releasing the claim of %s failed", key, record.eventId)
