"""Whole batches through the real function entry points (func.EventHubEvent, cardinality many), with state in
Azurite, history in SQLite, cards in a folder and approvals reaching the IMDS emulator."""

from __future__ import annotations

import base64
import html
import json
import re
from collections.abc import Sequence
from dataclasses import replace
from datetime import timedelta
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import azure.functions as func
import jsonschema
import pytest
from azure.functions.timer import TimerRequest

from coordinator.http import APPROVE_ROLE, READ_ROLE
from local.direct_callback import direct_coordinator
from tests.coordinator.conftest import App
from tests.coordinator.helpers import (
    DOC_EVENT_ID,
    DOC_NOW,
    documented_example,
    envelope,
    hub_event,
    scheduled_event,
    vm,
    web_vms,
)
from tests.coordinator.runs import imds_serving

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
    assert set(indexed()) == {
        "ingest_envelopes",
        "ingest_platform_events",
        "reevaluate",
        "continue_approval",
        "approve_event",
        "pending_events",
    }
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
    # Approvals a run handed over (coordinator/adapters/delivery_queue.py), on the host's own storage connection.
    assert binding("continue_approval") == {
        "direction": "IN",
        "type": "queueTrigger",
        "name": "message",
        "queueName": "approval-deliveries",
        "connection": "AzureWebJobsStorage",
    }
    # Event Grid's own hub: a trigger of its own, so the coordinator knows which channel a message came from.
    assert binding("ingest_platform_events") == {**hub, "eventHubName": "%PLATFORM_EVENTHUB_NAME%"}
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
    # No function key for people: App Service Authentication signs them in and coordinator/http.py checks roles.
    assert (state["route"], state["methods"], state["authLevel"]) == ("events", ["GET"], "ANONYMOUS")


def test_host_json_batches_match_the_function_and_the_benchmark():
    from pathlib import Path

    host = json.loads((Path(__file__).resolve().parents[2] / "host.json").read_text())
    hubs = host["extensions"]["eventHubs"]
    assert hubs["maxEventBatchSize"] == 200
    assert hubs["batchCheckpointFrequency"] == 1
    assert host["extensionBundle"]["version"] == "[4.0.0, 5.0.0)"
    # The delivery queue: picked up within a second, a failed invocation retried 5 s later, set aside after 5.
    queues = host["extensions"]["queues"]
    assert (queues["maxPollingInterval"], queues["visibilityTimeout"], queues["maxDequeueCount"]) == (
        "00:00:01",
        "00:00:05",
        5,
    )


def ingest(app: App, envelopes: Sequence[dict[str, Any] | bytes], start: int = 0) -> None:
    app.module.ingest_envelopes([hub_event(e, number=start + i) for i, e in enumerate(envelopes)])
    assert app.coordinator.drain(), "the batch's tail did not end within 30 s"  # it runs after the batch


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
    record = app.coordinator.parts.store.get_event(DOC_EVENT_ID)
    assert record is not None
    assert record.record.state == "Approved"
    assert record.record.approval is not None
    assert record.record.approval.executor == "WestNO_0"  # the leader: first in Resources
    assert len(app.approvals(DOC_EVENT_ID)) == 1
    # Incarnation 3 (Started) then 4 (gone) from both.
    ingest(app, [wn0[2], wn1[2]], start=10)
    ingest(app, [wn0[3], wn1[3]], start=20)
    final = app.coordinator.parts.store.get_event(DOC_EVENT_ID)
    assert final is not None
    assert final.record.state == "Completed"
    expected = [("Scheduled", "Approved"), ("Approved", "Started"), ("Started", "Completed")]
    assert transitions(app, DOC_EVENT_ID) == expected
    decisions = app.history(f"SELECT Rule, Outcome FROM {TABLE} WHERE RecordType = 'Decision'")
    assert decisions == [{"Rule": "short-freeze", "Outcome": "approve"}]
    # New and approved in one batch: one card, the approval's, naming the new event too.
    assert app.card_files() == [f"{DOC_EVENT_ID}-approved.json"]
    assert "Also since the last card: New scheduled event" in (app.cards / app.card_files()[0]).read_text()
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
    assert app.coordinator.drain()  # its history rows are the tail's, after the batch returned
    store = app.coordinator.parts.store
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
    record = app.coordinator.parts.store.get_event("EV-REBOOT")
    assert record is not None
    assert record.record.decision is not None
    assert record.record.decision.rule == "everything-else-waits"
    listed = app.module.pending_events(get("/api/events", headers=principal(READ_ROLE)))
    assert [p["eventId"] for p in json.loads(listed.get_body())["events"]] == ["EV-REBOOT"]

    app.clock.now = DOC_NOW + timedelta(minutes=16)  # NotBefore passed; both forwarders silent for 16 minutes
    app.module.reevaluate(TimerRequest(past_due=False))
    record = app.coordinator.parts.store.get_event("EV-REBOOT")
    assert record is not None
    assert record.record.state == "Expired"
    cards = app.card_files()
    assert "EV-REBOOT-expired.json" in cards
    assert sum("heartbeat-lost" in c for c in cards) == 2
    app.module.reevaluate(TimerRequest(past_due=False))
    assert app.card_files() == cards  # each alert once
    assert len(app.history(f"SELECT * FROM {TABLE} WHERE RecordType = 'Heartbeat'")) == 2
    assert app.approvals("EV-REBOOT") == []


