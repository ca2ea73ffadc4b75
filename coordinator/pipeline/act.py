"""Act, the fourth stage: approvals out to the VMs, then the cards (pipeline/outbox.py), for what was committed.

Takes the ``Work`` of a batch, tick or person (events whose approval was decided by a committed write, cards
recorded in the events' outbox); gives approvals sent through the ``ApprovalCallback`` (Azure Relay in Azure) and
each outcome committed to its event (Approved, or a retry time, or an alert). Only what was committed is acted on,
and only the write that decided an approval sends it.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from contracts.approval import ApprovalFacts, ApprovalRequest, ApprovalResult
from contracts.envelope import VmIdentity
from coordinator.adapters import telemetry
from coordinator.adapters.callback import ApprovalCallback, ApprovalDeliveryError
from coordinator.domain.approvals import choose_executor
from coordinator.domain.deletes import platform_hold
from coordinator.domain.evaluation import callback_of, hooks_required
from coordinator.domain.history_rows import approval_row
from coordinator.domain.lifecycle import EventChange, clone, raise_alert, transition
from coordinator.domain.model import EventRecord, VmSighting
from coordinator.domain.retry import backoff_delay
from coordinator.domain.rows import HistoryRow
from coordinator.pipeline import outbox
from coordinator.pipeline.context import BatchReport, Context, TickReport, Work
from coordinator.pipeline.decide import Fleet, release_budgets
from coordinator.pipeline.record import write_history
from coordinator.state.events import commit_event, read_event
from coordinator.state.tables import ConcurrencyConflict

log = logging.getLogger("coordinator")

APPROVAL_FAILED_AFTER = 3


@dataclass
class Delivery:
    """One approval on its way: what is sent, to whom, and what came back."""

    event_id: str
    decision_id: str
    executor: str
    # The path it takes: the Relay sender (ctx.callback) or the Maintenance RP's acknowledge (ctx.remote_acknowledge).
    callback: ApprovalCallback
    vm: VmIdentity | None = None
    request: ApprovalRequest | None = None
    intent: HistoryRow | None = None
    result: ApprovalResult | None = None
    failure: str = ""
    # The event's trace (EventRecord.traceparent): the approval's span and the listener's continue it.
    traceparent: str = ""


def act(
    ctx: Context,
    work: Work,
    now: datetime,
    report: BatchReport | TickReport,
    *,
    last_seen: dict[str, datetime] | None,
    settled: dict[str, list[str]] | None = None,
    settled_vms: outbox.VmCards | None = None,
    fleet: Fleet | None = None,
) -> None:
    """Sends the committed approvals and cards. The batch path logs the cards it sent in one write; the timer
    (``settled``: what those logs say was sent) clears them from the events' outbox itself.

    Approvals: the intent (the approval record, written by the deciding write, and an Approval history row)
    is recorded before anything is sent, so a coordinator that dies right after sending still leaves its
    history; they go out concurrently (a bounded pool, each with its own deadline), so a slow or absent
    listener holds up nothing else; each outcome is then written to its event. The caller writes the history rows
    left in ``work``."""
    records: dict[str, EventRecord] = dict(work.records)
    fleet = fleet or Fleet(ctx.store)
    plans = [plan for event_id in work.deliveries if (plan := plan_delivery(ctx, event_id, now, last_seen, fleet))]
    if any(plan.intent is not None for plan in plans):
        work.rows.extend(plan.intent for plan in plans if plan.intent is not None)
        write_history(ctx, work.rows, report)
        work.rows = []
    send_all(ctx, plans)
    for plan in plans:
        try:
            change = commit_event(
                ctx.store,
                plan.event_id,
                lambda r, plan=plan: approval_outcome(ctx, r, plan=plan, now=now, fleet=fleet),  # type: ignore[misc]
            )
        except ConcurrencyConflict:
            log.warning("approval of %s: outcome not recorded (contended); the timer reconciles", plan.event_id)
            continue
        if change is not None:
            report.approvals_sent += 1
            if any(row.RecordType == "Transition" and row.State == "Approved" for row in change.rows):
                # The listener's 'approved' moved the event to Approved just now (not a repeated delivery).
                record = change.record
                rule = record.approval.rule if record.approval is not None else ""
                telemetry.approved(
                    record.eventType, rule, detected=record.createdAt, not_before=record.notBefore, now=now
                )
            records[plan.event_id] = change.record
            fleet.note(change.record)
            work.collect(change)
    release_budgets(ctx, records.values())
    outbox.post(ctx, work, records, now, report, settled=settled, settled_vms=settled_vms)


def plan_delivery(
    ctx: Context, event_id: str, now: datetime, last_seen: dict[str, datetime] | None, fleet: Fleet
) -> Delivery | None:
    """What to send for one committed approval, read fresh: the executor and the request (None when no VM
    can execute it; the failure says why). Every approval is sent from a plan, so dry-run is held here: an
    approval decided before dry-run was switched on waits."""
    if ctx.dry_run:
        return None
    stored = read_event(ctx.store, event_id)
    if stored is None or stored.record.approval is None or stored.record.approval.delivered:
        return None
    record = stored.record
    approval = stored.record.approval
    seen = {name: s.lastSeen for name, s in record.vms.items()}
    if last_seen:
        seen.update({name: last_seen[name] for name in seen if name in last_seen})
    executor = choose_executor(record, seen, now - ctx.heartbeat_timeout, leaving=fleet.leaving(now))
    plan = Delivery(
        event_id=event_id,
        decision_id=approval.decisionId,
        executor=executor.name if executor else "",
        traceparent=record.traceparent,
        callback=ctx.callback,
    )
    remote = callback_of(ctx.policy, approval.rule) == "remote-acknowledge"
    if remote and ctx.remote_acknowledge is None:
        plan.failure = (
            f"rule {approval.rule!r} approves through remote acknowledge, which is off "
            "(COORDINATOR_REMOTE_ACKNOWLEDGE); nothing sent"
        )
        return plan
    if executor is None and ctx.remote_acknowledge is not None and ctx.remote_acknowledge_fallback:
        # No VM's listener can execute it (no forwarder reported within heartbeat_timeout, e.g. a VM known only
        # from Event Grid): acknowledged through ARM instead, unverified by any VM (docs/security.md).
        remote = True
    if remote:
        target = executor or _any_sighting(record)
        if target is None:
            plan.failure = f"no VM of {record.resources[:5]} is known: no resource to acknowledge the event on"
            return plan
        executor = target
        plan.executor = f"arm:{target.name}"
        assert ctx.remote_acknowledge is not None  # remote only when it is on (both branches above)
        plan.callback = ctx.remote_acknowledge
    if executor is None:
        within = f"{ctx.heartbeat_timeout.total_seconds():.0f} s"
        if record.eventType == "Terminate":
            plan.failure = (
                f"a Terminate is approved only through the VM it deletes, and none of {record.resources[:5]} "
                f"reported within {within} (no peer may approve it)"
            )
        else:
            plan.failure = f"no VM of {sorted(record.vms)[:10]} reported within {within}"
        return plan
    plan.vm = executor.identity()
    plan.request = ApprovalRequest(
        eventId=record.eventId,
        decisionId=approval.decisionId,
        rule=approval.rule[:256],
        issuedAt=now,
        expiresAt=record.notBefore or now + timedelta(minutes=15),
        # What the decision rested on, for the VM to check against its own IMDS document and hook ledger.
        facts=ApprovalFacts(
            eventType=record.eventType,
            eventSource=record.eventSource,
            durationInSeconds=record.durationInSeconds,
            notBefore=record.notBefore,
            resources=list(record.resources),
            hooksRequired=hooks_required(ctx.policy, approval.rule, record),
        ),
    )
    plan.intent = approval_row(
        record=record,
        now=now,
        vm=executor.name,
        rule=approval.rule,
        decision_id=approval.decisionId,
        actor=approval.actor,
        outcome="sending",
        reason=(
            f"acknowledge of {record.eventId} going to ARM for {executor.name} (attempt {approval.attempts + 1})"
            if plan.callback is not ctx.callback
            else f"StartRequests for {record.eventId} going to {executor.name} (attempt {approval.attempts + 1})"
        ),
    )
    return plan


def send_all(ctx: Context, plans: Sequence[Delivery]) -> None:
    """Sends the approvals concurrently, each given ``approval_deadline``. One that has not answered by then is
    recorded as failed and retried later; its thread finishes on its own (the sender has its own timeouts)."""
    futures: dict[concurrent.futures.Future[ApprovalResult], Delivery] = {}
    for plan in plans:
        if plan.request is not None and plan.vm is not None:
            futures[ctx.pool().submit(deliver, plan.callback, plan.request, plan.vm, plan.traceparent)] = plan
    if not futures:
        return
    done, late = concurrent.futures.wait(futures, timeout=ctx.approval_deadline.total_seconds())
    for future in done:
        plan = futures[future]
        try:
            plan.result = future.result()
        except ApprovalDeliveryError as error:
            plan.failure = str(error)
        except Exception as error:  # a bug or an odd answer in one delivery costs only that delivery
            log.exception("approval of %s through %s failed", plan.event_id, plan.executor)
            plan.failure = f"{type(error).__name__}: {error}"
    for future in late:
        plan = futures[future]
        plan.failure = (
            f"{plan.executor}'s listener did not answer within {ctx.approval_deadline.total_seconds():g} s; "
            "retried (idempotent by decisionId)"
        )


def deliver(callback: ApprovalCallback, request: ApprovalRequest, vm: VmIdentity, traceparent: str) -> ApprovalResult:
    """One approval through its callback, as the ``coordinator.approval`` span of the event's trace."""
    with telemetry.approval_span(
        traceparent, event_id=request.eventId, decision_id=request.decisionId, vm=vm.name
    ) as span:
        result = callback.send(request, vm=vm)
        telemetry.approval_answered(span, result.outcome)
        return result


