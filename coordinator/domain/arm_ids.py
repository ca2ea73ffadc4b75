"""ARM resource ids, read (pure): the resource group a VM's resource id is in, and the scale set it belongs to.

One reading for every caller (the settings' census scopes, ARM's census, the Maintenance RP's acknowledge target,
repairs, Event Grid's keys): ARM's path segments are case-insensitive, so every match is; what a caller keys on it
lowers itself. The resource id read here is ARM's (the census lists it, or the VM's attested vmId is bound to it),
never a ``subscriptionId`` / ``resourceGroupName`` / ``vmScaleSetName`` a VM writes beside it, except where a caller
says so.
"""

from __future__ import annotations

import re
from typing import NamedTuple

__all__ = ["ResourceGroup", "is_resource_group", "resource_group", "scale_set_id"]

_GROUP = re.compile(r"^/subscriptions/(?P<subscription>[^/]+)/resourceGroups/(?P<name>[^/]+)(?=/|$)", re.IGNORECASE)
_UNIFORM = re.compile(
    r"^(?P<scale_set>/subscriptions/[^/]+/resourceGroups/[^/]+/providers/Microsoft\.Compute/"
    r"virtualMachineScaleSets/[^/]+)/virtualMachines/[^/]+$",
    re.IGNORECASE,
)


class ResourceGroup(NamedTuple):
    """A resource group as a resource id names it, as written (not lowered)."""

    subscription: str
    name: str
    id: str  # /subscriptions/{subscription}/resourceGroups/{name}


def resource_group(resource_id: str) -> ResourceGroup | None:
    """The resource group ``resource_id`` is in (or is), or None when it names none."""
    found = _GROUP.match(resource_id)
    if found is None:
        return None
    return ResourceGroup(found["subscription"], found["name"], found.group(0))


def is_resource_group(text: str) -> bool:
    """``text`` is a resource group's own id (``/subscriptions/{id}/resourceGroups/{name}``), nothing under it."""
    found = resource_group(text)
    return found is not None and found.id == text


def scale_set_id(resource_id: str, scale_set: str) -> str | None:
    """The scale set of a VM: a Uniform instance's id is under its scale set's; a Flexible member is a VM of its own,
    in its scale set's resource group (``scale_set``: its scale set's name, as the caller knows it). None: the VM is
    in no scale set."""
    uniform = _UNIFORM.match(resource_id)
    if uniform is not None:
        return uniform["scale_set"]
    group = resource_group(resource_id)
    if group is None or group.id == resource_id or not scale_set:
        return None
    return f"{group.id}/providers/Microsoft.Compute/virtualMachineScaleSets/{scale_set}"
