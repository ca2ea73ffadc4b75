"""The policy's fleet controls, pure: windows (time zones, DST), blackouts, NotBefore first, budgets per domain kind
(count and percent), tags (restrict only unless trusted), gates (passing, failing, erroring), and the hold each
decision names."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import yaml

from coordinator.domain.budgets import budget_domains
from coordinator.domain.controls import GateResult, Schedule, VmFacts, claim_entity, limit_for, parse_duration
from coordinator.domain.evaluation import evaluate
from coordinator.domain.fleet_view import FleetView
from coordinator.domain.model import EventRecord
from coordinator.domain.policy import BudgetOption, Policy
from coordinator.domain.policy_file import PolicyError, parse_policy
from tests.coordinator.helpers import decision_record

NOW = datetime(2026, 11, 18, 10, 0, tzinfo=UTC)  # a Wednesday, 11:00 in Oslo (CET)


def record(**fields: object) -> EventRecord:
    base: dict[str, object] = {
        "eventId": "E1",
        "eventType": "Reboot",
        "eventSource": "Platform",
        "resources": ["web_1"],
        "notBefore": NOW + timedelta(minutes=15),
        "stateSince": NOW,
        "createdAt": NOW,
    }
    base.update(fields)
    return EventRecord.model_validate(base)


def policy(rule: dict[str, Any], **top: Any) -> Policy:
    return parse_policy(yaml.safe_dump({"version": 1, **top, "rules": [rule]}))


APPROVE_REBOOTS: dict[str, Any] = {"name": "reboots", "match": {"eventType": ["Reboot"]}, "action": "approve-now"}


# --- windows -------------------------------------------------------------------------------------------------------


def test_a_window_in_a_time_zone_opens_at_local_wall_clock_time() -> None:
    # 11:00-13:00 Oslo time is 10:00-12:00 UTC in November (CET, UTC+1).
    window = Schedule(schedule="0 11 * * *", duration="2h", timeZone="Europe/Oslo")
    assert window.open_until(NOW) == datetime(2026, 11, 18, 12, 0, tzinfo=UTC)
    assert window.open_until(NOW - timedelta(minutes=1)) is None
    assert window.open_until(NOW + timedelta(hours=2)) is None
    assert window.next_open(NOW + timedelta(hours=2)) == datetime(2026, 11, 19, 10, 0, tzinfo=UTC)


def test_a_window_keeps_its_local_time_across_daylight_saving() -> None:
    window = Schedule(schedule="0 11 * * *", duration="1h", timeZone="Europe/Oslo")
    # Summer (CEST, UTC+2): 11:00 local is 09:00 UTC.
    summer = datetime(2026, 7, 1, 9, 30, tzinfo=UTC)
    assert window.open_until(summer) == datetime(2026, 7, 1, 10, 0, tzinfo=UTC)
    assert window.open_until(datetime(2026, 7, 1, 10, 30, tzinfo=UTC)) is None


def test_a_start_inside_the_spring_forward_gap_opens_after_the_gap() -> None:
    # 2026-03-29: Oslo skips 02:00-03:00. A 02:30 start opens at 03:00 CEST (01:00 UTC) that day.
    window = Schedule(schedule="30 2 * * *", duration="1h", timeZone="Europe/Oslo")
    before = datetime(2026, 3, 29, 0, 0, tzinfo=UTC)
    opens = window.next_open(before)
    assert opens.date() == before.date()
    assert window.open_until(opens) == opens + timedelta(hours=1)
    assert window.open_until(opens - timedelta(minutes=1)) is None


def test_a_start_in_the_repeated_autumn_hour_opens_once() -> None:
    # 2026-10-25: Oslo repeats 02:00-03:00. A 02:30 start opens once that day.
    window = Schedule(schedule="30 2 * * *", duration="30m", timeZone="Europe/Oslo")
    first = window.next_open(datetime(2026, 10, 24, 23, 0, tzinfo=UTC))
    second = window.next_open(first + timedelta(minutes=1))
    assert second - first >= timedelta(hours=23)


def test_a_rule_outside_its_window_holds_until_it_opens_and_approves_inside() -> None:
    rule = {**APPROVE_REBOOTS, "window": {"schedule": "0 22 * * *", "duration": "4h", "timeZone": "Europe/Oslo"}}
    held = evaluate(policy(rule), record(notBefore=NOW + timedelta(days=2)), FleetView(), NOW)
    assert (held.verdict, held.holdKind, held.holdName) == ("wait", "window", "reboots")
    assert held.heldUntil == datetime(2026, 11, 18, 21, 0, tzinfo=UTC)
    assert "next opens 2026-11-18T21:00:00+00:00" in held.reason
    inside = evaluate(policy(rule), record(notBefore=NOW + timedelta(days=2)), FleetView(), NOW + timedelta(hours=12))
    assert (inside.verdict, inside.holdKind) == ("approve", "")


def test_by_default_an_event_whose_notbefore_comes_first_is_left_to_expire_and_says_so() -> None:
    rule = {**APPROVE_REBOOTS, "window": {"schedule": "0 22 * * *", "duration": "4h"}}
    event = record(notBefore=NOW + timedelta(minutes=1))
    decision = evaluate(policy(rule), event, FleetView(), NOW)
    assert decision.verdict == "wait"
    assert "comes first: left to expire (onNotBefore: expire)" in decision.reason


def test_onnotbefore_approve_approves_at_the_deadline_and_not_before() -> None:
    rule = {**APPROVE_REBOOTS, "window": {"schedule": "0 22 * * *", "duration": "4h"}, "onNotBefore": "approve"}
    event = record(notBefore=NOW + timedelta(minutes=10))
    early = evaluate(policy(rule), event, FleetView(), NOW)
    assert early.verdict == "wait"
    at_deadline = evaluate(policy(rule), event, FleetView(), NOW + timedelta(minutes=8))
    assert at_deadline.verdict == "approve"
    assert "approved at the deadline (onNotBefore: approve)" in at_deadline.reason
    assert at_deadline.holdKind == "window"  # still says what held it until then


def test_todays_days_and_hours_window_still_matches() -> None:
    rule = {**APPROVE_REBOOTS, "match": {"eventType": ["Reboot"], "window": {"days": ["Wed"], "hours": "09:00-11:00"}}}
    assert evaluate(policy(rule), record(), FleetView(), NOW).verdict == "approve"
    assert evaluate(policy(rule), record(), FleetView(), NOW + timedelta(hours=2)).rule == "(no rule matched)"


@pytest.mark.parametrize(
    ("window", "error"),
    [
        ({"schedule": "0 25 * * *", "duration": "1h"}, "not a 5-field cron"),
        ({"schedule": "0 2 * * * *", "duration": "1h"}, "not a 5-field cron"),
        ({"schedule": "0 2 * * *", "duration": "8d"}, "at most 7 days"),
        ({"schedule": "0 2 * * *", "duration": "soon"}, "must look like"),
        ({"schedule": "0 2 * * *", "duration": "1h", "timeZone": "Mars/Olympus"}, "not an IANA time zone"),
        # Valid cron syntax naming no date: every decision asking the window when it opens raised, every tick.
        ({"schedule": "0 2 30 2 *", "duration": "1h"}, "never comes: no date has that day"),
        ({"schedule": "*/5 * 31 4,6,9,11 *", "duration": "1h"}, "never comes"),
    ],
)
def test_a_bad_window_is_refused_naming_the_line(window: dict[str, str], error: str) -> None:
    text = f"rules:\n  - name: r\n    action: approve-now\n    window: {window}\n"
    with pytest.raises(PolicyError, match=error) as caught:
        parse_policy(text)
    assert "<policy>:4: rules.0.window" in str(caught.value)


def test_a_schedule_that_comes_rarely_is_not_refused() -> None:
    leap = Schedule(schedule="0 2 29 2 *", duration="1h")  # every four years (eight across 2100)
    assert leap.next_open(NOW) == datetime(2028, 2, 29, 2, 0, tzinfo=UTC)
    either = Schedule(schedule="0 2 30 2 Mon", duration="1h")  # day and weekday both set: either one (cron's OR)
    assert either.next_open(NOW) == datetime(2027, 2, 1, 2, 0, tzinfo=UTC)  # a Monday of February
    blackout = {"name": "never", "schedule": "0 0 30 2 *", "duration": "1d"}
    with pytest.raises(PolicyError, match=r"<policy>:\d+: blackouts.0.schedule: .*never comes"):
        policy(APPROVE_REBOOTS, blackouts=[blackout])


def test_durations() -> None:
    assert parse_duration("1h30m") == timedelta(minutes=90)
    assert parse_duration("1d") == timedelta(days=1)


# --- blackouts -----------------------------------------------------------------------------------------------------

FREEZE = {"name": "year-end", "schedule": "0 0 18 11 *", "duration": "1d", "timeZone": "UTC"}


def test_a_blackout_holds_every_approval_until_it_ends() -> None:
    decision = evaluate(policy(APPROVE_REBOOTS, blackouts=[FREEZE]), record(), FleetView(), NOW)
    assert (decision.verdict, decision.holdKind, decision.holdName) == ("wait", "blackout", "year-end")
    assert decision.heldUntil == datetime(2026, 11, 19, 0, 0, tzinfo=UTC)
    assert "comes first: left to expire (blackout)" in decision.reason
    after = evaluate(policy(APPROVE_REBOOTS, blackouts=[FREEZE]), record(), FleetView(), NOW + timedelta(days=1))
    assert after.verdict == "approve"


def test_a_blackout_is_not_lifted_by_onnotbefore_approve() -> None:
    rule = {**APPROVE_REBOOTS, "onNotBefore": "approve"}
    late = evaluate(policy(rule, blackouts=[FREEZE]), record(notBefore=NOW + timedelta(seconds=30)), FleetView(), NOW)
    assert (late.verdict, late.holdKind) == ("wait", "blackout")


def test_a_blackout_does_not_turn_a_wait_into_anything_else() -> None:
    rule = {"name": "person", "action": "wait-for-person"}
    decision = evaluate(policy(rule, blackouts=[FREEZE]), record(), FleetView(), NOW)
    assert (decision.verdict, decision.holdKind) == ("wait", "")


# --- budgets -------------------------------------------------------------------------------------------------------


def facts(**fields: Any) -> VmFacts:
    return VmFacts(**{"scaleSet": "web", "location": "westeurope", **fields})


def budget_rule(**budget: Any) -> dict[str, Any]:
    return {"name": "paced", "match": {"eventType": ["Reboot"]}, "action": "approve-within-budget", "budget": budget}


@pytest.mark.parametrize(
    ("kind", "same", "other", "key"),
    [
        ("zone", {"zone": "1"}, {"zone": "2"}, "zone:westeurope/1"),
        ("faultDomain", {"faultDomain": "0"}, {"faultDomain": "1"}, "faultDomain:web/0"),
        ("updateDomain", {"updateDomain": "3"}, {"updateDomain": "4"}, "updateDomain:web/3"),
        ("placementGroup", {"placementGroup": "pg1"}, {"placementGroup": "pg2"}, "placementGroup:pg1"),
        ("scaleSet", {"scaleSet": "web"}, {"scaleSet": "api"}, "web"),
    ],
)
def test_a_count_budget_holds_per_domain_of_each_kind(
    kind: str, same: dict[str, str], other: dict[str, str], key: str
) -> None:
    rule = budget_rule(maxImpacted=1, per=[kind])
    vms = {"web_1": facts(**same), "web_2": facts(**same), "web_3": facts(**other)}
    busy_same = FleetView(vms=vms, impacted={"web": frozenset({"web_2"})}, impactedVms=frozenset({"web_2"}))
    held = evaluate(policy(rule), record(), busy_same, NOW)
    assert (held.verdict, held.holdKind, held.holdName) == ("wait", "budget", key)
    assert "would have 2 impacted instances (limit 1)" in held.reason
    if kind != "scaleSet":
        # The same VM impacted in another domain of that kind leaves this one's budget free.
        vms_other = {"web_1": facts(**same), "web_3": facts(**other)}
        busy_other = FleetView(vms=vms_other, impactedVms=frozenset({"web_3"}))
        assert evaluate(policy(rule), record(), busy_other, NOW).verdict == "approve"


def test_a_percent_budget_takes_its_size_from_the_known_vms_of_the_domain_rounded_up() -> None:
    rule = budget_rule(maxPercent=25, per=["zone"])
    vms = {f"web_{i}": facts(zone="1") for i in range(8)}  # 25% of 8 = 2
    one_busy = FleetView(vms=vms, impactedVms=frozenset({"web_5"}))
    assert evaluate(policy(rule), record(), one_busy, NOW).verdict == "approve"
    two_busy = FleetView(vms=vms, impactedVms=frozenset({"web_5", "web_6"}))
    held = evaluate(policy(rule), record(), two_busy, NOW)
    assert "zone 'westeurope/1' would have 3 impacted instances (limit 2)" in held.reason
    assert limit_for(max_impacted=None, max_percent=10, size=5) == 1
    assert limit_for(max_impacted=3, max_percent=50, size=10) == 3


# Percents an operator writes, among them those whose float is just above the decimal (64.4 is 64.400000000000006:
# 64.4% of 250 is 161 exactly, the float's ceil gave 162).
PERCENTS = [
    "64.4",
    "0.1",
    "0.01",
    "1",
    "2.5",
    "7",
    "10",
    "12.5",
    "14.3",
    "28.6",
    "33.3",
    "33.33",
    "50",
    "57.1",
    "66.67",
    "70.1",
    "80.5",
    "99.9",
    "99.99",
    "100",
]


def test_a_percent_budget_is_exact_for_every_fleet_size() -> None:
    """maxPercent as the policy file gives it (YAML reads it as a float), against the rule computed in fractions
    from the text the operator wrote: P% of the size, rounded up, never below 1."""
    assert limit_for(max_impacted=None, max_percent=Decimal("64.4"), size=250) == 161
    for text in PERCENTS:
        read = BudgetOption.model_validate(yaml.safe_load(f"maxPercent: {text}")).maxPercent
        exact = Fraction(text)
        for size in range(1, 10_001):
            expected = max(1, math.ceil(size * exact / 100))
            assert limit_for(max_impacted=None, max_percent=read, size=size) == expected, (text, size)


def test_a_percent_that_is_not_a_finite_number_is_refused() -> None:
    for value in (".nan", ".inf", "0", "100.01", "-5"):
        with pytest.raises(PolicyError, match="maxPercent"):
            policy(budget_rule(maxPercent=yaml.safe_load(value)))


def test_vms_without_a_domain_of_that_kind_are_not_lumped_together() -> None:
    rule = budget_rule(maxImpacted=1, per=["zone"])
    vms = {"web_1": facts(), "web_2": facts()}  # regional: no zone
    busy = FleetView(vms=vms, impactedVms=frozenset({"web_2"}))
    assert evaluate(policy(rule), record(), busy, NOW).verdict == "approve"
    assert budget_domains(policy(rule), "paced", record(), busy) == []


def test_every_kind_listed_counts() -> None:
    rule = budget_rule(maxImpacted=1, per=["scaleSet", "updateDomain"])
    vms = {"web_1": facts(updateDomain="0"), "api_1": facts(scaleSet="api", updateDomain="0")}
    domains = budget_domains(policy(rule), "paced", record(), FleetView(vms=vms))
    assert [d.claim_key for d in domains] == ["web", "updateDomain:web/0"]
    # A scale set's fault and update domains keep their claims in one entity of the scale set; others their own.
    assert [d.entity_key for d in domains] == ["web", "updateDomains:web"]
    assert claim_entity("faultDomain", "pg-1/2") == "faultDomains:pg-1"
    assert claim_entity("zone", "westeurope/1") == "zone:westeurope/1"
    assert claim_entity("placementGroup", "pg-1") == "placementGroup:pg-1"


def test_a_budget_may_not_decide_terminate_and_needs_a_limit() -> None:
    with pytest.raises(PolicyError, match="cannot decide Terminate"):
        policy({**budget_rule(maxImpacted=1), "match": {}})
    with pytest.raises(PolicyError, match="needs maxImpacted, maxPercent or both"):
        policy(budget_rule(per=["zone"]))


# --- tags ----------------------------------------------------------------------------------------------------------


def tagged(**tags: str) -> FleetView:
    return FleetView(vms={"web_1": facts(tags=tags), "web_2": facts()})


TAG_RULES: list[dict[str, Any]] = [
    {"name": "opted-out", "match": {"tags": {"scheduled-events": "manual"}}, "action": "wait-for-person"},
    APPROVE_REBOOTS,
]


def test_a_tag_asking_for_a_person_holds_the_whole_event_it_shares() -> None:
    text = yaml.safe_dump({"rules": TAG_RULES})
    event = record(resources=["web_1", "web_2"])
    asked = evaluate(parse_policy(text), event, tagged(**{"Scheduled-Events": "manual"}), NOW)
    assert (asked.rule, asked.verdict) == ("opted-out", "wait")
    assert evaluate(parse_policy(text), event, tagged(other="x"), NOW).rule == "reboots"


def test_a_tag_cannot_widen_what_the_untagged_vm_would_get() -> None:
    rules: list[dict[str, Any]] = [
        {"name": "fast-lane", "match": {"tags": {"fast": "*"}}, "action": "approve-now"},
        {"name": "person", "action": "wait-for-person"},
    ]
    decision = evaluate(parse_policy(yaml.safe_dump({"rules": rules})), record(), tagged(fast="yes"), NOW)
    assert (decision.rule, decision.verdict) == ("person", "wait")
    assert "tags may only restrict (trustTags: false)" in decision.reason
    rules[0]["trustTags"] = True
    trusted = evaluate(parse_policy(yaml.safe_dump({"rules": rules})), record(), tagged(fast="yes"), NOW)
    assert (trusted.rule, trusted.verdict) == ("fast-lane", "approve")


# --- gates ---------------------------------------------------------------------------------------------------------

GATES = {"app-health": {"http": {"url": "http://127.0.0.1:1/health"}}}


@pytest.mark.parametrize(
    ("result", "verdict"),
    [
        (GateResult("passing", "HTTP 200"), "approve"),
        (GateResult("failing", "HTTP 503"), "wait"),
        (GateResult("error", "ConnectionError"), "wait"),
        (None, "wait"),
    ],
)
def test_a_gate_approves_only_while_it_passes(result: GateResult | None, verdict: str) -> None:
    rule = {**APPROVE_REBOOTS, "gates": ["app-health"]}
    gates = {"app-health": result} if result is not None else {}
    decision = evaluate(policy(rule, gates=GATES), record(), FleetView(), NOW, gates=gates)
    assert decision.verdict == verdict
    if verdict == "wait":
        assert (decision.holdKind, decision.holdName) == ("gate", "app-health")
        assert "gate 'app-health' is" in decision.reason


def test_a_rule_naming_an_undefined_gate_is_refused() -> None:
    with pytest.raises(PolicyError, match="names gates \\['nope'\\]"):
        policy({**APPROVE_REBOOTS, "gates": ["nope"]})


def test_a_gate_is_exactly_one_kind() -> None:
    with pytest.raises(PolicyError, match="exactly one of http, alert, logQuery"):
        policy(APPROVE_REBOOTS, gates={"g": {}})


def test_inside_the_repeated_autumn_hour_the_first_start_s_window_is_the_one_open() -> None:
    window = Schedule(schedule="30 2 * * *", duration="90m", timeZone="Europe/Oslo")
    # First 02:30 (CEST) is 00:30 UTC; its 90 minutes end at 02:00 UTC, past the second 02:30 (01:30 UTC).
    assert window.open_until(datetime(2026, 10, 25, 1, 45, tzinfo=UTC)) == datetime(2026, 10, 25, 2, 0, tzinfo=UTC)


def test_a_freed_slot_goes_to_the_queued_event_closest_to_its_notbefore() -> None:
    rule = budget_rule(maxImpacted=1, per=["zone"])
    vms = {name: facts(zone="1") for name in ("web_1", "web_2", "web_3")}
    # web_2's event waits for budget and goes sooner than web_1's; the slot is free.
    sooner = (NOW + timedelta(minutes=5), "E-SOONER", frozenset({"web_2"}))
    fleet = FleetView(vms=vms, queued=(sooner,))
    held = evaluate(policy(rule), record(notBefore=NOW + timedelta(minutes=15)), fleet, NOW)
    assert (held.verdict, held.holdKind) == ("wait", "budget")
    # The queued event itself is not behind itself; an event sooner than every queued one goes first.
    assert evaluate(policy(rule), record(eventId="E-SOONER", resources=["web_2"]), fleet, NOW).verdict == "approve"
    soonest = record(eventId="E0", notBefore=NOW + timedelta(minutes=1))
    assert evaluate(policy(rule), soonest, fleet, NOW).verdict == "approve"


def test_the_policy_reference_example_in_the_docs_is_a_valid_policy() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "policy.md").read_text(encoding="utf-8")
    section = text[text.index("### Policy reference") :]
    start = section.index("```yaml") + len("```yaml")
    example = parse_policy(section[start : section.index("```", start)])
    assert [rule.name for rule in example.rules] == ["weekday-web", "freezes-paced", "terminate", "reboots-escalate"]
    assert [step.do for step in example.rules[3].escalate] == ["notify", "approve"]
    paced = example.rules[1]
    assert paced.rate is not None
    assert (paced.rate.maxApprovals, paced.rate.periodSeconds) == (2, 3600)
    assert paced.sequence is not None
    assert (paced.sequence.per, paced.sequence.gapSeconds) == ("zone", 600)
    assert set(example.gates) == {"app-health", "lb-ready", "no-cpu-alert", "no-errors"}


def test_a_card_names_what_held_the_event_since_and_until_when() -> None:
    from coordinator.domain.cards import build_card

    held = record()
    held.decision = decision_record(
        rule="reboots",
        reason="gate 'app-health' is failing (HTTP 503, expected [200])",
        decidedAt=NOW,
        holdKind="gate",
        holdName="app-health",
        holdSince=NOW - timedelta(minutes=3),
    )
    text = str(build_card("expired", held, now=NOW))
    assert "gate 'app-health' since 2026-11-18T09:57:00+00:00: gate 'app-health' is failing" in text


@pytest.mark.parametrize(
    ("kind", "where"),
    [
        ("zone", {"zone": "1"}),
        ("faultDomain", {"faultDomain": "2"}),
        ("updateDomain", {"updateDomain": "3"}),
        ("placementGroup", {"placementGroup": "pg1"}),
        ("scaleSet", {}),
    ],
)
def test_a_percent_budget_holds_per_domain_of_each_kind(kind: str, where: dict[str, str]) -> None:
    # 20% of 10 VMs in the domain: 2 at a time; 5 more VMs elsewhere do not count towards its size.
    rule = budget_rule(maxPercent=20, per=[kind])
    vms = {f"web_{i}": facts(**where) for i in range(1, 11)}
    vms |= {f"other_{i}": VmFacts(scaleSet="other", location="elsewhere") for i in range(5)}
    one = FleetView(vms=vms, impacted={"web": frozenset({"web_9"})}, impactedVms=frozenset({"web_9"}))
    assert evaluate(policy(rule), record(), one, NOW).verdict == "approve"
    two = FleetView(
        vms=vms, impacted={"web": frozenset({"web_9", "web_10"})}, impactedVms=frozenset({"web_9", "web_10"})
    )
    held = evaluate(policy(rule), record(), two, NOW)
    assert (held.verdict, held.holdKind) == ("wait", "budget")
    assert "would have 3 impacted instances (limit 2)" in held.reason


def test_a_failing_gate_with_onnotbefore_approve_approves_at_the_deadline() -> None:
    rule = {**APPROVE_REBOOTS, "gates": ["app-health"], "onNotBefore": "approve", "approveBeforeSeconds": 300}
    failing = {"app-health": GateResult("failing", "HTTP 503")}
    event = record(notBefore=NOW + timedelta(minutes=4))
    decision = evaluate(policy(rule, gates=GATES), event, FleetView(), NOW, gates=failing)
    assert (decision.verdict, decision.holdKind) == ("approve", "gate")
    assert "approved at the deadline" in decision.reason
