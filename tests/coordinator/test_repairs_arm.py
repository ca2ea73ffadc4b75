"""The coordinator's repairs adapter (``ArmRepairs``) against the IMDS emulator's ARM face, over HTTPS with an ARM
token, as in Azure: the AutomaticRepairs service's state read from the scale set's instance view, Suspend and Resume
through ``setOrchestrationServiceState`` (202 accepted), and ARM's refusal of a scale set without repairs named in
the error."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from azure.core.credentials import AccessToken

from coordinator.adapters.arm import ArmOptions
from coordinator.adapters.repairs import ArmRepairs, RepairsError
from emulators.imds import ImdsEmulator, Scenario
from emulators.imds.clock import ManualClock
from emulators.tokens import mint_token

T0 = datetime(2026, 11, 30, 8, 0, tzinfo=UTC)
SUB = "00000000-0000-0000-0000-00000000e002"


class MintedCredential:
    """FAKE Entra: the coordinator's ARM token minted with the emulators' development key."""

    def get_token(self, *scopes: str, **_: Any) -> AccessToken:
        token, expires_on = mint_token(audience="https://management.azure.com", identity_resource_id="/coordinator")
        return AccessToken(token, expires_on)


@pytest.fixture
def imds() -> Iterator[ImdsEmulator]:
    scenario = Scenario.model_validate(
        {
            "name": "repairs-adapter",
            "scaleSets": {"web": {"automaticRepairs": True}},
            "vms": [
                {"name": "web_0", "vmScaleSetName": "web", "subscriptionId": SUB},
                {"name": "plain_0", "vmScaleSetName": "plain", "subscriptionId": SUB},
            ],
        }
    )
    with ImdsEmulator(scenario=scenario, throttle_rps=0, clock=ManualClock(T0)) as emulator:
        yield emulator


def scale_set(imds: ImdsEmulator, name: str) -> str:
    spec = next(vm for vm in imds.vms() if vm.vmScaleSetName == name)
    group = f"/subscriptions/{spec.subscriptionId}/resourceGroups/{spec.resourceGroupName}"
    return f"{group}/providers/Microsoft.Compute/virtualMachineScaleSets/{name}"


def test_the_state_read_then_suspended_and_resumed_through_arm(imds: ImdsEmulator) -> None:
    repairs = ArmRepairs(credential=MintedCredential(), arm=ArmOptions(endpoint=imds.arm_url))
    web = scale_set(imds, "web")
    assert repairs.state(web) == "Running"
    repairs.set(web, "Suspend")
    assert repairs.state(web) == "Suspended"
    repairs.set(web, "Resume")
    assert repairs.state(web) == "Running"
    assert [(c["scaleSet"], c["action"], c["status"]) for c in imds.arm_status()["orchestrationServiceCalls"]] == [
        ("web", "Suspend", 202),
        ("web", "Resume", 202),
    ]
    repairs.close()


def test_a_scale_set_without_repairs_is_not_running_and_refuses_a_suspend_by_name(imds: ImdsEmulator) -> None:
    repairs = ArmRepairs(credential=MintedCredential(), arm=ArmOptions(endpoint=imds.arm_url, retry_total=0))
    plain = scale_set(imds, "plain")
    assert repairs.state(plain) == "NotRunning"
    with pytest.raises(
        RepairsError, match=r"virtualMachineScaleSets/plain: POST setOrchestrationServiceState answered 409"
    ):
        repairs.set(plain, "Suspend")
    repairs.close()
