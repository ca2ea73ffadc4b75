"""Until when an approval may be executed (coordinator/domain/expiry.py), pure: the bound of each condition a rule's
approval rests on, the request's notAfter, when a request may still be sent; the "approve before NotBefore" timing,
over 200 generated cases played through the real rule, bound and listener checks; the policy's version."""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, timedelta

from contracts import wire
from contracts.approval import NOT_AFTER_TOLERANCE, ApprovalFacts, ApprovalRequest
from coordinator.domain.evaluation import evaluate
from coordinator.domain.expiry import (
    DELIVERY_TIME,
    SEND_MARGIN,
    TIMER_PERIOD,
    approval_bound,
    deadline_lead,
    person_bound,
    request_bound,
    sendable,
)
from coordinator.domain.fleet_view import FleetView
from coordinator.domain.policy_file import parse_policy
from coordinator.pipeline.run import APPROVAL_DEADLINE
from forwarder.approval_rules import Freshness, refuse_stale
from tests.coordinator.helpers import DOC_NOW, event_record

NOT_BEFORE = DOC_NOW + timedelta(minutes=15)  # 22:26:58; DOC_NOW is 22:11:58 UTC
CONTROLLED = """
blackouts: [{name: night, schedule: "15 22 * * *", duration: 1h}]
gates:
  app: {alert: {alertRuleId: "/subscriptions/s/resourceGroups/rg/providers/microsoft.insights/metricAlerts/a"}}
rules:
  - name: all
    match: {eventType: [Reboot]}
    action: approve-now
    window: {schedule: "0 22 * * *", duration: 20m}
    gates: [app]
"""


def at(hhmmss: str) -> datetime:
    return datetime.fromisoformat(f"2022-04-11T{hhmmss}+00:00")


def test_the_bound_is_the_earliest_of_the_conditions_the_approval_rests_on():
    record = event_record("E1", notBefore=NOT_BEFORE)
    policy = parse_policy(CONTROLLED)
    bound = approval_bound(policy, "all", record, DOC_NOW, at_deadline=False)
    assert bound is not None
    assert (bound.at, bound.why) == (DOC_NOW + timedelta(seconds=60), "the results of gates app are 60 s old")
    without_gates = parse_policy(CONTROLLED.replace("    gates: [app]\n", ""))
    assert approval_bound(without_gates, "all", record, DOC_NOW, at_deadline=False) == approval_bound(
        without_gates, "all", record, DOC_NOW, at_deadline=True
    )
    bound = approval_bound(without_gates, "all", record, DOC_NOW, at_deadline=False)
    assert bound is not None
    assert (bound.at, bound.why) == (at("22:15:00"), "blackout 'night' opens")
    # After the blackout's start (its next one is tomorrow): the window's end, then NotBefore.
    later = approval_bound(without_gates, "all", record, at("22:16:00"), at_deadline=False)
    assert later is not None
    assert (later.at, later.why) == (at("22:20:00"), "rule 'all''s window closes")
    # At the deadline the window and the gates held and NotBefore let the event go: they do not bound it.
    deadline = approval_bound(without_gates, "all", record, at("22:21:00"), at_deadline=True)
    assert deadline is not None
    assert (deadline.at, deadline.why) == (NOT_BEFORE, "the event's NotBefore")
    # A rule without controls and an event without NotBefore: nothing ends it but the delivery.
    plain = parse_policy("rules: [{name: all, action: approve-now}]")
    assert approval_bound(plain, "all", event_record("E2"), DOC_NOW, at_deadline=False) is None
    assert person_bound(record) == deadline
    assert person_bound(event_record("E2")) is None


