"""Decide (coordinator/pipeline/decide.py): the policy's verdict on each changed event with what the run knows of the
fleet: a decision (and its row) only when something changed, budgets claimed fleet-wide before an approval, nothing
approved in dry-run, the pending deletes of a scale set decided as one unit, budget slots freed at the end."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from coordinator.domain.claims import BudgetClaim, BudgetRecord
from coordinator.domain.evaluation import Decision
from coordinator.domain.evaluation import evaluate as real
from coordinator.domain.lifecycle import EventChange, clone
from coordinator.domain.model import ApprovalRecord, DecisionRecord, EventRecord
from coordinator.domain.policy_file import parse_policy
from coordinator.pipeline import decide, release
from coordinator.pipeline.decide import IN_FLIGHT_GRACE
from coordinator.pipeline.run import Run
from tests.coordinator.helpers import DOC_NOW, decision_record, event_record
from tests.coordinator.runs import NOT_BEFORE, Bench, put_event, put_terminate

BUDGET = parse_policy(
    """
rules:
  - name: one-at-a-time
    match: {eventType: [Reboot]}
    action: approve-within-budget
    budget: {maxImpacted: 1}
  - name: short-freeze
    match: {eventType: [Freeze], durationSeconds: {min: 0, max: 8}}
    action: approve-now
  - name: rest
    action: wait-for-person
"""
)
DELETES = parse_policy("rules:\n  - name: deletes-now\n    match: {eventType: [Terminate]}\n    action: approve-now\n")


def change_of(record: EventRecord) -> EventChange:
    return EventChange(record=clone(record))


def decided(run: Run, record: EventRecord) -> EventChange:
    change = change_of(record)
    decide.decide(run, change)
    return change


def freeze(event_id: str = "EV-F", **fields: Any) -> EventRecord:
    return event_record(event_id, eventType="Freeze", durationInSeconds=5, notBefore=NOT_BEFORE, **fields)


def test_a_decision_and_its_row_are_written_only_when_something_changed(bench: Bench):
    reboot = event_record("EV-R", notBefore=NOT_BEFORE)  # the default policy: a person decides
    first = decided(bench.run(), reboot)
    assert first.record.decision is not None
    assert (first.record.decision.rule, first.record.decision.verdict) == ("everything-else-waits", "wait")
    assert [(r.RecordType, r.Actor) for r in first.rows] == [("Decision", "rule:everything-else-waits")]
    # Nobody else will approve it: the card with the approval link.
    assert first.alerts == ["new-event"]
    assert first.changed

    again = decided(bench.run(), first.record)
    assert (again.rows, again.alerts, again.changed) == ([], [], False)
    assert again.record.decision == first.record.decision

    # The same event under another rule (the policy changed): a new decision, a new row.
    bench.policy = parse_policy("rules:\n  - name: people\n    action: wait-for-person\n")
    changed = decided(bench.run(), again.record)
    assert changed.record.decision is not None
    assert changed.record.decision.decisionId != first.record.decision.decisionId
    assert [r.Rule for r in changed.rows] == ["people"]


def test_an_approving_verdict_writes_the_approval_for_the_tail_to_deliver(bench: Bench):
    change = decided(bench.run(), freeze())
    decision, approval = change.record.decision, change.record.approval
    assert decision is not None
    assert approval is not None
    assert (decision.verdict, decision.dryRun) == ("approve", False)
    assert approval.decisionId == decision.decisionId
    assert (approval.rule, approval.actor) == ("short-freeze", "rule:short-freeze")
    # The deciding instance sends at once; the timer takes over only after the grace.
    assert approval.nextAttemptAt == DOC_NOW + decide.IN_FLIGHT_GRACE
    assert change.approval_decided


def test_only_a_scheduled_event_without_an_approval_is_decided(bench: Bench):
    started = decided(bench.run(), freeze(state="Started"))
    assert started.record.decision is None
    approved = freeze(approval=ApprovalRecord(decisionId="d", rule="r", actor="a", decidedAt=DOC_NOW))
    assert decided(bench.run(), approved).record.decision is None


def test_dry_run_decides_but_never_writes_an_approval_nor_claims_budget(bench: Bench):
    bench.policy = BUDGET
    reboot = put_event(bench.store, "EV-R", vms=("web_0",), scale_set="web", notBefore=NOT_BEFORE)
    for record in (freeze(), reboot):
        change = decided(bench.run(dry_run=True), record)
        assert change.record.decision is not None
        assert (change.record.decision.verdict, change.record.decision.dryRun) == ("approve", True)
        assert change.record.approval is None
        assert not change.approval_decided
        assert change.rows[0].DryRun is True
    assert bench.store.get_budget("web") is None


def other_instances_claim(bench: Bench) -> None:
    """Another instance approved a Reboot of the scale set a moment ago: its claim is stored, its approval not yet
    in this instance's view."""
    claim = BudgetClaim(eventId="EV-OTHER", vms=["web_1"], claimedAt=DOC_NOW)
    bench.store.save_budget(BudgetRecord(scaleSet="web", claims={"EV-OTHER": claim}), None)


