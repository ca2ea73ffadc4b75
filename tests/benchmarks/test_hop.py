"""benchmarks.hop: the coordinator's hop through the whole local stack, beside a conditional write, and the runs it
refuses to report (an approval not made, a coordinator not wired as shipped, a send outside its batch's run).

A short valid run of the benchmark is `python -m benchmarks --quick`'s (the test command runs it, and fails on
any problem it names); here, what must make a run invalid."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from benchmarks import hop

HEADLINE = ("hop_ms_p50", "hop_ms_p99", "conditional_write_ms_p50", "conditional_write_ms_p99")


def envelope(*events: tuple[str, str]) -> bytes:
    return json.dumps(
        {"kind": "incarnation", "document": {"Events": [{"EventId": e, "EventStatus": s} for e, s in events]}}
    ).encode()


def test_the_events_a_batch_brings_are_those_its_envelopes_list_scheduled() -> None:
    listed = list(hop._scheduled(envelope(("A", "Scheduled"), ("B", "Started"), ("C", "Scheduled"))))

    assert listed == [("A", 3), ("C", 3)]
    assert list(hop._scheduled(b"not json")) == []
    assert list(hop._scheduled(b'{"kind": "heartbeat"}')) == []


def recorded_hop(*, sent_to: str = "hop_0", sending_offset: float = 0.001) -> tuple[hop.HopClock, hop.Recorded]:
    """One event of hop_0 brought by one batch and sent 20 ms later, and what the run recorded of it."""
    clock, now = hop.HopClock(), datetime.now(UTC)
    batch = hop.Batch(10.0, 10.05, now, now + timedelta(seconds=0.05), 1, 1, {"E": 1}, 3.0, 3.04)
    clock.batches["E"] = batch
    clock.sends["E"] = hop.Send(10.02, sent_to, "RelayApprovalSender", {1: 3.012})
    recorded = hop.Recorded(
        created={"E": "hop_0"},
        writes=[5.0],
        approvals=[{"EventId": "E", "vm": "hop_0", "via": "imds", "at": now.isoformat()}],
        sending_at={"E": now + timedelta(seconds=sending_offset)},
    )
    return clock, recorded


def test_a_hop_is_from_its_batch_s_arrival_to_its_send() -> None:
    clock, recorded = recorded_hop()

    result = hop.figures(clock, recorded, n=1, vms=1)

    assert result["problems"] == []
    assert result["hop_ms_p50"] == pytest.approx(20.0)
    assert result["hop_over_conditional_write"] == pytest.approx(4.0)
    assert result["hop_cpu_ms_p50"] == pytest.approx(12.0)


def test_an_approval_sent_by_another_run_or_to_another_vm_is_a_problem() -> None:
    clock, recorded = recorded_hop(sending_offset=5.0)  # decided by a run after the batch had returned

    problems = hop.figures(clock, recorded, n=1, vms=1)["problems"]

    assert any("not sent by the run of the batch that brought their event" in p for p in problems), problems
    assert any("0 hops measured, 1 asked" in p for p in problems), problems

    clock, recorded = recorded_hop(sent_to="hop_1")
    problems = hop.figures(clock, recorded, n=1, vms=1)["problems"]
    assert any("sent to another VM" in p for p in problems), problems


@pytest.mark.slow
def test_a_coordinator_that_approves_nothing_and_skips_attestation_fails_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hop, "APPROVALS_WAIT", 3.0)  # none will come
    never = tmp_path / "never.yaml"
    never.write_text("version: 1\nrules:\n  - {name: hold, match: {}, action: never-approve}\n", encoding="utf-8")

    result = hop.run(
        n=2,
        vms=2,
        spacing=(0.3, 0.5),
        coordinator_env={"COORDINATOR_POLICY_PATH": str(never), "COORDINATOR_REQUIRE_ATTESTATION": "false"},
    )

    problems = result["problems"]
    assert any("2 of 2 events not approved in IMDS" in p for p in problems), problems
    assert any("decisions not 'approve' by rule 'approve-everything'" in p for p in problems), problems
    assert any("does not require and verify attested envelopes" in p for p in problems), problems
    assert any("0 hops measured, 2 asked" in p for p in problems), problems
