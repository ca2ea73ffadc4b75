"""The fleet as one run (a batch, tick or person) sees it: the view the budget rules read (impacted VMs, queued
events, the census of known VMs), the open deletes for delete coupling, the VMs leaving, the health gates read once,
and the fleet-wide budget claims per domain (ETag-checked entities, so two instances never over-claim).

The open events and the census are kept by the coordinator instance across runs (``FleetCache``) and refreshed with
what changed since (``StateStore.events_changed_since``, ``vm_groups_changed_since``), not read whole per run:
re-reading and re-parsing every VM group in every batch made a 10,000-VM wave under a census policy take 54-74 s
instead of 6-7 s, and doubling the fleet quadrupled it. Each run (``Fleet``) takes the cache as it is when it first
needs it and keeps it current as the run decides (``note``, ``add``); what the run committed goes back into the
cache at its end (``absorb``). The rules themselves stay pure (domain/evaluation.py, domain/budgets.py).

The census: with ARM's (``census``, coordinator/adapters/census.py, the deployed setting) the facts budgets and tag
rules read are ARM's alone. What envelopes say of a VM never enters it (every VM shares one sender identity: a VM
can claim any zone, tags or name); a VM ARM does not list is not counted and has no tags; a VM met in a batch that
ARM does not list yet makes the census read again (rate-limited). The instance's cache indexes ARM's snapshot
(``FleetCache.arm_census``, rebuilt only when ARM is read again). Without it (tests and tools that build the
coordinator by hand), the census is what the VMs last reported, kept in their VM groups and refreshed by change.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from contracts.envelope import VmIdentity
from coordinator.adapters.census import CensusView
from coordinator.adapters.gates import GateReader, MonitorReader
from coordinator.domain.budgets import BudgetDomain
from coordinator.domain.census import CensusEntry, disagreements
from coordinator.domain.controls import VmFacts
from coordinator.domain.deletes import REMOVING_EVENTS, leaving_vms
from coordinator.domain.fleet_view import Census, FleetView
from coordinator.domain.model import BudgetClaim, BudgetRecord, EventRecord, VmGroupRecord, VmRecord
from coordinator.domain.pacing import PaceDomain, PaceHold, claimed, is_rate, is_sequence, pace_hold, released, settled
from coordinator.domain.policy import MAX_PACING_SECONDS, Policy
from coordinator.state.commit import COMMIT_ATTEMPTS, commit
from coordinator.state.store import ConcurrencyConflict, StateStore, Stored

log = logging.getLogger("coordinator")

# A budget claim counts unconditionally this long (its approval is written right after it); then only while its
# event holds an approval.
CLAIM_LEASE = timedelta(seconds=90)
# How late an instance sees what other instances wrote: the cache asks for changes at most this often (its own
# writes it sees at once; the timer asks on every tick). Budget claims are checked fleet-wide by ETag whatever the
# view says, so this only delays when approvals by other rules, new VMs and their tags on other instances count.
# One query per 5 s costs a wave nothing measurable; asking per batch re-downloads the batch's own writes.
REFRESH_EVERY = 5.0
# Changes are asked for from this long before the latest one seen: writers commit concurrently, so a write stamped
# earlier can become visible after a later one. An unchanged ETag in the overlap is not parsed again.
OVERLAP = timedelta(seconds=5)


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


def waits_for_budget(record: EventRecord) -> bool:
    """A Scheduled event whose last decision was held by an impact budget: it is queued for the next free slot. One
    held by a rate or sequence is not: its VMs are no reason for another rule's budget to count them taken."""
    return (
        record.state == "Scheduled"
        and record.approval is None
        and record.decision is not None
        and record.decision.holdKind == "budget"
        and not is_rate(record.decision.holdName)
        and not is_sequence(record.decision.holdName)
    )


def holds_budget(record: EventRecord) -> bool:
    """An event impacts its VMs from the approval until it is gone. An Expired event whose approval was decided
    keeps its slots too: the platform starts it at NotBefore anyway."""
    return record.open and (record.state in ("Approved", "Started") or record.approval is not None)


@dataclass(frozen=True, slots=True)
class KnownVm:
    """What the timer needs of every VM without holding its whole record (a VM's record with its sightings is about
    4.4 KB in memory; this is a tenth of it): where it is kept, when it last spoke, and its conditions."""

    name: str
    vm_id: str
    group: str
    last_seen: datetime
    agentless: bool
    retired_by: str  # the event that removed it ("" while it is not retired)
    retired_at: datetime | None
    heartbeat_lost: bool
    imds_failing: bool
    pending_since: datetime | None
    pending: bool
    hybrid_connection: str

    @classmethod
    def of(cls, group: str, vm: VmRecord) -> KnownVm:
        return cls(
            name=vm.identity.name,
            vm_id=vm.identity.vmId.lower(),
            group=group,
            last_seen=vm.lastSeen,
            agentless=vm.agentless,
            retired_by=vm.retired.eventId if vm.retired is not None else "",
            retired_at=vm.retired.at if vm.retired is not None else None,
            heartbeat_lost=vm.heartbeatLost,
            imds_failing=vm.imdsFailing is not None,
            pending_since=vm.pendingSince,
            pending=bool(vm.pendingAlerts),
            hybrid_connection=vm.identity.hybrid_connection_name,
        )


