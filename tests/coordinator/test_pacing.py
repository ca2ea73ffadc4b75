"""Rate and sequence budgets, pure: the policy's fields and what they refuse, the keys an event is paced by, what
holds it and until when, and the state a claim, a conclusion, a withdrawal or a lapse leaves (domain/pacing.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from coordinator.domain.claims import BudgetClaim, BudgetRecord
from coordinator.domain.controls import VmFacts
from coordinator.domain.evaluation import evaluate, paced_hold, same_decision
from coordinator.domain.fleet_view import FleetView
from coordinator.domain.model import DecisionRecord, EventRecord
from coordinator.domain.pacing import PaceDomain, claimed, pace_domains, pace_hold, released, settled
from coordinator.domain.policy import RateOption, SequenceOption
from coordinator.domain.policy_file import PolicyError, parse_policy

NOW = datetime(2026, 11, 26, 12, tzinfo=UTC)
POLICY = parse_policy(
    """
version: 1
rules:
  - name: reboots-zone-by-zone
    match: {eventType: [Reboot]}
    action: approve-now
    sequence: {per: zone, gapSeconds: 60}
  - name: freezes-paced
    match: {eventType: [Freeze]}
    action: approve-now
    rate: {maxApprovals: 2, periodSeconds: 600}
  - name: redeploys-per-zone
    match: {eventType: [Redeploy]}
    action: approve-now
    rate: {maxApprovals: 1, periodSeconds: 60, per: zone}