def _any_sighting(record: EventRecord) -> VmSighting | None:
    """A VM the event names (else any that reported it): whose resource (its scale set, or itself) an acknowledge
    names."""
    for name in record.resources:
        if name in record.vms:
            return record.vms[name]
    return next(iter(record.vms.values()), None)


def approval_outcome(
    ctx: Context, record: EventRecord | None, *, plan: Delivery, now: datetime, fleet: Fleet
) -> EventChange | None:
    decision_id, executor, result, failure = plan.decision_id, plan.executor, plan.result, plan.failure
    if record is None or record.approval is None or record.approval.decisionId != decision_id:
        return None
    record = clone(record)
    change = EventChange(record=record, changed=True)
    approval = record.approval
    assert approval is not None
    approval.attempts += 1
    approval.lastAttemptAt = now
    approval.executor = executor
    approval.outcome = result.outcome if result else "failed"
    approval.reason = (result.reason if result else failure)[:1000]
    change.rows.append(
        approval_row(
            record=record,
            now=now,
            vm=executor,
            rule=approval.rule,
            decision_id=decision_id,
            actor=approval.actor,
            outcome=approval.outcome,
            reason=approval.reason or f"StartRequests accepted by {executor}",
            incarnation=result.documentIncarnation if result else None,
        )
    )
    if result is not None and result.outcome == "approved":
        # "approved" is the listener's word that IMDS took StartRequests; the platform's is Started or gone.
        approval.delivered = True
        approval.nextAttemptAt = None
        approval.confirmBy = now + ctx.start_bound
        # Set before the transition, so that the "approved" card says what holds it.
        update_hold(ctx, change, fleet.deletes().values(), now)
        if record.state == "Scheduled":
            transition(
                change,
                "Approved",
                now,
                f"approved by {approval.actor} through {executor}; confirmed when seen Started or gone",
                rule=approval.rule,
                actor=approval.actor,
                decision_id=decision_id,
                vm=executor,
            )
        return change
    if result is not None and result.outcome == "not-scheduled":
        # The VM sees it Started already; its next document moves the state.
        approval.nextAttemptAt = None
    else:
        delay = backoff_delay(
            approval.attempts - 1, initial=ctx.approval_backoff[0], maximum=ctx.approval_backoff[1], rng=ctx.rng
        )
        approval.nextAttemptAt = now + timedelta(seconds=max(1.0, delay))
    if result is not None and result.outcome == "rejected":
        # The VM found the decision's facts untrue of its own IMDS document or hook ledger: one card per event
        # (the reason is in the history's Approval row); retries go on in case the record was merely behind.
        raise_alert(change, "approval-refused", now)
    if approval.attempts >= APPROVAL_FAILED_AFTER:
        raise_alert(change, "approval-failed", now)
    return change


def update_hold(ctx: Context, change: EventChange, deletes: Iterable[EventRecord], now: datetime) -> None:
    """Shows an approved delete that the platform holds because another delete of its scale set is pending:
    on the record (the card and summarize() read it) and as an Approval row (Actor platform, Outcome held),
    and again when the hold is lifted or moves to another pending delete."""
    record = change.record
    hold = platform_hold(record, deletes, now)
    previous = record.platformHold
    if (hold.eventId if hold else "") == (previous.eventId if previous else ""):
        return
    record.platformHold = hold
    change.changed = True
    if hold is None and previous is not None and record.approval is not None and record.approval.delivered:
        # Held, the delete could not start: its time to be seen Started begins when the platform lets it go.
        record.approval.confirmBy = now + ctx.start_bound
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
