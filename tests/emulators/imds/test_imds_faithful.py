"""Where approvals can go wrong, the IMDS emulator behaves as Azure does (issue 10), checked over real HTTP on
loopback: VMs a delete or eviction removed stop answering, approvals that take effect later (or never), platform
maintenance within one update domain, no Terminate for Spot/low-priority VMs, Descriptions that match the source,
NotBefore with any offset, Microsoft's mock-server quirks, and the scenario fields the local runner acts on."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import requests

from emulators.imds import ImdsEmulator, ManualClock, Scenario, ScenarioError
from emulators.imds.models import (
    DESCRIPTION_EMERGENCY_REPAIR,
    DESCRIPTION_EVICTION,
    DESCRIPTION_HOST_MAINTENANCE,
    DESCRIPTION_INFRASTRUCTURE_MAINTENANCE,
    DESCRIPTION_LIVE_MIGRATION,
    EventCreate,
)

SE = "/metadata/scheduledevents"
META = {"Metadata": "true"}
RFC1123 = re.compile(r"^[A-Z][a-z]{2}, \d{2} [A-Z][a-z]{2} \d{4} \d{2}:\d{2}:\d{2} GMT$")
STARTED_MIN = 300  # seconds a Started event stays listed (time scale 1 on a manual clock: Azure seconds = seconds)

FLEET: dict[str, Any] = {
    "scaleSets": {"web": {"terminateNotBeforeSeconds": 300}},
    "vms": [
        {"name": "web_0", "vmScaleSetName": "web", "placementGroupId": "pg1", "platformUpdateDomain": 0},
        {"name": "web_1", "vmScaleSetName": "web", "placementGroupId": "pg1", "platformUpdateDomain": 0},
        {"name": "web_2", "vmScaleSetName": "web", "placementGroupId": "pg1", "platformUpdateDomain": 1},
        {"name": "web_3", "vmScaleSetName": "web", "placementGroupId": "pg1", "priority": "Spot"},
        {"name": "web_4", "vmScaleSetName": "web", "placementGroupId": "pg1", "priority": "Low"},
        {"name": "solo", "priority": "Spot", "isolated": True},
    ],
}

Make = Callable[..., ImdsEmulator]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def make(clock: ManualClock) -> Iterator[Make]:
    """``make(**scenario_fields)``: the FLEET scenario with extra top-level fields, served on a manual clock (each
    emulator stopped after the test)."""
    with ExitStack() as started:

        def build(**fields: Any) -> ImdsEmulator:
            scenario = Scenario.from_mapping({**FLEET, **fields})
            emulator = ImdsEmulator(
                scenario=scenario, time_scale=1, started_min_seconds=STARTED_MIN, throttle_rps=0, clock=clock
            )
            return started.enter_context(emulator)

        yield build


def iso(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


def get_doc(imds: ImdsEmulator, vm: str) -> dict[str, Any]:
    response = requests.get(imds.scheduled_events_url(vm), headers=META, timeout=5)
    assert response.status_code == 200, response.text
    document: dict[str, Any] = response.json()
    return document


def shown(imds: ImdsEmulator, vm: str) -> dict[str, str]:
    return {event["EventId"]: event["EventStatus"] for event in get_doc(imds, vm)["Events"]}


def post_start(imds: ImdsEmulator, vm: str, *event_ids: str) -> requests.Response:
    body = {"StartRequests": [{"EventId": event_id} for event_id in event_ids]}
    return requests.post(imds.scheduled_events_url(vm), headers=META, json=body, timeout=5)


def create(imds: ImdsEmulator, **fields: Any) -> requests.Response:
    return requests.post(imds.url + "/_emulator/events", json=fields, timeout=5)


def created_id(imds: ImdsEmulator, **fields: Any) -> str:
    response = create(imds, **fields)
    assert response.status_code == 201, response.text
    event_id: str = response.json()["EventId"]
    return event_id


def summaries(imds: ImdsEmulator) -> dict[str, dict[str, Any]]:
    listed = requests.get(imds.url + "/_emulator/events", timeout=5).json()
    return {event["EventId"]: event for event in listed}


def control_vms(imds: ImdsEmulator) -> dict[str, dict[str, Any]]:
    return {vm["name"]: vm for vm in requests.get(imds.url + "/_emulator/vms", timeout=5).json()}


def every_imds_call(imds: ImdsEmulator, vm: str) -> list[Callable[[], requests.Response]]:
    base = imds.url_for(vm)
    return [
        lambda: requests.get(base + SE + "?api-version=2020-07-01", headers=META, timeout=5),
        lambda: requests.get(base + "/metadata/instance?api-version=2021-02-01", headers=META, timeout=5),
        lambda: requests.get(
            base + "/metadata/identity/oauth2/token?api-version=2018-02-01&resource=https://management.azure.com/",
            headers=META,
            timeout=5,
        ),
        lambda: requests.post(
            base + SE + "?api-version=2020-07-01", headers=META, json={"StartRequests": [{"EventId": "x"}]}, timeout=5
        ),
        lambda: requests.get(base + SE, timeout=5),  # even a request IMDS would refuse gets no answer
    ]


def assert_no_answer(call: Callable[[], requests.Response]) -> None:
    # The connection closes without a status line: requests reports a connection error, never a response.
    with pytest.raises(requests.ConnectionError):
        call()


# ---- removed VMs stop answering ------------------------------------------------------------------------------


def test_a_deleted_vm_answers_nothing_while_its_group_sees_the_delete_start_then_leave(make, clock):
    imds = make()
    event_id = created_id(imds, EventType="Terminate", Resources=["web_1"])
    incarnation = get_doc(imds, "web_0")["DocumentIncarnation"]
    with requests.Session() as keep_alive:
        assert keep_alive.get(imds.scheduled_events_url("web_1"), headers=META, timeout=5).status_code == 200
        assert post_start(imds, "web_1", event_id).status_code == 200  # the approval itself is answered
        approved_at = clock.now()
        with pytest.raises(requests.ConnectionError):
            keep_alive.get(imds.scheduled_events_url("web_1"), headers=META, timeout=5)
    for call in every_imds_call(imds, "web_1"):
        assert_no_answer(call)
    # The rest of the placement group sees the delete Started, then leave the list.
    assert shown(imds, "web_0") == {event_id: "Started"}
    assert get_doc(imds, "web_0")["DocumentIncarnation"] == incarnation + 1
    removed = {"EventId": event_id, "EventType": "Terminate", "at": iso(approved_at)}
    vms = control_vms(imds)
    assert vms["web_1"]["removed"] == removed
    assert vms["web_1"]["requestsUnanswered"] == 1 + len(every_imds_call(imds, "web_1"))
    assert vms["web_1"]["events"] == []
    assert vms["web_0"]["removed"] is None
    status = requests.get(imds.url + "/_emulator/status", timeout=5).json()
    assert status["removedVms"] == {"web_1": removed}
    assert summaries(imds)[event_id]["vmsRemovedAt"] == iso(approved_at)
    assert [(a["EventId"], a["vm"]) for a in imds.approvals()] == [(event_id, "web_1")]
    clock.advance(STARTED_MIN - 1)
    assert shown(imds, "web_2") == {event_id: "Started"}
    clock.advance(1)
    assert shown(imds, "web_2") == {}
    assert get_doc(imds, "web_0")["DocumentIncarnation"] == incarnation + 2
    assert summaries(imds)[event_id]["state"] == "Completed"
    # A VM that no longer exists can be named by no new event.
    refused = create(imds, EventType="Freeze", Resources=["web_0", "web_1"])
    assert refused.status_code == 400
    assert f"web_1 was removed by Terminate {event_id}" in refused.json()["error"]
    assert_no_answer(every_imds_call(imds, "web_1")[0])  # still gone


def test_a_lone_spot_vm_evicted_at_not_before_is_gone_and_nobody_else_saw_it(make, clock):
    imds = make()
    event_id = created_id(imds, EventType="Preempt", Resources=["solo"])  # 30 s notice
    assert shown(imds, "solo") == {event_id: "Scheduled"}
    clock.advance(29)
    assert shown(imds, "solo") == {event_id: "Scheduled"}
    clock.advance(1)
    for call in every_imds_call(imds, "solo"):
        assert_no_answer(call)
    assert all(shown(imds, vm) == {} for vm in ("web_0", "web_1", "web_2"))  # isolated: nobody else saw it
    summary = summaries(imds)[event_id]
    assert (summary["state"], summary["startedBy"], summary["vmsRemovedAt"]) == (
        "Started",
        "notBefore",
        iso(clock.now()),
    )
    assert imds.removed_vms() == {"solo": {"EventId": event_id, "EventType": "Preempt", "at": iso(clock.now())}}
    clock.advance(STARTED_MIN)
    assert summaries(imds)[event_id]["state"] == "Completed"


def test_a_deleted_vm_can_be_given_time_to_see_its_delete_started(make, clock):
    imds = make(vmGoneAfterStartedSeconds=60)
    event_id = created_id(imds, EventType="Terminate", Resources=["web_1"])
    assert post_start(imds, "web_1", event_id).status_code == 200
    clock.advance(59)
    assert shown(imds, "web_1") == {event_id: "Started"}
    clock.advance(1)
    assert_no_answer(every_imds_call(imds, "web_1")[0])
    assert control_vms(imds)["web_1"]["removed"]["at"] == iso(clock.now())


def test_events_left_only_for_removed_vms_are_canceled_shared_ones_stay(make, clock):
    imds = make()
    reboot = created_id(imds, EventType="Reboot", Resources=["web_1"])
    freeze = created_id(imds, EventType="Freeze", Resources=["web_0", "web_1"])
    delete = created_id(imds, EventType="Terminate", Resources=["web_1"])
    assert post_start(imds, "web_1", delete).status_code == 200
    assert shown(imds, "web_0") == {freeze: "Scheduled", delete: "Started"}  # the reboot left with web_1
    history = summaries(imds)
    assert (history[reboot]["state"], history[reboot]["canceledBy"]) == ("Canceled", "vms-removed")
    assert history[freeze]["state"] == "Scheduled"
    assert post_start(imds, "web_0", reboot).status_code == 400  # gone: no longer valid for anyone


# ---- approvals that take effect later ------------------------------------------------------------------------


def test_an_approval_waits_for_the_other_tenants_of_the_host(make, clock):
    imds = make(startDelaySeconds=120)
    event_id = created_id(imds, EventType="Freeze", Resources=["web_0"])
    at_once = created_id(imds, EventType="Freeze", Resources=["web_2"], StartDelaySeconds=0)
    approved_at = clock.now()
    assert post_start(imds, "web_0", event_id, at_once).status_code == 200
    # Recorded when accepted, as the local runner measures approval latency from it.
    assert [(a["EventId"], a["at"]) for a in imds.approvals()] == [
        (event_id, iso(approved_at)),
        (at_once, iso(approved_at)),
    ]
    assert shown(imds, "web_1") == {event_id: "Scheduled", at_once: "Started"}  # the event's own setting wins
    summary = summaries(imds)[event_id]
    assert (summary["approvedAt"], summary["startDelaySeconds"]) == (iso(approved_at), 120)
    assert summary["startsAfterApproval"] == iso(approved_at + timedelta(seconds=120))
    clock.advance(119)
    assert shown(imds, "web_0")[event_id] == "Scheduled"
    clock.advance(1)
    assert shown(imds, "web_0")[event_id] == "Started"
    summary = summaries(imds)[event_id]
    assert (summary["startedBy"], summary["startedAt"]) == ("approval", iso(approved_at + timedelta(seconds=120)))


def test_the_platform_may_ignore_an_approval_until_not_before(make, clock):
    imds = make()
    event_id = created_id(
        imds, EventType="Reboot", Resources=["web_0"], NoticeSeconds=600, StartDelaySeconds="NotBefore"
    )
    assert post_start(imds, "web_0", event_id).status_code == 200
    assert [a["EventId"] for a in imds.approvals()] == [event_id]
    clock.advance(599)
    assert shown(imds, "web_0") == {event_id: "Scheduled"}
    summary = summaries(imds)[event_id]
    assert (summary["approvedAt"] is not None, summary["startsAfterApproval"]) == (True, None)
    clock.advance(1)
    assert shown(imds, "web_0") == {event_id: "Started"}
    assert summaries(imds)[event_id]["startedBy"] == "notBefore"


def test_pending_deletes_go_together_once_the_last_approval_takes_effect(make, clock):
    imds = make()
    slow = created_id(imds, EventType="Terminate", Resources=["web_0"], StartDelaySeconds=60)
    quick = created_id(imds, EventType="Terminate", Resources=["web_1"])
    assert post_start(imds, "web_1", quick).status_code == 200
    assert post_start(imds, "web_0", slow).status_code == 200
    approved_at = clock.now()
    # web_0's delete is approved but not yet in effect, so it is still pending and holds web_1's back.
    assert shown(imds, "web_2") == {slow: "Scheduled", quick: "Scheduled"}
    clock.advance(59)
    assert shown(imds, "web_2") == {slow: "Scheduled", quick: "Scheduled"}
    clock.advance(1)
    assert shown(imds, "web_2") == {slow: "Started", quick: "Started"}
    history = summaries(imds)
    assert history[slow]["startedAt"] == history[quick]["startedAt"] == iso(approved_at + timedelta(seconds=60))
    assert set(imds.removed_vms()) == {"web_0", "web_1"}


# ---- update domains, priorities ------------------------------------------------------------------------------


def test_platform_maintenance_is_refused_across_update_domains(make):
    imds = make()
    for fields in (
        {"EventType": "Freeze"},
        {"EventType": "Redeploy", "EventSource": "Platform"},
        {"EventType": "Reboot", "EventStatus": "Started"},  # a hardware failure is a Platform Reboot too
    ):
        refused = create(imds, Resources=["web_0", "web_2"], **fields)
        assert refused.status_code == 400, fields
        error = refused.json()["error"]
        assert "one update domain" in error
        assert "update domain 0: ['web_0']; update domain 1: ['web_2']" in error
    assert imds.events() == []
    # Within one domain it is accepted; user operations and deletes are not bound to update domains.
    assert create(imds, EventType="Freeze", Resources=["web_0", "web_1"]).status_code == 201
    assert create(imds, EventType="Reboot", EventSource="User", Resources=["web_0", "web_2"]).status_code == 201
    assert create(imds, EventType="Terminate", Resources=["web_0", "web_2"]).status_code == 201
    leaf = requests.get(
        imds.url_for("web_2") + "/metadata/instance/compute/platformUpdateDomain?api-version=2021-02-01&format=text",
        headers=META,
        timeout=5,
    )
    assert (leaf.status_code, leaf.text) == (200, "1")  # given as a number in the scenario, served as a string


def test_terminate_is_refused_for_spot_and_low_priority_vms(make):
    imds = make()
    for vm, priority in (("web_3", "Spot"), ("web_4", "Low")):
        refused = create(imds, EventType="Terminate", Resources=["web_0", vm])
        assert refused.status_code == 400
        assert f"{vm} (priority {priority})" in refused.json()["error"]
        assert "web_0 (priority" not in refused.json()["error"]
    assert imds.events() == []
    assert create(imds, EventType="Preempt", Resources=["web_4"]).status_code == 201  # low priority is evicted
    compute = requests.get(
        imds.url_for("web_4") + "/metadata/instance/compute?api-version=2021-02-01", headers=META, timeout=5
    ).json()
    assert compute["priority"] == "Low"


def test_priority_values_are_azures():
    with pytest.raises(ScenarioError, match=r"vms\.0\.priority"):
        Scenario.from_mapping({"vms": [{"name": "a", "priority": "spot"}]})


# ---- Descriptions ----------------------------------------------------------------------------------------------


USER_REBOOT = "Virtual machine is going to be restarted as requested by authorized user."


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"EventType": "Freeze"}, ("Platform", DESCRIPTION_LIVE_MIGRATION, None)),
        ({"EventType": "Reboot"}, ("Platform", DESCRIPTION_HOST_MAINTENANCE, None)),
        ({"EventType": "Redeploy"}, ("Platform", DESCRIPTION_INFRASTRUCTURE_MAINTENANCE, None)),
        ({"EventType": "Preempt", "Resources": ["solo"]}, ("Platform", DESCRIPTION_EVICTION, None)),
        # An actual hardware failure: straight to Started, Platform, an emergency repair.
        (
            {"EventType": "Reboot", "EventStatus": "Started"},
            ("Platform", DESCRIPTION_EMERGENCY_REPAIR, "hardware-failure"),
        ),
        ({"EventType": "Reboot", "EventSource": "User"}, ("User", USER_REBOOT, None)),
        (
            {"EventType": "Redeploy", "EventSource": "User"},
            ("User", "Virtual machine is going to be redeployed as requested by authorized user.", None),
        ),
        # A user reboot the scheduledEventsPolicy approves automatically appears Started: not a hardware failure.
        (
            {"EventType": "Reboot", "EventSource": "User", "EventStatus": "Started"},
            ("User", USER_REBOOT, "automatic-approval"),
        ),
        (
            {"EventType": "Terminate"},
            ("User", "Virtual machine is going to be deleted as requested by authorized user.", None),
        ),
    ],
)
def test_the_default_description_matches_type_status_and_source(make, fields, expected):
    imds = make()
    fields = {"Resources": ["web_0"], **fields}
    event_id = created_id(imds, **fields)
    [event] = [e for e in get_doc(imds, fields["Resources"][0])["Events"] if e["EventId"] == event_id]
    assert (event["EventSource"], event["Description"], summaries(imds)[event_id]["startedBy"]) == expected


# ---- NotBefore with other offsets, Microsoft's mock server -----------------------------------------------------


@pytest.mark.parametrize(
    "given",
    [
        "2026-01-05T17:45:00+05:30",
        "Mon, 05 Jan 2026 17:45:00 +0530",
        "2026-01-05T07:15:00-05:00",
        "2026-01-05T12:15:00Z",
    ],
)
def test_not_before_with_any_offset_is_the_same_instant_in_gmt(make, given):
    imds = make()
    event_id = created_id(imds, EventType="Freeze", Resources=["web_0"], NotBefore=given)
    assert shown(imds, "web_0") == {event_id: "Scheduled"}
    [event] = get_doc(imds, "web_0")["Events"]
    assert event["NotBefore"] == "Mon, 05 Jan 2026 12:15:00 GMT"
    assert summaries(imds)[event_id]["NotBefore"] == "Mon, 05 Jan 2026 12:15:00 GMT"


def test_not_before_in_a_scenario_file_with_an_offset(tmp_path: Path, clock):
    path = tmp_path / "offset.yaml"
    path.write_text(
        "vms: [{name: a}]\n"
        "steps:\n"
        "  - {at: 0, create: {EventType: Freeze, Resources: [a], NotBefore: 2026-01-05T17:45:00+05:30}}\n"
        "  - {at: 0, create: {EventType: Reboot, Resources: [a], NotBefore: 'Mon, 05 Jan 2026 13:15:00 +0100'}}\n",
        encoding="utf-8",
    )
    with ImdsEmulator(scenario=Scenario.from_file(path), throttle_rps=0, clock=clock) as imds:
        events = get_doc(imds, "a")["Events"]
        assert [e["NotBefore"] for e in events] == ["Mon, 05 Jan 2026 12:15:00 GMT"] * 2
    bad = create_error({"EventType": "Freeze", "Resources": ["a"], "NotBefore": "tomorrow at noon"})
    assert "NotBefore" in bad
    assert "tomorrow at noon" in bad


def create_error(body: dict[str, Any]) -> str:
    with ImdsEmulator(scenario=Scenario.from_mapping({"vms": [{"name": "a"}]}), throttle_rps=0) as imds:
        response = create(imds, **body)
        assert response.status_code == 400
        error: str = response.json()["error"]
        return error


def test_mock_server_mode_iso_not_before_and_a_new_event_id_once_started(make, clock):
    imds = make(notBeforeFormat="ISO8601", newEventIdWhenStarted=True)
    first = created_id(imds, EventType="Freeze", Resources=["web_0"], NoticeSeconds=600)
    [event] = get_doc(imds, "web_1")["Events"]
    assert re.match(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$", event["NotBefore"])
    assert datetime.fromisoformat(event["NotBefore"]) == clock.now() + timedelta(seconds=600)
    assert post_start(imds, "web_0", first).status_code == 200
    [started] = get_doc(imds, "web_1")["Events"]
    assert started["EventStatus"] == "Started"
    assert started["NotBefore"] == ""
    assert started["EventId"] != first
    assert post_start(imds, "web_0", first).status_code == 400  # the old id is not in any document any more
    assert post_start(imds, "web_0", started["EventId"]).status_code == 200
    summary = summaries(imds)[started["EventId"]]
    assert summary["formerEventIds"] == [first]
    assert [a["EventId"] for a in imds.approvals()] == [first, started["EventId"]]


def test_mock_server_options_per_event(make, clock):
    imds = make()
    mock_like = created_id(
        imds, EventType="Freeze", Resources=["web_0"], NotBeforeFormat="ISO8601", NewEventIdWhenStarted=True
    )
    plain = created_id(imds, EventType="Freeze", Resources=["web_2"])
    formats = {e["EventId"]: e["NotBefore"] for e in get_doc(imds, "web_1")["Events"]}
    assert formats[mock_like].endswith("Z")
    assert RFC1123.match(formats[plain])
    clock.advance(900)  # both start at NotBefore
    started = {e["EventId"] for e in get_doc(imds, "web_1")["Events"]}
    assert plain in started
    assert mock_like not in started
    assert len(started) == 2


# ---- scenario fields for the local runner ----------------------------------------------------------------------


def test_hooks_and_forwarder_wipe_are_validated_exposed_and_otherwise_ignored(clock):
    scenario = Scenario.from_mapping(
        {
            "vms": [
                {
                    "name": "web_2",
                    "vmScaleSetName": "web",
                    "hooks": {
                        "prepare": [
                            {"name": "10-check", "exitCode": 1},
                            {"name": "20-drain", "exitCode": 0, "seconds": 2},
                        ],
                        "recover": [{"name": "10_up", "exitCode": 0}],
                    },
                },
                {"name": "web_1", "vmScaleSetName": "web"},
            ],
            "steps": [{"at": 200, "wipeForwarderState": "web_1"}],
        }
    )
    hooks = scenario.vms[0].hooks
    assert hooks is not None
    assert [(h.name, h.exitCode, h.seconds) for h in hooks.prepare] == [("10-check", 1, 0), ("20-drain", 0, 2)]
    assert [h.name for h in hooks.recover] == ["10_up"]
    assert scenario.vms[1].hooks is None
    assert scenario.steps[0].wipeForwarderState == "web_1"
    with ImdsEmulator(scenario=scenario, throttle_rps=0, clock=clock) as imds:
        before = get_doc(imds, "web_1")
        clock.advance(200)
        assert get_doc(imds, "web_1") == before  # nothing changes in IMDS
        status = requests.get(imds.url + "/_emulator/status", timeout=5).json()
        assert status["stepErrors"] == []
        vms = control_vms(imds)
        assert vms["web_2"]["hooks"]["prepare"][1] == {"name": "20-drain", "exitCode": 0, "seconds": 2}
        compute = requests.get(
            imds.url_for("web_2") + "/metadata/instance/compute?api-version=2021-02-01", headers=META, timeout=5
        ).json()
        assert "hooks" not in compute


@pytest.mark.parametrize(
    ("hooks", "field", "reason"),
    [
        ({"prepare": [{"name": "10 check", "exitCode": 0}]}, r"vms\.0\.hooks\.prepare\.0\.name", "run-parts"),
        ({"prepare": [{"name": "10.sh", "exitCode": 0}]}, r"vms\.0\.hooks\.prepare\.0\.name", "run-parts"),
        ({"prepare": [{"name": "a", "exitCode": 256}]}, r"vms\.0\.hooks\.prepare\.0\.exitCode", "255"),
        ({"recover": [{"name": "a", "exitCode": -1}]}, r"vms\.0\.hooks\.recover\.0\.exitCode", "0"),
        ({"prepare": [{"name": "a", "exitCode": 0, "seconds": -1}]}, r"vms\.0\.hooks\.prepare\.0\.seconds", "0"),
        ({"prepare": [{"name": "a"}]}, r"vms\.0\.hooks\.prepare\.0\.exitCode", "required"),
        (
            {"prepare": [{"name": "a", "exitCode": 0, "timeout": 3}]},
            r"vms\.0\.hooks\.prepare\.0\.timeout",
            "not permitted",
        ),
        ({"drain": []}, r"vms\.0\.hooks\.drain", "not permitted"),
        ({"prepare": [{"name": "a", "exitCode": 0}, {"name": "a", "exitCode": 1}]}, r"vms\.0\.hooks", "twice"),
        ({"prepare": {"name": "a", "exitCode": 0}}, r"vms\.0\.hooks\.prepare", "list"),
    ],
)
def test_bad_hooks_are_refused_naming_the_field(hooks, field, reason):
    with pytest.raises(ScenarioError, match=field) as caught:
        Scenario.from_mapping({"vms": [{"name": "a", "hooks": hooks}]})
    assert reason in str(caught.value)


def test_bad_wipe_steps_are_refused():
    with pytest.raises(ScenarioError, match=r"steps\.0\.wipeForwarderState: unknown VM 'ghost'"):
        Scenario.from_mapping({"vms": [{"name": "a"}], "steps": [{"at": 1, "wipeForwarderState": "ghost"}]})
    with pytest.raises(ScenarioError, match="exactly one of"):
        Scenario.from_mapping(
            {
                "vms": [{"name": "a"}],
                "steps": [{"at": 1, "wipeForwarderState": "a", "cancel": "00000000-0000-0000-0000-000000000000"}],
            }
        )


def test_bad_event_timing_options_are_refused():
    for body, field in (
        ({"StartDelaySeconds": -1}, "StartDelaySeconds"),
        ({"StartDelaySeconds": "later"}, "StartDelaySeconds"),
        ({"NotBeforeFormat": "unix"}, "NotBeforeFormat"),
        ({"EventStatus": "Started", "StartDelaySeconds": 5}, "StartDelaySeconds"),
        ({"EventStatus": "Started", "NewEventIdWhenStarted": True}, "NewEventIdWhenStarted"),
    ):
        assert field in create_error({"EventType": "Reboot", "Resources": ["a"], **body})
    with pytest.raises(ScenarioError, match="vmGoneAfterStartedSeconds"):
        Scenario.from_mapping({"vms": [{"name": "a"}], "vmGoneAfterStartedSeconds": -1})
    with pytest.raises(ScenarioError, match=r"vms\.0\.platformUpdateDomain"):
        Scenario.from_mapping({"vms": [{"name": "a", "platformUpdateDomain": "one"}]})


def test_not_before_parse_keeps_the_instant_in_utc():
    parsed = EventCreate(EventType="Freeze", Resources=["a"], NotBefore="2026-01-05T17:45:00+05:30").NotBefore
    assert parsed == datetime(2026, 1, 5, 12, 15, tzinfo=UTC)
    assert parsed is not None
    assert parsed.utcoffset() == timedelta(0)
