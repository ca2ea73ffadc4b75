"""The oracle's checker on hand-made truths (pure, fast): each class of finding is named when the truth shows it and
not otherwise; what the oracle leaves open (faults, dead executors, forged envelopes) is neither missed nor wrong."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from oracle.allowed import _limit
from oracle.calendar import cron_periods, utc_window_spans
from oracle.check import check
from oracle.collect import platform_facts
from oracle.intervals import Intervals, seconds
from oracle.truth import (
    Approval,
    Event,
    Forgery,
    GateChange,
    Hook,
    Incarnation,
    ListenerFault,
    Observation,
    Options,
    Outage,
    Span,
    Transition,
    Truth,
    Vm,
)
from oracle.verdict import Bounds, Report

T0 = datetime(2026, 11, 26, 12, 0, 0, tzinfo=UTC)
POLICY = """
version: 1
gates:
  health: {http: {url: "http://local-gates/health", timeoutSeconds: 3}}
rules:
  - name: manual-by-tag
    match: {tags: {scheduled-events: manual}}
    action: approve-now
  - name: short-freeze
    match: {eventType: [Freeze], durationSeconds: {min: 0, max: 8}}
    action: approve-now
  - name: terminate-after-hooks
    match: {eventType: [Terminate]}
    action: approve-after-hooks
    hooks: {deadlineSeconds: 240, onDeadline: approve, noHooks: wait}
  - name: one-per-zone
    match: {eventType: [Reboot]}
    action: approve-within-budget
    budget: {maxImpacted: 1, per: [zone]}
  - name: gated-redeploy
    match: {eventType: [Redeploy]}
    action: approve-now
    gates: [health]
  - name: everything-else-waits
    action: wait-for-person