def test_a_budget_claim_refused_fleet_wide_turns_the_approval_into_a_wait_held_by_the_budget(bench: Bench):
    bench.policy = BUDGET
    other_instances_claim(bench)
    reboot = put_event(bench.store, "EV-R", vms=("web_0",), scale_set="web", notBefore=NOT_BEFORE)

    change = decided(bench.run(), reboot)
    decision = change.record.decision
    assert decision is not None
    assert (decision.verdict, decision.holdKind, decision.holdName) == ("wait", "budget", "web")
    assert "held fleet-wide by EV-OTHER" in decision.reason
    assert decision.holdSince == DOC_NOW
    assert change.record.approval is None
    assert not change.approval_decided
    assert [(r.HoldKind, r.HoldName) for r in change.rows] == [("budget", "web")]

    # Still held a minute later: the same hold, since the same time, no new row.
    bench.now = DOC_NOW + timedelta(minutes=1)
    later = decided(bench.run(), change.record)
    assert later.rows == []
    assert later.record.decision is not None
    assert later.record.decision.holdSince == DOC_NOW


def test_a_held_event_whose_budget_count_grows_keeps_its_decision_until_another_hold(bench: Bench, monkeypatch):
    # The fleet's count in the budget grows as events queue behind it; each count is not a new decision (an event
    # write and a Decision row per re-evaluation of every held event): the same hold is.
    counts = iter([70, 75, 135])

    def zone_full(policy, record, *args, **kwargs):
        reason = f"zone 'westeurope/1' would have {next(counts)} impacted instances (limit 68)"
        return Decision("r", "approve-within-budget", "wait", reason, holdKind="budget", holdName="zone:westeurope/1")

    monkeypatch.setattr(decide, "evaluate", zone_full)
    reboot = event_record("EV-Z", notBefore=NOT_BEFORE)
    first = decided(bench.run(), reboot)
    assert first.record.decision is not None
    assert [r.Reason for r in first.rows] == ["zone 'westeurope/1' would have 70 impacted instances (limit 68)"]
    for _ in range(2):
        again = decided(bench.run(), first.record)
        assert (again.rows, again.changed) == ([], False)
        assert again.record.decision == first.record.decision

    def other_zone(policy, record, *args, **kwargs):
        reason = "zone 'westeurope/2' would have 70 impacted instances (limit 68)"
        return Decision("r", "approve-within-budget", "wait", reason, holdKind="budget", holdName="zone:westeurope/2")

    monkeypatch.setattr(decide, "evaluate", other_zone)
    moved = decided(bench.run(), first.record)
    assert [r.HoldName for r in moved.rows] == ["zone:westeurope/2"]
    assert moved.record.decision is not None
    assert moved.record.decision.decisionId != first.record.decision.decisionId


def test_a_claimed_budget_is_named_on_the_approval_and_held_in_the_store(bench: Bench):
    bench.policy = BUDGET
    reboot = put_event(bench.store, "EV-R", vms=("web_0",), scale_set="web", notBefore=NOT_BEFORE)
    change = decided(bench.run(), reboot)
    assert change.record.approval is not None
    assert change.record.approval.budgetKeys == ["web"]
    stored = bench.store.get_budget("web")
    assert stored is not None
    assert list(stored.record.claims) == ["EV-R"]