"""
)
FLEET = FleetView(
    vms={
        "a_0": VmFacts(scaleSet="a", location="westeurope", zone="1"),
        "a_1": VmFacts(scaleSet="a", location="westeurope", zone="1"),
        "b_0": VmFacts(scaleSet="b", location="westeurope", zone="2"),
        "r_0": VmFacts(scaleSet="r", location="westeurope"),
    }
)


def event(event_id: str, event_type: str, *vms: str) -> EventRecord:
    return EventRecord(
        eventId=event_id, eventType=event_type, resources=list(vms), stateSince=NOW, createdAt=NOW, durationInSeconds=-1
    )


def claim(event_id: str, at: datetime, *domains: str) -> BudgetClaim:
    return BudgetClaim(eventId=event_id, vms=[], claimedAt=at, domains=list(domains))


FREEZE = "{name: r, match: {eventType: [Freeze]}, action: "


def state(key: str, *claims: BudgetClaim, **fields: object) -> BudgetRecord:
    return BudgetRecord(scaleSet=key, claims={c.eventId: c for c in claims}, **fields)


RATE = PaceDomain(
    "rate:freezes-paced:fleet", "freezes-paced", frozenset({"a_0"}), rate=RateOption(maxApprovals=2, periodSeconds=600)
)
ZONE_2 = PaceDomain(
    "sequence:reboots-zone-by-zone:zone",
    "reboots-zone-by-zone",
    frozenset({"b_0"}),
    sequence=SequenceOption(per="zone", gapSeconds=60),
    domains=frozenset({"westeurope/2"}),
)


@pytest.mark.parametrize(
    ("rule", "error"),
    [
        (
            FREEZE + "wait-for-person, rate: {maxApprovals: 1, periodSeconds: 60}}",
            "a 'wait-for-person' rule makes none",
        ),
        ("{name: r, action: approve-now, sequence: {per: zone}}", "cannot pace Terminate events"),
        (
            "{name: r, match: {eventType: [Terminate]}, action: approve-now, sequence: {per: zone}}",
            "cannot pace Terminate events",
        ),
        (
            "{name: r, match: {eventType: [Freeze]}, action: approve-now, rate: {maxApprovals: 0, periodSeconds: 60}}",
            "maxApprovals",
        ),
        (
            FREEZE + "approve-now, rate: {maxApprovals: 1, periodSeconds: 86401}}",
            "periodSeconds",
        ),
        ("{name: r, match: {eventType: [Freeze]}, action: approve-now, sequence: {per: scaleSet}}", "sequence.per"),
    ],
)
def test_the_policy_refuses_pacing_that_cannot_hold(rule: str, error: str) -> None:
    with pytest.raises(PolicyError, match=error):
        parse_policy(f"version: 1\nrules:\n  - {rule}\n")


def test_a_sequence_or_a_rate_per_zone_reads_the_census_a_rate_per_fleet_does_not() -> None:
    assert POLICY.needs_census
    fleet_only = parse_policy(
        "version: 1\nrules:\n  - {name: r, match: {eventType: [Freeze]}, action: approve-now, "
        "rate: {maxApprovals: 1, periodSeconds: 60}}\n"
    )
    assert not fleet_only.needs_census


def test_the_keys_an_event_is_paced_by() -> None:
    reboot = event("e1", "Reboot", "a_0", "b_0", "r_0")
    [sequence] = pace_domains(POLICY, "reboots-zone-by-zone", reboot, FLEET)
    assert (sequence.key, sorted(sequence.domains)) == (
        "sequence:reboots-zone-by-zone:zone",
        ["westeurope/1", "westeurope/2"],  # the regional VM is in no zone: not counted
    )
    [rate] = pace_domains(POLICY, "freezes-paced", event("e2", "Freeze", "a_0", "a_1"), FLEET)
    assert (rate.key, sorted(rate.vms)) == ("rate:freezes-paced:fleet", ["a_0", "a_1"])
    per_zone = pace_domains(POLICY, "redeploys-per-zone", event("e3", "Redeploy", "a_0", "b_0", "r_0"), FLEET)
    assert [d.key for d in per_zone] == [
        "rate:redeploys-per-zone:zone:westeurope/1",
        "rate:redeploys-per-zone:zone:westeurope/2",
    ]
    assert pace_domains(POLICY, "reboots-zone-by-zone", event("e4", "Reboot", "r_0"), FLEET) == []
    assert pace_domains(POLICY, "no-such-rule", reboot, FLEET) == []


def test_a_rate_holds_the_third_approval_in_its_period_until_the_oldest_ages_out() -> None:
    first, second = NOW - timedelta(seconds=500), NOW - timedelta(seconds=100)
    two = state(RATE.key, claim("f1", first), claim("f2", second))
    hold = pace_hold(RATE, two, "f3", NOW)
    assert hold is not None
    assert hold.until == first + timedelta(seconds=600)
    assert "2 approvals by rule 'freezes-paced' in the last 600 s (at most 2)" in hold.reason
    assert pace_hold(RATE, two, "f3", first + timedelta(seconds=600)) is None  # f1 aged out: a slot
    assert pace_hold(RATE, two, "f2", NOW) is None  # an event's own claim is not counted against it
    # Three in the window (a claim raced in): room only once two of them aged out.
    three = state(RATE.key, claim("f1", first), claim("f2", second), claim("f0", NOW - timedelta(seconds=550)))
    hold = pace_hold(RATE, three, "f3", NOW)
    assert hold is not None
    assert hold.until == first + timedelta(seconds=600)


def test_a_rate_claim_drops_what_aged_out_and_a_conclusion_leaves_it_counting() -> None:
    old = state(RATE.key, claim("f0", NOW - timedelta(seconds=700)), claim("f1", NOW - timedelta(seconds=10)))
    after = claimed(RATE, old, "f2", NOW)
    assert sorted(after.claims) == ["f1", "f2"]
    assert after.periodSeconds == 600
    assert released(after, "f1", concluded_at=NOW) is None  # concluded: the approval still counts in the window
    withdrawn = released(after, "f1", concluded_at=None)
    assert withdrawn is not None
    assert sorted(withdrawn.claims) == ["f2"]  # never executed: its slot is free


def test_a_sequence_lets_the_domain_in_progress_go_on_and_holds_another_until_it_concludes() -> None:
    in_zone_1 = state(ZONE_2.key, claim("r1", NOW, "westeurope/1"))
    hold = pace_hold(ZONE_2, in_zone_1, "r2", NOW)
    assert hold is not None
    assert hold.until is None  # when zone 1 concludes is not known
    waits = "zone westeurope/1 in progress (r1 first, 1 in all); westeurope/2 waits until its events conclude, then 60"
    assert waits in hold.reason
    zone_1 = PaceDomain(
        ZONE_2.key, ZONE_2.rule, frozenset({"a_1"}), sequence=ZONE_2.sequence, domains=frozenset({"westeurope/1"})
    )
    assert pace_hold(zone_1, in_zone_1, "r3", NOW) is None  # the same zone goes on
    both = PaceDomain(
        ZONE_2.key,
        ZONE_2.rule,
        frozenset(),
        sequence=ZONE_2.sequence,
        domains=frozenset({"westeurope/1", "westeurope/2"}),
    )
    assert pace_hold(both, in_zone_1, "r4", NOW) is not None  # it would start zone 2 too
    assert pace_hold(both, None, "r4", NOW) is None  # nothing in progress: it goes, alone


def test_a_sequence_hold_names_the_first_event_that_took_the_domain_so_a_later_claim_leaves_it_the_same() -> None:
    # Held while zone 1 goes on, an event is decided again at each batch carrying its VMs; the hold is the same
    # decision (no event write, no Decision row) only if a later claim changes nothing but figures in its reason.
    taken = [claim("rx", NOW - timedelta(seconds=9), "westeurope/1"), claim("ry", NOW, "westeurope/1")]
    held = event("z", "Reboot", "b_0")
    approve = evaluate(POLICY, held, FLEET, NOW)
    before = pace_hold(ZONE_2, state(ZONE_2.key, *taken), "z", NOW)
    # Taken at the same time as ry, after it; its id sorts before every other.
    after = pace_hold(ZONE_2, state(ZONE_2.key, *taken, claim("a0", NOW, "westeurope/1")), "z", NOW)
    assert before is not None
    assert after is not None
    assert "in progress (rx first, 2 in all); " in before.reason
    assert "in progress (rx first, 3 in all); " in after.reason
    first = paced_hold(approve, held, before)
    recorded = DecisionRecord(
        decisionId="d1", rule=first.rule, action=first.action, verdict=first.verdict, reason=first.reason,
        decidedAt=NOW, holdKind=first.holdKind, holdName=first.holdName, heldUntil=first.heldUntil,
    )  # fmt: skip
    assert same_decision(recorded, paced_hold(approve, held, after), dry_run=False)
    # Once rx concludes, ry is the first: what holds it is named anew.
    rest = pace_hold(ZONE_2, state(ZONE_2.key, *taken[1:], claim("a0", NOW, "westeurope/1")), "z", NOW)
    assert rest is not None
    assert not same_decision(recorded, paced_hold(approve, held, rest), dry_run=False)


def test_a_sequence_waits_its_gap_after_the_last_domain_concluded() -> None:
    in_zone_1 = state(ZONE_2.key, claim("r1", NOW - timedelta(seconds=300), "westeurope/1"))
    done = released(in_zone_1, "r1", concluded_at=NOW)
    assert done is not None
    assert (done.claims, done.lastDomains, done.doneAt) == ({}, ["westeurope/1"], NOW)
    hold = pace_hold(ZONE_2, done, "r2", NOW + timedelta(seconds=30))
    assert hold is not None
    assert hold.until == NOW + timedelta(seconds=60)
    assert pace_hold(ZONE_2, done, "r2", NOW + timedelta(seconds=60)) is None
    zone_1 = PaceDomain(
        ZONE_2.key, ZONE_2.rule, frozenset(), sequence=ZONE_2.sequence, domains=frozenset({"westeurope/1"})
    )
    assert pace_hold(zone_1, done, "r3", NOW + timedelta(seconds=1)) is None  # the same zone again: no gap
    # A withdrawn approval never ran: no gap.
    withdrawn = released(in_zone_1, "r1", concluded_at=None)
    assert withdrawn is not None
    assert withdrawn.doneAt is None
    # Of two lapsed at once, the later conclusion starts the gap.
    two = state(ZONE_2.key, claim("r1", NOW, "westeurope/1"), claim("r5", NOW, "westeurope/3"))
    lapsed = settled(two, {"r1": NOW + timedelta(seconds=9), "r5": NOW + timedelta(seconds=5)})
    assert (lapsed.doneAt, lapsed.lastDomains) == (NOW + timedelta(seconds=9), ["westeurope/1"])


def test_evaluation_holds_an_approval_by_the_state_its_view_carries_and_names_the_budget() -> None:
    reboot = event("r2", "Reboot", "b_0").model_copy(update={"notBefore": NOW + timedelta(minutes=15)})
    free = evaluate(POLICY, reboot, FLEET, NOW)
    assert (free.verdict, free.holdKind) == ("approve", "")
    view = FleetView(vms=FLEET.vms, paced={ZONE_2.key: state(ZONE_2.key, claim("r1", NOW, "westeurope/1"))})
    held = evaluate(POLICY, reboot, view, NOW)
    assert (held.verdict, held.holdKind, held.holdName, held.heldUntil) == (
        "wait",
        "budget",
        "sequence:reboots-zone-by-zone:zone",
        None,
    )
    freeze = event("f3", "Freeze", "a_0").model_copy(update={"notBefore": NOW + timedelta(minutes=5)})
    full = FleetView(paced={RATE.key: state(RATE.key, claim("f1", NOW - timedelta(seconds=60)), claim("f2", NOW))})
    rated = evaluate(POLICY, freeze, full, NOW)
    assert (rated.verdict, rated.holdName, rated.heldUntil) == ("wait", RATE.key, NOW + timedelta(seconds=540))
    assert "left to expire" in rated.reason  # NotBefore (5 min) comes before the slot (9 min)
