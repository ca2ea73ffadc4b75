"""Escalation ladders (policy ``escalate``; coordinator/domain/escalation.py): each step taken once, by the first run
at or after its time, with a Decision row and a card; an approve step's approval executed by the VM only that near
NotBefore on its own clock; what the policy refuses."""

from __future__ import annotations

import dataclasses
import random
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from contracts import wire
from contracts.approval import ApprovalRequest, ApprovalResult
from contracts.envelope import VmIdentity
from coordinator.adapters.teams import FolderCardSink
from coordinator.domain.claims import BudgetClaim, BudgetRecord
from coordinator.domain.controls import VmFacts
from coordinator.domain.escalation import reached
from coordinator.domain.evaluation import evaluate
from coordinator.domain.fleet_view import FleetView
from coordinator.domain.model import EventRecord
from coordinator.domain.policy_file import PolicyError, parse_policy
from coordinator.service import Coordinator
from forwarder.approval_rules import Freshness, judge, refuse_stale
from tests.coordinator.conftest import Clock
from tests.coordinator.helpers import DOC_NOW, MemoryHistory, envelope, event_record, raw_message, scheduled_event, vm
from tests.coordinator.memory_store import MemoryStateStore
from tests.coordinator.runs import make_coordinator

EVENT = "E-LADDER"
# DOC_NOW is 22:11:58 UTC; the documented event's NotBefore 22:26:58, 900 s later.
NOT_BEFORE = DOC_NOW + timedelta(seconds=900)
LADDER = """
rules:
  - name: reboots-wait
    match: {eventType: [Reboot]}
    action: wait-for-person
    escalate:
      - {beforeNotBeforeSeconds: 600, do: notify, owner: sre-oncall, ownerTag: owner}
      - {beforeNotBeforeSeconds: 300, do: notify, owner: platform-lead}
      - {beforeNotBeforeSeconds: 120, do: approve}
"""


class Listener:
    """web_0's listener with the VM's own rules (``judge``) on the document the VM sees, at the test's clock."""

    def __init__(self, clock: Clock, document: dict[str, Any]) -> None:
        self.clock = clock
        self.document = wire.ScheduledEventsDocument.from_mapping(document)
        self.answers: list[tuple[str, str]] = []
        self.requests: list[ApprovalRequest] = []

    def send(self, request: ApprovalRequest, *, vm: VmIdentity) -> ApprovalResult:
        self.requests.append(request)
        wired = wire.ApprovalRequest.from_mapping(request.model_dump())
        stale = refuse_stale(wired, now=self.clock(), freshness=Freshness())
        outcome, reason = (
            ("rejected", stale) if stale else judge(wired, self.document, vm_name=vm.name, now=self.clock())
        )
        self.answers.append((outcome, reason))
        return ApprovalResult(outcome=outcome, eventId=request.eventId, decisionId=request.decisionId, reason=reason)


def reboot() -> dict[str, Any]:
    return scheduled_event(EVENT, event_type="Reboot", resources=["web_0"], duration=-1)


def build(policy: str, tmp: Path) -> tuple[Coordinator, MemoryHistory, Listener, Clock]:
    clock = Clock(DOC_NOW)
    history = MemoryHistory()
    listener = Listener(clock, {"DocumentIncarnation": 2, "Events": [reboot()]})
    coordinator = make_coordinator(
        store=MemoryStateStore(),
        history=history,
        alerts=FolderCardSink(tmp / "cards"),
        callback=listener,
        policy=parse_policy(policy),
        clock=clock,
        rng=random.Random(38),
    )
    report(coordinator, clock)
    return coordinator, history, listener, clock


def report(coordinator: Coordinator, clock: Clock) -> None:
    """web_0 reports its document (the Reboot) at the clock's time, as its forwarder does each minute."""
    identity = vm("web_0", scale_set="web", index=1)
    sequence = int((clock.now - DOC_NOW).total_seconds()) + 1
    data = envelope(identity, sequence=sequence, incarnation=2, events=[reboot()], observed_at=clock.now)
    coordinator.process_batch([raw_message(identity, data)])


def stored(coordinator: Coordinator) -> EventRecord:
    event = coordinator.event(EVENT)
    assert event is not None
    return event.record