def test_events_competing_for_budget_are_decided_closest_to_not_before_first(bench: Bench):
    bench.policy = BUDGET
    later = put_event(bench.store, "EV-A", vms=("web_0",), scale_set="web", notBefore=NOT_BEFORE)
    sooner = put_event(
        bench.store, "EV-B", vms=("web_1",), scale_set="web", notBefore=NOT_BEFORE - timedelta(minutes=5)
    )
    run = bench.run()
    changes = [change_of(later), change_of(sooner)]  # arrival order: the later one first
    decide.decide_all(run, changes)
    approved = {c.record.eventId for c in changes if c.record.approval is not None}
    assert approved == {"EV-B"}
    assert run.stages == ["decide"]


def test_a_failure_deciding_one_event_costs_only_that_events_decision(bench: Bench, monkeypatch):
    def evaluate(policy, record, *args, **kwargs):
        if record.eventId == "EV-BAD":
            raise RuntimeError("a rule that cannot be read")
        return real(policy, record, *args, **kwargs)

    monkeypatch.setattr(decide, "evaluate", evaluate)
    changes = [change_of(freeze("EV-BAD")), change_of(freeze("EV-GOOD"))]
    decide.decide_all(bench.run(), changes)
    assert [c.record.decision is not None for c in changes] == [False, True]


def test_a_ready_delete_waits_while_a_sibling_delete_of_its_scale_set_is_not_ready(bench: Bench):
    bench.policy = DELETES
    put_terminate(bench.store, "EV-T0", "web_0")  # pending, not decided yet (its VM's batch has not come)
    mine = put_terminate(bench.store, "EV-T1", "web_1")
    change = decided(bench.run(), mine)
    decision = change.record.decision
    assert decision is not None
    assert (decision.verdict, decision.heldBy, decision.holdKind) == ("wait", "EV-T0", "delete")
    assert change.record.approval is None


def held_by(holder: str, reason: str = "held with the pending deletes of scale set web") -> DecisionRecord:
    """Rule deletes-now's decision on a delete that ``holder``, a pending delete of its scale set, holds back."""
    return decision_record(
        decisionId="d-held", rule="deletes-now", reason=reason, heldBy=holder, holdKind="delete", holdName=holder
    )


def test_release_held_redecides_the_deletes_a_changed_delete_held_back(bench: Bench):
    bench.policy = DELETES
    put_terminate(bench.store, "EV-T0", "web_0")
    put_terminate(bench.store, "EV-T1", "web_1", decision=held_by("EV-T0"))

    bench.now = DOC_NOW + timedelta(seconds=30)
    run = bench.run()
    holder = change_of(bench.event("EV-T0"))
    decide.decide_all(run, [holder])  # EV-T0's VM reported: it is decided, and approved
    assert holder.record.approval is not None

    assert decide.release_held(run, [holder.record]) == 1
    released = bench.event("EV-T1")
    assert released.decision is not None
    assert released.approval is not None
    assert (released.decision.verdict, released.decision.heldBy) == ("approve", "")
    # Approved in this same run: the tail delivers it with the one that held it.
    assert run.work.deliveries == ["EV-T1"]


def test_release_held_leaves_deletes_alone_when_no_delete_of_their_scale_set_changed(bench: Bench):
    bench.policy = DELETES
    put_terminate(bench.store, "EV-T0", "web_0")
    put_terminate(bench.store, "EV-T1", "web_1", decision=decision_record(rule="deletes-now", heldBy="EV-T0"))
    run = bench.run()
    assert decide.release_held(run, [freeze()]) == 0
    assert bench.event("EV-T1").approval is None


def test_approve_together_approves_the_set_when_fresh_reads_show_every_delete_ready(bench: Bench):
    bench.policy = DELETES
    put_terminate(bench.store, "EV-T0", "web_0")
    put_terminate(bench.store, "EV-T1", "web_1", decision=held_by("EV-T0"))
    run = bench.run()
    # This run's view of EV-T0 is as an earlier run left it (not ready); what is stored now says it is.
    waiting = decision_record(decisionId="d0", action="wait", reason="waiting for hooks")
    run.fleet.note(bench.event("EV-T0").model_copy(update={"decision": waiting}))
    assert decide.approve_together(run, ["web"]) == 2
    for event_id in ("EV-T0", "EV-T1"):
        record = bench.event(event_id)
        assert record.approval is not None, event_id
    assert sorted(run.work.deliveries) == ["EV-T0", "EV-T1"]


