"""Tracing and health, on the real emulators: an incarnation change's Event Hubs message carries the W3C context
of the forwarder's `forwarder.detect` span (through a spool replay and a restart); heartbeats report IMDS health;
a forwarder with telemetry off never loads the OpenTelemetry SDK."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import requests

from contracts.envelope import ForwarderHealth
from emulators.eventhubs import EventHubsEmulator
from emulators.eventhubs.partition_log import StoredEvent
from emulators.imds import ImdsEmulator
from forwarder.eventhub import EventHubSink
from forwarder.telemetry import SERVICE_NAME
from tests.forwarder.conftest import HUB, Harness, forwarder_importing, read_envelopes, write_hook
from tests.polling import wait_for

TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
MakeHarness = Callable[..., Harness]


def spans(path: Path) -> list[dict[str, Any]]:
    return read_envelopes(path)  # whole lines only: the forwarder may be appending


def properties(event: StoredEvent) -> dict[str, str]:
    """The message's application properties, keys and values as text (AMQP may hand them back as bytes)."""

    def text(value: Any) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    return {text(k): text(v) for k, v in event.properties.items()}


def hub_message(eventhubs: EventHubsEmulator, incarnation: int) -> StoredEvent | None:
    for event in eventhubs.all_events(HUB):
        envelope = json.loads(event.body)
        if envelope["kind"] == "incarnation" and envelope["document"]["DocumentIncarnation"] == incarnation:
            return event
    return None


def wait_message(eventhubs: EventHubsEmulator, incarnation: int, timeout: float = 20.0) -> StoredEvent:
    event: StoredEvent = wait_for(
        lambda: hub_message(eventhubs, incarnation), timeout=timeout, what=f"incarnation {incarnation} in the hub"
    )
    return event


def wait_span(spans_file: Path, span_id: str) -> dict[str, Any]:
    """The recorded span with this id. A span reaches the file when it ends, and a message may reach the hub first:
    `forwarder.send` ends after the send returns, and the sender may send an envelope before the `forwarder.detect`
    or `forwarder.hooks` span that spooled it has ended. So wait for it."""
    span: dict[str, Any] = wait_for(
        lambda: next((s for s in spans(spans_file) if s["spanId"] == span_id), None),
        what=f"span {span_id!r} in the spans file",
    )
    return span


def assert_traced(event: StoredEvent, spans_file: Path, *, incarnation: int, event_ids: str) -> None:
    """The message's traceparent is the child of a `forwarder.send` span, itself the child of the
    `forwarder.detect` span of that incarnation: one trace from the detection to the hub."""
    carried = properties(event)
    assert "tracestate" not in carried  # only when non-empty
    match = TRACEPARENT.match(carried.get("traceparent", ""))
    assert match, f"no valid traceparent application property: {carried}"
    trace_id, parent_id, flags = match.groups()
    assert int(flags, 16) & 1, "sampled, so that the coordinator records its part"
    assert b"traceparent" not in event.body  # beside the envelope, not in it
    sent = wait_span(spans_file, parent_id)
    assert sent["name"] == "forwarder.send"
    assert sent["traceId"] == trace_id
    assert "error.type" not in sent["attributes"]
    detect = wait_span(spans_file, sent["parentSpanId"])
    detections = [s for s in spans(spans_file) if s["name"] == "forwarder.detect"]
    of_incarnation = [s for s in detections if s["attributes"]["scheduled_events.incarnation"] == incarnation]
    assert of_incarnation == [detect], "one detection per incarnation"
    assert detect["traceId"] == trace_id
    assert detect["parentSpanId"] == ""  # the trace starts at the detection
    assert detect["attributes"]["scheduled_events.event_ids"] == event_ids
    assert detect["attributes"]["vm.name"] == "web_0"
    for span in (detect, sent):
        assert span["service"] == SERVICE_NAME
        assert 0 < span["startTimeUnixNano"] <= span["endTimeUnixNano"]
        assert set(span) == {
            "traceId", "spanId", "parentSpanId", "name", "service", "startTimeUnixNano", "endTimeUnixNano",
            "attributes",
        }  # fmt: skip


def test_an_incarnation_message_carries_the_trace_of_its_detection(
    imds: ImdsEmulator, eventhubs: EventHubsEmulator, harness: MakeHarness, tmp_path: Path
) -> None:
    spans_file = tmp_path / "spans.jsonl"
    sink = EventHubSink.from_connection_string(eventhubs.rest_connection_string(HUB))
    harness(imds.url_for("web_0"), sink=sink, heartbeat_interval=0.2, telemetry_spans_file=spans_file)
    first = wait_message(eventhubs, 1)
    created = imds.create_event(EventType="Reboot", Resources=["web_0"], NoticeSeconds=900)
    assert_traced(wait_message(eventhubs, 2), spans_file, incarnation=2, event_ids=created["EventId"])
    # Each change is a trace of its own; heartbeats carry none.
    assert_traced(first, spans_file, incarnation=1, event_ids="")
    assert properties(first)["traceparent"][3:35] != properties(wait_message(eventhubs, 2))["traceparent"][3:35]
    beats = [e for e in eventhubs.all_events(HUB) if json.loads(e.body)["kind"] == "heartbeat"]
    assert beats
    assert all("traceparent" not in properties(e) for e in beats)


