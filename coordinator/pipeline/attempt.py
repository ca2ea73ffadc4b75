"""An approval's attempt, written to its event: planned before the write that decides it (``intend``: the intent
row goes with that write), its outcome committed after the send (``approval_outcome``), or with the deciding write
itself when nothing can be sent (no VM to send it through, a notAfter already past): every write that leaves an
approval undelivered says whether a request may be on its way, so that a run reading it in between never waits for a
send that was never made.

``act`` sends the plans and calls ``approval_outcome`` with each answer; ``plan`` makes the plans.
"""

from __future__ import annotations

from datetime import timedelta

from coordinator.domain.deletes import may_be_held, platform_hold
from coordinator.domain.history_rows import approval_row
from coordinator.domain.lifecycle import EventChange, approval_step, clone, lost_answer, raise_alert, transition
from coordinator.domain.model import EventRecord, OpenRequest
from coordinator.domain.retry import backoff_delay
from coordinator.pipeline import handover
from coordinator.pipeline.plan import plan_delivery
from coordinator.pipeline.run import Delivery, Run

__all__ = ["APPROVAL_FAILED_AFTER", "approval_outcome", "intend", "open_after", "update_hold"]

APPROVAL_FAILED_AFTER = 3


def intend(
    run: Run, change: EventChange | None, *, unstorable: frozenset[str] = frozenset(), standing: bool = False
) -> EventChange | None:
    """Plans the delivery of the approval ``change`` decides (``standing``: of the approval it holds, decided before:
    a delivery run's), before the change is written: its intent row joins the change's rows, committed with it, and
    the plan is this run's to send once the change is committed (``Work.collect``). A plan that can send nothing
    has its outcome in the change too: written with the decision, not by a tail that a batch bringing
    the missing VM may overtake; this run has nothing to send. Returns the change."""
    if change is None or change.record.approval is None or not (change.approval_decided or standing):
        return change
    record = change.record
    plan = plan_delivery(run, record.eventId, None, unstorable=unstorable, deciding=record)
    if plan is None:
        return change
    if plan.intent is not None:
        change.rows.append(plan.intent)
        plan.intent = None  # written with the deciding write, not again with the outcome
    if plan.request is None and plan.wait_until is None and plan.failure:
        _apply(run, change, plan)  # the approval is the plan's: planned from this very record
        change.approval_decided = False  # nothing for this run to send: the timer or a VM's sighting retries it
        return change
    run.work.intend(change, plan)
    return change


def approval_outcome(run: Run, record: EventRecord | None, *, plan: Delivery) -> EventChange | None:
    """One delivery's outcome committed to its event, after the intent row of a send its deciding write did not carry
    (a retry's, planned after that write). A request whose answer was lost (it reached the listener, which went
    away) is kept on the approval after the outcome's own row (lifecycle.lost_answer): with the event already seen
    Started before its NotBefore, the row that says so."""
    change = _outcome(run, record, plan=plan)
    if change is not None and plan.intent is not None:
        change.rows.insert(0, plan.intent)
    approval = change.record.approval if change is not None else None
    if change is not None and plan.answer_lost and approval is not None and approval.decisionId == plan.decision_id:
        lost_answer(change, run.now, executor=plan.executor, reason=plan.failure)
    return change


def _outcome(run: Run, record: EventRecord | None, *, plan: Delivery) -> EventChange | None:
    if record is None or record.approval is None or record.approval.decisionId != plan.decision_id:
        return _superseded(record, plan)
    change = EventChange(record=clone(record), changed=True)
    _apply(run, change, plan)
    return change


