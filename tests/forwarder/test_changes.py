"""Change detection and the prepare/recover decision, as pure functions."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contracts.wire import ScheduledEventsDocument
from forwarder.changes import canonical, detect


def doc(incarnation: int, *events: dict[str, Any]) -> ScheduledEventsDocument:
    return ScheduledEventsDocument.from_mapping({"DocumentIncarnation": incarnation, "Events": list(events)})


def event(event_id: str, *resources: str, status: str = "Scheduled") -> dict[str, Any]:
    return {"EventId": event_id, "EventType": "Reboot", "Resources": list(resources), "EventStatus": status}


def test_first_document_is_a_change_and_prepares_this_vms_events_only() -> None:
    current = doc(1, event("A", "web_0"), event("B", "web_1"))
    change = detect(None, None, current, vm_name="web_0")
    assert change is not None
    assert change.reason == "first"
    assert [e.EventId for e in change.prepare] == ["A"]
    assert change.recover == ()


def test_same_document_is_no_change() -> None:
    before = doc(3, event("A", "web_0"))
    assert detect(before, canonical(before), doc(3, event("A", "web_0")), vm_name="web_0") is None


def test_incarnation_up_prepares_new_and_recovers_gone() -> None:
    before = doc(2, event("A", "web_0"), event("B", "web_0"))
    after = doc(3, event("B", "web_0", status="Started"), event("C", "web_0", "web_1"))
    change = detect(before, canonical(before), after, vm_name="web_0")
    assert change is not None
    assert change.reason == "up"
    assert [e.EventId for e in change.prepare] == ["C"]
    assert [e.EventId for e in change.recover] == ["A"]


def test_incarnation_down_after_a_reset_is_a_change() -> None:
    before = doc(9, event("A", "web_0"))
    after = doc(1, event("A", "web_0"))
    change = detect(before, canonical(before), after, vm_name="web_0")
    assert change is not None
    assert change.reason == "down"
    assert change.prepare == ()
    assert change.recover == ()


def test_same_incarnation_different_content_is_a_change() -> None:
    before = doc(4, event("A", "web_0"))
    after = doc(4, event("A", "web_0", status="Started"))
    change = detect(before, canonical(before), after, vm_name="web_0")
    assert change is not None
    assert change.reason == "content"


def test_key_order_and_whitespace_are_not_content() -> None:
    one = ScheduledEventsDocument.from_json_bytes(
        '{"DocumentIncarnation": 2, "Events": [{"EventId": "A", "EventType": "Freeze", '
        '"EventStatus": "Scheduled", "Resources": ["x"]}]}'
    )
    two = ScheduledEventsDocument.from_json_bytes(
        '{"Events":[{"Resources":["x"],"EventType":"Freeze","EventStatus":"Scheduled","EventId":"A"}],"DocumentIncarnation":2}'
    )
    assert detect(one, canonical(one), two, vm_name="x") is None


def test_events_of_other_vms_never_run_hooks_here() -> None:
    before = doc(1, event("A", "web_1"))
    after = doc(2, event("B", "web_1", "web_2"))
    change = detect(before, canonical(before), after, vm_name="web_0")
    assert change is not None
    assert change.prepare == ()
    assert change.recover == ()


def test_unknown_fields_count_as_content() -> None:
    before = doc(1, event("A", "web_0"))
    after = ScheduledEventsDocument.from_mapping(
        {"DocumentIncarnation": 1, "Events": [{**event("A", "web_0"), "NewField": 1}]}
    )
    change = detect(before, canonical(before), after, vm_name="web_0")
    assert change is not None
    assert change.reason == "content"


@given(
    steps=st.lists(
        st.tuples(st.frozensets(st.sampled_from("ABCDE"), max_size=4), st.booleans(), st.integers(0, 3)),
        min_size=1,
        max_size=30,
    )
)
def test_any_sequence_of_documents(steps: list[tuple[frozenset[str], bool, int]]) -> None:
    """Polled documents, each possibly seen several times in a row: one change per distinct consecutive document;
    each of this VM's events prepared once when it appears and recovered once when it leaves."""
    previous: ScheduledEventsDocument | None = None
    previous_canonical: str | None = None
    incarnation = 0
    changes = prepared = recovered = 0
    expected_changes = expected_prepared = expected_recovered = 0
    last_ids: frozenset[str] | None = None
    last_key: tuple[int, frozenset[str]] | None = None
    for ids, reset, repeats in steps:
        if ids != last_ids or reset:
            incarnation = 1 if reset else incarnation + 1  # IMDS starts over at 1 after a reset
        key = (incarnation, ids)
        if key != last_key:
            mine, before = {i for i in ids if i in "ABC"}, {i for i in (last_ids or ()) if i in "ABC"}
            expected_changes += 1
            expected_prepared += len(mine - before)
            expected_recovered += len(before - mine)
        last_ids, last_key = ids, key
        # A, B and C concern web_0; D and E another VM of the group.
        current = doc(incarnation, *(event(i, "web_0" if i in "ABC" else "web_9") for i in sorted(ids)))
        for _ in range(1 + repeats):
            change = detect(previous, previous_canonical, current, vm_name="web_0")
            if change is not None:
                changes += 1
                prepared += len(change.prepare)
                recovered += len(change.recover)
                previous, previous_canonical = change.document, change.canonical
    assert changes == expected_changes
    assert (prepared, recovered) == (expected_prepared, expected_recovered)


