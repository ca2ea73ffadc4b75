"""Record history: the rows of a batch, tick or person's request, kept in the outbox, then written last.

Every row is in the state's outbox before the history sink sees it (docs/liveness.md, *The outbox*): the rows of
a write are stored with that write, in its transaction (an event's rows with the event, a VM's with its group:
``commit_event``, fold, positions), and the run's other rows (``stage_loose``) on their own, before a batch returns
and before a run writes its history. The last step of every run's tail writes the run's rows to the sink and then
deletes their entries; rows the sink did not take stay in the outbox, and so do those of a process that stopped
first: the timer takes over entries older than ``OUTBOX_GRACE`` (``adopt``) and writes them with its own. Each row
has a stable ``RecordId``, so a row written twice (a sink that took it but did not say so, a timer that took over from
a tail still running) is one row to the local store and to a query that counts distinct RecordIds. A history failure
never stops the pipeline. The state entities the run's reads set aside (unreadable: store.py says how) are counted
here and get their ``DeadLetter`` row.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from coordinator.adapters import telemetry
from coordinator.adapters.history import HistoryError
from coordinator.domain.history_rows import dead_letter_row
from coordinator.domain.rows import HistoryRow
from coordinator.pipeline.run import Run

log = logging.getLogger("coordinator")

# A run's entries are its own to write this long: the timer takes over older ones (their run stopped, or its sink
# failed). A batch's tail waits at most a few seconds for its answers and 15 s for its upload.
OUTBOX_GRACE = timedelta(seconds=60)
# The most entries one tick takes over, so that a backlog (a history outage) never makes one tick long.
ADOPTED_PER_TICK = 500


def history(run: Run) -> None:
    """The last step of every run's tail: the run's history rows, written once, then their outbox entries gone."""
    run.enter("history")
    for item in run.parts.store.set_aside():
        run.report.set_aside += 1
        reason = f"state entity {item.what} cannot be read and was set aside: {item.reason}"
        run.work.rows.append(dead_letter_row(now=run.now, reason=reason[:2000], details={"entity": item.what}))
    stage_loose(run)
    if write(run, run.work.rows) and run.work.staged:
        try:
            run.parts.store.unstage(run.work.staged)
        except Exception:  # written: the timer writes them again, which adds nothing (RecordId)
            log.exception("history: %d outbox entries written but not deleted", len(run.work.staged))
    # Written and deleted, or left to the timer: either way no longer this run's.
    run.work.staged = []
    run.work.rows = []


def stage_loose(run: Run) -> None:
    """Stores in the outbox the run's rows that no write stored with it (dead letters, cards, retries' rows)."""
    loose = run.work.unstaged()
    if not loose:
        return
    outbox = run.outbox()
    pieces = outbox.pieces("", loose)
    try:
        run.parts.store.stage(pieces)
    except Exception:  # the rows are still written below; only a process that stops first loses them
        log.exception("history: %d rows could not be kept in the outbox", len(loose))
        return
    outbox.written.extend(pieces)


def adopt(run: Run) -> None:
    """The timer's: the outbox entries older than ``OUTBOX_GRACE`` (a run that stopped before writing them, or whose
    sink failed) become this run's, written and deleted by its tail."""
    try:
        entries = run.parts.store.outbox()
    except Exception:  # the next tick reads them again
        log.exception("history: the outbox could not be read")
        return
    due = [entry for entry in entries if entry.at <= run.now - OUTBOX_GRACE][:ADOPTED_PER_TICK]
    mine = {row.RecordId for row in run.work.rows}
    for entry in due:
        run.work.rows.extend(row for row in entry.rows if row.RecordId not in mine)
        mine.update(row.RecordId for row in entry.rows)
    run.work.staged.extend(due)
    run.report.history_adopted += len(due)


def write(run: Run, rows: list[HistoryRow]) -> bool:
    """Hands rows to the history sink; whether it took them all (a row it cannot serialise it sets aside)."""
    if not rows:
        return True
    telemetry.history_written(rows)
    try:
        run.parts.history.write(rows)
    except HistoryError as error:
        log.warning("history: %d rows not written, kept in the outbox for the timer: %s", len(rows), error)
        return False
    except Exception:  # history must never stop the pipeline; the outbox keeps the rows
        log.exception("history: could not write %d rows; kept in the outbox for the timer", len(rows))
        return False
    run.report.history_rows += len(rows)
    return True