class FleetCache:
    """The open events and the VMs of the fleet, kept by one coordinator instance across its runs and refreshed
    with what changed (the store's write times), at most every ``REFRESH_EVERY`` seconds unless forced (the timer).
    Each is loaded whole once, on first need: the events by any run, the VMs by a census policy or the timer.
    Shared by the runs on the Functions worker's threads: every access takes the lock."""

    def __init__(self, store: StateStore, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self._clock = clock
        self._lock = threading.Lock()
        self._events: dict[str, EventRecord] = {}
        self._deletes: dict[str, dict[str, EventRecord]] = {}  # open Terminates, by scale set
        self._removing: dict[str, EventRecord] = {}  # open Terminates and Preempts
        self._holding: dict[str, EventRecord] = {}
        self._queued: dict[str, EventRecord] = {}
        self._events_mark: datetime | None = None
        self._events_at: float | None = None  # when last refreshed (None: never loaded)
        self.census = Census()
        self._vms: dict[str, KnownVm] = {}  # by vmId, lower case
        self._groups_mark: datetime | None = None
        self._groups_at: float | None = None
        # ARM's census, indexed (``arm_census``), and the snapshot it was built from.
        self._arm_census = Census()
        self._arm_entries: Mapping[str, CensusEntry] | None = None

    # events --------------------------------------------------------------------------------------------------
    def _refresh_events(self, *, force: bool) -> None:
        now = self._clock()
        if self._events_at is not None and not force and now - self._events_at < REFRESH_EVERY:
            return
        since = None if self._events_at is None or self._events_mark is None else self._events_mark - OVERLAP
        changed = self.store.events_changed_since(since)
        if since is None:  # every open event: what the cache held and is not among them has concluded
            for held in (self._events, self._removing, self._holding, self._queued):
                held.clear()
            self._deletes.clear()
        self._events_at = now
        if changed.watermark is not None:
            self._events_mark = max(changed.watermark, self._events_mark or changed.watermark)
        for stored in changed.records:
            self._put_event(stored.record)

    def _put_event(self, record: EventRecord) -> None:
        event_id = record.eventId
        old = self._events.pop(event_id, None)
        if old is not None and old.eventType == "Terminate":
            for scale_set in old.scaleSets or [""]:
                self._deletes.get(scale_set, {}).pop(event_id, None)
        self._removing.pop(event_id, None)
        self._holding.pop(event_id, None)
        self._queued.pop(event_id, None)
        if not record.open:
            return
        self._events[event_id] = record
        if record.eventType == "Terminate":
            for scale_set in record.scaleSets or [""]:
                self._deletes.setdefault(scale_set, {})[event_id] = record
        if record.eventType in REMOVING_EVENTS:
            self._removing[event_id] = record
        if holds_budget(record):
            self._holding[event_id] = record
        if waits_for_budget(record):
            self._queued[event_id] = record

    def absorb(self, records: Iterable[EventRecord]) -> None:
        """Records a run committed (or read fresh): seen at once by the next run of this instance."""
        with self._lock:
            if self._events_at is None:
                return  # not loaded yet: the first load reads them
            for record in records:
                self._put_event(record)

    def probably_new(self, event_ids: Iterable[str], groups: Iterable[Stored[VmGroupRecord]]) -> set[str]:
        """The events that are neither open as this instance knows (none when it has not loaded them) nor sighted
        by any VM of ``groups``: most likely new, so a batch inserts them without reading them first (an insert
        is refused when the event exists, and then the batch reads)."""
        with self._lock:
            if self._events_at is None:
                return set()
            unknown = {event_id for event_id in event_ids if event_id not in self._events}
        for group in groups:
            for vm in group.record.vms.values():
                unknown -= vm.sightings.keys()
        return unknown

    def open_events(self, *, force: bool = False) -> dict[str, EventRecord]:
        with self._lock:
            self._refresh_events(force=force)
            return dict(self._events)

    def budget_events(self) -> tuple[list[EventRecord], list[EventRecord]]:
        """The open events that hold their VMs (impacted) and those queued for budget."""
        with self._lock:
            self._refresh_events(force=False)
            return list(self._holding.values()), list(self._queued.values())

    def deletes_of(self, scale_sets: Iterable[str]) -> dict[str, EventRecord]:
        """The open Terminates of these scale sets (delete coupling looks at one scale set's deletes; scanning
        every open delete for each decision made a Terminate wave quadratic)."""
        with self._lock:
            self._refresh_events(force=False)
            return {i: r for s in set(scale_sets) for i, r in self._deletes.get(s, {}).items()}

    def removing(self) -> dict[str, EventRecord]:
        with self._lock:
            self._refresh_events(force=False)
            return dict(self._removing)

    # VMs -----------------------------------------------------------------------------------------------------
    def _refresh_groups(self, *, force: bool) -> None:
        now = self._clock()
        if self._groups_at is not None and not force and now - self._groups_at < REFRESH_EVERY:
            return
        since = None if self._groups_at is None or self._groups_mark is None else self._groups_mark - OVERLAP
        changed = self.store.vm_groups_changed_since(since)
        if since is None:
            self._vms.clear()
            self.census = Census()
        self._groups_at = now
        if changed.watermark is not None:
            self._groups_mark = max(changed.watermark, self._groups_mark or changed.watermark)
        for stored in changed.records:
            self._put_group(stored.record)

    def _put_group(self, group: VmGroupRecord) -> None:
        for vm_id, vm in group.vms.items():
            old = self._vms.get(vm_id)
            if old is not None and old.name != vm.identity.name:
                self.census.drop(old.name)
            self._vms[vm_id] = KnownVm.of(group.group, vm)
            if vm.retired is None:
                self.census.put(vm.identity.name, facts_of(vm.identity))
            else:
                self.census.drop(vm.identity.name)

    def groups_written(self, groups: Iterable[VmGroupRecord]) -> None:
        """VM groups a run wrote (the timer's retirements and lost heartbeats): seen at once."""
        with self._lock:
            if self._groups_at is None:
                return
            for group in groups:
                self._put_group(group)

    def forget_vms(self, vm_ids: Iterable[str]) -> None:
        """VMs whose positions housekeeping removed (retired long ago: none is in the census)."""
        with self._lock:
            for vm_id in vm_ids:
                self._vms.pop(vm_id, None)

    def known_census(self) -> Census:
        """The census, loaded on first need and refreshed by change (the live object: read, never iterated
        while another thread may change it, except through its own copying methods)."""
        with self._lock:
            self._refresh_groups(force=False)
            return self.census

    def vms(self, *, force: bool = False) -> list[KnownVm]:
        with self._lock:
            self._refresh_groups(force=force)
            return list(self._vms.values())

    def arm_census(self, arm: CensusView) -> Census:
        """ARM's census as an indexed ``Census``, rebuilt only when ARM's snapshot changes (a read of ARM),
        kept across runs like the reported one (the live object: read, never iterated while another thread may
        change it)."""
        entries = arm.entries()
        with self._lock:
            if self._arm_entries is not entries:
                self._arm_census = Census(arm.facts().items())
                self._arm_entries = entries
            return self._arm_census

    def note_vms(self, records: Iterable[VmRecord]) -> None:
        """The VMs of a batch as their envelopes just said: in the census at once (their positions are written
        after the events are decided, so a new VM's first event is decided with its tags). Only once the census
        is loaded: its first load reads them."""
        with self._lock:
            if self._groups_at is None:
                return
            for record in records:
                if record.retired is None:
                    self.census.put(record.identity.name, facts_of(record.identity))


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
        self._gates: GateReader | None = None
        self._reported: list[VmRecord] = []

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

    def census_unusable(self) -> str:
        """Why ARM's census cannot be decided on now ("" when it can, or when there is none: the reported one)."""
        if self._arm is None or self._arm.usable():
            return ""
        return self._arm.why_not_usable()

    def disagreements(self, identity: VmIdentity) -> dict[str, tuple[str, str]] | None:
        """What a VM says of itself that ARM does not (domain/census.py); None without ARM's census."""
        return None if self._arm is None else disagreements(identity, self._arm.entry(identity.name))

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

    def leaving(self, now: datetime) -> dict[str, str]:
        """The VMs an open Terminate/Preempt is removing now (sightings.leaving_vms): the open events as read, then
        as this batch/tick changed them (a later version of a record wins)."""
        latest = self.cache.removing() | {i: r for i, r in self._noted.items() if r.eventType in REMOVING_EVENTS}
        return leaving_vms(latest.values(), now)

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
            live = self.live(claims, now)
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

        def claim(stored: Stored[BudgetRecord] | None) -> BudgetRecord | None:
            nonlocal hold
            state = self.settle(stored.record, now) if stored is not None else None
            if state is not None and event_id in state.claims:
                hold = None
                return None
            hold = pace_hold(domain, state, event_id, now)
            return None if hold is not None else claimed(domain, state, event_id, now)

        try:
            commit(
                lambda _attempt: self._store.get_budget(domain.key),
                claim,
                lambda record, stored: self._store.save_budget(record, stored.etag if stored else None),
                what=f"budget of {domain.key}",
            )
        except ConcurrencyConflict:
            return PaceHold(
                domain.key,
                f"budget {domain.key!r}: contended for {COMMIT_ATTEMPTS} attempts; retried by the timer",
                None,
            )
        return hold

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

        try:
            commit(
                lambda _attempt: self._store.get_budget(key),
                release,
                lambda record, stored: self._store.save_budget(record, stored.etag if stored else None),
                what=f"budget of {key}",
            )
        except ConcurrencyConflict:
            log.warning("budget of %s: claim of %s not released (contended); it lapses by itself", key, event_id)
