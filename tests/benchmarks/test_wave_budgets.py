"""benchmarks.wave_budgets: each budget wave's policy loads and decides the wave's events by its budget rule, and the
check of a budget wave fails for a domain over its limit, an event held while its budget had room, or two zones of
a sequence at once."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from benchmarks.wave_budgets import BUDGETS, RULE, budget_problems
from benchmarks.wave_fleet import fleet_scenario, vm_name
from coordinator import EventRecord, FleetView, VmFacts, evaluate, parse_policy

SPECS = {spec.name: spec for spec in fleet_scenario(200, 20).vms}  # 10 groups: zones 1,2,3 by group
# Group g's event reaches its VMs 0-4, as benchmarks/wave_fleet.build_wave's.
EVENTS = {f"E{g}": [vm_name(g, i) for i in range(5)] for g in range(10)}


def states(approved: set[int]) -> dict[str, str]:
    return {f"E{g}": "Approved" if g in approved else "Scheduled" for g in range(10)}


@pytest.mark.parametrize("kind", sorted(BUDGETS))
def test_each_budget_policy_loads_and_its_rule_approves_the_waves_first_event(kind: str) -> None:
    census = {
        name: VmFacts(
            scaleSet=spec.vmScaleSetName,
            zone=spec.zone,
            location=spec.location,
            faultDomain=spec.platformFaultDomain,
            updateDomain=spec.platformUpdateDomain,
            placementGroup=spec.placementGroupId,
            tags=spec.tags,
        )
        for name, spec in SPECS.items()
    }
    now = datetime(2026, 11, 20, 1, tzinfo=UTC)
    record = EventRecord(
        eventId="E0", eventType="Reboot", resources=EVENTS["E0"], notBefore=now + timedelta(minutes=15),
        stateSince=now, createdAt=now,
    )  # fmt: skip

    decision = evaluate(parse_policy(BUDGETS[kind].policy), record, FleetView(vms=census, authoritative=True), now)

    assert (decision.rule, decision.action, decision.verdict) == (RULE, BUDGETS[kind].action, "approve")


def test_a_zone_budget_spent_exactly_holds_the_rest_without_a_problem() -> None:
    # Zone 1 is groups 0, 3, 6, 9 (80 VMs: 10 % is 8, one event of 5); zones 2 and 3 have 60 (6: one event).
    assert budget_problems("budget-zone", SPECS, EVENTS, states({0, 1, 2})) == []


def test_a_domain_over_its_limit_is_a_problem() -> None:
    found = budget_problems("budget-zone", SPECS, EVENTS, states({0, 3, 1, 2}))

    assert found == ["budget-zone: domain '1' has 10 impacted (limit 8)"]


def test_an_event_held_while_its_budget_had_room_is_a_problem() -> None:
    found = budget_problems("budget-zone", SPECS, EVENTS, states({0, 1}))

    assert found == [f"budget-zone: {e} held though its budget had room" for e in ("E2", "E5", "E8")]


def test_a_wave_that_approved_nothing_is_a_problem() -> None:
    assert budget_problems("budget-tags", SPECS, EVENTS, states(set())) == [
        "budget-tags: no event approved (the budget decided nothing)"
    ]


def test_a_sequence_in_two_zones_at_once_or_holding_its_own_zone_is_a_problem() -> None:
    assert budget_problems("budget-sequence", SPECS, EVENTS, states({0, 3, 6, 9})) == []
    assert budget_problems("budget-sequence", SPECS, EVENTS, states({0, 1})) == [
        "budget-sequence: events approved in 2 zones at once (['1', '2'])",
        "budget-sequence: E3 held in the zone under way",
        "budget-sequence: E4 held in the zone under way",
        "budget-sequence: E6 held in the zone under way",
        "budget-sequence: E7 held in the zone under way",
        "budget-sequence: E9 held in the zone under way",
    ]


def test_the_rate_counts_approvals_not_vms() -> None:
    limit = BUDGETS["budget-rate"].limit(0)

    assert budget_problems("budget-rate", SPECS, EVENTS, states(set(range(10)))) == []  # 10 of 100
    assert limit == 100