def get(url: str, headers: dict[str, str] | None = None) -> func.HttpRequest:
    return func.HttpRequest(method="GET", url=url, body=b"", headers=headers or {})


OWN_ORIGIN = "http://127.0.0.1:7071"  # COORDINATOR_PUBLIC_BASE_URL of the app fixture


@pytest.fixture(autouse=True)
def platform_authentication(monkeypatch: pytest.MonkeyPatch) -> None:
    # What App Service injects when its authentication runs in front of the app (infra/modules/functionapp.bicep).
    monkeypatch.setenv("WEBSITE_AUTH_ENABLED", "True")


ALICE_OID = "0a1b2c3d-0000-4000-8000-000000000001"


def principal(*roles: str, upn: str = "alice@example.com", oid: str = ALICE_OID) -> dict[str, str]:
    """The X-MS-CLIENT-PRINCIPAL header App Service Authentication sends for an Entra ID user: the token's claims,
    mapped as the platform does (long claim type URIs, one "roles" claim per app role)."""
    claims = [
        {"typ": "http://schemas.microsoft.com/identity/claims/objectidentifier", "val": oid},
        {"typ": "preferred_username", "val": upn},
        {"typ": "name", "val": "Alice Example"},
        *({"typ": "roles", "val": role} for role in roles),
    ]
    payload = {
        "auth_typ": "aad",
        "claims": claims,
        "name_typ": "http://schemas.xmlsoap.org/ws/2005/05/identity/claims/emailaddress",
        "role_typ": "http://schemas.microsoft.com/ws/2008/06/identity/claims/role",
    }
    return {"X-MS-CLIENT-PRINCIPAL": base64.b64encode(json.dumps(payload).encode()).decode()}


def reboot_waiting_for_a_person(app: App, name: str = "WestNO_1") -> str:
    created = app.imds.create_event(EventType="Reboot", Resources=[name], NoticeSeconds=900)
    event_id: str = created["EventId"]
    reboot = scheduled_event(event_id, event_type="Reboot", resources=[name], duration=-1)
    ingest(app, [envelope(vm(name, index=int(name[-1]) + 1), sequence=5, incarnation=3, events=[reboot])])
    return event_id


def open_page(app: App, event_id: str, headers: dict[str, str]) -> func.HttpResponse:
    response: func.HttpResponse = app.module.approve_event(
        func.HttpRequest(
            method="GET",
            url=f"{OWN_ORIGIN}/api/events/{event_id}/approve",
            body=b"",
            headers=headers,
            route_params={"event_id": event_id},
        )
    )
    return response


def form_token_of(page: func.HttpResponse) -> str:
    found = re.search(rb'name="token" value="([^"]+)"', page.get_body())
    assert found, page.get_body()
    return html.unescape(found.group(1).decode())


def post(app: App, event_id: str, headers: dict[str, str], token: str | None) -> func.HttpResponse:
    body = b"" if token is None else urlencode({"token": token}).encode()
    response: func.HttpResponse = app.module.approve_event(
        func.HttpRequest(
            method="POST",
            url=f"{OWN_ORIGIN}/api/events/{event_id}/approve",
            body=body,
            headers={"Content-Type": "application/x-www-form-urlencoded", **headers},
            route_params={"event_id": event_id},
        )
    )
    return response


