"""Deliver, the first step of every run's tail (pipeline/tail.py): approvals out to the VMs, outcomes committed.

Takes the run's ``Work`` (events whose approval was decided by a committed write); gives approvals sent through the
``ApprovalCallback`` (Azure Relay in Azure, or the Maintenance RP's acknowledge) and each outcome committed to its
event (Approved, or a retry time, or an alert). Only what was committed is acted on, and only the write that
decided an approval sends it.

An approval leaves right after its deciding write (``send_decided``, called by fold before the VM positions are
written): the plan made before that write (pipeline/plan.py, ``intend``: its intent row committed with the write, in
the outbox), and the record and ETag the write gave, are what is sent and what its outcome is written against, with
no re-read; the outcome's rows are committed with the outcome (the run's outcomes together, one transaction per
event partition: ``_outcomes_together``), and the history is uploaded last, in the tail. A crash after the deciding
write leaves the approval record itself (``nextAttemptAt``): the timer sends it again.

Nothing waits for a slow or dead listener either: with a delivery queue (``Parts.deliveries``), a batch, tick or
person's run gives each approval ``in_run_delivery`` (3 s; less when NotBefore is near, plan.answer_wait) and hands
one not answered by then to the queue (pipeline/handover.py); a ``delivery`` run plans it again from the record,
through another VM when the one that did not answer has a peer that can execute it, and gives it the whole approval
deadline. One decisionId throughout: the listener executes it once. A batch does not even wait for those 3 s: its
sends are ``Sending``s its tail awaits after the batch has returned (``tail_after_batch``; docs/liveness.md,
*The tail after the batch*).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any

from contracts.approval import ApprovalRequest, ApprovalResult
from contracts.envelope import VmIdentity
from coordinator.adapters import telemetry
from coordinator.adapters.callback import (
    ApprovalCallback,
    ApprovalDeliveryError,
    is_batch,
    is_bounded,
)
from coordinator.domain.lifecycle import EventChange
from coordinator.domain.model import EventRecord
from coordinator.pipeline import attest, handover
from coordinator.pipeline.attempt import approval_outcome
from coordinator.pipeline.plan import answer_wait, hands_over, plan_delivery
from coordinator.pipeline.run import Delivery, Run, Sending
from coordinator.state.entities import event_partition, packed
from coordinator.state.events import aggregate, commit_event
from coordinator.state.store import ConcurrencyConflict, RecordTooLarge, Stored

log = logging.getLogger("coordinator")

# How long past its own time a run waits for a bounded send's answer to come back (the attempt's end, the reply).
SEND_SLACK = 0.5
# An unproven answer (a lying listener beside the VM's on its hybrid connection, which Relay picks at random) is sent
# again after a pause (the VM's own connects as it lists the event), this many times in the send's seconds (4: 1 in 16).
PROOF_ATTEMPTS, PROOF_PAUSE = 16, 0.1
# How long a batch waits for its approvals' sends to start before it writes its VM positions. A pool thread woken by
# the batch gets the GIL only when the batch thread blocks or after the interpreter's 5 ms switch interval, so without
# the wait the positions' transaction was built, and often sent, before the approval: measured by benchmarks/hop.py
# (hop_table_requests 2 where the approval needs 1). Bounded: a saturated pool costs the batch at most this, and only
# the sends the pool can start at once are waited for (the rest start as earlier ones end, a round trip later).
LEAVE_FIRST = 0.02


def deliver(run: Run, *, last_seen: dict[str, datetime] | None, again: bool = False) -> None:
    """Sends the run's committed approvals not sent yet, then commits each outcome to its event (``run.work``
    collects the changes: their rows, cards and records). ``again``: the same stage, for what the run decided since
    it delivered (tail.after_census)."""
    if not again:
        run.enter("deliver")
    send_decided(run, last_seen=last_seen)
    work = run.work
    for sending in work.sending:  # a batch's sends, answered while the batch was returning (tail_after_batch)
        await_answers(sending)
        work.sent.extend(sending.plans)
    work.sending = []
    sent, work.sent = work.sent, []  # each outcome committed once, however often a run delivers (tail.finish)
    together = _outcomes_together(run, sent)
    for plan in sent:
        known = work.records.get(plan.event_id)
        etag = work.etags.get(plan.event_id)
        try:
            if plan.event_id in together:
                change = together[plan.event_id]
            else:
                change = commit_event(
                    run.parts.store,
                    plan.event_id,
                    lambda r, plan=plan: approval_outcome(run, r, plan=plan),  # type: ignore[misc]
                    # The record as this run committed it, and that write's ETag: no re-read unless another wrote since.
                    read=Stored(known, etag) if known is not None and etag is not None else None,
                    etags=work.etags,
                    outbox=run.outbox(),
                )
        except ConcurrencyConflict:
            log.warning("approval of %s: outcome not recorded (contended); the timer reconciles", plan.event_id)
            change = None
        if change is None and plan.intent is not None:
            work.rows.append(plan.intent)  # a send with no outcome written: its intent goes with the run's rows
        if change is not None:
            run.report.approvals_sent += 1
            if any(row.RecordType == "Transition" and row.State == "Approved" for row in change.rows):
                # The listener's 'approved' moved the event to Approved just now (not a repeated delivery).
                record = change.record
                rule = record.approval.rule if record.approval is not None else ""
                telemetry.approved(
                    record.eventType, rule, detected=record.createdAt, not_before=record.notBefore, now=run.now
                )
            run.fleet.note(change.record)
            work.collect(change)
            if plan.continued:
                handover.put(
                    run,
                    event_id=plan.event_id,
                    decision_id=plan.decision_id,
                    executor=plan.executor,
                    visible_at=plan.wait_until,
                )


# A run's outcomes are written together per event partition, at most this many events and characters of records a
# transaction (each event with its rows: well within the service's 100 operations and the store's 3 MB cut), so that
# each is one transaction, all or nothing: one cut in two could write half, and the other half's events redone on
# their own would apply the written half's outcomes twice.
TOGETHER, TOGETHER_CHARS = 25, 1_000_000


def _outcomes_together(run: Run, plans: Sequence[Delivery]) -> dict[str, EventChange | None]:
    """The outcomes of the run's sends, each on the record its deciding write left (with that write's ETag), written
    together: a transaction per event partition with their rows, not one request per approval. What a transaction
    could not write (another instance wrote one of its events, or one is too large to store) is left out, and
    ``deliver`` commits each of those on its own, reading what was written. A handed-over send (its record changes
    in the queue's run) is not taken."""
    work = run.work
    mine = [p for p in plans if not p.continued and p.event_id in work.records and p.event_id in work.etags]
    if len(mine) < 2 or len({p.event_id for p in mine}) < len(mine):
        return {}
    by_partition: dict[str, list[Delivery]] = {}
    for plan in mine:
        by_partition.setdefault(event_partition(plan.event_id), []).append(plan)
    out: dict[str, EventChange | None] = {}
    outbox = run.outbox()
    for group in by_partition.values():
        for part in _transactions(group, work.records):
            changes = {p.event_id: approval_outcome(run, work.records[p.event_id], plan=p) for p in part}
            written = {i: c for i, c in changes.items() if c is not None and c.changed}
            writes = [(c.record, work.etags[i]) for i, c in written.items()]
            staged = [piece for i, c in written.items() for piece in outbox.joined(f"event:{i}", c.rows)]
            try:
                etags = run.parts.store.save_events(writes, staged=staged) if writes else []
            except (ConcurrencyConflict, RecordTooLarge):  # nothing written: each on its own, as before
                continue
            outbox.wrote(staged)
            for (record, _), etag in zip(writes, etags, strict=True):
                work.etags[record.eventId] = etag
            out.update({i: written.get(i) for i in changes})
    return out


def _transactions(plans: Sequence[Delivery], records: Mapping[str, EventRecord]) -> Iterator[list[Delivery]]:
    return packed(
        ([plan] for plan in plans),
        lambda unit: len(aggregate(records[unit[0].event_id])),
        count=TOGETHER,
        size=TOGETHER_CHARS,
    )


def send_decided(
    run: Run, *, last_seen: dict[str, datetime] | None = None, unstorable: frozenset[str] = frozenset()
) -> None:
    """Sends the approvals committed so far and not sent yet, concurrently (a bounded pool, each with its own
    deadline: a slow or absent listener holds up nothing else); their outcomes are committed by ``deliver``. A
    batch whose tail runs after it (``Run.tail_after_batch``) does not wait here: its tail awaits the answers."""
    work = run.work
    going = {plan.event_id for plan in work.sent} | {p.event_id for s in work.sending for p in s.plans}
    plans = [
        plan
        for event_id in work.deliveries
        if event_id not in going and (plan := _plan(run, event_id, last_seen, unstorable=unstorable))
    ]
    sending = send_all(run, plans)
    if sending is not None and run.tail_after_batch:
        sending.departed(LEAVE_FIRST, at_most=run.options.approval_workers)
        work.sending.append(sending)
        in_flight = {id(plan) for plan in sending.plans}
        work.sent.extend(plan for plan in plans if id(plan) not in in_flight)
        return
    if sending is not None:
        await_answers(sending)
    work.sent.extend(plans)


def _plan(
    run: Run, event_id: str, last_seen: dict[str, datetime] | None, *, unstorable: frozenset[str]
) -> Delivery | None:
    """The plan its deciding write committed (attempt.intend), when it is for the approval committed; else made now."""
    planned = run.work.planned.pop(event_id, None)
    record = run.work.records.get(event_id)
    approval = record.approval if record is not None else None
    if planned is not None and approval is not None and planned.decision_id == approval.decisionId:
        return planned
    return plan_delivery(run, event_id, last_seen, unstorable=unstorable)


def send_all(run: Run, plans: Sequence[Delivery]) -> Sending | None:
    """Sends the approvals concurrently; ``await_answers`` collects their answers. With a delivery queue, a batch,
    tick or person's run gives each ``in_run_delivery`` and marks one not answered by then ``continued`` (``deliver``
    hands it over); otherwise, and in the queue's own run, each has ``approval_deadline``, after which it is recorded
    as failed and retried later. A send not over by then finishes on its own thread (each sender has its own
    timeouts). Approvals through a callback that takes several at once (the Maintenance RP's list acknowledge) go
    together, one request per resource, each with its own outcome."""
    handing_over = hands_over(run)
    within = (run.options.in_run_delivery if handing_over else run.options.approval_deadline).total_seconds()
    leaving = threading.Semaphore(0)
    futures = _submit(run, plans, within, leaving.release)
    if not futures:
        return None
    # A bounded sender ends by itself within its time; the slack is for its last answer to come back.
    until = time.monotonic() + within + (SEND_SLACK if handing_over else 0.0)
    return Sending(futures=futures, handing_over=handing_over, within=within, until=until, leaving=leaving)


def await_answers(sending: Sending) -> None:
    """Waits for the sends' answers until their deadline and sets each plan's result, or its failure (continued:
    to be handed over, when the run hands over)."""
    futures, handing_over, within = sending.futures, sending.handing_over, sending.within
    done, late = concurrent.futures.wait(futures, timeout=max(0.0, sending.until - time.monotonic()))
    for future in done:
        group = futures[future]
        try:
            answer = future.result()
        except ApprovalDeliveryError as error:
            answer = [error] * len(group)
        except Exception as error:  # a bug or an odd answer in one delivery costs only that delivery
            log.exception("approval of %s through %s failed", group[0].event_id, group[0].executor)
            answer = [RuntimeError(f"{type(error).__name__}: {error}")] * len(group)
        for plan, outcome in zip(group, answer if isinstance(answer, list) else [answer], strict=True):
            if isinstance(outcome, ApprovalResult):
                plan.result = outcome
            else:
                plan.failure = str(outcome)
                plan.continued = handing_over and isinstance(outcome, ApprovalDeliveryError)
                plan.unreached = isinstance(outcome, ApprovalDeliveryError) and outcome.unreached
                plan.answer_lost = isinstance(outcome, ApprovalDeliveryError) and outcome.answer_lost
    for future in late:
        for plan in futures[future]:
            plan.continued = handing_over
            plan.failure = (
                f"{plan.executor}'s listener did not answer within {within:g} s; retried (idempotent by decisionId)"
            )


def _submit(
    run: Run, plans: Sequence[Delivery], within: float, leaving: Callable[[], None]
) -> dict[concurrent.futures.Future[Any], list[Delivery]]:
    """Each plan's send on the run's pool, ``leaving`` called as each starts; those of one resource through a
    ``BatchCallback`` as one send."""
    futures: dict[concurrent.futures.Future[Any], list[Delivery]] = {}
    batches: dict[tuple[int, str], list[Delivery]] = {}
    for plan in plans:
        if plan.request is None or plan.vm is None:
            continue
        callback = plan.callback
        if is_batch(callback) and callback is not run.parts.callback:
            # No VM answers on this path, so there is no answer to prove (_proof): only the resource groups them.
            batches.setdefault((id(callback), callback.batch_key(plan.vm)), []).append(plan)
            continue
        proof = _proof(run, plan.vm, plan.decision_id) if callback is run.parts.callback else None
        wait = answer_wait(run, plan.request, within)
        future = run.pool().submit(
            send, callback, plan.request, plan.vm, plan.traceparent, proof, within=wait, leaving=leaving
        )
        futures[future] = [plan]
    for group in batches.values():
        plan = group[0]
        if len(group) == 1 and plan.request is not None and plan.vm is not None:
            future = run.pool().submit(
                send, plan.callback, plan.request, plan.vm, plan.traceparent, within=within, leaving=leaving
            )
            futures[future] = group
        else:
            futures[run.pool().submit(send_batch, group, within=within, leaving=leaving)] = group
    return futures


def send_batch(
    plans: Sequence[Delivery], *, within: float, leaving: Callable[[], None] = lambda: None
) -> list[ApprovalResult | ApprovalDeliveryError]:
    """Approvals of one resource through one ``BatchCallback`` request, each as its own ``coordinator.approval``
    span of its event's trace."""
    callback = plans[0].callback
    assert is_batch(callback)  # send_all groups only these
    items = [(plan.request, plan.vm) for plan in plans if plan.request is not None and plan.vm is not None]
    with contextlib.ExitStack() as spans:
        opened = [
            spans.enter_context(
                telemetry.approval_span(
                    plan.traceparent, event_id=request.eventId, decision_id=request.decisionId, vm=vm.name
                )
            )
            for plan, (request, vm) in zip(plans, items, strict=True)
        ]
        leaving()
        outcomes = callback.send_many(items, seconds=within)
        for span, outcome in zip(opened, outcomes, strict=True):
            telemetry.approval_answered(
                span, "failed" if isinstance(outcome, ApprovalDeliveryError) else outcome.outcome
            )
    return outcomes


def _proof(run: Run, vm: VmIdentity, decision_id: str) -> Callable[[ApprovalResult], str]:
    """What an answer must prove (pipeline/attest.py): that the executing VM gave it."""
    return lambda result: attest.answer_problem(
        run.parts.attestations,
        result,
        vm_id=vm.vmId,
        decision_id=decision_id,
        at=run.now,
        required=run.options.require_attestation,
    )


def send(
    callback: ApprovalCallback,
    request: ApprovalRequest,
    vm: VmIdentity,
    traceparent: str,
    proof: Callable[[ApprovalResult], str] | None = None,
    *,
    within: float,
    leaving: Callable[[], None] = lambda: None,
) -> ApprovalResult:
    """One approval through its callback, ended within ``within`` seconds where the callback can be told so, as the
    ``coordinator.approval`` span of the event's trace. An answer ``proof`` finds wanting is not the executing VM's:
    sent again after a pause (PROOF_ATTEMPTS in all, within the same seconds). ``leaving`` is called as the first
    attempt starts (the batch that decided it waits for that: ``Sending.departed``)."""
    give_up = time.monotonic() + within
    with telemetry.approval_span(
        traceparent, event_id=request.eventId, decision_id=request.decisionId, vm=vm.name
    ) as span:
        problem, made = "", 0
        leaving()  # the first attempt starts now (or none will: the time is up)
        for _attempt in range(PROOF_ATTEMPTS if proof else 1):
            left = give_up - time.monotonic()
            if left <= 0:
                break
            made += 1
            if is_bounded(callback):
                result = callback.send_within(request, vm=vm, seconds=left)
            else:
                result = callback.send(request, vm=vm)
            problem = proof(result) if proof else ""
            if not problem:
                telemetry.approval_answered(span, result.outcome)
                return result
            log.warning("approval of %s: an answer not from %s (%s); sent again", request.eventId, vm.name, problem)
            time.sleep(max(0.0, min(PROOF_PAUSE, give_up - time.monotonic())))
        telemetry.approval_answered(span, "unproven")
        raise ApprovalDeliveryError(
            f"{made} answers on {vm.name}'s hybrid connection did not prove they came from {vm.name}: {problem}; "
            "another instance may be listening on it; retried"
        )