"""


def at(offset: float) -> datetime:
    return T0 + timedelta(seconds=offset)


def event(
    ref: str,
    kind: str,
    resources: list[str],
    created: float,
    not_before: float,
    *,
    started: float | None = None,
    reason: str = "notBefore",
    duration: int = 5,
    viewers: list[str] | None = None,
) -> Event:
    started = not_before if started is None else started
    return Event(
        eventId=f"{ref.upper():0<8}-0000-4000-8000-000000000000",
        ref=ref,
        eventType=kind,
        eventSource="Platform",
        durationInSeconds=duration,
        resources=resources,
        viewers=viewers or resources,
        notBefore=at(not_before),
        transitions=[
            Transition(at=at(created), state="Scheduled", reason="created"),
            Transition(at=at(started), state="Started", reason=reason),
            Transition(at=at(started + 5), state="Completed", reason="impact over"),
        ],
    )


def approval(target: Event, offset: float, vm: str = "web_0") -> Approval:
    return Approval(eventId=target.eventId, vm=vm, at=at(offset))


def fleet(**changes: Any) -> list[Vm]:
    vms = {
        "web_0": Vm(name="web_0", scaleSet="web", location="westeurope", zone="1"),
        "web_1": Vm(name="web_1", scaleSet="web", location="westeurope", zone="1"),
        "web_2": Vm(name="web_2", scaleSet="web", location="westeurope", zone="2"),
    }
    for name, vm in changes.items():
        vms[name] = vm
    return list(vms.values())


def truth(events: list[Event], approvals: list[Approval], **fields: Any) -> Truth:
    vms = fields.pop("vms", fleet())
    return Truth(
        scenario="hand-made",
        started=T0,
        ended=at(60),
        policy=fields.pop("policy", POLICY),
        options=Options(timeScale=120),
        vms=vms,
        events=events,
        approvals=approvals,
        incarnations=fields.pop("incarnations", []),
        forwarderRuns=fields.pop("forwarderRuns", {vm.name: [Span(begin=at(-10))] for vm in vms}),
        **fields,
    )


def kinds(report: Report) -> list[str]:
    return [finding.kind for finding in report.findings]


def due(report: Report, ref: str) -> float | None:
    verdict = next(v for v in report.verdicts if v.label == ref)
    return None if verdict.due is None else verdict.due - seconds(T0)


def test_an_approval_the_policy_allows_made_in_time_is_no_finding() -> None:
    freeze = event("f", "Freeze", ["web_0"], 1, 16, started=2, reason="approval")
    report = check(truth([freeze], [approval(freeze, 2)]))
    assert report.findings == []
    assert due(report, "f") == pytest.approx(1 + Bounds().latency)


def test_an_approval_no_rule_allows_is_wrong_and_says_which_rule_waits() -> None:
    long_freeze = event("long", "Freeze", ["web_0"], 1, 16, duration=30, started=3, reason="approval")
    report = check(truth([long_freeze], [approval(long_freeze, 3)]))
    assert kinds(report) == ["wrong"]
    assert "everything-else-waits" in report.findings[0].detail
    assert "never allowed" in report.findings[0].detail


def test_a_due_approval_never_made_is_missed_and_one_made_after_its_due_time_is_late() -> None:
    missed = event("missed", "Freeze", ["web_0"], 1, 16)
    late = event("late", "Freeze", ["web_1"], 1, 16, started=12, reason="approval")
    report = check(truth([missed, late], [approval(late, 12, vm="web_1")]))
    assert sorted(kinds(report)) == ["late", "missed"]
    assert "due at +6.0s" in next(f.detail for f in report.findings if f.kind == "missed")
    assert "6.0 s late" in next(f.detail for f in report.findings if f.kind == "late")


def test_two_startrequests_for_one_event_are_a_duplicate() -> None:
    freeze = event("f", "Freeze", ["web_0", "web_1"], 1, 16, started=2, reason="approval")
    report = check(truth([freeze], [approval(freeze, 2), approval(freeze, 2.5, vm="web_1")]))
    assert kinds(report) == ["duplicate"]
    assert "through web_1" in report.findings[0].detail


def test_a_gate_that_fails_makes_a_later_approval_wrong_and_an_earlier_one_right() -> None:
    gates = [
        GateChange(at=at(-10), name="health", state="passing"),
        GateChange(at=at(10), name="health", state="failing"),
    ]
    early = event("early", "Redeploy", ["web_0"], 1, 30, started=2, reason="approval")
    late = event("late", "Redeploy", ["web_1"], 9, 30, started=20, reason="approval")
    report = check(truth([early, late], [approval(early, 2), approval(late, 20, vm="web_1")], gates=gates))
    assert [(f.kind, f.label) for f in report.findings] == [("wrong", "late")]
    assert "gate 'health' is not passing" in report.findings[0].detail


def test_a_gate_the_local_pages_do_not_serve_is_either_way() -> None:
    gated = event("g", "Redeploy", ["web_0"], 1, 30, started=2, reason="approval")
    unapproved = event("u", "Redeploy", ["web_1"], 1, 30)
    assert check(truth([gated, unapproved], [approval(gated, 2)])).findings == []


def test_a_delete_is_allowed_only_once_its_hooks_succeeded_or_its_deadline_passed() -> None:
    vms = fleet(
        web_1=Vm(name="web_1", scaleSet="web", prepare=[Hook(name="10-check", exitCode=1)]),
        web_2=Vm(name="web_2", scaleSet="api", prepare=[Hook(name="10-drain", exitCode=0, seconds=4)]),
    )
    failing = event("failing", "Terminate", ["web_1"], 1, 20, started=3, reason="approval")
    slow = event("slow", "Terminate", ["web_2"], 1, 20, started=2, reason="approval")
    report = check(truth([failing, slow], [approval(failing, 3, vm="web_1"), approval(slow, 2, vm="web_2")], vms=vms))
    details = {f.label: f.detail for f in report.findings}
    assert set(details) == {"failing", "slow"}
    assert "web_1's prepare phase failed" in details["failing"]
    assert "web_2's hooks not done" in details["slow"]


def test_a_budget_surely_exceeded_is_wrong_and_taking_turns_is_right() -> None:
    first = event("first", "Reboot", ["web_0"], 1, 40, started=2, reason="approval")
    # web_1 shares zone 1: approved while the first reboot is Started (approved 4 s before: surely decided first).
    overlapping = event("second", "Reboot", ["web_1"], 1, 40, started=6, reason="approval")
    # web_2 is in zone 2: its own slot.
    other_zone = event("third", "Reboot", ["web_2"], 1, 40, started=3, reason="approval")
    approvals = [approval(first, 2), approval(overlapping, 6, vm="web_1"), approval(other_zone, 3, vm="web_2")]
    report = check(truth([first, overlapping, other_zone], approvals))
    assert [(f.kind, f.label) for f in report.findings] == [("wrong", "second")]
    assert "budget zone 'westeurope/1': 2 impacted (limit 1)" in report.findings[0].detail
    after = event("second", "Reboot", ["web_1"], 1, 40, started=9, reason="approval")  # the first ended at 7
    assert check(truth([first, after], [approval(first, 2), approval(after, 9, vm="web_1")])).findings == []


def test_percent_budgets_are_computed_exactly() -> None:
    # 64.4 % of 250 is 161 exactly; in floating point 250 * 64.4 / 100 is 161.00000000000003, whose ceiling is 162.
    assert _limit(None, 64.4, 250) == 161
    assert _limit(None, 10, 5) == 1
    assert _limit(2, 50, 10) == 2


def test_a_tag_rule_may_not_widen_what_the_untagged_rule_allows() -> None:
    vms = fleet(web_0=Vm(name="web_0", scaleSet="web", tags={"scheduled-events": "manual"}))
    long_freeze = event("long", "Freeze", ["web_0"], 1, 16, duration=30, started=2, reason="approval")
    report = check(truth([long_freeze], [approval(long_freeze, 2)], vms=vms))
    assert kinds(report) == ["wrong"]
    assert "may not widen" in report.findings[0].detail


@pytest.mark.parametrize(
    ("blackout", "wrong"),
    [
        ({"schedule": "* * * * *", "duration": "1m"}, True),  # open every minute: always
        ({"schedule": "0 0 1 1 *", "duration": "1m"}, False),  # 1 January only
    ],
)
def test_an_open_blackout_allows_nothing(blackout: dict[str, str], wrong: bool) -> None:
    policy = POLICY.replace(
        "rules:", f"blackouts: [{{name: b, schedule: '{blackout['schedule']}', duration: 1m}}]\nrules:"
    )
    freeze = event("f", "Freeze", ["web_0"], 1, 16, started=2, reason="approval")
    report = check(truth([freeze], [approval(freeze, 2)], policy=policy))
    assert kinds(report) == (["wrong"] if wrong else [])


def test_a_closed_window_lets_approve_on_not_before_approve_before_not_before() -> None:
    window = "window: {schedule: '0 0 1 1 *', duration: 1m}\n    onNotBefore: "
    rule = "    action: approve-now\n  - name: terminate-after-hooks"
    freeze = event("f", "Freeze", ["web_0"], 1, 16, started=2, reason="approval")
    expire = POLICY.replace(rule, f"    action: approve-now\n    {window}expire\n  - name: terminate-after-hooks", 1)
    approve = POLICY.replace(rule, f"    action: approve-now\n    {window}approve\n  - name: terminate-after-hooks", 1)
    assert kinds(check(truth([freeze], [approval(freeze, 2)], policy=expire))) == ["wrong"]
    # NotBefore is 15 s away, less than approveBeforeSeconds (120): the deadline has passed at once.
    assert check(truth([freeze], [approval(freeze, 2)], policy=approve)).findings == []


def test_faults_on_the_path_and_dead_executors_leave_an_approval_either_way() -> None:
    outage = event("outage", "Freeze", ["web_0"], 1, 16)
    dead = event("dead", "Freeze", ["web_1"], 1, 16)
    forged = event("forged", "Freeze", ["web_2"], 1, 16)
    report = check(
        truth(
            [outage, dead, forged],
            [],
            outages=[Outage(service="eventhubs", span=Span(begin=at(2), end=at(4)))],
            listenerFaults=[ListenerFault(vm="web_1", span=Span(begin=at(0)), dead=True)],
            forgeries=[Forgery(at=at(2), by="web_0", about="web_2", kind="gone", events=[])],
            vms=fleet(web_0=Vm(name="web_0", scaleSet="web", location="westeurope", zone="3")),
        )
    )
    assert report.findings == []
    assert [due(report, ref) for ref in ("outage", "dead", "forged")] == [None, None, None]


def test_a_dead_listener_is_no_excuse_when_another_vm_that_sees_the_event_can_execute_it() -> None:
    shared = event("shared", "Freeze", ["web_0"], 1, 16, viewers=["web_0", "web_1"])
    faults = [ListenerFault(vm="web_0", span=Span(begin=at(0)), dead=True)]
    assert kinds(check(truth([shared], [], listenerFaults=faults))) == ["missed"]


def test_a_slow_listener_left_alone_when_the_quick_one_dies_delays_what_is_due() -> None:
    """Seed 114: web_1's listener died 0.5 s after the Freeze appeared, and web_0's answers 25 s late; the approval,
    valid a few seconds, can be executed by neither in time. Judged by the quick one's delay it was due at +6 s."""
    shared = event("shared", "Freeze", ["web_0"], 1, 16, viewers=["web_0", "web_1"])
    faults = [
        ListenerFault(vm="web_0", span=Span(begin=at(1)), delaySeconds=25.0),
        ListenerFault(vm="web_1", span=Span(begin=at(1.5)), dead=True),
    ]
    report = check(truth([shared], [], listenerFaults=faults))
    assert report.findings == []
    assert due(report, "shared") is None
    # The quick listener alive throughout: due at its own latency, whatever the slow one adds.
    alive = [faults[0]]
    assert kinds(check(truth([shared], [], listenerFaults=alive))) == ["missed"]


