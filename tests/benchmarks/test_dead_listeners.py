"""benchmarks.dead_listeners: live VMs' approvals beside a dead listener, and a live VM whose listener is dead too
reported as missed.

A short valid run of the benchmark is `python -m benchmarks --quick`'s (the test command runs it, and fails on
any problem it names); here, what must make a run invalid."""

from __future__ import annotations

import pytest

from benchmarks import dead_listeners


@pytest.mark.slow
def test_a_live_vm_with_a_dead_listener_is_a_missed_event() -> None:
    result = dead_listeners.run(events=2, vms=2, dead=0, in_run_seconds=3.0, seed=7, kill=frozenset({"bench_1"}))

    problems = result["problems"]
    assert any("1 live VMs' events not approved before their NotBefore" in p for p in problems), problems
    assert any("1 live approvals measured, 2 asked" in p for p in problems), problems
