"""An approval decided before a blackout, a window's end, a gate's failure or a policy change is not executed after
it: its first delivery fails (the VM's listener is not there), the condition changes, and the timer's retry decides
it again and withdraws it (a Decision row says why, its budget claim is freed) instead of sending it. One whose
conditions still hold is sent again with the same decisionId and a renewed notAfter. The coordinator runs for real
on the in-memory state store; the listener is played by ``Listener``, which judges each request's dates with the
real listener's ``refuse_stale`` on the test's clock."""

from __future__ import annotations

import random
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import yaml

from contracts import wire
from contracts.approval import ApprovalRequest, ApprovalResult
from contracts.envelope import VmIdentity
from coordinator.adapters.callback import ApprovalDeliveryError
from coordinator.adapters.teams import FolderCardSink
from coordinator.domain.controls import AlertGate, LogQueryGate
from coordinator.domain.model import EventRecord
from coordinator.domain.policy_file import parse_policy
from coordinator.service import Coordinator
from forwarder.approval_rules import Freshness, refuse_stale
from tests.coordinator.conftest import Clock
from tests.coordinator.helpers import DOC_NOW, MemoryHistory, envelope, raw_message, scheduled_event, vm
from tests.coordinator.memory_store import MemoryStateStore
from tests.coordinator.runs import make_coordinator

EVENT = "E-EXPIRY"
# DOC_NOW is 22:11:58 UTC; the event's NotBefore 22:26:58. The timer's retry runs 90 s later, at 22:13:28.
RETRY = timedelta(seconds=90)
GATED = """
gates:
  app-health: {alert: {alertRuleId: "/subscriptions/s/resourceGroups/rg/providers/microsoft.insights/metricAlerts/a"}}
rules:
  - {name: freeze-now, match: {eventType: [Freeze]}, action: approve-now, gates: [app-health]}
"""


class Listener:
    """A VM's listener as the coordinator meets it: unreachable while ``down``; otherwise it judges the request's
    dates as the real one does, at the test's clock, and executes what they allow."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.down = False
        self.requests: list[ApprovalRequest] = []
        self.executed: list[ApprovalRequest] = []

    def send(self, request: ApprovalRequest, *, vm: VmIdentity) -> ApprovalResult:
        self.requests.append(request)
        if self.down:
            raise ApprovalDeliveryError(f"no listener connected on {vm.name}")
        refused = refuse_stale(
            wire.ApprovalRequest.from_mapping(request.model_dump()), now=self.clock(), freshness=Freshness()
        )
        if refused is not None:
            return ApprovalResult(
                outcome="rejected", eventId=request.eventId, decisionId=request.decisionId, reason=refused
            )
        self.executed.append(request)
        return ApprovalResult(outcome="approved", eventId=request.eventId, decisionId=request.decisionId)


class Monitor:
    """Azure Monitor for an alert gate: ``fired`` alerts of the rule."""

    fired = 0

    def fired_alerts(self, gate: AlertGate) -> int:
        return self.fired

    def query_rows(self, gate: LogQueryGate) -> int:
        return 0


def build(policy: str, tmp: Path, *, monitor: Monitor | None = None) -> tuple[Coordinator, MemoryHistory, Listener]:
    clock = Clock(DOC_NOW)
    history = MemoryHistory()
    listener = Listener(clock)
    coordinator = make_coordinator(
        store=MemoryStateStore(),
        history=history,
        alerts=FolderCardSink(tmp / "cards"),
        callback=listener,
        policy=parse_policy(policy),
        clock=clock,
        monitor=monitor,
        rng=random.Random(21),
        # Longer than the conditions' bounds here, so that the requests show those (the delivery's deadline, when it
        # comes first, bounds a request as any other: test_a_persons_approval_…).
        approval_deadline=timedelta(minutes=2),
    )
    return coordinator, history, listener


def in_window(schedule: str, duration: str, **options: Any) -> str:
    """A policy of one rule, freeze-in-window: a Freeze is approved now inside the window ``schedule`` (cron) lasting
    ``duration``; ``options`` are the rule's others."""
    rule = {"name": "freeze-in-window", "match": {"eventType": ["Freeze"]}, "action": "approve-now"}
    return yaml.safe_dump({"rules": [{**rule, "window": {"schedule": schedule, "duration": duration}, **options}]})


def report(coordinator: Coordinator) -> None:
    """web_0 reports the Freeze (NotBefore 22:26:58, documented example) through its forwarder."""
    identity = vm("web_0", scale_set="web", index=1)
    freeze = scheduled_event(EVENT, resources=["web_0"])
    data = envelope(identity, sequence=1, incarnation=2, events=[freeze])
    coordinator.process_batch([raw_message(identity, data)])