def steps_in_rows(history: MemoryHistory) -> list[tuple[int, str]]:
    return [
        (step["step"], step["do"])
        for row in history.rows
        if row.RecordType == "Decision" and row.Details
        for step in row.Details.get("escalation", [])
    ]


def tick_at(coordinator: Coordinator, clock: Clock, seconds_before: float) -> None:
    clock.now = NOT_BEFORE - timedelta(seconds=seconds_before)
    report(coordinator, clock)
    coordinator.tick()


def test_each_step_is_taken_once_at_its_time_with_a_row_and_a_card_and_the_last_approves(tmp_path):
    coordinator, history, listener, clock = build(LADDER, tmp_path)
    assert stored(coordinator).escalation == []
    tick_at(coordinator, clock, 601)  # one second before the first step: nothing yet
    assert steps_in_rows(history) == []
    tick_at(coordinator, clock, 600)
    tick_at(coordinator, clock, 540)  # the same step again: not taken twice
    assert steps_in_rows(history) == [(1, "notify")]
    record = stored(coordinator)
    assert [(s.step, s.owners) for s in record.escalation] == [(1, ["sre-oncall"])]  # no ARM census: no tag read
    assert record.decision is not None
    assert "escalation step 1 of 3 (notify, 600 s before NotBefore): tell sre-oncall" in record.decision.reason
    tick_at(coordinator, clock, 250)
    assert steps_in_rows(history) == [(1, "notify"), (2, "notify")]
    assert record.approval is None
    assert listener.answers == []
    tick_at(coordinator, clock, 100)
    assert steps_in_rows(history) == [(1, "notify"), (2, "notify"), (3, "approve")]
    record = stored(coordinator)
    assert record.state == "Approved"
    assert listener.answers == [("approved", "")]
    assert record.approval is not None
    assert record.approval.nearNotBeforeSeconds == 120
    cards = sorted(p.name for p in (tmp_path / "cards").iterdir())
    for step in (1, 2):
        assert sum(f"escalation-{step}" in name for name in cards) == 1, cards
    # The last step approves: its alert and the approval's are one card, the approval's, naming the step.
    assert not any("escalation-3" in name for name in cards), cards
    approved = next(p for p in (tmp_path / "cards").iterdir() if p.name.endswith("-approved.json")).read_text()
    assert "Also since the last card: Escalation step 3 of 3: approve" in approved


def test_steps_reached_together_are_taken_in_one_decision(tmp_path):
    """A notice shorter than the ladder (first seen 900 s before NotBefore, steps at 1,200 and 1,000 s): the first
    two steps at once, by the batch that brought the event."""
    coordinator, history, _, clock = build(LADDER.replace("600", "1200").replace("300", "1000"), tmp_path)
    tick_at(coordinator, clock, 850)
    taken = [r.Details.get("escalation") for r in history.rows if r.RecordType == "Decision" and r.Details]
    assert [[step["step"] for step in steps] for steps in taken if steps] == [[1, 2]]


def test_the_vm_executes_an_escalations_approval_only_that_near_not_before_on_its_own_clock(tmp_path):
    """The request the approve step sent, judged by the VM's own rules at other times on the VM's clock: refused
    while NotBefore is further than the step's 120 s (and the 2 min skew), executed once it is that near."""
    coordinator, _, listener, clock = build(LADDER, tmp_path)
    tick_at(coordinator, clock, 100)
    assert listener.answers == [("approved", "")]
    wired = wire.ApprovalRequest.from_mapping(listener.requests[0].model_dump())
    early = judge(wired, listener.document, vm_name="web_0", now=NOT_BEFORE - timedelta(seconds=241))
    assert early == (
        "rejected",
        "the decision rested on NotBefore being within 120 s, and it is 241 s away on this VM's clock",
    )
    assert judge(wired, listener.document, vm_name="web_0", now=NOT_BEFORE - timedelta(seconds=239)) == ("approved", "")
    assert judge(wired, listener.document, vm_name="web_0")[0] == "rejected"  # no clock: nothing to check it with


def test_a_blackout_still_approves_nothing_at_the_approve_step():
    policy = parse_policy(
        LADDER
        + """
blackouts:
  - {name: freeze-week, schedule: "0 22 * * *", duration: 2h}
"""
    )
    record = event_record(EVENT, resources=["web_0"], notBefore=NOT_BEFORE)
    decision = evaluate(policy, record, FleetView(), NOT_BEFORE - timedelta(seconds=100))
    assert decision.verdict == "wait"
    assert "not approved, blackout 'freeze-week' holds it" in decision.reason


