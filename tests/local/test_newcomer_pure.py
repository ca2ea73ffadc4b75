"""The local runner's pure parts a newcomer meets (issue 25): the scenario's own expectations over the rules', the
live timeline in time order, one printed trace for approvals that share it, scenario errors with their line, and the
policy's health-page URLs pointed at the pages the runner serves."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from emulators.imds import Scenario, ScenarioError
from local.expectations import Expected, with_declared
from local.scenario import served_policy
from local.summary import RunFacts, summarize
from local.telemetry import Report
from local.timeline import InTimeOrder, moment

T0 = datetime(2026, 11, 25, 12, tzinfo=UTC)


def expected(label: str, approval: str) -> Expected:
    return Expected(label.upper(), label, "Reboot", approval, "one-reboot-per-zone", "Completed")  # type: ignore[arg-type]


def facts(items: list[Expected], approved: list[str]) -> RunFacts:
    return RunFacts(
        expected=items,
        imds_events=[],
        imds_approvals=[{"EventId": event_id} for event_id in approved],
        coordinator_states={item.event_id: "Completed" for item in items},
        envelopes_sent={"incarnation": 1},
        envelopes_delivered=1,
        last_sequence_sent={},
        last_sequence_applied={},
        sightings_sent=set(),
        sightings_logged=set(),
        dead_letters=0,
        failed_batches=0,
    )


def test_the_scenarios_expectation_replaces_an_either_and_fails_when_not_met() -> None:
    items = with_declared(
        [expected("zone-first", "either"), expected("zone-second", "either")], {"zone-second": "no-approval"}
    )
    assert [(item.approval, item.computed) for item in items] == [("either", None), ("no-approval", "either")]
    assert with_declared(items[:1], {}) == items[:1]
    summary = summarize(facts(items, approved=["ZONE-FIRST", "ZONE-SECOND"]))
    assert summary.failures == ["zone-second (Reboot): approved, although the scenario expects it is not"]
    assert summary.events[1]["expected"] == "no-approval"


def test_a_scenario_contradicting_its_policys_definite_rule_fails() -> None:
    items = with_declared([expected("manual-tag", "no-approval")], {"manual-tag": "approve"})
    summary = summarize(facts(items, approved=["MANUAL-TAG"]))
    assert summary.failures == [
        "manual-tag (Reboot): the scenario expects approve, but rule one-reboot-per-zone alone says no-approval: "
        "the scenario and its policy disagree"
    ]


def test_the_timeline_prints_in_time_order_what_was_logged_out_of_it() -> None:
    order = InTimeOrder(timedelta(seconds=2))
    order.add(T0 + timedelta(seconds=1), ["decided"])
    order.add(T0, ["seen"])  # observed before the decision, logged after it
    order.add(T0 + timedelta(seconds=1), ["approved"])
    assert order.due(T0 + timedelta(seconds=2)) == ["seen"]
    assert order.due(T0 + timedelta(seconds=3)) == ["decided", "approved"]
    order.add(T0 + timedelta(seconds=5), ["started"])
    assert order.due(T0 + timedelta(seconds=5)) == []
    assert order.flush() == ["started"]
    observation = {"RecordType": "Observation", "TimeGenerated": "2026-11-25T12:00:01+00:00"}
    assert moment(observation | {"ObservedAt": "2026-11-25T12:00:00+00:00"}) == T0
    assert moment({"RecordType": "Decision", "TimeGenerated": "2026-11-25T12:00:00+00:00"}) == T0


def span(span_id: str, name: str, start: float) -> dict[str, object]:
    return {"spanId": span_id, "name": name, "service": "s", "startMs": start, "durationMs": 1.0}


def test_approvals_sharing_a_trace_print_it_once() -> None:
    detect, send = span("d", "forwarder.detect", 0.0), span("s", "forwarder.send", 2.0)
    traces = [
        {"traceId": "T", "eventId": "AAAAAAAA-1", "spans": [detect, send, span("a1", "coordinator.approval", 10.0)]},
        # Times count from this approval's own first span, here the same detection.
        {"traceId": "T", "eventId": "BBBBBBBB-2", "spans": [detect, send, span("a2", "coordinator.approval", 12.0)]},
        {"traceId": "U", "eventId": "CCCCCCCC-3", "spans": [span("a3", "coordinator.approval", 0.0)]},
    ]
    lines = Report(traces=traces, metrics={}, metrics_by_attributes={}, problems=[]).render()
    assert [line for line in lines if line.startswith("event")] == [
        "events AAAAAAAA, BBBBBBBB  trace T",
        "event CCCCCCCC  trace U",
    ]
    assert sum("forwarder.detect" in line for line in lines) == 1
    assert [line.split()[2] for line in lines if "coordinator.approval" in line] == ["coordinator.approval"] * 3


def test_a_scenario_error_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        "name: bad\nvms:\n  - name: web_0\nsteps:\n  - at: 0\n    create: {EventType: Reboot, Resources: [web_0]}\n"
        "  - at: 10\n    wipeForwarderState: web_9\n",
        encoding="utf-8",
    )
    with pytest.raises(ScenarioError) as caught:
        Scenario.from_file(path)
    assert str(caught.value) == f"scenario {path} is invalid: steps.1.wipeForwarderState (line 8): unknown VM 'web_9'"


def test_the_policys_gate_urls_are_pointed_at_the_pages_served() -> None:
    text = 'gates:\n  app-health:\n    http: {url: "http://127.0.0.1:8765/health"}\nrules: []\n'
    assert served_policy(text, {"http://127.0.0.1:8765/health": "http://127.0.0.1:40123/health"}) == text.replace(
        "8765", "40123"
    )
