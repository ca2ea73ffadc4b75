"""benchmarks.approval_latency: the bare Relay hop to a connected listener, and the runs it refuses to report."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from benchmarks import approval_latency
from contracts.approval import ApprovalRequest, ApprovalResult
from contracts.envelope import VmIdentity


@pytest.fixture
def key_file() -> Iterator[str]:
    with tempfile.NamedTemporaryFile("w", suffix=".key") as handle:
        handle.write(approval_latency.KEY)
        handle.flush()
        yield handle.name


def test_a_short_run_measures_connected_approvals_the_coordinator_would_send(key_file: str) -> None:
    result = approval_latency.run(5, key_file)

    assert result["problems"] == []
    assert result["listener"] == "connected"
    assert result["samples"] == 5
    for key in ("approval_ms_p50", "approval_ms_p99", "roundtrip_ms_p50", "roundtrip_ms_p99"):
        assert result[key] > 0


def test_the_request_is_bounded_as_the_coordinator_bounds_it() -> None:
    """notAfter: the batch's delivery time and the listener's tolerance, never past the event's NotBefore; an event
    too close to its NotBefore is not sent at all (the listener would refuse it)."""
    now = datetime.now(UTC)
    created = {
        "EventId": "E1",
        "EventType": "Freeze",
        "ResourceType": "VirtualMachine",
        "Resources": ["bench_0"],
        "EventSource": "Platform",
        "DurationInSeconds": 5,
        "NotBefore": (now + timedelta(minutes=15)).strftime("%a, %d %b %Y %H:%M:%S GMT"),
    }
    request = approval_latency.approval_request(created, decision_id="d", now=now)
    assert request is not None
    assert request.facts is not None
    assert request.facts.notBefore is not None
    assert request.notAfter is not None
    assert request.notAfter <= request.facts.notBefore
    assert request.notAfter == request.expiresAt
    assert request.notAfter - now == approval_latency.VALID_FOR + timedelta(seconds=2)

    soon = created | {"NotBefore": (now + timedelta(seconds=1)).strftime("%a, %d %b %Y %H:%M:%S GMT")}
    assert approval_latency.approval_request(soon, decision_id="d", now=now) is None


def test_a_listener_not_connected_when_approvals_are_sent_is_a_problem(key_file: str) -> None:
    result = approval_latency.run(4, key_file, listener_mode="late")

    assert any("not connected when" in problem for problem in result["problems"]), result["problems"]


class AnswersWithoutTheVm:
    """A sender that says "approved" without reaching the VM: no StartRequests is made."""

    def send(self, request: ApprovalRequest, *, vm: VmIdentity) -> ApprovalResult:
        return ApprovalResult(outcome="approved", eventId=request.eventId, decisionId=request.decisionId)


def test_approvals_that_never_land_in_imds_are_problems(key_file: str) -> None:
    result = approval_latency.run(3, key_file, sender=AnswersWithoutTheVm())

    problems = result["problems"]
    assert any("3 of 3 events not approved in IMDS" in problem for problem in problems), problems
    assert any("0 approvals measured, 3 asked" in problem for problem in problems), problems
    assert "approval_ms_p50" not in result


def test_the_process_exits_1_when_there_are_problems(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(approval_latency, "run", lambda n, key_file: {"listener": "connected", "problems": ["broken"]})

    assert approval_latency.main(["--n", "1"]) == 1
    assert '"problems": ["broken"]' in capsys.readouterr().out
