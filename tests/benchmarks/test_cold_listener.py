"""benchmarks.cold_listener: approvals to a forwarder's on-demand listener, and a listener in another mode than the
one measured reported as a problem."""

from __future__ import annotations

import pytest

from benchmarks import cold_listener


@pytest.fixture(autouse=True)
def short_trials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cold_listener, "REFILL_SECONDS", 1.0)


@pytest.mark.slow
def test_a_short_run_measures_the_on_demand_listener() -> None:
    result = cold_listener.run(2)

    assert result["problems"] == []
    assert result["listener"] == "on-demand"
    assert result["samples"] == 2
    assert result["cold_listener_approval_ms_p50"] > 0
    assert result["cold_listener_approval_ms_p99"] >= result["cold_listener_approval_ms_p50"]


@pytest.mark.slow
def test_an_always_on_listener_is_not_the_on_demand_one() -> None:
    result = cold_listener.run(1, forwarder_mode="always-on")

    assert result["listener"] == "on-demand"
    assert any("not on demand" in problem for problem in result["problems"]), result["problems"]
    assert "cold_listener_approval_ms_p50" not in result
