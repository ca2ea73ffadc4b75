"""The handover: an approval a run could not deliver within its own seconds goes on outside the run.

A batch, tick or person's approval gives each approval ``in_run_delivery`` (3 s, pipeline/act.py); one not answered
by then is handed over: its record says so (outcome "continued", the VM that did not answer), the timer leaves it to
the delivery queue for ``HANDOVER_GRACE``, and a ``QueuedDelivery`` goes to the queue (adapters/delivery_queue.py).
The queue's function (function_app.continue_approval) starts a ``delivery`` run (pipeline/delivery.py), which decides
it again; its tail sends the approval again (plan.plan_delivery: through a peer of the VM that did not answer when it
has one) with the whole approval deadline. One decisionId throughout: the listener executes it once.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from coordinator.adapters.delivery_queue import DeliveryQueueError, QueuedDelivery
from coordinator.domain.approvals import REROUTE_MARGIN
from coordinator.domain.lifecycle import EventChange, approval_step
from coordinator.domain.model import EventRecord
from coordinator.pipeline.run import Run

__all__ = ["HANDOVER_GRACE", "LAPSE_WAIT_MAX", "handed_over", "lapse_wait", "put"]

log = logging.getLogger("coordinator")

# A handed-over approval is the delivery queue's this long before the timer sends it again: the queue's function
# picks a message up within its 1 s polling (host.json) and gives it the 30 s approval deadline; 90 s, as a deciding
# run's own in-flight grace (pipeline/decide.py), leaves room for a retried invocation.
HANDOVER_GRACE = timedelta(seconds=90)
# A delivery run whose approval waits for the unanswered request to lapse (domain/approvals.py, reroute_at) waits for
# it before it starts, when that is this close, rather than putting its message back: a message's invisibility is in
# whole seconds and the trigger polls every second, which cost up to 2 s more (enough to miss a short Freeze).
LAPSE_WAIT_MAX = timedelta(seconds=10)


def handed_over(run: Run, change: EventChange, *, executor: str, failure: str, waiting: bool = False) -> EventChange:
    """The approval goes on in the delivery queue: its record says so (outcome "continued", ``executor``, the VM
    that did not answer) and the timer leaves it to the queue for ``HANDOVER_GRACE``. Not counted as a failed
    attempt: no answer within a run's few seconds is not yet a failure. ``waiting``: not sent at all, since the
    VM that did not answer may still execute its request (approvals.reroute_at); the message waits until then."""
    now, record = run.now, change.record
    approval = record.approval
    assert approval is not None
    approval.lastAttemptAt = now
    approval.executor = executor
    approval.outcome = "continued"
    approval.reason = (
        f"{failure[:600]}; continued through the delivery queue, same decisionId"
        if waiting
        else f"no answer within {run.options.in_run_delivery.total_seconds():g} s ({failure[:600]}); continued "
        "outside this run through the delivery queue, same decisionId"
    )
    approval.nextAttemptAt = now + HANDOVER_GRACE
    change.rows.append(approval_step(record, now, vm=executor, outcome="continued", reason=approval.reason))
    return change


def put(run: Run, *, event_id: str, decision_id: str, executor: str, visible_at: datetime | None = None) -> None:
    """Puts an approval whose record now says "continued" in the delivery queue (visible from ``visible_at``, when
    it waits for an earlier request to lapse). One that cannot be queued is the timer's once ``HANDOVER_GRACE`` has
    passed (its record's nextAttemptAt)."""
    queue = run.parts.deliveries
    assert queue is not None  # handed over only with a queue (act.send_all, plan.plan_delivery)
    delay = max(visible_at - run.now, timedelta(0)) if visible_at is not None else timedelta(0)
    try:
        queue.put(
            QueuedDelivery(eventId=event_id, decisionId=decision_id, executor=executor, handedOverAt=run.now),
            delay=delay,
        )
    except DeliveryQueueError:
        log.exception("approval of %s: not queued; the timer sends it again after its grace", event_id)
        return
    run.report.deliveries_continued += 1


def lapse_wait(record: EventRecord | None, delivery: QueuedDelivery, now: datetime) -> timedelta:
    """How long a delivery run waits before it starts: until the request the handed-over approval left unanswered
    has lapsed (its notAfter + REROUTE_MARGIN), when that is within ``LAPSE_WAIT_MAX``; else no time (the run puts
    its message back, or sends through the same VM, which needs no wait)."""
    open_request = record.openRequest if record is not None else None
    if open_request is None or open_request.decisionId != delivery.decisionId:
        return timedelta(0)
    wait = open_request.until + REROUTE_MARGIN - now
    return wait if timedelta(0) < wait <= LAPSE_WAIT_MAX else timedelta(0)
