"""The pure lifecycle state machine of the IMDS emulator, driven by hand-set times (no sockets, no sleeping)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emulators.imds.models import EventCreate, FaultSpec, Scenario, ScenarioError, StartRequestsBody
from emulators.imds.records import EmulatorInputError, VmRemovedError
from emulators.imds.state import EmulatorState
from emulators.imds.vm_models import VmSpec

T0 = datetime(2026, 3, 2, 10, 0, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def fleet(**extra) -> Scenario:
    return Scenario.from_mapping(
        {
            "scaleSets": {"web": {"terminateNotBeforeSeconds": 300}},
            "vms": [
                {"name": "web_0", "vmScaleSetName": "web", "placementGroupId": "pg1"},
                {"name": "web_1", "vmScaleSetName": "web", "placementGroupId": "pg1"},
                {"name": "web_2", "vmScaleSetName": "web", "placementGroupId": "pg1"},
                {"name": "other_0", "vmScaleSetName": "other", "placementGroupId": "pg2"},
                {"name": "gpu_0", "vmScaleSetName": "gpu", "placementGroupId": "pg1", "isolated": True},
                {"name": "spot", "priority": "Spot"},
            ],
            **extra,
        }
    )


def new_state(scenario: Scenario | None = None, **options) -> EmulatorState:
    return EmulatorState(scenario or fleet(), start=T0, **options)


def approve(state: EmulatorState, vm: str, *ids: str, when: datetime) -> None:
    state.approve(vm, StartRequestsBody.model_validate({"StartRequests": [{"EventId": i} for i in ids]}), when)


def statuses(state: EmulatorState, vm: str, when: datetime) -> dict[str, str]:
    return {e["EventId"]: e["EventStatus"] for e in state.document(vm, "2020-07-01", when)["Events"]}


def test_freeze_waits_for_its_notice_then_starts_then_is_removed_after_the_started_minimum():
    state = new_state(started_min_seconds=120)
    event = state.create_event(EventCreate(EventType="Freeze", Resources=["web_0"]), at(0))
    document = state.document("web_0", "2020-07-01", at(0))
    assert document["DocumentIncarnation"] == 2
    shown = document["Events"][0]
    assert shown["EventStatus"] == "Scheduled"
    assert parsedate_to_datetime(shown["NotBefore"]) == at(900)  # 15 minutes' notice
    assert shown["NotBefore"].endswith(" GMT")
    assert statuses(state, "web_0", at(899.9)) == {event.event_id: "Scheduled"}
    document = state.document("web_0", "2020-07-01", at(900))
    assert document["Events"][0]["EventStatus"] == "Started"
    assert document["Events"][0]["NotBefore"] == ""
    assert document["DocumentIncarnation"] == 3
    assert statuses(state, "web_0", at(1019)) == {event.event_id: "Started"}
    assert state.document("web_0", "2020-07-01", at(1020)) == {"DocumentIncarnation": 4, "Events": []}
    assert event.started_by == "notBefore"
    assert event.started_at == at(900)
    assert event.removed_at == at(1020)  # applied at the due instant, not at the (later) poll


def test_time_scale_divides_notice_and_hold():
    state = new_state(time_scale=60, started_min_seconds=600)
    event = state.create_event(EventCreate(EventType="Reboot", Resources=["web_0"]), at(0))
    assert event.not_before == at(15)
    state.advance(at(15))
    assert event.summary()["state"] == "Started"
    state.advance(at(25))
    assert event.summary()["state"] == "Completed"
    assert event.removed_at == at(25)


def test_approval_starts_the_event_for_every_resource_and_is_recorded_with_the_incarnation():
    state = new_state()
    event = state.create_event(EventCreate(EventType="Freeze", Resources=["web_0", "web_1"]), at(0))
    approve(state, "web_2", event.event_id, when=at(10))  # any VM of the group may approve
    assert statuses(state, "web_0", at(10)) == {event.event_id: "Started"}
    assert event.started_by == "approval"
    assert [(a.vm, a.incarnation, a.status_before) for a in state.approvals] == [("web_2", 2, "Scheduled")]
    approve(state, "web_0", event.event_id, when=at(11))  # already started: still accepted
    assert [a.status_before for a in state.approvals] == ["Scheduled", "Started"]


def test_unknown_or_foreign_or_finished_event_ids_are_refused_and_nothing_is_applied():
    state = new_state(started_min_seconds=10)
    mine = state.create_event(EventCreate(EventType="Freeze", Resources=["web_0"]), at(0))
    foreign = state.create_event(EventCreate(EventType="Reboot", Resources=["other_0"]), at(0))
    with pytest.raises(EmulatorInputError, match="not valid for VM 'web_0'") as raised:
        approve(state, "web_0", mine.event_id, foreign.event_id, "5DD55B64-45AD-49D3-BBC9-F57D4EA97BD7", when=at(1))
    assert foreign.event_id in str(raised.value)
    assert mine.event_id not in str(raised.value)
    assert mine.summary()["state"] == "Scheduled"
    assert state.approvals == []
    approve(state, "web_0", mine.event_id.lower(), when=at(2))  # ids compare case-insensitively
    state.advance(at(20))
    assert mine.summary()["state"] == "Completed"
    with pytest.raises(EmulatorInputError):
        approve(state, "web_0", mine.event_id, when=at(21))


def test_cancellation_removes_a_scheduled_event_without_starting_it():
    state = new_state()
    event = state.create_event(EventCreate(EventType="Redeploy", Resources=["web_1"]), at(0))
    assert event.not_before == at(600)
    state.cancel_event(event.event_id, at(30))
    assert state.document("web_1", "2020-07-01", at(30)) == {"DocumentIncarnation": 3, "Events": []}
    assert (event.status, event.started_at, event.removed_at) == ("Canceled", None, at(30))
    with pytest.raises(EmulatorInputError, match="only a Scheduled event"):
        state.cancel_event(event.event_id, at(31))


def test_hardware_failure_appears_directly_started():
    state = new_state(started_min_seconds=60)
    event = state.create_event(EventCreate(EventType="Reboot", Resources=["web_0"], EventStatus="Started"), at(5))
    shown = state.document("web_0", "2020-07-01", at(5))["Events"][0]
    assert (shown["EventStatus"], shown["NotBefore"]) == ("Started", "")
    assert event.started_by == "hardware-failure"
    assert state.document("web_0", "2020-07-01", at(65))["Events"] == []


def test_per_type_notice_and_terminate_notice_from_the_scale_set():
    state = new_state()
    notices = {
        kind: state.create_event(EventCreate(EventType=kind, Resources=[vm]), at(0)).not_before
        for kind, vm in [("Freeze", "web_0"), ("Redeploy", "web_1"), ("Preempt", "spot"), ("Terminate", "web_2")]
    }
    assert notices == {"Freeze": at(900), "Redeploy": at(600), "Preempt": at(30), "Terminate": at(300)}


def test_placement_group_visibility_and_isolated_vms():
    state = new_state()
    group = state.create_event(EventCreate(EventType="Freeze", Resources=["web_0"]), at(0))
    gpu = state.create_event(EventCreate(EventType="Freeze", Resources=["gpu_0"]), at(0))
    assert set(statuses(state, "web_1", at(1))) == {group.event_id}  # same group, not in Resources
    assert set(statuses(state, "gpu_0", at(1))) == {gpu.event_id}  # isolated: only its own
    assert set(statuses(state, "web_2", at(1))) == {group.event_id}  # the isolated VM's event stays private
    assert statuses(state, "other_0", at(1)) == {}
    incarnations = dict(state.incarnations)
    state.create_event(EventCreate(EventType="Reboot", Resources=["other_0"]), at(2))
    state.advance(at(2))
    assert state.incarnations["other_0"] == incarnations["other_0"] + 1
    assert state.incarnations["web_0"] == incarnations["web_0"]  # each VM has its own counter


def test_a_scale_set_can_be_isolated_as_a_whole():
    scenario = Scenario.from_mapping(
        {
            "scaleSets": {"gpu": {"isolated": True}},
            "vms": [
                {"name": "gpu_0", "vmScaleSetName": "gpu", "placementGroupId": "pg"},
                {"name": "gpu_1", "vmScaleSetName": "gpu", "placementGroupId": "pg"},
            ],
        }
    )
    state = new_state(scenario)
    event = state.create_event(EventCreate(EventType="Reboot", Resources=["gpu_0"]), at(0))
    assert set(statuses(state, "gpu_0", at(1))) == {event.event_id}
    assert statuses(state, "gpu_1", at(1)) == {}


def test_scenario_time_starts_when_the_emulator_begins():
    scenario = fleet(steps=[{"at": 10, "create": {"EventType": "Freeze", "Resources": ["web_0"]}}])
    state = new_state(scenario)
    state.begin(at(100))
    assert state.event_summaries(at(109)) == []
    [summary] = state.event_summaries(at(110))
    assert summary["scheduledAt"] == "2026-03-02T10:01:50Z"


def test_approved_terminate_waits_for_a_pending_unapproved_delete_then_both_go():
    state = new_state()
    first = state.create_event(EventCreate(EventType="Terminate", Resources=["web_1"]), at(0))
    second = state.create_event(EventCreate(EventType="Terminate", Resources=["web_2"], NoticeSeconds=600), at(0))
    approve(state, "web_2", second.event_id, when=at(10))
    assert second.status == "Scheduled"  # waits: web_1's delete is pending unapproved
    state.advance(at(299))
    assert (first.status, second.status) == ("Scheduled", "Scheduled")
    state.advance(at(300))  # web_1's delete times out: both go
    assert (first.status, second.status) == ("Started", "Started")
    assert (first.started_by, second.started_by) == ("notBefore", "approval")
    assert first.started_at == second.started_at == at(300)


def test_approved_terminate_goes_when_the_other_pending_delete_is_approved():
    state = new_state()
    first = state.create_event(EventCreate(EventType="Terminate", Resources=["web_1"]), at(0))
    second = state.create_event(EventCreate(EventType="Terminate", Resources=["web_2"]), at(0))
    approve(state, "web_1", first.event_id, when=at(5))
    assert first.status == "Scheduled"
    approve(state, "web_2", second.event_id, when=at(8))
    assert (first.status, second.status) == ("Started", "Started")
    assert first.started_at == at(8)


def test_canceling_the_pending_delete_releases_the_approved_one():
    state = new_state()
    pending = state.create_event(EventCreate(EventType="Terminate", Resources=["web_1"]), at(0))
    approved = state.create_event(EventCreate(EventType="Terminate", Resources=["web_2"]), at(0))
    approve(state, "web_2", approved.event_id, when=at(1))
    state.cancel_event(pending.event_id, at(2))
    assert statuses(state, "web_0", at(2)) == {approved.event_id: "Started"}


def test_simultaneous_deletes_need_both_approvals_and_other_scale_sets_do_not_block():
    state = new_state()
    first = state.create_event(EventCreate(EventType="Terminate", Resources=["web_0"]), at(0))
    second = state.create_event(EventCreate(EventType="Terminate", Resources=["web_1"]), at(0))
    assert first.not_before == second.not_before
    approve(state, "web_0", first.event_id, when=at(1))
    state.advance(at(299))
    assert (first.status, second.status) == ("Scheduled", "Scheduled")
    state.advance(at(300))
    assert (first.status, second.status) == ("Started", "Started")
    other = state.create_event(EventCreate(EventType="Terminate", Resources=["other_0"]), at(301))
    pending = state.create_event(EventCreate(EventType="Terminate", Resources=["web_2"]), at(301))
    approve(state, "other_0", other.event_id, when=at(302))
    assert (other.status, pending.status) == ("Started", "Scheduled")


def test_fields_and_types_per_api_version():
    state = new_state()
    state.create_event(EventCreate(EventType="Freeze", Resources=["web_0"]), at(0))
    state.create_event(EventCreate(EventType="Terminate", Resources=["web_1"]), at(0))
    state.create_event(EventCreate(EventType="Preempt", Resources=["spot"]), at(0))

    def shown(vm: str, version: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = state.document(vm, version, at(1))["Events"]
        return events

    newest = shown("web_0", "2020-07-01")
    assert {e["EventType"] for e in newest} == {"Freeze", "Terminate"}
    assert all({"Description", "EventSource", "DurationInSeconds"} <= set(e) for e in newest)
    assert [set(e) & {"Description", "EventSource", "DurationInSeconds"} for e in shown("web_0", "2019-08-01")] == [
        {"Description", "EventSource"}
    ] * 2
    assert all("EventSource" not in e and "Description" in e for e in shown("web_0", "2019-04-01"))
    assert all("Description" not in e for e in shown("web_0", "2019-01-01"))
    assert {e["EventType"] for e in shown("web_0", "2019-01-01")} == {"Freeze", "Terminate"}
    assert {e["EventType"] for e in shown("web_0", "2017-11-01")} == {"Freeze"}  # no Terminate before 2019-01-01
    assert [e["EventType"] for e in shown("spot", "2017-11-01")] == ["Preempt"]
    assert shown("spot", "2017-08-01") == []  # no Preempt before 2017-11-01
    assert shown("web_0", "2017-03-01")[0]["Resources"] == ["_web_0"]  # the preview's underscore names
    # The incarnation is the VM's own, whatever the version.
    assert state.document("web_0", "2017-08-01", at(1))["DocumentIncarnation"] == state.incarnations["web_0"]


def test_incarnation_reset_restarts_the_counter():
    state = new_state()
    state.create_event(EventCreate(EventType="Freeze", Resources=["web_0"]), at(0))
    assert state.document("web_0", "2020-07-01", at(1))["DocumentIncarnation"] == 2
    state.apply_fault(FaultSpec(kind="incarnation-reset", vm="web_0"), at(2))
    assert state.document("web_0", "2020-07-01", at(2))["DocumentIncarnation"] == 1
    assert state.document("web_1", "2020-07-01", at(2))["DocumentIncarnation"] == 2


def test_scenario_steps_run_at_their_offsets_and_bad_steps_are_set_aside():
    scenario = fleet(
        steps=[
            {"at": 10, "create": {"ref": "m", "EventType": "Redeploy", "Resources": ["web_0"]}},
            {"at": 20, "create": {"EventType": "Preempt", "Resources": ["web_1"]}},  # not a Spot VM
            {"at": 30, "cancel": "m"},
            {"at": 40, "create": {"EventType": "Freeze", "Resources": ["web_1"]}},
        ]
    )
    state = new_state(scenario, time_scale=10)
    assert state.event_summaries(at(0.99)) == []
    [redeploy] = state.event_summaries(at(1))
    assert redeploy["state"] == "Scheduled"
    summaries = state.event_summaries(at(4))
    assert [(s["EventType"], s["state"]) for s in summaries] == [("Redeploy", "Canceled"), ("Freeze", "Scheduled")]
    assert summaries[0]["removedAt"] == "2026-03-02T10:00:03Z"
    assert len(state.step_errors) == 1
    assert "steps.1.create" in state.step_errors[0]
    assert "Spot" in state.step_errors[0]


def test_scenario_steps_play_in_time_order_whatever_their_order_in_the_file():
    """A step listed after a later one is played at its own time: the Freeze created at 2 and canceled at 5 is in
    the documents between them (played in list order, both waited for the step at 10 and it never was)."""
    scenario = fleet(
        steps=[
            {"at": 10, "create": {"EventType": "Reboot", "Resources": ["web_0"]}},
            {"at": 5, "cancel": "f"},
            {"at": 2, "create": {"ref": "f", "EventType": "Freeze", "Resources": ["web_1"]}},
            {"at": 3, "create": {"EventType": "Preempt", "Resources": ["web_1"]}},  # not a Spot VM
        ]
    )
    state = new_state(scenario)
    assert list(statuses(state, "web_1", at(2.5)).values()) == ["Scheduled"]
    assert statuses(state, "web_1", at(6)) == {}
    assert [(s["EventType"], s["state"]) for s in state.event_summaries(at(11))] == [
        ("Freeze", "Canceled"),
        ("Reboot", "Scheduled"),
    ]
    assert len(state.step_errors) == 1
    assert "steps.3.create" in state.step_errors[0]  # its place in the file


def test_create_refuses_unknown_vms_and_terminate_outside_a_scale_set():
    state = new_state()
    with pytest.raises(EmulatorInputError, match="unknown VMs"):
        state.create_event(EventCreate(EventType="Freeze", Resources=["nope"]), at(0))
    with pytest.raises(EmulatorInputError, match="scale-set VMs"):
        state.create_event(EventCreate(EventType="Terminate", Resources=["spot"]), at(0))
    with pytest.raises(EmulatorInputError, match="all of one scale set"):
        state.create_event(EventCreate(EventType="Terminate", Resources=["web_0", "other_0"]), at(0))


def test_scenario_validation_names_the_field():
    with pytest.raises(ScenarioError, match=r"vms\.0\.name"):
        Scenario.from_mapping({"vms": [{"name": "bad name"}]})
    with pytest.raises(ScenarioError, match=r"steps\.0\.create\.Resources: unknown VMs \['x'\]"):
        Scenario.from_mapping(
            {"vms": [{"name": "a"}], "steps": [{"at": 0, "create": {"EventType": "Freeze", "Resources": ["x"]}}]}
        )
    with pytest.raises(ScenarioError, match=r"steps\.0\.create\.EventType"):
        Scenario.from_mapping(
            {"vms": [{"name": "a"}], "steps": [{"at": 0, "create": {"EventType": "Melt", "Resources": ["a"]}}]}
        )
    with pytest.raises(ScenarioError, match=r"steps\.0\.cancel"):
        Scenario.from_mapping({"vms": [{"name": "a"}], "steps": [{"at": 0, "cancel": "never-created"}]})


def test_vm_identity_is_derived_like_azure_and_the_hostname_differs():
    vm = VmSpec(name="web_12", vmScaleSetName="web", placementGroupId="pg")
    assert vm.resourceId.endswith("/providers/Microsoft.Compute/virtualMachineScaleSets/web/virtualMachines/12")
    assert vm.computerName == "web00000c"
    assert VmSpec(name="db-0").computerName != "db-0"
    assert all(isinstance(value, str) for key, value in vm.compute().items() if key not in ("osProfile", "tagsList"))


# ---- invariants over random operation sequences --------------------------------------------------------------

_OPERATION = st.one_of(
    st.tuples(
        st.just("create"),
        st.sampled_from(["Freeze", "Reboot", "Redeploy", "Terminate", "Preempt"]),
        st.sampled_from(["web_0", "web_1", "web_2", "other_0", "gpu_0", "spot"]),
        st.sampled_from([None, 0.0, 30.0, 300.0]),
        st.booleans(),
        st.sampled_from([None, 0.0, 50.0, "NotBefore"]),
    ),
    st.tuples(
        st.just("approve"), st.sampled_from(["web_0", "web_1", "web_2", "other_0", "gpu_0", "spot"]), st.integers(0, 20)
    ),
    st.tuples(st.just("cancel"), st.integers(0, 20)),
    st.tuples(st.just("wait"), st.floats(0, 400)),
)


def _apply(state: EmulatorState, operation: tuple[Any, ...], now: float) -> float:
    """Applies one random operation; returns the new time. Refused input changes nothing."""
    ids = list(state.events)
    try:
        if operation[0] == "create":
            _, kind, vm, notice, hardware, delay = operation
            spec = EventCreate(
                EventType=kind,
                Resources=[vm],
                NoticeSeconds=None if hardware else notice,
                EventStatus="Started" if hardware else "Scheduled",
                StartDelaySeconds=None if hardware else delay,
            )
            state.create_event(spec, at(now))
        elif operation[0] == "approve" and ids:
            approve(state, operation[1], ids[operation[2] % len(ids)], when=at(now))
        elif operation[0] == "cancel" and ids:
            state.cancel_event(ids[operation[1] % len(ids)], at(now))
        elif operation[0] == "wait":
            return now + float(operation[1])
    except EmulatorInputError:
        pass
    return now


def _check_history(state: EmulatorState) -> None:
    for record in state.events.values():
        if record.started_by == "approval":
            assert record.approved_at is not None
            assert record.started_at is not None
            assert record.start_delay != "NotBefore"  # an ignored approval never starts anything
            assert record.started_at >= record.approved_at + timedelta(seconds=record.start_delay)
        elif record.started_by == "notBefore":
            assert record.started_at == record.not_before
        if record.status == "Canceled":
            assert record.started_at is None
        if record.removed_at is not None and record.started_at is not None:
            assert record.removed_at >= record.started_at + timedelta(seconds=60)
        if record.live:
            assert not all(name in state.removed for name in record.resources) or record.status == "Started"
    for name, removal in state.removed.items():
        [remover] = [r for r in state.events.values() if r.event_id == removal.event_id]
        assert remover.event_type in ("Terminate", "Preempt")
        assert name in remover.resources
        assert remover.started_at is not None
        assert removal.at >= remover.started_at


@settings(max_examples=60, deadline=None)
@given(operations=st.lists(_OPERATION, max_size=30))
def test_invariants_hold_for_any_sequence_of_operations(operations):
    state = new_state(started_min_seconds=60)
    now = 0.0
    seen: dict[str, tuple[int, str]] = {}
    for operation in operations:
        now = _apply(state, operation, now)
        state.advance(at(now))  # so that `state.removed` is up to date
        for vm in state.vms:
            if vm in state.removed:
                with pytest.raises(VmRemovedError):
                    state.document(vm, "2020-07-01", at(now))
                continue
            document = state.document(vm, "2020-07-01", at(now))
            content = json.dumps(document["Events"], sort_keys=True)
            incarnation = document["DocumentIncarnation"]
            if vm in seen:
                previous_incarnation, previous_content = seen[vm]
                # Same incarnation = same content; every change of content = a higher incarnation.
                assert (incarnation == previous_incarnation) == (content == previous_content)
                assert incarnation >= previous_incarnation
            seen[vm] = (incarnation, content)
            for event in document["Events"]:
                assert vm in state.events[event["EventId"]].viewers
    _check_history(state)


def test_every_document_content_every_state_and_every_approval_path_are_recorded():
    state = new_state(started_min_seconds=120)
    event = state.create_event(EventCreate(EventType="Freeze", Resources=["web_0"]), at(0))
    state.document("web_0", "2020-07-01", at(1), served=True)
    state.document("web_0", "2020-07-01", at(2))  # not served: a control read, or a garbled answer
    approve(state, "web_1", event.event_id, when=at(3))
    state.reset_incarnation("web_0")
    log = [entry.summary() for entry in state.incarnation_log["web_0"]]
    assert [(e["incarnation"], e["serial"]) for e in log] == [(1, 0), (2, 1), (3, 2), (1, 3)]
    assert log[1]["listed"] == [{"EventId": event.event_id, "EventStatus": "Scheduled"}]
    assert (log[1]["firstServed"], log[1]["lastServed"]) == (at(1).isoformat().replace("+00:00", "Z"),) * 2
    assert log[2]["listed"] == [{"EventId": event.event_id, "EventStatus": "Started"}]
    assert log[2]["firstServed"] is None
    assert log[3]["listed"] == log[2]["listed"]  # the counter started over; the content did not change
    summary = state.event_summaries(at(200))[0]
    assert [(t["state"], t["reason"]) for t in summary["transitions"]] == [
        ("Scheduled", "created"),
        ("Started", "approval"),
        ("Completed", "impact over"),
    ]
    assert summary["viewers"] == ["web_0", "web_1", "web_2"]
    assert state.approval_summaries(at(200))[0]["via"] == "imds"
    last = [e for e in state.incarnation_summaries(at(200)) if e["vm"] == "web_0"][-1]
    assert (last["listed"], last["gone"]) == ([], [event.event_id])
