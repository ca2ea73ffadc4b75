"""The IMDS emulator's ARM face, the Compute lists (emulators/imds/arm.py), over HTTP: scale sets with their
orchestration mode, a Uniform scale set's instances, a resource group's VMs (Flexible members and standalone VMs),
each with what the same VM's instance metadata says; pages with nextLink; ARM's answers to a missing or wrong token,
an unknown api-version, an injected fault; a VM a delete removed no longer listed; a VM changed or added through the
control API seen by both faces."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import requests

from emulators.imds import ImdsEmulator, Scenario
from emulators.imds.clock import ManualClock
from emulators.tokens import mint_token

SUB = "00000000-0000-0000-0000-0000000a4301"
GROUP = f"/subscriptions/{SUB}/resourceGroups/rg-fleet"
COMPUTE = f"{GROUP}/providers/Microsoft.Compute"
VERSION = "2025-04-01"


@pytest.fixture
def imds() -> Iterator[ImdsEmulator]:
    vms: list[dict[str, Any]] = [
        {"name": "web_0", "vmScaleSetName": "web", "zone": "1", "platformFaultDomain": 1, "placementGroupId": "pg-1",
         "tags": {"tier": "front"}},
        {"name": "web_1", "vmScaleSetName": "web", "zone": "2", "platformUpdateDomain": 4},
        {"name": "web_2", "vmScaleSetName": "web"},
        {"name": "api-x1", "vmScaleSetName": "api", "platformFaultDomain": 2},
        {"name": "db-0", "placementGroupId": "avset-db"},
        {"name": "elsewhere-0", "resourceGroupName": "rg-other"},
    ]  # fmt: skip
    scenario = Scenario.model_validate(
        {"name": "arm-lists", "vms": [{"subscriptionId": SUB, "resourceGroupName": "rg-fleet", **vm} for vm in vms]}
    )
    with ImdsEmulator(scenario=scenario, throttle_rps=0, clock=ManualClock(), arm_page_size=2) as emulator:
        yield emulator


def bearer(audience: str = "https://management.azure.com") -> dict[str, str]:
    token, _ = mint_token(audience=audience, identity_resource_id=f"{GROUP}/coordinator")
    return {"Authorization": f"Bearer {token}"}


def get(imds: ImdsEmulator, path: str, **params: str) -> requests.Response:
    return requests.get(imds.arm_url + path, params={"api-version": VERSION, **params}, headers=bearer(), timeout=5)


def every(imds: ImdsEmulator, path: str, **params: str) -> list[dict[str, Any]]:
    """Every item of a list, following nextLink as ARM's clients do."""
    page = get(imds, path, **params)
    assert page.status_code == 200, page.text
    body = page.json()
    items = list(body["value"])
    while "nextLink" in body:
        assert body["nextLink"].startswith(imds.arm_url + path)
        page = requests.get(body["nextLink"], headers=bearer(), timeout=5)
        assert page.status_code == 200, page.text
        body = page.json()
        items += body["value"]
    return items


def test_scale_sets_say_their_orchestration_mode(imds: ImdsEmulator) -> None:
    sets = every(imds, f"{COMPUTE}/virtualMachineScaleSets")
    assert [(s["name"], s["properties"]["orchestrationMode"]) for s in sets] == [
        ("api", "Flexible"),
        ("web", "Uniform"),
    ]
    assert sets[1]["id"] == f"{COMPUTE}/virtualMachineScaleSets/web"


def test_a_uniform_scale_sets_instances_carry_what_their_instance_metadata_says(imds: ImdsEmulator) -> None:
    instances = every(imds, f"{COMPUTE}/virtualMachineScaleSets/web/virtualMachines", **{"$expand": "instanceView"})
    assert [vm["name"] for vm in instances] == ["web_0", "web_1", "web_2"]  # two pages
    web_0 = instances[0]
    compute = imds.state.vms["web_0"].compute()
    assert web_0["id"] == compute["resourceId"]
    assert web_0["instanceId"] == "0"
    assert web_0["zones"] == [compute["zone"]]
    assert web_0["tags"] == {"tier": "front"}
    assert web_0["properties"]["vmId"] == compute["vmId"]
    view = web_0["properties"]["instanceView"]
    assert (view["platformFaultDomain"], view["platformUpdateDomain"], view["placementGroupId"]) == (1, 0, "pg-1")
    assert "zones" not in instances[2], "a regional VM has no zones"
    # Without $expand there is no instance view (the census must ask for it).
    bare = get(imds, f"{COMPUTE}/virtualMachineScaleSets/web/virtualMachines").json()["value"]
    assert "instanceView" not in bare[0]["properties"]


def test_the_groups_vms_are_flexible_members_and_standalone_vms(imds: ImdsEmulator) -> None:
    vms = {vm["name"]: vm for vm in every(imds, f"{COMPUTE}/virtualMachines", **{"$expand": "instanceView"})}
    assert sorted(vms) == ["api-x1", "db-0"], "Uniform instances are the scale set's; rg-other's are not here"
    member = vms["api-x1"]["properties"]
    assert member["virtualMachineScaleSet"]["id"] == f"{COMPUTE}/virtualMachineScaleSets/api"
    assert (member["platformFaultDomain"], member["instanceView"]["platformFaultDomain"]) == (2, 2)
    assert "placementGroupId" not in member["instanceView"]
    assert vms["db-0"]["properties"]["availabilitySet"]["id"] == f"{COMPUTE}/availabilitySets/avset-db"
    # A Flexible scale set's members are not listed as its instances (the emulator's choice, documented).
    flexible = get(imds, f"{COMPUTE}/virtualMachineScaleSets/api/virtualMachines")
    assert (flexible.status_code, flexible.json()["error"]["code"]) == (400, "OperationNotAllowed")