def test_approve_together_leaves_a_set_alone_while_one_delete_is_still_not_ready(bench: Bench):
    # The default policy: EV-T0's VM has not reported its hooks, so it is not ready; EV-T1 stays held as it was.
    put_terminate(bench.store, "EV-T0", "web_0")
    before = put_terminate(bench.store, "EV-T1", "web_1", decision=held_by("EV-T0"))
    run = bench.run()
    assert decide.approve_together(run, ["web"]) == 0
    after = bench.event("EV-T1")
    assert after.decision == before.decision
    assert after.approval is None
    assert run.work.rows == []


def concluded(event_id: str, *, keys: list[str], state: str = "Completed") -> EventRecord:
    approval = ApprovalRecord(decisionId="d", rule="one-at-a-time", actor="rule", decidedAt=DOC_NOW, budgetKeys=keys)
    return event_record(event_id, resources=["web_0"], state=state, approval=approval)


@pytest.mark.parametrize(("state", "released"), [("Completed", True), ("Canceled", True), ("Approved", False)])
def test_release_budgets_frees_the_slots_of_events_that_concluded(bench: Bench, state, released):
    bench.policy = BUDGET
    claim = BudgetClaim(eventId="EV-R", vms=["web_0"], claimedAt=DOC_NOW)
    bench.store.save_budget(BudgetRecord(scaleSet="web", claims={"EV-R": claim}), None)
    run = bench.run()
    run.work.records["EV-R"] = concluded("EV-R", keys=["web"], state=state)
    release.release_budgets(run)
    stored = bench.store.get_budget("web")
    assert stored is not None
    assert ("EV-R" not in stored.record.claims) is released
    assert run.stages == ["budgets"]


def test_release_budgets_finds_the_scale_set_of_an_approval_from_before_budget_keys(bench: Bench):
    bench.policy = BUDGET
    claim = BudgetClaim(eventId="EV-R", vms=["web_0"], claimedAt=DOC_NOW)
    bench.store.save_budget(BudgetRecord(scaleSet="web", claims={"EV-R": claim}), None)
    run = bench.run()
    run.work.records["EV-R"] = concluded("EV-R", keys=[])
    release.release_budgets(run)
    stored = bench.store.get_budget("web")
    assert stored is not None
    assert stored.record.claims == {}


def test_an_approval_that_found_no_executor_is_sent_by_the_run_that_brings_one(bench: Bench):
    """A Terminate's own VM reported just after a peer: the approval found no VM to go through, and waited for its
    retry's backoff and the timer, past NotBefore (oracle seed 90). Nothing was sent, so nothing is in flight: the
    run that brings the VM's sighting sends it, same decision."""
    bench.policy = DELETES
    failed = ApprovalRecord(
        decisionId="d-1",
        rule="deletes-now",
        actor="rule:deletes-now",
        decidedAt=DOC_NOW,
        attempts=1,
        outcome="failed",
        nextAttemptAt=DOC_NOW + timedelta(seconds=5),
    )
    record = put_event(
        bench.store, "EV-T", vms=("web_0",), eventType="Terminate", notBefore=NOT_BEFORE, approval=failed
    )
    change = decided(bench.run(), record)
    assert change.approval_decided
    assert change.record.approval is not None
    assert change.record.approval.decisionId == "d-1"
    # In flight from this write on: a run that reads it before the outcome is committed sends nothing (oracle seed 8:
    # a second send renewed the request past a gate that failed meanwhile).
    assert (change.record.approval.outcome, change.record.approval.nextAttemptAt) == ("", DOC_NOW + IN_FLIGHT_GRACE)
    assert change.changed
    assert not decided(bench.run(), change.record).approval_decided
    # Its VM silent (no executor still), or an attempt that reached a VM: the retry waits for its time.
    bench.now = DOC_NOW + timedelta(minutes=10)
    silent = decided(bench.run(), record.model_copy(update={"notBefore": bench.now + timedelta(minutes=5)}))
    assert not silent.approval_decided
    bench.now = DOC_NOW
    sent = record.model_copy(update={"approval": failed.model_copy(update={"executor": "web_0"})})
    assert not decided(bench.run(), sent).approval_decided
