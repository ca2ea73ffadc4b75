"""The IMDS emulator's ARM face: the Maintenance RP's scheduled-event acknowledge, for the coordinator's
remote-acknowledge callback (coordinator/adapters/remote_acknowledge.py), and the Compute RP's lists of scale sets
and VMs, for the coordinator's census (coordinator/adapters/census.py). The Compute RP's operations that drills
trigger (restart, redeploy, delete instances, simulateEviction) are in emulators/imds/drills.py.

Takes ``POST {vm or scale set id}/providers/Microsoft.Maintenance/scheduledevents/{eventId}/acknowledge ?api-
version=2025-11-01`` (or the preview 2023-10-01-preview) with ``Authorization: Bearer <token>``, and the list form
``POST {vm or scale set id}/providers/Microsoft.Maintenance/scheduledevents?api-version=2025-11-01`` with
``{"value": [eventIds]}`` (the spec's example bodies, ``ScheduledEvents_AcknowledgeList``): every event it can
acknowledge is acknowledged; when any cannot, the answer is the spec's ``ScheduledEventsListAcknowledgeError`` with
one ``details`` entry (``target``, ``code``, ``message``) per event that failed, with status 400 and code
``BadRequest`` (the emulator's choice: the spec gives neither). The single form gives what ARM gives, in ARM's error
shape ``{"error": {"code", "message"}}``: 401 without a valid token, 403 for a token of another audience (the
brief's choice; real ARM may answer 401 ``InvalidAuthenticationTokenAudience``, unverified), 404 for an event that
the resource's VMs do not see, 200 ``{"value": "Successfully Approved"}`` (the spec's example) otherwise. The event
is then approved in the emulator's state exactly as one of the resource's VMs POSTing StartRequests would, so its
lifecycle proceeds. Injected ARM faults (``ArmFault``: 429 with Retry-After, 5xx, 403, 409…) answer the next
acknowledges first, after the token check.

The lists (``GET {resource group}/providers/Microsoft.Compute/virtualMachineScaleSets``,
``…/virtualMachineScaleSets/{name}/virtualMachines`` for a Uniform scale set's instances and
``…/virtualMachines`` for Flexible members and standalone VMs, each with ``$expand=instanceView``) are built from the
same ``VmSpec``s that IMDS serves, so what a VM's instance metadata says and what ARM lists agree unless a test
makes them differ (``ImdsEmulator.update_vm``), and a VM a delete removed is no longer listed. They page with
``nextLink`` (``$skiptoken``) and answer the token, api-version and injected faults (``target: read``) as the
acknowledge does.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import quote

from pydantic import BaseModel, ConfigDict, Field

from emulators.imds.vm_models import VmSpec
from emulators.tokens import TokenError, verify_token

ARM_AUDIENCE = "https://management.azure.com"
API_VERSIONS = ("2023-10-01-preview", "2025-11-01")
# The list form is in the stable version only.
LIST_API_VERSIONS = ("2025-11-01",)
_ACKNOWLEDGED_RESOURCE = (
    r"^(?P<resource>/subscriptions/(?P<subscription>[^/]+)/resourcegroups/(?P<group>[^/]+)/providers/"
    r"microsoft\.compute/(?P<kind>virtualmachines|virtualmachinescalesets)/(?P<name>[^/]+))"
    r"/providers/microsoft\.maintenance/scheduledevents"
)
ACKNOWLEDGE = re.compile(_ACKNOWLEDGED_RESOURCE + r"/(?P<event>[^/]+)/acknowledge$", re.IGNORECASE)
ACKNOWLEDGE_LIST = re.compile(_ACKNOWLEDGED_RESOURCE + r"$", re.IGNORECASE)
# Compute api-versions the lists answer (the coordinator's census uses the one its Bicep deploys the scale set with).
COMPUTE_API_VERSIONS = ("2024-07-01", "2024-11-01", "2025-04-01")
_GROUP = r"^/subscriptions/(?P<subscription>[^/]+)/resourcegroups/(?P<group>[^/]+)/providers/microsoft\.compute"
SCALE_SETS = re.compile(_GROUP + r"/virtualmachinescalesets$", re.IGNORECASE)
SCALE_SET_VMS = re.compile(_GROUP + r"/virtualmachinescalesets/(?P<name>[^/]+)/virtualmachines$", re.IGNORECASE)
VIRTUAL_MACHINES = re.compile(_GROUP + r"/virtualmachines$", re.IGNORECASE)
_UNIFORM_ID = re.compile(r"/virtualMachineScaleSets/(?P<scale_set>[^/]+)/virtualMachines/(?P<instance>[^/]+)$", re.I)
# Items per page of a list (ARM pages its lists; the census must follow nextLink).
DEFAULT_PAGE_SIZE = 100
# acknowledge: the acknowledges; read: the lists and a scale set's instance view; write: setOrchestrationServiceState.
ArmTarget = Literal["acknowledge", "read", "write"]
_FAULT_CODES = {
    403: "AuthorizationFailed",
    404: "NotFound",
    409: "Conflict",
    429: "TooManyRequests",
    500: "InternalServerError",
    503: "ServiceUnavailable",
}


class ScheduledEventsIdList(BaseModel):
    """The list acknowledge's body (the spec's ``ScheduledEventsIdList``: ``value`` required)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    value: list[str] = Field(min_length=1, max_length=1000)


