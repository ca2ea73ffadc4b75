"""Who is who in the local stack, as Entra ID and RBAC say it in Azure: the VMs' managed identities (those the IMDS
emulator's tokens name, holding "Azure Event Hubs Data Sender" on the hub, as the Bicep assigns it to the fleet's
identity) and the coordinator's own (a user-assigned identity beside the fleet, whose tokens App Service's endpoint
gives the app: emulators/app_identity.py). No party here takes its tokens from another's endpoint."""

from __future__ import annotations

from collections.abc import Callable

from emulators.app_identity import app_identity_id
from emulators.imds import ImdsEmulator, Scenario

__all__ = ["FleetIdentities", "coordinator_identity"]


class FleetIdentities:
    """The managed identities of the stack's VMs, as they are now (VMs added while it runs too): the IMDS emulator's
    tokens name the VM's resource id."""

    def __init__(self, imds: Callable[[], ImdsEmulator | None]) -> None:
        self._imds = imds

    def __contains__(self, identity: object) -> bool:
        imds = self._imds()
        return imds is not None and any(vm.resourceId == identity for vm in imds.vms())


def coordinator_identity(scenario: Scenario) -> str:
    """The resource id of the coordinator's user-assigned identity: in the scenario's first resource group, as the
    Bicep puts it beside the fleet."""
    first = scenario.vms[0]
    return app_identity_id(first.subscriptionId, first.resourceGroupName)