def decisions(app: App, event_id: str) -> list[dict[str, Any]]:
    return app.history(
        f"SELECT Rule, Actor, Outcome, DryRun FROM {TABLE} "
        "WHERE RecordType = 'Decision' AND EventId = ? ORDER BY rowid",
        (event_id,),
    )


def test_a_person_with_the_approve_role_approves_from_the_page_and_is_in_the_history(app: App):
    event_id = reboot_waiting_for_a_person(app)
    alice = principal(APPROVE_ROLE)
    page = open_page(app, event_id, alice)
    assert page.status_code == 200
    assert b"Approve now as alice@example.com" in page.get_body()
    assert page.headers["X-Frame-Options"] == "DENY"  # the button cannot be framed by another site
    assert app.approvals(event_id) == []  # a GET (link preview, card click) never approves
    bob = principal(APPROVE_ROLE, upn="bob@example.com", oid="0a1b2c3d-0000-4000-8000-000000000002")
    bobs_page = open_page(app, event_id, bob)  # a second approver has the page open meanwhile
    approved = post(app, event_id, {**alice, "Origin": OWN_ORIGIN}, form_token_of(page))
    assert approved.status_code == 200, approved.get_body()
    result = json.loads(approved.get_body())
    assert result["event"]["approval"]["actor"] == "person:alice@example.com"
    assert len(app.approvals(event_id)) == 1
    assert decisions(app, event_id)[-1] == {
        "Rule": "manual",
        "Actor": "person:alice@example.com",
        "Outcome": "approve",
        "DryRun": 0,
    }
    again = post(app, event_id, {**bob, "Origin": OWN_ORIGIN}, form_token_of(bobs_page))
    assert again.status_code == 409  # already approved, by alice
    assert json.loads(again.get_body())["status"] == "already-approved"
    assert len(app.approvals(event_id)) == 1
    missing = post(app, "nope", {**alice, "Origin": OWN_ORIGIN}, "1.x")
    assert missing.status_code == 403  # the token is checked before the event is even looked up


def test_without_sign_in_nothing_is_shown_or_approved(app: App):
    event_id = reboot_waiting_for_a_person(app)
    assert open_page(app, event_id, {}).status_code == 401
    assert post(app, event_id, {"Origin": OWN_ORIGIN}, None).status_code == 401
    # The name header alone is what a caller can type; it is never taken as a sign-in.
    named = post(app, event_id, {"X-MS-CLIENT-PRINCIPAL-NAME": "alice@example.com", "Origin": OWN_ORIGIN}, None)
    assert named.status_code == 401
    garbage = post(app, event_id, {"X-MS-CLIENT-PRINCIPAL": "not base64 json!", "Origin": OWN_ORIGIN}, None)
    assert garbage.status_code == 401
    assert b"X-MS-CLIENT-PRINCIPAL".lower() in garbage.get_body().lower()
    assert app.module.pending_events(get("/api/events")).status_code == 401
    assert app.approvals(event_id) == []


def test_without_platform_authentication_no_principal_header_is_trusted(app: App, monkeypatch: pytest.MonkeyPatch):
    event_id = reboot_waiting_for_a_person(app)
    alice = principal(APPROVE_ROLE)
    token = form_token_of(open_page(app, event_id, alice))
    monkeypatch.delenv("WEBSITE_AUTH_ENABLED")  # e.g. someone switched App Service Authentication off
    refused = post(app, event_id, {**alice, "Origin": OWN_ORIGIN}, token)
    assert refused.status_code == 503
    assert b"WEBSITE_AUTH_ENABLED" in refused.get_body()
    assert app.approvals(event_id) == []


