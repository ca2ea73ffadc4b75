"""Change detection and the prepare/recover decision, as pure functions."""

from __future__ import annotations

from typing import Any

from forwarder.changes import canonical, detect
from forwarder.document import ScheduledEventsDocument


def doc(incarnation: int, *events: dict[str, Any]) -> ScheduledEventsDocument:
    return ScheduledEventsDocument.model_validate({"DocumentIncarnation": incarnation, "Events": list(events)})


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
    one = ScheduledEventsDocument.model_validate_json(
        '{"DocumentIncarnation": 2, "Events": [{"EventId": "A", "EventType": "Freeze", '
        '"EventStatus": "Scheduled", "Resources": ["x"]}]}'
    )
    two = ScheduledEventsDocument.model_validate_json(
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
    after = ScheduledEventsDocument.model_validate(
        {"DocumentIncarnation": 1, "Events": [{**event("A", "web_0"), "NewField": 1}]}
    )
    change = detect(before, canonical(before), after, vm_name="web_0")
    assert change is not None
    assert change.reason == "content"
