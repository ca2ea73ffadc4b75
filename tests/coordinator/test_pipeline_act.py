"""Deliver (coordinator/pipeline/act.py): committed approvals sent through the chosen VM (or the Maintenance RP), and
each outcome committed to its event: Approved, a retry time with backoff, or a card."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta
from typing import Any, NoReturn

import pytest

from contracts.approval import ApprovalRequest, ApprovalResult
from contracts.envelope import VmIdentity
from coordinator.adapters.callback import ApprovalDeliveryError
from coordinator.adapters.delivery_queue import QueuedDelivery
from coordinator.domain import approvals
from coordinator.domain.model import ApprovalRecord, EventRecord, OpenRequest, VmSighting
from coordinator.domain.policy_file import parse_policy
from coordinator.pipeline import act, attempt, delivery, handover, plan
from coordinator.pipeline.run import Delivery, Run
from tests.coordinator.helpers import DOC_NOW, approval_record
from tests.coordinator.runs import (
    NOT_BEFORE,
    Bench,
    Bound,
    DeadFor,
    MemoryDeliveries,
    RecordingCallback,
    put_event,
    put_terminate,
    put_vm,
)
from tests.health_page import HealthPage

EVENT = "EV-FREEZE"
SILENT = DOC_NOW - timedelta(minutes=10)


def approval(rule: str = "short-freeze", **fields: Any) -> ApprovalRecord:
    """Rule ``rule``'s approval "d-1", its next attempt 90 s after DOC_NOW, unless ``fields`` say."""
    first = {
        "decisionId": "d-1",
        "rule": rule,
        "actor": f"rule:{rule}",
        "nextAttemptAt": DOC_NOW + timedelta(seconds=90),
    }
    return approval_record(**{**first, **fields})


def approved_freeze(
    bench: Bench, *, event_id: str = EVENT, seen: datetime = DOC_NOW, rule: str = "short-freeze", **fields: Any
) -> None:
    put_event(
        bench.store,
        event_id,
        vms=("WestNO_0", "WestNO_1"),
        seen=seen,
        eventType="Freeze",
        durationInSeconds=5,
        notBefore=NOT_BEFORE,
        approval=approval(rule),
        **fields,
    )


def deliver(bench: Bench, *event_ids: str, last_seen: dict[str, datetime] | None = None, **options: Any) -> Run:
    run = bench.run(**options)
    run.work.deliveries = list(event_ids or [EVENT])
    act.deliver(run, last_seen=last_seen)
    return run


def test_an_approval_goes_to_the_first_named_vm_and_its_approved_answer_moves_the_event(bench: Bench):
    approved_freeze(bench)
    run = deliver(bench)

    assert bench.callback.vms == ["WestNO_0"]
    request = bench.callback.sent[0][0]
    assert (request.eventId, request.decisionId, request.rule) == (EVENT, "d-1", "short-freeze")
    # The request expires with its approval (docs/security.md, "Approvals expire"): never after NotBefore, and here
    # at the delivery deadline, which comes first.
    assert request.notAfter is not None
    assert request.expiresAt == request.notAfter <= NOT_BEFORE
    assert request.facts is not None
    assert (request.facts.eventType, request.facts.durationInSeconds, request.facts.resources) == (
        "Freeze",
        5,
        ["WestNO_0", "WestNO_1"],
    )
    record = bench.event(EVENT)
    assert record.state == "Approved"
    assert record.approval is not None
    assert (record.approval.delivered, record.approval.attempts, record.approval.executor) == (True, 1, "WestNO_0")
    # The listener's word is not the platform's: Started (or gone) must follow within start_bound.
    assert record.approval.confirmBy == DOC_NOW + run.options.start_bound
    assert record.approval.nextAttemptAt is None
    assert run.report.approvals_sent == 1
    assert run.work.alerts == [(EVENT, "approved")]
    # The approval left before any history was written: its intent and outcome wait for the tail's history step.
    assert bench.rows("Approval") == []
    assert [(r.Outcome, r.Reason) for r in run.work.rows if r.Outcome == "sending"] == [
        ("sending", f"StartRequests for {EVENT} going to WestNO_0 (attempt 1)")
    ]
    assert [(r.RecordType, r.Outcome or r.State) for r in run.work.rows] == [
        ("Approval", "sending"),
        ("Approval", "approved"),
        ("Transition", "Approved"),
    ]
    assert run.stages == ["deliver"]