def test_a_terminate_is_due_only_once_every_pending_delete_of_its_scale_set_is_ready() -> None:
    vms = fleet(web_1=Vm(name="web_1", scaleSet="web", prepare=[Hook(name="10-check", exitCode=1)]))
    ready = event("ready", "Terminate", ["web_0"], 1, 20)
    failing = event("failing", "Terminate", ["web_1"], 1, 20)
    report = check(truth([ready, failing], [], vms=vms))
    assert report.findings == []
    assert due(report, "ready") is None


def incarnation(vm: str, number: int, served: float, listed: list[tuple[str, str]]) -> Incarnation:
    return Incarnation(
        vm=vm,
        incarnation=number,
        serial=number,
        at=at(served - 0.5),
        listed=listed,
        gone=[],
        firstServed=at(served),
        lastServed=at(served + 3),
    )


def test_a_document_a_forwarder_read_without_a_history_row_is_lost() -> None:
    freeze = event("f", "Freeze", ["web_0"], 1, 16, started=2, reason="approval")
    listed = [(freeze.eventId, "Scheduled")]
    read = [incarnation("web_0", 2, 1.5, listed), incarnation("web_1", 2, 1.5, listed)]
    rows = [Observation(vm="web_0", incarnation=2, eventId=freeze.eventId, status="Scheduled")]
    report = check(truth([freeze], [approval(freeze, 2)], incarnations=read, observations=rows))
    assert [(f.kind, f.label) for f in report.findings] == [("lost", "web_1")]
    assert report.checked_incarnations == 2


