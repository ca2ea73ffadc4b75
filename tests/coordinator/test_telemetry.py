"""The coordinator's telemetry (adapters/telemetry.py), collected with the OpenTelemetry SDK as python -m local does
(local/telemetry.py): an approval continues the trace of the envelope that first reported its event, through the
decision, the approval's span and the Relay request's traceparent header; the metrics count what happened; a
forwarder whose heartbeats say IMDS fails raises one card, and another only after it recovered; an event that waits
for a person gets the card that says so."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import azure.monitor.opentelemetry
import pytest
from azure.core.credentials import AzureNamedKeyCredential
from azure.functions.eventhub import EventHubTriggerConverter
from azure.functions.meta import Datum
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan

import function_app
from coordinator.adapters import telemetry
from coordinator.adapters.relay_sender import RelayApprovalSender
from coordinator.adapters.teams import AlertError, FolderCardSink
from coordinator.pipeline.ingest import RawMessage
from coordinator.service import Coordinator
from emulators.azurite import AzuriteEndpoints
from emulators.imds import ImdsEmulator
from local.telemetry import Collector, metric_values
from tests.coordinator.conftest import App, Clock
from tests.coordinator.helpers import DOC_NOW, MemoryHistory, envelope, scheduled_event, vm
from tests.coordinator.runs import table_coordinator
from tests.loopback import QuietHandler

TRACE = "0af7651916cd43dd8448eb211c80319c"
SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE}-{SPAN}-01"
OTHER = f"00-{'1' * 32}-{'2' * 16}-01"


@pytest.fixture
def collector() -> Collector:
    collector = Collector.install()
    collector.begin()
    return collector


def build(azurite: AzuriteEndpoints, imds: ImdsEmulator, tmp: Path) -> tuple[Coordinator, MemoryHistory, Clock]:
    clock = Clock(DOC_NOW)
    coordinator, history = table_coordinator(
        azurite,
        imds,
        "s" + uuid.uuid4().hex[:12],
        tmp / "cards",
        clock,
        approve_url=lambda event_id: f"http://127.0.0.1:7071/api/events/{event_id}/approve",
    )
    return coordinator, history, clock


def message(data: dict[str, Any], traceparent: str = "") -> RawMessage:
    return RawMessage(
        body=json.dumps(data).encode(),
        partition_key=data["vm"]["resourceId"].lower(),
        enqueued_time=DOC_NOW - timedelta(seconds=2),
        traceparent=traceparent,
    )


def spans(collector: Collector, name: str) -> list[ReadableSpan]:
    return [s for s in collector.exporter.get_finished_spans() if s.name == name]


def parent_of(span: ReadableSpan) -> tuple[str, str]:
    assert span.parent is not None, f"{span.name} has no parent"
    return f"{span.parent.trace_id:032x}", f"{span.parent.span_id:016x}"


def test_an_approval_continues_the_trace_of_the_envelope_that_first_reported_its_event(
    azurite: AzuriteEndpoints, imds: ImdsEmulator, tmp_path: Path, collector: Collector
) -> None:
    coordinator, _history, _clock = build(azurite, imds, tmp_path)
    event_id = imds.create_event(EventType="Freeze", Resources=["WestNO_0", "WestNO_1"], NoticeSeconds=900)["EventId"]
    freeze = scheduled_event(event_id)
    coordinator.process_batch(
        [
            message(envelope(vm("WestNO_0", index=1), sequence=1, incarnation=2, events=[freeze]), TRACEPARENT),
            message(envelope(vm("WestNO_1", index=2), sequence=1, incarnation=2, events=[freeze]), OTHER),
            RawMessage(body=b"{not json", partition_key="x", enqueued_time=DOC_NOW - timedelta(seconds=2)),
        ]
    )
    stored = coordinator.event(event_id)
    assert stored is not None
    assert stored.record.traceparent == TRACEPARENT
    assert stored.record.state == "Approved"
    (decide,) = spans(collector, "coordinator.decide")
    assert parent_of(decide) == (TRACE, SPAN)
    assert decide.attributes is not None
    assert (decide.attributes["scheduled_events.rule"], decide.attributes["scheduled_events.verdict"]) == (
        "short-freeze",
        "approve",
    )
    assert decide.attributes["scheduled_events.event_id"] == event_id
    (approval,) = spans(collector, "coordinator.approval")
    assert parent_of(approval) == (TRACE, SPAN)
    assert approval.attributes is not None
    assert approval.attributes["scheduled_events.outcome"] == "approved"
    (batch,) = spans(collector, "coordinator.batch")
    assert {f"{link.context.trace_id:032x}" for link in batch.links} == {TRACE, "1" * 32}
    assert batch.parent is None or f"{batch.context.trace_id:032x}" not in (TRACE, "1" * 32)

    totals, by_attributes = metric_values(collector.reader.get_metrics_data())
    assert totals["scheduled_events.events.detected"] == 1
    assert by_attributes["scheduled_events.decisions"] == {
        "scheduled_events.dry_run=False,scheduled_events.rule=short-freeze,scheduled_events.verdict=approve": 1
    }
    assert totals["scheduled_events.approval.latency"]["count"] == 1
    assert totals["scheduled_events.approval.notice_left"]["count"] == 1
    assert totals["scheduled_events.batch.age"] == {"count": 3, "sum": 6.0, "max": 2.0}
    assert by_attributes["scheduled_events.dead_letters"] == {"scheduled_events.reason=invalid envelope": 1}
    assert by_attributes["scheduled_events.events.transitions"] == {
        "scheduled_events.event_type=Freeze,scheduled_events.state=Approved": 1
    }


def test_an_approval_the_timer_sends_again_continues_the_events_trace(
    azurite: AzuriteEndpoints, imds: ImdsEmulator, tmp_path: Path, collector: Collector
) -> None:
    coordinator, _history, clock = build(azurite, imds, tmp_path)
    coordinator.options = replace(coordinator.options, approval_backoff=(5.0, 60.0))
    event_id = imds.create_event(EventType="Freeze", Resources=["WestNO_0", "WestNO_1"], NoticeSeconds=900)["EventId"]
    imds.inject_fault(kind="error-burst", vm="WestNO_0", count=1, status=503)
    freeze = scheduled_event(event_id)
    coordinator.process_batch(
        [
            message(envelope(vm("WestNO_0", index=1), sequence=1, incarnation=2, events=[freeze]), TRACEPARENT),
            message(envelope(vm("WestNO_1", index=2), sequence=1, incarnation=2, events=[freeze]), OTHER),
        ]
    )
    clock.now = DOC_NOW + timedelta(minutes=2)
    coordinator.tick()
    stored = coordinator.event(event_id)
    assert stored is not None
    assert stored.record.state == "Approved"
    attempts = spans(collector, "coordinator.approval")
    assert [parent_of(span) for span in attempts] == [(TRACE, SPAN), (TRACE, SPAN)]
    assert [(span.attributes or {}).get("scheduled_events.outcome") for span in attempts] == [None, "approved"]
    assert not attempts[0].status.is_ok
    _totals, by_attributes = metric_values(collector.reader.get_metrics_data())
    # The timer's census: the event as this tick left it (series seen before in this process read 0).
    assert {k: v for k, v in by_attributes["scheduled_events.events.open"].items() if v} == {
        "scheduled_events.event_type=Freeze,scheduled_events.state=Approved": 1
    }
    assert by_attributes["scheduled_events.vms"]["scheduled_events.condition=reporting"] == 2


def test_only_a_valid_traceparent_is_kept_and_only_its_own_characters() -> None:
    assert telemetry.valid_traceparent(TRACEPARENT) == TRACEPARENT
    assert telemetry.valid_traceparent(TRACEPARENT + "x" * 10_000) == TRACEPARENT
    for bad in ("", "garbage", f"00-{'0' * 32}-{SPAN}-01", f"00-{TRACE}-{'0' * 16}-01", TRACEPARENT.upper()):
        assert telemetry.valid_traceparent(bad) == "", bad


def test_a_malformed_traceparent_is_not_kept_and_the_decision_joins_the_batchs_trace(
    azurite: AzuriteEndpoints, imds: ImdsEmulator, tmp_path: Path, collector: Collector
) -> None:
    coordinator, _history, _clock = build(azurite, imds, tmp_path)
    reboot = scheduled_event("EV-BADTRACE", event_type="Reboot", duration=-1)
    coordinator.process_batch(
        [message(envelope(vm("WestNO_0", index=1), sequence=1, incarnation=2, events=[reboot]), "00-zz-not-a-trace")]
    )
    stored = coordinator.event("EV-BADTRACE")
    assert stored is not None
    assert stored.record.traceparent == ""
    (decide,) = spans(collector, "coordinator.decide")
    (batch,) = spans(collector, "coordinator.batch")
    assert parent_of(decide) == (f"{batch.context.trace_id:032x}", f"{batch.context.span_id:016x}")
    assert batch.links == ()


def test_the_function_reads_each_messages_trace_context_from_the_batchs_properties_array(
    app: App, collector: Collector
) -> None:
    """The worker hands a cardinality-many batch one trigger metadata; ``PropertiesArray`` holds each message's
    application properties in order. The event is reported by the second message only: its context must be kept."""
    bodies = [
        envelope(vm("WestNO_0", index=1), sequence=1, incarnation=2, events=[]),
        envelope(vm("WestNO_1", index=2), sequence=1, incarnation=2, events=[scheduled_event("EV-PROPS", duration=-1)]),
    ]
    collection = Datum(type="collection_bytes", value=_Bytes([json.dumps(b).encode() for b in bodies]))
    system = [
        {"PartitionKey": b["vm"]["resourceId"].lower(), "SequenceNumber": i, "Offset": str(i)}
        for i, b in enumerate(bodies)
    ]
    properties = [{"traceparent": OTHER}, {"traceparent": TRACEPARENT, "tracestate": "se=1"}]
    events = EventHubTriggerConverter.decode(
        collection,
        trigger_metadata={
            "SystemPropertiesArray": Datum(type="json", value=json.dumps(system)),
            "PropertiesArray": Datum(type="json", value=json.dumps(properties)),
        },
    )
    assert isinstance(events, list)
    app.module.ingest_envelopes(events)
    stored = app.coordinator.event("EV-PROPS")
    assert stored is not None
    assert stored.record.traceparent == TRACEPARENT


class _Bytes:
    def __init__(self, items: list[bytes]) -> None:
        self.bytes = items


class _Listener(QuietHandler):
    """A hybrid connection's listener as the sender sees it: answers 'approved' and keeps the request headers."""

    seen: ClassVar[list[dict[str, str]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(dict(self.headers.items()))
        answer = json.dumps(
            {"outcome": "approved", "eventId": body["eventId"], "decisionId": body["decisionId"], "reason": ""}
        ).encode()
        self.respond(200, answer)


@pytest.fixture
def listener() -> Iterator[tuple[str, list[dict[str, str]]]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Listener)
    _Listener.seen = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _Listener.seen
    server.shutdown()
    server.server_close()


def test_the_relay_request_carries_the_approval_spans_traceparent(
    azurite: AzuriteEndpoints,
    imds: ImdsEmulator,
    tmp_path: Path,
    collector: Collector,
    listener: tuple[str, list[dict[str, str]]],
) -> None:
    coordinator, _history, clock = build(azurite, imds, tmp_path)
    endpoint, seen = listener
    sender = RelayApprovalSender(endpoint=endpoint, credential=AzureNamedKeyCredential("send", "c2VjcmV0"), clock=clock)
    coordinator.parts = replace(coordinator.parts, callback=sender)
    freeze = scheduled_event("EV-RELAYTRACE")
    coordinator.process_batch(
        [message(envelope(vm("WestNO_0", index=1), sequence=1, incarnation=2, events=[freeze]), TRACEPARENT)]
    )
    (approval,) = spans(collector, "coordinator.approval")
    (headers,) = seen
    assert headers["traceparent"] == f"00-{TRACE}-{approval.context.span_id:016x}-01"


def heartbeat(sequence: int, *, good_poll_ago: float | None, errors: int, at_minutes: float = 0) -> dict[str, Any]:
    at = DOC_NOW + timedelta(minutes=at_minutes)
    data = envelope(vm("WestNO_0", index=1), sequence=sequence, kind="heartbeat", observed_at=at)
    data["health"] = {
        "lastGoodPollAt": None if good_poll_ago is None else (at - timedelta(seconds=good_poll_ago)).isoformat(),
        "pollErrors": errors,
        "consecutivePollErrors": errors,
        "lastPollError": "ConnectTimeout: 169.254.169.254" if errors else "",
        "spoolDepth": 3,
        "dropped": 1,
    }
    return data


def test_imds_failing_is_carded_once_per_episode(
    azurite: AzuriteEndpoints, imds: ImdsEmulator, tmp_path: Path, collector: Collector
) -> None:
    coordinator, history, clock = build(azurite, imds, tmp_path)

    def outcomes() -> list[str]:
        return [r.Outcome for r in history.rows if r.RecordType == "Heartbeat"]

    def cards() -> list[str]:
        return sorted(p.name for p in (tmp_path / "cards").glob("*imds-failing*"))

    coordinator.process_batch([message(heartbeat(1, good_poll_ago=1, errors=0))])
    assert outcomes() == []
    assert cards() == []
    coordinator.process_batch([message(heartbeat(2, good_poll_ago=95, errors=90, at_minutes=1))])
    assert outcomes() == ["imds-failing"]
    assert len(cards()) == 1
    (row,) = [r for r in history.rows if r.Outcome == "imds-failing"]
    assert "no good IMDS poll for 95 s (limit 60 s)" in row.Reason
    assert "ConnectTimeout" in row.Reason
    assert row.Details is not None
    assert row.Details["consecutivePollErrors"] == 90
    # While it lasts: nothing more, even across the timer.
    coordinator.process_batch([message(heartbeat(3, good_poll_ago=155, errors=150, at_minutes=2))])
    clock.now = DOC_NOW + timedelta(minutes=2, seconds=5)
    coordinator.tick()
    assert outcomes() == ["imds-failing"]
    assert len(cards()) == 1
    totals, by_attributes = metric_values(collector.reader.get_metrics_data())
    assert by_attributes["scheduled_events.vms"]["scheduled_events.condition=unhealthy"] == 1
    assert by_attributes["scheduled_events.forwarder.poll_age"] == {
        "scheduled_events.scale_set=,scheduled_events.vm=WestNO_0": 155.0
    }
    assert totals["scheduled_events.forwarder.spool_depth"] == 3
    assert by_attributes["scheduled_events.vm.conditions"] == {"scheduled_events.condition=imds-failing": 1}
    assert by_attributes["scheduled_events.alerts"] == {
        "scheduled_events.alert_kind=imds-failing,scheduled_events.outcome=sent": 1
    }
    # Recovered, then failing again: a second card.
    coordinator.process_batch([message(heartbeat(4, good_poll_ago=0.5, errors=0, at_minutes=3))])
    assert outcomes() == ["imds-failing", "imds-recovered"]
    coordinator.process_batch([message(heartbeat(5, good_poll_ago=None, errors=60, at_minutes=4))])
    assert outcomes() == ["imds-failing", "imds-recovered", "imds-failing"]
    assert len(cards()) == 2
    last = [r for r in history.rows if r.RecordType == "Heartbeat"][-1]
    assert "no good IMDS poll since the forwarder started, 60 failed in a row" in last.Reason
    # The batch logged the cards it sent; the timer clears them from the VM's outbox and sends none again.
    clock.now = DOC_NOW + timedelta(minutes=5)
    coordinator.tick()
    assert pending(coordinator) == []
    assert len([r for r in history.rows if r.RecordType == "Alert" and r.Action == "imds-failing"]) == 2


def pending(coordinator: Coordinator) -> list[str]:
    (vm_record,) = [v for g in coordinator.parts.store.all_vm_groups() for v in g.record.vms.values()]
    return vm_record.pendingAlerts


class FlakySink:
    """A Teams webhook that refuses the first ``failures`` cards."""

    def __init__(self, inner: FolderCardSink, failures: int) -> None:
        self.inner, self.failures = inner, failures

    def send(self, card: dict[str, Any], *, key: str) -> None:
        if self.failures:
            self.failures -= 1
            raise AlertError(f"Teams webhook refused card {key}: HTTP 503 after 3 attempts")
        self.inner.send(card, key=key)


def test_a_vm_card_that_failed_stays_in_the_vms_outbox_until_the_timer_sends_it(
    azurite: AzuriteEndpoints, imds: ImdsEmulator, tmp_path: Path
) -> None:
    coordinator, history, clock = build(azurite, imds, tmp_path)
    coordinator.parts = replace(coordinator.parts, alerts=FlakySink(FolderCardSink(tmp_path / "cards"), failures=1))
    coordinator.process_batch([message(heartbeat(1, good_poll_ago=1, errors=0))])
    clock.now = DOC_NOW + timedelta(minutes=6)
    coordinator.tick()  # silent for 6 min > 300 s: lost; the card fails
    alerts = [(r.Action, r.Outcome, r.VmName) for r in history.rows if r.RecordType == "Alert"]
    assert alerts == [("heartbeat-lost", "failed", "WestNO_0")]
    assert pending(coordinator) == ["heartbeat-lost"]
    clock.now += timedelta(seconds=10)
    coordinator.tick()  # within ALERT_GRACE: not yet
    assert len([r for r in history.rows if r.RecordType == "Alert"]) == 1
    clock.now += timedelta(seconds=60)
    coordinator.tick()
    assert [(r.Action, r.Outcome) for r in history.rows if r.RecordType == "Alert"] == [
        ("heartbeat-lost", "failed"),
        ("heartbeat-lost", "sent"),
    ]
    assert pending(coordinator) == []
    # Keyed by when the VM was last heard: its heartbeat's enqueued time (DOC_NOW - 2 s), the service's clock.
    assert [p.name.split("-heartbeat-lost-")[1] for p in (tmp_path / "cards").glob("*heartbeat-lost*")] == [
        "20220411T221156.json"
    ]
    clock.now += timedelta(seconds=60)
    coordinator.tick()
    assert len([r for r in history.rows if r.RecordType == "Alert"]) == 2


def test_an_event_that_waits_for_a_person_gets_one_card_that_says_so(
    azurite: AzuriteEndpoints, imds: ImdsEmulator, tmp_path: Path
) -> None:
    coordinator, history, _clock = build(azurite, imds, tmp_path)
    # DurationInSeconds 0 is "no impact": no new-event card when first seen, but no rule approves it either.
    quiet = scheduled_event("EV-QUIET", event_type="Reboot", duration=0)
    loud = scheduled_event("EV-LOUD", event_type="Redeploy", duration=-1)
    coordinator.process_batch(
        [message(envelope(vm("WestNO_0", index=1), sequence=1, incarnation=2, events=[quiet, loud]))]
    )
    for event_id in ("EV-QUIET", "EV-LOUD"):
        sent = [r for r in history.rows if r.RecordType == "Alert" and r.EventId == event_id]
        assert [(r.Action, r.Outcome) for r in sent] == [("new-event", "sent")]
        card = json.loads((tmp_path / "cards" / f"{event_id}-new-event.json").read_text())
        content = card["attachments"][0]["content"]
        assert content["body"][0]["text"].startswith("New scheduled event needs a person's approval")
        assert "it waits for a person" in json.dumps(content)
        assert content["actions"] == [
            {
                "type": "Action.OpenUrl",
                "title": "Approve now",
                "url": f"http://127.0.0.1:7071/api/events/{event_id}/approve",
            }
        ]


def test_the_app_configures_azure_monitor_once_and_only_with_a_connection_string(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(azure.monitor.opentelemetry, "configure_azure_monitor", lambda **kw: calls.append(kw))
    unset = trace.ProxyTracerProvider()
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: unset)
    monkeypatch.delenv("APPLICATIONINSIGHTS_CONNECTION_STRING", raising=False)
    function_app._configure_telemetry()
    assert calls == []
    monkeypatch.setenv(
        "APPLICATIONINSIGHTS_CONNECTION_STRING", "InstrumentationKey=00000000-0000-0000-0000-000000000000"
    )
    function_app._configure_telemetry()
    (call,) = calls
    assert call["disable_logging"] is True
    assert call["resource"].attributes["service.name"] == "scheduled-events-coordinator"
    # A provider set already (the worker's own option, or this process's collector): not configured twice.
    monkeypatch.setattr(trace, "get_tracer_provider", object)
    function_app._configure_telemetry()
    assert len(calls) == 1