def _apply(run: Run, change: EventChange, plan: Delivery) -> None:
    """The plan's outcome on its own approval, in ``change`` (its record already a copy)."""
    executor, result, failure = plan.executor, plan.result, plan.failure
    now, record = run.now, change.record
    change.changed = True
    approval = record.approval
    assert approval is not None
    record.openRequest = open_after(record.openRequest, plan)
    if plan.wait_until is not None and not plan.continued:
        # No queue to wait in: the timer sends it once the earlier request has lapsed (not an attempt).
        approval.nextAttemptAt = max(plan.wait_until, now)
        approval.reason = plan.failure[:1000]
        return
    if plan.continued:
        handover.handed_over(
            run, change, executor=plan.executor, failure=plan.failure, waiting=plan.wait_until is not None
        )
        return
    approval.attempts += 1
    approval.lastAttemptAt = now
    approval.executor = executor
    # Not answered after a request of this decision reached the listener, which went away: unknown, not failed (IMDS
    # may have accepted it; docs/liveness.md, *A lost answer*).
    unknown = plan.answer_lost or approval.lostAnswer is not None
    approval.outcome = result.outcome if result else ("unknown" if unknown else "failed")
    approval.reason = (result.reason if result else failure)[:1000]
    change.rows.append(
        approval_step(
            record,
            now,
            vm=executor,
            outcome=approval.outcome,
            reason=approval.reason or f"StartRequests accepted by {executor}",
            incarnation=result.documentIncarnation if result else None,
        )
    )
    if result is not None and result.outcome == "approved":
        _approved(run, change, executor)
        return
    if result is not None and result.outcome == "accepted" and approval.forceHook and plan.request is not None:
        # The VM runs its force hook and starts the event itself once it succeeded, until the request's deadline:
        # nothing is sent again, to it or a peer, while it may (the request stays open); Started says it did.
        approval.nextAttemptAt = None
        record.openRequest = OpenRequest(executor=executor, decisionId=approval.decisionId, until=plan.request.deadline)
        return
    if result is not None and result.outcome == "not-scheduled":
        # The VM sees it Started already; its next document moves the state.
        approval.nextAttemptAt = None
    else:
        initial, maximum = run.options.approval_backoff
        delay = backoff_delay(approval.attempts - 1, initial=initial, maximum=maximum, rng=run.parts.rng)
        approval.nextAttemptAt = now + timedelta(seconds=max(1.0, delay))
    if result is not None and result.outcome == "rejected":
        # The VM found the decision's facts untrue of its own IMDS document or hook ledger: one card per event
        # (the reason is in the history's Approval row); retries go on in case the record was merely behind.
        raise_alert(change, "approval-refused", now)
    if approval.attempts >= APPROVAL_FAILED_AFTER:
        raise_alert(change, "approval-failed", now)


def _approved(run: Run, change: EventChange, executor: str) -> None:
    """ "approved" is the listener's word that IMDS took StartRequests; the platform's is Started or gone."""
    now, record = run.now, change.record
    approval = record.approval
    assert approval is not None
    approval.delivered = True
    approval.nextAttemptAt = None
    approval.confirmBy = now + run.options.start_bound
    # Set before the transition, so that the "approved" card says what holds it.
    update_hold(run, change)
    if record.state == "Scheduled":
        transition(
            change,
            "Approved",
            now,
            f"approved by {approval.actor} through {executor}; confirmed when seen Started or gone",
            executor=executor,
        )


def _superseded(record: EventRecord | None, plan: Delivery) -> EventChange | None:
    """An outcome for an approval withdrawn while it was on its way is not recorded, but the request it left
    unanswered is: it may still be executed until its notAfter."""
    if record is None:
        return None
    opened = open_after(record.openRequest, plan)
    if opened == record.openRequest:
        return None
    record = clone(record)
    record.openRequest = opened
    return EventChange(record=record, changed=True)


def open_after(open_request: OpenRequest | None, plan: Delivery) -> OpenRequest | None:
    """The event's unanswered request after this plan: a request sent and not answered (no answer in time, or a
    failure after it may have reached the listener) stays open until its notAfter; an answer closes it, and one
    that reached no listener (connections refused, the relay had none) leaves things as they were."""
    request = plan.request
    if request is None or plan.vm is None:
        return open_request  # nothing sent (a plan that waits, or one no VM could take)
    if plan.result is not None:
        return None
    if plan.unreached:
        return open_request  # it reached no listener: nobody can be executing it
    until = request.deadline
    if open_request is not None and (open_request.executor, open_request.decisionId) == (
        plan.executor,
        request.decisionId,
    ):
        until = max(until, open_request.until)
    return OpenRequest(executor=plan.executor, decisionId=request.decisionId, until=until)


def update_hold(run: Run, change: EventChange) -> None:
    """Shows an approved delete that the platform holds because another delete of its scale set is pending:
    on the record (the card and summarize() read it) and as an Approval row (Actor platform, Outcome held),
    and again when the hold is lifted or moves to another pending delete."""
    now = run.now
    record = change.record
    previous = record.platformHold
    if previous is None and not may_be_held(record):
        return  # nothing held it and nothing can: no need for its scale set's deletes (every approval comes here)
    hold = platform_hold(record, run.fleet.deletes_of(record.scaleSets), now)
    if (hold.eventId if hold else "") == (previous.eventId if previous else ""):
        return
    record.platformHold = hold
    change.changed = True
    if hold is None and previous is not None and record.approval is not None and record.approval.delivered:
        # Held, the delete could not start: its time to be seen Started begins when the platform lets it go.
        record.approval.confirmBy = now + run.options.start_bound
    change.rows.append(
        approval_row(
            record=record,
            now=now,
            actor="platform",
            outcome="held" if hold else "released",
            reason=(
                hold.describe() if hold else "no longer held by the platform: no other delete of its scale set pending"
            ),
            decision_id=record.approval.decisionId if record.approval else "",
            details=(
                {"heldBy": hold.eventId, "heldByVm": hold.vm, "until": hold.until.isoformat() if hold.until else None}
                if hold
                else None
            ),
        )
    )
