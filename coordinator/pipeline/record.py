"""Record history: the rows of a batch, tick or person's request, written last.

Takes the ``HistoryRow``s the stages built (each with its type's builder in coordinator/domain/history_rows.py) and
hands them to the history sink. A history failure is logged and never stops the pipeline.
"""

from __future__ import annotations

import logging

from coordinator.adapters import telemetry
from coordinator.domain.rows import HistoryRow
from coordinator.pipeline.context import BatchReport, Context, TickReport

log = logging.getLogger("coordinator")


def write_history(ctx: Context, rows: list[HistoryRow], report: BatchReport | TickReport) -> None:
    if not rows:
        return
    telemetry.history_written(rows)
    try:
        ctx.history.write(rows)
        report.history_rows += len(rows)
    except Exception:  # history must never stop the pipeline; the sink keeps what it could not send
        log.exception("history: could not write %d rows", len(rows))
