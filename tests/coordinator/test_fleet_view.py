"""coordinator.domain.fleet_view: the impacted VMs per budget domain and a domain's size, kept by index (made once
per view, carried forward by ``with_event``), and the VMs taken in a domain (kept per view and place in the queue),
are what scanning every impacted and queued VM and copying the domain gives."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.domain.controls import DomainKind, VmFacts
from coordinator.domain.fleet_view import Census, FleetView
from coordinator.domain.model import EventRecord

NOW = datetime(2026, 11, 20, 1, tzinfo=UTC)
KINDS: tuple[DomainKind, ...] = ("scaleSet", "zone", "faultDomain", "updateDomain", "placementGroup")
NAMES = [f"vm{i}" for i in range(24)]


def facts(i: int) -> VmFacts:
    return VmFacts(
        scaleSet=f"ss{i % 3}",
        zone=str(i % 2 + 1),
        location="westeurope",
        faultDomain=str(i % 3),
        updateDomain=str(i % 5),
        placementGroup=f"pg{i % 4}",
    )


def event(n: int, names: list[str]) -> EventRecord:
    return EventRecord(eventId=f"E{n}", eventType="Reboot", resources=names, stateSince=NOW, createdAt=NOW)


def scanned(view: FleetView, kind: DomainKind, key: str) -> frozenset[str]:
    return frozenset(n for n in view.impactedVms if (f := view.vms.get(n)) is not None and f.domain(kind) == key)


@settings(max_examples=60, deadline=None)
@given(
    known=st.sets(st.integers(0, 23), min_size=1),
    first=st.lists(st.lists(st.sampled_from(NAMES), min_size=1, max_size=4), max_size=3),
    later=st.lists(st.lists(st.sampled_from(NAMES), min_size=1, max_size=4), max_size=4),
    census=st.booleans(),
)
def test_the_impacted_per_domain_and_the_domain_sizes_are_the_scans(
    known: set[int], first: list[list[str]], later: list[list[str]], census: bool
) -> None:
    pairs = [(f"vm{i}", facts(i)) for i in sorted(known)]
    vms = Census(pairs) if census else dict(pairs)
    view = FleetView.of([event(n, names) for n, names in enumerate(first)], vms=vms)
    keys = {kind: {f.domain(kind) for f in vms.values()} for kind in KINDS}
    view.impacted_in("zone", "westeurope/1")  # one kind indexed before the events are added, the others after
    for n, names in enumerate(later, start=len(first)):
        view = view.with_event(event(n, names))

    for kind in KINDS:
        for key in keys[kind]:
            assert view.impacted_in(kind, key) == scanned(view, kind, key)
            assert view.size_with(kind, key, NAMES[:3]) == len(
                {n for n, f in vms.items() if f.domain(kind) == key} | set(NAMES[:3])
            )


def test_adding_an_event_leaves_the_view_it_came_from_as_it_was() -> None:
    vms = Census((f"vm{i}", facts(i)) for i in range(6))
    before = FleetView.of([event(0, ["vm0"])], vms=vms)
    assert before.impacted_in("zone", "westeurope/1") == {"vm0"}

    after = before.with_event(event(1, ["vm2", "vm3"]))

    assert after.impacted_in("zone", "westeurope/1") == {"vm0", "vm2"}
    assert before.impacted_in("zone", "westeurope/1") == {"vm0"}
    assert after.impacted_in("zone", "westeurope/2") == {"vm3"}


@settings(max_examples=60, deadline=None)
@given(
    queue=st.lists(st.tuples(st.integers(0, 5), st.lists(st.sampled_from(NAMES), min_size=1, max_size=4)), max_size=8),
    approved=st.sets(st.integers(0, 7), max_size=3),
    position=st.integers(0, 6),
    census=st.booleans(),
)
def test_the_vms_queued_ahead_in_a_domain_are_those_of_the_events_ahead_in_the_queue(
    queue: list[tuple[int, list[str]]], approved: set[int], position: int, census: bool
) -> None:
    pairs = [(f"vm{i}", facts(i)) for i in range(0, 24, 2)]  # half the VMs known: the rest by their names
    vms = Census(pairs) if census else dict(pairs)
    queued = tuple(
        sorted((NOW + timedelta(minutes=m), f"Q{n}", frozenset(names)) for n, (m, names) in enumerate(queue))
    )
    view = FleetView.of([], vms=vms, queued=queued)
    view.ahead_in("zone", "westeurope/1", event(99, ["vm0"]))  # indexed before events leave the queue
    for kind in KINDS:  # answers kept by the view before events leave it, not by the views made from it
        view.taken_in(kind, "westeurope/1", event(99, ["vm0"]))
    for n in approved:
        view = view.with_event(event(n, ["vm1"]).model_copy(update={"eventId": f"Q{n}"}))
    record = event(99, ["vm0"]).model_copy(update={"notBefore": NOW + timedelta(minutes=position)})

    mine = (record.notBefore, record.eventId)
    for kind in KINDS:
        ahead = [vm for nb, eid, names in view.queued if (nb, eid) < mine for vm in names]
        for key in {view.facts(record, vm).domain(kind) for vm in NAMES}:
            assert view.ahead_in(kind, key, record) == {
                vm for vm in ahead if vm not in record.vms and view.facts(record, vm).domain(kind) == key
            }
            held = view.impacted.get(key, frozenset()) if kind == "scaleSet" else scanned(view, kind, key)
            assert view.taken_in(kind, key, record) == held | view.ahead_in(kind, key, record)