def test_dry_run_sends_nothing_and_records_no_attempt(bench: Bench):
    approved_freeze(bench)
    run = deliver(bench, dry_run=True)
    assert bench.callback.sent == []
    record = bench.event(EVENT)
    assert record.approval is not None
    assert (record.state, record.approval.attempts, record.approval.outcome) == ("Scheduled", 0, "")
    assert run.report.approvals_sent == 0
    assert bench.history.rows == []
    assert run.work.rows == []


def test_the_policys_dry_run_holds_an_approval_decided_before_it_was_switched_on(bench: Bench):
    approved_freeze(bench)
    bench.policy = parse_policy("dryRun: true\nrules:\n  - name: short-freeze\n    action: approve-now\n")
    deliver(bench)
    assert bench.callback.sent == []


def test_no_vm_reporting_within_the_heartbeat_timeout_is_a_failure_that_says_so(bench: Bench):
    approved_freeze(bench, seen=SILENT)
    run = deliver(bench)
    assert bench.callback.sent == []
    approval_now = bench.event(EVENT).approval
    assert approval_now is not None
    assert approval_now.outcome == "failed"
    assert approval_now.reason == "no VM of ['WestNO_0', 'WestNO_1'] reported within 300 s"
    assert approval_now.nextAttemptAt is not None
    assert approval_now.nextAttemptAt > DOC_NOW
    # Nothing was sent: no intent row, only the outcome.
    assert bench.rows("Approval") == []
    assert [r.Outcome for r in run.work.rows] == ["failed"]


def test_the_timers_fresh_last_seen_makes_a_recently_heard_vm_the_executor(bench: Bench):
    approved_freeze(bench, seen=SILENT)
    deliver(bench, last_seen={"WestNO_1": DOC_NOW})
    assert bench.callback.vms == ["WestNO_1"]


def test_a_terminate_goes_only_through_the_vm_it_deletes_never_a_peer(bench: Bench):
    put_terminate(bench.store, "EV-DEL", "web_0", seen=SILENT, approval=approval("terminate-after-prepare-hooks"))
    # A peer of the same placement group that lists the delete too, and is alive.
    peer = bench.event("EV-DEL").vms["web_0"].model_copy(update={"lastSeen": DOC_NOW, "name": ""})
    put_vm(bench.store, "web_1", scale_set="web", sightings={"EV-DEL": peer})
    assert set(bench.event("EV-DEL").vms) == {"web_0", "web_1"}

    deliver(bench, "EV-DEL")
    assert bench.callback.sent == []
    approval_now = bench.event("EV-DEL").approval
    assert approval_now is not None
    assert approval_now.reason.startswith(
        "a Terminate is approved only through the VM it deletes, and none of ['web_0']"
    )


def test_a_vm_that_a_delete_is_removing_is_never_the_executor(bench: Bench):
    approved_freeze(bench)
    put_event(
        bench.store,
        "EV-DEL",
        vms=("WestNO_0",),
        eventType="Terminate",
        notBefore=NOT_BEFORE,
        approval=approval("terminate-after-prepare-hooks", decisionId="d-del"),
    )
    deliver(bench)
    # Its listener may be gone before it answers: the Freeze goes through the other VM.
    assert bench.callback.vms == ["WestNO_1"]


REMOTE_POLICY = """
rules:
  - name: arm-freeze
    match: {eventType: [Freeze]}
    action: approve-now
    callback: remote-acknowledge
  - name: rest
    action: wait-for-person
"""


def test_a_rule_asking_for_remote_acknowledge_sends_nothing_while_it_is_off(bench: Bench):
    bench.policy = parse_policy(REMOTE_POLICY)
    approved_freeze(bench, rule="arm-freeze")
    deliver(bench)
    assert bench.callback.sent == []
    approval_now = bench.event(EVENT).approval
    assert approval_now is not None
    assert approval_now.outcome == "failed"
    assert approval_now.reason == (
        "rule 'arm-freeze' approves through remote acknowledge, which is off (COORDINATOR_REMOTE_ACKNOWLEDGE); "
        "nothing sent"
    )


