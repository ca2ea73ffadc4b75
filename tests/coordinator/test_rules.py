"""Rules: pure, no I/O. The default policy mirrors the documented advice; errors name the line and the field."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from coordinator.domain.deletes import couple
from coordinator.domain.evaluation import Decision, evaluate, same_decision
from coordinator.domain.fleet_view import FleetView
from coordinator.domain.model import EventRecord, VmSighting
from coordinator.domain.policy import TimeWindow
from coordinator.domain.policy_file import DEFAULT_POLICY_PATH, PolicyError, load_policy, parse_policy
from tests.coordinator.helpers import decision_record

NOW = datetime(2026, 11, 18, 10, 0, tzinfo=UTC)  # a Wednesday


def record(**fields: object) -> EventRecord:
    base: dict[str, object] = {
        "eventId": "E1",
        "eventType": "Freeze",
        "eventSource": "Platform",
        "durationInSeconds": 5,
        "resources": ["web_1", "web_2"],
        "notBefore": NOW + timedelta(minutes=15),
        "stateSince": NOW,
        "createdAt": NOW,
    }
    base.update(fields)
    return EventRecord.model_validate(base)


def sighting(name: str, *, scale_set: str = "web", prepare: str | None = None) -> VmSighting:
    return VmSighting(
        name=name,
        vmId=name,
        resourceId=f"/vm/{name}",
        scaleSet=scale_set,
        firstSeen=NOW,
        lastSeen=NOW,
        lastSequence=1,
        status="Scheduled",
        hooks={"prepare": prepare} if prepare else {},
    )


@pytest.fixture(scope="module")
def default():
    return load_policy(DEFAULT_POLICY_PATH)


@pytest.mark.parametrize(
    ("fields", "rule", "verdict"),
    [
        ({"eventSource": "User", "eventType": "Reboot", "durationInSeconds": -1}, "user-initiated", "approve"),
        ({"eventType": "Freeze", "durationInSeconds": 5}, "short-freeze", "approve"),
        ({"eventType": "Freeze", "durationInSeconds": 8}, "short-freeze", "approve"),
        ({"eventType": "Freeze", "durationInSeconds": 9}, "everything-else-waits", "wait"),
        ({"eventType": "Freeze", "durationInSeconds": -1}, "everything-else-waits", "wait"),
        ({"eventType": "Reboot", "durationInSeconds": -1}, "everything-else-waits", "wait"),
        ({"eventType": "Redeploy"}, "everything-else-waits", "wait"),
        ({"eventType": "Preempt"}, "everything-else-waits", "wait"),
        ({"eventType": "SomethingNew"}, "everything-else-waits", "wait"),
        ({"eventType": "Terminate", "durationInSeconds": -1}, "terminate-after-prepare-hooks", "wait"),
        # A scale-in delete is user-initiated, and still drains first.
        ({"eventSource": "User", "eventType": "Terminate"}, "terminate-after-prepare-hooks", "wait"),
    ],
)
def test_default_policy_follows_the_documented_advice(default, fields, rule, verdict):
    decision = evaluate(default, record(**fields), FleetView(), NOW)
    assert (decision.rule, decision.verdict) == (rule, verdict)
    assert decision.reason


def test_terminate_waits_for_every_prepare_hook_then_approves(default):
    vms = {"web_1": sighting("web_1", prepare="succeeded"), "web_2": sighting("web_2", prepare="failed")}
    waiting = evaluate(default, record(eventType="Terminate", vms=vms), FleetView(), NOW)
    assert waiting.verdict == "wait"
    assert "web_2=failed" in waiting.reason
    vms["web_2"] = sighting("web_2", prepare="succeeded")
    ready = evaluate(default, record(eventType="Terminate", vms=vms), FleetView(), NOW)
    assert ready.verdict == "approve"


def test_hook_deadline_then_on_deadline_action(default):
    vms = {"web_1": sighting("web_1", prepare="succeeded")}  # web_2 never reported a hook
    event = record(eventType="Terminate", vms=vms)
    assert evaluate(default, event, FleetView(), NOW + timedelta(seconds=239)).verdict == "wait"
    late = evaluate(default, event, FleetView(), NOW + timedelta(seconds=240))
    assert late.verdict == "approve"
    assert "deadline" in late.reason
    waits = parse_policy(
        "rules:\n  - name: t\n    action: approve-after-hooks\n    hooks: {deadlineSeconds: 10, onDeadline: wait}\n"
    )
    assert evaluate(waits, event, FleetView(), NOW + timedelta(hours=1)).verdict == "wait"


def test_budget_counts_impacted_instances_per_scale_set():
    policy = parse_policy(
        "rules:\n  - name: two-at-a-time\n    match: {eventType: [Freeze, Reboot]}\n"
        "    action: approve-within-budget\n    budget: {maxImpacted: 2}\n"
    )
    one = record(resources=["web_1"], vms={"web_1": sighting("web_1")})
    assert evaluate(policy, one, FleetView(), NOW).verdict == "approve"
    busy = FleetView().with_event(record(eventId="E0", resources=["web_7"], vms={"web_7": sighting("web_7")}))
    assert evaluate(policy, one, busy, NOW).verdict == "approve"
    busier = busy.with_event(record(eventId="E2", resources=["web_8"], vms={"web_8": sighting("web_8")}))
    decision = evaluate(policy, one, busier, NOW)
    assert decision.verdict == "wait"
    assert "3 impacted" in decision.reason
    other_set = FleetView().with_event(
        record(
            eventId="E3",
            resources=["api_1", "api_2"],
            vms={n: sighting(n, scale_set="api") for n in ("api_1", "api_2")},
        )
    )
    assert evaluate(policy, one, other_set, NOW).verdict == "approve"


def test_patterns_windows_and_first_match_wins():
    policy = parse_policy(
        """
