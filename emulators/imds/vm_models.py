"""The IMDS emulator's simulated VMs as a scenario or the control API gives them (validated): a VM, named and placed
the way Azure names and places things, its hooks, and its scale set's profile."""

from __future__ import annotations

import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEFAULT_SUBSCRIPTION = "00000000-0000-0000-0000-00000000e001"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_SCALE_SET_NAME = re.compile(r"^.+_(?P<instance>\d+)$")
GUID = re.compile(r"^[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}$")
# run-parts runs only files whose names consist of these characters (Debian run-parts, default "lanana" rules
# aside); the forwarder's hook folders follow run-parts, so a scenario's hook names must too.
_HOOK_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


def _base36(number: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    text = ""
    while True:
        number, rest = divmod(number, 36)
        text = digits[rest] + text
        if number == 0:
            return text


class HookSpec(BaseModel):
    """One hook file of a VM's prepare or recover folder as a scenario describes it: the local runner installs a
    script of this name that sleeps ``seconds`` (real seconds) and exits with ``exitCode``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=64)
    exitCode: int = Field(ge=0, le=255)
    seconds: float = Field(default=0, ge=0, le=3600)

    @field_validator("name")
    @classmethod
    def _run_parts_name(cls, value: str) -> str:
        if not _HOOK_NAME.match(value):
            raise ValueError(f"{value!r} is not a run-parts file name (letters, digits, '_' and '-' only)")
        return value


class VmHooks(BaseModel):
    """The hooks of one VM, per phase, in the order run-parts runs them (by name)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prepare: list[HookSpec] = Field(default_factory=list)
    recover: list[HookSpec] = Field(default_factory=list)
    # Installed in force.d: run one by name when an escalation ladder's force step approves (forwarder/approver.py).
    force: list[HookSpec] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_names(self) -> VmHooks:
        for phase in ("prepare", "recover", "force"):
            names = [hook.name for hook in getattr(self, phase)]
            twice = sorted({name for name in names if names.count(name) > 1})
            if twice:
                raise ValueError(f"{phase}: hook names {twice} appear twice (one folder cannot hold two files)")
        return self


def _domain_number(value: Any) -> Any:
    """Fault and update domains are numbers that IMDS serves as strings; a scenario may write either."""
    if isinstance(value, bool):
        return value  # left for pydantic to refuse
    if isinstance(value, int):
        if value < 0:
            raise ValueError("must be a number >= 0")
        return str(value)
    if isinstance(value, str) and not value.isdigit():
        raise ValueError(f"{value!r} is not a number >= 0")
    return value


class VmSpec(BaseModel):
    """One simulated VM. Only ``name`` is required; the rest is derived the way Azure names things."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    vmId: str = ""
    resourceId: str = ""
    subscriptionId: str = DEFAULT_SUBSCRIPTION
    resourceGroupName: str = "rg-scheduled-events"
    vmScaleSetName: str = ""
    location: str = "westeurope"
    zone: str = ""
    platformFaultDomain: str = "0"
    platformUpdateDomain: str = "0"
    placementGroupId: str = ""
    computerName: str = ""
    priority: Literal["Regular", "Spot", "Low"] = "Regular"
    vmSize: str = "Standard_D2s_v5"
    osType: Literal["Linux", "Windows"] = "Linux"
    tags: dict[str, str] = Field(default_factory=dict)
    # The docs: VMs placed individually in a zone and GPU scale sets with one fault domain receive only their
    # own events, not those of the rest of their placement group.
    isolated: bool = False
    # Read by the local runner (which installs these hooks for the VM's forwarder); the emulator only validates
    # them. None: the runner's default hooks.
    hooks: VmHooks | None = None
    # How far the VM's clock is off (read by the local runner, whose forwarder for this VM stamps its envelopes with
    # that clock): a VM whose clock drifted. Seconds, negative = slow.
    clockSkewSeconds: float = Field(default=0, ge=-86_400, le=86_400)
    # A VM without the forwarder (read by the local runner, which starts none for it): its scale set publishes to
    # Event Grid, so the coordinator learns of its events from the Event Grid events the runner has this emulator
    # publish (emulators/imds/event_grid.py), and approves them through the ARM face (remote acknowledge).
    agentless: bool = False

    domains_are_numbers = field_validator("platformFaultDomain", "platformUpdateDomain", mode="before")(_domain_number)

    @field_validator("name")
    @classmethod
    def _valid_name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError("must be 1-64 letters, digits, '_', '.', '-' and start with a letter or digit")
        return value

    @model_validator(mode="after")
    def _derive(self) -> VmSpec:
        derived: dict[str, str] = {}
        if not self.vmId:
            derived["vmId"] = str(uuid.uuid5(uuid.NAMESPACE_URL, f"emulated-vm:{self.name}"))
        match = _SCALE_SET_NAME.match(self.name)
        scale_set = self.vmScaleSetName
        if not self.resourceId:
            prefix = f"/subscriptions/{self.subscriptionId}/resourceGroups/{self.resourceGroupName}/providers"
            if scale_set and match:
                derived["resourceId"] = (
                    f"{prefix}/Microsoft.Compute/virtualMachineScaleSets/{scale_set}"
                    f"/virtualMachines/{match.group('instance')}"
                )
            else:
                derived["resourceId"] = f"{prefix}/Microsoft.Compute/virtualMachines/{self.name}"
        if not self.computerName:
            # Deliberately different from `name` (as on real scale sets: prefix + base-36 instance id), so
            # that code matching Resources against the hostname is caught.
            if scale_set and match:
                derived["computerName"] = f"{scale_set.replace('_', '-')}{_base36(int(match.group('instance'))):0>6}"
            else:
                derived["computerName"] = f"{self.name.lower().replace('_', '-')}-host"
        for key, value in derived.items():
            object.__setattr__(self, key, value)
        if self.computerName == self.name:
            raise ValueError("computerName must differ from name (hostname misuse would go unnoticed)")
        return self

    @property
    def client_id(self) -> str:
        """The client id of the VM's system-assigned identity (stable per resource id)."""
        return str(uuid.uuid5(uuid.NAMESPACE_OID, f"client:{self.resourceId.lower()}"))

    def compute(self) -> dict[str, Any]:
        """The `compute` object of instance metadata (every value a string, as IMDS sends them)."""
        publisher, offer, sku = (
            ("Canonical", "ubuntu-24_04-lts", "server")
            if self.osType == "Linux"
            else (
                "MicrosoftWindowsServer",
                "WindowsServer",
                "2022-datacenter",
            )
        )
        return {
            "azEnvironment": "AzurePublicCloud",
            "computerName": self.computerName,
            "isHostCompatibilityLayerVm": "false",
            "location": self.location,
            "name": self.name,
            "offer": offer,
            "osProfile": {
                "adminUsername": "azureuser",
                "computerName": self.computerName,
                "disablePasswordAuthentication": "true",
            },
            "osType": self.osType,
            "placementGroupId": self.placementGroupId,
            "platformFaultDomain": self.platformFaultDomain,
            "platformUpdateDomain": self.platformUpdateDomain,
            "priority": self.priority,
            "provider": "Microsoft.Compute",
            "publisher": publisher,
            "resourceGroupName": self.resourceGroupName,
            "resourceId": self.resourceId,
            "sku": sku,
            "subscriptionId": self.subscriptionId,
            "tags": ";".join(f"{key}:{value}" for key, value in sorted(self.tags.items())),
            "tagsList": [{"name": key, "value": value} for key, value in sorted(self.tags.items())],
            "version": "latest",
            "vmId": self.vmId,
            "vmScaleSetName": self.vmScaleSetName,
            "vmSize": self.vmSize,
            "zone": self.zone,
        }


class ScaleSetSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # terminateNotificationProfile: enable + notBeforeTimeout (PT5M..PT15M)
    terminateNotification: bool = True
    terminateNotBeforeSeconds: float = Field(default=300, ge=300, le=900)
    # scheduledEventsPolicy.userInitiatedReboot / userInitiatedRedeploy.automaticallyApprove: a user's restart or
    # redeploy (a drill's, emulators/imds/drills.py) is then created Started, without notice. The project's Bicep
    # sets both false, so that the coordinator's rules see them.
    automaticallyApproveUserReboot: bool = False
    automaticallyApproveUserRedeploy: bool = False
    # automaticRepairsPolicy enabled (PT10M, Replace): its AutomaticRepairs service runs, and the coordinator may
    # suspend and resume it (emulators/imds/repairs.py); else the service is NotRunning and ARM refuses both.
    automaticRepairs: bool = False
    # A GPU scale set with one fault domain: every instance receives only its own events.
    isolated: bool = False