def test_a_rule_asking_for_remote_acknowledge_goes_through_arm_when_it_is_on(bench: Bench):
    bench.policy = parse_policy(REMOTE_POLICY)
    bench.remote_acknowledge = RecordingCallback()
    approved_freeze(bench, rule="arm-freeze")
    run = deliver(bench)
    assert bench.callback.sent == []
    assert bench.remote_acknowledge.vms == ["WestNO_0"]
    approval_now = bench.event(EVENT).approval
    assert approval_now is not None
    assert approval_now.executor == "arm:WestNO_0"
    assert run.work.rows[0].Reason == f"acknowledge of {EVENT} going to ARM for WestNO_0 (attempt 1)"


@pytest.mark.parametrize("fallback", [False, True])
def test_remote_acknowledge_takes_over_when_no_listener_can_only_as_the_fallback(bench: Bench, fallback):
    bench.remote_acknowledge = RecordingCallback()
    approved_freeze(bench, seen=SILENT)
    deliver(bench, remote_acknowledge_fallback=fallback)
    assert bench.callback.sent == []
    assert bench.remote_acknowledge.vms == (["WestNO_0"] if fallback else [])


def test_failures_back_off_and_the_third_raises_approval_failed(bench: Bench):
    bench.rng = Bound(high=True)  # the jitter at its ceiling: the delays show the backoff itself
    bench.callback.error = ApprovalDeliveryError("nobody listening on vm-WestNO_0")
    approved_freeze(bench)
    delays, cards = [], []
    for _ in range(3):
        run = deliver(bench, approval_backoff=(5.0, 15.0))
        approval_now = bench.event(EVENT).approval
        assert approval_now is not None
        assert approval_now.nextAttemptAt is not None
        assert (approval_now.outcome, approval_now.reason) == ("failed", "nobody listening on vm-WestNO_0")
        delays.append((approval_now.nextAttemptAt - bench.now).total_seconds())
        cards.append([kind for _, kind in run.work.alerts])
        # The next attempt (through a peer) once the failed request has surely lapsed (act.reroute_at).
        bench.now += timedelta(minutes=1)
    assert delays == [5.0, 10.0, 15.0]  # doubling from 5 s, capped at 15 s
    assert cards == [[], [], ["approval-failed"]]
    assert bench.event(EVENT).state == "Scheduled"


def test_the_retry_waits_at_least_a_second_however_the_jitter_falls(bench: Bench):
    bench.rng = Bound(high=False)
    bench.callback.error = ApprovalDeliveryError("timeout")
    approved_freeze(bench)
    deliver(bench)
    approval_now = bench.event(EVENT).approval
    assert approval_now is not None
    assert approval_now.nextAttemptAt == DOC_NOW + timedelta(seconds=1)


def test_a_rejected_approval_raises_approval_refused_once_and_is_retried(bench: Bench):
    bench.callback.outcome = "rejected"
    bench.callback.reason = "EventType is 'Reboot' here, the decision rested on 'Freeze'"
    approved_freeze(bench)
    first = deliver(bench)
    second = deliver(bench)
    record = bench.event(EVENT)
    assert record.approval is not None
    assert (record.state, record.approval.delivered, record.approval.attempts) == ("Scheduled", False, 2)
    assert record.approval.reason == "EventType is 'Reboot' here, the decision rested on 'Freeze'"
    assert record.approval.nextAttemptAt is not None
    assert [k for _, k in first.work.alerts] == ["approval-refused"]
    assert second.work.alerts == []


def test_not_scheduled_waits_for_the_vms_next_document_instead_of_retrying(bench: Bench):
    bench.callback.outcome = "not-scheduled"
    approved_freeze(bench)
    deliver(bench)
    approval_now = bench.event(EVENT).approval
    assert approval_now is not None
    assert (approval_now.outcome, approval_now.nextAttemptAt, approval_now.delivered) == ("not-scheduled", None, False)


def test_a_listener_that_does_not_answer_within_the_deadline_is_recorded_as_failed(bench: Bench):
    approved_freeze(bench)
    bench.callback.hold = threading.Event()
    try:
        deliver(bench, approval_deadline=timedelta(milliseconds=50))
    finally:
        bench.callback.hold.set()  # its thread finishes on its own (the real sender has its own timeouts)
    approval_now = bench.event(EVENT).approval
    assert approval_now is not None
    assert (approval_now.outcome, approval_now.delivered) == ("failed", False)
    assert approval_now.reason == "WestNO_0's listener did not answer within 0.05 s; retried (idempotent by decisionId)"