class ArmFault(BaseModel):
    """Answer the next ``count`` acknowledges (``target: acknowledge``, the default), list or instance-view reads
    (``read``) or automatic-repairs calls (``write``) with ``status`` (and Retry-After, when given)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    status: int = Field(ge=400, le=599)
    count: int = Field(default=1, ge=1, le=1000)
    retryAfterSeconds: int | None = Field(default=None, ge=0, le=3600)
    target: ArmTarget = "acknowledge"


@dataclass
class ArmAnswer:
    status: int
    body: dict[str, Any]
    headers: dict[str, str]


def arm_error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> ArmAnswer:
    return ArmAnswer(status, {"error": {"code": code, "message": message}}, headers or {})


class ArmFaults:
    """The queue of injected ARM answers (the caller holds the emulator's lock)."""

    def __init__(self) -> None:
        self._queues: dict[ArmTarget, deque[ArmFault]] = {"acknowledge": deque(), "read": deque(), "write": deque()}
        self.answered = 0

    def add(self, fault: ArmFault) -> None:
        self._queues[fault.target].extend([fault.model_copy(update={"count": 1})] * fault.count)

    def take(self, target: ArmTarget = "acknowledge") -> ArmAnswer | None:
        queue = self._queues[target]
        if not queue:
            return None
        fault = queue.popleft()
        self.answered += 1
        headers = {"Retry-After": str(fault.retryAfterSeconds)} if fault.retryAfterSeconds is not None else {}
        code = _FAULT_CODES.get(fault.status, "InjectedFault")
        return arm_error(fault.status, code, f"injected by the emulator ({fault.status})", headers)

    def pending(self) -> int:
        return sum(len(queue) for queue in self._queues.values())


def refusal(
    method: str, wanted: str, query: dict[str, list[str]], authorization: str | None, versions: tuple[str, ...]
) -> ArmAnswer | None:
    """What ARM answers a request before it acts, if anything: the wrong method, an api-version the route does not
    take, then a missing or wrong token, in that order."""
    if method != wanted:
        return arm_error(405, "MethodNotAllowed", f"{method} is not allowed here")
    version = (query.get("api-version") or [""])[0]
    if version not in versions:
        return arm_error(400, "InvalidApiVersionParameter", f"api-version {version!r} is not one of {list(versions)}")
    return check_token(authorization)


def check_token(authorization: str | None) -> ArmAnswer | None:
    """None when the bearer token is valid and for ARM; else the refusal."""
    if not authorization or not authorization.startswith("Bearer "):
        return arm_error(401, "AuthenticationFailed", "Authentication failed. The 'Authorization' header is missing.")
    token = authorization.removeprefix("Bearer ").strip()
    try:
        verify_token(token, audience=ARM_AUDIENCE)
    except TokenError as error:
        try:
            verify_token(token, audience=_audience_of(token))
        except TokenError:
            return arm_error(401, "InvalidAuthenticationToken", f"The access token is invalid: {error}")
        return arm_error(
            403,
            "InvalidAuthenticationTokenAudience",
            f"The access token has been obtained for the wrong audience or resource '{_audience_of(token)}'; "
            f"it should be {ARM_AUDIENCE}",
        )
    return None


def _audience_of(token: str) -> str:
    import jwt  # noqa: PLC0415 -- only to read a refused token's audience

    try:
        claims = jwt.decode(token, options={"verify_signature": False})
    except jwt.PyJWTError:
        return ""
    return str(claims.get("aud", ""))


def vms_of(resource: re.Match[str], vms: dict[str, VmSpec]) -> list[str]:
    """The emulated VMs the acknowledge names: the VM itself, or every VM of the scale set."""
    subscription, group = resource.group("subscription").lower(), resource.group("group").lower()
    name = resource.group("name").lower()
    found = []
    for vm in vms.values():
        if vm.subscriptionId.lower() != subscription or vm.resourceGroupName.lower() != group:
            continue
        if resource.group("kind").lower() == "virtualmachinescalesets":
            if vm.vmScaleSetName.lower() == name:
                found.append(vm.name)
        elif vm.resourceId.lower() == resource.group("resource").lower() or vm.name.lower() == name:
            found.append(vm.name)
    return found


# ---- the Compute RP's lists (the coordinator's census) ----------------------------------------------------------


def _in_group(vm: VmSpec, subscription: str, group: str) -> bool:
    return vm.subscriptionId.lower() == subscription.lower() and vm.resourceGroupName.lower() == group.lower()


def _group_id(vm: VmSpec) -> str:
    return f"/subscriptions/{vm.subscriptionId}/resourceGroups/{vm.resourceGroupName}"


def _scale_set_id(vm: VmSpec) -> str:
    return f"{_group_id(vm)}/providers/Microsoft.Compute/virtualMachineScaleSets/{vm.vmScaleSetName}"


def uniform_instance(vm: VmSpec) -> str | None:
    """The instance id of a Uniform scale set's VM (its resource id is the scale set's, with
    ``/virtualMachines/{instance}``), else None (a Flexible member or a standalone VM is a VM resource of its own)."""
    match = _UNIFORM_ID.search(vm.resourceId)
    return match.group("instance") if match and vm.vmScaleSetName else None


def _instance_view(vm: VmSpec, *, placement_group: bool) -> dict[str, Any]:
    view: dict[str, Any] = {
        "platformUpdateDomain": int(vm.platformUpdateDomain),
        "platformFaultDomain": int(vm.platformFaultDomain),
        "computerName": vm.computerName,
        "osName": "ubuntu" if vm.osType == "Linux" else "Windows Server 2022 Datacenter",
        "statuses": [
            {"code": "ProvisioningState/succeeded", "level": "Info", "displayStatus": "Provisioning succeeded"},
            {"code": "PowerState/running", "level": "Info", "displayStatus": "VM running"},
        ],
    }
    if placement_group and vm.placementGroupId:
        view["placementGroupId"] = vm.placementGroupId
    return view


def _common(vm: VmSpec) -> dict[str, Any]:
    resource: dict[str, Any] = {"name": vm.name, "id": vm.resourceId, "location": vm.location, "tags": dict(vm.tags)}
    if vm.zone:
        resource["zones"] = [vm.zone]
    return resource


def scale_set_vm_resource(vm: VmSpec, *, expand: bool) -> dict[str, Any]:
    """A Uniform instance as ``VirtualMachineScaleSetVMs_List`` gives it (``$expand=instanceView``: with its fault
    and update domain and placement group)."""
    properties: dict[str, Any] = {
        "vmId": vm.vmId,
        "provisioningState": "Succeeded",
        "latestModelApplied": True,
        "osProfile": {"computerName": vm.computerName},
    }
    if expand:
        properties["instanceView"] = _instance_view(vm, placement_group=True)
    return {
        **_common(vm),
        "type": "Microsoft.Compute/virtualMachineScaleSets/virtualMachines",
        "instanceId": uniform_instance(vm),
        "sku": {"name": vm.vmSize, "tier": "Standard"},
        "properties": properties,
    }


def vm_resource(vm: VmSpec, *, expand: bool) -> dict[str, Any]:
    """A VM as ``VirtualMachines_List`` gives it: a Flexible scale set's member names its scale set
    (``properties.virtualMachineScaleSet``) and fault domain; a standalone VM in a placement group is in the
    availability set of that name (``properties.availabilitySet``)."""
    properties: dict[str, Any] = {
        "vmId": vm.vmId,
        "provisioningState": "Succeeded",
        "hardwareProfile": {"vmSize": vm.vmSize},
        "osProfile": {"computerName": vm.computerName},
    }
    if vm.priority != "Regular":
        # A Spot VM says so (a Uniform instance does not: its scale set's model does, drills.scale_set_resource).
        properties["priority"] = vm.priority
    if vm.vmScaleSetName:
        properties["virtualMachineScaleSet"] = {"id": _scale_set_id(vm)}
        properties["platformFaultDomain"] = int(vm.platformFaultDomain)
    elif vm.placementGroupId:
        properties["availabilitySet"] = {
            "id": f"{_group_id(vm)}/providers/Microsoft.Compute/availabilitySets/{vm.placementGroupId}"
        }
    if expand:
        properties["instanceView"] = _instance_view(vm, placement_group=False)
    return {**_common(vm), "type": "Microsoft.Compute/virtualMachines", "properties": properties}


def scale_set_resources(vms: Iterable[VmSpec], subscription: str, group: str) -> list[dict[str, Any]]:
    """The scale sets of a resource group, as ``VirtualMachineScaleSets_List`` gives them: Uniform when its
    instances are scale-set VMs, else Flexible."""
    found: dict[str, dict[str, Any]] = {}
    for vm in vms:
        if not vm.vmScaleSetName or not _in_group(vm, subscription, group):
            continue
        mode = "Uniform" if uniform_instance(vm) is not None else "Flexible"
        entry = found.setdefault(
            vm.vmScaleSetName.lower(),
            {
                "name": vm.vmScaleSetName,
                "id": _scale_set_id(vm),
                "type": "Microsoft.Compute/virtualMachineScaleSets",
                "location": vm.location,
                "properties": {"orchestrationMode": mode, "provisioningState": "Succeeded"},
            },
        )
        if mode == "Uniform":
            entry["properties"]["orchestrationMode"] = "Uniform"
    return sorted(found.values(), key=lambda item: str(item["name"]).lower())


class ArmLists:
    """The VMs that exist now, indexed once by resource group and scale set, so that a list reads only what it
    lists: the census of a fleet of 100,000 VMs in 5,000 scale sets (benchmarks/wave.py) reads every scale set's
    instances, which a scan of the whole fleet per request made quadratic. Build a new one when the VMs change."""

    def __init__(self, vms: Iterable[VmSpec]) -> None:
        self.groups: dict[tuple[str, str], list[VmSpec]] = {}
        self.scale_sets: dict[tuple[str, str, str], list[VmSpec]] = {}
        for vm in vms:
            group = (vm.subscriptionId.lower(), vm.resourceGroupName.lower())
            self.groups.setdefault(group, []).append(vm)
            if vm.vmScaleSetName:
                self.scale_sets.setdefault((*group, vm.vmScaleSetName.lower()), []).append(vm)
        self._scale_set_lists: dict[tuple[str, str], list[dict[str, Any]]] = {}

    def in_group(self, subscription: str, group: str) -> list[VmSpec]:
        return self.groups.get((subscription.lower(), group.lower()), [])

    def members(self, subscription: str, group: str, scale_set: str) -> list[VmSpec]:
        return self.scale_sets.get((subscription.lower(), group.lower(), scale_set.lower()), [])

    def scale_set_list(self, subscription: str, group: str) -> list[dict[str, Any]]:
        """``scale_set_resources`` of the group, made once (each page of the list would make it again)."""
        key = (subscription.lower(), group.lower())
        if key not in self._scale_set_lists:
            self._scale_set_lists[key] = scale_set_resources(self.in_group(subscription, group), subscription, group)
        return self._scale_set_lists[key]


def list_answer(
    path: str, query: dict[str, list[str]], vms: Iterable[VmSpec] | ArmLists, *, base_url: str, page_size: int
) -> ArmAnswer | None:
    """The answer to a list read at ``path`` (None: not a list route). ``vms``: the VMs that exist now (a removed
    one is deleted, so no list shows it), or their ``ArmLists``."""
    lists = vms if isinstance(vms, ArmLists) else ArmLists(vms)
    if (match := SCALE_SETS.match(path)) is not None:
        items = lists.scale_set_list(match.group("subscription"), match.group("group"))
    elif (match := SCALE_SET_VMS.match(path)) is not None:
        subscription, group, name = match.group("subscription"), match.group("group"), match.group("name")
        members = lists.members(subscription, group, name)
        if not members:
            return arm_error(
                404,
                "ResourceNotFound",
                f"The Resource 'Microsoft.Compute/virtualMachineScaleSets/{name}'"
                f" under resource group '{group}' was not found.",
            )
        if any(uniform_instance(vm) is None for vm in members):
            # The emulator's choice (unverified): a Flexible scale set's members are VMs of their own, listed
            # with the resource group's VMs; its instance list is refused rather than answered empty.
            return arm_error(
                400,
                "OperationNotAllowed",
                f"Scale set {name} is in Flexible orchestration mode: list "
                "its VMs with the resource group's virtualMachines",
            )
        expand = _expands(query)
        items = [scale_set_vm_resource(vm, expand=expand) for vm in members]
    elif (match := VIRTUAL_MACHINES.match(path)) is not None:
        subscription, group = match.group("subscription"), match.group("group")
        expand = _expands(query)
        items = [
            vm_resource(vm, expand=expand) for vm in lists.in_group(subscription, group) if uniform_instance(vm) is None
        ]
    else:
        return None
    if query.get("$filter"):
        return arm_error(400, "InvalidParameter", "the emulator's lists take no $filter")
    skip = (query.get("$skiptoken") or ["0"])[0]
    start = int(skip) if skip.isdigit() else 0
    page: dict[str, Any] = {"value": items[start : start + page_size]}
    if start + page_size < len(items):
        rest = "&".join(
            f"{quote(key, safe='$')}={quote(value, safe='')}"
            for key, values in sorted(query.items())
            if key != "$skiptoken"
            for value in values
        )
        page["nextLink"] = f"{base_url}{path}?{rest}&$skiptoken={start + page_size}"
    return ArmAnswer(200, page, {})


def _expands(query: dict[str, list[str]]) -> bool:
    return any(value.lower() == "instanceview" for value in query.get("$expand", []))
