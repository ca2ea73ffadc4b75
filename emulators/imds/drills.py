"""The IMDS emulator's ARM face for drills: the Compute RP's operations a person triggers on a scale set's VMs (what
``python -m ops.drill`` calls), answered as ARM does, each producing the scheduled event Azure announces for it.

Takes, with ``Authorization: Bearer <token>`` for ARM and a Compute api-version (``COMPUTE_API_VERSIONS``):

- ``GET …/virtualMachineScaleSets/{name}`` (``VirtualMachineScaleSets_Get``): the scale set with what a drill reads,
  its ``scheduledEventsPolicy`` (``userInitiatedReboot`` / ``userInitiatedRedeploy`` ``automaticallyApprove``) and
  ``virtualMachineProfile.scheduledEventsProfile.terminateNotificationProfile`` (``enable``, ``notBeforeTimeout``),
  from the scenario's ``scaleSets`` entry;
- ``POST …/virtualMachineScaleSets/{name}/restart``, ``…/redeploy`` (body ``{"instanceIds": [...]}``, optional: all
  instances) and ``…/delete`` (``VirtualMachineScaleSets_DeleteInstances``, body required): 202 with
  ``Azure-AsyncOperation``, ``Location`` and ``Retry-After``, as ARM answers a long-running operation. Each instance
  gets its own event, ``EventSource: User``: ``Reboot`` / ``Redeploy`` with the documented notice (15 / 10 minutes,
  scaled), or created ``Started`` when the scale set's policy approves them automatically; ``Terminate`` with the
  scale set's ``terminateNotBeforeSeconds``;
- ``POST …/virtualMachineScaleSets/{name}/virtualMachines/{instanceId}/simulateEviction``
  (``VirtualMachineScaleSetVMs_SimulateEviction``) and ``POST …/virtualMachines/{name}/simulateEviction`` (a Flexible
  member, ``VirtualMachines_SimulateEviction``): 204, and a ``Preempt`` (``EventSource: Platform``) with the
  documented 30 s notice, scaled;
- ``GET {ARM}/subscriptions/{sub}/providers/Microsoft.Compute/locations/{location}/operations/{id}``: the operation's
  status, ``InProgress`` until the platform did what it was asked (every event ``Started``; for a delete, every VM
  gone), then ``Succeeded`` with its ``endTime`` (``Canceled`` when an event was canceled instead). With
  ``monitor=true`` (the ``Location`` form): 202 while in progress, 200 once done;
- a scale set's automatic repairs, ``…/setOrchestrationServiceState`` and ``…/instanceView`` (emulators/imds/
  repairs.py), and its ``automaticRepairsPolicy`` in the ``GET`` when the scenario's entry has ``automaticRepairs``.

Instance ids are a Uniform instance's number (the end of its resource id) or, in a Flexible scale set, the VM's
name. What Azure refuses the emulator refuses (ARM's error shape): an instance not in the scale set (404), an
eviction of a VM that is not Spot, a delete that raises no Terminate (terminate notifications off, or a Spot VM), a
VM already gone (409 ``OperationNotAllowed``; the codes and the 409 are the emulator's choice). Nothing here reads
the clock or holds a socket: the server calls it under its lock with ``now``.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal
from urllib.parse import quote

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from emulators.imds.arm import ArmAnswer, arm_error, uniform_instance
from emulators.imds.models import EventCreate, EventTypeName
from emulators.imds.records import EmulatorInputError
from emulators.imds.repairs import AUTOMATIC_REPAIRS_POLICY, OrchestrationServiceStateInput, Repairs
from emulators.imds.state import EmulatorState
from emulators.imds.vm_models import ScaleSetSpec, VmSpec

_SCALE_SET = (
    r"^/subscriptions/(?P<subscription>[^/]+)/resourcegroups/(?P<group>[^/]+)/providers/microsoft\.compute"
    r"/virtualmachinescalesets/(?P<name>[^/]+)"
)
SCALE_SET = re.compile(_SCALE_SET + r"$", re.IGNORECASE)
SCALE_SET_ACTION = re.compile(_SCALE_SET + r"/(?P<action>restart|redeploy|delete)$", re.IGNORECASE)
# A scale set's automatic repairs (emulators/imds/repairs.py).
SET_ORCHESTRATION_SERVICE_STATE = re.compile(_SCALE_SET + r"/setorchestrationservicestate$", re.IGNORECASE)
SCALE_SET_INSTANCE_VIEW = re.compile(_SCALE_SET + r"/instanceview$", re.IGNORECASE)
INSTANCE_EVICTION = re.compile(_SCALE_SET + r"/virtualmachines/(?P<instance>[^/]+)/simulateeviction$", re.IGNORECASE)
VM_EVICTION = re.compile(
    r"^/subscriptions/(?P<subscription>[^/]+)/resourcegroups/(?P<group>[^/]+)/providers/microsoft\.compute"
    r"/virtualmachines/(?P<vm>[^/]+)/simulateeviction$",
    re.IGNORECASE,
)
OPERATION = re.compile(
    r"^/subscriptions/(?P<subscription>[^/]+)/providers/microsoft\.compute/locations/(?P<location>[^/]+)"
    r"/operations/(?P<id>[^/]+)$",
    re.IGNORECASE,
)
# What each action produces (the scheduled events docs: only deletes raise Terminate).
_EVENT_OF: dict[str, EventTypeName] = {"restart": "Reboot", "redeploy": "Redeploy", "delete": "Terminate"}
# Seconds a client is asked to wait between polls of an operation (real seconds: the emulator's time is scaled).
RETRY_AFTER_SECONDS = 1
OperationStatus = Literal["InProgress", "Succeeded", "Canceled"]


class InstanceIds(BaseModel):
    """``VirtualMachineScaleSetVMInstanceIDs`` (restart, redeploy: optional, all instances when absent) and
    ``VirtualMachineScaleSetVMInstanceRequiredIDs`` (delete)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    instanceIds: list[str] | None = Field(default=None, max_length=1000)


