"""Record (coordinator/pipeline/record.py): a run's history rows written once, last, through the outbox; a sink that
fails never stops the run and counts nothing, and what it did not take the timer writes after OUTBOX_GRACE."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta

import pytest

from coordinator.domain.history_rows import dead_letter_row
from coordinator.domain.rows import HistoryRow
from coordinator.pipeline import record
from tests.coordinator.helpers import DOC_NOW, MemoryHistory
from tests.coordinator.runs import Bench


class FailingHistory:
    """A history sink that is down (Logs Ingestion unreachable, a locked database)."""

    def __init__(self) -> None:
        self.calls = 0

    def write(self, rows: Sequence[HistoryRow]) -> None:
        self.calls += 1
        raise OSError("history sink down")


def rows(count: int) -> list[HistoryRow]:
    return [dead_letter_row(now=DOC_NOW, reason=f"reason {n}", details={}) for n in range(count)]


def test_history_writes_the_runs_rows_once_and_counts_them(bench: Bench):
    run = bench.run()
    run.work.rows = rows(3)
    record.history(run)
    assert [row.Reason for row in bench.history.rows] == ["reason 0", "reason 1", "reason 2"]
    assert run.report.history_rows == 3
    assert run.work.rows == []
    assert run.stages == ["history"]
    # Entered again (nothing left): no row written twice.
    record.history(run)
    assert len(bench.history.rows) == 3
    assert run.report.history_rows == 3


def test_a_failing_sink_never_raises_and_counts_nothing(bench: Bench, caplog: pytest.LogCaptureFixture):
    sink = FailingHistory()
    bench.history = sink  # type: ignore[assignment]
    run = bench.run()
    run.work.rows = rows(2)
    with caplog.at_level(logging.ERROR, logger="coordinator"):
        record.history(run)
    assert sink.calls == 1
    assert run.report.history_rows == 0
    assert "could not write 2 rows" in caplog.text
    # The outbox keeps what the sink did not take (the timer writes it): the run does not hold the rows in memory.
    assert run.work.rows == []
    assert len(bench.store.outbox()) == 1


def test_write_hands_nothing_to_the_sink_when_there_are_no_rows(bench: Bench):
    sink = FailingHistory()
    bench.history = sink  # type: ignore[assignment]
    run = bench.run()
    record.write(run, [])
    assert sink.calls == 0


def test_write_adds_to_the_count_of_earlier_writes(bench: Bench):
    # The approvals' intents are written before they are sent, the rest at the end: both count.
    run = bench.run()
    record.write(run, rows(2))
    record.write(run, rows(1))
    assert run.report.history_rows == 3 == len(bench.history.rows)


def test_rows_go_through_the_outbox_and_leave_it_once_written(bench: Bench):
    run = bench.run()
    run.work.rows = rows(2)
    record.stage_loose(run)  # as a batch does before it returns
    assert [r.Reason for entry in bench.store.outbox() for r in entry.rows] == ["reason 0", "reason 1"]
    record.stage_loose(run)  # nothing new: nothing staged twice
    assert len(bench.store.outbox()) == 1
    record.history(run)
    assert [row.Reason for row in bench.history.rows] == ["reason 0", "reason 1"]
    assert bench.store.outbox() == []


def test_rows_a_sink_did_not_take_stay_in_the_outbox_and_the_timer_writes_them_after_the_grace(bench: Bench):
    sink = FailingHistory()
    bench.history = sink  # type: ignore[assignment]
    run = bench.run()
    run.work.rows = rows(2)
    record.history(run)
    assert [r.Reason for entry in bench.store.outbox() for r in entry.rows] == ["reason 0", "reason 1"]

    bench.history = MemoryHistory()
    bench.now = DOC_NOW + record.OUTBOX_GRACE - timedelta(seconds=1)
    early = bench.run("tick")
    record.adopt(early)  # still the first run's: its tail may be writing them
    assert early.work.rows == []
    bench.now = DOC_NOW + record.OUTBOX_GRACE
    tick = bench.run("tick")
    record.adopt(tick)
    assert tick.report.history_adopted == 1
    record.history(tick)
    assert [row.Reason for row in bench.history.rows] == ["reason 0", "reason 1"]
    assert [row.TimeGenerated for row in bench.history.rows] == [DOC_NOW, DOC_NOW]  # when they were made
    assert bench.store.outbox() == []


def test_rows_left_to_the_timer_are_not_deleted_by_a_later_history_of_the_same_run(bench: Bench):
    bench.history = FailingHistory()  # type: ignore[assignment]
    run = bench.run()
    run.work.rows = rows(1)
    record.history(run)
    record.history(run)  # entered again, nothing left: what the timer is to write stays in the outbox
    assert len(bench.store.outbox()) == 1