def started(event_id: str, *resources: str, event_type: str = "Reboot") -> dict[str, Any]:
    return {"EventId": event_id, "EventType": event_type, "Resources": list(resources), "EventStatus": "Started"}


def test_a_scheduled_event_that_starts_under_a_new_id_is_the_same_maintenance() -> None:
    """Microsoft's mock server gives the Started event a new EventId: no recover for the old id, no prepare for
    the new one, and the pair is reported so the daemon can log it."""
    before = doc(1, event("old", "web_0", "web_1"))
    after = doc(2, started("new", "web_1", "web_0"))  # the same set of Resources, in another order
    change = detect(before, canonical(before), after, vm_name="web_0")
    assert change is not None
    assert (change.prepare, change.recover) == ((), ())
    assert [(b.EventId, a.EventId) for b, a in change.renamed] == [("old", "new")]
    # Once the renamed event leaves, recover runs once, for it.
    gone = detect(after, canonical(after), doc(3), vm_name="web_0")
    assert gone is not None
    assert [e.EventId for e in gone.recover] == ["new"]


@pytest.mark.parametrize(
    ("leaving", "arriving"),
    [
        (event("old", "web_0"), started("new", "web_0", event_type="Freeze")),  # another type
        (event("old", "web_0"), started("new", "web_0", "web_1")),  # other Resources
        (event("old", "web_0"), event("new", "web_0")),  # the new one is not Started
        (event("old", "web_0", status="Started"), started("new", "web_0")),  # the old one had started already
    ],
)
def test_other_pairs_are_two_maintenances(leaving: dict[str, Any], arriving: dict[str, Any]) -> None:
    before = doc(1, leaving)
    change = detect(before, canonical(before), doc(2, arriving), vm_name="web_0")
    assert change is not None
    assert change.renamed == ()
    assert ([e.EventId for e in change.prepare], [e.EventId for e in change.recover]) == (["new"], ["old"])


def test_a_rename_pairs_each_event_once() -> None:
    before = doc(1, event("a", "web_0"), event("b", "web_0"))
    after = doc(2, started("c", "web_0"))
    change = detect(before, canonical(before), after, vm_name="web_0")
    assert change is not None
    assert [(b.EventId, a.EventId) for b, a in change.renamed] == [("a", "c")]
    assert [e.EventId for e in change.recover] == ["b"]
    assert change.prepare == ()


def test_events_of_other_vms_are_not_renamed() -> None:
    before = doc(1, event("old", "web_1"))
    change = detect(before, canonical(before), doc(2, started("new", "web_1")), vm_name="web_0")
    assert change is not None
    assert (change.prepare, change.recover, change.renamed) == ((), (), ())


def test_a_set_aside_event_has_not_left() -> None:
    """An event still listed but invalid now is left out of the document; it is not recovered."""
    before = doc(1, event("A", "web_0"), event("B", "web_0"))
    change = detect(before, canonical(before), doc(2, event("B", "web_0")), vm_name="web_0", set_aside=frozenset("A"))
    assert change is not None
    assert change.recover == ()
