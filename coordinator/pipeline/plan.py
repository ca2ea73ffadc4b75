"""Plan, the part of delivering an approval that decides what is sent: through which VM (or ARM), with which request
and until when it holds, or why nothing can be sent now. ``act`` sends the plans and commits their outcomes.

An approval decided by a write is planned before that write (``attempt.intend``): its intent row (the Approval row
"sending") is committed with the deciding write, in the outbox beside the Decision row, and ``act.send_decided`` sends
that very plan right after the write. A process that stops between the write and the send leaves the approval record
and both rows; one that stops after the send leaves nothing unrecorded that the VM may have executed.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from contracts.approval import ApprovalFacts, ApprovalRequest
from contracts.envelope import VmIdentity
from coordinator.domain.approvals import choose_executor, reroutable_within, reroute_at
from coordinator.domain.evaluation import callback_of, hooks_required
from coordinator.domain.expiry import Bound, person_bound, request_bound, sendable
from coordinator.domain.lifecycle import approval_step
from coordinator.domain.model import ApprovalRecord, EventRecord, OpenRequest, VmSighting
from coordinator.domain.rows import HistoryRow
from coordinator.pipeline.run import Delivery, Run
from coordinator.state.events import read_event
from coordinator.state.store import Stored

__all__ = ["UNANSWERED", "UNPEERED_ALLOWANCE", "answer_wait", "hands_over", "plan_delivery"]

# The answers that say the executor's listener was not reached or did not answer (unknown: it went away before
# answering): the next attempt prefers a peer.
UNANSWERED = frozenset({"failed", "continued", "unknown"})
# How much longer than the run waits a handed-over request stays valid when no peer could take it over yet, nor is
# coming (a VM the event names that has not reported it: _coming): a listener the Relay holds 3 s still executes it; a
# peer that reports the event later waits this much more.
UNPEERED_ALLOWANCE = timedelta(seconds=2)


def plan_delivery(
    run: Run,
    event_id: str,
    last_seen: dict[str, datetime] | None,
    *,
    unstorable: frozenset[str] = frozenset(),
    deciding: EventRecord | None = None,
) -> Delivery | None:
    """What to send for one approval: the executor and the request (None when no VM can execute it; the failure
    says why), from the record as the deciding write is about to commit it (``deciding``), else as this run
    committed it (read fresh only when the run holds none). Every approval is sent from a plan, so dry-run is held
    here: an approval decided before dry-run was switched on waits."""
    if run.dry_run:
        return None
    known = deciding or run.work.records.get(event_id)
    stored = Stored(known, run.work.etags.get(event_id)) if known is not None else read_event(run.parts.store, event_id)
    if stored is None or stored.record.approval is None or stored.record.approval.delivered:
        return None
    now, options, approval = run.now, run.options, stored.record.approval
    record = stored.record
    if unstorable & record.vms.keys():
        # VMs whose positions this batch cannot store: their sightings are not kept, so none is an executor.
        record = record.model_copy(update={"vms": {n: s for n, s in record.vms.items() if n not in unstorable}})
    # When each VM was last heard: its sighting, or later, its position (heartbeats count), as the timer judges it.
    seen = {name: s.lastSeen for name, s in record.vms.items()}
    for heard in (run.heard, last_seen or {}):
        seen.update({name: max(seen[name], heard[name]) for name in seen if name in heard})
    # The VM whose listener did not answer the last attempt: a peer that can execute it goes first.
    avoid = frozenset({approval.executor}) if approval.outcome in UNANSWERED and approval.executor else frozenset()
    alive_after, leaving = now - options.heartbeat_timeout, run.fleet.leaving(now)
    busy = run.fleet.busy(record.vms.keys(), event_id)
    executor = choose_executor(record, seen, alive_after, leaving=leaving, avoid=avoid, busy=busy)
    plan = Delivery(
        event_id=event_id,
        decision_id=approval.decisionId,
        executor=executor.name if executor else "",
        traceparent=record.traceparent,
        callback=run.parts.callback,
    )
    # Never past what the decision rested on (an approval from before notAfter existed: its NotBefore), nor past the
    # delivery's own deadline. A retry was decided again in this run before it got here (pipeline/decide.py).
    kept = Bound(approval.notAfter, approval.notAfterReason) if approval.notAfter else person_bound(record)
    tolerance = options.not_after_tolerance
    valid_for = _valid_for(run, record, seen, executor, alive_after=alive_after, leaving=leaving)
    not_after = request_bound(kept, now, valid_for, tolerance=tolerance)
    if not sendable(not_after.at, now, tolerance=tolerance):
        plan.failure = (
            f"not sent: its notAfter {not_after.at.isoformat()} ({not_after.why}) is past or within the listener's "
            f"{tolerance.total_seconds():g} s tolerance; decided again when retried"
        )
        return plan
    gone = executor is not None and executor.name in avoid and seen[executor.name] < now - options.executor_silence
    executor = _route(run, plan, record, approval.rule, executor, gone=gone)
    if executor is None or _waits(run, plan, record.openRequest):
        return plan
    plan.vm = _identity(run, plan, executor)
    plan.request = _request(run, record, approval, not_after)
    plan.intent = _intent(run, plan, record, approval, executor=executor.name, not_after=not_after)
    return plan


def _identity(run: Run, plan: Delivery, executor: VmSighting) -> VmIdentity:
    """The VM the plan is for. Through ARM's acknowledge, ARM acts on the resource its scale set names: that is
    ARM's word for it (the census), never the VM's own."""
    vm = executor.identity()
    if run.parts.remote_acknowledge is not None and plan.callback is run.parts.remote_acknowledge:
        return run.fleet.as_arm_lists(vm)
    return vm


def _route(
    run: Run, plan: Delivery, record: EventRecord, rule: str, executor: VmSighting | None, *, gone: bool
) -> VmSighting | None:
    """Which way the plan goes: the VM's listener (``executor``), or ARM's acknowledge when the rule says so or, as a
    fallback, when no listener can execute it (``gone``: the only one left did not answer and has been silent).
    None when it can go neither way; the plan's failure says why."""
    options, remote_acknowledge = run.options, run.parts.remote_acknowledge
    remote = callback_of(run.policy, rule) == "remote-acknowledge"
    if remote and remote_acknowledge is None:
        plan.failure = (
            f"rule {rule!r} approves through remote acknowledge, which is off (COORDINATOR_REMOTE_ACKNOWLEDGE); "
            "nothing sent"
        )
        return None
    if (executor is None or gone) and remote_acknowledge is not None and options.remote_acknowledge_fallback:
        # No VM's listener can execute it: no forwarder reported within heartbeat_timeout (e.g. a VM known only from
        # Event Grid), or the only one left did not answer and has been silent for executor_silence (a VM gone, not
        # a slow Relay): acknowledged through ARM instead, unverified by any VM (docs/security.md).
        remote = True
    if remote:
        target = executor or _any_sighting(record)
        if target is None:
            plan.failure = f"no VM of {record.resources[:5]} is known: no resource to acknowledge the event on"
            return None
        assert remote_acknowledge is not None  # remote only when it is on (both branches above)
        plan.executor, plan.callback = f"arm:{target.name}", remote_acknowledge
        return target
    if executor is None:
        within = f"{options.heartbeat_timeout.total_seconds():.0f} s"
        if record.eventType == "Terminate":
            plan.failure = (
                f"a Terminate is approved only through the VM it deletes, and none of {record.resources[:5]} "
                f"reported within {within} (no peer may approve it)"
            )
        else:
            plan.failure = f"no VM of {sorted(record.vms)[:10]} reported within {within}"
    return executor


