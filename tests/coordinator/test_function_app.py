"""Whole batches through the real function entry points (func.EventHubEvent, cardinality many), with state in
Azurite, history in SQLite, cards in a folder and approvals reaching the IMDS emulator."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import timedelta
from functools import cache
from pathlib import Path
from typing import Any

import azure.functions as func
import jsonschema
import pytest
from azure.functions.timer import TimerRequest

from tests.coordinator.conftest import App
from tests.coordinator.helpers import (
    DOC_EVENT_ID,
    DOC_NOW,
    documented_example,
    envelope,
    hub_event,
    scheduled_event,
    vm,
)

TABLE = "ScheduledEventsHistory_CL"


@cache
def indexed() -> dict[str, dict[str, Any]]:
    # app.get_functions() is not idempotent in azure-functions 1.26: index once per process.
    import function_app

    return {str(f.get_function_name()): json.loads(f.get_function_json()) for f in function_app.app.get_functions()}


def binding(name: str) -> dict[str, Any]:
    bindings: list[dict[str, Any]] = indexed()[name]["bindings"]
    return next(b for b in bindings if b["direction"] == "IN")


def test_indexed_functions_are_what_the_deployment_expects():
    assert set(indexed()) == {"ingest_envelopes", "reevaluate", "approve_event", "pending_events"}
    hub = binding("ingest_envelopes")
    assert hub == {
        "direction": "IN",
        "type": "eventHubTrigger",
        "name": "events",
        # Identity-based: the host reads EventHubConnection__fullyQualifiedNamespace (no connection string).
        "connection": "EventHubConnection",
        "eventHubName": "%EVENTHUB_NAME%",
        "cardinality": "MANY",
        "consumerGroup": "%EVENTHUB_CONSUMER_GROUP%",
    }
    timer = binding("reevaluate")
    assert timer["type"] == "timerTrigger"
    assert timer["schedule"] == "0 * * * * *"
    approve = binding("approve_event")
    assert (approve["type"], approve["route"], approve["authLevel"]) == (
        "httpTrigger",
        "events/{event_id}/approve",
        "ANONYMOUS",
    )
    assert sorted(approve["methods"]) == ["GET", "POST"]
    state = binding("pending_events")
    assert (state["route"], state["methods"], state["authLevel"]) == ("events", ["GET"], "FUNCTION")


def test_host_json_batches_match_the_function_and_the_benchmark():
    from pathlib import Path

    host = json.loads((Path(__file__).resolve().parents[2] / "host.json").read_text())
    hubs = host["extensions"]["eventHubs"]
    assert hubs["maxEventBatchSize"] == 100
    assert hubs["batchCheckpointFrequency"] == 1
    assert host["extensionBundle"]["version"] == "[4.0.0, 5.0.0)"


def ingest(app: App, envelopes: Sequence[dict[str, Any] | bytes], start: int = 0) -> None:
    app.module.ingest_envelopes([hub_event(e, number=start + i) for i, e in enumerate(envelopes)])


def transitions(app: App, event_id: str) -> list[tuple[str, str]]:
    rows = app.history(
        f"SELECT PreviousState, State FROM {TABLE} WHERE EventId = ? AND RecordType = 'Transition' ORDER BY rowid",
        (event_id,),
    )
    return [(r["PreviousState"], r["State"]) for r in rows]


def test_documented_example_through_the_function_ends_as_one_event_logged_once(app: App):
    app.imds.create_event(
        EventId=DOC_EVENT_ID, EventType="Freeze", Resources=["WestNO_0", "WestNO_1"], NoticeSeconds=900
    )
    items = documented_example()
    wn0, wn1 = items[:4], items[4:]
    # Incarnations 1 and 2 from both VMs: the short Freeze is approved at once (rule short-freeze), once.
    ingest(app, [wn0[0], wn1[0], wn0[1], wn1[1]])
    record = app.coordinator.store.get_event(DOC_EVENT_ID)
    assert record is not None
    assert record.record.state == "Approved"
    assert record.record.approval is not None
    assert record.record.approval.executor == "WestNO_0"  # the leader: first in Resources
    assert len(app.approvals(DOC_EVENT_ID)) == 1
    # Incarnation 3 (Started) then 4 (gone) from both.
    ingest(app, [wn0[2], wn1[2]], start=10)
    ingest(app, [wn0[3], wn1[3]], start=20)
    final = app.coordinator.store.get_event(DOC_EVENT_ID)
    assert final is not None
    assert final.record.state == "Completed"
    expected = [("Scheduled", "Approved"), ("Approved", "Started"), ("Started", "Completed")]
    assert transitions(app, DOC_EVENT_ID) == expected
    decisions = app.history(f"SELECT Rule, Outcome FROM {TABLE} WHERE RecordType = 'Decision'")
    assert decisions == [{"Rule": "short-freeze", "Outcome": "approve"}]
    assert app.card_files() == [f"{DOC_EVENT_ID}-approved.json", f"{DOC_EVENT_ID}-new-event.json"]
    schema = json.loads((Path(__file__).with_name("adaptive_card_subset.schema.json")).read_text())
    for name in app.card_files():
        card = (app.cards / name).read_bytes()
        assert len(card) < 28 * 1024
        jsonschema.validate(json.loads(card), schema)
    rows_before = app.history(f"SELECT count(*) AS n FROM {TABLE}")[0]["n"]

    # Event Hubs is at-least-once: the whole sequence again, in one batch, changes nothing.
    ingest(app, items, start=30)
    assert transitions(app, DOC_EVENT_ID) == expected
    assert app.history(f"SELECT count(*) AS n FROM {TABLE}")[0]["n"] == rows_before
    assert len(app.approvals(DOC_EVENT_ID)) == 1
    assert app.coordinator.pending() == []


def test_hostile_message_is_dead_lettered_and_the_rest_of_the_batch_goes_on(app: App):
    good = envelope(vm("WestNO_0", index=1), sequence=1, incarnation=2, events=[scheduled_event("EV-GOOD")])
    spoofed = envelope(vm("WestNO_1", index=2), sequence=1, incarnation=2, events=[scheduled_event("EV-SPOOF")])
    ingest(app, [b"\xff\xfe not json", good])
    # A VM may report only for itself: the partition key (its resource id) must match the envelope's VM.
    app.module.ingest_envelopes([hub_event(spoofed, partition_key="/subscriptions/x/virtualmachines/other")])
    store = app.coordinator.store
    assert store.get_event("EV-GOOD") is not None
    assert store.get_event("EV-SPOOF") is None
    letters = store.dead_letters()
    assert len(letters) == 2
    reasons = [letter["Reason"] for letter in letters]
    assert any(r.startswith("invalid envelope: (envelope): Invalid JSON") for r in reasons)
    assert any("partition key" in r and "reports only for itself" in r for r in reasons)
    rows = app.history(f"SELECT Reason FROM {TABLE} WHERE RecordType = 'DeadLetter'")
    assert len(rows) == 2


def test_timer_expires_unapproved_events_and_notices_lost_heartbeats(app: App):
    reboot = scheduled_event("EV-REBOOT", event_type="Reboot", duration=-1)
    identities = [vm("WestNO_0", index=1), vm("WestNO_1", index=2)]
    ingest(app, [envelope(i, sequence=1, incarnation=2, events=[reboot]) for i in identities])
    record = app.coordinator.store.get_event("EV-REBOOT")
    assert record is not None
    assert record.record.decision is not None
    assert record.record.decision.rule == "everything-else-waits"
    assert [p["eventId"] for p in json.loads(app.module.pending_events(get("/api/events")).get_body())["events"]] == [
        "EV-REBOOT"
    ]

    app.clock.now = DOC_NOW + timedelta(minutes=16)  # NotBefore passed; both forwarders silent for 16 minutes
    app.module.reevaluate(TimerRequest(past_due=False))
    record = app.coordinator.store.get_event("EV-REBOOT")
    assert record is not None
    assert record.record.state == "Expired"
    cards = app.card_files()
    assert "EV-REBOOT-expired.json" in cards
    assert sum("heartbeat-lost" in c for c in cards) == 2
    app.module.reevaluate(TimerRequest(past_due=False))
    assert app.card_files() == cards  # each alert once
    assert len(app.history(f"SELECT * FROM {TABLE} WHERE RecordType = 'Heartbeat'")) == 2
    assert app.approvals("EV-REBOOT") == []


def get(url: str) -> func.HttpRequest:
    return func.HttpRequest(method="GET", url=url, body=b"", headers={})


def test_manual_approval_needs_a_signed_in_person(app: App):
    created = app.imds.create_event(EventType="Reboot", Resources=["WestNO_1"], NoticeSeconds=900)
    event_id = created["EventId"]
    reboot = scheduled_event(event_id, event_type="Reboot", resources=["WestNO_1"], duration=-1)
    ingest(app, [envelope(vm("WestNO_1", index=2), sequence=5, incarnation=3, events=[reboot])])
    url = f"/api/events/{event_id}/approve"
    page = app.module.approve_event(
        func.HttpRequest(method="GET", url=url, body=b"", headers={}, route_params={"event_id": event_id})
    )
    assert page.status_code == 200
    assert b"Approve now" in page.get_body()
    assert app.approvals(event_id) == []  # a GET (link preview, card click) never approves
    anonymous = app.module.approve_event(
        func.HttpRequest(method="POST", url=url, body=b"", headers={}, route_params={"event_id": event_id})
    )
    assert anonymous.status_code == 401
    signed_in = app.module.approve_event(
        func.HttpRequest(
            method="POST",
            url=url,
            body=b"",
            headers={"X-MS-CLIENT-PRINCIPAL-NAME": "alice@example.com"},
            route_params={"event_id": event_id},
        )
    )
    assert signed_in.status_code == 200, signed_in.get_body()
    result = json.loads(signed_in.get_body())
    assert result["event"]["approval"]["actor"] == "person:alice@example.com"
    assert len(app.approvals(event_id)) == 1
    again = app.module.approve_event(
        func.HttpRequest(
            method="POST",
            url=url,
            body=b"",
            headers={"X-MS-CLIENT-PRINCIPAL-NAME": "bob@example.com"},
            route_params={"event_id": event_id},
        )
    )
    assert again.status_code == 409  # already Approved
    assert len(app.approvals(event_id)) == 1
    missing = app.module.approve_event(
        func.HttpRequest(
            method="POST",
            url="/api/events/nope/approve",
            body=b"",
            headers={"X-MS-CLIENT-PRINCIPAL-NAME": "alice@example.com"},
            route_params={"event_id": "nope"},
        )
    )
    assert missing.status_code == 404


@pytest.mark.parametrize("outcome", ["succeeded"])
def test_terminate_is_approved_after_every_prepare_hook(app: App, outcome: str):
    created = app.imds.create_event(EventType="Reboot", Resources=["WestNO_0", "WestNO_1"], NoticeSeconds=900)
    event_id = created["EventId"]
    # The emulator has no scale set here; the coordinator sees a Terminate document from the forwarders.
    terminate = scheduled_event(event_id, event_type="Terminate", duration=-1)
    identities = [vm("WestNO_0", index=1), vm("WestNO_1", index=2)]
    ingest(app, [envelope(i, sequence=1, incarnation=2, events=[terminate]) for i in identities])
    assert app.approvals(event_id) == []
    hook = {"eventId": event_id, "phase": "prepare", "outcome": outcome, "durationSeconds": 2.0, "exitCode": 0}
    ingest(app, [envelope(identities[0], sequence=2, kind="hook", hook=hook)], start=5)
    assert app.approvals(event_id) == []  # WestNO_1 has not drained yet
    ingest(app, [envelope(identities[1], sequence=2, kind="hook", hook=hook)], start=6)
    assert len(app.approvals(event_id)) == 1
    stored = app.coordinator.store.get_event(event_id)
    assert stored is not None
    assert stored.record.state == "Approved"