def stored(coordinator: Coordinator) -> EventRecord:
    event = coordinator.event(EVENT)
    assert event is not None
    return event.record


def decided_then_undelivered(coordinator: Coordinator, listener: Listener) -> ApprovalRequest:
    """The rule approves at DOC_NOW; the listener is not there, so the approval waits for the timer's retry."""
    listener.down = True
    report(coordinator)
    approval = stored(coordinator).approval
    assert approval is not None
    assert (approval.outcome, approval.delivered) == ("failed", False)
    assert len(listener.requests) == 1
    return listener.requests[0]


def retried(coordinator: Coordinator, listener: Listener, *, after: timedelta = RETRY) -> None:
    clock = coordinator.parts.clock
    assert isinstance(clock, Clock)
    clock.now = DOC_NOW + after
    listener.down = False
    coordinator.tick()


def withdrawn(coordinator: Coordinator, history: MemoryHistory, decision_id: str) -> dict[str, Any]:
    """The approval is gone, never executed; the decision that replaced it says why, in the record and the history."""
    record = stored(coordinator)
    assert record.approval is None
    decision = record.decision
    assert decision is not None
    assert decision.decisionId != decision_id
    assert decision.withdrawal.startswith(f"approval {decision_id} by rule ")
    assert decision.withdrawal.endswith(" withdrawn, decided again: ")
    rows = [r for r in history.rows if r.RecordType == "Decision" and r.DecisionId == decision.decisionId]
    reason = decision.withdrawal + decision.reason
    assert [(r.Outcome, r.Reason) for r in rows] == [(decision.verdict, reason)]
    # The next tick finds the same: no other row.
    coordinator.tick()
    assert [r.Reason for r in history.rows if r.RecordType == "Decision"][-1] == reason
    return {"verdict": decision.verdict, "reason": reason, "hold": decision.holdKind}


def test_an_approval_decided_before_a_blackout_is_withdrawn_once_it_begins(tmp_path):
    policy = """
blackouts: [{name: night, schedule: "13 22 * * *", duration: 1h}]
rules: [{name: freeze-now, match: {eventType: [Freeze]}, action: approve-now}]
"""
    coordinator, history, listener = build(policy, tmp_path)
    first = decided_then_undelivered(coordinator, listener)
    # Sent valid only until the blackout opens at 22:13, before the event's NotBefore.
    assert first.notAfter == datetime.fromisoformat("2022-04-11T22:13:00+00:00")
    assert first.notAfterReason == "blackout 'night' opens"
    assert first.policyVersion == coordinator.policy.fingerprint
    retried(coordinator, listener)
    assert listener.executed == []
    assert len(listener.requests) == 1  # not sent again
    decision = withdrawn(coordinator, history, first.decisionId)
    assert (decision["verdict"], decision["hold"]) == ("wait", "blackout")
    assert "valid until 2022-04-11T22:13:00+00:00 (blackout 'night' opens)" in decision["reason"]


def test_an_approval_decided_in_a_window_is_withdrawn_once_the_window_closed(tmp_path):
    coordinator, history, listener = build(in_window("0 22 * * *", "13m"), tmp_path)
    first = decided_then_undelivered(coordinator, listener)
    assert (first.notAfter, first.notAfterReason) == (
        datetime.fromisoformat("2022-04-11T22:13:00+00:00"),
        "rule 'freeze-in-window''s window closes",
    )
    retried(coordinator, listener)
    assert listener.executed == []
    decision = withdrawn(coordinator, history, first.decisionId)
    assert (decision["verdict"], decision["hold"]) == ("wait", "window")


def test_an_approval_resting_on_a_gate_is_withdrawn_once_the_gate_fails(tmp_path):
    monitor = Monitor()
    coordinator, history, listener = build(GATED, tmp_path, monitor=monitor)
    first = decided_then_undelivered(coordinator, listener)
    # A gate's result is what the decision rested on for one timer period.
    assert first.notAfter == DOC_NOW + timedelta(seconds=60)
    assert first.notAfterReason == "the results of gates app-health are 60 s old"
    monitor.fired = 2
    retried(coordinator, listener)
    assert listener.executed == []
    decision = withdrawn(coordinator, history, first.decisionId)
    assert (decision["verdict"], decision["hold"]) == ("wait", "gate")
    assert "gate 'app-health' is failing (2 alerts fired)" in decision["reason"]