def _request(run: Run, record: EventRecord, approval: ApprovalRecord, not_after: Bound) -> ApprovalRequest:
    """The StartRequests the executor is asked to make, with what the decision rested on for the VM to check against
    its own IMDS document and hook ledger."""
    return ApprovalRequest(
        eventId=record.eventId,
        decisionId=approval.decisionId,
        rule=approval.rule[:256],
        issuedAt=run.now,
        # The same instant as notAfter: a listener of an earlier release reads only expiresAt.
        expiresAt=not_after.at,
        notAfter=not_after.at,
        notAfterReason=not_after.why[:256],
        policyVersion=approval.policyVersion,
        facts=ApprovalFacts(
            eventType=record.eventType,
            eventSource=record.eventSource,
            durationInSeconds=record.durationInSeconds,
            notBefore=record.notBefore,
            resources=list(record.resources),
            hooksRequired=hooks_required(run.policy, approval.rule, record),
            nearNotBeforeSeconds=approval.nearNotBeforeSeconds,
            forceHook=approval.forceHook or None,
        ),
    )


def _intent(
    run: Run, plan: Delivery, record: EventRecord, approval: ApprovalRecord, *, executor: str, not_after: Bound
) -> HistoryRow:
    """The Approval row "sending", committed before the request leaves."""
    attempt = approval.attempts + 1
    return approval_step(
        record,
        run.now,
        vm=executor,
        outcome="sending",
        reason=(
            f"acknowledge of {record.eventId} going to ARM for {executor} (attempt {attempt})"
            if plan.callback is not run.parts.callback
            else f"StartRequests for {record.eventId} going to {executor} (attempt {attempt})"
        ),
        details={
            "notAfter": not_after.at.isoformat(),
            "notAfterReason": not_after.why,
            "policyVersion": approval.policyVersion,
        },
    )


