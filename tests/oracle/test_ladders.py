"""Escalation ladders under the oracle (pure, fast): an ``approve`` last step allows (and makes due) an approval from
its time, no blackout open, until the send margin; each step's Decision row judged early (wrong), late, twice
(duplicate) or missing (missed); the generator gives ladders whose steps fall inside the run."""

from __future__ import annotations

import json
from typing import Any

import pytest

from coordinator import parse_policy
from oracle.check import check
from oracle.collect import ladder_steps
from oracle.generate import TIME_SCALE, generate
from oracle.truth import Event, HistoryStep, LadderStep, Outage, Span, Truth
from oracle.verdict import Report
from tests.oracle.test_check import approval, at, due, event, kinds, truth

POLICY = """
version: 1
rules:
  - name: reboots-escalate
    match: {eventType: [Reboot]}
    action: wait-for-person
    escalate:
      - {beforeNotBeforeSeconds: 80, do: notify, owner: sre-oncall}
      - {beforeNotBeforeSeconds: 60, do: approve}
  - name: redeploys-hold
    match: {eventType: [Redeploy]}
    action: wait-for-person
    escalate:
      - {beforeNotBeforeSeconds: 80, do: notify, owner: dba-oncall}
      - {beforeNotBeforeSeconds: 60, do: hold}
  - name: everything-else-waits
    action: wait-for-person
"""
# NotBefore at +100 s: the notify step's time is +20 s, the approve (or hold) step's +40 s.
STEPS = {1: ("notify", 80, 20.0), 2: ("approve", 60, 40.0)}


def row(target: Event, offset: float, *steps: int, rule: str = "reboots-escalate", decision: str = "") -> HistoryStep:
    """The Decision row of a decision at ``offset`` that took ``steps`` of its rule's ladder."""
    last = "hold" if rule == "redeploys-hold" else "approve"
    taken = []
    for step in steps:
        do, lead, time = STEPS[step]
        taken.append(
            LadderStep(step=step, of=2, do=do if step == 1 else last, beforeNotBeforeSeconds=lead, at=at(time))
        )
    outcome = "approve" if 2 in steps and last == "approve" else "wait"
    return HistoryStep(
        at=at(offset),
        kind="Decision",
        eventId=target.eventId,
        outcome=outcome,
        rule=rule,
        decisionId=decision or f"d{offset}",
        escalation=taken,
    )


def judged(events: list[Event], approvals: list[Any], history: list[HistoryStep], **fields: Any) -> Report:
    made: Truth = truth(events, approvals, policy=fields.pop("policy", POLICY), history=history, **fields)
    return check(made.model_copy(update={"ended": at(120)}))


def reboot(started: float = 41, reason: str = "approval") -> Event:
    return event("r", "Reboot", ["web_0"], 1, 100, started=started, reason=reason)


def details(report: Report) -> list[tuple[str, str]]:
    return [(f.kind, f.detail) for f in report.findings]


def test_a_ladder_climbed_in_time_and_its_approval_made_anyway_is_no_finding() -> None:
    target = reboot()
    report = judged([target], [approval(target, 41)], [row(target, 20.5, 1), row(target, 40.5, 2)])
    assert report.findings == []
    # Due like any approval: the policy surely allows it from the approve step's time, +40 s.
    assert due(report, "r") == pytest.approx(45.0)


def test_an_approval_before_the_approve_step_is_wrong_and_one_never_made_is_missed() -> None:
    early = reboot(started=30)
    report = judged([early], [approval(early, 30)], [row(early, 20.5, 1), row(early, 29.5, 1, 2)])
    wrong = next(detail for kind, detail in details(report) if kind == "wrong" and "StartRequests" in detail)
    assert "does not approve (wait-for-person) (its escalation ladder approves only from +40.0s to +95.0s)" in wrong
    # The step the approval rested on was also taken 10.5 s before its time.
    assert any("escalation step 2 of 2" in d and "before its time +40.0s" in d for k, d in details(report))
    never = reboot(started=100, reason="notBefore")
    report = judged([never], [], [row(never, 20.5, 1), row(never, 40.5, 2)])
    assert kinds(report) == ["missed"]
    assert "due at +45.0s" in report.findings[0].detail


def test_a_ladder_that_holds_approves_nothing() -> None:
    held = event("h", "Redeploy", ["web_0"], 1, 100, started=41, reason="approval")
    rows = [row(held, 20.5, 1, rule="redeploys-hold"), row(held, 40.5, 2, rule="redeploys-hold")]
    assert kinds(judged([held], [approval(held, 41)], rows)) == ["wrong"]
    unapproved = event("h", "Redeploy", ["web_0"], 1, 100)
    assert judged([unapproved], [], rows).findings == []


def test_an_open_blackout_or_the_send_margin_leaves_nothing_to_approve() -> None:
    blackout = POLICY.replace("rules:", "blackouts: [{name: b, schedule: '* * * * *', duration: 1m}]\nrules:", 1)
    target = reboot()
    rows = [row(target, 20.5, 1), row(target, 40.5, 2)]
    assert kinds(judged([target], [approval(target, 41)], rows, policy=blackout)) == ["wrong"]
    # The steps are still taken under a blackout; nothing is due.
    unapproved = reboot(started=100, reason="notBefore")
    assert judged([unapproved], [], rows, policy=blackout).findings == []
    # A short notice: both steps reached at first sight, the approval allowed only until 5 s before NotBefore.
    short = event("s", "Reboot", ["web_0"], 1, 16, started=2, reason="approval")
    first = HistoryStep(
        at=at(1.5),
        kind="Decision",
        eventId=short.eventId,
        outcome="approve",
        rule="reboots-escalate",
        decisionId="d1",
        escalation=[
            LadderStep(step=1, of=2, do="notify", beforeNotBeforeSeconds=80, at=at(-64)),
            LadderStep(step=2, of=2, do="approve", beforeNotBeforeSeconds=60, at=at(-44)),
        ],
    )
    assert judged([short], [approval(short, 2)], [first]).findings == []
    too_near = event("s", "Reboot", ["web_0"], 1, 16, started=15, reason="approval")
    # (and late: it was due 5 s after the event was seen)
    assert kinds(judged([too_near], [approval(too_near, 15)], [first])) == ["wrong", "late"]


