"""The IMDS emulator's automatic repairs over HTTP (emulators/imds/repairs.py): a scale set's policy in its resource,
``setOrchestrationServiceState`` suspending and resuming its AutomaticRepairs service (202 and a long-running
operation, as drills answer), the instance view saying so, ARM's refusals, and the control API's state and log."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
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
SUSPEND = {"serviceName": "AutomaticRepairs", "action": "Suspend"}
RESUME = {"serviceName": "AutomaticRepairs", "action": "Resume"}


@pytest.fixture
def imds() -> Iterator[ImdsEmulator]:
    scenario = Scenario.model_validate(
        {
            "name": "repairs",
            "scaleSets": {"web": {"automaticRepairs": True}, "flex": {"automaticRepairs": True}},
            "vms": [
                {"name": "web_0", "vmScaleSetName": "web"},
                {"name": "web_1", "vmScaleSetName": "web"},
                {"name": "plain_0", "vmScaleSetName": "plain"},
                {"name": "flex-a", "vmScaleSetName": "flex"},
            ],
        }
    )
    with ImdsEmulator(scenario=scenario, throttle_rps=0, clock=ManualClock(T0)) as emulator:
        yield emulator


def headers() -> dict[str, str]:
    token, _ = mint_token(audience="https://management.azure.com", identity_resource_id="/repairs-test")
    return {"Authorization": f"Bearer {token}"}


def set_state(imds: ImdsEmulator, scale_set: str, body: Any) -> requests.Response:
    url = f"{imds.arm_url}{GROUP}/virtualMachineScaleSets/{scale_set}/setOrchestrationServiceState?{VERSION}"
    return requests.post(url, json=body, headers=headers(), timeout=5)


def get(imds: ImdsEmulator, path: str) -> requests.Response:
    return requests.get(f"{imds.arm_url}{GROUP}{path}?{VERSION}", headers=headers(), timeout=5)


def service_state(imds: ImdsEmulator, scale_set: str) -> str:
    view = get(imds, f"/virtualMachineScaleSets/{scale_set}/instanceView")
    assert view.status_code == 200, view.text
    (service,) = view.json()["orchestrationServices"]
    assert service["serviceName"] == "AutomaticRepairs"
    return str(service["serviceState"])


def test_the_scale_set_shows_its_automatic_repairs_policy_only_when_the_scenario_enables_it(
    imds: ImdsEmulator,
) -> None:
    web = get(imds, "/virtualMachineScaleSets/web").json()
    assert web["properties"]["automaticRepairsPolicy"] == {
        "enabled": True,
        "gracePeriod": "PT10M",
        "repairAction": "Replace",
    }
    assert "automaticRepairsPolicy" not in get(imds, "/virtualMachineScaleSets/plain").json()["properties"]
    view = get(imds, "/virtualMachineScaleSets/web/instanceView").json()
    assert view["virtualMachine"]["statusesSummary"] == [{"code": "ProvisioningState/succeeded", "count": 2}]
    assert (service_state(imds, "web"), service_state(imds, "plain")) == ("Running", "NotRunning")
    assert imds.arm_status()["automaticRepairs"] == {"flex": "Running", "plain": "NotRunning", "web": "Running"}


def test_suspend_then_resume_changes_the_instance_view_and_is_logged_in_order(imds: ImdsEmulator) -> None:
    suspended = set_state(imds, "web", SUSPEND)
    assert suspended.status_code == 202, suspended.text
    assert suspended.headers["Location"] == suspended.headers["Azure-AsyncOperation"] + "&monitor=true"
    operation = requests.get(suspended.headers["Azure-AsyncOperation"], headers=headers(), timeout=5).json()
    assert (operation["status"], operation["endTime"]) == ("Succeeded", "2026-11-26T08:00:00Z")
    assert requests.get(suspended.headers["Location"], headers=headers(), timeout=5).status_code == 200
    assert service_state(imds, "web") == "Suspended"
    assert service_state(imds, "flex") == "Running"  # only the scale set named
    assert imds.arm_status()["automaticRepairs"]["web"] == "Suspended"
    imds.clock.advance(600)  # type: ignore[attr-defined]
    assert set_state(imds, "WEB", RESUME).status_code == 202  # ARM's paths are case-insensitive
    assert service_state(imds, "web") == "Running"
    assert imds.arm_status()["orchestrationServiceCalls"] == [
        {
            "time": "2026-11-26T08:00:00Z",
            "scaleSet": "web",
            "serviceName": "AutomaticRepairs",
            "action": "Suspend",
            "status": 202,
        },
        {
            "time": "2026-11-26T08:10:00Z",
            "scaleSet": "web",
            "serviceName": "AutomaticRepairs",
            "action": "Resume",
            "status": 202,
        },
    ]
    control = requests.get(f"{imds.arm_url}/_emulator/arm", timeout=5).json()
    assert [call["action"] for call in control["orchestrationServiceCalls"]] == ["Suspend", "Resume"]
    assert control["automaticRepairs"]["web"] == "Running"


def test_suspending_twice_is_accepted_and_changes_nothing(imds: ImdsEmulator) -> None:
    assert set_state(imds, "web", SUSPEND).status_code == 202
    assert set_state(imds, "web", SUSPEND).status_code == 202
    assert service_state(imds, "web") == "Suspended"


@pytest.mark.parametrize(
    "body",
    [SUSPEND, RESUME, {"serviceName": "AutomaticZoneRebalancing", "action": "Suspend"}],
)
def test_a_scale_set_without_the_service_enabled_refuses_with_409(imds: ImdsEmulator, body: dict[str, str]) -> None:
    scale_set = "plain" if body["serviceName"] == "AutomaticRepairs" else "web"
    refused = set_state(imds, scale_set, body)
    assert (refused.status_code, refused.json()["error"]["code"]) == (409, "OperationNotAllowed")
    assert service_state(imds, scale_set) == ("NotRunning" if scale_set == "plain" else "Running")
    (call,) = imds.arm_status()["orchestrationServiceCalls"]
    assert (call["scaleSet"], call["status"]) == (scale_set, 409)


@pytest.mark.parametrize(
    "body",
    [
        None,
        {},
        {"serviceName": "AutomaticRepairs"},
        {"serviceName": "AutomaticRepairs", "action": "Pause"},
        {"serviceName": "Autoscale", "action": "Suspend"},
        {"serviceName": "AutomaticRepairs", "action": "Suspend", "extra": 1},
        ["AutomaticRepairs", "Suspend"],
    ],
)
def test_a_bad_body_is_refused_with_400(imds: ImdsEmulator, body: Any) -> None:
    refused = set_state(imds, "web", body)
    assert (refused.status_code, refused.json()["error"]["code"]) == (400, "InvalidRequestContent")
    assert service_state(imds, "web") == "Running"
    assert imds.arm_status()["orchestrationServiceCalls"] == []


def test_a_body_that_is_not_json_is_refused_with_arms_400(imds: ImdsEmulator) -> None:
    url = f"{imds.arm_url}{GROUP}/virtualMachineScaleSets/web/setOrchestrationServiceState?{VERSION}"
    refused = requests.post(url, data=b"{not json", headers=headers(), timeout=5)
    assert (refused.status_code, refused.json()["error"]["code"]) == (400, "InvalidRequestContent")


def test_the_routes_check_the_token_the_method_the_api_version_and_the_scale_set(imds: ImdsEmulator) -> None:
    base = f"{imds.arm_url}{GROUP}/virtualMachineScaleSets/web"
    no_token = requests.post(f"{base}/setOrchestrationServiceState?{VERSION}", json=SUSPEND, timeout=5)
    assert (no_token.status_code, no_token.json()["error"]["code"]) == (401, "AuthenticationFailed")
    assert requests.get(f"{base}/instanceView?{VERSION}", timeout=5).status_code == 401
    old = requests.post(
        f"{base}/setOrchestrationServiceState?api-version=2019-01-01", json=SUSPEND, headers=headers(), timeout=5
    )
    assert (old.status_code, old.json()["error"]["code"]) == (400, "InvalidApiVersionParameter")
    assert (
        requests.get(f"{base}/setOrchestrationServiceState?{VERSION}", headers=headers(), timeout=5).status_code == 405
    )
    assert requests.post(f"{base}/instanceView?{VERSION}", headers=headers(), timeout=5).status_code == 405
    missing = set_state(imds, "nowhere", SUSPEND)
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "ResourceNotFound")
    assert get(imds, "/virtualMachineScaleSets/nowhere/instanceView").status_code == 404
    assert service_state(imds, "web") == "Running"
    assert imds.arm_status()["orchestrationServiceCalls"] == []


def test_injected_faults_answer_writes_and_reads_as_for_the_other_routes(imds: ImdsEmulator) -> None:
    before = imds.arm_status()["requests"]
    imds.inject_arm_fault(status=429, retryAfterSeconds=3, target="write")
    throttled = set_state(imds, "web", SUSPEND)
    assert (throttled.status_code, throttled.headers["Retry-After"]) == (429, "3")
    assert throttled.json()["error"]["code"] == "TooManyRequests"
    assert imds.arm_status()["orchestrationServiceCalls"] == []  # the call never reached the scale set
    imds.inject_arm_fault(status=503, target="read")
    unavailable = get(imds, "/virtualMachineScaleSets/web/instanceView")
    assert (unavailable.status_code, unavailable.json()["error"]["code"]) == (503, "ServiceUnavailable")
    assert service_state(imds, "web") == "Running"
    assert set_state(imds, "web", SUSPEND).status_code == 202
    status = imds.arm_status()
    assert (status["faultsAnswered"], status["faultsPending"], status["requests"] - before) == (2, 0, 4)
    assert status["automaticRepairs"]["web"] == "Suspended"


def test_an_acknowledge_fault_is_not_taken_by_a_repairs_call(imds: ImdsEmulator) -> None:
    imds.inject_arm_fault(status=500)  # target: acknowledge, the default
    assert set_state(imds, "web", SUSPEND).status_code == 202
    assert imds.arm_status()["faultsPending"] == 1