def test_an_unexpected_error_in_one_delivery_costs_only_that_delivery(bench: Bench):
    approved_freeze(bench)
    bench.callback.error = KeyError("DocumentIncarnation")
    run = deliver(bench)
    approval_now = bench.event(EVENT).approval
    assert approval_now is not None
    assert approval_now.reason == "KeyError: 'DocumentIncarnation'"
    assert run.stages == ["deliver"]


def test_an_outcome_for_a_superseded_decision_is_not_recorded(bench: Bench):
    approved_freeze(bench)
    record = bench.event(EVENT)
    plan = Delivery(event_id=EVENT, decision_id="d-older", executor="WestNO_0", callback=bench.callback)
    assert attempt.approval_outcome(bench.run(), record, plan=plan) is None
    assert attempt.approval_outcome(bench.run(), None, plan=plan) is None


def test_an_approved_delete_held_by_a_pending_sibling_shows_the_platforms_hold(bench: Bench):
    put_terminate(bench.store, "EV-DEL-0", "web_0", approval=approval("terminate-after-prepare-hooks"))
    put_terminate(bench.store, "EV-DEL-1", "web_1")
    run = deliver(bench, "EV-DEL-0")
    record: EventRecord = bench.event("EV-DEL-0")
    assert record.state == "Approved"
    assert record.platformHold is not None
    assert (record.platformHold.eventId, record.platformHold.vm) == ("EV-DEL-1", "web_1")
    held = [r for r in run.work.rows if r.Actor == "platform"]
    assert [(r.Outcome, (r.Details or {}).get("heldBy")) for r in held] == [("held", "EV-DEL-1")]


class DeadListeners(DeadFor):
    """An approval path on which the listeners of ``dead`` never answer (hung, or gone with their VM): a bounded
    sender, told how long each send may take, gives up then, as the Relay sender does."""

    def fail(self, vm: VmIdentity, seconds: float) -> NoReturn:
        time.sleep(seconds)
        raise ApprovalDeliveryError(f"no listener connected within {seconds:.1f} s ({vm.name})")


def queued_bench(bench: Bench, *dead: str) -> DeadListeners:
    bench.deliveries = MemoryDeliveries()
    bench.callback = DeadListeners(*dead)
    return bench.callback


def test_a_listener_that_does_not_answer_holds_its_run_only_in_run_delivery_and_continues_in_the_queue(bench: Bench):
    """A listener that did not answer held its whole batch (~28 s), so an unrelated event of the next batch with
    20 s of notice expired (issue 22): now the run gives it in_run_delivery, hands it to the delivery queue, and
    the queue's run delivers it through a peer that can execute it."""
    callback = queued_bench(bench, "WestNO_0")
    approved_freeze(bench)
    put_event(bench.store, "EV-OTHER", vms=("Other_0",), eventType="Freeze", notBefore=NOT_BEFORE, approval=approval())
    started = time.monotonic()
    run = deliver(bench, EVENT, "EV-OTHER", in_run_delivery=timedelta(milliseconds=300))
    held = time.monotonic() - started

    assert held < 1.0, f"the run waited {held:.1f} s for a listener that does not answer"
    assert callback.within == pytest.approx([0.3, 0.3], abs=0.05)
    assert bench.event("EV-OTHER").state == "Approved"  # the other VM's approval was not held
    record = bench.event(EVENT)
    assert record.approval is not None
    assert (record.state, record.approval.outcome, record.approval.executor) == ("Scheduled", "continued", "WestNO_0")
    # Not a failed attempt, and the timer leaves it to the queue for the handover grace.
    assert (record.approval.attempts, record.approval.nextAttemptAt) == (0, DOC_NOW + handover.HANDOVER_GRACE)
    assert bench.deliveries is not None
    assert bench.deliveries.queued == [
        QueuedDelivery(eventId=EVENT, decisionId="d-1", executor="WestNO_0", handedOverAt=DOC_NOW)
    ]
    assert run.report.deliveries_continued == 1
    (row,) = [r for r in run.work.rows if r.Outcome == "continued"]
    assert row.VmName == "WestNO_0"
    assert row.Reason.startswith("no answer within 0.3 s (no listener connected within 0.3 s (WestNO_0)); continued")

    # The request it left is valid for the run's time only (plus the listener's tolerance): after it, and a margin
    # for a POST begun just before, no longer executable by WestNO_0.
    tolerance = run.options.not_after_tolerance
    lapsed = DOC_NOW + timedelta(milliseconds=300) + tolerance
    assert record.openRequest is not None
    assert (record.openRequest.executor, record.openRequest.until) == ("WestNO_0", lapsed)

    # The queue's run before then sends nothing to a peer: the message waits in the queue until it has lapsed.
    early = bench.run("delivery")
    delivery.take_over(early, bench.deliveries.queued[0])
    act.deliver(early, last_seen=None)
    assert callback.vms == ["WestNO_0", "Other_0"]
    assert bench.deliveries.delays[-1] == lapsed + approvals.REROUTE_MARGIN - DOC_NOW
    waiting = bench.event(EVENT).approval
    assert waiting is not None
    assert (waiting.outcome, waiting.executor, waiting.attempts) == ("continued", "WestNO_0", 0)
    assert "may be executed until" in waiting.reason

    # Then: the whole approval deadline, through a peer of the VM that did not answer.
    bench.now = lapsed + approvals.REROUTE_MARGIN
    continued = bench.run("delivery")
    delivery.take_over(continued, bench.deliveries.queued[-1])
    act.deliver(continued, last_seen=None)
    assert callback.vms[-1] == "WestNO_1"
    assert callback.within[-1] == pytest.approx(continued.options.approval_deadline.total_seconds(), abs=0.1)
    record = bench.event(EVENT)
    assert record.approval is not None
    assert (record.state, record.approval.executor, record.approval.attempts) == ("Approved", "WestNO_1", 1)
    assert record.openRequest is None  # answered
    assert continued.stages == ["continue", "deliver"]
    # A message delivered twice (queues are at least once) finds the approval delivered: nothing more is sent.
    again = bench.run("delivery")
    delivery.take_over(again, bench.deliveries.queued[-1])
    assert again.work.deliveries == []


