"""Decide, the third stage: the policy's verdict on each changed event, with the fleet view it needs.

Takes the event records ``fold`` has just merged (or the timer re-reads); gives each a ``DecisionRecord`` (a new
one, and a Decision history row, only when the rule, verdict, hold or reason changed) and, for an approval, an
``ApprovalRecord`` for the tail to deliver, with until when its conditions hold (domain/expiry.py) and the policy's
version. The rules themselves are pure (domain/evaluation.py); this module adds what they need from the run: the
fleet view and budget claims (pipeline/fleet.py), the health gates' results (read once per run), the census (ARM's:
an approval that rests on it waits while it cannot be read) and the pending deletes of a scale set, decided as one
unit. Events compete for budget in NotBefore order (the closest first). Runs inside the caller's ETag-checked write,
so a decision commits once.

No approval is sent again without being decided again: a rule's approval that was not delivered is decided anew
when its retry is due (``nextAttemptAt``), with this run's time, gates and policy. The same rule approving confirms
it (its bound renewed); any other verdict withdraws it, with a Decision row saying why, and its budget claims are
freed by the tail (``release.release_budgets``).
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from datetime import datetime, timedelta

from coordinator.adapters import telemetry
from coordinator.adapters.gates import GatesPending
from coordinator.domain.approvals import choose_executor, withdrawal
from coordinator.domain.budgets import budget_domains
from coordinator.domain.controls import GateResult
from coordinator.domain.deletes import couple, pending_delete, ready_to_go
from coordinator.domain.escalation import force_spent, not_taken, take
from coordinator.domain.evaluation import Decision, escalated, evaluate, needs_fleet, paced_hold, same_decision
from coordinator.domain.expiry import approval_bound
from coordinator.domain.fleet_view import FleetView
from coordinator.domain.history_rows import decision_row
from coordinator.domain.lifecycle import EventChange, clone, force_refused, raise_alert
from coordinator.domain.model import (
    ApprovalRecord,
    DecisionRecord,
    EventRecord,
)
from coordinator.domain.pacing import pace_domains
from coordinator.domain.policy import Policy
from coordinator.pipeline import attempt, returns, shadow
from coordinator.pipeline.fleet_cache import by_not_before
from coordinator.pipeline.run import Run
from coordinator.state.events import commit_event, read_event
from coordinator.state.store import ConcurrencyConflict

log = logging.getLogger("coordinator")

# The instance that decides sends at once; the timer takes over only if no outcome was recorded by then (the
# sender crashed between its deciding write and the send).
IN_FLIGHT_GRACE = timedelta(seconds=90)


def decide_all(run: Run, changes: Sequence[EventChange]) -> list[EventChange]:
    """Decides the changed events of a batch or tick. The pending deletes among them are decided as one unit
    with those of their scale sets: each one's own verdict is noted first, so that simultaneous deletes
    arriving together are approved together rather than one held by the other. A failure deciding one event
    costs only that event's decision (its observations are still written; the timer decides it again). Events are
    decided closest to NotBefore first (``by_not_before``): the first decided takes the budget left.

    Within ``Fleet.gates_in_background`` (a batch's fold), an event whose gates are still being read is set aside
    while the others are decided, and decided as soon as they are read; those still waiting when the others are
    decided are returned, undecided: the caller writes them so and has them decided once its approvals are sent
    (``decide_awaiting``). A slow gate (a trickling probe, up to its deadline) then holds only the events that need
    it, not the batch's other approvals nor its partition's next batch (oracle seed 824: a User Reboot, approved at
    once, queued 5 s behind batches each waiting 3 s for a Freeze's gate, and missed its due time)."""
    run.enter("decide")
    fleet = run.fleet
    changes = sorted(changes, key=lambda c: by_not_before(c.record))
    for change in changes:
        record = change.record
        if record.eventType == "Terminate" and record.state == "Scheduled" and record.approval is None:
            try:
                own = _own_verdict(run, record)
            except GatesPending:
                fleet.note(record)  # its own verdict waits for its gates: it is decided with them
                continue
            except Exception:
                log.exception("event %s: its rule could not be evaluated", record.eventId)
                continue
            _note_provisionally(run, record, own)
        else:
            fleet.note(record)
    waiting: list[tuple[EventChange, list[Future[GateResult]]]] = []
    for change in changes:
        if (reads := _decided(run, change)) is not None:
            waiting.append((change, reads))
        # An event whose gates have been read since is decided at once: NotBefore order, as far as gates allow.
        waiting = [
            (c, now_waiting)
            for c, reads in waiting
            if (now_waiting := reads if not all(f.done() for f in reads) else _decided(run, c)) is not None
        ]
    return [change for change, _ in waiting]


def decide_awaiting(run: Run) -> int:
    """The events the run wrote undecided while their gates were being read (``decide_all``), each decided now in
    its own write, their gates waited for (each read ends within its deadline). Returns how many changed."""
    awaiting, run.work.awaiting_gates = run.work.awaiting_gates, []
    if not awaiting:
        return 0
    after_gates(run)
    released = redecide_each(run, awaiting)
    # Decided one by one, the first of a scale set's deletes was held by a sibling not decided yet: decided again.
    records = [r for e in awaiting if (r := run.work.records.get(e)) is not None]
    return released + release_held(run, records, themselves=True)


def after_gates(run: Run) -> None:
    """Waits for the gates the run is reading (each within its deadline), then moves the run's time to when they
    have answered: what is decided from them is decided then, and an approval's validity, and its request's, runs
    from then (from the run's start, an approval decided after a 3 s gate was sent already expired, or not at all)."""
    run.fleet.wait_for_gates()
    run.now = run.parts.clock()


def _decided(run: Run, change: EventChange) -> list[Future[GateResult]] | None:
    """Decides one event, then notes it in the fleet view; or the reads of its gates, still under way (undecided)."""
    try:
        decide(run, change)
    except GatesPending as pending:
        return pending.reads
    except Exception:
        log.exception("event %s: deciding failed; the timer decides it again", change.record.eventId)
    run.fleet.note(change.record)
    return None


def release_held(run: Run, changed: Sequence[EventRecord], *, themselves: bool = False) -> int:
    """Deletes held back by a delete that changed here (approved, ready, started, gone, expired) are decided
    again at once, not on the next timer run: once the last pending delete of a scale set is ready, all of
    them are approved in this same batch or tick. ``themselves``: the changed deletes too when held (decided one by
    one, not together, the first was held by a sibling decided after it). Returns how many changed."""
    touched = {scale_set for r in changed if r.eventType == "Terminate" for scale_set in r.scaleSets}
    here = set() if themselves else {r.eventId for r in changed}
    return redecide_each(run, [e for e in run.fleet.held_in(touched, run.now) if e not in here])


def approve_together(run: Run, scale_sets: Iterable[str]) -> int:
    """The pending deletes of these scale sets approved together when fresh reads show every one ready (its own
    rule approves it), after this run wrote its VM positions. Two runs deciding sibling deletes side by side (a
    scale set's VMs sit on several Event Hubs partitions) each read the other's delete as it was before: its hook
    result lives in its VM's position, written at the end of its run, so each held its own delete by the other's,
    or approved some and left the rest held, and ``release_held`` re-decides only what this run saw held (the
    fleet demo's scale-in-2 expired that way). Each run reads again once its own positions are written, so the
    later of two such runs sees both hooks and approves the set. A set not all ready is left as it is (no
    decision flips back to waiting on a read that misses a sibling's hook).

    ``scale_sets``: those where this run decided a delete ready (approved or held only by another delete). Only the
    deletes this run does not know ready are read again, one at a time, closest NotBefore first, until one is
    still not ready: a wave's batch reads about one. Returns how many changed."""
    fleet, store, now = run.fleet, run.parts.store, run.now
    wanted = set(scale_sets)
    pending = sorted(
        (r for r in fleet.deletes_of(wanted) if pending_delete(r, now)) if wanted else (), key=by_not_before
    )
    if not pending:
        return 0
    for record in pending:
        if ready_to_go(record):
            continue
        stored = read_event(store, record.eventId)
        if stored is None or not pending_delete(stored.record, now):
            continue  # approved or gone meanwhile: it holds nothing
        own = _own_verdict(run, stored.record)
        if own.verdict != "approve":
            return 0
        _note_provisionally(run, stored.record, own)
    return redecide_each(run, [record.eventId for record in pending])


def _own_verdict(run: Run, record: EventRecord) -> Decision:
    """The verdict of a pending delete's own rule (its gates read), before deletes are coupled: whether it is ready."""
    view = run.fleet.view(census=run.policy.needs_census) if needs_fleet(run.policy, record, run.now) else FleetView()
    return evaluate(run.policy, record, view, run.now, gates=_gate_results(run, record, view))


def _note_provisionally(run: Run, record: EventRecord, own: Decision) -> None:
    """The fleet view sees ``record`` with its own rule's verdict (a decision with no id, never written), so that
    its sibling deletes decided after it see whether it is ready."""
    provisional = DecisionRecord(
        decisionId="", rule=own.rule, action=own.action, verdict=own.verdict, reason=own.reason, decidedAt=run.now
    )
    run.fleet.note(record.model_copy(update={"decision": provisional}))


def redecide_each(run: Run, event_ids: Iterable[str]) -> int:
    """Each event decided again in its own write (``redecide``) from a fresh read, noted in the fleet view and
    collected; one contended is left to the timer. Returns how many changed."""
    released = 0
    # Once each: redecided twice, an approval this run decided would record its Decision row again.
    for event_id in dict.fromkeys(event_ids):
        try:
            change = commit_event(
                run.parts.store, event_id, lambda r: redecide(run, r), etags=run.work.etags, outbox=run.outbox()
            )
        except ConcurrencyConflict:
            log.warning("held delete %s: contended; the timer decides it again", event_id)
            continue
        if change is not None:
            released += 1
            run.fleet.note(change.record)
            run.work.collect(change)
    return released


def redecide(run: Run, record: EventRecord | None) -> EventChange | None:
    """The event decided again, inside its write; an approval it decides planned before that write (its intent
    row committed with it: attempt.intend)."""
    if record is None:
        return None
    change = EventChange(record=clone(record))
    decide(run, change)
    return attempt.intend(run, change)


def _gate_results(run: Run, record: EventRecord, view: FleetView) -> dict[str, GateResult]:
    """The gates of the rule the event matches, read once per batch/tick (``Fleet.rule_gates``)."""
    return run.fleet.rule_gates(run.policy, run.parts.monitor, record, run.now, view)


def decided_again(approval: ApprovalRecord, now: datetime, *, dry_run: bool) -> bool:
    """Whether an approval is decided again now: a rule's approval, not delivered, whose retry is due. Before then a
    send may be in flight (the deciding run's, or a retry's), and the VM may be executing it. A person's approval is
    that person's decision, not the policy's; in dry-run nothing is sent, so nothing needs deciding again."""
    return (
        not dry_run
        and not approval.delivered
        and approval.actor.startswith("rule:")
        and approval.nextAttemptAt is not None
        and approval.nextAttemptAt <= now
    )


def executor_found(run: Run, record: EventRecord, approval: ApprovalRecord) -> bool:
    """Whether a rule's approval whose last attempt found no VM to send it through (nothing sent, so nothing in
    flight) now has one: decided again and sent by the run that brought that VM's sighting, not at its retry (a
    Terminate whose own VM reported just after a peer waited for its backoff and the timer, and missed NotBefore)."""
    if run.dry_run or approval.delivered or not approval.actor.startswith("rule:"):
        return False
    if approval.outcome != "failed" or approval.executor:
        return False
    now = run.now
    seen = {name: sighting.lastSeen for name, sighting in record.vms.items()}
    alive_after = now - run.options.heartbeat_timeout
    return choose_executor(record, seen, alive_after, leaving=run.fleet.leaving(now)) is not None


def decide(run: Run, change: EventChange, *, again: bool = False) -> None:
    """The policy's verdict on one event, into ``change``. ``again``: a rule's approval not delivered is decided
    anew now whatever its retry time (a delivery run sends it again: pipeline/handover.py)."""
    record = change.record
    if record.state != "Scheduled":
        returns.follow(run, change)  # once completed: its VMs' way back in service
        return
    shadow.consider(run, change)  # the candidate policy's verdict first, whatever the live one does next
    pending = record.approval
    if pending is not None and pending.decisionId in run.work.decided and not pending.delivered:
        _decided_by_this_run(run, change, pending)
        return
    found = pending is not None and executor_found(run, record, pending)
    forced = again and pending is not None and not pending.delivered and pending.actor.startswith("rule:")
    refused = force_refused(record)  # its VM ran the force hook, which failed: that approval executes nothing
    redecide = found or forced or bool(refused)
    if pending is not None and not redecide and not decided_again(pending, run.now, dry_run=run.dry_run):
        return
    if record.older_view(run.now):
        return  # read between the deciding batch's event write and its positions': the next run decides
    if pending is not None and refused:
        force_spent(record, pending.decisionId, refused)  # before the verdict: the ladder must not force again
    started = telemetry.now_ns()
    decision, claimed = _verdict(run, record)
    withdrew = ""
    if pending is not None:
        # A force step's approval, an escalation's (executed only near NotBefore) and the rule's own are different
        # requests to the VM: a retry decided another way is a new approval, not the first one renewed.
        form = (pending.forceHook, pending.nearNotBeforeSeconds) == (decision.forceHook, decision.nearNotBeforeSeconds)
        if decision.verdict == "approve" and decision.rule == pending.rule and form:
            renew(change, pending, decision, run.policy, run.now)
            if found:
                # Nothing was sent before (no VM to send it through), so nothing is in flight: this run sends it,
                # and its write says so (in flight until the grace, as a new approval): another run that reads it
                # before this one's outcome is committed must not send it again (a batch's outcomes are committed
                # after it: a second batch's send renewed the request's validity past a gate that failed meanwhile).
                pending.outcome, pending.nextAttemptAt = "", run.now + IN_FLIGHT_GRACE
                change.approval_decided = change.changed = True
            return
        # Its conditions no longer hold (or another rule decides now): withdrawn before it was ever executed, and its
        # claims freed by the tail (those this decision claims again excepted).
        record.approval = None
        change.changed = True
        change.released = [key for key in pending.budgetKeys if key not in claimed]
        withdrew = withdrawal(pending, run.policy.fingerprint, run.now, refused_by=refused)
    _record_decision(run, change, decision, withdrew=withdrew, started=started)
    if decision.verdict == "approve" and not run.dry_run and record.decision is not None:
        _approve(run, change, decision, claimed)


def _decided_by_this_run(run: Run, change: EventChange, pending: ApprovalRecord) -> None:
    """This run decided ``pending`` in an earlier attempt of this same write, which landed though its answer was lost
    (a timed-out insert retried and refused as "already exists"): not another run's approval in flight, but this
    run's to send, with its Decision row. Left alone, it waited for the timer's in-flight grace (90 s) and a short
    Freeze's approval was never sent (no Decision row, no approval)."""
    record = change.record
    if record.decision is not None and record.decision.decisionId == pending.decisionId:
        change.rows.append(decision_row(record=record, now=run.now))
    change.approval_decided = change.changed = True


def _verdict(run: Run, record: EventRecord) -> tuple[Decision, list[str]]:
    """The policy's decision on the fleet as it is (gates read, the census usable, deletes coupled), and the budget
    keys an approval claims (or the decision held by the budget that refused)."""
    now, fleet, policy = run.now, run.fleet, run.policy
    needed = needs_fleet(policy, record, now)
    view = fleet.view(census=policy.needs_census) if needed else FleetView()
    decision = evaluate(policy, record, view, now, gates=_gate_results(run, record, view))
    unusable = fleet.census_unusable() if needed else ""
    if unusable:
        run.work.awaiting_census.append(record.eventId)  # decided again by the tail if a read lands (tail.py)
    if unusable and decision.verdict == "approve":
        # A census that cannot be read approves nothing resting on it, as an unreadable gate: without the VMs' tags a
        # tag that holds an event back would not, and a percent budget's domain size would be a guess.
        decision = dataclasses.replace(
            decision, verdict="wait", reason=f"{unusable}: {decision.reason}", holdKind="census", holdName="arm"
        )
    if record.eventType == "Terminate" and record.scaleSets:
        decision = couple(decision, record, fleet.deletes_of(record.scaleSets), now)
    decision, claimed = claim(run, record, decision, view)
    # Held after the rules (census, a delete, a claim): the ladder's steps are still taken, its approve step is not.
    held = f"{decision.holdKind} {decision.holdName!r}"
    return escalated(policy, decision, record, view, now, held=held), claimed


def _record_decision(run: Run, change: EventChange, decision: Decision, *, withdrew: str, started: int) -> None:
    """A new decision (and row) when the rule, verdict, hold or reason changes (e.g. a hook now failed), or it
    withdrew an approval; not on every re-evaluation that finds the same (``same_decision``: a budget's count that
    grew is the same hold)."""
    record, now, dry_run = change.record, run.now, run.dry_run
    previous = record.decision
    hold_since = now if decision.holdKind else None
    hold = (decision.holdKind, decision.holdName)
    if previous is not None and decision.holdKind and (previous.holdKind, previous.holdName) == hold:
        hold_since = previous.holdSince or previous.decidedAt  # held by the same hold since then
    new_steps = not_taken(record, decision.escalation)
    if not withdrew and not new_steps and previous is not None and same_decision(previous, decision, dry_run=dry_run):
        return
    record.decision = DecisionRecord(
        decisionId=uuid.uuid4().hex,
        rule=decision.rule,
        action=decision.action,
        verdict=decision.verdict,
        reason=decision.reason,
        decidedAt=now,
        dryRun=dry_run,
        actor=f"rule:{decision.rule}",
        heldBy=decision.heldBy,
        heldByVm=decision.heldByVm,
        heldUntil=decision.heldUntil,
        holdKind=decision.holdKind,
        holdName=decision.holdName,
        holdSince=hold_since,
        withdrawal=withdrew,
        viewed=record.view(),
    )
    take(change, new_steps, now, cards=not dry_run)  # a dry run tells no one: its steps are rows only
    change.rows.append(decision_row(record=record, now=now))
    change.changed = True
    telemetry.decided(
        record.traceparent,
        started_ns=started,
        event_id=record.eventId,
        event_type=record.eventType,
        rule=decision.rule,
        verdict=decision.verdict,
        action=decision.action,
        dry_run=dry_run,
    )
    if decision.action == "wait-for-person":
        # Nobody else will approve it: the card that says so, with the approval link (once per event: an impactful
        # event's new-event card, raised when it was first seen, is this same card).
        raise_alert(change, "new-event", now)


def _approve(run: Run, change: EventChange, decision: Decision, claimed: list[str]) -> None:
    """The approval of the decision just recorded, claiming ``claimed``, for this run to send."""
    record, now, policy = change.record, run.now, run.policy
    assert record.decision is not None
    bound = approval_bound(policy, decision.rule, record, now, at_deadline=decision.atDeadline)
    record.approval = ApprovalRecord(
        decisionId=record.decision.decisionId,
        rule=decision.rule,
        actor=f"rule:{decision.rule}",
        decidedAt=now,
        nextAttemptAt=now + IN_FLIGHT_GRACE,
        budgetKeys=claimed,
        notAfter=bound.at if bound else None,
        notAfterReason=bound.why if bound else "",
        policyVersion=policy.fingerprint,
        nearNotBeforeSeconds=decision.nearNotBeforeSeconds,
        forceHook=decision.forceHook,
    )
    run.fleet.add(record)
    change.changed = True
    change.approval_decided = True
    run.work.decided.add(record.approval.decisionId)


def claim(run: Run, record: EventRecord, decision: Decision, view: FleetView) -> tuple[Decision, list[str]]:
    """An approval's fleet-wide claims: the keys claimed, or the decision held by the budget that refused."""
    now, fleet, policy, dry_run = run.now, run.fleet, run.policy, run.dry_run
    domains = budget_domains(policy, decision.rule, record, view)
    claimed: list[str] = []
    if decision.verdict == "approve" and not dry_run and domains:
        # The rule saw budget left in this instance's view; the claim makes that hold across instances.
        refused, full = fleet.budgets.claim(record, domains, now)
        if refused:
            decision = Decision(decision.rule, decision.action, "wait", refused, holdKind="budget", holdName=full)
        else:
            claimed = list(dict.fromkeys(d.entity_key for d in domains))  # the entities: what is released
    paces = pace_domains(policy, decision.rule, record, view)
    if decision.verdict == "approve" and not dry_run and paces:
        # The rule's rate and sequence, whose state only the claim entities hold: claimed after the impact budgets
        # (which are given back when pacing holds the event).
        hold = fleet.budgets.pace(record, paces, now)
        if hold is not None:
            for key in claimed:
                fleet.budgets.release(key, record.eventId)
            claimed = []
            decision = paced_hold(decision, record, hold)
        else:
            claimed += [p.key for p in paces]
    return decision, claimed


def renew(change: EventChange, approval: ApprovalRecord, decision: Decision, policy: Policy, now: datetime) -> None:
    """The rule that approved approves again: the approval stands (same decisionId, so a listener that executed it
    already answers from its ledger), bounded anew by what holds now, under the policy loaded now."""
    bound = approval_bound(policy, decision.rule, change.record, now, at_deadline=decision.atDeadline)
    renewed = (bound.at if bound else None, bound.why if bound else "", policy.fingerprint)
    if renewed != (approval.notAfter, approval.notAfterReason, approval.policyVersion):
        approval.notAfter, approval.notAfterReason, approval.policyVersion = renewed
        change.changed = True