def test_arms_refusals(imds: ImdsEmulator) -> None:
    path = imds.arm_url + f"{COMPUTE}/virtualMachines"
    missing = requests.get(path, params={"api-version": VERSION}, timeout=5)
    assert (missing.status_code, missing.json()["error"]["code"]) == (401, "AuthenticationFailed")
    other = requests.get(path, params={"api-version": VERSION}, headers=bearer("https://relay.azure.net"), timeout=5)
    assert (other.status_code, other.json()["error"]["code"]) == (403, "InvalidAuthenticationTokenAudience")
    old = requests.get(path, params={"api-version": "2015-06-15"}, headers=bearer(), timeout=5)
    assert (old.status_code, old.json()["error"]["code"]) == (400, "InvalidApiVersionParameter")
    assert get(imds, f"{COMPUTE}/virtualMachines", **{"$filter": "x"}).status_code == 400
    assert get(imds, f"{COMPUTE}/virtualMachineScaleSets/nope/virtualMachines").status_code == 404
    assert requests.delete(path, params={"api-version": VERSION}, headers=bearer(), timeout=5).status_code == 405
    imds.inject_arm_fault(status=429, retryAfterSeconds=2, target="read")
    throttled = get(imds, f"{COMPUTE}/virtualMachines")
    assert (throttled.status_code, throttled.headers["Retry-After"]) == (429, "2")
    assert get(imds, f"{COMPUTE}/virtualMachines").status_code == 200
    assert imds.arm_status()["faultsAnswered"] == 1


def test_a_vm_a_delete_removed_is_not_listed(imds: ImdsEmulator) -> None:
    imds.create_event(EventType="Terminate", Resources=["web_1"], NotBefore="2026-01-05T12:01:00Z")
    imds.clock.advance(120)  # type: ignore[attr-defined]
    assert "web_1" in imds.removed_vms()
    instances = every(imds, f"{COMPUTE}/virtualMachineScaleSets/web/virtualMachines")
    assert [vm["name"] for vm in instances] == ["web_0", "web_2"]


def test_a_vm_changed_or_added_is_seen_by_imds_and_arm_alike(imds: ImdsEmulator) -> None:
    changed = requests.put(f"{imds.url}/_emulator/vms/web_2", json={"zone": "3", "tags": {"a": "b"}}, timeout=5)
    assert changed.status_code == 200, changed.text
    assert (imds.state.vms["web_2"].compute()["zone"], imds.document("web_2")["DocumentIncarnation"]) == ("3", 1)
    instances = every(imds, f"{COMPUTE}/virtualMachineScaleSets/web/virtualMachines")
    assert (instances[2]["zones"], instances[2]["tags"]) == (["3"], {"a": "b"})
    refused = requests.put(f"{imds.url}/_emulator/vms/web_2", json={"vmScaleSetName": "api"}, timeout=5)
    assert refused.status_code == 400
    assert "cannot change" in refused.json()["error"]
    added = requests.post(
        f"{imds.url}/_emulator/vms",
        json={"name": "web_7", "vmScaleSetName": "web", "subscriptionId": SUB, "resourceGroupName": "rg-fleet"},
        timeout=5,
    )
    assert added.status_code == 201, added.text
    assert requests.get(imds.scheduled_events_url("web_7"), headers={"Metadata": "true"}, timeout=5).ok
    assert "web_7" in [vm["name"] for vm in every(imds, f"{COMPUTE}/virtualMachineScaleSets/web/virtualMachines")]
    again = requests.post(f"{imds.url}/_emulator/vms", json={"name": "WEB_7"}, timeout=5)
    assert again.status_code == 400


def test_the_lists_follow_every_change_after_a_read(imds: ImdsEmulator) -> None:
    # The lists are indexed once per state of the VMs (emulators/imds/arm.py ArmLists): each change is seen by the next
    # read, not only by the first read after the emulator started.
    def web() -> list[dict[str, Any]]:
        return every(imds, f"{COMPUTE}/virtualMachineScaleSets/web/virtualMachines")

    assert [vm["name"] for vm in web()] == ["web_0", "web_1", "web_2"]
    imds.update_vm("web_2", zone="3")
    assert web()[2]["zones"] == ["3"]
    imds.add_vm({"name": "web_7", "vmScaleSetName": "web", "subscriptionId": SUB, "resourceGroupName": "rg-fleet"})
    assert [vm["name"] for vm in web()] == ["web_0", "web_1", "web_2", "web_7"]
    imds.create_event(EventType="Terminate", Resources=["web_1"], NotBefore="2026-01-05T12:01:00Z")
    imds.clock.advance(120)  # type: ignore[attr-defined]
    assert [vm["name"] for vm in web()] == ["web_0", "web_2", "web_7"]
