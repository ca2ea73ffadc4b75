"""The fleet as a decision sees it: which VMs other events impact, the census of known VMs, the events queued for
budget ahead of this one.

Pure: built by coordinator/pipeline/decide.py (and ops/policy/) from the stored records; read by matching (tags),
budgets (domains and their sizes) and evaluation.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import get_args

from coordinator.domain.claims import BudgetRecord
from coordinator.domain.controls import DomainKind, VmFacts
from coordinator.domain.model import EventRecord

__all__ = ["Census", "FleetView", "scale_set_of"]

_KINDS: tuple[DomainKind, ...] = get_args(DomainKind)


class Census(Mapping[str, VmFacts]):
    """The facts of every known VM that is not retired, by name, with the members of each budget domain indexed:
    a percent budget asks its domain's size once per decision, and scanning a 100,000-VM census for it made every
    decision cost the fleet's size (a wave quadratic). Kept by the coordinator instance across runs and changed
    one VM at a time (``put``, ``drop``); safe to read while another thread changes it (reads take the lock or
    copy)."""

    def __init__(self, vms: Iterable[tuple[str, VmFacts]] = ()) -> None:
        self._vms: dict[str, VmFacts] = {}
        self._members: dict[tuple[DomainKind, str], set[str]] = {}
        self._lock = threading.Lock()
        for name, facts in vms:
            self.put(name, facts)

    def put(self, name: str, facts: VmFacts) -> None:
        with self._lock:
            old = self._vms.get(name)
            if old == facts:
                return
            if old is not None:
                self._unindex(name, old)
            self._vms[name] = facts
            for kind in _KINDS:
                self._members.setdefault((kind, facts.domain(kind)), set()).add(name)

    def drop(self, name: str) -> None:
        with self._lock:
            old = self._vms.pop(name, None)
            if old is not None:
                self._unindex(name, old)

    def _unindex(self, name: str, facts: VmFacts) -> None:
        for kind in _KINDS:
            members = self._members.get((kind, facts.domain(kind)))
            if members is not None:
                members.discard(name)

    def members(self, kind: DomainKind, key: str) -> set[str]:
        """The known VMs in one domain (a copy)."""
        with self._lock:
            return set(self._members.get((kind, key), ()))

    def size_with(self, kind: DomainKind, key: str, names: Iterable[str]) -> int:
        """How many VMs one domain has with ``names`` counted in it, without copying its members (a zone's are a
        third of the fleet, and every decision of a percent budget asks)."""
        with self._lock:
            members = self._members.get((kind, key), set())
            return len(members) + sum(1 for name in set(names) if name not in members)

    def __getitem__(self, name: str) -> VmFacts:
        return self._vms[name]

    def get(self, name: str, default: VmFacts | None = None) -> VmFacts | None:  # type: ignore[override]
        return self._vms.get(name, default)

    def __contains__(self, name: object) -> bool:
        return name in self._vms

    def __iter__(self) -> Iterator[str]:
        with self._lock:
            return iter(list(self._vms))

    def __len__(self) -> int:
        return len(self._vms)


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
    # The view without the VMs' tags (``untagged``): what a rule matched by a tag may not exceed.
    tagless: bool = False
    # The rate and sequence budgets' state by claim key (coordinator/domain/pacing.py), where the caller has it:
    # ops/policy's test cases give it; the coordinator leaves it empty and claims them fleet-wide after the rules.
    paced: Mapping[str, BudgetRecord] = field(default_factory=dict)
    # The impacted VMs by budget domain, per kind, made on first use from ``impactedVms`` and carried forward by
    # ``with_event``: counting a domain's impacted VMs by scanning every impacted VM made each decision cost the
    # wave so far (a budget wave quadratic).
    _by_domain: dict[DomainKind, dict[str, frozenset[str]]] = field(default_factory=dict, compare=False, repr=False)
    # The queued events' VMs by budget domain, per kind, each domain's in queue order (made on first use, shared by
    # the views ``with_event`` derives, which only leave events out: ``_dequeued``), so that the VMs queued ahead of
    # an event in one domain are a prefix, not a scan of the whole queue per decision.
    _queue_by_domain: dict[DomainKind, dict[str, list[tuple[datetime, str, str]]]] = field(
        default_factory=dict, compare=False, repr=False
    )
    _dequeued: frozenset[str] = field(default=frozenset(), compare=False, repr=False)
    # ``taken_in``'s answers by (kind, key, place in that domain's queue): an event's evaluation and its claim ask
    # the same, and so do the held events a batch decides again at one place (each answer a set of up to a
    # domain's queue, made twice per held decision and per batch before). Not carried to a derived view.
    _taken: dict[tuple[DomainKind, str, int], frozenset[str]] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(
        cls,
        holding: Iterable[EventRecord],
        *,
        vms: Mapping[str, VmFacts] | None = None,
        queued: tuple[tuple[datetime, str, frozenset[str]], ...] = (),
        authoritative: bool = False,
    ) -> FleetView:
        """The view with the VMs of ``holding`` (events that hold their VMs) impacted, built in one pass (adding
        them one by one with ``with_event`` copies the view each time)."""
        impacted: dict[str, set[str]] = {}
        every: set[str] = set()
        taken: set[str] = set()
        for record in holding:
            taken.add(record.eventId)
            every.update(record.impacting)
            for name in record.impacting:
                impacted.setdefault(scale_set_of(record, name), set()).add(name)
        return cls(
            {k: frozenset(v) for k, v in impacted.items() if k},
            vms if vms is not None else {},
            frozenset(every),
            tuple(q for q in queued if q[1] not in taken),
            authoritative,
        )

    def with_event(self, record: EventRecord) -> FleetView:
        impacted = dict(self.impacted)
        mine: dict[str, set[str]] = {}
        for name in record.resources:
            mine.setdefault(scale_set_of(record, name), set()).add(name)
        for key, names in mine.items():
            if key:
                impacted[key] = impacted.get(key, frozenset()) | names
        added = frozenset(record.resources) - self.impactedVms
        by_domain: dict[DomainKind, dict[str, frozenset[str]]] = {}
        for kind, index in self._by_domain.items():
            by_domain[kind] = grown = dict(index)
            for key, names in self._keyed(kind, added).items():
                grown[key] = grown.get(key, frozenset()) | names
        return dataclasses.replace(
            self,
            impacted=impacted,
            impactedVms=self.impactedVms | added,
            queued=tuple(q for q in self.queued if q[1] != record.eventId),
            _by_domain=by_domain,
            _dequeued=self._dequeued | {record.eventId},
            _taken={},
        )

    def impacted_in(self, kind: DomainKind, key: str) -> frozenset[str]:
        """The impacted VMs whose census facts put them in this domain (a VM the census does not know is in none)."""
        index = self._by_domain.get(kind)
        if index is None:
            index = self._by_domain[kind] = {k: frozenset(v) for k, v in self._keyed(kind, self.impactedVms).items()}
        return index.get(key, frozenset())

    def _keyed(self, kind: DomainKind, names: Iterable[str]) -> dict[str, set[str]]:
        keyed: dict[str, set[str]] = {}
        for name in names:
            facts = self.vms.get(name)
            if facts is not None:
                keyed.setdefault(facts.domain(kind), set()).add(name)
        return keyed

    def size_with(self, kind: DomainKind, key: str, names: Iterable[str]) -> int:
        """How many known VMs one budget domain has with ``names`` counted in it."""
        if isinstance(self.vms, Census):
            return self.vms.size_with(kind, key, names)
        return len(self.members(kind, key) | set(names))

    def members(self, kind: DomainKind, key: str) -> set[str]:
        """The known VMs in one budget domain (a ``Census`` answers from its index; a plain mapping is scanned)."""
        if isinstance(self.vms, Census):
            return self.vms.members(kind, key)
        return {name for name, facts in self.vms.items() if facts.domain(kind) == key}

    def ahead_in(self, kind: DomainKind, key: str, record: EventRecord) -> set[str]:
        """The VMs in one budget domain of the events queued for budget ahead of this one (closer to their
        NotBefore); a VM's domain as ``facts`` gives it for a VM of another event."""
        entries, cut = self._ahead(kind, key, record)
        return {name for _, event_id, name in entries[:cut] if event_id not in self._dequeued}

    def taken_in(self, kind: DomainKind, key: str, record: EventRecord) -> frozenset[str]:
        """The VMs other events take in one budget domain: impacted there (without ARM's census, a scale set's
        are its events' sightings', ``impacted``), or queued for budget ahead of this event. May include this
        event's own VMs (count them once)."""
        entries, cut = self._ahead(kind, key, record)
        found = self._taken.get((kind, key, cut))
        if found is None:
            held = self.impacted.get(key, frozenset()) if kind == "scaleSet" and not self.authoritative else None
            held = self.impacted_in(kind, key) if held is None else held
            found = held | {name for _, event_id, name in entries[:cut] if event_id not in self._dequeued}
            self._taken[(kind, key, cut)] = found
        return found

    def _ahead(self, kind: DomainKind, key: str, record: EventRecord) -> tuple[list[tuple[datetime, str, str]], int]:
        """One domain's queue (NotBefore, EventId, VM) and where this event stands in it."""
        index = self._queue_by_domain.get(kind)
        if index is None:
            index = self._queue_by_domain[kind] = {}
            for not_before, event_id, vms in sorted(self.queued):
                for name in sorted(vms):
                    domain = self.facts(_OTHER, name).domain(kind)
                    index.setdefault(domain, []).append((not_before, event_id, name))
        entries = index.get(key, [])
        mine = (record.notBefore or datetime.max.replace(tzinfo=UTC), record.eventId)
        return entries, bisect.bisect_left(entries, mine, key=lambda entry: (entry[0], entry[1]))

    def facts(self, record: EventRecord, name: str) -> VmFacts:
        """A VM's facts: from the census; else none when the census is ARM's (a VM ARM does not list is not
        counted), else what the event's own sighting (or the VM's name) says."""
        known = self.vms.get(name)
        if known is not None:
            return dataclasses.replace(known, tags={}) if self.tagless and known.tags else known
        if self.authoritative:
            return VmFacts()
        sighting = record.vms.get(name)
        return VmFacts(scaleSet=scale_set_of(record, name), placementGroup=sighting.placementGroup if sighting else "")

    def untagged(self) -> FleetView:
        """The same view with every VM's tags left out (the census is not copied: ``facts`` leaves them out)."""
        return dataclasses.replace(self, tagless=True)


# The record ``facts`` is asked about for a VM of another event: none of its sightings are the VM's.
_OTHER = EventRecord(
    eventId="", eventType="", stateSince=datetime.min.replace(tzinfo=UTC), createdAt=datetime.min.replace(tzinfo=UTC)
)


def scale_set_of(record: EventRecord, vm_name: str) -> str:
    sighting = record.vms.get(vm_name)
    if sighting is not None:
        return sighting.scaleSet
    # Scale-set instance names are '{scale-set-name}_{instance-id}' (documented): a fallback for silent VMs.
    head, sep, tail = vm_name.rpartition("_")
    return head if sep and tail.isdigit() else ""
