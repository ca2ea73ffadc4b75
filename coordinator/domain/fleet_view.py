"""The fleet as a decision sees it: which VMs other events impact, the census of known VMs, the events queued for
budget ahead of this one.

Pure: built by coordinator/pipeline/decide.py (and ops/policy/) from the stored records; read by matching (tags),
budgets (domains and their sizes) and evaluation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from coordinator.domain.controls import VmFacts
from coordinator.domain.model import EventRecord

__all__ = ["FleetView", "scale_set_of"]


@dataclass(frozen=True)
class FleetView:
    """What other events do to the fleet right now: per scale set, the VM names impacted by an Approved or
    Started event (the budget rule counts these); every impacted VM (``impactedVms``, for the other domain kinds);
    and the census, the facts of every VM the coordinator knows that is not retired (``vms``: domain sizes for
    percent budgets, tags and domains for rules). ``authoritative``: the census is ARM's (coordinator/adapters/
    census.py), so a VM it does not list has no facts at all, whatever its own reports say (not counted in any
    domain, no tags), and each VM's scale set is ARM's too."""

    impacted: dict[str, frozenset[str]] = field(default_factory=dict)
    vms: Mapping[str, VmFacts] = field(default_factory=dict)
    impactedVms: frozenset[str] = frozenset()
    # Events waiting for budget (their last decision was held by one), as (NotBefore, EventId, VMs): an event
    # later in that order counts their VMs as taken, so a freed slot goes to the event closest to its NotBefore
    # even when a later one is decided first (a new event's batch before the timer's tick).
    queued: tuple[tuple[datetime, str, frozenset[str]], ...] = ()
    authoritative: bool = False

    def with_event(self, record: EventRecord) -> FleetView:
        impacted = {k: set(v) for k, v in self.impacted.items()}
        for name in record.resources:
            impacted.setdefault(scale_set_of(record, name), set()).add(name)
        return FleetView(
            {k: frozenset(v) for k, v in impacted.items() if k},
            self.vms,
            self.impactedVms | frozenset(record.resources),
            tuple(q for q in self.queued if q[1] != record.eventId),
            self.authoritative,
        )

    def ahead_of(self, record: EventRecord) -> set[str]:
        """The VMs of the events queued for budget ahead of this one (closer to their NotBefore)."""
        mine = (record.notBefore or datetime.max.replace(tzinfo=UTC), record.eventId)
        return {vm for not_before, event_id, vms in self.queued if (not_before, event_id) < mine for vm in vms}

    def facts(self, record: EventRecord, name: str) -> VmFacts:
        """A VM's facts: from the census; else none when the census is ARM's (a VM ARM does not list is not
        counted), else what the event's own sighting (or the VM's name) says."""
        known = self.vms.get(name)
        if known is not None:
            return known
        if self.authoritative:
            return VmFacts()
        sighting = record.vms.get(name)
        return VmFacts(scaleSet=scale_set_of(record, name), placementGroup=sighting.placementGroup if sighting else "")

    def untagged(self) -> FleetView:
        return FleetView(
            self.impacted,
            {name: dataclasses.replace(facts, tags={}) for name, facts in self.vms.items()},
            self.impactedVms,
            self.queued,
            self.authoritative,
        )


def scale_set_of(record: EventRecord, vm_name: str) -> str:
    sighting = record.vms.get(vm_name)
    if sighting is not None:
        return sighting.scaleSet
    # Scale-set instance names are '{scale-set-name}_{instance-id}' (documented): a fallback for silent VMs.
    head, sep, tail = vm_name.rpartition("_")
    return head if sep and tail.isdigit() else ""