@pytest.mark.parametrize(
    ("executor", "decision", "after", "waits"),
    [
        ("vm-a", "d-1", 0.0, False),  # the same request again: its listener executes a decisionId once
        ("vm-b", "d-1", 0.0, True),  # a peer while vm-a may still execute it
        ("vm-a", "d-2", 0.0, True),  # another decision through the same VM: its ledger does not know it
        ("vm-b", "d-1", 0.999, True),  # within the margin after its notAfter
        ("vm-b", "d-1", 1.0, False),  # lapsed, and the margin passed
    ],
)
def test_no_second_executor_while_an_unanswered_request_may_still_be_executed(
    executor: str, decision: str, after: float, waits: bool
):
    until = DOC_NOW + timedelta(seconds=5)
    open_request = OpenRequest(executor="vm-a", decisionId="d-1", until=until)
    now = until + timedelta(seconds=after)
    expected = until + approvals.REROUTE_MARGIN if waits else None
    assert approvals.reroute_at(open_request, executor, decision, now) == expected
    assert approvals.reroute_at(None, executor, decision, now) is None


def test_a_request_stays_open_until_answered_and_only_the_same_executors_extends_it():
    sent = Delivery(event_id=EVENT, decision_id="d-1", executor="vm-a", callback=RecordingCallback())
    sent.vm = VmIdentity(name="vm-a", vmId="00000000-0000-0000-0000-000000000001", resourceId="/vm/vm-a")
    sent.request = ApprovalRequest(
        eventId=EVENT,
        decisionId="d-1",
        rule="r",
        issuedAt=DOC_NOW,
        expiresAt=DOC_NOW + timedelta(seconds=5),
        notAfter=DOC_NOW + timedelta(seconds=5),
    )
    opened = attempt.open_after(None, sent)
    assert opened == OpenRequest(executor="vm-a", decisionId="d-1", until=DOC_NOW + timedelta(seconds=5))
    later = OpenRequest(executor="vm-a", decisionId="d-1", until=DOC_NOW + timedelta(seconds=9))
    assert attempt.open_after(later, sent) == later  # a shorter request again does not shorten it
    sent.result = ApprovalResult(outcome="not-found", eventId=EVENT, decisionId="d-1")
    assert attempt.open_after(later, sent) is None
    waiting = Delivery(event_id=EVENT, decision_id="d-1", executor="vm-a", callback=RecordingCallback())
    assert attempt.open_after(later, waiting) == later  # nothing sent
    # Sent, but it reached no listener (connections refused, the relay had none): nothing new is open.
    sent.result, sent.unreached = None, True
    assert attempt.open_after(None, sent) is None
    assert attempt.open_after(later, sent) == later