def test_an_approval_sent_before_the_send_margin_may_wait_for_its_paused_executor() -> None:
    """Seed 31: sent 0.1 s before the send margin (NotBefore - 5 s) to web_0, whose forwarder a Freeze paused; its
    listener executed it once the process ran again, 3.7 s later: not wrong. Not paused, that delay is wrong."""
    target = reboot(started=98.5, reason="approval")
    rows = [row(target, 20.5, 1), row(target, 40.5, 2)]
    assert kinds(judged([target], [approval(target, 98.5)], rows)) == ["wrong", "late"]
    paused = {"web_0": [Span(begin=at(-10), end=at(94)), Span(begin=at(96))]}
    for vm in ("web_1", "web_2"):
        paused[vm] = [Span(begin=at(-10))]
    assert kinds(judged([target], [approval(target, 98.5)], rows, forwarderRuns=paused)) == ["late"]
    # Killed, not paused: no listener held the request.
    killed = judged([target], [approval(target, 98.5)], rows, forwarderRuns=paused, kills={"web_0": [at(94)]})
    assert kinds(killed) == ["wrong", "late"]


@pytest.mark.parametrize(
    ("rows", "kind", "says"),
    [
        # Taken 5 s before its time (+20 s): wrong.
        (lambda e: [row(e, 15, 1), row(e, 40.5, 2)], "wrong", "5.0 s before its time +20.0s"),
        # Due at +26 s (its time, a timer period and the latency), taken at +30 s: late.
        (lambda e: [row(e, 30, 1), row(e, 40.5, 2)], "late", "due at +26.0s, taken at +30.0s (4.0 s late)"),
        # Taken by two decisions: duplicate.
        (lambda e: [row(e, 20.5, 1), row(e, 21, 1), row(e, 40.5, 2)], "duplicate", "taken again at +21.0s"),
        # Never taken while the event waited: missed.
        (lambda e: [row(e, 40.5, 2)], "missed", "escalation step 1 of 2 (notify, 80 s before NotBefore) at +20.0s"),
        # A step the rule's ladder does not have (another lead): wrong.
        (lambda e: [row(e, 20.5, 1, rule="everything-else-waits"), row(e, 40.5, 2)], "wrong", "whose ladder is []"),
    ],
    ids=["early", "late", "twice", "missed", "not-in-ladder"],
)
def test_each_step_is_taken_once_not_early_and_in_time(rows: Any, kind: str, says: str) -> None:
    target = reboot()
    report = judged([target], [approval(target, 41)], rows(target))
    assert kinds(report) == [kind]
    assert "escalation step 1 of 2" in report.findings[0].detail
    assert says in report.findings[0].detail


def test_a_row_written_twice_is_one_decision_and_faults_or_an_approval_excuse_a_step() -> None:
    target = reboot()
    twice = [row(target, 20.5, 1, decision="same"), row(target, 20.5, 1, decision="same"), row(target, 40.5, 2)]
    assert judged([target], [approval(target, 41)], twice).findings == []
    # A storage stall over the step's time: not late, and not missed either while it lasts.
    stall = [Outage(service="storage", span=Span(begin=at(18), end=at(22)))]
    late = [row(target, 33, 1), row(target, 40.5, 2)]
    assert judged([target], [approval(target, 41)], late, outages=stall).findings == []
    # Approved (by a person, say) before the first step's time: no step is due after it.
    approved = event("r", "Reboot", ["web_0"], 1, 100, started=10, reason="approval")
    report = judged([approved], [approval(approved, 10)], [])
    assert [f.detail for f in report.findings if f.detail.startswith("escalation")] == []


def test_a_decision_rows_details_give_its_steps() -> None:
    text = json.dumps(
        {
            "escalation": [
                {"step": 1, "of": 2, "do": "notify", "beforeNotBeforeSeconds": 80, "at": "2026-11-26T12:00:20+00:00"},
                {"step": "bad"},
            ]
        }
    )
    (step,) = ladder_steps(text)
    assert (step.step, step.do, step.at) == (1, "notify", at(20))
    assert ladder_steps(None) == []
    assert ladder_steps("not json") == []


def test_generated_ladders_are_valid_and_their_steps_fall_inside_the_run() -> None:
    laddered = 0
    for seed in range(60):
        plan = generate(seed)
        policy = parse_policy(plan.policy, source=f"seed {seed}")  # every generated ladder is one the policy takes
        rules = [rule for rule in policy.rules if rule.escalate]
        if not rules:
            continue
        laddered += 1
        (rule,) = rules
        leads = [step.beforeNotBeforeSeconds for step in rule.escalate]
        assert all(60 <= lead <= 604800 for lead in leads)
        assert not (rule.escalate[-1].do == "approve" and (rule.budget or rule.match.tags))
        notices = [
            step["create"]["NoticeSeconds"] / TIME_SCALE
            for step in plan.scenario_data["steps"]
            if step.get("create", {}).get("NoticeSeconds", 0) > 1500
        ]
        # A long notice passes one of the ladder's leads by 6-20 s: that step comes inside the run.
        assert all(any(0 < notice - lead <= 20 for lead in leads) for notice in notices)
        assert plan.timeout >= max(notices, default=0.0)
    assert laddered >= 20