@dataclass
class Operation:
    """One long-running operation: the events it raised and what ends it."""

    id: str
    action: str
    subscription: str
    location: str
    started: datetime
    event_ids: list[str]
    vms: list[str]
    ended: datetime | None = None
    status: OperationStatus = "InProgress"


@dataclass
class Drills:
    """The operations started through the ARM face (the caller holds the emulator's lock)."""

    operations: dict[str, Operation] = field(default_factory=dict)
    # Every drill call taken: {action, scaleSet, vms, eventIds, operation}; for tests and the control API.
    log: list[dict[str, Any]] = field(default_factory=list)
    # Each scale set's AutomaticRepairs service and the calls that set it.
    repairs: Repairs = field(default_factory=Repairs)

    def scale_set(self, match: re.Match[str], state: EmulatorState) -> ArmAnswer:
        """``VirtualMachineScaleSets_Get``: what a drill reads of the scale set."""
        members = _members(match, state, include_removed=False)
        if not members:
            return _no_scale_set(match)
        return ArmAnswer(200, scale_set_resource(members, state.scenario.scaleSets.get(members[0].vmScaleSetName)), {})

    def set_orchestration_service_state(
        self,
        match: re.Match[str],
        wanted: OrchestrationServiceStateInput,
        state: EmulatorState,
        now: datetime,
        *,
        base_url: str,
        version: str,
    ) -> ArmAnswer:
        """Suspends or resumes the scale set's automatic repairs (repairs.py) at once: 202 and a long-running
        operation that has already succeeded."""
        members = _members(match, state, include_removed=False)
        if not members:
            return _no_scale_set(match)
        name = members[0].vmScaleSetName
        refused = self.repairs.apply(name, state.scenario.scaleSets.get(name), wanted, now)
        if refused is not None:
            return refused
        operation = Operation(
            id=str(uuid.uuid4()),
            action="setOrchestrationServiceState",
            subscription=match.group("subscription"),
            location=members[0].location,
            started=now,
            event_ids=[],
            vms=[],
            ended=now,
            status="Succeeded",
        )
        self.operations[operation.id] = operation
        return _accepted(operation, base_url=base_url, version=version)

    def instance_view(self, match: re.Match[str], state: EmulatorState) -> ArmAnswer:
        """``VirtualMachineScaleSets_GetInstanceView``: its instances and its AutomaticRepairs service."""
        members = _members(match, state, include_removed=False)
        if not members:
            return _no_scale_set(match)
        name = members[0].vmScaleSetName
        return ArmAnswer(200, self.repairs.instance_view(name, state.scenario.scaleSets.get(name), len(members)), {})

    def act(  # noqa: PLR0911 -- one return per refusal, each ARM's answer
        self, match: re.Match[str], body: Any, state: EmulatorState, now: datetime, *, base_url: str, version: str
    ) -> ArmAnswer:
        """restart, redeploy or delete of some instances: one event per instance, and a long-running operation."""
        action = match.group("action").lower()
        try:
            ids = InstanceIds.model_validate(body if body is not None else {}).instanceIds
        except ValidationError as error:
            return arm_error(400, "InvalidRequestContent", f"the body is not a list of instance ids: {error}")
        if action == "delete" and not ids:
            return arm_error(400, "InvalidParameter", "instanceIds is required to delete instances")
        members = _members(match, state, include_removed=False)
        if not members:
            return _no_scale_set(match)
        chosen, refusal = _instances(members, ids, match.group("name"))
        if refusal is not None:
            return refusal
        profile = state.scenario.scaleSets.get(members[0].vmScaleSetName, ScaleSetSpec())
        specs = _event_specs(chosen, _EVENT_OF[action], profile)
        if isinstance(specs, ArmAnswer):
            return specs
        try:
            events = [state.create_event(spec, now) for spec in specs]
        except EmulatorInputError as error:
            return arm_error(409, "OperationNotAllowed", str(error))
        operation = Operation(
            id=str(uuid.uuid4()),
            action=action,
            subscription=match.group("subscription"),
            location=chosen[0].location,
            started=now,
            event_ids=[event.event_id for event in events],
            vms=[vm.name for vm in chosen],
        )
        self.operations[operation.id] = operation
        self._log(action, match.group("name"), operation.vms, operation.event_ids, operation.id)
        return _accepted(operation, base_url=base_url, version=version)

    def evict(self, match: re.Match[str], state: EmulatorState, now: datetime) -> ArmAnswer:
        """simulateEviction of one Spot VM: 204 and a Preempt."""
        groups = match.groupdict()
        if "instance" in groups:
            members = _members(match, state, include_removed=True)
            if not members:
                return _no_scale_set(match)
            chosen, refusal = _instances(members, [groups["instance"]], groups["name"])
            if refusal is not None:
                return refusal
            vm = chosen[0]
        else:
            named = [
                vm
                for vm in state.vms.values()
                if vm.name.lower() == groups["vm"].lower()
                and vm.subscriptionId.lower() == groups["subscription"].lower()
                and vm.resourceGroupName.lower() == groups["group"].lower()
            ]
            if not named:
                return arm_error(
                    404,
                    "ResourceNotFound",
                    f"The Resource 'Microsoft.Compute/virtualMachines/{groups['vm']}' was not found.",
                )
            vm = named[0]
        if vm.priority == "Regular":
            return arm_error(
                409, "OperationNotAllowed", f"simulateEviction applies to Spot VMs only; {vm.name} has priority Regular"
            )
        try:
            event = state.create_event(EventCreate(EventType="Preempt", Resources=[vm.name]), now)
        except EmulatorInputError as error:
            return arm_error(409, "OperationNotAllowed", str(error))
        self._log("simulateEviction", vm.vmScaleSetName, [vm.name], [event.event_id], None)
        return ArmAnswer(204, {}, {})

    def status(self, match: re.Match[str], state: EmulatorState, now: datetime, *, monitor: bool) -> ArmAnswer:
        """The operation's status (``Azure-AsyncOperation``), or with ``monitor`` its ``Location`` answer."""
        operation = self.operations.get(match.group("id"))
        if operation is None:
            return arm_error(404, "NotFound", f"no operation {match.group('id')}")
        if operation.status == "InProgress":
            _settle(operation, state, now)
        if monitor:
            if operation.status == "InProgress":
                return ArmAnswer(202, {}, {"Retry-After": str(RETRY_AFTER_SECONDS)})
            return ArmAnswer(200, {}, {})
        body: dict[str, Any] = {
            "name": operation.id,
            "status": operation.status,
            "startTime": _iso(operation.started),
        }
        if operation.ended is not None:
            body["endTime"] = _iso(operation.ended)
        if operation.status == "Canceled":
            body["error"] = {"code": "OperationCanceled", "message": "an event of the operation was canceled"}
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if operation.status == "InProgress" else {}
        return ArmAnswer(200, body, headers)

    def _log(self, action: str, scale_set: str, vms: list[str], event_ids: list[str], operation: str | None) -> None:
        self.log.append(
            {"action": action, "scaleSet": scale_set, "vms": vms, "eventIds": event_ids, "operation": operation}
        )


