"""benchmarks.bare_hop: the coordinator's hop alone (attested envelopes, attestation required, a stand-in callback),
beside a conditional write, and the runs it refuses to report."""

from __future__ import annotations

import functools
import json

import pytest

from benchmarks import bare_hop

KEYS = (
    "hop_ms_p50",
    "hop_ms_p99",
    "conditional_write_ms_p50",
    "conditional_write_ms_p99",
    "hop_over_conditional_write",
    "hop_table_requests",
)


def test_a_short_run_measures_attested_hops_and_conditional_writes() -> None:
    result = bare_hop.run(4)

    assert result["problems"] == []
    assert (result["n"], result["samples"]) == (4, 4)
    for key in KEYS:
        assert result[key] > 0, key
    assert result["hop_over_conditional_write"] == pytest.approx(
        result["hop_ms_p50"] / result["conditional_write_ms_p50"], rel=0.02
    )


def test_an_envelope_without_a_valid_document_fails_the_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first VM's document signs another state's nonce: its envelopes are refused, its event never approved."""
    monkeypatch.setattr(bare_hop, "run", functools.partial(bare_hop.run, forged=1))

    assert bare_hop.main(["--n", "3"]) == 1

    result = json.loads(capsys.readouterr().out)
    problems = result["problems"]
    assert result["samples"] == 2
    assert any("1 of 3 timed envelopes dead-lettered" in p for p in problems), problems
    assert any("attestation refused" in p for p in problems), problems
    assert any("1 of 3 events' approvals not made" in p for p in problems), problems
    assert any("have no Decision row" in p for p in problems), problems
    assert any("2 hops measured, 3 asked" in p for p in problems), problems


def call(event_id: str, vm: str) -> bare_hop.Call:
    return bare_hop.Call(event_id, vm, 0.0, 0)


def test_approvals_made_twice_to_another_vm_or_for_no_event_made_are_problems() -> None:
    created = {"E1": "hop_0", "E2": "hop_1", "E3": "hop_2"}
    calls = [call("E1", "hop_0"), call("E1", "hop_0"), call("E2", "hop_0"), call("X", "hop_2")]

    problems = bare_hop._approval_problems(calls, created)

    assert any("1 of 3 events' approvals not made: E3" in p for p in problems), problems
    assert any("1 events' approvals made more than once: E1" in p for p in problems), problems
    assert any("E2 to hop_0" in p for p in problems), problems
    assert any("did not create: X" in p for p in problems), problems
    assert bare_hop._approval_problems([call("E1", "hop_0")], {"E1": "hop_0"}) == []