def test_an_approval_decided_under_an_older_policy_is_decided_again_under_the_new_one(tmp_path):
    coordinator, history, listener = build(
        "rules: [{name: freeze-now, match: {eventType: [Freeze]}, action: approve-now}]", tmp_path
    )
    first = decided_then_undelivered(coordinator, listener)
    old = coordinator.policy.fingerprint
    coordinator.policy = parse_policy("rules: [{name: people, match: {eventType: [Freeze]}, action: wait-for-person}]")
    retried(coordinator, listener)
    assert listener.executed == []
    decision = withdrawn(coordinator, history, first.decisionId)
    assert decision["verdict"] == "wait"
    assert f"the policy changed since (version {old}, now {coordinator.policy.fingerprint})" in decision["reason"]
    assert decision["reason"].endswith("rule 'people' waits for a person")


def test_an_approval_whose_conditions_still_hold_is_sent_again_as_the_same_decision_with_a_new_not_after(tmp_path):
    coordinator, _, listener = build(GATED, tmp_path, monitor=Monitor())
    first = decided_then_undelivered(coordinator, listener)
    retried(coordinator, listener)
    assert len(listener.executed) == 1
    again = listener.executed[0]
    assert again.decisionId == first.decisionId
    assert again.notAfter == DOC_NOW + RETRY + timedelta(seconds=60)  # the gate read again at the retry
    assert stored(coordinator).state == "Approved"


def test_a_withdrawn_approval_frees_its_budget_claim(tmp_path):
    policy = """
blackouts: [{name: night, schedule: "13 22 * * *", duration: 1h}]
rules:
  - {name: paced, match: {eventType: [Freeze]}, action: approve-within-budget, budget: {maxImpacted: 1}}
"""
    coordinator, history, listener = build(policy, tmp_path)
    first = decided_then_undelivered(coordinator, listener)
    claims = coordinator.parts.store.get_budget("web")
    assert claims is not None
    assert list(claims.record.claims) == [EVENT]
    retried(coordinator, listener)
    withdrawn(coordinator, history, first.decisionId)
    claims = coordinator.parts.store.get_budget("web")
    assert claims is not None
    assert claims.record.claims == {}


def test_an_approval_that_could_not_reach_the_listener_before_its_not_after_is_not_sent(tmp_path):
    """The window closes 2 s after the decision: within the listener's tolerance, so it is not sent at all (the
    listener would refuse it), and the retry withdraws it."""
    coordinator, history, listener = build(in_window("0 22 * * *", "12m"), tmp_path)
    report(coordinator)
    assert listener.requests == []
    failed = [r for r in history.rows if r.RecordType == "Approval" and r.Outcome == "failed"]
    assert len(failed) == 1
    assert failed[0].Reason.startswith("not sent: its notAfter 2022-04-11T22:12:00+00:00 (rule 'freeze-in-window''s")
    approval = stored(coordinator).approval
    assert approval is not None
    retried(coordinator, listener)
    assert listener.requests == []
    withdrawn(coordinator, history, approval.decisionId)


def test_a_persons_approval_is_not_decided_again_by_the_policy(tmp_path):
    """A person may approve through a blackout; the retry of that approval sends it again, bounded by NotBefore and
    its delivery's deadline."""
    policy = """
blackouts: [{name: all-night, schedule: "0 22 * * *", duration: 2h}]
rules: [{name: people, match: {eventType: [Freeze]}, action: wait-for-person}]
"""
    coordinator, _, listener = build(policy, tmp_path)
    report(coordinator)
    listener.down = True
    assert coordinator.approve_manually(EVENT, person="ops@example.com").status == "sent"
    retried(coordinator, listener)
    assert [r.decisionId for r in listener.executed] == [listener.requests[0].decisionId]
    assert listener.executed[0].notAfterReason == "the delivery's deadline, 120 s after sending"
    assert listener.executed[0].policyVersion == ""


def test_an_approval_at_the_deadline_is_not_made_when_too_near_not_before(tmp_path):
    """onNotBefore: approve, the window closed: a tick 4 s before NotBefore (inside the 5 s send margin) approves
    nothing; the event is left to expire."""
    policy = in_window("0 3 * * *", "1h", onNotBefore="approve", approveBeforeSeconds=60)
    coordinator, _, listener = build(policy, tmp_path)
    listener.down = True
    report(coordinator)  # 15 minutes before NotBefore: held by the window
    assert stored(coordinator).approval is None
    retried(coordinator, listener, after=timedelta(minutes=15) - timedelta(seconds=4))
    record = stored(coordinator)
    assert record.approval is None
    assert record.decision is not None
    assert "is too near to deliver an approval before it (sent only until 5 s before)" in record.decision.reason
    assert listener.requests == []
