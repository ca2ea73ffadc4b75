"""Record history: the rows of a batch, tick or person's request, written last.

Takes the ``HistoryRow``s the stages built (each with its type's builder in coordinator/domain/history_rows.py) and
hands them to the history sink. A history failure is logged and never stops the pipeline. The state entities the
run's reads set aside (unreadable: store.py says how) are counted here and get their ``DeadLetter`` row.
"""

from __future__ import annotations

import logging

from coordinator.adapters import telemetry
from coordinator.domain.history_rows import dead_letter_row
from coordinator.domain.rows import HistoryRow
from coordinator.pipeline.run import Run

log = logging.getLogger("coordinator")


def history(run: Run) -> None:
    """The last step of every run's tail: the run's history rows, written once."""
    run.enter("history")
    for item in run.parts.store.set_aside():
        run.report.set_aside += 1
        reason = f"state entity {item.what} cannot be read and was set aside: {item.reason}"
        run.work.rows.append(dead_letter_row(now=run.now, reason=reason[:2000], details={"entity": item.what}))
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
