"""The IMDS emulator over real HTTP on loopback: protocol, lifecycle, several VMs, faults, metadata, tokens."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from emulators.imds import ImdsEmulator, ManualClock, Scenario
from emulators.imds.models import DESCRIPTION_INFRASTRUCTURE_MAINTENANCE
from emulators.tokens import verify_token
from tests.polling import wait_for

SE = "/metadata/scheduledevents"
META = {"Metadata": "true"}
GUID = re.compile(r"^[0-9A-F]{8}-[0-9A-F]{4}-[0-9A-F]{4}-[0-9A-F]{4}-[0-9A-F]{12}$")

FLEET = {
    "scaleSets": {"web": {"terminateNotBeforeSeconds": 300}},
    "vms": [
        {"name": "web_0", "vmScaleSetName": "web", "placementGroupId": "pg1", "zone": "1"},
        {"name": "web_1", "vmScaleSetName": "web", "placementGroupId": "pg1", "zone": "1"},
        {"name": "web_2", "vmScaleSetName": "web", "placementGroupId": "pg1", "zone": "1"},
        {"name": "solo", "zone": "2", "isolated": True, "priority": "Spot"},
    ],
}


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def imds(clock: ManualClock) -> Iterator[ImdsEmulator]:
    # Time moves only when a test advances `clock`, so a loaded machine cannot reorder what a test checks.
    # 600x: a 15-minute notice lasts 1.5 s; a Started event stays 0.5 s. Throttling off: tests poll fast.
    with ImdsEmulator(
        scenario=Scenario.from_mapping(FLEET), time_scale=600, started_min_seconds=300, throttle_rps=0, clock=clock
    ) as emulator:
        yield emulator


@pytest.fixture
def live_imds() -> Iterator[ImdsEmulator]:
    """The same on the wall clock: time scaling as a real client experiences it."""
    with ImdsEmulator(
        scenario=Scenario.from_mapping(FLEET), time_scale=600, started_min_seconds=300, throttle_rps=0
    ) as emulator:
        yield emulator


def get_doc(imds: ImdsEmulator, vm: str | None = None, version: str = "2020-07-01") -> dict[str, Any]:
    response = requests.get(imds.scheduled_events_url(vm, api_version=version), headers=META, timeout=5)
    assert response.status_code == 200, response.text
    document: dict[str, Any] = response.json()
    return document


def post_start(imds: ImdsEmulator, vm: str | None, body: Any, **kwargs: Any) -> requests.Response:
    base = imds.url_for(vm) if vm else imds.url
    data = body if isinstance(body, str | bytes) else json.dumps(body)
    return requests.post(base + SE, params={"api-version": "2020-07-01"}, headers=META, data=data, timeout=5, **kwargs)


# ---- protocol ------------------------------------------------------------------------------------------------


def test_metadata_header_is_required(imds):
    for headers in ({}, {"Metadata": "false"}):
        response = requests.get(imds.scheduled_events_url(), headers=headers, timeout=5)
        assert response.status_code == 400
        assert response.json() == {"error": "Bad request. Required metadata header not specified"}
    assert requests.get(imds.scheduled_events_url(), headers={"Metadata": "True"}, timeout=5).status_code == 200


def test_x_forwarded_for_is_refused(imds):
    response = requests.get(imds.scheduled_events_url(), headers={**META, "X-Forwarded-For": "10.0.0.9"}, timeout=5)
    assert response.status_code == 400
    assert "X-Forwarded-For" in response.json()["error"]


@pytest.mark.parametrize("query", ["", "?api-version=", "?api-version={latest}", "?api-version=2021-01-01"])
def test_api_version_is_required_and_checked(imds, query):
    response = requests.get(imds.url + SE + query, headers=META, timeout=5)
    assert response.status_code == 400
    body = response.json()
    assert body["error"].startswith("Bad request. api-version")
    assert body["newest-versions"] == ["2020-07-01", "2019-08-01", "2019-04-01"]


@pytest.mark.parametrize(
    "version", ["2017-03-01", "2017-08-01", "2017-11-01", "2019-01-01", "2019-04-01", "2019-08-01", "2020-07-01"]
)
def test_every_documented_version_is_served_with_its_fields(imds, version):
    imds.create_event(EventType="Freeze", Resources=["web_0"])
    [event] = get_doc(imds, "web_0", version)["Events"]
    assert ("Description" in event) == (version >= "2019-04-01")
    assert ("EventSource" in event) == (version >= "2019-08-01")
    assert ("DurationInSeconds" in event) == (version >= "2020-07-01")
    assert event["Resources"] == (["_web_0"] if version == "2017-03-01" else ["web_0"])


def test_start_requests_malformed_bodies_are_400_and_change_nothing(imds):
    event = imds.create_event(EventType="Freeze", Resources=["web_0"])
    for body in ["not json", "{}", '{"StartRequests": []}', '{"StartRequests": [{"Id": "x"}]}', "[1]"]:
        response = post_start(imds, "web_0", body)
        assert response.status_code == 400, body
        assert response.json()["error"].startswith("Bad request.")
    response = post_start(imds, "web_0", {"StartRequests": [{"EventId": "5DD55B64-45AD-49D3-BBC9-F57D4EA97BD7"}]})
    assert response.status_code == 400
    assert "5DD55B64-45AD-49D3-BBC9-F57D4EA97BD7" in response.json()["error"]
    assert imds.approvals() == []
    assert get_doc(imds, "web_0")["Events"][0]["EventStatus"] == "Scheduled"
    assert get_doc(imds, "web_0")["Events"][0]["EventId"] == event["EventId"]


def test_wrong_method_and_path(imds):
    assert requests.delete(imds.scheduled_events_url(), headers=META, timeout=5).status_code == 405
    assert (
        requests.get(imds.url + "/metadata/nothing?api-version=2020-07-01", headers=META, timeout=5).status_code == 404
    )


# ---- lifecycle -----------------------------------------------------------------------------------------------


def test_lifecycle_scheduled_to_started_at_not_before_then_removed(live_imds):
    imds = live_imds
    created = imds.create_event(EventType="Freeze", Resources=["web_0"])
    assert GUID.match(created["EventId"])
    first = get_doc(imds, "web_0")
    [event] = first["Events"]
    assert event["EventStatus"] == "Scheduled"
    assert re.match(r"^[A-Z][a-z]{2}, \d{2} [A-Z][a-z]{2} \d{4} \d{2}:\d{2}:\d{2} GMT$", event["NotBefore"])
    started = wait_for(
        lambda: (d := get_doc(imds, "web_0"))["Events"] and d["Events"][0]["EventStatus"] == "Started" and d,
        timeout=5.0,
    )
    assert started["Events"][0]["NotBefore"] == ""
    assert started["Events"][0]["EventId"] == created["EventId"]  # the id never changes
    assert started["DocumentIncarnation"] == first["DocumentIncarnation"] + 1
    gone = wait_for(lambda: (d := get_doc(imds, "web_0"))["Events"] == [] and d, timeout=5.0)
    assert gone["DocumentIncarnation"] == first["DocumentIncarnation"] + 2
    [summary] = imds.events()
    assert summary["state"] == "Completed"
    assert summary["startedBy"] == "notBefore"
    assert summary["scheduledAt"] < summary["startedAt"] < summary["removedAt"]


def test_approval_over_http_starts_the_event_for_the_whole_group(imds):
    event = imds.create_event(EventType="Freeze", Resources=["web_0", "web_1"])
    response = post_start(imds, "web_1", {"StartRequests": [{"EventId": event["EventId"]}]})
    assert (response.status_code, response.content) == (200, b"")
    assert [e["EventStatus"] for e in get_doc(imds, "web_0")["Events"]] == ["Started"]
    assert [e["EventStatus"] for e in get_doc(imds, "web_2")["Events"]] == ["Started"]  # same placement group
    again = post_start(imds, "web_0", {"StartRequests": [{"EventId": event["EventId"]}]})
    assert again.status_code == 200  # already started: still 200, as documented
    approvals = requests.get(imds.url + "/_emulator/approvals", timeout=5).json()
    assert [(a["EventId"], a["vm"], a["statusBefore"]) for a in approvals] == [
        (event["EventId"], "web_1", "Scheduled"),
        (event["EventId"], "web_0", "Started"),
    ]
    assert all(isinstance(a["incarnation"], int) and a["at"].endswith("Z") for a in approvals)


def test_cancellation_and_hardware_failure_over_the_control_api(imds):
    created = requests.post(
        imds.url + "/_emulator/events", json={"EventType": "Redeploy", "Resources": ["web_2"]}, timeout=5
    )
    assert created.status_code == 201
    event_id = created.json()["EventId"]
    assert [e["EventId"] for e in get_doc(imds, "web_2")["Events"]] == [event_id]
    canceled = requests.post(imds.url + f"/_emulator/events/{event_id}/cancel", timeout=5)
    assert canceled.status_code == 200
    assert canceled.json()["state"] == "Canceled"
    assert get_doc(imds, "web_2")["Events"] == []
    failure = requests.post(
        imds.url + "/_emulator/events",
        json={"EventType": "Reboot", "Resources": ["web_2"], "EventStatus": "Started"},
        timeout=5,
    ).json()
    [shown] = get_doc(imds, "web_2")["Events"]
    assert (shown["EventId"], shown["EventStatus"], shown["NotBefore"]) == (failure["EventId"], "Started", "")
    history = {e["EventId"]: e for e in requests.get(imds.url + "/_emulator/events", timeout=5).json()}
    assert history[event_id]["state"] == "Canceled"
    assert history[event_id]["startedAt"] is None
    assert history[event_id]["removedAt"] is not None


def test_control_api_rejects_bad_events_naming_the_field(imds):
    response = requests.post(imds.url + "/_emulator/events", json={"EventType": "Melt", "Resources": []}, timeout=5)
    assert response.status_code == 400
    assert "EventType" in response.json()["error"]
    assert "Resources" in response.json()["error"]
    response = requests.post(
        imds.url + "/_emulator/events", json={"EventType": "Freeze", "Resources": ["ghost"]}, timeout=5
    )
    assert response.status_code == 400
    assert "ghost" in response.json()["error"]
    assert requests.post(imds.url + "/_emulator/events", data="{", timeout=5).status_code == 400
    assert imds.events() == []


def test_terminate_rules_over_http(imds, clock):
    pending = imds.create_event(EventType="Terminate", Resources=["web_1"], NoticeSeconds=600)
    approved = imds.create_event(EventType="Terminate", Resources=["web_2"], NoticeSeconds=900)
    assert post_start(imds, "web_2", {"StartRequests": [{"EventId": approved["EventId"]}]}).status_code == 200
    states = {e["EventId"]: e["EventStatus"] for e in get_doc(imds, "web_2")["Events"]}
    assert states == {pending["EventId"]: "Scheduled", approved["EventId"]: "Scheduled"}
    clock.advance(0.99)
    assert {e["EventStatus"] for e in get_doc(imds, "web_0")["Events"]} == {"Scheduled"}
    clock.advance(0.01)  # web_1's delete times out (600 s / 600): then both go together
    assert {e["EventStatus"] for e in get_doc(imds, "web_0")["Events"]} == {"Started"}
    summary = {e["EventId"]: e for e in imds.events()}
    assert summary[pending["EventId"]]["startedBy"] == "notBefore"
    assert summary[approved["EventId"]]["startedBy"] == "approval"
    assert summary[pending["EventId"]]["startedAt"] == summary[approved["EventId"]]["startedAt"]


# ---- several VMs ---------------------------------------------------------------------------------------------


def test_vm_selection_by_prefix_header_or_default(imds):
    own = imds.create_event(EventType="Preempt", Resources=["solo"])
    assert get_doc(imds)["Events"] == []  # no VM named: the first VM (web_0)
    assert [e["EventId"] for e in get_doc(imds, "solo")["Events"]] == [own["EventId"]]
    by_header = requests.get(imds.scheduled_events_url(), headers={**META, "X-Emulator-VM": "solo"}, timeout=5).json()
    assert [e["EventId"] for e in by_header["Events"]] == [own["EventId"]]
    unknown = requests.get(imds.url + "/vm/ghost" + SE + "?api-version=2020-07-01", headers=META, timeout=5)
    assert unknown.status_code == 404
    assert "ghost" in unknown.json()["error"]


def test_each_vm_keeps_its_own_incarnation(imds):
    before = {vm.name: get_doc(imds, vm.name)["DocumentIncarnation"] for vm in imds.vms()}
    imds.create_event(EventType="Preempt", Resources=["solo"])
    after = {vm.name: get_doc(imds, vm.name)["DocumentIncarnation"] for vm in imds.vms()}
    assert after == {**before, "solo": before["solo"] + 1}
    vms = {vm["name"]: vm for vm in requests.get(imds.url + "/_emulator/vms", timeout=5).json()}
    assert vms["solo"]["DocumentIncarnation"] == after["solo"]
    assert vms["solo"]["requests"] == 2


# ---- faults --------------------------------------------------------------------------------------------------


def test_error_burst_then_recovery(imds):
    response = requests.post(
        imds.url + "/_emulator/faults",
        json={"kind": "error-burst", "count": 3, "status": 503, "vm": "web_1"},
        timeout=5,
    )
    assert response.status_code == 201
    assert [requests.get(imds.scheduled_events_url("web_0"), headers=META, timeout=5).status_code] == [200]
    codes = [requests.get(imds.scheduled_events_url("web_1"), headers=META, timeout=5).status_code for _ in range(4)]
    assert codes == [503, 503, 503, 200]


def test_malformed_json_fault(imds):
    imds.inject_fault(kind="malformed-json", count=1)
    broken = requests.get(imds.scheduled_events_url(), headers=META, timeout=5)
    assert broken.status_code == 200
    with pytest.raises(ValueError):  # noqa: PT011 - requests' JSON error type differs by version
        broken.json()
    assert "DocumentIncarnation" in get_doc(imds)


def test_hang_fault_makes_a_client_time_out(imds):
    imds.inject_fault(kind="hang", seconds=2, count=1)
    started = time.monotonic()
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.get(imds.scheduled_events_url(), headers=META, timeout=0.3)
    assert time.monotonic() - started < 1.5
    assert get_doc(imds)["Events"] == []


def test_first_call_delay_is_scaled_and_once_per_vm(imds):
    imds.inject_fault(kind="first-call-delay", seconds=300, endpoint="all")  # 5 minutes / 600 = 0.5 s
    durations = []
    for vm in ("web_0", "web_0", "web_1"):
        started = time.monotonic()
        get_doc(imds, vm)
        durations.append(time.monotonic() - started)
    assert durations[0] >= 0.49
    assert durations[1] < 0.4
    assert durations[2] >= 0.49


def test_incarnation_reset_fault(imds):
    imds.create_event(EventType="Freeze", Resources=["web_0"])
    assert get_doc(imds, "web_0")["DocumentIncarnation"] == 2
    imds.inject_fault(kind="incarnation-reset", vm="web_0")
    document = get_doc(imds, "web_0")
    assert document["DocumentIncarnation"] == 1
    assert len(document["Events"]) == 1


def test_flaky_scenario_faults_reach_the_clients():
    scenario = Scenario.from_file("emulators/scenarios/flaky-imds.yaml")
    clock = ManualClock()  # the scenario's offsets pass only when the test says so
    with ImdsEmulator(scenario=scenario, time_scale=600, throttle_rps=0, clock=clock) as emulator:
        started = time.monotonic()
        assert requests.get(emulator.scheduled_events_url("app-0"), headers=META, timeout=5).status_code == 200
        assert time.monotonic() - started >= 0.19  # first call: 120 s / 600
        clock.advance(0.1)  # to the error burst's offset (60 s / 600); the hang (at 0.3 s) stays in the future
        codes = [
            requests.get(emulator.scheduled_events_url("app-0"), headers=META, timeout=5).status_code for _ in range(4)
        ]
        assert codes == [500, 500, 500, 200]
        status = requests.get(emulator.url + "/_emulator/status", timeout=5).json()
        assert (status["scenario"], status["stepErrors"]) == ("flaky-imds", [])


def test_throttling_above_five_requests_per_second_per_vm_by_default(clock):
    with ImdsEmulator(scenario=Scenario.from_mapping(FLEET), clock=clock) as emulator:

        def status(vm: str) -> int:
            return requests.get(emulator.scheduled_events_url(vm), headers=META, timeout=5).status_code

        assert [status("web_0") for _ in range(6)] == [200] * 5 + [429]
        assert status("web_1") == 200  # per VM
        clock.advance(0.999)
        assert status("web_0") == 429
        clock.advance(0.001)  # the window has slid past the first five
        assert status("web_0") == 200
        emulator.inject_fault(kind="throttle", requestsPerSecond=0)
        assert {status("web_1") for _ in range(8)} == {200}


def test_bad_fault_is_refused(imds):
    response = requests.post(imds.url + "/_emulator/faults", json={"kind": "hang"}, timeout=5)
    assert response.status_code == 400
    assert "seconds" in response.json()["error"]
    response = requests.post(imds.url + "/_emulator/faults", json={"kind": "error-burst", "vm": "ghost"}, timeout=5)
    assert response.status_code == 400
    assert "ghost" in response.json()["error"]


# ---- instance metadata and identity --------------------------------------------------------------------------


def test_instance_metadata_compute_and_leaf(imds):
    full = requests.get(imds.url_for("web_1") + "/metadata/instance?api-version=2021-02-01", headers=META, timeout=5)
    assert full.status_code == 200
    compute = full.json()["compute"]
    assert compute["name"] == "web_1"
    assert compute["vmScaleSetName"] == "web"
    assert compute["osProfile"]["computerName"] != compute["name"]
    for key in (
        "vmId",
        "resourceId",
        "subscriptionId",
        "resourceGroupName",
        "location",
        "zone",
        "platformFaultDomain",
        "platformUpdateDomain",
        "placementGroupId",
        "priority",
    ):
        assert isinstance(compute[key], str), key
    assert compute["resourceId"].endswith("/virtualMachineScaleSets/web/virtualMachines/1")
    only = requests.get(
        imds.url_for("web_1") + "/metadata/instance/compute?api-version=2021-02-01", headers=META, timeout=5
    )
    assert only.json() == compute
    leaf = requests.get(
        imds.url_for("web_1") + "/metadata/instance/compute/vmId?api-version=2021-02-01&format=text",
        headers=META,
        timeout=5,
    )
    assert leaf.text == compute["vmId"]
    assert (
        requests.get(imds.url + "/metadata/instance?api-version=2099-01-01", headers=META, timeout=5).status_code == 400
    )
    assert requests.get(imds.url + "/metadata/instance?api-version=2021-02-01", timeout=5).status_code == 400


def test_token_endpoint_shape(imds):
    response = requests.get(
        imds.url_for("web_2") + "/metadata/identity/oauth2/token",
        params={"api-version": "2018-02-01", "resource": "https://eventhubs.azure.net"},
        headers=META,
        timeout=5,
    )
    assert response.status_code == 200
    body = response.json()
    assert set(body) >= {"access_token", "client_id", "expires_in", "expires_on", "resource", "token_type"}
    assert body["token_type"] == "Bearer"
    assert body["resource"] == "https://eventhubs.azure.net"
    assert int(body["expires_on"]) - time.time() > 3000
    claims = verify_token(body["access_token"], audience="https://eventhubs.azure.net")
    assert claims["xms_mirid"] == next(vm.resourceId for vm in imds.vms() if vm.name == "web_2")
    missing = requests.get(
        imds.url + "/metadata/identity/oauth2/token", params={"api-version": "2018-02-01"}, headers=META, timeout=5
    )
    assert (missing.status_code, missing.json()["error"]) == (400, "invalid_request")
    other = requests.get(
        imds.url + "/metadata/identity/oauth2/token",
        params={"api-version": "2018-02-01", "resource": "https://relay.azure.net", "client_id": "someone-else"},
        headers=META,
        timeout=5,
    )
    assert other.status_code == 400


def test_managed_identity_credential_gets_each_vms_own_token(imds, monkeypatch):
    from azure.identity import ManagedIdentityCredential

    for variable in (
        "IDENTITY_ENDPOINT",
        "IDENTITY_HEADER",
        "IMDS_ENDPOINT",
        "MSI_ENDPOINT",
        "AZURE_FEDERATED_TOKEN_FILE",
    ):
        monkeypatch.delenv(variable, raising=False)
    identities = {}
    for vm in ("web_0", "solo"):
        for key, value in imds.identity_environment(vm).items():
            monkeypatch.setenv(key, value)
        with ManagedIdentityCredential() as credential:
            token = credential.get_token("https://relay.azure.net/.default")
        claims = verify_token(token.token, audience="https://relay.azure.net")
        identities[vm] = claims["xms_mirid"]
        assert token.expires_on > time.time() + 3000
    assert identities == {vm.name: vm.resourceId for vm in imds.vms() if vm.name in identities}
    assert identities["web_0"] != identities["solo"]
    solo = next(vm for vm in imds.vms() if vm.name == "solo")
    with ManagedIdentityCredential(client_id=solo.client_id) as credential:  # the VM's identity named explicitly
        token = credential.get_token("https://eventhubs.azure.net/.default")
    assert verify_token(token.token, audience="https://eventhubs.azure.net")["xms_mirid"] == solo.resourceId


# ---- Microsoft's documented sample, unchanged except for the base URL --------------------------------------


def test_microsofts_documented_python_sample_runs_against_the_emulator(monkeypatch):
    from tests.emulators.imds import ms_sample

    with ImdsEmulator(time_scale=1) as emulator:  # real notice: nothing starts unless the sample approves it
        monkeypatch.setattr(ms_sample, "metadata_url", emulator.url + SE)
        monkeypatch.setattr(ms_sample, "logged", [])
        freeze = emulator.create_event(EventType="Freeze", Resources=["WestNO_0", "WestNO_1"], DurationInSeconds=5)
        user_reboot = emulator.create_event(EventType="Reboot", EventSource="User", Resources=["WestNO_0"])
        long_freeze = emulator.create_event(EventType="Freeze", Resources=["WestNO_1"], DurationInSeconds=30)
        incarnation = ms_sample.advanced_sample("-1")
        assert incarnation == 4
        approved = {a["EventId"]: a["vm"] for a in emulator.approvals()}
        assert approved == {freeze["EventId"]: "WestNO_0", user_reboot["EventId"]: "WestNO_0"}
        states = {e["EventId"]: e["state"] for e in emulator.events()}
        assert states == {
            freeze["EventId"]: "Started",
            user_reboot["EventId"]: "Started",
            long_freeze["EventId"]: "Scheduled",
        }
        assert ms_sample.logged == [long_freeze["Description"]]  # impactful: left to custom handling
        redeploy = emulator.create_event(EventType="Redeploy", Resources=["WestNO_0"])
        assert ms_sample.advanced_sample(incarnation) > incarnation
        assert redeploy["Description"] == DESCRIPTION_INFRASTRUCTURE_MAINTENANCE  # platform maintenance
        assert redeploy["Description"] in ms_sample.logged
        assert user_reboot["Description"] in ms_sample.logged  # now Started: logged


def test_a_refused_post_leaves_the_keep_alive_connection_usable(imds):
    """A fault answered before the body was looked at must not leave the body to be read as the next request."""
    imds.inject_fault(kind="error-burst", count=1, status=500, vm="web_0")
    body = json.dumps({"StartRequests": [{"EventId": "00000000-0000-0000-0000-000000000000"}]})
    with requests.Session() as session:
        refused = session.post(imds.scheduled_events_url("web_0"), headers=META, data=body, timeout=5)
        assert refused.status_code == 500
        again = session.get(imds.scheduled_events_url("web_0"), headers=META, timeout=5)
        assert again.status_code == 200, again.text
        assert "DocumentIncarnation" in again.json()