def test_with_telemetry_off_the_trace_context_is_still_made_and_sent(
    imds: ImdsEmulator, eventhubs: EventHubsEmulator, harness: MakeHarness, tmp_path: Path
) -> None:
    sink = EventHubSink.from_connection_string(eventhubs.rest_connection_string(HUB))
    h = harness(imds.url_for("web_0"), sink=sink)
    assert h.settings.telemetry_spans_file is None
    first = TRACEPARENT.match(properties(wait_message(eventhubs, 1)).get("traceparent", ""))
    imds.create_event(EventType="Reboot", Resources=["web_0"], NoticeSeconds=900)
    second = TRACEPARENT.match(properties(wait_message(eventhubs, 2)).get("traceparent", ""))
    assert first
    assert second, "no trace context without a spans file: the coordinator's spans would have no trace to join"
    assert first.group(1) != second.group(1), "a trace per change"
    assert "0" * 32 not in (first.group(1), second.group(1))
    assert int(second.group(3), 16) & 1  # sampled
    assert not list(tmp_path.rglob("*spans*"))


def test_a_hook_report_joins_the_trace_of_the_change_that_ran_its_hooks(
    imds: ImdsEmulator, eventhubs: EventHubsEmulator, harness: MakeHarness, tmp_path: Path
) -> None:
    spans_file = tmp_path / "spans.jsonl"
    write_hook(tmp_path / "vm" / "hooks" / "prepare.d", "10-drain", "exit 0\n")
    sink = EventHubSink.from_connection_string(eventhubs.rest_connection_string(HUB))
    harness(imds.url_for("web_0"), sink=sink, telemetry_spans_file=spans_file)
    created = imds.create_event(EventType="Reboot", Resources=["web_0"], NoticeSeconds=900)
    wait_message(eventhubs, 2)

    def hook_message() -> StoredEvent | None:
        return next((e for e in eventhubs.all_events(HUB) if json.loads(e.body)["kind"] == "hook"), None)

    message: StoredEvent = wait_for(hook_message, timeout=20, what="the hook report in the hub")
    assert json.loads(message.body)["hook"]["outcome"] == "succeeded"
    match = TRACEPARENT.match(properties(message)["traceparent"])
    assert match
    sent = wait_span(spans_file, match.group(2))
    hooks = wait_span(spans_file, sent["parentSpanId"])
    detect = wait_span(spans_file, hooks["parentSpanId"])
    assert (sent["name"], hooks["name"], detect["name"]) == ("forwarder.send", "forwarder.hooks", "forwarder.detect")
    assert {sent["traceId"], hooks["traceId"], detect["traceId"]} == {match.group(1)}
    assert detect["attributes"]["scheduled_events.incarnation"] == 2
    assert hooks["attributes"]["scheduled_events.event_id"] == created["EventId"]
    assert hooks["attributes"]["scheduled_events.hook_phase"] == "prepare"
    assert hooks["attributes"]["scheduled_events.hook_outcome"] == "succeeded"


def test_the_trace_survives_a_spool_replay_and_a_restart(
    imds: ImdsEmulator, eventhubs: EventHubsEmulator, harness: MakeHarness, tmp_path: Path
) -> None:
    spans_file = tmp_path / "spans.jsonl"
    connection_string = eventhubs.rest_connection_string(HUB)

    def start() -> Harness:
        sink = EventHubSink.from_connection_string(connection_string)
        return harness(imds.url_for("web_0"), sink=sink, telemetry_spans_file=spans_file)

    h = start()
    wait_message(eventhubs, 1)
    # The hub goes down: a change is spooled with its trace context, its sends fail, then the hub comes back.
    eventhubs.stop()
    reboot = imds.create_event(EventType="Reboot", Resources=["web_0"], NoticeSeconds=900)
    wait_for(lambda: h.forwarder.counters["send_failures"] >= 1 and h.store.depth() >= 1, what="a failed send")
    eventhubs.start()
    assert_traced(wait_message(eventhubs, 2), spans_file, incarnation=2, event_ids=reboot["EventId"])
    failed = [s for s in spans(spans_file) if s["name"] == "forwarder.send" and "error.type" in s["attributes"]]
    assert failed, "the failed attempt is a forwarder.send span too, with its error"

    # Down again, a change spooled, the forwarder stopped while it cannot send; the next one sends it.
    eventhubs.stop()
    freeze = imds.create_event(EventType="Freeze", Resources=["web_1"], NoticeSeconds=900)
    wait_for(lambda: h.forwarder.counters["changes"] >= 3, what="the change while the hub is down")
    h.stop()
    assert h.store.path.exists()
    eventhubs.start()
    start()
    assert_traced(
        wait_message(eventhubs, 3), spans_file, incarnation=3, event_ids=f"{reboot['EventId']},{freeze['EventId']}"
    )


