"""The census as Azure Resource Manager lists it now: ``ArmCensusReader`` reads where each VM of the fleet sits
(scale set, zone, fault and update domain, placement group) and its tags, with the coordinator's own identity,
never from what the VMs report. ``coordinator/adapters/census.py`` keeps the last good read for the runs.

Takes the resource groups the fleet lives in; gives one ``CensusEntry`` (coordinator/domain/census.py) per VM that
exists there. Per resource group, through the project's ARM pipeline (arm.py; api-version 2025-04-01, the one
infra/modules/vmss.bicep deploys the scale set with), every list followed through its ``nextLink``:

1. ``GET {group}/providers/Microsoft.Compute/virtualMachineScaleSets``: the scale sets and their orchestration mode;
2. per Uniform scale set, ``GET {scale set}/virtualMachines?$expand=instanceView``: its instances, with ``zones``,
   ``tags`` and, in the instance view, ``platformFaultDomain``, ``platformUpdateDomain`` and ``placementGroupId``;
3. ``GET {group}/providers/Microsoft.Compute/virtualMachines?$expand=instanceView``: the Flexible scale sets' members
   (``properties.virtualMachineScaleSet``) and standalone VMs (a VM in an availability set has that set as its
   placement group), with the same facts (a Flexible member has no placement group).

A VM that ARM shows being deleted (``provisioningState`` Deleting) is left out: a percent budget counts the VMs that
will still be there. Permission: the custom role *Scheduled Events VM Census Reader* (the three ``…/read`` actions,
nothing else) on the resource group (infra/modules/vmss.bicep, docs/deploy.md). Cost: ARM reads are not billed;
each read is 2 + (Uniform scale sets) requests per resource group (more pages past a page's worth of VMs), against
ARM's and the Compute RP's read throttling (docs/coordinator.md, *The census*). Each page is bounded by its call's
deadline (arm.py); the read as a whole by how long a run waits for it (census.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol, TypeVar
from urllib.parse import quote

from azure.core.credentials import TokenCredential
from azure.core.exceptions import AzureError
from azure.core.rest import HttpRequest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from coordinator.adapters import deadline
from coordinator.adapters.arm import ArmClient, ArmOptions
from coordinator.domain.arm_ids import is_resource_group
from coordinator.domain.census import CensusEntry
from coordinator.domain.controls import VmFacts

__all__ = ["API_VERSION", "ArmCensusReader", "CensusError", "CensusReader", "resource_group_id"]

API_VERSION = "2025-04-01"
# A resource group as ARM names it: the census' scope.
# Pages followed per list at most: a list that never ends (a loop of nextLinks) is an error, not a hang.
MAX_PAGES = 1000
# What each refusal means for an operator, beside ARM's own code and message.
_MEANING = {
    401: "ARM refused the coordinator's token",
    403: "the coordinator's identity lacks the census reader role on this resource group (infra/modules/vmss.bicep)",
    404: "no such resource group or scale set (COORDINATOR_CENSUS_RESOURCE_GROUPS)",
}


class CensusError(RuntimeError):
    """ARM could not be read (after the pipeline's retries), or answered something the census cannot read."""


def resource_group_id(value: str) -> str:
    """A census scope as given (``/subscriptions/{id}/resourceGroups/{name}``), or ValueError naming the form."""
    text = value.strip().rstrip("/")
    if not is_resource_group(text):
        raise ValueError(f"{value!r} is not a resource group id (/subscriptions/{{id}}/resourceGroups/{{name}})")
    return text


# ---- ARM's answers (only the fields the census reads; extra fields ignored) ----------------------------------


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


_M = TypeVar("_M", bound=_Lenient)


class _SubResource(_Lenient):
    id: str = ""


class _InstanceView(_Lenient):
    platformUpdateDomain: int | None = None
    platformFaultDomain: int | None = None
    placementGroupId: str = ""


class _VmProperties(_Lenient):
    vmId: str = ""
    provisioningState: str = ""
    virtualMachineScaleSet: _SubResource | None = None
    availabilitySet: _SubResource | None = None
    platformFaultDomain: int | None = None
    instanceView: _InstanceView | None = None


class _Vm(_Lenient):
    name: str = Field(min_length=1)
    id: str = Field(min_length=1)
    location: str = ""
    zones: list[str] = Field(default_factory=list)
    tags: dict[str, str] = Field(default_factory=dict)
    properties: _VmProperties = Field(default_factory=_VmProperties)


class _ScaleSetProperties(_Lenient):
    orchestrationMode: str = "Uniform"


class _ScaleSet(_Lenient):
    name: str = Field(min_length=1)
    id: str = Field(min_length=1)
    properties: _ScaleSetProperties = Field(default_factory=_ScaleSetProperties)


class _Page(_Lenient):
    value: list[dict[str, Any]] = Field(default_factory=list)
    nextLink: str | None = None


def _last(resource_id: str) -> str:
    return resource_id.rstrip("/").rsplit("/", 1)[-1] if resource_id else ""


def _number(value: int | None) -> str:
    # IMDS serves domains as strings of digits; the census keeps them the same way (VmFacts.domain's keys).
    return "" if value is None else str(value)


def _entry(vm: _Vm, *, scale_set: str) -> CensusEntry:
    view = vm.properties.instanceView or _InstanceView()
    fault = view.platformFaultDomain if view.platformFaultDomain is not None else vm.properties.platformFaultDomain
    if scale_set:
        # A Uniform instance's placement group is in its instance view; a Flexible member has none.
        placement = view.placementGroupId
    else:
        placement = _last(vm.properties.availabilitySet.id) if vm.properties.availabilitySet else ""
    return CensusEntry(
        name=vm.name,
        vmId=vm.properties.vmId,
        resourceId=vm.id,
        facts=VmFacts(
            scaleSet=scale_set,
            zone=vm.zones[0] if vm.zones else "",
            location=vm.location,
            faultDomain=_number(fault),
            updateDomain=_number(view.platformUpdateDomain),
            placementGroup=placement,
            tags=dict(vm.tags),
        ),
    )


class CensusReader(Protocol):
    """Reads the census whole: every VM of its scopes as ARM lists it now. Raises ``CensusError``."""

    @property
    def scopes(self) -> Sequence[str]: ...

    def read(self) -> list[CensusEntry]: ...


class ArmCensusReader:
    """``CensusReader`` over ARM's Compute lists (module docstring), with the coordinator's identity.

    :keyword resource_groups: the scopes, as resource group ids.
    :keyword arm: how ARM is called (its root: the IMDS emulator's ARM face locally; retries; each call's
        deadline, which bounds each page of a list)."""

    def __init__(
        self,
        *,
        credential: TokenCredential,
        resource_groups: Sequence[str],
        arm: ArmOptions | None = None,
    ) -> None:
        if not resource_groups:
            raise ValueError("the census needs at least one resource group")
        self._groups = tuple(resource_group_id(group) for group in resource_groups)
        self._client = ArmClient(credential=credential, moniker="census", options=arm)

    @property
    def scopes(self) -> Sequence[str]:
        return self._groups

    def close(self) -> None:
        self._client.close()

    def read(self) -> list[CensusEntry]:
        entries: list[CensusEntry] = []
        for group in self._groups:
            compute = f"{group}/providers/Microsoft.Compute"
            for item in self._pages(f"{compute}/virtualMachineScaleSets?api-version={API_VERSION}"):
                scale_set = self._model(_ScaleSet, item)
                if scale_set.properties.orchestrationMode.lower() != "uniform":
                    continue  # a Flexible scale set's members are VMs of their own: listed below
                path = f"{compute}/virtualMachineScaleSets/{quote(scale_set.name, safe='')}/virtualMachines"
                for vm in self._pages(f"{path}?$expand=instanceView&api-version={API_VERSION}"):
                    entries.extend(self._listed(vm, scale_set=scale_set.name))
            for vm in self._pages(f"{compute}/virtualMachines?$expand=instanceView&api-version={API_VERSION}"):
                entries.extend(self._listed(vm, scale_set=None))
        return entries

    def _listed(self, item: dict[str, Any], *, scale_set: str | None) -> list[CensusEntry]:
        vm = self._model(_Vm, item)
        if vm.properties.provisioningState.lower() == "deleting":
            return []
        owner = scale_set if scale_set is not None else _last(getattr(vm.properties.virtualMachineScaleSet, "id", ""))
        return [_entry(vm, scale_set=owner)]

    @staticmethod
    def _model(model: type[_M], item: dict[str, Any]) -> _M:
        try:
            return model.model_validate(item)
        except ValidationError as error:
            raise CensusError(f"ARM listed a {model.__name__.strip('_')} the census cannot read: {error}") from error

    def _pages(self, url: str) -> Iterator[dict[str, Any]]:
        next_url: str | None = url
        for _page in range(MAX_PAGES):
            if next_url is None:
                return
            try:
                response = self._client.send(HttpRequest("GET", next_url))
            except AzureError as error:  # raised only once the retry policy gave up
                raise CensusError(f"ARM GET {next_url} failed: {error.message}") from error
            except deadline.DeadlineExceeded as error:
                raise CensusError(str(error)) from error
            if response.status_code != 200:
                raise CensusError(
                    f"ARM GET {next_url} answered {response.status_code}: "
                    f"{_MEANING.get(response.status_code, 'unexpected answer')}: {response.text()[:300]}"
                )
            try:
                page = _Page.model_validate_json(response.content)
            except ValidationError as error:
                raise CensusError(f"ARM GET {next_url}: not a list page: {error}") from error
            yield from page.value
            next_url = page.nextLink
        raise CensusError(f"ARM GET {url}: more than {MAX_PAGES} pages")
