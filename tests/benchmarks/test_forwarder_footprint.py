"""benchmarks.forwarder_footprint: real forwarders beside a bare poller, and a listener in another mode than its
configuration's reported as a problem."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import forwarder_footprint

SHORT = argparse.Namespace(seconds=6.0, warmup=3.0, sink="eventhub", auth="imds", event_every=0.0)
IDLE_AND_CONNECTED = {suffix: forwarder_footprint.CONFIGURATIONS[suffix] for suffix in ("", "_connected")}


@pytest.mark.slow
def test_a_short_run_measures_idle_and_connected_forwarders() -> None:
    result = forwarder_footprint.measure(SHORT, IDLE_AND_CONNECTED)

    assert result["problems"] == []
    assert result["listener_modes"] == {"production": "on-demand", "connected": "connected"}
    for key in ("forwarder_rss_mib", "forwarder_rss_ratio_to_bare_poller", "forwarder_rss_mib_connected"):
        assert result[key] > 0


@pytest.mark.slow
def test_a_connected_configuration_whose_listener_is_on_demand_is_a_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forwarder_footprint, "LISTENER_MODES", {"idle": "on-demand", "connected": "on-demand"})

    result = forwarder_footprint.measure(SHORT, IDLE_AND_CONNECTED)

    problems = result["problems"]
    assert any("forwarder_connected: its listener was not connected" in p for p in problems), problems