def test_a_document_read_just_before_the_vm_was_removed_or_wiped_need_not_reach_the_history() -> None:
    freeze = event("f", "Freeze", ["web_0"], 1, 16, started=2, reason="approval")
    listed = [(freeze.eventId, "Scheduled")]
    read = [incarnation("web_0", 2, 1.5, listed), incarnation("web_1", 2, 1.5, listed)]
    report = check(
        truth(
            [freeze],
            [approval(freeze, 2)],
            incarnations=read,
            permanentKills={"web_0": [at(2.0)]},
            wipes={"web_1": [at(2.5)]},
        )
    )
    assert report.findings == []
    assert report.checked_incarnations == 0


def test_the_platform_log_becomes_runs_kills_outages_and_listener_faults() -> None:
    log: list[dict[str, Any]] = [
        {"at": at(0).isoformat(), "action": "forwarder-start", "vm": "web_0"},
        {"at": at(1).isoformat(), "action": "forwarder-start", "vm": "web_1"},
        {"at": at(5).isoformat(), "action": "forwarder-kill", "vm": "web_0", "reason": "signal"},
        {"at": at(6).isoformat(), "action": "outage-begin", "service": "relay"},
        {"at": at(7).isoformat(), "action": "forwarder-start", "vm": "web_0"},
        {"at": at(8).isoformat(), "action": "listener", "vm": "web_1", "delaySeconds": 3.0, "dead": False},
        {"at": at(9).isoformat(), "action": "outage-end", "service": "relay"},
        {"at": at(10).isoformat(), "action": "forwarder-kill", "vm": "web_1", "reason": "removed"},
    ]
    facts = platform_facts(log)
    assert facts.runs["web_0"] == [Span(begin=at(0), end=at(5)), Span(begin=at(7))]
    assert facts.runs["web_1"] == [Span(begin=at(1), end=at(10))]
    assert facts.kills == {"web_0": [at(5)], "web_1": [at(10)]}
    assert facts.permanent_kills == {"web_1": [at(10)]}
    assert facts.outages == [Outage(service="relay", span=Span(begin=at(6), end=at(9)))]
    assert facts.listener_faults == [ListenerFault(vm="web_1", span=Span(begin=at(8)), delaySeconds=3.0)]


