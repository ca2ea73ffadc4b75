"""python -m local's telemetry (local/telemetry.py): the forwarders' span files are read line by line (a bad line is
named and set aside, the others count), joined with the coordinator's in-process spans into one trace per approval,
written to telemetry.json with the run's metrics; the local function host carries each message's application
properties (the trace context) as the Functions worker does; and, end to end, an approval is one trace from the
forwarder's detection to the listener's approval."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from azure.eventhub import EventData

import function_app
from coordinator.adapters import telemetry
from local.runner import to_function_batch
from local.telemetry import REPORT_FILE, TELEMETRY_DIR, Collector, SpanRecord, approval_traces, read_forwarder_spans
from tests.local.conftest import Runner, compact_scenario

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
DETECT = "00f067aa0ba902b7"
MS = 1_000_000


def forwarder_line(name: str, span_id: str, parent: str, start_ms: int, end_ms: int, **attributes: Any) -> str:
    return json.dumps(
        {
            "traceId": TRACE,
            "spanId": span_id,
            "parentSpanId": parent,
            "name": name,
            "service": "scheduled-events-forwarder",
            "startTimeUnixNano": start_ms * MS,
            "endTimeUnixNano": end_ms * MS,
            "attributes": attributes,
        }
    )


def write_spans(folder: Path, vm: str, lines: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"spans-{vm}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


def coordinator_span(name: str, span_id: str, start_ms: int, end_ms: int, **attributes: Any) -> SpanRecord:
    return SpanRecord(
        trace_id=TRACE,
        span_id=span_id,
        parent_id=DETECT,
        name=name,
        service=telemetry.SERVICE_NAME,
        start_ns=start_ms * MS,
        end_ns=end_ms * MS,
        attributes=attributes,
    )


def test_a_bad_line_is_named_and_set_aside_and_the_others_count(tmp_path: Path) -> None:
    folder = tmp_path / TELEMETRY_DIR
    write_spans(
        folder,
        "web_0",
        [
            forwarder_line("forwarder.detect", DETECT, "", 1000, 1002, **{"scheduled_events.event_ids": "E1,E2"}),
            "{not json",
            forwarder_line("forwarder.send", "1111111111111111", DETECT, 1002, 1010),
            json.dumps({"traceId": "XYZ", "spanId": "1", "name": "x", "service": "s"}),
        ],
    )
    write_spans(folder, "web_1", [forwarder_line("listener.imds_get", "2222222222222222", "3333333333333333", 5, 6)])
    spans, problems = read_forwarder_spans(folder)
    assert [s.name for s in spans] == ["forwarder.detect", "forwarder.send", "listener.imds_get"]
    assert len(problems) == 2
    assert problems[0].startswith("spans-web_0.jsonl:2: ")
    assert problems[1].startswith("spans-web_0.jsonl:4: traceId: String should match pattern")
    assert spans[0].event_ids() == {"E1", "E2"}
    assert read_forwarder_spans(tmp_path / "absent") == ([], [])


def test_one_trace_per_approval_with_times_from_its_first_span(tmp_path: Path) -> None:
    folder = tmp_path / TELEMETRY_DIR
    write_spans(
        folder,
        "web_0",
        [
            forwarder_line("forwarder.detect", DETECT, "", 1000, 1003, **{"scheduled_events.event_ids": "E1,E2"}),
            forwarder_line("forwarder.send", "1111111111111111", DETECT, 1003, 1020),
            forwarder_line(
                "listener.approve",
                "4444444444444444",
                "5555555555555555",
                1300,
                1450,
                **{"scheduled_events.event_id": "E1", "scheduled_events.outcome": "approved"},
            ),
            forwarder_line("listener.imds_get", "6666666666666666", "4444444444444444", 1310, 1330),
        ],
    )
    forwarder, problems = read_forwarder_spans(folder)
    assert problems == []
    coordinator = [
        coordinator_span("coordinator.decide", "7777777777777777", 1100, 1105, **{telemetry.EVENT_ID: "E1"}),
        coordinator_span("coordinator.decide", "8888888888888888", 1100, 1104, **{telemetry.EVENT_ID: "E2"}),
        coordinator_span("coordinator.approval", "5555555555555555", 1200, 1500, **{telemetry.EVENT_ID: "E1"}),
    ]
    (trace,) = approval_traces([*forwarder, *coordinator])
    assert (trace["traceId"], trace["eventId"]) == (TRACE, "E1")
    assert [(s["name"], s["startMs"], s["durationMs"]) for s in trace["spans"]] == [
        ("forwarder.detect", 0.0, 3.0),
        ("forwarder.send", 3.0, 17.0),
        ("coordinator.decide", 100.0, 5.0),
        ("coordinator.approval", 200.0, 300.0),
        ("listener.approve", 300.0, 150.0),
        ("listener.imds_get", 310.0, 20.0),
    ]
    assert trace["spans"][3]["service"] == telemetry.SERVICE_NAME


def test_the_collector_writes_this_runs_spans_and_metrics(tmp_path: Path) -> None:
    collector = Collector.install()
    telemetry.event_detected("Freeze")  # an earlier run's: not this one's
    collector.begin()
    traceparent = f"00-{TRACE}-{DETECT}-01"
    telemetry.event_detected("Freeze")
    telemetry.decided(
        traceparent,
        started_ns=telemetry.now_ns(),
        event_id="E1",
        event_type="Freeze",
        rule="short-freeze",
        verdict="approve",
        action="approve-now",
        dry_run=False,
    )
    with telemetry.approval_span(traceparent, event_id="E1", decision_id="d1", vm="web_0") as span:
        headers: dict[str, str] = {}
        telemetry.inject(headers)
        telemetry.approval_answered(span, "approved")
    approval_id = headers["traceparent"].split("-")[2]
    write_spans(
        tmp_path / TELEMETRY_DIR,
        "web_0",
        [
            forwarder_line("forwarder.detect", DETECT, "", 1, 2, **{"scheduled_events.event_ids": "E1"}),
            forwarder_line(
                "listener.approve", "9999999999999999", approval_id, 3, 4, **{"scheduled_events.event_id": "E1"}
            ),
        ],
    )
    report = collector.finish(tmp_path)
    written = json.loads((tmp_path / REPORT_FILE).read_text(encoding="utf-8"))
    assert written == json.loads(json.dumps(report.as_dict(), default=str))
    (trace,) = written["traces"]
    assert {s["name"] for s in trace["spans"]} == {
        "forwarder.detect",
        "coordinator.decide",
        "coordinator.approval",
        "listener.approve",
    }
    assert written["metrics"]["scheduled_events.events.detected"] == 1
    lines = report.render()
    assert any("coordinator.approval" in line and "ms" in line for line in lines)
    assert any(line.startswith("event E1") for line in lines)


def test_the_local_host_hands_the_function_each_messages_application_properties() -> None:
    first, second, third = EventData(b"{}"), EventData(b"{}"), EventData(b"{}")
    first.properties = {b"traceparent": b"00-" + TRACE.encode() + b"-" + DETECT.encode() + b"-01"}
    second.properties = {"tracestate": "se=1", "traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"}
    batch = to_function_batch([first, second, third])
    properties = function_app.application_properties(batch)
    assert [p.get("traceparent") for p in properties] == [
        f"00-{TRACE}-{DETECT}-01",
        "00-" + "a" * 32 + "-" + "b" * 16 + "-01",
        None,
    ]
    assert properties[1]["tracestate"] == "se=1"


@pytest.mark.slow
def test_an_approval_is_one_trace_from_detection_to_the_listener_and_the_metrics_match_the_history(
    run_pipeline: Runner,
) -> None:
    """Needs the forwarder half of issue 13 (traceparent on incarnation envelopes, spans-<vm>.jsonl)."""
    outcome = run_pipeline(compact_scenario())
    outcome.judged_ok()
    report = outcome.telemetry
    assert report.problems == []
    with sqlite3.connect(outcome.stack.history_path) as db:
        decisions = db.execute(
            "SELECT count(*) FROM ScheduledEventsHistory_CL WHERE RecordType = 'Decision'"
        ).fetchone()
        approved = db.execute(
            "SELECT count(*) FROM ScheduledEventsHistory_CL WHERE RecordType = 'Transition' AND State = 'Approved'"
        ).fetchone()
        answered = db.execute(
            "SELECT count(*) FROM ScheduledEventsHistory_CL WHERE RecordType = 'Approval' AND Outcome = 'approved'"
        ).fetchone()
    assert report.metrics["scheduled_events.decisions"] == decisions[0] > 0
    approvals = report.metrics_by_attributes["scheduled_events.events.transitions"]
    assert sum(n for key, n in approvals.items() if key.endswith("scheduled_events.state=Approved")) == approved[0]
    assert report.metrics["scheduled_events.approval.latency"]["count"] == approved[0]
    # Each listener's answer is an Approval row; its Approved transition only when the answer is recorded before the
    # VM's next document shows the event Started. IMDS starts a Freeze at once: under load that document can come
    # first, and the event goes Scheduled -> Started ("seen Started while approval ... awaited its answer").
    assert outcome.summary.approvals_made == answered[0] == 2
    assert 1 <= approved[0] <= answered[0]
    written = json.loads((outcome.stack.workdir / REPORT_FILE).read_text(encoding="utf-8"))
    assert len(written["traces"]) >= outcome.summary.approvals_made
    complete = []
    for trace in written["traces"]:
        names = [span["name"] for span in trace["spans"]]
        chain = ["forwarder.detect", "coordinator.decide", "coordinator.approval", "listener.approve"]
        if all(name in names for name in chain):
            starts = [next(s["startMs"] for s in trace["spans"] if s["name"] == name) for name in chain]
            assert starts == sorted(starts), trace
            complete.append(trace)
    assert complete, f"no approval's trace spans detection to the listener: {written['traces']}"
    assert outcome.stack.imds is not None
    assert {t["eventId"] for t in complete} <= {str(e["EventId"]) for e in outcome.stack.imds.approvals()}