def test_a_handed_over_request_with_no_peer_yet_stays_valid_a_few_seconds_longer(bench: Bench):
    """No peer to take over yet: a listener the Relay holds longer than the run waits (oracle seed 15: 3 s) still
    executes the first request, and a peer that reports the event later waits only a few seconds more."""
    queued_bench(bench, "Other_0")
    put_event(bench.store, "EV-OTHER", vms=("Other_0",), eventType="Freeze", notBefore=NOT_BEFORE, approval=approval())
    run = deliver(bench, "EV-OTHER", in_run_delivery=timedelta(milliseconds=100))
    record = bench.event("EV-OTHER")
    assert record.approval is not None
    assert record.approval.outcome == "continued"
    assert record.openRequest is not None
    valid = run.options.in_run_delivery + plan.UNPEERED_ALLOWANCE + run.options.not_after_tolerance
    assert record.openRequest.until == DOC_NOW + valid


def test_a_request_sent_before_the_named_vm_reported_gets_no_allowance_its_peer_is_coming(bench: Bench):
    """Oracle seed 1042: only a viewer (Other_0) had reported web_1's event when it was decided; web_1 reported it
    30-150 ms later. The VM an event names always lists it, so a peer is coming: the request is valid for the run's
    wait alone, and a slow viewer's request lapses 2 s sooner for the named VM to take it over."""
    queued_bench(bench, "Other_0")
    put_event(
        bench.store,
        "EV-NAMED",
        vms=("Other_0",),
        resources=["Named_0"],
        eventType="Freeze",
        notBefore=NOT_BEFORE,
        approval=approval(),
    )
    run = deliver(bench, "EV-NAMED", in_run_delivery=timedelta(milliseconds=100))
    record = bench.event("EV-NAMED")
    assert record.approval is not None
    assert (record.approval.outcome, record.approval.executor) == ("continued", "Other_0")
    assert record.openRequest is not None
    assert record.openRequest.until == DOC_NOW + run.options.in_run_delivery + run.options.not_after_tolerance


def test_a_named_vm_counts_as_coming_unless_it_reported_or_another_event_removes_it():
    executor = VmSighting(
        name="web_0", firstSeen=DOC_NOW, lastSeen=DOC_NOW, lastSequence=1, incarnation=1, status="Scheduled"
    )
    record = EventRecord.model_validate(
        {
            "eventId": "EV-T",
            "eventType": "Terminate",
            "stateSince": DOC_NOW,
            "createdAt": DOC_NOW,
            "resources": ["web_0", "web_1"],
            "vms": {"web_0": executor},
        }
    )
    assert plan._coming(record, executor, {})
    assert plan._coming(record, executor, {"web_1": "EV-T"})  # its own delete: it still reports and may execute
    assert not plan._coming(record, executor, {"web_1": "EV-OTHER"})  # another event removes it
    assert not plan._coming(record.model_copy(update={"resources": ["web_0"]}), executor, {})
    assert not plan._coming(record, None, {})


def test_without_a_delivery_queue_a_run_waits_the_whole_deadline_as_before(bench: Bench):
    callback = DeadListeners()
    bench.callback = callback
    approved_freeze(bench)
    deliver(bench)
    assert callback.within == pytest.approx([bench.run().options.approval_deadline.total_seconds()], abs=0.1)
    assert bench.event(EVENT).state == "Approved"


def test_a_handover_that_cannot_be_queued_is_the_timers_after_its_grace(bench: Bench):
    queued_bench(bench, "WestNO_0")
    assert bench.deliveries is not None
    bench.deliveries.failing = True
    approved_freeze(bench)
    run = deliver(bench, in_run_delivery=timedelta(milliseconds=100))
    record = bench.event(EVENT)
    assert record.approval is not None
    assert (record.approval.outcome, record.approval.nextAttemptAt) == ("continued", DOC_NOW + handover.HANDOVER_GRACE)
    assert run.report.deliveries_continued == 0


