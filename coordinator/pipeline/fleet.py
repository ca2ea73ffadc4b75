"""The fleet as one run (a batch, tick or person) sees it: the view the budget rules read (impacted VMs, queued
events, the census of known VMs), the open deletes for delete coupling, the VMs leaving, the health gates read once,
and the fleet-wide budget claims per domain (ETag-checked entities, so two instances never over-claim).

The open events and the census are kept by the coordinator instance across runs (``FleetCache``,
pipeline/fleet_cache.py). Each run (``Fleet``) takes the cache as it is when it first needs it and keeps it current
as the run decides (``note``, ``add``); what the run committed goes back into the cache at its end (``absorb``). The
rules themselves stay pure (domain/evaluation.py, domain/budgets.py).

The census: with ARM's (``census``, coordinator/adapters/census.py, the deployed setting) the facts budgets and tag
rules read are ARM's alone. What envelopes say of a VM never enters it (every VM shares one sender identity: a VM
can claim any zone, tags or name); a VM ARM does not list is not counted and has no tags; a VM met in a batch that
ARM does not list yet makes the census read again (rate-limited). The instance's cache indexes ARM's snapshot
(``FleetCache.arm_census``, rebuilt only when ARM is read again). Without it (tests and tools that build the
coordinator by hand), the census is what the VMs last reported, kept in their VM groups and refreshed by change.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime, timedelta

from contracts.envelope import VmIdentity
from coordinator.adapters.census import CensusView
from coordinator.adapters.gates import GateReader, MonitorReader
from coordinator.domain.budgets import BudgetDomain
from coordinator.domain.census import disagreements
from coordinator.domain.controls import VmFacts
from coordinator.domain.deletes import REMOVING_EVENTS, leaving_vms
from coordinator.domain.fleet_view import FleetView
from coordinator.domain.model import BudgetClaim, BudgetRecord, EventRecord, VmRecord
from coordinator.domain.pacing import PaceDomain, PaceHold, claimed, is_rate, is_sequence, pace_hold, released, settled
from coordinator.domain.policy import MAX_PACING_SECONDS, Policy
from coordinator.pipeline.fleet_cache import (
    FleetCache,
    by_not_before,
    holds_budget,
    waits_for_budget,
)
from coordinator.state.commit import COMMIT_ATTEMPTS, commit
from coordinator.state.store import ConcurrencyConflict, StateStore, Stored

log = logging.getLogger("coordinator")

# A budget claim counts unconditionally this long (its approval is written right after it); then only while its
# event holds an approval.
CLAIM_LEASE = timedelta(seconds=90)
# An event's budget entities written in one transaction, up to the service's 100 operations (and far from its 4 MiB).
MAX_TOGETHER = 100


class Fleet:
    """The fleet view for budget rules, taken from the instance's ``FleetCache`` at most once per batch/tick and
    updated as approvals are decided, and the fleet-wide budget claims (I/O; the rules themselves stay pure)."""

    def __init__(self, store: StateStore, cache: FleetCache | None = None, *, census: CensusView | None = None) -> None:
        self._store = store
        self.cache = cache if cache is not None else FleetCache(store)
        self._arm = census
        self._view: FleetView | None = None
        # Events as this run last decided them (a later version of a record wins over the cache's).
        self._noted: dict[str, EventRecord] = {}
        self._noted_by_vm: dict[str, set[str]] = {}  # VM name -> the noted events that name it
        self._gates: GateReader | None = None
        self._reported: list[VmRecord] = []
        # Budget entities as this run read or wrote them (the instance's ``KnownBudgets`` are only a guess), and the
        # claims deferred (``defer_claims``): per entity, what it was read as, which its write is conditioned on.
        self._budgets_seen: dict[str, Stored[BudgetRecord] | None] = {}
        self._pending: dict[str, Stored[BudgetRecord] | None] = {}
        self._guessing = True
        self.defer_claims = False

    def gates(self, policy: Policy, monitor: MonitorReader | None) -> GateReader:
        """The gate reader of this batch/tick: each gate read at most once."""
        if self._gates is None:
            self._gates = GateReader(policy.gates, monitor=monitor)
        return self._gates

    def note_vms(self, records: Iterable[VmRecord]) -> None:
        """The VMs of this batch as their envelopes just said (see ``FleetCache.note_vms``). With ARM's census,
        what they say stays out of it: a VM it does not list yet makes it read ARM again."""
        if self._arm is not None:
            self._arm.ensure(record.identity.name for record in records if record.retired is None)
            self._view = None
            return
        self._reported.extend(records)
        self.cache.note_vms(self._reported)
        self._view = None

    @property
    def arm(self) -> CensusView | None:
        """ARM's census as this run sees it (None without one): the door reads each VM's name from it."""
        return self._arm

    def census_unusable(self) -> str:
        """Why ARM's census cannot be decided on now ("" when it can, or when there is none: the reported one)."""
        if self._arm is None or self._arm.usable():
            return ""
        return self._arm.why_not_usable()

    def disagreements(self, identity: VmIdentity) -> dict[str, tuple[str, str]] | None:
        """What a VM says of itself that ARM does not (domain/census.py); None without ARM's census, or while it is
        not usable (never read, or too old: a census that could not be read lists no VM, yet says nothing of one)."""
        if self._arm is None or not self._arm.usable():
            return None
        return disagreements(identity, self._arm.entry(identity.name))

    def view(self, *, census: bool = True) -> FleetView:
        """The fleet view; ``census``: with the facts of every known VM (loaded once per instance, then refreshed
        by change), which only a policy with tags, percent or domain budgets needs (``Policy.needs_census``).
        ARM's census, held in memory, is always in the view: it also says each VM's scale set for a scale set's
        budget."""
        if self._view is None:
            holding, queued = self.cache.budget_events()
            latest = {r.eventId: r for r in holding + queued} | self._noted
            vms: Mapping[str, VmFacts] | None = None
            if self._arm is not None:
                vms = self.cache.arm_census(self._arm)
            elif census:
                vms = self.cache.known_census()
                self.cache.note_vms(self._reported)  # a first load did not have them yet
            view = FleetView.of(
                (r for r in latest.values() if holds_budget(r)),
                vms=vms,
                queued=tuple(
                    sorted(
                        (by_not_before(r)[0], r.eventId, frozenset(r.resources))
                        for r in latest.values()
                        if waits_for_budget(r)
                    )
                ),
                authoritative=self._arm is not None,
            )
            self._view = view
        return self._view

    def deletes_of(self, scale_sets: Iterable[str]) -> list[EventRecord]:
        """The open Terminates of these scale sets, as this batch/tick last decided them (delete coupling)."""
        wanted = set(scale_sets) or {""}
        latest = self.cache.deletes_of(wanted)
        for event_id, record in self._noted.items():
            if record.eventType == "Terminate" and wanted & (set(record.scaleSets) or {""}):
                latest[event_id] = record
        return [r for r in latest.values() if r.open]

    def note(self, record: EventRecord) -> None:
        """Keeps the deletes and the removals current as events change within a batch or tick."""
        self._noted[record.eventId] = record
        for name in record.resources:
            self._noted_by_vm.setdefault(name, set()).add(record.eventId)

    def leaving(self, now: datetime) -> dict[str, str]:
        """The VMs an open Terminate/Preempt is removing now (sightings.leaving_vms): the open events as read, then
        as this batch/tick changed them (a later version of a record wins)."""
        latest = self.cache.removing() | {i: r for i, r in self._noted.items() if r.eventType in REMOVING_EVENTS}
        return leaving_vms(latest.values(), now)

    def busy(self, names: Iterable[str], event_id: str) -> frozenset[str]:
        """Of these VMs, those another open event disrupts now or is about to (approved or Started: a Reboot, Redeploy
        or Freeze under way takes the VM's listener away), as the cache holds them and this run decided them."""
        wanted = set(names)
        held = self.cache.holding_of(wanted)
        for name in wanted:
            for other in self._noted_by_vm.get(name, ()):
                noted, ids = self._noted[other], held.setdefault(name, set())
                if holds_budget(noted) and name in noted.resources:
                    ids.add(other)
                else:
                    ids.discard(other)  # this run concluded it (or it no longer names the VM)
        return frozenset(name for name, ids in held.items() if ids - {event_id})

    def held_in(self, scale_sets: Iterable[str], now: datetime) -> list[str]:
        """Pending deletes of these scale sets that are held back by another one (to re-decide)."""
        wanted = set(scale_sets)
        if not wanted:
            return []
        return sorted(
            r.eventId
            for r in self.deletes_of(wanted)
            if r.decision is not None and r.decision.heldBy and wanted & set(r.scaleSets) and r.approval is None
        )

    def add(self, record: EventRecord) -> None:
        if self._view is not None:
            self._view = self._view.with_event(record)

    def absorb(self, records: Iterable[EventRecord]) -> None:
        """What the run committed, into the instance's cache for its next runs."""
        self.cache.absorb(records)

    def claim(self, record: EventRecord, domains: Sequence[BudgetDomain], now: datetime) -> tuple[str, str]:
        """Takes this event's slots in every budget domain it counts in, or none. Returns ("", "") when claimed,
        else why not and the domain (claim key) that refused.

        Each domain's claims are one entity written with its ETag: of two instances that see the last slot
        free, one write fails, and that instance re-reads and sees the slot taken. An event's domains are written
        in one entity group transaction (they share the budget partition): all or none, one request. A claim is
        made before the approval is written, so a crash in between can leave a claim without an approval: claims
        older than CLAIM_LEASE count only while their event still holds an approval (checked fresh), so none
        leaks. The entities are read from what this instance last saw (``KnownBudgets``) on the first attempt."""
        ordered = sorted(domains, key=lambda d: d.claim_key)
        if not ordered:
            return "", ""
        for attempt in range(COMMIT_ATTEMPTS):
            writes: list[tuple[BudgetRecord, Stored[BudgetRecord] | None]] = []
            for domain in ordered:
                stored, fresh = self._budget(domain.claim_key, guess=attempt == 0)
                change, refused = self._with_claim(domain, stored, record.eventId, now)
                if refused and not fresh:  # refused on a guess: only what this run read or wrote may refuse
                    stored, fresh = self._budget(domain.claim_key, guess=False)
                    change, refused = self._with_claim(domain, stored, record.eventId, now)
                if refused:
                    return refused, domain.claim_key
                if change is not None:
                    writes.append((change, stored))
            if self.defer_claims:
                self._defer(writes)
                return "", ""
            try:
                self._save_budgets(writes)
            except ConcurrencyConflict:
                continue  # another instance claimed or released meanwhile: decide again on what it wrote
            return "", ""
        key = ordered[0].claim_key
        return f"budget {key!r}: contended for {COMMIT_ATTEMPTS} attempts; retried by the timer", key

    def _defer(self, writes: Sequence[tuple[BudgetRecord, Stored[BudgetRecord] | None]]) -> None:
        """Keeps the claims for ``flush_claims``: each entity's write stays conditioned on what it was first read as
        in this run, and later claims of the run build on it."""
        for record, stored in writes:
            self._pending.setdefault(record.scaleSet, stored)
            self._budgets_seen[record.scaleSet] = Stored(record, "")

    @contextlib.contextmanager
    def claims_deferred(self) -> Iterator[None]:
        """While inside, claims are kept (``flush_claims`` writes them): a batch's decisions."""
        self.defer_claims = True
        try:
            yield
        finally:
            self.defer_claims = False

    def flush_claims(self) -> None:
        """Writes the claims deferred while ``defer_claims`` (a batch's decisions, before their events are written),
        in transactions of up to 100 entities: one request for a batch's claims instead of one per approval. On a
        conflict nothing is known of those entities any more and the run reads them fresh from then on; the caller
        decides again (ConcurrencyConflict)."""
        pending, self._pending = self._pending, {}
        writes = [(seen.record, base) for key, base in pending.items() if (seen := self._budgets_seen.get(key))]
        try:
            for start in range(0, len(writes), MAX_TOGETHER):
                self._save_budgets(writes[start : start + MAX_TOGETHER])
        except ConcurrencyConflict:
            for key in pending:
                self._budgets_seen.pop(key, None)
                self.cache.budgets.forget(key)
            self._guessing = False
            raise

    def _with_claim(
        self, domain: BudgetDomain, stored: Stored[BudgetRecord] | None, event_id: str, now: datetime
    ) -> tuple[BudgetRecord | None, str]:
        """The domain's entity with this event's claim added (None: it has it already), or why the domain refuses."""
        claims = dict(stored.record.claims) if stored else {}
        if event_id in claims:
            return None, ""
        live = self.live(claims, now)
        impacted = set(domain.mine) | domain.others
        for claim in live.values():
            impacted.update(claim.vms)
        if len(impacted) > domain.limit:
            holders = ", ".join(sorted(live)[:5]) or "approved events"
            return None, f"{domain.describe(len(impacted))}; held fleet-wide by {holders}"
        live[event_id] = BudgetClaim(eventId=event_id, vms=sorted(domain.mine), claimedAt=now)
        return BudgetRecord(scaleSet=domain.claim_key, claims=live), ""

    def _budget(self, key: str, *, guess: bool) -> tuple[Stored[BudgetRecord] | None, bool]:
        """The budget entity, and whether it is as this run read or wrote it (only that may refuse a claim or hold
        an event). Else, with ``guess``, as this instance saw it lately (``KnownBudgets``; a key not seen lately is
        taken as absent, and its write, an insert, fails if it exists); else read now."""
        if key in self._budgets_seen:
            return self._budgets_seen[key], True
        if guess and self._guessing:
            return self.cache.budgets.known(key), False
        return self._read_budget(key), True

    def _read_budget(self, key: str) -> Stored[BudgetRecord] | None:
        stored = self._store.get_budget(key)
        self._saw_budget(key, stored)
        return stored

    def _saw_budget(self, key: str, stored: Stored[BudgetRecord] | None) -> None:
        self._budgets_seen[key] = stored
        self.cache.budgets.saw(key, stored)

    def _save_budgets(self, writes: Sequence[tuple[BudgetRecord, Stored[BudgetRecord] | None]]) -> None:
        """Each entity If-Match what it was read as (an insert when it was absent), all in one transaction or none;
        what is written is remembered, and what was refused forgotten so that the next attempt reads it."""
        if not writes:
            return
        pairs = [(record, stored.etag if stored else None) for record, stored in writes]
        try:
            if len(pairs) == 1 or len(pairs) > MAX_TOGETHER:
                # Beyond one transaction, one by one: a conflict part way leaves claims the next attempt finds made.
                etags = [self._store.save_budget(*pair) for pair in pairs]
            else:
                etags = self._store.save_budgets(pairs)
        except ConcurrencyConflict:
            for record, _ in writes:
                self._budgets_seen.pop(record.scaleSet, None)
                self.cache.budgets.forget(record.scaleSet)
            raise
        for (record, _), etag in zip(writes, etags, strict=True):
            self._saw_budget(record.scaleSet, Stored(record, etag))

    def pace(self, record: EventRecord, domains: Sequence[PaceDomain], now: datetime) -> PaceHold | None:
        """Takes this event's claims on its rule's rate and sequence keys, or none: None when claimed, else what
        held it. Each key is one entity written with its ETag after checking its live claims (``pace_hold``), so of
        two instances that both see the last slot free one write fails and re-reads it taken."""
        taken: list[str] = []
        for domain in sorted(domains, key=lambda d: d.key):
            hold = self._pace_one(domain, record.eventId, now)
            if hold is not None:
                for key in taken:
                    self.release(key, record.eventId)
                return hold
            taken.append(domain.key)
        return None

    def _pace_one(self, domain: PaceDomain, event_id: str, now: datetime) -> PaceHold | None:
        hold: PaceHold | None = None
        guessed = False

        def claim(stored: Stored[BudgetRecord] | None) -> BudgetRecord | None:
            nonlocal hold
            state = self.settle(stored.record, now) if stored is not None else None
            if state is not None and event_id in state.claims:
                hold = None
                return None
            hold = pace_hold(domain, state, event_id, now)
            return None if hold is not None else claimed(domain, state, event_id, now)

        def read(attempt: int) -> Stored[BudgetRecord] | None:
            nonlocal guessed
            stored, fresh = self._budget(domain.key, guess=attempt == 0 and not guessed)
            guessed = guessed or not fresh
            return stored

        try:
            self._commit_budget(domain.key, claim, read=read)
            if hold is not None and guessed and domain.key not in self._budgets_seen:
                self._commit_budget(domain.key, claim, read=read)  # held on a guess: decided again on a fresh read
        except ConcurrencyConflict:
            return PaceHold(
                domain.key,
                f"budget {domain.key!r}: contended for {COMMIT_ATTEMPTS} attempts; retried by the timer",
                None,
            )
        return hold

    def _commit_budget(
        self,
        key: str,
        change: Callable[[Stored[BudgetRecord] | None], BudgetRecord | None],
        *,
        read: Callable[[int], Stored[BudgetRecord] | None] | None = None,
    ) -> None:
        """``change`` on the budget entity ``key``: read (by default from the table: a release must see the claim
        whoever wrote it), written If-Match, decided again on a conflict (ConcurrencyConflict once the attempts are
        spent); ``change`` gives None to write nothing."""
        commit(
            read or (lambda _attempt: self._read_budget(key)),
            change,
            lambda record, stored: self._save_budgets([(record, stored)]),
            what=f"budget of {key}",
        )

    def settle(self, state: BudgetRecord, now: datetime) -> BudgetRecord:
        """A rate or sequence key's state without the claims that lapsed: past ``CLAIM_LEASE``, a claim counts only
        while its event (read fresh) holds its approval, a rate's also once concluded (until it ages out); a
        sequence's concluded event is done (its gap from when it concluded), which covers a release that never ran."""
        old = [event_id for event_id, claim in state.claims.items() if claim.claimedAt < now - CLAIM_LEASE]
        events = {k: v.record for k, v in self._store.get_events(old).items()} if old else {}
        gone: dict[str, datetime | None] = {}
        for event_id in old:
            event = events.get(event_id)
            if event is None or event.approval is None:
                gone[event_id] = None
            elif not event.open and is_sequence(state.scaleSet):
                gone[event_id] = event.stateSince
        return settled(state, gone) if gone else state

    def spent(self, state: BudgetRecord, now: datetime) -> bool:
        """Whether housekeeping may delete a budget entity: no claim counts any more, and, for a sequence, its last
        domain concluded longer ago than any gap may last (a rate's claims count only within its period)."""
        if is_rate(state.scaleSet):
            period = timedelta(seconds=state.periodSeconds)
            return not any(c.claimedAt > now - period for c in self.settle(state, now).claims.values())
        if is_sequence(state.scaleSet):
            quiet = state.doneAt is None or state.doneAt < now - timedelta(seconds=MAX_PACING_SECONDS)
            return quiet and not self.settle(state, now).claims
        return not self.live(dict(state.claims), now)

    def live(self, claims: dict[str, BudgetClaim], now: datetime) -> dict[str, BudgetClaim]:
        """The claims that still count: those within their lease, and older ones whose event (read fresh) still
        holds an approval."""
        old = [event_id for event_id, claim in claims.items() if claim.claimedAt < now - CLAIM_LEASE]
        events = self._store.get_events(old) if old else {}
        return {
            event_id: claim
            for event_id, claim in claims.items()
            if event_id not in old or (event_id in events and holds_budget(events[event_id].record))
        }

    def release(self, key: str, event_id: str, *, concluded_at: datetime | None = None) -> None:
        """Frees the event's claim on ``key``. ``concluded_at``: the event concluded then (a rate's claim stays until
        it ages out; a sequence's gap runs from then); None: its approval was withdrawn, it never ran."""

        def release(stored: Stored[BudgetRecord] | None) -> BudgetRecord | None:
            if stored is None or event_id not in stored.record.claims:
                return None
            return released(stored.record, event_id, concluded_at=concluded_at)

        if key in self._pending:  # claimed in this run and not written yet: given back before it is
            seen = self._budgets_seen.get(key)
            if seen is not None and (after := release(seen)) is not None:
                self._budgets_seen[key] = Stored(after, "")
            return
        try:
            self._commit_budget(key, release)
        except ConcurrencyConflict:
            log.warning("budget of %s: claim of %s not released (contended); it lapses by itself", key, event_id)
