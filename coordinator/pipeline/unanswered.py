"""Approvals whose sender stopped, as the timer finds them: sent again while their event is Scheduled (``retry_due``,
once the in-flight grace has passed), their outcome said once it is not (``concluded_unanswered`` for a concluded
event kept in view by the store's Pending column; ``lifecycle.sender_gone`` for an open one, in the timer's
reconsider). The listener executes a decisionId once, so sending one again approves nothing twice."""

from __future__ import annotations

from coordinator.domain.lifecycle import EventChange, approval_step, clone, sender_gone
from coordinator.domain.model import EventRecord
from coordinator.pipeline.run import Run
from coordinator.state.events import commit_event
from coordinator.state.store import ConcurrencyConflict, Stored

__all__ = ["concluded_unanswered", "retry_due"]


def concluded_unanswered(run: Run, stored: Stored[EventRecord]) -> EventRecord:
    """A concluded event still awaiting its approval's outcome (kept in view by the store's Pending column): once the
    approval's grace has passed, its ``unknown`` row (lifecycle.sender_gone), written with the record."""
    record = stored.record
    if run.dry_run or not record.awaiting_outcome:
        return record

    def settle(current: EventRecord | None) -> EventChange | None:
        if current is None:
            return None
        change = EventChange(record=clone(current))
        sender_gone(change, run.now)
        return change if change.changed else None

    try:
        change = commit_event(
            run.parts.store, record.eventId, settle, read=stored, etags=run.work.etags, outbox=run.outbox()
        )
    except ConcurrencyConflict:
        return record  # another run moved it: the next tick looks again
    if change is None:
        return record
    run.work.collect(change)
    return change.record


def retry_due(run: Run, record: EventRecord) -> None:
    """Queues the delivery of an approval whose next attempt is due (a failed one, or one whose sender stopped
    between the deciding write and recording the outcome: in flight past its grace)."""
    now, work = run.now, run.work
    approval = record.approval
    if (
        approval is not None
        and not approval.delivered
        and record.state == "Scheduled"
        and approval.nextAttemptAt is not None
        and approval.nextAttemptAt <= now
        and record.eventId not in work.deliveries
    ):
        if approval.attempts == 0 and not approval.outcome:
            # The deciding run stopped before it recorded an outcome: its Decision and intent rows were committed
            # with its deciding write (the outbox); what is known of the send is that nothing answered it.
            work.rows.append(
                approval_step(
                    record,
                    now,
                    outcome="unknown",
                    reason=f"approval decided at {approval.decidedAt.isoformat()} has no recorded outcome (the "
                    "sender stopped before recording it); sent again with the same decisionId (the listener "
                    "answers a repeat without approving twice)",
                )
            )
        work.deliveries.append(record.eventId)