def test_the_owner_is_read_from_arms_tags_only():
    policy = parse_policy(LADDER)
    rule = policy.rules[0]
    record = event_record(EVENT, resources=["web_0"], notBefore=NOT_BEFORE)
    facts = {"web_0": VmFacts(scaleSet="web", tags={"Owner": "team-web"})}
    at = NOT_BEFORE - timedelta(seconds=500)
    assert reached(rule, record, FleetView(vms=facts, authoritative=True), at)[0].owners == ("team-web",)
    assert reached(rule, record, FleetView(vms=facts), at)[0].owners == ("sre-oncall",)  # the VM's word: not read


@pytest.mark.parametrize(
    ("ladder", "said"),
    [
        ("[{beforeNotBeforeSeconds: 300, do: notify, owner: a}, {beforeNotBeforeSeconds: 600, do: approve}]", "order"),
        ("[{beforeNotBeforeSeconds: 600, do: approve}, {beforeNotBeforeSeconds: 300, do: notify, owner: a}]", "ends"),
        ("[{beforeNotBeforeSeconds: 600, do: notify}]", "needs 'owner' or 'ownerTag'"),
        ("[{beforeNotBeforeSeconds: 30, do: approve}]", "greater than or equal to 60"),
        ("[{beforeNotBeforeSeconds: 600, do: hold, owner: a}]", "tells no one"),
    ],
)
def test_a_ladder_the_policy_refuses(ladder: str, said: str):
    with pytest.raises(PolicyError, match=said):
        parse_policy(f"rules:\n  - {{name: r, action: wait-for-person, escalate: {ladder}}}\n")


def test_an_approve_step_may_not_pass_a_budget():
    rule = (
        "{name: r, match: {eventType: [Reboot]}, action: approve-within-budget, budget: {maxImpacted: 1}, "
        "escalate: [{beforeNotBeforeSeconds: 600, do: approve}]}"
    )
    with pytest.raises(PolicyError, match="approve past the rule's budget"):
        parse_policy(f"rules:\n  - {rule}\n")
    parse_policy(f"rules:\n  - {rule.replace('do: approve', 'do: hold')}\n")


def test_a_step_is_not_reached_after_the_event_left_scheduled():
    rule = parse_policy(LADDER).rules[0]
    record = EventRecord(
        eventId=EVENT, eventType="Reboot", state="Started", notBefore=NOT_BEFORE, stateSince=DOC_NOW, createdAt=DOC_NOW
    )
    assert reached(rule, record, FleetView(), NOT_BEFORE) == ()
    never = datetime.max.replace(tzinfo=NOT_BEFORE.tzinfo)
    assert reached(rule, record.model_copy(update={"state": "Scheduled", "notBefore": None}), FleetView(), never) == ()


def test_a_dry_run_takes_each_step_as_a_row_and_tells_no_one(tmp_path):
    coordinator, history, listener, clock = build("dryRun: true\n" + LADDER, tmp_path)
    for seconds in (600, 250, 100):
        tick_at(coordinator, clock, seconds)
    assert steps_in_rows(history) == [(1, "notify"), (2, "notify"), (3, "approve")]
    assert all(row.DryRun for row in history.rows if row.RecordType == "Decision")
    assert listener.requests == []
    assert not [p.name for p in (tmp_path / "cards").glob("*escalation*")]


def test_a_tag_rule_may_not_widen_through_its_ladder():
    """A rule matched by a VM's own tag whose ladder ends in approve goes further than the plain rule that waits:
    with trustTags false the plain rule decides, and nothing is approved at the step's time."""
    policy = parse_policy(
        """
rules:
  - name: tagged
    match: {eventType: [Reboot], tags: {team: web}}
    action: wait-for-person
    escalate: [{beforeNotBeforeSeconds: 120, do: approve}]
  - {name: plain, action: wait-for-person}
"""
    )
    record = event_record(EVENT, resources=["web_0"], notBefore=NOT_BEFORE)
    tagged = FleetView(vms={"web_0": VmFacts(scaleSet="web", tags={"team": "web"})})
    decision = evaluate(policy, record, tagged, NOT_BEFORE - timedelta(seconds=100))
    assert (decision.rule, decision.verdict) == ("plain", "wait")
    assert "would approve more than rule 'plain'" in decision.reason


