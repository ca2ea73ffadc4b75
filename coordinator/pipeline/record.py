"""Record history: the rows of a batch, tick or person's request, written last.

Takes the ``HistoryRow``s the stages built (each with its type's builder in coordinator/domain/history_rows.py) and
hands them to the history sink. A history failure is logged and never stops the pipeline.
"""

from __future__ import annotations

import logging

from coordinator.adapters import telemetry
from coordinator.domain.rows import HistoryRow
from coordinator.pipeline.run import Run

log = logging.getLogger("coordinator")


def history(run: Run) -> None:
    """The last step of every run's tail: the run's history rows, written once."""
    run.enter("history")
    write(run, run.work.rows)
    run.work.rows = []


def write(run: Run, rows: list[HistoryRow]) -> None:
    """Hands rows to the history sink (also the approvals' intents, written before they are sent)."""
    if not rows:
        return
    telemetry.history_written(rows)
    try:
        run.parts.history.write(rows)
        run.report.history_rows += len(rows)
    except Exception:  # history must never stop the pipeline; the sink keeps what it could not send
        log.exception("history: could not write %d rows", len(rows))
