"""benchmarks.pipeline_latency: detect-to-approve through the whole local stack, and a run whose listeners are not on
demand reported as a problem.

A short valid run of the benchmark is `python -m benchmarks --quick`'s (the test command runs it, and fails on
any problem it names); here, what must make a run invalid."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from benchmarks import pipeline_latency
from local.forwarders import ForwarderProcess
from local.stack import LocalStack
from local.telemetry import EVENT_ID, SpanRecord


@pytest.mark.slow
def test_always_on_listeners_are_not_the_pipeline_s(monkeypatch: pytest.MonkeyPatch) -> None:
    forwarder = LocalStack._forwarder

    def always_on(self: LocalStack, vm: Any) -> ForwarderProcess:
        process = forwarder(self, vm)
        process._command += ["--relay-listener-mode", "always-on"]
        return process

    monkeypatch.setattr(LocalStack, "_forwarder", always_on)

    result = pipeline_latency.run(events=1, vms=2, seed=7, spacing=(0.5, 0.8))

    assert any("connected before any event (not on demand)" in p for p in result["problems"]), result["problems"]


def approve_span(event_id: str, start_ms: float, end_ms: float, name: str = "listener.approve") -> SpanRecord:
    return SpanRecord(
        "0" * 32, "1" * 16, "", name, "forwarder", int(start_ms * 1e6), int(end_ms * 1e6), {EVENT_ID: event_id}
    )


def test_after_the_decision_the_listeners_first_taking_and_its_own_time_are_split() -> None:
    decided = {e: datetime.fromtimestamp(1_800_000_000 + i, UTC) for i, e in enumerate(("A", "B", "C"))}
    at = {e: d.timestamp() * 1000 for e, d in decided.items()}
    spans = [
        approve_span("A", at["A"] + 40, at["A"] + 49),  # a second request, later: not the first taking
        approve_span("A", at["A"] + 15, at["A"] + 24),
        approve_span("B", at["B"] + 7, at["B"] + 10),
        approve_span("B", at["B"] + 1, at["B"] + 2, name="listener.imds_get"),  # not the listener's request
        approve_span("D", at["C"], at["C"] + 1),  # an event the run did not create
    ]

    to_listener, listener = pipeline_latency.listener_times(spans, decided, ["A", "B", "C"])

    assert [round(v, 3) for v in to_listener] == [15.0, 7.0]  # C: no listener took it, no sample
    assert [round(v, 3) for v in listener] == [9.0, 3.0]
