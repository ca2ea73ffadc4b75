"""Alerts: every card validates against the Adaptive Card 1.4 subset we emit and stays under Teams' 28 KB; the
webhook sink retries with backoff and never leaks the URL; a failing webhook never blocks the pipeline."""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any, get_args

import jsonschema
import pytest

from contracts.envelope import VmIdentity
from coordinator.adapters.teams import AlertError, TeamsWebhookSink
from coordinator.domain.cards import MAX_CARD_BYTES, build_card, build_vm_card, card_bytes
from coordinator.domain.model import AlertKind, ApprovalRecord, DecisionRecord, EventRecord, VmRecord
from coordinator.domain.policy_file import DEFAULT_POLICY_PATH, load_policy
from coordinator.pipeline.ingest import RawMessage
from coordinator.state.tables import TableStateStore
from local.direct_callback import DirectImdsCallback
from tests.coordinator.helpers import DOC_NOW, MemoryHistory, envelope, scheduled_event, vm
from tests.coordinator.runs import make_coordinator
from tests.loopback import QuietHandler

SCHEMA = json.loads((Path(__file__).with_name("adaptive_card_subset.schema.json")).read_text())
NOW = datetime(2026, 11, 20, 12, 0, tzinfo=UTC)


def big_record() -> EventRecord:
    names = [f"scaleset-with-a-long-name_{i}" for i in range(1000)]
    return EventRecord(
        eventId="C7061BAC-AFDC-4513-B24B-AA5F13A16123",
        eventType="Reboot",
        resources=names,
        description="x" * 5000,
        notBefore=NOW + timedelta(minutes=15),
        stateSince=NOW,
        createdAt=NOW,
        decision=DecisionRecord(
            decisionId="d1", rule="r" * 300, action="approve-now", verdict="approve", reason="why", decidedAt=NOW
        ),
        approval=ApprovalRecord(decisionId="d1", rule="r", actor="person:alice", decidedAt=NOW, outcome="failed"),
    )


@pytest.mark.parametrize("kind", [k for k in get_args(AlertKind) if k != "heartbeat-lost"])
def test_event_cards_validate_and_fit(kind: AlertKind):
    card = build_card(kind, big_record(), now=NOW, approve_url="https://app.example.net/api/events/E/approve")
    jsonschema.validate(card, SCHEMA)
    assert len(card_bytes(card)) < MAX_CARD_BYTES
    actions = card["attachments"][0]["content"].get("actions", [])
    if kind in ("new-event", "approval-failed"):
        assert actions == [
            {"type": "Action.OpenUrl", "title": "Approve now", "url": "https://app.example.net/api/events/E/approve"}
        ]
    else:
        assert actions == []


def test_a_card_standing_for_every_other_alert_kind_validates_and_fits():
    """The most a card can name (``also``: every event alert kind once, each with its explanation) stays a card Teams
    takes."""
    kinds = [k for k in get_args(AlertKind) if k not in ("heartbeat-lost", "forwarder-conflict", "imds-failing")]
    card = build_card("approval-failed", big_record(), now=NOW, also=[k for k in kinds if k != "approval-failed"])
    jsonschema.validate(card, SCHEMA)
    assert len(card_bytes(card)) < MAX_CARD_BYTES
    assert "Also since the last card: New scheduled event" in json.dumps(card)


def test_heartbeat_card_validates():
    record = VmRecord(identity=VmIdentity(name="web_1", vmId="v1", resourceId="/r/web_1"), lastSeen=NOW)
    card = build_vm_card("heartbeat-lost", record, now=NOW, timeout_seconds=300)
    jsonschema.validate(card, SCHEMA)
    assert "web_1" in card_bytes(card).decode()


def test_schema_subset_catches_mistakes():
    card = build_card("new-event", big_record(), now=NOW)
    card["attachments"][0]["content"]["body"][0]["colour"] = "Good"  # a typo Teams would silently ignore
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(card, SCHEMA)


class Webhook:
    """A loopback stand-in for the Teams Workflows endpoint: records bodies, answers the scripted statuses."""

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.bodies: list[Any] = []
        outer = self

        class Handler(QuietHandler):
            def do_POST(self) -> None:
                outer.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.respond(outer.statuses.pop(0) if outer.statuses else 202)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/workflows/run?sig=SECRET-SIGNATURE"


@pytest.fixture
def webhook() -> Iterator[Webhook]:
    hook = Webhook()
    yield hook
    hook.server.shutdown()
    hook.server.server_close()


def test_webhook_retries_with_backoff_and_keeps_the_url_secret(webhook: Webhook, caplog):
    waits: list[float] = []
    sink = TeamsWebhookSink(webhook_url=webhook.url, sleep=waits.append)
    webhook.statuses = [503, 429]
    card = build_card("new-event", big_record(), now=NOW)
    sink.send(card, key="E-new-event")
    assert len(webhook.bodies) == 3
    assert webhook.bodies[-1] == card
    assert len(waits) == 2
    assert 0 <= waits[0] <= 0.5
    assert 0 <= waits[1] <= 1.0

    webhook.statuses = [400]
    with caplog.at_level(logging.DEBUG), pytest.raises(AlertError) as caught:
        sink.send(card, key="E-approved")
    assert len(webhook.bodies) == 4  # a 400 is not retried
    assert "SECRET-SIGNATURE" not in str(caught.value)
    assert "SECRET-SIGNATURE" not in caplog.text


def test_a_failing_webhook_never_blocks_the_pipeline(azurite, imds, webhook: Webhook):
    store = TableStateStore.from_connection_string(azurite.connection_string, table_name="al" + uuid.uuid4().hex[:12])
    clock = [DOC_NOW]
    coordinator = make_coordinator(
        store=store,
        history=MemoryHistory(),
        alerts=TeamsWebhookSink(webhook_url=webhook.url, sleep=lambda _: None),
        callback=DirectImdsCallback(base_url=imds.url),
        policy=load_policy(DEFAULT_POLICY_PATH),
        clock=lambda: clock[0],
    )
    reboot = scheduled_event("EV-ALERT", event_type="Reboot", duration=-1)
    data = envelope(vm("WestNO_0", index=1), sequence=1, incarnation=2, events=[reboot])
    webhook.statuses = [500, 500, 500]
    report = coordinator.process_batch(
        [RawMessage(body=json.dumps(data).encode(), partition_key=data["vm"]["resourceId"].lower())]
    )
    assert report.accepted == 1
    assert report.alerts_failed == 1
    stored = store.get_event("EV-ALERT")
    assert stored is not None
    assert stored.record.decision is not None  # the decision went on regardless
    assert stored.record.pendingAlerts == ["new-event"]

    clock[0] = DOC_NOW + timedelta(minutes=1)
    coordinator.tick()  # the webhook answers again: the pending card goes out, once
    stored = store.get_event("EV-ALERT")
    assert stored is not None
    assert stored.record.pendingAlerts == []
    assert len(webhook.bodies) == 4
    coordinator.tick()
    assert len(webhook.bodies) == 4
