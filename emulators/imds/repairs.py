"""The IMDS emulator's ARM face for a scale set's automatic repairs: the coordinator suspends them while an approved
disruptive event (Reboot, Redeploy, Freeze) is in flight on the scale set's VMs, and resumes them after, so that a
maintenance reboot is not counted as a failed instance and replaced.

Takes, with the Compute checks of the drills (``Authorization: Bearer <token>`` for ARM, ``COMPUTE_API_VERSIONS``):

- ``POST …/virtualMachineScaleSets/{name}/setOrchestrationServiceState``
  (``VirtualMachineScaleSets_SetOrchestrationServiceState``) with the spec's ``OrchestrationServiceStateInput``,
  ``{"serviceName": "AutomaticRepairs", "action": "Suspend" | "Resume"}``: 202 with the headers of a long-running
  operation (``drills.py``), the state changed at once and the operation already ``Succeeded``. A scale set whose
  scenario entry has no ``automaticRepairs`` (its service is ``NotRunning``) → 409 ``OperationNotAllowed``, as is
  ``AutomaticZoneRebalancing`` (which the emulator never runs); any other body → 400 ``InvalidRequestContent``.
  Suspending a suspended service, or resuming a running one, is accepted and changes nothing (the emulator's
  choice: unverified).
- ``GET …/virtualMachineScaleSets/{name}/instanceView`` (``VirtualMachineScaleSets_GetInstanceView``): the
  instances' provisioning summary and ``orchestrationServices``:
  ``[{"serviceName": "AutomaticRepairs", "serviceState": "Running" | "Suspended" | "NotRunning"}]``.

Nothing here reads the clock or holds a socket: ``Drills`` calls it under the emulator's lock with ``now``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from emulators.imds.arm import ArmAnswer, arm_error
from emulators.imds.vm_models import ScaleSetSpec

AUTOMATIC_REPAIRS = "AutomaticRepairs"
ServiceName = Literal["AutomaticRepairs", "AutomaticZoneRebalancing"]
ServiceAction = Literal["Suspend", "Resume"]
ServiceState = Literal["Running", "Suspended", "NotRunning"]
# What the scale set resource shows for a scenario entry with automaticRepairs (the defaults Azure documents:
# the minimum grace period, PT10M, and the Replace action).
AUTOMATIC_REPAIRS_POLICY: dict[str, Any] = {"enabled": True, "gracePeriod": "PT10M", "repairAction": "Replace"}


class OrchestrationServiceStateInput(BaseModel):
    """``setOrchestrationServiceState``'s body (the spec's ``OrchestrationServiceStateInput``: both required)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    serviceName: ServiceName
    action: ServiceAction


def parse_input(body: Any) -> OrchestrationServiceStateInput | ArmAnswer:
    """The body, or ARM's 400 for one that is not an ``OrchestrationServiceStateInput``."""
    try:
        return OrchestrationServiceStateInput.model_validate(body)
    except ValidationError as error:
        return arm_error(
            400,
            "InvalidRequestContent",
            f"the body is not an OrchestrationServiceStateInput ({{serviceName, action}}): {error}",
        )


@dataclass
class Repairs:
    """Each scale set's AutomaticRepairs service, and every call that set it (the caller holds the emulator's lock).
    Scale sets are named as the scenario names them (``scaleSets`` is keyed by name)."""

    suspended: set[str] = field(default_factory=set)
    # Every setOrchestrationServiceState that reached a scale set: {time, scaleSet, serviceName, action, status}.
    log: list[dict[str, Any]] = field(default_factory=list)

    def service_state(self, scale_set: str, spec: ScaleSetSpec | None) -> ServiceState:
        if spec is None or not spec.automaticRepairs:
            return "NotRunning"
        return "Suspended" if scale_set in self.suspended else "Running"

    def apply(
        self, scale_set: str, spec: ScaleSetSpec | None, wanted: OrchestrationServiceStateInput, now: datetime
    ) -> ArmAnswer | None:
        """Suspends or resumes the scale set's service (None), or ARM's refusal; logged either way."""
        refused: ArmAnswer | None = None
        if wanted.serviceName != AUTOMATIC_REPAIRS or self.service_state(scale_set, spec) == "NotRunning":
            refused = arm_error(
                409,
                "OperationNotAllowed",
                f"Orchestration service {wanted.serviceName} is not enabled on virtual machine scale set {scale_set}, "
                f"so it cannot be {'suspended' if wanted.action == 'Suspend' else 'resumed'}.",
            )
        elif wanted.action == "Suspend":
            self.suspended.add(scale_set)
        else:
            self.suspended.discard(scale_set)
        self.log.append(
            {
                "time": now.isoformat().replace("+00:00", "Z"),
                "scaleSet": scale_set,
                "serviceName": wanted.serviceName,
                "action": wanted.action,
                "status": 202 if refused is None else refused.status,
            }
        )
        return refused

    def instance_view(self, scale_set: str, spec: ScaleSetSpec | None, instances: int) -> dict[str, Any]:
        """``VirtualMachineScaleSets_GetInstanceView``: what the emulator knows of it."""
        return {
            "virtualMachine": {"statusesSummary": [{"code": "ProvisioningState/succeeded", "count": instances}]},
            "statuses": [
                {"code": "ProvisioningState/succeeded", "level": "Info", "displayStatus": "Provisioning succeeded"}
            ],
            "orchestrationServices": [
                {"serviceName": AUTOMATIC_REPAIRS, "serviceState": self.service_state(scale_set, spec)}
            ],
        }
