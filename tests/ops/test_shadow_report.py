"""``python -m ops.policy shadow-report`` as a user runs it (a subprocess) on a recorded history: per event, when the
candidate (Shadow rows, or with --dry-run the dry-run Decision rows) first would have approved it, beside when the live
policy approved it or let it expire, when the platform started it and the impact measured."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from coordinator.adapters.history import SqliteHistory
from coordinator.domain.rows import HistoryRow
from tests.commands import python_m

T0 = datetime(2026, 11, 24, 10, 0, tzinfo=UTC)
REBOOT = {"EventId": "E-REBOOT", "EventType": "Reboot", "EventSource": "Platform", "DurationInSeconds": -1}
FREEZE = {"EventId": "E-FREEZE", "EventType": "Freeze", "EventSource": "Platform", "DurationInSeconds": 5}


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def row(seconds: float, kind: str, event: dict[str, Any], **fields: Any) -> HistoryRow:
    return HistoryRow(TimeGenerated=at(seconds), RecordType=kind, **event, **fields)


def history(tmp_path: Path, *, candidate: str = "Shadow") -> Path:
    """A Reboot the live policy let expire (the candidate would have approved it at once; the platform started it at
    NotBefore, down 42 s) and a Freeze both approved (the live policy 60 s after the candidate would have)."""
    path = tmp_path / "history.sqlite"
    dry = {"DryRun": True}
    rows = [
        row(0, "Observation", REBOOT, VmName="web_0", EventStatus="Scheduled", NotBefore=at(900)),
        row(0, "Decision", REBOOT, Rule="wait", Action="wait-for-person", Outcome="wait"),
        row(0, candidate, REBOOT, Rule="cand", Action="approve-now", Outcome="approve", **dry),
        row(900, "Transition", REBOOT, PreviousState="Scheduled", State="Expired"),
        row(905, "Transition", REBOOT, PreviousState="Expired", State="Started"),
        row(960, "Impact", REBOOT, VmName="web_0", ImpactMeasure="downtime", MeasuredSeconds=42.0),
        row(10, "Observation", FREEZE, VmName="web_1", EventStatus="Scheduled", NotBefore=at(910)),
        row(10, candidate, FREEZE, Rule="cand", Action="approve-now", Outcome="approve", **dry),
        row(70, "Transition", FREEZE, PreviousState="Scheduled", State="Approved", Rule="live"),
        row(71, "Transition", FREEZE, PreviousState="Approved", State="Started"),
        row(80, "Impact", FREEZE, VmName="web_1", ImpactMeasure="pause", MeasuredSeconds=4.5),
    ]
    store = SqliteHistory(path)
    store.write(rows)
    store.close()
    return path


def report(*args: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    done = python_m("ops.policy", "shadow-report", *args, "--json")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    return lines[:-1], lines[-1]["summary"]


def test_each_event_the_candidate_beside_the_live_policy_the_platform_and_the_impact(tmp_path: Path) -> None:
    events, totals = report("--history", str(history(tmp_path)))
    by_id = {event["eventId"]: event for event in events}
    reboot, freeze = by_id["E-REBOOT"], by_id["E-FREEZE"]
    assert (reboot["wouldApproveAt"], reboot["liveApprovedAt"]) == (at(0).isoformat(), None)
    assert (reboot["expiredAt"], reboot["startedAt"]) == (at(900).isoformat(), at(905).isoformat())
    assert reboot["impactSeconds"] == {"web_0": 42.0}
    assert reboot["differs"] is True
    assert (freeze["wouldApproveAt"], freeze["liveApprovedAt"], freeze["liveRule"]) == (
        at(10).isoformat(),
        at(70).isoformat(),
        "live",
    )
    assert freeze["differs"] is False
    assert totals["onlyCandidate"] == ["E-REBOOT"]
    assert totals["impactOfOnlyCandidateSeconds"] == 42.0
    assert totals["candidateEarlierSecondsMedian"] == 60.0


def test_a_dry_run_is_its_own_candidate(tmp_path: Path) -> None:
    """--dry-run reads the dry-run Decision rows (a live policy deciding without sending) as the candidate's."""
    events, _ = report("--history", str(history(tmp_path, candidate="Decision")), "--dry-run")
    assert {e["eventId"]: e["wouldApproveAt"] for e in events} == {
        "E-REBOOT": at(0).isoformat(),
        "E-FREEZE": at(10).isoformat(),
    }
    without, _ = report("--history", str(history(tmp_path / "x", candidate="Decision")))
    assert {e["eventId"]: e["wouldApproveAt"] for e in without} == {"E-REBOOT": None, "E-FREEZE": None}
