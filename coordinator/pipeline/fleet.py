"""The fleet as one run (a batch, tick or person) sees it: the view the budget rules read (impacted VMs, queued
events, the census of known VMs), the open deletes for delete coupling, the VMs leaving, the health gates read once,
and the fleet-wide budget claims per domain (ETag-checked entities, so two instances never over-claim).

Loaded at most once per run and kept current as the run decides (``note``, ``add``); the rules themselves stay pure
(domain/evaluation.py, domain/budgets.py).

The census: with ARM's (``census``, coordinator/adapters/census.py, the deployed setting) the facts budgets and tag
rules read are ARM's alone. What envelopes say of a VM never enters it (every VM shares one sender identity: a VM
can claim any zone, tags or name); a VM ARM does not list is not counted and has no tags; a VM met in a batch that
ARM does not list yet makes the census read again (rate-limited). Without it (tests and tools that build the
coordinator by hand), the census is what the VMs last reported, kept in their VM groups.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta

from contracts.envelope import VmIdentity
from coordinator.adapters.census import CensusView
from coordinator.adapters.gates import GateReader, MonitorReader
from coordinator.domain.budgets import BudgetDomain
from coordinator.domain.census import disagreements
from coordinator.domain.controls import VmFacts
from coordinator.domain.deletes import REMOVING_EVENTS, leaving_vms
from coordinator.domain.fleet_view import FleetView
from coordinator.domain.model import BudgetClaim, BudgetRecord, EventRecord, VmGroupRecord, VmRecord
from coordinator.domain.policy import Policy
from coordinator.state.commit import COMMIT_ATTEMPTS, commit
from coordinator.state.store import ConcurrencyConflict, StateStore, Stored

log = logging.getLogger("coordinator")

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

    def __init__(self, store: StateStore, census: CensusView | None = None) -> None:
        self._store = store
        self._arm = census
        self._view: FleetView | None = None
        self._open: list[EventRecord] | None = None
        self._deletes: dict[str, EventRecord] | None = None
        self._removals: dict[str, EventRecord] = {}
        self._census: dict[str, VmFacts] | None = None
        self._reported: dict[str, VmRecord] = {}
        self._gates: GateReader | None = None

    def gates(self, policy: Policy, monitor: MonitorReader | None) -> GateReader:
        """The gate reader of this batch/tick: each gate read at most once."""
        if self._gates is None:
            self._gates = GateReader(policy.gates, monitor=monitor)
        return self._gates

    def seed_census(self, groups: Iterable[VmGroupRecord]) -> None:
        """The VM groups the caller has just read (saves reading them again; ARM's census does not come from them)."""
        if self._arm is None:
            self._census = census(groups)

    def note_vms(self, records: Iterable[VmRecord]) -> None:
        """The VMs of this batch as their envelopes just said (their positions are written after the events are
        decided, so the stored census does not have them yet: a new VM's first event is decided with its tags).
        With ARM's census, what they say stays out of it: a VM it does not list yet makes it read ARM again."""
        if self._arm is not None:
            if self._arm.ensure(record.identity.name for record in records if record.retired is None):
                self._census = None
            self._view = None
            return
        for record in records:
            self._reported[record.identity.name] = record
        self._census = None if self._census is None else self._census | census_of(self._reported.values())
        self._view = None

    def census_unusable(self) -> str:
        """Why ARM's census cannot be decided on now ("" when it can, or when there is none: the reported one)."""
        if self._arm is None or self._arm.usable():
            return ""
        return self._arm.why_not_usable()

    def disagreements(self, identity: VmIdentity) -> dict[str, tuple[str, str]] | None:
        """What a VM says of itself that ARM does not (domain/census.py); None without ARM's census."""
        return None if self._arm is None else disagreements(identity, self._arm.entry(identity.name))

    def _vms(self) -> dict[str, VmFacts]:
        if self._census is None and self._arm is not None:
            self._census = self._arm.facts()
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
        a policy with tags, percent or domain budgets needs (``Policy.needs_census``). ARM's census, held in
        memory, is always in the view: it also says each VM's scale set for a scale set's budget."""
        if self._view is None:
            queued = tuple(
                (by_not_before(r)[0], r.eventId, frozenset(r.resources))
                for r in self._open_events()
                if waits_for_budget(r)
            )
            arm = self._arm is not None
            view = FleetView(vms=self._vms() if census or arm else {}, queued=queued, authoritative=arm)
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