def test_signed_in_without_the_role_is_refused(app: App):
    event_id = reboot_waiting_for_a_person(app)
    nobody = principal()  # signed in, in the tenant, no app role
    assert open_page(app, event_id, nobody).status_code == 403
    assert app.module.pending_events(get("/api/events", headers=nobody)).status_code == 403
    reader = principal(READ_ROLE)
    page = open_page(app, event_id, reader)
    assert page.status_code == 200
    assert b'name="token"' not in page.get_body()  # a reader gets no form
    # Even with a token minted for an approver, a reader cannot approve.
    approver_token = form_token_of(open_page(app, event_id, principal(APPROVE_ROLE)))
    refused = post(app, event_id, {**reader, "Origin": OWN_ORIGIN}, approver_token)
    assert refused.status_code == 403
    assert APPROVE_ROLE.encode() in refused.get_body()
    listed = app.module.pending_events(get("/api/events", headers=reader))
    assert listed.status_code == 200
    assert [e["eventId"] for e in json.loads(listed.get_body())["events"]] == [event_id]
    assert app.approvals(event_id) == []


@pytest.mark.parametrize(
    ("origin_headers", "reason"),
    [
        ({"Origin": "https://evil.example"}, b"not from this app"),
        ({"Origin": "null", "Referer": "https://evil.example/page"}, b"not from this app"),
        ({"Referer": "https://127.0.0.1.evil.example/x"}, b"not from this app"),
        ({}, b"no Origin or Referer"),
    ],
)
def test_a_cross_site_post_is_refused(app: App, origin_headers: dict[str, str], reason: bytes):
    event_id = reboot_waiting_for_a_person(app)
    alice = principal(APPROVE_ROLE)
    token = form_token_of(open_page(app, event_id, alice))
    refused = post(app, event_id, {**alice, **origin_headers}, token)
    assert refused.status_code == 403
    assert reason in refused.get_body()
    assert app.approvals(event_id) == []
    # The same form from the app's own page (Referer only, as some browsers send) goes through.
    accepted = post(app, event_id, {**alice, "Referer": f"{OWN_ORIGIN}/api/events/{event_id}/approve"}, token)
    assert accepted.status_code == 200, accepted.get_body()


def test_a_missing_forged_foreign_or_expired_token_is_refused(app: App):
    event_id = reboot_waiting_for_a_person(app)
    other_id = reboot_waiting_for_a_person(app, "WestNO_0")
    alice = {**principal(APPROVE_ROLE), "Origin": OWN_ORIGIN}
    bob = principal(APPROVE_ROLE, upn="bob@example.com", oid="0a1b2c3d-0000-4000-8000-000000000002")
    token = form_token_of(open_page(app, event_id, alice))
    stamp, _, signature = token.partition(".")
    attempts = {
        "missing": None,
        "forged": f"{stamp}.{signature[::-1]}",
        "stretched": f"{int(stamp) + 3600}.{signature}",  # a later expiry under the same signature
        "another event's": form_token_of(open_page(app, other_id, alice)),
        "another person's": form_token_of(open_page(app, event_id, bob)),
        "huge": "9" * 40 + ".x",
    }
    for name, attempt in attempts.items():
        refused = post(app, event_id, alice, attempt)
        assert refused.status_code == 403, (name, refused.get_body())
    app.clock.now = app.clock.now + timedelta(minutes=21)  # the page was left open too long
    expired = post(app, event_id, alice, token)
    assert expired.status_code == 403
    assert b"expired" in expired.get_body()
    assert app.approvals(event_id) == []


def test_every_instance_shares_the_form_key(app: App):
    from coordinator.state.tables import TableStateStore

    first = app.coordinator.parts.store.shared_key("approval-form")
    # Another instance: its own client on the same table (the key was created once, by whoever came first).
    settings = app.module.settings()
    assert settings.storage_connection_string is not None
    other = TableStateStore.from_connection_string(
        settings.storage_connection_string.get_secret_value(), table_name=app.table
    )
    assert other.shared_key("approval-form") == first
    assert len(first) == 32
    assert other.shared_key("another-purpose") != first


def test_dry_run_records_the_persons_decision_and_sends_nothing(app: App):
    event_id = reboot_waiting_for_a_person(app)
    app.coordinator.options = replace(app.coordinator.options, dry_run=True)
    alice = principal(APPROVE_ROLE)
    answer = post(app, event_id, {**alice, "Origin": OWN_ORIGIN}, form_token_of(open_page(app, event_id, alice)))
    assert answer.status_code == 200, answer.get_body()
    assert json.loads(answer.get_body())["status"] == "dry-run"
    assert decisions(app, event_id)[-1] == {
        "Rule": "manual",
        "Actor": "person:alice@example.com",
        "Outcome": "approve",
        "DryRun": 1,
    }
    app.module.reevaluate(TimerRequest(past_due=False))
    assert app.approvals(event_id) == []
    stored = app.coordinator.parts.store.get_event(event_id)
    assert stored is not None
    assert stored.record.state == "Scheduled"
    assert stored.record.approval is None


