"""Who is who in the local stack: the hub's data senders are the VMs IMDS serves now, and the coordinator's identity
is its own, not a VM's."""

from __future__ import annotations

from emulators.imds import ImdsEmulator, ManualClock, Scenario
from local.identities import FleetIdentities, coordinator_identity

SCENARIO = Scenario.model_validate(
    {"vms": [{"name": "web_0", "resourceGroupName": "rg-fleet"}, {"name": "web_1", "resourceGroupName": "rg-fleet"}]}
)


def test_the_fleet_s_identities_are_the_vms_imds_serves_now() -> None:
    imds = ImdsEmulator(scenario=SCENARIO, throttle_rps=0, clock=ManualClock())
    seen: list[ImdsEmulator | None] = [None]
    fleet = FleetIdentities(lambda: seen[0])
    web_0 = imds.vms()[0].resourceId
    assert web_0 not in fleet  # no emulator yet: nobody holds the role
    seen[0] = imds
    assert web_0 in fleet
    added = imds.add_vm({"name": "web_9", "resourceGroupName": "rg-fleet"})
    assert added.resourceId in fleet  # a VM that joins while the stack runs may send
    assert coordinator_identity(SCENARIO) not in fleet  # the coordinator is no sender on the VMs' hub


def test_the_coordinator_s_identity_is_a_user_assigned_one_beside_the_fleet() -> None:
    identity = coordinator_identity(SCENARIO)
    vm = SCENARIO.vms[0]
    assert identity == (
        f"/subscriptions/{vm.subscriptionId}/resourceGroups/rg-fleet"
        "/providers/Microsoft.ManagedIdentity/userAssignedIdentities/local-coordinator-id"
    )
    assert all(identity != spec.resourceId for spec in SCENARIO.vms)
