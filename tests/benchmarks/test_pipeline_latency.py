"""benchmarks.pipeline_latency: detect-to-approve through the whole local stack, and a run whose listeners are not on
demand reported as a problem."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks import pipeline_latency
from local.stack import ForwarderProcess, LocalStack


@pytest.mark.slow
def test_a_short_run_approves_every_event_through_on_demand_listeners() -> None:
    result = pipeline_latency.run(events=3, vms=2, seed=7, spacing=(0.5, 0.8))

    assert result["problems"] == []
    assert result["listener"] == "on-demand"
    for key in ("detect_to_approve_ms_p50", "detect_to_approve_ms_p99", "pipeline_added_ms_p99"):
        assert result[key] > 0


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
