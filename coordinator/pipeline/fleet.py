"""The fleet as one run (a batch, tick or person) sees it: the view the budget rules read (impacted VMs, queued
events, the census of known VMs), the open deletes for delete coupling, the VMs leaving, the health gates read once,
and the fleet-wide budget claims per domain (``budgets``: pipeline/budget_claims.py).

The open events and the census are kept by the coordinator instance across runs (``FleetCache``,
pipeline/fleet_cache.py). Each run (``Fleet``) takes the cache as it is when it first needs it and keeps it current
as the run decides (``note``, ``add``); what the run committed goes back into the cache at its end (``absorb``). The
rules themselves stay pure (domain/evaluation.py, domain/budgets.py).

The census: with ARM's (``census``, coordinator/adapters/census.py, the deployed setting) the facts budgets and tag
rules read are ARM's alone. What envelopes say of a VM never enters it (every VM shares one sender identity: a VM
can claim any zone, tags or name); a VM ARM does not list is not counted and has no tags; a VM met in a batch that
ARM does not list yet makes the census read again (rate-limited). ARM's snapshot comes indexed by budget domain
(``CensusView.indexed``, made with each read of ARM, off the batches' path). Without it (tests and tools that build the
coordinator by hand), the census is what the VMs last reported, kept in their VM groups and refreshed by change.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime, timedelta

from contracts.envelope import VmIdentity
from coordinator.adapters.census import CensusView
from coordinator.adapters.gates import GateReader, MonitorReader
from coordinator.domain.arm_ids import resource_group
from coordinator.domain.census import disagreements
from coordinator.domain.controls import GateResult, VmFacts
from coordinator.domain.deletes import REMOVING_EVENTS, leaving_vms
from coordinator.domain.fleet_view import FleetView
from coordinator.domain.matching import first_match
from coordinator.domain.model import EventRecord, VmRecord, group_key, placement_key
from coordinator.domain.policy import Policy
from coordinator.pipeline.budget_claims import BudgetClaims
from coordinator.pipeline.fleet_cache import (
    FleetCache,
    by_not_before,
    holds_budget,
    waits_for_budget,
)
from coordinator.state.store import StateStore

log = logging.getLogger("coordinator")


class Fleet:
    """The fleet view for budget rules, taken from the instance's ``FleetCache`` at most once per batch/tick and
    updated as approvals are decided, and the run's fleet-wide budget claims (``budgets``; I/O: the rules themselves
    stay pure)."""

    def __init__(self, store: StateStore, cache: FleetCache | None = None, *, census: CensusView | None = None) -> None:
        self._store = store
        self.cache = cache if cache is not None else FleetCache(store)
        self._arm = census
        self._view: FleetView | None = None
        # Events as this run last decided them (a later version of a record wins over the cache's).
        self._noted: dict[str, EventRecord] = {}
        self._noted_by_vm: dict[str, set[str]] = {}  # VM name -> the noted events that name it
        self._gates: dict[int, GateReader] = {}  # by the policy's id: the live one's, and a shadow policy's
        self._gates_wait = True  # False while a batch decides: see ``gates_in_background``
        self._reported: list[VmRecord] = []
        self._leaving: tuple[datetime, dict[str, str]] | None = None  # ``leaving`` at that instant, until a note
        # The fleet-wide budget claims of this run (pipeline/budget_claims.py).
        self.budgets = BudgetClaims(store, self.cache.budgets, self._noted)

    def gates(self, policy: Policy, monitor: MonitorReader | None) -> GateReader:
        """The gate reader of this batch/tick for ``policy``: each gate read at most once."""
        if id(policy) not in self._gates:
            self._gates[id(policy)] = GateReader(policy.gates, monitor=monitor)
        return self._gates[id(policy)]

    def rule_gates(
        self, policy: Policy, monitor: MonitorReader | None, record: EventRecord, now: datetime, view: FleetView
    ) -> dict[str, GateResult]:
        """The results of the gates of the rule ``policy`` matches for the event (and of the rule it matches without
        tags, which a tag rule that may not widen falls back to), each read once per batch/tick."""
        if not policy.gates:
            return {}
        names: set[str] = set()
        for candidate in (view, view.untagged()):
            rule = first_match(policy, record, now, candidate)
            names.update(rule.gates if rule is not None else [])
        return self.gates(policy, monitor).results(sorted(names), wait=self._gates_wait) if names else {}

    def wait_for_gates(self) -> None:
        """Until every gate read this run started has ended (each within its deadline)."""
        for reader in self._gates.values():
            reader.wait()

    @contextlib.contextmanager
    def gates_in_background(self) -> Iterator[None]:
        """Within: a rule's gates not read yet are read in threads of their own and ``rule_gates`` raises
        ``GatesPending`` until they are (``decide.decide_all``: what does not need them is decided meanwhile)."""
        self._gates_wait = False
        try:
            yield
        finally:
            self._gates_wait = True

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

    def scale_sets(self, names: Iterable[str]) -> list[str] | None:
        """The scale sets of these VMs as ARM's census lists them (none for a VM it does not list): what delete
        coupling reads (``EventRecord.scaleSets``), never a VM's own word. None without a census usable now: the
        sightings' then, as every fact."""
        if self._arm is None or not self._arm.usable():
            return None
        return sorted({entry.facts.scaleSet for name in names if (entry := self._arm.entry(name))} - {""})

    def as_arm_lists(self, vm: VmIdentity) -> VmIdentity:
        """``vm`` with its scale set as ARM's census lists the VM of its resource id, not as the VM says: where the
        coordinator acts on a VM's behalf (the Maintenance RP's acknowledge target: a Flexible member's scale set is
        named only by ``vmScaleSetName``). Unchanged without a census usable now, or for a VM ARM does not list."""
        if self._arm is None or not self._arm.usable():
            return vm
        entry = self._arm.entry_of_resource(vm.resourceId)
        if entry is None or entry.facts.scaleSet == vm.vmScaleSetName:
            return vm
        return vm.model_copy(update={"vmScaleSetName": entry.facts.scaleSet})

    def group_of(self, vm: VmIdentity) -> str:
        """The VM group that keeps ``vm``'s position (``model.group_key``), from where ARM's census lists the VM of
        its resource id: a Uniform instance by its placement group, a member of a scale set by its scale set, a VM
        of an availability set by that set (named with its resource group), another VM alone. The VM's own word
        only for a VM ARM does not list (no census, not read yet, outside its scopes):
        the resource id and vmId were checked at the door, what a VM writes beside them was not. Any census read
        will do, usable or stale: where ARM put a VM is still ARM's word."""
        entry = self._arm.entry_of_resource(vm.resourceId) if self._arm is not None else None
        if entry is None or (entry.vmId and entry.vmId.lower() != vm.vmId.lower()):
            return group_key(vm)
        where = resource_group(entry.resourceId)
        subscription, group = (where.subscription, where.name) if where else ("", "")
        placement, scale_set = entry.facts.placementGroup, entry.facts.scaleSet
        if placement and not scale_set:
            placement = f"{subscription}/{group}/{placement}"  # an availability set: its name is its group's only
        return placement_key(
            vm.vmId, placement_group=placement, scale_set=scale_set, subscription=subscription, resource_group=group
        )

    def census_landed(self, within: timedelta) -> bool:
        """Whether ARM's census is usable once the read under way (if any) has ended, ``within`` at most; the view
        is then made again from it."""
        if self._arm is None:
            return False
        self._arm.census.wait_for_read(within)
        self._view = None
        return self._arm.usable()

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
                vms = self._arm.indexed()
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
        if record.eventType in REMOVING_EVENTS:
            self._leaving = None
        for name in record.resources:
            self._noted_by_vm.setdefault(name, set()).add(record.eventId)

    def leaving(self, now: datetime) -> dict[str, str]:
        """The VMs an open Terminate/Preempt is removing now (sightings.leaving_vms): the open events as read, then
        as this batch/tick changed them (a later version of a record wins). Kept until a removal is noted: each
        approval's plan asks (walking every open removal for each made a wave's approvals cost their number times
        the removals')."""
        if self._leaving is None or self._leaving[0] != now:
            latest = self.cache.removing() | {i: r for i, r in self._noted.items() if r.eventType in REMOVING_EVENTS}
            self._leaving = (now, leaving_vms(latest.values(), now))
        return self._leaving[1]

    def busy(self, names: Iterable[str], event_id: str) -> frozenset[str]:
        """Of these VMs, those another open event disrupts now or is about to (approved or Started: a Reboot, Redeploy
        or Freeze under way takes the VM's listener away), as the cache holds them and this run decided them."""
        wanted = set(names)
        held = self.cache.holding_of(wanted)
        for name in wanted:
            for other in self._noted_by_vm.get(name, ()):
                noted, ids = self._noted[other], held.setdefault(name, set())
                if holds_budget(noted) and name in noted.impacting:
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
