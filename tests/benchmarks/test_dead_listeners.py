"""benchmarks.dead_listeners: live VMs' approvals beside a dead listener, and a live VM whose listener is dead too
reported as missed."""

from __future__ import annotations

import pytest

from benchmarks import dead_listeners


@pytest.mark.slow
def test_a_short_run_approves_the_live_vms_and_never_the_dead_one() -> None:
    result = dead_listeners.run(events=4, vms=2, dead=1, in_run_seconds=3.0, seed=7)

    assert result["problems"] == []
    assert (result["live_events"], result["dead_events"], result["live_missed"]) == (2, 2, 0)
    assert result["deliveries_continued"] >= 1
    assert result["detect_to_approve_ms_p50"] > 0


@pytest.mark.slow
def test_a_live_vm_with_a_dead_listener_is_a_missed_event() -> None:
    result = dead_listeners.run(events=2, vms=2, dead=0, in_run_seconds=3.0, seed=7, kill=frozenset({"bench_1"}))

    problems = result["problems"]
    assert any("1 live VMs' events not approved before their NotBefore" in p for p in problems), problems
    assert any("1 live approvals measured, 2 asked" in p for p in problems), problems