def test_the_request_is_bounded_by_the_delivery_too_and_sent_only_before_the_listener_would_refuse_it():
    bound = approval_bound(parse_policy(CONTROLLED), "all", event_record("E1"), DOC_NOW, at_deadline=False)
    assert (
        request_bound(bound, DOC_NOW, timedelta(seconds=30), tolerance=NOT_AFTER_TOLERANCE).why
        == "the delivery's deadline, 30 s after sending"
    )
    assert request_bound(
        bound, DOC_NOW, timedelta(seconds=30), tolerance=NOT_AFTER_TOLERANCE
    ).at == DOC_NOW + timedelta(seconds=32)
    assert request_bound(bound, DOC_NOW, timedelta(seconds=90), tolerance=NOT_AFTER_TOLERANCE) == bound
    assert request_bound(None, DOC_NOW, timedelta(seconds=30), tolerance=NOT_AFTER_TOLERANCE).at == DOC_NOW + timedelta(
        seconds=32
    )
    assert sendable(DOC_NOW + timedelta(seconds=2.001), DOC_NOW, tolerance=NOT_AFTER_TOLERANCE)
    assert not sendable(DOC_NOW + NOT_AFTER_TOLERANCE, DOC_NOW, tolerance=NOT_AFTER_TOLERANCE)


def test_an_approval_at_the_deadline_is_decided_only_while_it_can_still_be_sent():
    held = "rules: [{name: night, action: approve-now, window: {schedule: '0 3 * * *', duration: 1h},"
    policy = parse_policy(held + " onNotBefore: approve, approveBeforeSeconds: 60}]")
    record = event_record("E1", notBefore=NOT_BEFORE)
    # approveBeforeSeconds 60 acts as 65: the deciding tick may come a minute late and must leave the send margin.
    assert deadline_lead(policy.rules[0]) == TIMER_PERIOD + SEND_MARGIN == timedelta(seconds=65)
    assert deadline_lead(parse_policy(held + " onNotBefore: approve}]").rules[0]) == timedelta(seconds=120)
    verdicts = {
        offset: evaluate(policy, record, FleetView(), NOT_BEFORE - timedelta(seconds=offset))
        for offset in (66, 65, 30, 5.001, 5, 1)
    }
    assert {o: (d.verdict, d.atDeadline) for o, d in verdicts.items()} == {
        66: ("wait", False),
        65: ("approve", True),
        30: ("approve", True),
        5.001: ("approve", True),
        5: ("wait", False),
        1: ("wait", False),
    }
    assert verdicts[30].reason.endswith(f"to be sent by {(NOT_BEFORE - SEND_MARGIN).isoformat()}")
    assert "too near to deliver an approval before it (sent only until 5 s before)" in verdicts[5].reason


def test_the_policy_version_changes_with_what_the_policy_says_not_how_it_is_written():
    policy = parse_policy(CONTROLLED)
    assert policy.fingerprint == parse_policy("# reformatted\n" + CONTROLLED.replace(": ", ":  ")).fingerprint
    assert len(policy.fingerprint) == 16
    assert policy.fingerprint != parse_policy(CONTROLLED.replace("20m", "21m")).fingerprint


# ------------------------------------------------------------------------------------- approve before NotBefore


@dataclass(frozen=True)
class Case:
    """One approval at the deadline as the timer would make it: when NotBefore is, the rule's approveBeforeSeconds,
    the timer's phase, and what the run and the delivery take, and the VM's clock error."""

    not_before: datetime
    approve_before: int
    phase: float  # seconds past the minute of the timer's ticks
    work: float  # from the tick's now to its deliver step
    delivery: float  # from the send to the listener's check
    skew: float  # the VM's clock minus the true time


@dataclass(frozen=True)
class Landing:
    sent: bool
    landed_at: datetime | None  # when IMDS got StartRequests (true time); None when nothing was executed


