"""benchmarks.forwarder_footprint: real forwarders beside a bare poller, and a listener in another mode than its
configuration's reported as a problem.

A short valid run of the benchmark is `python -m benchmarks --quick`'s (the test command runs it, and fails on
any problem it names); here, what must make a run invalid."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import forwarder_footprint

SHORT = argparse.Namespace(seconds=6.0, warmup=3.0, sink="eventhub", auth="imds", event_every=0.0)
IDLE_AND_CONNECTED = {suffix: forwarder_footprint.CONFIGURATIONS[suffix] for suffix in ("", "_connected")}


@pytest.mark.slow
def test_a_connected_configuration_whose_listener_is_on_demand_is_a_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forwarder_footprint, "LISTENER_MODES", {"idle": "on-demand", "connected": "on-demand"})

    result = forwarder_footprint.measure(SHORT, IDLE_AND_CONNECTED)

    problems = result["problems"]
    assert any("forwarder_connected: its listener was not connected" in p for p in problems), problems