def _settle(operation: Operation, state: EmulatorState, now: datetime) -> None:
    summaries = {item["EventId"]: item for item in state.event_summaries(now)}
    events = [summaries.get(event_id) for event_id in operation.event_ids]
    if any(event is None or event["state"] == "Canceled" for event in events):
        operation.status, operation.ended = "Canceled", now
    elif operation.action == "delete":
        if all(name in state.removed for name in operation.vms):
            operation.status, operation.ended = "Succeeded", now
    elif all(event is not None and event["state"] in ("Started", "Completed") for event in events):
        operation.status, operation.ended = "Succeeded", now


def scale_set_resource(members: list[VmSpec], spec: ScaleSetSpec | None) -> dict[str, Any]:
    """A scale set as ``VirtualMachineScaleSets_Get`` gives it: the fields a drill reads."""
    first = members[0]
    profile = spec or ScaleSetSpec()
    minutes = round(profile.terminateNotBeforeSeconds / 60)
    uniform = uniform_instance(first) is not None
    properties: dict[str, Any] = {
        "orchestrationMode": "Uniform" if uniform else "Flexible",
        "provisioningState": "Succeeded",
        "scheduledEventsPolicy": {
            "userInitiatedReboot": {"automaticallyApprove": profile.automaticallyApproveUserReboot},
            "userInitiatedRedeploy": {"automaticallyApprove": profile.automaticallyApproveUserRedeploy},
        },
        "virtualMachineProfile": {
            "priority": first.priority,
            "scheduledEventsProfile": {
                "terminateNotificationProfile": {
                    "enable": profile.terminateNotification,
                    "notBeforeTimeout": f"PT{minutes}M",
                }
            },
        },
    }
    if profile.automaticRepairs:
        properties["automaticRepairsPolicy"] = dict(AUTOMATIC_REPAIRS_POLICY)
    return {
        "name": first.vmScaleSetName,
        "id": (
            f"/subscriptions/{first.subscriptionId}/resourceGroups/{first.resourceGroupName}/providers/"
            f"Microsoft.Compute/virtualMachineScaleSets/{first.vmScaleSetName}"
        ),
        "type": "Microsoft.Compute/virtualMachineScaleSets",
        "location": first.location,
        "sku": {"name": first.vmSize, "tier": "Standard", "capacity": len(members)},
        "properties": properties,
    }