def test_a_rate_hold_still_takes_the_ladders_steps():
    """A rule paced by a rate whose count is spent holds the event; its ladder's notify step is reached all the
    same (the coordinator takes it: a row and a card)."""
    policy = parse_policy(
        """
rules:
  - name: paced
    match: {eventType: [Reboot]}
    action: approve-now
    rate: {maxApprovals: 1, periodSeconds: 3600}
    escalate: [{beforeNotBeforeSeconds: 600, do: notify, owner: sre}]
"""
    )
    record = event_record(EVENT, resources=["web_0"], notBefore=NOT_BEFORE)
    spent = BudgetRecord(
        scaleSet="rate:paced:fleet",
        periodSeconds=3600,
        claims={"E-OTHER": BudgetClaim(eventId="E-OTHER", vms=["web_1"], claimedAt=DOC_NOW)},
    )
    decision = evaluate(policy, record, FleetView(paced={spent.scaleSet: spent}), NOT_BEFORE - timedelta(seconds=500))
    assert (decision.verdict, decision.holdKind) == ("wait", "budget")
    assert [rung.step for rung in decision.escalation] == [1]


FORCE = LADDER.replace("do: approve}", "do: force, hook: drain-force}")


class ForcingListener(Listener):
    """web_0's listener as the forwarder answers a force request: judged as any request, then "accepted" while its
    force hook runs (forwarder/approver.py; the VM then starts the event itself)."""

    def send(self, request: ApprovalRequest, *, vm: VmIdentity) -> ApprovalResult:
        result = super().send(request, vm=vm)
        if result.outcome != "approved" or request.facts is None or not request.facts.forceHook:
            return result
        self.answers[-1] = ("accepted", "force hook running")
        return result.model_copy(update={"outcome": "accepted", "reason": "force hook drain-force running"})


def test_a_force_step_sends_the_hook_to_run_and_an_accepted_request_stays_open_not_sent_again(tmp_path: Path) -> None:
    coordinator, history, _listener, clock = build(FORCE, tmp_path)
    forcing = ForcingListener(clock, {"DocumentIncarnation": 2, "Events": [reboot()]})
    coordinator.parts = dataclasses.replace(coordinator.parts, callback=forcing)
    clock.now = NOT_BEFORE - timedelta(seconds=120)
    report(coordinator, clock)
    coordinator.tick()
    [request] = forcing.requests
    assert request.facts is not None
    assert (request.facts.forceHook, request.facts.nearNotBeforeSeconds) == ("drain-force", 120)
    # Valid while the hook runs: up to NotBefore less the send margin, not the delivery's few seconds.
    assert request.deadline >= NOT_BEFORE - timedelta(seconds=10)
    record = stored(coordinator)
    assert record.approval is not None
    approval = record.approval
    assert (approval.outcome, approval.forceHook, record.state) == ("accepted", "drain-force", "Scheduled")
    assert record.openRequest is not None
    assert (record.openRequest.executor, record.openRequest.until) == ("web_0", request.deadline)
    assert steps_in_rows(history)[-1] == (3, "force")
    clock.now += timedelta(seconds=60)
    report(coordinator, clock)
    coordinator.tick()
    assert len(forcing.requests) == 1  # the VM runs its hook: nothing is sent again meanwhile


@pytest.mark.parametrize(
    ("step", "said"),
    [
        ("{beforeNotBeforeSeconds: 600, do: force}", "a 'force' step names its 'hook'"),
        ("{beforeNotBeforeSeconds: 600, do: approve, hook: x}", "a 'force' step names its 'hook'"),
        ("{beforeNotBeforeSeconds: 1200, do: force, hook: x}", "at most 900 s before NotBefore"),
        ("{beforeNotBeforeSeconds: 600, do: force, hook: 'rm -rf'}", "hook"),
    ],
)
def test_a_force_step_names_a_hook_the_vm_can_hold_and_comes_late_enough(step: str, said: str) -> None:
    text = f"rules:\n  - name: r\n    action: wait-for-person\n    escalate:\n      - {step}\n"
    with pytest.raises(PolicyError, match=said):
        parse_policy(text)