rules:
  - name: never-db
    match: {vmName: ["db-*"]}
    action: never-approve
  - name: business-hours-web
    match:
      scaleSet: ["web*"]
      window: {days: [Mon, Tue, Wed, Thu, Fri], hours: "08:00-18:00"}
    action: approve-now
  - name: rest
    action: wait-for-person
"""
    )
    web = record(vms={"web_1": sighting("web_1"), "web_2": sighting("web_2")})
    assert evaluate(policy, web, FleetView(), NOW).rule == "business-hours-web"
    saturday = datetime(2026, 11, 21, 10, 0, tzinfo=UTC)
    assert evaluate(policy, web, FleetView(), saturday).rule == "rest"
    assert evaluate(policy, web, FleetView(), NOW.replace(hour=18)).rule == "rest"
    db = record(resources=["db-1"])
    never = evaluate(policy, db, FleetView(), NOW)
    assert (never.rule, never.verdict) == ("never-db", "never")
    mixed = record(resources=["db-1", "web_1"])
    # vmName needs every affected VM to match, so 'never-db' does not; db-1 belongs to no scale set, and the only
    # scale set affected is web.
    assert evaluate(policy, mixed, FleetView(), NOW).rule == "business-hours-web"


def test_overnight_window_belongs_to_the_day_it_starts():
    window = TimeWindow(days=["Fri"], hours="22:00-06:00")
    assert window.contains(datetime(2026, 11, 20, 23, 0, tzinfo=UTC))  # Friday night
    assert window.contains(datetime(2026, 11, 21, 5, 59, tzinfo=UTC))  # early Saturday, still Friday's window
    assert not window.contains(datetime(2026, 11, 21, 23, 0, tzinfo=UTC))  # Saturday night
    assert not window.contains(datetime(2026, 11, 20, 5, 0, tzinfo=UTC))  # early Friday: Thursday's window


def test_no_rule_matched_waits_for_a_person():
    policy = parse_policy("rules:\n  - name: only-user\n    match: {eventSource: [User]}\n    action: approve-now\n")
    decision = evaluate(policy, record(), FleetView(), NOW)
    assert (decision.rule, decision.verdict) == ("(no rule matched)", "wait")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("rules:\n  - name: a\n    action: approve-sometimes\n", ["p.yaml:3: rules.0.action"]),
        (
            "rules:\n  - name: a\n    action: approve-now\n  - name: b\n    match:\n"
            "      durationSeconds: {min: 9, max: 1}\n    action: wait-for-person\n",
            ["p.yaml:6: rules.1.match.durationSeconds", "min 9 is greater than max 1"],
        ),
        (
            "rules:\n  - name: a\n    match: {evenType: [Freeze]}\n    action: approve-now\n",
            ["p.yaml:3: rules.0.match.evenType"],
        ),
        ("rules:\n  - name: a\n    action: approve-within-budget\n", ["p.yaml:2: rules.0", "budget"]),
        (
            "rules:\n  - name: a\n    action: approve-now\n  - name: a\n    action: approve-now\n",
            ["rules", "used twice"],
        ),
        ("rules:\n  - name: a\n    match: {window: {hours: '8-18'}}\n    action: approve-now\n", ["window.hours"]),
        ("rules: [\n", ["not valid YAML"]),
        ("- just a list\n", ["a policy is a mapping"]),
    ],
)
def test_invalid_policies_name_line_and_field(text, expected):
    with pytest.raises(PolicyError) as caught:
        parse_policy(text, source="p.yaml")
    for fragment in expected:
        assert fragment in str(caught.value)


def test_missing_policy_file_is_a_clear_error(tmp_path):
    with pytest.raises(PolicyError, match="cannot read policy file"):
        load_policy(tmp_path / "nope.yaml")


def test_a_budget_rule_cannot_decide_terminate_events():
    for match in ("", "    match: {eventType: [Reboot, Terminate]}\n"):
        with pytest.raises(PolicyError) as error:
            parse_policy(
                f"rules:\n  - name: b\n{match}    action: approve-within-budget\n    budget: {{maxImpacted: 1}}\n"
            )
        assert "cannot decide Terminate events" in str(error.value)
        assert "does not pace them" in str(error.value)


def test_a_ready_delete_waits_for_a_pending_sibling_and_names_it():
    later = NOW + timedelta(minutes=12)
    mine = record(eventId="T1", eventType="Terminate", resources=["web_1"], scaleSets=["web"])
    sibling = record(
        eventId="T2",
        eventType="Terminate",
        resources=["web_2"],
        scaleSets=["web"],
        notBefore=later,
        decision={
            "decisionId": "d",
            "rule": "r",
            "action": "approve-after-hooks",
            "verdict": "wait",
            "reason": "waiting for prepare hooks",
            "decidedAt": NOW,
        },
    )
    other_scale_set = record(eventId="T3", eventType="Terminate", resources=["api_1"], scaleSets=["api"])
    ready = Decision("r", "approve-after-hooks", "approve", "prepare hooks succeeded on all 1 VMs")
    held = couple(ready, mine, [mine, sibling, other_scale_set], NOW)
    assert (held.verdict, held.heldBy, held.heldByVm, held.heldUntil) == ("wait", "T2", "web_2", later)
    assert f"delete of web_2 (T2) is not ready (waiting for prepare hooks), pending until {later.isoformat()}" in (
        held.reason
    )
    # Once the sibling is ready (or held only by this one), both go.
    assert sibling.decision is not None
    ready_sibling = sibling.model_copy(
        update={"decision": sibling.decision.model_copy(update={"verdict": "wait", "heldBy": "T1"})}
    )
    assert couple(ready, mine, [mine, ready_sibling], NOW).verdict == "approve"
    # An expired sibling no longer holds it (the platform deletes it at NotBefore).
    assert couple(ready, mine, [mine, sibling], later).verdict == "approve"


def test_the_same_hold_with_other_figures_is_the_same_decision_what_holds_it_or_until_when_is_not():
    reason = "zone 'westeurope/1' would have 70 impacted instances (limit 68)"
    held = decision_record(reason=reason, holdKind="budget", holdName="zone:westeurope/1")  # rule "r", waiting

    def now(reason: str, **fields: object) -> Decision:
        base: dict[str, object] = {"holdKind": "budget", "holdName": "zone:westeurope/1"}
        return Decision("r", "approve-within-budget", "wait", reason, **{**base, **fields})  # type: ignore[arg-type]

    grown = "zone 'westeurope/1' would have 135 impacted instances (limit 66)"
    assert same_decision(held, now(grown), dry_run=False)
    assert not same_decision(held, now(grown), dry_run=True)
    assert not same_decision(held, now(grown, holdName="zone:westeurope/2"), dry_run=False)
    assert not same_decision(held, now(grown, heldUntil=NOW), dry_run=False)  # a rate's slot frees at another time
    assert not same_decision(held, now("zone 'westeurope/1' is not known to the census"), dry_run=False)
    hooks = decision_record(reason="waiting for prepare hooks: web_2=running", holdKind="hooks", holdName="web_2")
    failed = now("waiting for prepare hooks: web_2=failed (10-check)", holdKind="hooks", holdName="web_2")
    assert not same_decision(hooks, failed, dry_run=False)  # a hook now failed: words, not figures