def _waits(run: Run, plan: Delivery, open_request: OpenRequest | None) -> bool:
    """Whether the plan must wait for an unanswered request to lapse (``reroute_at``); if so, it says until when,
    and waits in the delivery queue (a message visible from then), else for the timer."""
    reroute = reroute_at(open_request, plan.executor, plan.decision_id, run.now)
    if reroute is None or open_request is None:
        return False
    plan.wait_until = reroute
    plan.continued = run.parts.deliveries is not None
    plan.failure = (
        f"not sent to {plan.executor} yet: {open_request.executor}'s unanswered request ({open_request.decisionId}) "
        f"may be executed until {open_request.until.isoformat()}; sent from {reroute.isoformat()} (one valid "
        "approval per event at a time)"
    )
    plan.executor = open_request.executor
    return True


def _valid_for(
    run: Run,
    record: EventRecord,
    seen: dict[str, datetime],
    executor: VmSighting | None,
    *,
    alive_after: datetime,
    leaving: dict[str, str],
) -> timedelta:
    """How long a request sent now is valid. One a run hands over, only about as long as the run waits for it: once
    it lapses, a peer may be sent the event without two valid approvals existing at once (``reroute_at``). As long
    exactly when a peer that could take over is known; ``UNPEERED_ALLOWANCE`` longer when none is yet (a listener
    the Relay holds a few seconds still executes it; a peer that reports the event later waits at
    most that much more). Either way short enough, when NotBefore is near, that a peer can still execute the event
    before it once the request lapsed (approvals.reroutable_within). The queue's and the timer's sends: the whole
    approval deadline."""
    options = run.options
    approval = record.approval
    if approval is not None and approval.forceHook and record.notBefore is not None:
        # A force step's request stays valid while the VM's hook runs, up to NotBefore (its approval's own bound
        # caps it): no peer is sent it meanwhile (the request stays open), the VM starts it once its hook succeeded.
        return max(record.notBefore - run.now, options.approval_deadline)
    if not hands_over(run):
        return options.approval_deadline
    avoid = frozenset({executor.name}) if executor is not None else frozenset()
    peer = choose_executor(record, seen, alive_after, leaving=leaving, avoid=avoid) if executor else None
    known = peer is not None and executor is not None and peer.name != executor.name
    valid_for = options.in_run_delivery + (
        timedelta(0) if known or _coming(record, executor, leaving) else UNPEERED_ALLOWANCE
    )
    if record.eventType == "Terminate" and len(record.resources) <= 1:
        return valid_for  # only its own VM may ever execute it (choose_executor): no peer to leave room for
    return reroutable_within(valid_for, record.notBefore, run.now, tolerance=options.not_after_tolerance)


def _coming(record: EventRecord, executor: VmSighting | None, leaving: dict[str, str]) -> bool:
    """Whether a VM the event names, not the executor, has not reported it yet and is not being removed by another
    event (``choose_executor``'s own test: the event's own delete leaves it an executor): it will report it (IMDS lists
    each VM's own events in its document, its forwarder sends the new incarnation within its poll), so a peer to take
    over is coming. Oracle seed 1042: a peer's sighting came 30-150 ms after the decision, and the request given the
    allowance meanwhile held the event 2 s more past its executor's slow listener."""
    if executor is None:
        return False
    return any(
        n != executor.name and n not in record.vms and leaving.get(n, record.eventId) == record.eventId
        for n in record.resources
    )


def answer_wait(run: Run, request: ApprovalRequest, within: float) -> float:
    """How long a send waits for its answer: ``within``, but in a run that hands over no longer than the listener may
    still execute the request (it refuses it from its notAfter less the tolerance; sooner when NotBefore is near,
    approvals.reroutable_within): handed over sooner, it is sooner the delivery run's to send through a peer."""
    if not hands_over(run) or request.notAfter is None:
        return within
    return min(within, (request.notAfter - run.options.not_after_tolerance - run.now).total_seconds())


def hands_over(run: Run) -> bool:
    """Whether the run gives an approval only ``in_run_delivery`` and hands one not answered to the delivery queue."""
    return run.parts.deliveries is not None and run.kind != "delivery"


def _any_sighting(record: EventRecord) -> VmSighting | None:
    """A VM the event names (else any that reported it): whose resource (its scale set, or itself) an acknowledge
    names."""
    for name in record.resources:
        if name in record.vms:
            return record.vms[name]
    return next(iter(record.vms.values()), None)