TERMINATE_NOW = parse_policy(
    """
version: 1
rules:
  - name: terminate-now
    match: {eventType: [Terminate]}
    action: approve-now
"""
)


def test_a_terminate_whose_vm_did_not_answer_is_continued_through_that_vm_never_a_peer(bench: Bench):
    callback = queued_bench(bench, "web_0")
    bench.policy = TERMINATE_NOW  # the delivery run decides it again: its rule still approves it
    put_terminate(bench.store, "EV-DEL", "web_0", approval=approval("terminate-now"))
    peer = bench.event("EV-DEL").vms["web_0"].model_copy(update={"name": ""})
    put_vm(bench.store, "web_1", scale_set="web", sightings={"EV-DEL": peer})
    deliver(bench, "EV-DEL", in_run_delivery=timedelta(milliseconds=100))
    assert bench.deliveries is not None
    (queued,) = bench.deliveries.queued

    continued = bench.run("delivery", approval_deadline=timedelta(milliseconds=200))
    delivery.take_over(continued, queued)
    act.deliver(continued, last_seen=None)
    assert callback.vms == ["web_0", "web_0"]
    approval_now = bench.event("EV-DEL").approval
    assert approval_now is not None
    assert (approval_now.outcome, approval_now.executor) == ("failed", "web_0")


@pytest.mark.parametrize(("silent_for", "through"), [(timedelta(minutes=3), "arm:web_0"), (timedelta(0), "web_0")])
def test_a_terminate_whose_vm_is_gone_goes_through_remote_acknowledge_where_it_is_the_fallback(
    bench: Bench, silent_for: timedelta, through: str
):
    """Gone: its listener did not answer the last attempt and it has been silent for executor_silence (150 s, two
    and a half heartbeats); a listener that merely did not answer, of a VM still heard, is tried again."""
    bench.remote_acknowledge = RecordingCallback()
    answered = approval("terminate-after-prepare-hooks", outcome="continued", executor="web_0")
    put_terminate(bench.store, "EV-DEL", "web_0", seen=DOC_NOW - silent_for, approval=answered)
    deliver(bench, "EV-DEL", remote_acknowledge_fallback=True)
    approval_now = bench.event("EV-DEL").approval
    assert approval_now is not None
    assert approval_now.executor == through