def test_dry_run_holds_an_approval_decided_before_it_was_switched_on(app: App):
    event_id = reboot_waiting_for_a_person(app)
    # Decided and committed, but not yet delivered (e.g. Relay was down); then the coordinator restarts in dry-run.
    app.coordinator.parts = replace(app.coordinator.parts, callback=_Unreachable())
    alice = principal(APPROVE_ROLE)
    answer = post(app, event_id, {**alice, "Origin": OWN_ORIGIN}, form_token_of(open_page(app, event_id, alice)))
    assert json.loads(answer.get_body())["status"] == "sent"
    app.module.coordinator.cache_clear()
    app.module.coordinator().parts = replace(app.module.coordinator().parts, clock=app.clock)
    app.module.coordinator().options = replace(app.module.coordinator().options, dry_run=True)
    app.clock.now = app.clock.now + timedelta(minutes=2)  # past the retry time of the pending delivery
    app.module.reevaluate(TimerRequest(past_due=False))
    assert app.approvals(event_id) == []
    stored = app.coordinator.parts.store.get_event(event_id)
    assert stored is not None
    assert stored.record.approval is not None
    assert not stored.record.approval.delivered


def test_a_second_approval_while_the_first_is_on_its_way_sends_nothing(app: App):
    """One decision, one StartRequests per event, whatever the clicks: a second click, a second tab or a second
    approver while the first approval is still being delivered is told so, and decides and sends nothing (a second
    decision has its own decisionId, so the VM's listener would POST StartRequests again)."""
    event_id = reboot_waiting_for_a_person(app)
    working = app.coordinator.parts.callback
    # The first approval cannot be delivered yet.
    app.coordinator.parts = replace(app.coordinator.parts, callback=_Unreachable())
    alice = principal(APPROVE_ROLE)
    bob = principal(APPROVE_ROLE, upn="bob@example.com", oid="0a1b2c3d-0000-4000-8000-000000000002")
    pages = {"alice": open_page(app, event_id, alice), "bob": open_page(app, event_id, bob)}
    first = post(app, event_id, {**alice, "Origin": OWN_ORIGIN}, form_token_of(pages["alice"]))
    assert json.loads(first.get_body())["status"] == "sent"
    app.coordinator.parts = replace(app.coordinator.parts, callback=working)
    for who, headers in (("alice", alice), ("bob", bob)):
        again = post(app, event_id, {**headers, "Origin": OWN_ORIGIN}, form_token_of(pages[who]))
        assert again.status_code == 409
        answer = json.loads(again.get_body())
        assert answer["status"] == "already-approved"
        assert "is already approved by person:alice@example.com" in answer["message"]
        assert "attempt 1 answered failed: relay unreachable (test)" in answer["message"]
        assert answer["message"].endswith("nothing more is sent")
    assert [d["Actor"] for d in decisions(app, event_id) if d["Rule"] == "manual"] == ["person:alice@example.com"]
    assert app.approvals(event_id) == []
    # The page no longer offers the form.
    reopened = open_page(app, event_id, bob)
    assert b'name="token"' not in reopened.get_body()
    assert b"Already approved by person:alice@example.com" in reopened.get_body()
    # The one decision is delivered by the timer's retry: one StartRequests.
    app.clock.now = app.clock.now + timedelta(minutes=2)
    app.module.reevaluate(TimerRequest(past_due=False))
    assert len(app.approvals(event_id)) == 1


BROWSER = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"


@pytest.mark.parametrize(
    ("accept", "html"),
    [
        (BROWSER, True),
        ("text/html", True),
        ("application/json, text/html", True),  # equal preference: a person is looking
        ("*/*", False),  # curl, requests
        ("", False),
        ("application/json", False),
        ("application/json, text/html;q=0.5", False),
        ("text/html;q=0", False),
        ("text/html;q=oops", False),
    ],
)
def test_a_browser_is_told_from_a_script_by_accept(accept: str, html: bool):
    from coordinator.http import wants_html

    assert wants_html({"Accept": accept}) is html