def play(case: Case) -> Landing:
    """The case through the real code, tick by tick until NotBefore: the rule (evaluate), the approval's bound
    (approval_bound), the request (request_bound) and its send (sendable) as plan.plan_delivery and the senders check
    them, and the listener's own check (refuse_stale) on the VM's clock. A refused or unsent approval is decided again
    at the next tick, as the timer's retry is."""
    policy = parse_policy(
        "rules: [{name: night, action: approve-now, window: {schedule: '0 3 * * *', duration: 1h},"
        f" onNotBefore: approve, approveBeforeSeconds: {case.approve_before}}}]"
    )
    record = event_record("E1", eventType="Freeze", notBefore=case.not_before)
    facts = ApprovalFacts(
        eventType="Freeze", eventSource="Platform", durationInSeconds=-1, notBefore=case.not_before, resources=["vm"]
    )
    start = case.not_before - timedelta(seconds=900) - TIMER_PERIOD  # before the longest lead (approveBefore 900)
    tick = start.replace(second=0, microsecond=0) + timedelta(seconds=case.phase)
    sent = False
    while tick < case.not_before:
        decision = evaluate(policy, record, FleetView(), tick, gates={})
        if decision.verdict == "approve":
            bound = approval_bound(policy, decision.rule, record, tick, at_deadline=decision.atDeadline)
            not_after = request_bound(bound, tick, APPROVAL_DEADLINE, tolerance=NOT_AFTER_TOLERANCE)
            send_at = tick + timedelta(seconds=case.work)
            if sendable(not_after.at, tick, tolerance=NOT_AFTER_TOLERANCE) and sendable(
                not_after.at, send_at, tolerance=NOT_AFTER_TOLERANCE
            ):
                sent = True
                request = ApprovalRequest(
                    eventId="E1",
                    decisionId="d",
                    rule=decision.rule,
                    issuedAt=tick,
                    expiresAt=not_after.at,
                    notAfter=not_after.at,
                    facts=facts,
                )
                arrival = send_at + timedelta(seconds=case.delivery)
                if (
                    refuse_stale(
                        wire.ApprovalRequest.from_mapping(request.model_dump()),
                        now=arrival + timedelta(seconds=case.skew),
                        freshness=Freshness(),
                    )
                    is None
                ):
                    return Landing(sent=True, landed_at=arrival)
        tick += TIMER_PERIOD
    return Landing(sent=sent, landed_at=None)


def cases(rng: random.Random, n: int, *, work: float, delivery: float) -> list[Case]:
    base = datetime.fromisoformat("2026-11-21T06:00:00+00:00")
    return [
        Case(
            not_before=base + timedelta(seconds=rng.uniform(0, 86_400)),
            approve_before=rng.choice([60, 60, 60, 61, 62, 64, 65, 70, 90, 120, 300, 900]),
            phase=rng.uniform(0, 60),
            work=rng.uniform(0, work),
            delivery=rng.uniform(0, delivery),
            skew=rng.uniform(-NOT_AFTER_TOLERANCE.total_seconds(), NOT_AFTER_TOLERANCE.total_seconds()),
        )
        for _ in range(n)
    ]


def test_every_approval_at_the_deadline_lands_before_not_before():
    """200 generated cases within the measured times (the tick's work up to 2.2 s and the delivery up to 0.8 s,
    together within DELIVERY_TIME; VM clocks within the tolerance): every one lands, and before NotBefore (it is
    decided at least SEND_MARGIN before, and reaches the listener within DELIVERY_TIME of that)."""
    assert timedelta(seconds=2.2 + 0.8) <= DELIVERY_TIME
    played = [(case, play(case)) for case in cases(random.Random(21), 200, work=2.2, delivery=0.8)]
    leads = [(case.not_before - landing.landed_at).total_seconds() for case, landing in played if landing.landed_at]
    assert len(leads) == 200
    assert min(leads) > 0
    print(f"figures: 200 approvals at the deadline, 200 landed, the least {min(leads):.2f} s before NotBefore")


def test_slower_than_measured_an_approval_at_the_deadline_is_not_sent_or_refused_never_late():
    """The same with runs and deliveries far slower than measured (up to 20 s and 5 s): some approvals are not sent or
    refused by the listener, none lands after NotBefore."""
    played = [(case, play(case)) for case in cases(random.Random(1), 200, work=20.0, delivery=5.0)]
    landed = [(case, landing.landed_at) for case, landing in played if landing.landed_at is not None]
    assert all(when < case.not_before for case, when in landed if when is not None)
    assert 0 < len(landed) < 200
    print(f"figures: slow runs: {len(landed)} of 200 landed before NotBefore, the rest not at all")
