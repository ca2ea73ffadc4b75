"""The delivery run: an approval a batch, tick or person's run handed to the delivery queue (pipeline/handover.py),
continued by the queue's function (function_app.continue_approval, ``CoordinatorService.continue_delivery``).

Its own step is ``take_over``; the tail (pipeline/tail.py) then sends the approval with the whole approval deadline,
through a peer of the VM that did not answer when it has one (plan.plan_delivery).
"""

from __future__ import annotations

import logging

from coordinator.adapters.delivery_queue import QueuedDelivery
from coordinator.domain.lifecycle import EventChange, clone
from coordinator.domain.model import EventRecord
from coordinator.pipeline import attempt, decide
from coordinator.pipeline.positions import last_heard
from coordinator.pipeline.run import Run
from coordinator.state.events import commit_event, read_event
from coordinator.state.store import ConcurrencyConflict

__all__ = ["take_over"]

log = logging.getLogger("coordinator")


def take_over(run: Run, delivery: QueuedDelivery) -> None:
    """A ``delivery`` run's own step: the handed-over approval becomes the run's to deliver (the tail sends it) while
    its record still says it was handed over and not delivered since. A message that comes late, twice, or after
    the timer took the approval over finds another outcome there and sends nothing; so does one whose event is no
    longer Scheduled (seen Started meanwhile: nothing is left to approve, as for the timer's retries).

    A rule's approval is decided again first, with this run's time, gates and policy (decide.decide), as every
    other resend is: it goes out only if its rule still approves it (same decisionId, its bound renewed), and is
    withdrawn otherwise. The send it continues was decided seconds ago, and a gate that stopped passing meanwhile
    let a resend through a VM back from the dead execute it."""
    run.enter("continue")

    def continued(record: EventRecord | None) -> EventChange | None:
        approval = record.approval if record is not None else None
        if (
            record is None
            or approval is None
            or approval.decisionId != delivery.decisionId
            or approval.delivered
            or approval.outcome != "continued"
            or record.state != "Scheduled"
        ):
            return None
        change = EventChange(record=clone(record))
        decide.decide(run, change, again=True)
        change.changed = True  # committed even when it decides the same: the ETag says no other run took it meanwhile
        # Planned before this write, so that its intent row is committed with it (attempt.intend).
        return attempt.intend(run, change, standing=True)

    stored = read_event(run.parts.store, delivery.eventId)
    if stored is not None:
        # Its executor judged by when the service last heard each VM (heartbeats count), as the timer judges it.
        run.heard = last_heard(run.parts.store, stored.record)
    try:
        change = commit_event(
            run.parts.store,
            delivery.eventId,
            continued,
            read=stored,
            etags=run.work.etags,
            outbox=run.outbox(),
        )
    except ConcurrencyConflict:
        log.warning("delivery of %s (%s): contended; the timer sends it after its grace", *_ids(delivery))
        return
    if change is None:
        log.info("delivery of %s (%s): nothing to continue", *_ids(delivery))
        return
    run.work.collect(change)
    approval = change.record.approval
    if approval is not None and approval.decisionId == delivery.decisionId and delivery.eventId in run.work.planned:
        run.work.deliveries.append(delivery.eventId)  # planned (attempt.intend), not settled with the write


def _ids(delivery: QueuedDelivery) -> tuple[str, str]:
    return delivery.eventId, delivery.decisionId