def test_a_browser_gets_pages_and_a_script_json(app: App):
    event_id = reboot_waiting_for_a_person(app)
    alice = principal(APPROVE_ROLE)
    listed = app.module.pending_events(get("/api/events", headers={**alice, "Accept": BROWSER}))
    assert listed.status_code == 200
    assert listed.mimetype == "text/html"
    assert listed.headers["Content-Security-Policy"].startswith("default-src 'none'")
    assert listed.headers["Vary"] == "Accept"
    body = listed.get_body().decode()
    assert f'data-event-id="{event_id}"' in body
    assert f'href="/api/events/{event_id}/approve">Approve…</a>' in body
    scripted = app.module.pending_events(get("/api/events", headers={**alice, "Accept": "*/*"}))
    assert scripted.mimetype == "application/json"
    assert scripted.headers["Vary"] == "Accept"
    assert [e["eventId"] for e in json.loads(scripted.get_body())["events"]] == [event_id]
    # Refusals too: a page with the reason for a person, JSON for a script.
    unsigned = app.module.pending_events(get("/api/events", headers={"Accept": BROWSER}))
    assert (unsigned.status_code, unsigned.mimetype) == (401, "text/html")
    assert b"Sign in first" in unsigned.get_body()
    assert json.loads(app.module.pending_events(get("/api/events")).get_body())["error"].startswith("sign in first")
    # The approval's answer: the result page in a browser.
    page = open_page(app, event_id, alice)
    approved = post(app, event_id, {**alice, "Origin": OWN_ORIGIN, "Accept": BROWSER}, form_token_of(page))
    assert (approved.status_code, approved.mimetype) == (200, "text/html")
    assert b"<h1>Approved</h1>" in approved.get_body()
    assert f"event {event_id} approved by alice@example.com".encode() in approved.get_body()
    assert len(app.approvals(event_id)) == 1


class _Unreachable:
    def send(self, request: Any, *, vm: Any) -> Any:
        from coordinator.adapters.callback import ApprovalDeliveryError

        raise ApprovalDeliveryError("relay unreachable (test)")


def test_terminate_is_approved_after_every_prepare_hook(app: App, monkeypatch: pytest.MonkeyPatch):
    """A scale-in deleting two VMs: approved through the function once both prepare phases succeeded, and each
    deleted VM's own ledger (checked before approving) agrees."""
    ledger: dict[tuple[str, str], str] = {}
    with imds_serving("function-app-deletes", web_vms("web_0", "web_1")) as fleet:
        builder = direct_coordinator(app.module.settings, fleet.url, hook_ledger=lambda v, e: ledger.get((v, e)))
        monkeypatch.setattr(app.module, "coordinator", builder)
        app.module.coordinator().parts = replace(app.module.coordinator().parts, clock=app.clock)
        event_id = fleet.create_event(EventType="Terminate", Resources=["web_0", "web_1"], NoticeSeconds=900)["EventId"]
        document = fleet.document("web_0")
        identities = [vm(n, group="pg-web", scale_set="web", index=i + 1) for i, n in enumerate(("web_0", "web_1"))]
        ingest(app, [envelope(i, sequence=1, incarnation=2, events=document["Events"]) for i in identities])
        assert [a for a in fleet.approvals() if a["EventId"] == event_id] == []
        hook = {"eventId": event_id, "phase": "prepare", "outcome": "succeeded", "durationSeconds": 2.0, "exitCode": 0}
        ledger[("web_0", event_id)] = "succeeded"
        ingest(app, [envelope(identities[0], sequence=2, kind="hook", hook=hook)], start=5)
        assert [a for a in fleet.approvals() if a["EventId"] == event_id] == []  # web_1 has not drained yet
        ledger[("web_1", event_id)] = "succeeded"
        ingest(app, [envelope(identities[1], sequence=2, kind="hook", hook=hook)], start=6)
        assert len([a for a in fleet.approvals() if a["EventId"] == event_id]) == 1
    stored = app.coordinator.parts.store.get_event(event_id)
    assert stored is not None
    assert stored.record.state == "Approved"
