"""The people's routes: a person's approval of one event, and the open events as the HTTP endpoints show them.

Takes an EventId and who is asking (coordinator/http.py has checked the sign-in, role, origin and form token);
gives a ``ManualApproval`` (status and message) after committing the person's decision with ``commit_event`` and
ending the run with the tail every run ends with (pipeline/tail.py), or the events summarized for
``GET /api/events``. In dry-run the decision is recorded and nothing is sent. An event approved or being approved is
never decided again (``already_approved``).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from coordinator.domain.expiry import person_bound
from coordinator.domain.history_rows import decision_row
from coordinator.domain.lifecycle import EventChange, clone
from coordinator.domain.model import ApprovalRecord, DecisionRecord, EventRecord
from coordinator.pipeline import attempt, tail
from coordinator.pipeline.decide import IN_FLIGHT_GRACE
from coordinator.pipeline.positions import last_heard
from coordinator.pipeline.run import Run
from coordinator.state.events import assemble, commit_event, read_event
from coordinator.state.store import StateStore

ApproveUrl = Callable[[str], str] | None


@dataclass
class ManualApproval:
    status: Literal["approved", "sent", "dry-run", "not-found", "conflict", "already-approved"]
    message: str
    event: dict[str, Any] | None = None


def already_approved(record: EventRecord, *, approve_url: ApproveUrl) -> ManualApproval | None:
    """The answer to a person approving an event that is approved or being approved (a second click, a second
    tab, a second approver, a rule's approval on its way): one decision per event, so nothing more is sent. A new
    decision would be a second approval with its own decisionId, which the VM's listener does not recognise as the
    first, so IMDS would get StartRequests twice."""
    approval = record.approval
    if approval is None:
        return None
    if approval.delivered:
        how = f"StartRequests accepted through {approval.executor}" if approval.executor else "delivered"
    elif approval.attempts:
        how = (
            f"being delivered: attempt {approval.attempts} answered {approval.outcome or 'nothing'}"
            f"{': ' + approval.reason if approval.reason else ''}; retried until NotBefore"
        )
    else:
        how = "being delivered"
    return ManualApproval(
        "already-approved",
        f"event {record.eventId} is already approved by {approval.actor} at {approval.decidedAt.isoformat()} "
        f"({how}; now {record.state}); nothing more is sent",
        summarize(record, approve_url=approve_url),
    )


def approve_manually(run: Run, event_id: str, *, person: str) -> ManualApproval:
    run.enter("person")
    now, store, dry_run = run.now, run.parts.store, run.dry_run
    stored = read_event(store, event_id)
    if stored is None:
        return ManualApproval("not-found", f"no event {event_id!r} is known")
    if answer := already_approved(stored.record, approve_url=run.options.approve_url):
        return answer
    if stored.record.state != "Scheduled":
        return ManualApproval("conflict", f"event {event_id} is {stored.record.state}; only Scheduled can be approved")

    def decide(record: EventRecord | None) -> EventChange | None:
        # Checked again inside the conditional write: of two clicks racing past the check above, one decides.
        if record is None or record.state != "Scheduled" or record.approval is not None:
            return None
        record = clone(record)
        change = EventChange(record=record, changed=True)
        decision_id = uuid.uuid4().hex
        actor = f"person:{person}"
        record.decision = DecisionRecord(
            decisionId=decision_id,
            rule="manual",
            action="manual-approval",
            verdict="approve",
            reason=f"approved by {person} through the coordinator's HTTP endpoint",
            decidedAt=now,
            dryRun=dry_run,
            actor=actor,
        )
        change.rows.append(decision_row(record=record, now=now))
        if dry_run:  # recorded as the person's decision; nothing is ever sent in dry-run
            return change
        bound = person_bound(record)
        record.approval = ApprovalRecord(
            decisionId=decision_id,
            rule="manual",
            actor=actor,
            decidedAt=now,
            nextAttemptAt=now + IN_FLIGHT_GRACE,
            notAfter=bound.at if bound else None,
            notAfterReason=bound.why if bound else "",
        )
        change.approval_decided = True
        return change

    # Its executor judged by when the service last heard each VM (heartbeats count), as the timer judges it.
    run.heard = last_heard(store, stored.record)
    change = commit_event(
        store, event_id, lambda r: attempt.intend(run, decide(r)), etags=run.work.etags, outbox=run.outbox()
    )
    if change is None:
        current = read_event(store, event_id)
        if current is not None and (answer := already_approved(current.record, approve_url=run.options.approve_url)):
            return answer
        state = current.record.state if current else "gone"
        return ManualApproval("conflict", f"event {event_id} changed meanwhile (now {state}); nothing sent")
    run.report.events_changed += 1
    # Its rows, its record (what the delivery is planned from, with its ETag: no re-read) and, unless in dry-run
    # (only the person's decision is logged), its delivery.
    run.work.collect(change)
    tail.finish(run)
    current = read_event(store, event_id)
    summary = summarize(current.record, approve_url=run.options.approve_url) if current else None
    approved = current is not None and current.record.approval is not None and current.record.approval.delivered
    status: Literal["dry-run", "approved", "sent"]
    if dry_run:
        status, message = "dry-run", f"dry run: {person}'s approval of {event_id} recorded, nothing sent"
    elif approved:
        status, message = "approved", f"event {event_id} approved by {person}"
    else:
        status, message = "sent", f"approval of {event_id} decided; delivery is retried until NotBefore"
    return ManualApproval(status, message, summary)


def summarize(record: EventRecord, *, approve_url: ApproveUrl) -> dict[str, Any]:
    return {
        "eventId": record.eventId,
        "eventType": record.eventType,
        "eventSource": record.eventSource,
        "description": record.description,
        "state": record.state,
        "stateSince": record.stateSince.isoformat(),
        "notBefore": record.notBefore.isoformat() if record.notBefore else None,
        "durationInSeconds": record.durationInSeconds,
        "resources": record.resources,
        "reportingVms": sorted(record.vms),
        "goneFrom": sorted(n for n, s in record.vms.items() if s.status == "Gone"),
        "decision": record.decision.model_dump(mode="json") if record.decision else None,
        "approval": record.approval.model_dump(mode="json") if record.approval else None,
        "heldBy": held_by(record),
        "failedHooks": {name: dict(s.failedHooks) for name, s in sorted(record.vms.items()) if s.failedHooks},
        "removed": list(record.removed),
        "approveUrl": approve_url(record.eventId) if approve_url else None,
    }


def pending(store: StateStore, *, approve_url: ApproveUrl) -> list[dict[str, Any]]:
    """Open events (not Completed/Canceled), oldest NotBefore first."""
    groups = {g.record.group: g for g in store.all_vm_groups()}
    assembled = assemble({s.record.eventId: s for s in store.open_events()}, groups)
    records = [s.record for s in assembled.values()]
    far = datetime.max.replace(tzinfo=UTC)
    records.sort(key=lambda r: (r.notBefore or far, r.eventId))
    return [summarize(r, approve_url=approve_url) for r in records]


def held_by(record: EventRecord) -> dict[str, Any] | None:
    """What holds the event back, in words and by EventId: the platform (an approved delete waiting for another
    pending delete of its scale set) or the coordinator (a ready delete waiting for its siblings to be ready)."""
    if record.open and record.platformHold is not None:
        hold = record.platformHold
        return {
            "by": "platform",
            "eventId": hold.eventId,
            "vm": hold.vm,
            "until": hold.until.isoformat() if hold.until else None,
            "reason": hold.describe(),
        }
    decision = record.decision
    if record.state == "Scheduled" and record.approval is None and decision is not None and decision.heldBy:
        return {
            "by": "coordinator",
            "eventId": decision.heldBy,
            "vm": decision.heldByVm,
            "until": decision.heldUntil.isoformat() if decision.heldUntil else None,
            "reason": decision.reason,
        }
    return None
