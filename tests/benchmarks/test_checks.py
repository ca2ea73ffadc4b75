"""benchmarks.checks: what the benchmarks read from their own runs to say whether a run is what it claims."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import checks
from coordinator.adapters.history import SqliteHistory
from coordinator.domain.rows import HistoryRow
from local.runner import RunnerStats


def test_imds_approvals_are_held_to_the_events_and_vms_expected() -> None:
    approvals = [
        {"EventId": "A", "vm": "vm_0", "via": "imds"},
        {"EventId": "B", "vm": "vm_9", "via": "imds"},
        {"EventId": "C", "vm": "vm_2", "via": "arm"},
        {"EventId": "C", "vm": "vm_2", "via": "imds"},
        {"EventId": "X", "vm": "vm_3", "via": "imds"},
    ]
    expected = {"A": ["vm_0"], "B": ["vm_1"], "C": ["vm_2"], "D": ["vm_3"]}

    problems = checks.approvals_problems(approvals, expected)

    assert problems == [
        "1 of 4 events not approved in IMDS: D",
        "1 events approved more than once in IMDS: C",
        "2 approvals not by the event's own VM through IMDS: B by vm_9 via imds, C by vm_2 via arm",
        "1 approvals of events the benchmark did not create: X",
    ]
    assert checks.approvals_problems(approvals[:1], {"A": ["vm_0"]}) == []


def test_decisions_and_dead_letters_come_from_the_history(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite"
    history = SqliteHistory(path)
    now = datetime.now(UTC)
    history.write(
        [
            HistoryRow(TimeGenerated=now, RecordType="Decision", EventId="A", Rule="go", Outcome="approve"),
            HistoryRow(TimeGenerated=now, RecordType="Decision", EventId="B", Rule="hold", Outcome="never"),
            HistoryRow(TimeGenerated=now, RecordType="DeadLetter", Reason="no attested document"),
        ]
    )
    history.close()

    assert checks.decisions_problems(path, ["A"], rule="go") == []
    assert checks.decisions_problems(path, ["A", "B", "C"], rule="go") == [
        "1 of 3 events have no Decision row: C",
        "1 decisions not 'approve' by rule 'go': B: never by rule 'hold'",
    ]
    assert checks.dead_letter_problems(path) == [
        "1 envelopes dead-lettered by the coordinator: 1x no attested document"
    ]


def test_a_failed_stack_run_says_what_held_its_partitions_up(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite"
    history = SqliteHistory(path)
    now = datetime.now(UTC)
    history.write([HistoryRow(TimeGenerated=now, RecordType="Decision", EventId="A", Rule="go", Outcome="approve")])
    history.close()
    stats = RunnerStats(stalls=[f"t{i} partition 1: 4 events reached the trigger 14.{i} s late" for i in range(12)])
    stack = SimpleNamespace(history_path=path, host=SimpleNamespace(stats=stats))

    assert checks.stack_problems(stack, ["A"], rule="go") == []  # type: ignore[arg-type]  # noted, but valid
    problems = checks.stack_problems(stack, ["A", "B"], rule="go")  # type: ignore[arg-type]
    assert problems[0] == "1 of 2 events have no Decision row: B"
    assert problems[1].startswith("the function host noted (the last 10): ['t2 partition 1: 4 events reached")
    assert "14.11 s late" in problems[1]
    assert "t1 " not in problems[1]


def test_the_coordinator_s_batch_reports_are_summed() -> None:
    log = logging.getLogger("function_app")
    with checks.batch_reports() as reports:
        log.info("batch %s", json.dumps({"received": 3, "accepted": 3, "dead_lettered": 0, "set_aside": 0}))
        log.info("batch %s", json.dumps({"received": 2, "accepted": 1, "dead_lettered": 1, "set_aside": 0}))
        log.info("tick %s (past due: %s)", json.dumps({"events_changed": 1}), False)

    assert reports.batches == 2
    assert reports.figures() == {"envelopes_received": 5, "envelopes_accepted": 4}
    assert reports.problems() == ["the coordinator's reports: 1 of 5 envelopes dead-lettered"]
    assert log.level == logging.NOTSET
    assert log.propagate


def test_a_run_that_raises_still_prints_its_problems_and_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    def crash() -> dict[str, object]:
        raise RuntimeError("the emulator did not start")

    assert checks.finish(crash) == 1
    assert json.loads(capsys.readouterr().out) == {
        "problems": ["the run did not complete: RuntimeError: the emulator did not start"]
    }
    assert checks.finish(lambda: {"figure": 1, "problems": []}) == 0
