"""The IMDS emulator's Compute operations for drills over HTTP (emulators/imds/drills.py): each call answered as
ARM answers it (202 + Azure-AsyncOperation/Location polled to the end, 204 for simulateEviction, ARM's errors) and
the scheduled event it produces in the VMs' documents, with the right NotBefore."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from typing import Any

import pytest
import requests

from emulators.imds import ImdsEmulator, Scenario
from emulators.imds.clock import ManualClock
from emulators.tokens import mint_token

T0 = datetime(2026, 11, 26, 8, 0, tzinfo=UTC)
SUB = "00000000-0000-0000-0000-00000000e001"
GROUP = f"/subscriptions/{SUB}/resourceGroups/rg-scheduled-events/providers/Microsoft.Compute"
VERSION = "api-version=2025-04-01"


@pytest.fixture
def imds() -> Iterator[ImdsEmulator]:
    scenario = Scenario.model_validate(
        {
            "name": "drills",
            "scaleSets": {
                "web": {"terminateNotBeforeSeconds": 600},
                "auto": {"automaticallyApproveUserReboot": True},
                "quiet": {"terminateNotification": False},
            },
            "vms": [
                {"name": "web_0", "vmScaleSetName": "web", "placementGroupId": "pg-web"},
                {"name": "web_1", "vmScaleSetName": "web", "placementGroupId": "pg-web"},
                {"name": "auto_0", "vmScaleSetName": "auto"},
                {"name": "quiet_0", "vmScaleSetName": "quiet"},
                {"name": "spot_0", "vmScaleSetName": "spot", "priority": "Spot", "isolated": True},
                # A Flexible member: a VM resource of its own, named by its name in instanceIds.
                {"name": "flex-a", "vmScaleSetName": "flex", "priority": "Spot", "isolated": True},
            ],
        }
    )
    with ImdsEmulator(scenario=scenario, throttle_rps=0, clock=ManualClock(T0)) as emulator:
        yield emulator


def headers() -> dict[str, str]:
    token, _ = mint_token(audience="https://management.azure.com", identity_resource_id="/drill-test")
    return {"Authorization": f"Bearer {token}"}


def post(imds: ImdsEmulator, path: str, body: Any = None) -> requests.Response:
    return requests.post(f"{imds.arm_url}{GROUP}{path}?{VERSION}", json=body, headers=headers(), timeout=5)


def events_of(imds: ImdsEmulator, vm: str) -> list[dict[str, Any]]:
    return list(imds.document(vm)["Events"])


def test_a_restart_answers_a_long_running_operation_polled_until_the_reboot_started(imds: ImdsEmulator) -> None:
    answer = post(imds, "/virtualMachineScaleSets/web/restart", {"instanceIds": ["0"]})
    assert answer.status_code == 202
    operation = answer.headers["Azure-AsyncOperation"]
    assert f"/subscriptions/{SUB}/providers/Microsoft.Compute/locations/westeurope/operations/" in operation
    assert answer.headers["Location"] == operation + "&monitor=true"
    assert answer.headers["Retry-After"] == "1"
    (event,) = events_of(imds, "web_0")
    assert (event["EventType"], event["EventSource"], event["EventStatus"]) == ("Reboot", "User", "Scheduled")
    assert parsedate_to_datetime(event["NotBefore"]) == T0 + timedelta(minutes=15)
    assert events_of(imds, "web_1") == [event]  # its placement group sees it too
    status = requests.get(operation, headers=headers(), timeout=5).json()
    assert (status["status"], status["startTime"]) == ("InProgress", "2026-11-26T08:00:00Z")
    assert requests.get(answer.headers["Location"], headers=headers(), timeout=5).status_code == 202
    imds.clock.advance(15 * 60)  # type: ignore[attr-defined]
    status = requests.get(operation, headers=headers(), timeout=5).json()
    assert status["status"] == "Succeeded"
    assert status["endTime"] == "2026-11-26T08:15:00Z"
    assert requests.get(answer.headers["Location"], headers=headers(), timeout=5).status_code == 200


def test_a_redeploy_gives_each_instance_its_event_and_a_policy_that_approves_reboots_gives_no_notice(
    imds: ImdsEmulator,
) -> None:
    assert post(imds, "/virtualMachineScaleSets/web/redeploy", {"instanceIds": ["0", "1"]}).status_code == 202
    redeploys = {e["Resources"][0]: e for e in events_of(imds, "web_0")}
    assert sorted(redeploys) == ["web_0", "web_1"]
    assert {parsedate_to_datetime(e["NotBefore"]) for e in redeploys.values()} == {T0 + timedelta(minutes=10)}
    answer = post(imds, "/virtualMachineScaleSets/auto/restart", {})  # no instanceIds: every instance
    assert answer.status_code == 202
    (started,) = events_of(imds, "auto_0")
    assert (started["EventStatus"], started["NotBefore"]) == ("Started", "")
    status = requests.get(answer.headers["Azure-AsyncOperation"], headers=headers(), timeout=5).json()
    assert status["status"] == "Succeeded"


def test_a_scale_in_delete_raises_terminate_with_the_scale_sets_notice_and_ends_when_the_vm_is_gone(
    imds: ImdsEmulator,
) -> None:
    answer = post(imds, "/virtualMachineScaleSets/web/delete", {"instanceIds": ["1"]})
    assert answer.status_code == 202
    (event,) = [e for e in events_of(imds, "web_1") if e["EventType"] == "Terminate"]
    assert event["EventSource"] == "User"
    assert parsedate_to_datetime(event["NotBefore"]) == T0 + timedelta(minutes=10)
    imds.clock.advance(10 * 60)  # type: ignore[attr-defined]
    status = requests.get(answer.headers["Azure-AsyncOperation"], headers=headers(), timeout=5).json()
    assert status["status"] == "Succeeded"
    assert "web_1" in imds.removed_vms()
    listed = requests.get(
        f"{imds.arm_url}{GROUP}/virtualMachineScaleSets/web/virtualMachines?{VERSION}", headers=headers(), timeout=5
    )
    assert [vm["name"] for vm in listed.json()["value"]] == ["web_0"]


def test_simulate_eviction_answers_204_and_a_preempt_with_30_seconds(imds: ImdsEmulator) -> None:
    answer = post(imds, "/virtualMachineScaleSets/spot/virtualMachines/0/simulateEviction")
    assert (answer.status_code, answer.content) == (204, b"")
    (event,) = events_of(imds, "spot_0")
    assert (event["EventType"], event["EventSource"]) == ("Preempt", "Platform")
    assert parsedate_to_datetime(event["NotBefore"]) == T0 + timedelta(seconds=30)
    assert post(imds, "/virtualMachines/flex-a/simulateEviction").status_code == 204
    assert [e["EventType"] for e in events_of(imds, "flex-a")] == ["Preempt"]


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        ("/virtualMachineScaleSets/web/virtualMachines/0/simulateEviction", None, 409, "OperationNotAllowed"),
        ("/virtualMachineScaleSets/quiet/delete", {"instanceIds": ["0"]}, 409, "OperationNotAllowed"),
        ("/virtualMachineScaleSets/spot/delete", {"instanceIds": ["0"]}, 409, "OperationNotAllowed"),
        ("/virtualMachineScaleSets/web/delete", {}, 400, "InvalidParameter"),
        ("/virtualMachineScaleSets/web/restart", {"instanceIds": ["7"]}, 404, "NotFound"),
        ("/virtualMachineScaleSets/nowhere/restart", {}, 404, "ResourceNotFound"),
    ],
)
def test_what_azure_refuses_is_refused_and_raises_no_event(
    imds: ImdsEmulator, path: str, body: Any, status: int, code: str
) -> None:
    answer = post(imds, path, body)
    assert (answer.status_code, answer.json()["error"]["code"]) == (status, code)
    assert imds.events() == []


def test_the_calls_need_an_arm_token_and_a_compute_api_version(imds: ImdsEmulator) -> None:
    url = f"{imds.arm_url}{GROUP}/virtualMachineScaleSets/web/restart"
    assert requests.post(f"{url}?{VERSION}", json={}, timeout=5).status_code == 401
    wrong = requests.post(f"{url}?api-version=2019-01-01", json={}, headers=headers(), timeout=5)
    assert wrong.json()["error"]["code"] == "InvalidApiVersionParameter"
    assert imds.events() == []


def test_the_scale_set_says_its_notice_and_scheduled_events_policy(imds: ImdsEmulator) -> None:
    web = requests.get(
        f"{imds.arm_url}{GROUP}/virtualMachineScaleSets/web?{VERSION}", headers=headers(), timeout=5
    ).json()
    profile = web["properties"]["virtualMachineProfile"]["scheduledEventsProfile"]["terminateNotificationProfile"]
    assert profile == {"enable": True, "notBeforeTimeout": "PT10M"}
    assert web["properties"]["orchestrationMode"] == "Uniform"
    auto = requests.get(
        f"{imds.arm_url}{GROUP}/virtualMachineScaleSets/auto?{VERSION}", headers=headers(), timeout=5
    ).json()
    assert auto["properties"]["scheduledEventsPolicy"]["userInitiatedReboot"] == {"automaticallyApprove": True}
