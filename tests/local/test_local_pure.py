"""Pure parts of the local mode: timeline lines, expectations, the summary's verdict, scenario shifting."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.envelope import VmIdentity
from coordinator.domain.policy_file import DEFAULT_POLICY_PATH, load_policy
from emulators.imds import Scenario
from local.expectations import Expected, expect, expect_all
from local.observe import cards_written
from local.scenario import delayed
from local.summary import RunFacts, percentile, sightings_from_documents, summarize
from local.timeline import Timeline
from tests.local.hostile import hostile_message, refused, template

T0 = datetime(2026, 1, 5, 12, 0, 0, tzinfo=UTC)
EVENT = "11111111-2222-3333-4444-555555555555"


def at(ms: float) -> str:
    return (T0 + timedelta(milliseconds=ms)).isoformat()


def row(kind: str, ms: float, **values: Any) -> dict[str, Any]:
    return {"RecordType": kind, "TimeGenerated": at(ms), "EventId": EVENT, "EventType": "Freeze", **values}


def heartbeat(ms: float, vm: str, outcome: str, **values: Any) -> dict[str, Any]:
    """A Heartbeat row of ``vm`` (of no event, unless ``values`` name one)."""
    return {"RecordType": "Heartbeat", "TimeGenerated": at(ms), "VmName": vm, "Outcome": outcome, **values}


def test_timeline_follows_an_event_from_seen_to_completed_with_latencies() -> None:
    timeline = Timeline(labels={EVENT: "freeze-web"})
    lines: list[str] = []
    for item in [
        row("Observation", 120, ObservedAt=at(0), VmName="web_0", EventStatus="Scheduled", Resources='["web_0"]'),
        row("Observation", 130, ObservedAt=at(10), VmName="web_1", EventStatus="Scheduled"),
        row("Decision", 150, Rule="short-freeze", Outcome="approve", Reason="at once"),
        row("Approval", 400, Outcome="approved", VmName="web_1"),
        row("Transition", 400, State="Approved"),
        row("Transition", 1500, State="Started", Reason="seen Started"),
        row("Hook", 1600, Outcome="not-run", VmName="web_0"),
        row("Transition", 9000, State="Completed", Reason="gone"),
    ]:
        lines.extend(timeline.add(item))
    steps = [line.split()[3] for line in lines]
    assert steps == ["seen", "decided", "approved", "started", "completed"]
    assert "freeze-web" in lines[0]
    assert "logged +120 ms" in lines[0]
    assert "+400 ms" in lines[2]
    assert "through web_1" in lines[2]
    path = timeline.paths[EVENT]
    assert path.state == "Completed"
    assert path.rule == "short-freeze"
    assert path.reporters == {"web_0", "web_1"}
    assert path.latency_ms("approved") == pytest.approx(400.0)
    assert path.latency_ms("completed") == pytest.approx(9000.0)
    assert timeline.open_events() == []


def test_an_expired_event_is_open_until_completed_whatever_order_its_rows_were_logged_in() -> None:
    timeline = Timeline(labels={EVENT: "reboot-web"})
    for item in [
        row("Observation", 100, ObservedAt=at(0), VmName="web_1", EventStatus="Scheduled"),
        # The batch that saw it Started is logged before the timer's Expired, which it followed.
        row("Transition", 1500, State="Started", PreviousState="Expired", Reason="seen Started"),
        row("Transition", 900, State="Expired", PreviousState="Scheduled", Reason="NotBefore passed"),
    ]:
        timeline.add(item)
    assert timeline.paths[EVENT].state == "Started"
    assert timeline.open_events() == [EVENT]
    timeline.add(row("Transition", 5000, State="Completed", Reason="gone"))
    assert timeline.open_events() == []
    expired_only = Timeline(labels={})
    expired_only.add(row("Transition", 900, State="Expired", PreviousState="Scheduled"))
    assert expired_only.open_events() == [EVENT]  # not over: the platform starts an expired event anyway


def test_timeline_never_prints_a_negative_latency_when_a_vms_clock_runs_ahead() -> None:
    """A VM's observedAt is its own clock, each step's time the service's: with the VM 141 ms ahead, the demo's
    timeline printed "logged +-141 ms"."""
    timeline = Timeline(labels={EVENT: "freeze-web"})
    lines: list[str] = []
    for item in [
        row("Observation", 100, ObservedAt=at(241), VmName="web_0", EventStatus="Scheduled", Resources='["web_0"]'),
        row("Decision", 150, Rule="short-freeze", Outcome="approve", Reason="at once"),
        row("Observation", 160, ObservedAt=at(50), VmName="web_1", EventStatus="Scheduled"),
        row("Approval", 400, Outcome="approved", VmName="web_1"),
    ]:
        lines.extend(timeline.add(item))
    assert "logged 141 ms before it by the service's clock (web_0's clock runs ahead)" in lines[0]
    assert all("+-" not in line for line in lines)
    # The decision, logged before web_0 observed the event, starts the path; web_1, observed earlier still, then does.
    assert "+0 ms" in lines[1]
    assert "+350 ms" in lines[2]
    assert timeline.paths[EVENT].latency_ms("approved") == pytest.approx(350.0)


def test_timeline_counts_dead_letters_and_shows_failed_approvals() -> None:
    timeline = Timeline()
    dead = timeline.add({"RecordType": "DeadLetter", "TimeGenerated": at(0), "Reason": "invalid envelope: vm"})
    failed = timeline.add(row("Approval", 50, Outcome="failed", Reason="no listener"))
    assert timeline.dead_letters == 1
    assert "invalid envelope: vm" in dead[0]
    assert "failed: no listener" in failed[0]
    assert timeline.open_events() == [EVENT]
    assert timeline.add({"RecordType": "Alert", "TimeGenerated": at(60), "EventId": EVENT}) == []


def imds_event(
    event_type: str,
    *,
    source: str = "Platform",
    duration: int = -1,
    notice: float = 15.0,
    state: str = "Completed",
    started_by: str | None = "approval",
    ref: str = "e",
) -> dict[str, Any]:
    return {
        "EventId": f"{ref}-id",
        "EventType": event_type,
        "EventSource": source,
        "Resources": ["web_0"],
        "DurationInSeconds": duration,
        "NotBefore": format_datetime(T0 + timedelta(seconds=notice), usegmt=True) if notice else "",
        "scheduledAt": T0.isoformat(),
        "state": state,
        "startedBy": started_by,
        "ref": ref,
    }


def test_expectations_follow_the_default_policy() -> None:
    policy = load_policy(DEFAULT_POLICY_PATH)
    short_freeze = expect(imds_event("Freeze", duration=5), policy, prepare_hooks=True)
    long_freeze = expect(imds_event("Freeze", duration=30), policy, prepare_hooks=True)
    user_reboot = expect(imds_event("Reboot", source="User"), policy, prepare_hooks=True)
    terminate = expect(imds_event("Terminate"), policy, prepare_hooks=True)
    terminate_no_hooks = expect(imds_event("Terminate"), policy, prepare_hooks=False)
    preempt = expect(imds_event("Preempt", notice=0.5), policy, prepare_hooks=True)
    failure = expect(imds_event("Reboot", notice=0, started_by="hardware-failure"), policy, prepare_hooks=True)
    canceled = expect(imds_event("Redeploy", state="Canceled", started_by=None), policy, prepare_hooks=True)
    assert (short_freeze.approval, short_freeze.rule) == ("approve", "short-freeze")
    assert long_freeze.approval == "no-approval"
    assert user_reboot.approval == "approve"
    assert (terminate.approval, terminate.rule) == ("approve", "terminate-after-prepare-hooks")
    assert terminate_no_hooks.approval == "either"
    assert preempt.approval == "no-approval"
    assert failure.approval == "no-approval"
    assert (canceled.approval, canceled.terminal_state) == ("no-approval", "Canceled")
    assert short_freeze.terminal_state == "Completed"


def test_a_notice_too_short_to_act_on_sets_no_expectation() -> None:
    policy = load_policy(DEFAULT_POLICY_PATH)
    [quick] = expect_all([imds_event("Freeze", duration=5, notice=1)], policy, prepare_hooks=True)
    assert quick.approval == "either"


def test_sightings_from_documents_orders_by_sequence_and_notices_gone() -> None:
    documents = [
        ("web_0", "s1", 3, []),
        ("web_0", "s1", 1, [("A", "Scheduled")]),
        ("web_0", "s1", 2, [("A", "Started"), ("B", "Scheduled")]),
        ("web_1", "s9", 7, [("A", "Scheduled")]),
    ]
    assert sightings_from_documents(documents) == {
        ("web_0", "A", "Scheduled"),
        ("web_0", "A", "Started"),
        ("web_0", "B", "Scheduled"),
        ("web_0", "A", "Gone"),
        ("web_0", "B", "Gone"),
        ("web_1", "A", "Scheduled"),
    }


def test_sightings_compare_sequences_within_one_forwarder_state() -> None:
    # The wiped forwarder's new state starts at sequence 1 again: its documents are not 'later' than the old
    # state's sequence 5, and its first document implies nothing about what the lost state listed.
    documents = [
        ("web_0", "old", 4, [("A", "Scheduled")]),
        ("web_0", "old", 5, [("A", "Scheduled"), ("B", "Scheduled")]),
        ("web_0", "new", 1, [("C", "Scheduled")]),
        ("web_0", "new", 2, []),
    ]
    assert sightings_from_documents(documents) == {
        ("web_0", "A", "Scheduled"),
        ("web_0", "B", "Scheduled"),
        ("web_0", "C", "Scheduled"),
        ("web_0", "C", "Gone"),
    }


def expected(event_id: str, approval: str, terminal: str = "Completed") -> Expected:
    return Expected(event_id, event_id, "Freeze", approval, "rule", terminal)  # type: ignore[arg-type]


def facts(**changes: Any) -> RunFacts:
    base: dict[str, Any] = {
        "expected": [expected("A", "approve"), expected("B", "no-approval", "Canceled"), expected("C", "either")],
        "imds_events": [{"EventId": "A", "state": "Completed"}, {"EventId": "B", "state": "Canceled"}],
        "imds_approvals": [{"EventId": "A", "vm": "web_0"}],
        "coordinator_states": {"A": "Completed", "B": "Canceled", "C": "Completed"},
        "envelopes_sent": {"incarnation": 4, "heartbeat": 2},
        "envelopes_delivered": 6,
        "last_sequence_sent": {"web_0": 5},
        "last_sequence_applied": {"web_0": 5},
        "sightings_sent": {("web_0", "A", "Scheduled")},
        "sightings_logged": {("web_0", "A", "Scheduled"), ("web_0", "B", "Scheduled")},
        "dead_letters": 0,
        "failed_batches": 0,
        "latencies_ms": {"approved": [100.0, 300.0, 200.0]},
    }
    return RunFacts(**(base | changes))


def test_summary_of_a_good_run_is_ok() -> None:
    summary = summarize(facts())
    assert summary.ok, summary.failures
    assert (summary.approvals_expected, summary.approvals_made, summary.approvals_expected_made) == (1, 1, 1)
    assert summary.events_by_state == {"Completed": 2, "Canceled": 1}
    assert summary.envelopes_sent == 6
    assert summary.latencies_ms["approved"]["p50"] == 200.0
    assert any("OK" in line for line in summary.render())


@pytest.mark.parametrize(
    ("changes", "failure"),
    [
        ({"imds_approvals": []}, "A (Freeze): rule rule says it is approved; it was not"),
        ({"imds_approvals": [{"EventId": "A"}, {"EventId": "B"}]}, "B (Freeze): approved, although rule rule says"),
        ({"coordinator_states": {"A": "Started", "B": "Canceled"}}, "coordinator state Started"),
        ({"last_sequence_applied": {"web_0": 4}}, "last envelope sequence sent 5, applied by the coordinator 4"),
        ({"sightings_logged": set()}, "1 event sightings sent but never logged"),
        ({"dead_letters": 2}, "dead letters: 2, expected 0"),
        ({"failed_batches": 1}, "failed every retry"),
        ({"envelopes_sent": {}}, "no envelope reached Event Hubs"),
    ],
)
def test_summary_names_each_failed_expectation(changes: dict[str, Any], failure: str) -> None:
    summary = summarize(facts(**changes))
    assert not summary.ok
    assert any(failure in text for text in summary.failures), summary.failures
    assert any("FAILED" in line for line in summary.render())


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 50.0
    assert percentile(values, 0.99) == 99.0
    assert percentile([7.0], 0.99) == 7.0


def test_delayed_shifts_every_step_and_refuses_negative_delays() -> None:
    scenario = Scenario.from_file("emulators/scenarios/fleet-demo.yaml")
    later = delayed(scenario, seconds=180)
    assert [s.at for s in later.steps] == [s.at + 180 for s in scenario.steps]
    assert later.vms == scenario.vms
    with pytest.raises(ValueError, match="early"):
        delayed(scenario, seconds=-1)


def _vm(name: str, number: int) -> VmIdentity:
    return VmIdentity(name=name, vmId=f"00000000-0000-0000-0000-00000000000{number}", resourceId=f"/vms/{name}")


@settings(max_examples=300, deadline=None, database=None)
@given(data=st.data())
def test_every_hostile_mutation_is_refused_at_the_coordinators_door(data: st.DataObject) -> None:
    target, other = _vm("web_0", 0), _vm("web_1", 1)
    body, key = data.draw(
        hostile_message(base=template(target), own_key=target.partition_key, other_keys=[other.partition_key])
    )
    assert refused(body, key)


def test_the_unmutated_template_is_accepted() -> None:
    target = _vm("web_0", 0)
    assert not refused(json.dumps(template(target)).encode(), target.partition_key)


def test_timeline_skips_the_sending_intent_and_shows_holds_retirements_and_resets() -> None:
    timeline = Timeline(labels={EVENT: "scale-in"})
    holder = "99999999-2222-3333-4444-555555555555"
    sending = timeline.add(row("Approval", 10, Outcome="sending", VmName="web_0"))
    held = timeline.add(
        row(
            "Approval",
            20,
            Outcome="held",
            Actor="platform",
            Reason="held by the platform: delete of web_1 pending",
            Details=json.dumps({"heldBy": holder, "heldByVm": "web_1"}),
        )
    )
    assert sending == []
    assert held[0].endswith("  held by the platform: delete of web_1 pending")
    assert timeline.paths[EVENT].held_by == holder
    timeline.add(row("Approval", 30, Outcome="released", Actor="platform", Reason="no longer held"))
    assert timeline.paths[EVENT].held_by == ""
    retired = timeline.add(
        heartbeat(40, "web_1", "retired", EventId=EVENT, EventType="Terminate", Reason="its NotBefore passed")
    )
    assert "retired by scale-in (Terminate): its NotBefore passed" in retired[0]
    moved = {"oldState": "aaaaaaaa0001", "newState": "bbbbbbbb0002", "lastSequence": 41, "newSequence": 1}
    reset = timeline.add(heartbeat(50, "web_0", "reset", Details=moved))
    assert "reset: forwarder state aaaaaaaa → bbbbbbbb, sequence 41 → 1" in reset[0]
    both = {"state": "aaaaaaaa0001", "otherState": "bbbbbbbb0002", "lastSequence": 50, "newSequence": 51}
    conflict = timeline.add(heartbeat(51, "web_0", "conflict", Details=both))
    assert "conflict: forwarder states aaaaaaaa and bbbbbbbb both send as this VM" in conflict[0]
    assert (timeline.retired, timeline.resets) == ({"web_1"}, ["web_0"])


def scenario_vms(hooks: dict[str, Any] | None, **more: Any) -> list[Any]:
    vm = {"name": "web_0", "vmScaleSetName": "web"} | ({"hooks": hooks} if hooks is not None else {})
    return Scenario.from_mapping({"name": "t", "vms": [vm, *more.get("others", [])], "steps": []}).vms


def test_a_failing_prepare_hook_means_no_approval_before_the_hook_deadline() -> None:
    policy = load_policy(DEFAULT_POLICY_PATH)
    event = imds_event("Terminate", notice=600.0, started_by="notBefore")
    failing = {"prepare": [{"name": "10-check", "exitCode": 1}, {"name": "20-drain", "exitCode": 0}]}
    passing = {"prepare": [{"name": "10-check", "exitCode": 0}, {"name": "20-drain", "exitCode": 0, "seconds": 2}]}
    # 600 Azure seconds at 120x: a 5 s notice, far shorter than the rule's 240 s (real) hook deadline.
    [fails] = expect_all([event], policy, prepare_hooks=True, vms=scenario_vms(failing), time_scale=120)
    [works] = expect_all([event], policy, prepare_hooks=True, vms=scenario_vms(passing), time_scale=120)
    [none] = expect_all([event], policy, prepare_hooks=True, vms=scenario_vms({"prepare": []}), time_scale=120)
    # At 1x the notice (600 s) outlasts the deadline, and onDeadline approves: either may happen first.
    [slow] = expect_all([event], policy, prepare_hooks=True, vms=scenario_vms(failing), time_scale=1)
    assert (fails.approval, works.approval, none.approval, slow.approval) == (
        "no-approval",
        "approve",
        "no-approval",
        "either",
    )


def test_a_delete_overlapping_an_unready_delete_of_its_scale_set_is_either() -> None:
    policy = load_policy(DEFAULT_POLICY_PATH)
    ready = imds_event("Terminate", notice=600.0, ref="ready")
    blocked = imds_event("Terminate", notice=600.0, ref="blocked") | {"Resources": ["web_1"]}
    elsewhere = imds_event("Terminate", notice=600.0, ref="elsewhere") | {"Resources": ["api_0"]}
    vms = scenario_vms(
        None,
        others=[
            {"name": "web_1", "vmScaleSetName": "web", "hooks": {"prepare": [{"name": "10-check", "exitCode": 1}]}},
            {"name": "api_0", "vmScaleSetName": "api"},
        ],
    )
    result = expect_all([ready, blocked, elsewhere], policy, prepare_hooks=True, vms=vms, time_scale=120)
    assert [item.approval for item in result] == ["either", "no-approval", "approve"]


def test_cards_are_listed_by_kind_event_and_vm_from_their_file_names(tmp_path: Path) -> None:
    vm_id = "0f1e2d3c-aaaa-bbbb-cccc-000000000001"
    for name in (f"{EVENT}-new-event", f"{EVENT}-expired", f"{vm_id}-heartbeat-lost-20260105T120000", "stray"):
        (tmp_path / f"{name}.json").write_text("{}")
    cards = cards_written(tmp_path, {vm_id: "web_3"})
    assert sorted(cards, key=str) == sorted(
        [
            {"kind": "new-event", "eventId": EVENT, "vm": None},
            {"kind": "expired", "eventId": EVENT, "vm": None},
            {"kind": "heartbeat-lost", "eventId": None, "vm": "web_3"},
            {"kind": "unknown", "eventId": None, "vm": None},
        ],
        key=str,
    )
