"""benchmarks.wave: a small wave through the coordinator as shipped (attested envelopes, ARM's census) that measures
what it claims, and waves the coordinator must refuse reported as problems, so the validity check can fail."""

from __future__ import annotations

import json
import os
import pstats
from pathlib import Path
from typing import Any

import pytest

from benchmarks import wave


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    code = wave.main(list(argv))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    result: dict[str, Any] = json.loads(lines[-1])
    return code, result


def test_a_warm_wave_is_accepted_whole_and_decided_by_its_policy(capsys: pytest.CaptureFixture[str]) -> None:
    environment = dict(os.environ)

    code, result = run(capsys, "--vms", "200")

    assert result["problems"] == []
    assert code == 0
    assert result["bindings"] == "warm"
    assert result["accepted"] == result["wave_envelopes"] == 200
    assert result["dead_lettered"] == 0
    assert result["distinct_events"] == 10
    assert result["event_states"] == {"Scheduled": 10}
    # ARM's census lists what IMDS serves; every VM bound before the clock, none read again during the wave.
    assert result["census_vms"] == 200
    assert result["binding_rows"] == 800  # four per VM: its resource id, name and vmId bound both ways
    assert result["binding_table_ops"] == 0
    assert result["prep_seconds"] > 0
    assert os.environ == environment  # the coordinator's settings were put back


def test_a_cold_wave_binds_every_vm_under_the_census_policy(capsys: pytest.CaptureFixture[str]) -> None:
    code, result = run(capsys, "--vms", "100", "--bindings", "cold", "--policy", "census", "--event-type", "Terminate")

    assert result["problems"] == []
    assert code == 0
    assert result["bindings"] == "cold"
    assert result["accepted"] == 100
    assert result["binding_rows"] == 400
    # ARM's census vouched for each VM: no binding read or written during the wave; the tick after it writes the
    # four of each VM.
    assert result["binding_table_ops"] == 0
    assert result["bindings_written_by_ticks"] == 400
    assert result["ticks_writing_bindings_after"] == 0


def test_a_storm_is_dead_lettered_whole_over_several_partitions(capsys: pytest.CaptureFixture[str]) -> None:
    code, result = run(capsys, "--vms", "300", "--storm", "--batch", "50")

    assert result["problems"] == []
    assert code == 0
    assert result["bindings"] == "cold"
    assert result["accepted"] == 0
    assert result["dead_lettered"] == result["wave_envelopes"] == 300
    assert result["distinct_events"] == 0
    assert result["binding_rows"] == 0
    # Six batches of 50, each one transaction in a partition of its own drawn at random from 16: at least two.
    assert result["dead_letter_partitions"] >= 2
    assert result["dead_letter_busiest_partition_ops_per_s"] >= 50


@pytest.mark.parametrize(
    ("sabotage", "reason"),
    [("unsigned", "unattested"), ("foreign-anchor", "does not chain to a configured root")],
)
def test_a_wave_the_coordinator_refuses_is_reported_and_exits_1(
    capsys: pytest.CaptureFixture[str], sabotage: str, reason: str
) -> None:
    code, result = run(capsys, "--vms", "40", "--sabotage", sabotage)

    assert code == 1
    problems = result["problems"]
    assert "accepted 0 of 40 envelopes" in problems
    assert "dead_lettered 40 (expected 0)" in problems
    assert "distinct events 0 (expected 2)" in problems
    assert any(reason in problem for problem in problems), problems


@pytest.mark.parametrize("listeners", ["elsewhere", "in-process"])
def test_a_budget_wave_approves_within_its_budget_and_holds_the_rest(
    capsys: pytest.CaptureFixture[str], listeners: str
) -> None:
    """Whether the stand-ins for the VMs' listeners answer from processes of their own (the default) or from the
    coordinator's, the same approvals are answered, their proofs verified by the coordinator."""
    code, result = run(capsys, "--vms", "200", "--policy", "budget-zone", "--listeners", listeners)

    assert result["listeners"] == listeners
    assert result["problems"] == []
    assert code == 0
    # Zone 1 holds groups 0, 3, 6, 9 (80 VMs, 10 %: 8), zones 2 and 3 three groups (60: 6); each event reaches 5 VMs.
    assert result["event_states"] == {"Approved": 3, "Scheduled": 7}
    assert result["accepted"] == 200
    # Three approvals, one in each zone: each writes its zone's budget entity, once.
    assert result["table_entity_ops_by_partition_kind"]["budget"] == 3


def test_a_profile_of_the_batches_cpu_names_the_coordinators_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _ = run(capsys, "--vms", "100", "--profile", str(tmp_path / "cpu.out"), "--profile-clock", "cpu")

    assert code == 0
    profiled = pstats.Stats(str(tmp_path / "cpu.out")).stats  # type: ignore[attr-defined]
    assert any(name == "run_batch" for _, _, name in profiled)