def test_intervals_and_calendars() -> None:
    a = Intervals.of([(0, 5), (3, 8), (10, 12)])
    assert list(a.spans) == [(0, 8), (10, 12)]
    assert list((a - Intervals(((4, 11),))).spans) == [(0, 4), (11, 12)]
    assert a.first_run(3) == 3
    assert Intervals.where([2.0, 4.0], 0, 6, lambda t: 2 < t < 4).spans == ((2.0, 4.0),)
    monday = datetime(2026, 11, 23, tzinfo=UTC)  # a Monday
    spans = utc_window_spans(["Mon"], "22:00-02:00", seconds(monday), seconds(monday + timedelta(days=2)))
    assert spans.spans == ((seconds(monday + timedelta(hours=22)), seconds(monday + timedelta(hours=26))),)
    periods = cron_periods("0 * * * *", "30m", "UTC", seconds(monday), seconds(monday + timedelta(hours=2)))
    assert len(periods.spans) == 2


def test_a_delete_whose_own_listener_dies_before_it_is_due_is_either_way() -> None:
    delete = event("delete", "Terminate", ["web_0"], 1, 16, viewers=["web_0", "web_1"])
    faults = [ListenerFault(vm="web_0", span=Span(begin=at(5)), dead=True)]
    # The delete removes web_0 at NotBefore: its forwarder dies then, but its listener was dead before.
    runs = {"web_0": [Span(begin=at(-10), end=at(16))], "web_1": [Span(begin=at(-10))], "web_2": [Span(begin=at(-10))]}
    report = check(truth([delete], [], listenerFaults=faults, removals={"web_0": at(16)}, forwarderRuns=runs))
    assert report.findings == []
    assert due(report, "delete") is None