def test_heartbeats_report_imds_health_while_polls_fail(imds: ImdsEmulator, harness: MakeHarness) -> None:
    h = harness(imds.url_for("web_0"), heartbeat_interval=0.2)

    def health() -> list[dict[str, Any]]:
        return [e["health"] for e in h.envelopes("heartbeat")]

    healthy = wait_for(lambda: [b for b in health() if b.get("lastGoodPollAt")], what="a heartbeat after a good poll")
    assert healthy[-1]["consecutivePollErrors"] == 0
    assert healthy[-1].get("listenerConnected") is None  # no listener configured (None is left out)
    assert "counters" in h.envelopes("heartbeat")[-1]  # the older field stays

    imds.inject_fault(kind="error-burst", count=10_000, status=503, vm="web_0")
    # A poll answered just before the fault may record its success a moment after it.
    faulted_at = datetime.now(UTC) + timedelta(seconds=0.5)
    # The poll backs off (0.5-1 s, then more) while IMDS fails; heartbeats go on and say so.
    beat = wait_for(
        lambda: [b for b in h.envelopes("heartbeat") if b["health"]["consecutivePollErrors"] >= 2],
        timeout=15,
        what="two failed polls",
    )[-1]
    sick = beat["health"]
    assert datetime.fromisoformat(sick["lastGoodPollAt"]) <= faulted_at  # no good poll since the fault
    age = ForwarderHealth.model_validate(sick).poll_age_seconds(datetime.fromisoformat(beat["observedAt"]))
    assert age is not None
    assert age >= 0.5
    assert sick["pollErrors"] >= sick["consecutivePollErrors"]
    assert "503" in sick["lastPollError"]
    assert len(sick["lastPollError"]) <= 256
    assert sick["spoolDepth"] >= 0
    assert sick["sendErrors"] == 0
    assert sick["dropped"] == 0

    requests.delete(f"{imds.url}/_emulator/faults", timeout=5).raise_for_status()
    recovered = wait_for(
        lambda: [b for b in health() if b["consecutivePollErrors"] == 0 and b["pollErrors"] >= 2],
        timeout=15,
        what="a good poll after the fault",
    )[-1]
    assert datetime.fromisoformat(recovered["lastGoodPollAt"]) > faulted_at
    assert "503" in recovered["lastPollError"]  # the last error is kept for whoever looks later


def test_health_counts_what_the_spool_dropped_and_failed_sends(
    imds: ImdsEmulator, eventhubs: EventHubsEmulator, harness: MakeHarness
) -> None:
    eventhubs_connection = eventhubs.rest_connection_string(HUB)
    eventhubs.stop()
    sink = EventHubSink.from_connection_string(eventhubs_connection)
    h = harness(imds.url_for("web_0"), sink=sink, heartbeat_interval=0.05, spool_max_entries=3)
    wait_for(lambda: h.store.counters().get("spool_dropped", 0) >= 3, what="the full spool to drop heartbeats")
    wait_for(lambda: h.forwarder.counters["send_failures"] >= 1, what="a failed send")
    eventhubs.start()
    beats = wait_for(
        lambda: [json.loads(e.body) for e in eventhubs.all_events(HUB) if json.loads(e.body)["kind"] == "heartbeat"],
        timeout=30,
        what="heartbeats after the outage",
    )
    health = beats[-1]["health"]
    assert health["dropped"] >= 3
    assert health["sendErrors"] >= 1
    assert health["dropped"] == beats[-1]["counters"]["spool_dropped"]


def _forwarder_imports(imds: ImdsEmulator, tmp_path: Path, **env: str) -> set[str]:
    """Runs `python -X importtime -m forwarder run` until it has forwarded the first document; the top-level
    packages of what it imported."""
    with forwarder_importing(imds, tmp_path, **env) as log:
        pass
    lines = log.read_text(encoding="utf-8").splitlines()
    return {ln.rsplit("|", 1)[1].strip().split(".")[0] for ln in lines if ln.startswith("import time:") and "|" in ln}


def test_opentelemetry_is_never_loaded_spans_are_recorded_without_it(imds: ImdsEmulator, tmp_path: Path) -> None:
    off = _forwarder_imports(imds, tmp_path / "off")
    assert "forwarder" in off  # its telemetry makes the trace context (test_trace_context.py)
    assert "opentelemetry" not in off
    assert "typing_extensions" not in off
    spans_file = tmp_path / "on" / "state" / "spans.jsonl"
    on = _forwarder_imports(imds, tmp_path / "on", SE_FORWARDER_TELEMETRY_SPANS_FILE=str(spans_file))
    assert "opentelemetry" not in on  # recorded by forwarder.telemetry.RecordingTracer
    assert [s["name"] for s in spans(spans_file)] == ["forwarder.detect", "forwarder.send"]