class RecordingBatch(RecordingCallback):
    """A stand-in for remote acknowledge's list form: every VM's events share one resource; each ``send_many``
    is recorded, and the events in ``refuse`` fail on their own."""

    def __init__(self, refuse: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.refuse = refuse
        self.batches: list[list[str]] = []

    def batch_key(self, vm: VmIdentity) -> str:
        return "one-scale-set"

    def send_within(self, request: ApprovalRequest, *, vm: VmIdentity, seconds: float) -> ApprovalResult:
        return self.send(request, vm=vm)

    def send_many(self, items: Any, *, seconds: float) -> list[ApprovalResult | ApprovalDeliveryError]:
        self.batches.append([request.eventId for request, _ in items])
        return [
            ApprovalDeliveryError(f"{request.eventId}: NotFound")
            if request.eventId in self.refuse
            else self.send(request, vm=vm)
            for request, vm in items
        ]


def test_remote_acknowledges_of_one_resource_go_in_one_request_each_outcome_its_own(bench: Bench):
    bench.policy = parse_policy(REMOTE_POLICY)
    batch = RecordingBatch(refuse=frozenset({"EV-B"}))
    bench.remote_acknowledge = batch
    for event_id in ("EV-A", "EV-B"):
        approved_freeze(bench, event_id=event_id, rule="arm-freeze")
    deliver(bench, "EV-A", "EV-B")
    assert batch.batches == [["EV-A", "EV-B"]]
    assert bench.callback.sent == []
    approved, refused = bench.event("EV-A"), bench.event("EV-B")
    assert approved.state == "Approved"
    assert refused.approval is not None
    assert (refused.approval.outcome, refused.approval.reason) == ("failed", "EV-B: NotFound")


@pytest.mark.parametrize(
    ("until", "decision", "wait"),
    [
        (3.0, "d-1", 4.0),  # lapses in 3 s: the delivery run waits for it (+ the margin) rather than requeue
        (9.5, "d-1", 0.0),  # beyond LAPSE_WAIT_MAX: the message goes back to the queue, invisible until then
        (-1.0, "d-1", 0.0),  # lapsed already
        (3.0, "d-2", 0.0),  # another decision's request: not this message's to wait for
    ],
)
def test_a_delivery_run_waits_a_few_seconds_for_the_unanswered_request_to_lapse(
    until: float, decision: str, wait: float
):
    record = EventRecord.model_validate(
        {
            "eventId": EVENT,
            "eventType": "Freeze",
            "stateSince": DOC_NOW,
            "createdAt": DOC_NOW,
            "openRequest": {"executor": "vm-a", "decisionId": decision, "until": DOC_NOW + timedelta(seconds=until)},
        }
    )
    delivery = QueuedDelivery(eventId=EVENT, decisionId="d-1", executor="vm-a", handedOverAt=DOC_NOW)
    assert handover.lapse_wait(record, delivery, DOC_NOW) == timedelta(seconds=wait)
    assert handover.lapse_wait(None, delivery, DOC_NOW) == timedelta(0)


@pytest.mark.parametrize("passing", [True, False])
def test_a_handed_over_approval_is_decided_again_before_the_delivery_run_sends_it(
    bench: Bench, health: tuple[str, type[HealthPage]], passing: bool
):
    """The delivery run continues a send decided seconds before: its rule is asked again with the run's gates. A
    gate that stopped passing meanwhile let a resend through a VM back from the dead execute it (oracle seed 8);
    now the approval is withdrawn and nothing more is sent. Still passing: sent again, same decisionId."""
    url, page = health
    bench.policy = parse_policy(
        f"""
version: 1
gates:
  health: {{http: {{url: "{url}", expectStatus: [200], timeoutSeconds: 2}}}}
rules:
  - name: gated-freeze
    match: {{eventType: [Freeze]}}
    action: approve-now
    gates: [health]
"""
    )
    callback = queued_bench(bench, "WestNO_0", "WestNO_1")
    approved_freeze(bench, rule="gated-freeze")
    deliver(bench, in_run_delivery=timedelta(milliseconds=100))
    assert bench.deliveries is not None
    (queued,) = bench.deliveries.queued
    callback.dead.clear()  # the VMs are back
    page.status = 200 if passing else 503

    record = bench.event(EVENT)
    assert record.openRequest is not None
    bench.now = record.openRequest.until + approvals.REROUTE_MARGIN  # the request it left has lapsed
    continued = bench.run("delivery")
    delivery.take_over(continued, queued)
    act.deliver(continued, last_seen=None)
    record = bench.event(EVENT)
    if passing:
        assert [request.decisionId for request, _ in callback.sent] == ["d-1", "d-1"]
        assert record.approval is not None
        assert record.approval.delivered
    else:
        assert [request.decisionId for request, _ in callback.sent] == ["d-1"]
        assert record.approval is None
        assert record.decision is not None
        assert record.decision.verdict == "wait"
        assert record.decision.withdrawal.startswith("approval d-1 by rule 'gated-freeze'")
        assert "withdrawn" in record.decision.withdrawal
        assert "gate 'health' is failing" in record.decision.reason


def test_a_delivery_run_finds_the_vm_by_its_heartbeats_as_the_timer_does():
    """Issue 33: a person's approval handed over, continued 10 minutes after WestNO_0 listed the event, while
    WestNO_0 heartbeats every minute: the delivery run sends it through WestNO_0 (before: no VM reported within
    300 s, as it judged WestNO_0 by its sighting's last change)."""
    bench = Bench(deliveries=MemoryDeliveries())
    approval = approval_record(
        decisionId="d-1", rule="manual", actor="person:ops@example.com", outcome="continued", executor="WestNO_0"
    )
    put_event(bench.store, EVENT, vms=("WestNO_0",), notBefore=NOT_BEFORE, approval=approval)
    bench.now = DOC_NOW + timedelta(minutes=10)
    put_vm(bench.store, "WestNO_0", last_seen=bench.now - timedelta(seconds=30))
    run = bench.run("delivery")
    delivery.take_over(run, QueuedDelivery(eventId=EVENT, decisionId="d-1", executor="WestNO_0", handedOverAt=DOC_NOW))
    act.deliver(run, last_seen=None)
    assert bench.callback.vms == ["WestNO_0"]
    record = bench.event(EVENT)
    assert record.approval is not None
    assert (record.state, record.approval.outcome) == ("Approved", "approved")
