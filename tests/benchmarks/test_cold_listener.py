"""benchmarks.cold_listener: approvals to a forwarder's on-demand listener, and a listener in another mode than the
one measured reported as a problem.

A short valid run of the benchmark is `python -m benchmarks --quick`'s (the test command runs it, and fails on
any problem it names); here, what must make a run invalid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import cold_listener


@pytest.fixture(autouse=True)
def short_trials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cold_listener, "REFILL_SECONDS", 1.0)


@pytest.mark.slow
def test_an_always_on_listener_is_not_the_on_demand_one() -> None:
    result = cold_listener.run(1, forwarder_mode="always-on")

    assert result["listener"] == "on-demand"
    assert any("not on demand" in problem for problem in result["problems"]), result["problems"]
    assert "cold_listener_approval_ms_p50" not in result


def test_an_envelope_the_forwarder_is_still_writing_is_not_read(tmp_path: Path) -> None:
    envelopes = tmp_path / "envelopes.jsonl"
    scheduled = {"document": {"Events": [{"EventId": "EV-1", "EventStatus": "Scheduled"}]}}
    whole = json.dumps({"document": {"Events": []}}) + "\n"
    envelopes.write_text(whole + json.dumps(scheduled)[:30], encoding="utf-8")  # its first buffer, not its end

    assert not cold_listener.seen_scheduled(envelopes, "EV-1")

    envelopes.write_text(whole + json.dumps(scheduled) + "\n", encoding="utf-8")
    assert cold_listener.seen_scheduled(envelopes, "EV-1")
