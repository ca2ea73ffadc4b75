"""Record (coordinator/pipeline/record.py): a run's history rows written once, last; a sink that fails never stops
the run and counts nothing."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest

from coordinator.domain.history_rows import dead_letter_row
from coordinator.domain.rows import HistoryRow
from coordinator.pipeline import record
from tests.coordinator.helpers import DOC_NOW
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
    # The sink keeps what it could not send (its own business): the run does not hold the rows for another try.
    assert run.work.rows == []


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
