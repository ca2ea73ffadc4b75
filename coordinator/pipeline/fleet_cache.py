"""The instance's fleet cache: the open events and the VMs of the fleet, kept by one coordinator instance across its
runs (``FleetCache``) and refreshed with what changed since (``StateStore.events_changed_since``,
``vm_groups_changed_since``), not read whole per run: re-reading and re-parsing every VM group in every batch made a
10,000-VM wave under a census policy take 54-74 s instead of 6-7 s, and doubling the fleet quadrupled it. What a run
committed goes back into it (``absorb``), and a record goes in only if it is newer than the one held
(``EventRecord.revision``): a batch's tail absorbs its records at its very end, seconds after it committed them, and
an event concluded meanwhile came back as Approved (a budget rule then held the next event of its domain until the
cache was refreshed). A concluded event never comes back from a copy older than its conclusion (only a later write
opens it again: a conclusion found untrue, event_merge.py).

How a run sees the fleet through it (the view, claims, deletes) is pipeline/fleet.py.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Generic, TypeVar

from contracts.envelope import VmIdentity
from coordinator.domain.claims import BudgetRecord
from coordinator.domain.controls import VmFacts
from coordinator.domain.deletes import REMOVING_EVENTS
from coordinator.domain.fleet_view import Census
from coordinator.domain.model import EventRecord, VmGroupRecord, VmRecord
from coordinator.domain.pacing import is_rate, is_sequence
from coordinator.state.store import Changed, StateStore, Stored

__all__ = [
    "OVERLAP",
    "REFRESH_EVERY",
    "FleetCache",
    "KnownVm",
    "by_not_before",
    "facts_of",
    "holds_budget",
    "waits_for_budget",
]

# How late an instance sees what other instances wrote: the cache asks for changes at most this often (its own
# writes it sees at once; the timer asks on every tick). Budget claims are checked fleet-wide by ETag whatever the
# view says, so this only delays when approvals by other rules, new VMs and their tags on other instances count.
# One query per 5 s costs a wave nothing measurable; asking per batch re-downloads the batch's own writes.
REFRESH_EVERY = 5.0
# Changes are asked for from this long before the latest one seen: writers commit concurrently, so a write stamped
# earlier can become visible after a later one. An unchanged ETag in the overlap is not parsed again.
OVERLAP = timedelta(seconds=5)
# How many concluded events the cache remembers as concluded, so that none comes back from a late copy (a batch's
# tail absorbs its records seconds after it committed them): the newest that many, far more than conclude while a
# tail runs.
CONCLUDED_KEPT = 100_000

R = TypeVar("R", bound=EventRecord | VmGroupRecord)


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
    """An event impacts its VMs from the approval until it is gone, then those not back in service yet (its rule's
    ``returnToService``: ``EventRecord.impacting``). An Expired event whose approval was decided keeps its slots
    too: the platform starts it at NotBefore anyway."""
    if not record.open:
        return bool(record.returning)
    return record.state in ("Approved", "Started") or record.approval is not None


class _Part(Generic[R]):
    """One part of the cache (the open events, the VMs) and how far it has read the store: when it was last
    refreshed (the instance's clock; None: never loaded) and the latest write time (the store's clock) it has seen.
    ``changed_since`` reads the store, ``clear`` empties the part before it is read whole, ``put`` holds a record."""

    def __init__(
        self,
        changed_since: Callable[[datetime | None], Changed[R]],
        clear: Callable[[], None],
        put: Callable[[R], None],
    ) -> None:
        self._changed_since, self._clear, self._put = changed_since, clear, put
        self.at: float | None = None
        self.mark: datetime | None = None

    def refresh(self, now: float, *, force: bool) -> None:
        """Puts what changed since the mark (less ``OVERLAP``), unless refreshed less than ``REFRESH_EVERY`` ago and
        not forced; the first load reads everything."""
        if self.at is not None and not force and now - self.at < REFRESH_EVERY:
            return
        since = None if self.at is None or self.mark is None else self.mark - OVERLAP
        changed = self._changed_since(since)
        if since is None:  # everything: what the part held and is not among it is gone
            self._clear()
        self.at = now
        if changed.watermark is not None:
            self.mark = max(changed.watermark, self.mark or changed.watermark)
        for stored in changed.records:
            self._put(stored.record)


class KnownBudgets:
    """Budget entities as this instance last read or wrote them, and when. A claim decides on one younger than
    ``REFRESH_EVERY`` without reading it, and on a key not known so as absent: its write is If-Match (or an insert),
    so a newer entity refuses it and is read again (no over-claim), and a refusal is at most as late about another
    instance's release as the fleet view is about its approvals. Releases read fresh."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[float, Stored[BudgetRecord] | None]] = {}

    def known(self, key: str) -> Stored[BudgetRecord] | None:
        """The entity as last seen, if recently; None when absent, not known, or seen too long ago."""
        with self._lock:
            hit = self._seen.get(key)
        return hit[1] if hit is not None and self._clock() - hit[0] < REFRESH_EVERY else None

    def last(self, key: str) -> Stored[BudgetRecord] | None:
        """The entity as last seen, however long ago; None when absent or not known. Fresh again once its ETag is
        found unchanged (``BudgetClaims``)."""
        with self._lock:
            hit = self._seen.get(key)
        return hit[1] if hit is not None else None

    def saw(self, key: str, stored: Stored[BudgetRecord] | None) -> None:
        with self._lock:
            self._seen[key] = (self._clock(), stored)

    def forget(self, key: str) -> None:
        with self._lock:
            self._seen.pop(key, None)


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
        self._holding_by_vm: dict[str, set[str]] = {}  # VM name -> the holding events that name it
        self._queued: dict[str, EventRecord] = {}
        # Concluded events, by the revision that concluded them (the newest CONCLUDED_KEPT): no older copy opens one.
        self._concluded: OrderedDict[str, int] = OrderedDict()
        self._events_part = _Part(store.events_changed_since, self._clear_events, self._put_event)
        self.census = Census()
        self._vms: dict[str, KnownVm] = {}  # by vmId, lower case: the VM's newest copy
        self._strays: dict[str, dict[str, KnownVm]] = {}  # by group, then vmId: a VM's older copies elsewhere
        self._groups_part = _Part(store.vm_groups_changed_since, self._clear_groups, self._put_group)
        self.budgets = KnownBudgets(clock)

    # events --------------------------------------------------------------------------------------------------
    def _refresh_events(self, *, force: bool) -> None:
        self._events_part.refresh(self._clock(), force=force)

    def _clear_events(self) -> None:
        """Before every open event is read: what the cache held and is not among them has concluded."""
        for held in (self._events, self._removing, self._holding, self._queued):
            held.clear()
        self._deletes.clear()
        self._holding_by_vm.clear()

    def _put_event(self, record: EventRecord) -> None:
        """Holds ``record`` in place of the event's copy, unless the copy is newer (a higher revision) or the event
        concluded: a copy put late (a tail's, seconds after its write) never undoes a later write."""
        event_id = record.eventId
        held = self._events.get(event_id)
        if held is not None and held.revision > record.revision:
            return
        concluded = self._concluded.get(event_id)
        if concluded is not None and record.revision <= concluded:
            return  # a copy from before its conclusion (one opened again, a later write, comes in)
        self._concluded.pop(event_id, None)
        old = self._events.pop(event_id, None)
        if old is not None and old.eventType == "Terminate":
            for scale_set in old.scaleSets or [""]:
                self._deletes.get(scale_set, {}).pop(event_id, None)
        self._removing.pop(event_id, None)
        self._unhold(event_id)
        self._queued.pop(event_id, None)
        if not record.open:
            self._concluded[event_id] = record.revision
            while len(self._concluded) > CONCLUDED_KEPT:
                self._concluded.popitem(last=False)
            if holds_budget(record):  # VMs not back in service: still impacted
                self._hold(record)
            return
        self._events[event_id] = record
        if record.eventType == "Terminate":
            for scale_set in record.scaleSets or [""]:
                self._deletes.setdefault(scale_set, {})[event_id] = record
        if record.eventType in REMOVING_EVENTS:
            self._removing[event_id] = record
        if holds_budget(record):
            self._hold(record)
        if waits_for_budget(record):
            self._queued[event_id] = record

    def _hold(self, record: EventRecord) -> None:
        self._holding[record.eventId] = record
        for name in record.impacting:
            self._holding_by_vm.setdefault(name, set()).add(record.eventId)

    def _unhold(self, event_id: str) -> None:
        held = self._holding.pop(event_id, None)
        for name in held.impacting if held is not None else ():
            ids = self._holding_by_vm.get(name)
            if ids is not None:
                ids.discard(event_id)
                if not ids:
                    del self._holding_by_vm[name]

    def absorb(self, records: Iterable[EventRecord]) -> None:
        """Records a run committed (or read fresh): seen at once by the next run of this instance."""
        with self._lock:
            if self._events_part.at is None:
                return  # not loaded yet: the first load reads them
            for record in records:
                self._put_event(record)

    def probably_new(self, event_ids: Iterable[str], groups: Iterable[Stored[VmGroupRecord]]) -> set[str]:
        """The events that are neither open as this instance knows (none when it has not loaded them) nor sighted
        by any VM of ``groups``: most likely new, so a batch inserts them without reading them first (an insert
        is refused when the event exists, and then the batch reads)."""
        with self._lock:
            if self._events_part.at is None:
                return set()
            unknown = {event_id for event_id in event_ids if event_id not in self._events}
        # In place, and only while any is left: ``unknown -= keys`` built a new set for every VM (a keys view is
        # not a set), O(unknown) each: a tenth of a second per 10k-VM wave once the events were loaded.
        for group in groups:
            for vm in group.record.vms.values():
                if not unknown:
                    return unknown
                unknown.difference_update(vm.sightings)
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

    def holding_of(self, names: Iterable[str]) -> dict[str, set[str]]:
        """Of these VMs, those that open events hold (``holds_budget``: approved or Started), with those events' ids:
        looked up by name, so that choosing an approval's executor costs nothing per open event."""
        with self._lock:
            self._refresh_events(force=False)
            return {name: set(ids) for name in names if (ids := self._holding_by_vm.get(name))}

    # VMs -----------------------------------------------------------------------------------------------------
    def _refresh_groups(self, *, force: bool) -> None:
        self._groups_part.refresh(self._clock(), force=force)

    def _clear_groups(self) -> None:
        self._vms.clear()
        self._strays.clear()
        self.census = Census()

    def _put_group(self, group: VmGroupRecord) -> None:
        held = self._strays.get(group.group)
        if held:  # copies removed from the group since
            for vm_id in [vm_id for vm_id in held if vm_id not in group.vms]:
                del held[vm_id]
        for vm_id, vm in group.vms.items():
            copy = KnownVm.of(group.group, vm)
            old = self._vms.get(vm_id)
            if old is not None and old.group != copy.group:
                # One VM in two groups (moved to where ARM places it, its old copy not removed yet): the newest is
                # the VM; the other is a stray copy, never a VM of its own.
                older, copy = (copy, old) if old.last_seen > copy.last_seen else (old, copy)
                self._strays.setdefault(older.group, {})[vm_id] = older
                if copy is old:
                    continue
            self._strays.get(copy.group, {}).pop(vm_id, None)
            if old is not None and old.name != vm.identity.name:
                self.census.drop(old.name)
            self._vms[vm_id] = copy
            if vm.retired is None:
                self.census.put(vm.identity.name, facts_of(vm.identity))
            else:
                self.census.drop(vm.identity.name)

    def groups_written(self, groups: Iterable[VmGroupRecord]) -> None:
        """VM groups a run wrote (the timer's retirements and lost heartbeats): seen at once."""
        with self._lock:
            if self._groups_part.at is None:
                return
            for group in groups:
                self._put_group(group)

    def forget_vms(self, vm_ids: Iterable[str]) -> None:
        """VMs whose positions housekeeping removed (retired long ago: none is in the census)."""
        with self._lock:
            for vm_id in vm_ids:
                self._vms.pop(vm_id, None)

    def strays(self) -> list[KnownVm]:
        """The copies of a VM's position found in another group than its newest (``_put_group``), as last read."""
        with self._lock:
            self._refresh_groups(force=False)
            return [copy for held in self._strays.values() for copy in held.values()]

    def forget_copies(self, group: str, vm_ids: Iterable[str]) -> None:
        """Stray copies removed from ``group`` (or found gone)."""
        with self._lock:
            held = self._strays.get(group, {})
            for vm_id in vm_ids:
                held.pop(vm_id, None)

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

    def note_vms(self, records: Iterable[VmRecord]) -> None:
        """The VMs of a batch as their envelopes just said: in the census at once (their positions are written
        after the events are decided, so a new VM's first event is decided with its tags). Only once the census
        is loaded: its first load reads them."""
        with self._lock:
            if self._groups_part.at is None:
                return
            for record in records:
                if record.retired is None:
                    self.census.put(record.identity.name, facts_of(record.identity))