def _event_specs(
    chosen: list[VmSpec], event_type: EventTypeName, profile: ScaleSetSpec
) -> list[EventCreate] | ArmAnswer:
    """One user event per instance (Started at once where the scale set approves it automatically), or ARM's refusal
    of a delete the emulator cannot model."""
    specs = []
    for vm in chosen:
        if event_type == "Terminate" and (not profile.terminateNotification or vm.priority != "Regular"):
            why = "terminate notifications are off" if not profile.terminateNotification else "it is a Spot VM"
            return arm_error(
                409,
                "OperationNotAllowed",
                f"the emulator models deletes only where they raise a Terminate; deleting {vm.name} would not ({why})",
            )
        automatic = (event_type == "Reboot" and profile.automaticallyApproveUserReboot) or (
            event_type == "Redeploy" and profile.automaticallyApproveUserRedeploy
        )
        specs.append(
            EventCreate(
                EventType=event_type,
                Resources=[vm.name],
                EventSource="User",
                DurationInSeconds=-1,
                EventStatus="Started" if automatic else "Scheduled",
            )
        )
    return specs


def _accepted(operation: Operation, *, base_url: str, version: str) -> ArmAnswer:
    """202 with the long-running operation's status URL (and its monitor URL), as the Compute RP answers."""
    url = (
        f"{base_url}/subscriptions/{quote(operation.subscription)}/providers/Microsoft.Compute/locations/"
        f"{quote(operation.location)}/operations/{operation.id}?api-version={version}"
    )
    headers = {
        "Azure-AsyncOperation": url,
        "Location": url + "&monitor=true",
        "Retry-After": str(RETRY_AFTER_SECONDS),
    }
    return ArmAnswer(202, {}, headers)


def _members(match: re.Match[str], state: EmulatorState, *, include_removed: bool) -> list[VmSpec]:
    subscription, group, name = match.group("subscription"), match.group("group"), match.group("name")
    return [
        vm
        for vm in state.vms.values()
        if vm.vmScaleSetName.lower() == name.lower()
        and vm.subscriptionId.lower() == subscription.lower()
        and vm.resourceGroupName.lower() == group.lower()
        and (include_removed or vm.name not in state.removed)
    ]


def instance_id(vm: VmSpec) -> str:
    """A scale set instance's id: a Uniform instance's number, a Flexible member's VM name."""
    return uniform_instance(vm) or vm.name


def _instances(members: list[VmSpec], ids: list[str] | None, scale_set: str) -> tuple[list[VmSpec], ArmAnswer | None]:
    if ids is None:
        return members, None
    by_id = {instance_id(vm).lower(): vm for vm in members}
    unknown = [item for item in ids if item.lower() not in by_id]
    if unknown:
        return [], arm_error(404, "NotFound", f"instance ids {unknown} are not instances of scale set {scale_set}")
    return [by_id[item.lower()] for item in dict.fromkeys(ids)], None


def _no_scale_set(match: re.Match[str]) -> ArmAnswer:
    return arm_error(
        404,
        "ResourceNotFound",
        f"The Resource 'Microsoft.Compute/virtualMachineScaleSets/{match.group('name')}' under resource group "
        f"'{match.group('group')}' was not found.",
    )


def _iso(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")
