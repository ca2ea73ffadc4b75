"""What a drill will do, decided before anything is sent (pure: no I/O).

Takes the drill's kind, the scale set and its instances as ARM describes them (``ScaleSet``, ``Instance``: parsed
at the boundary, ops/drill/arm.py), the chosen VMs and ARM's endpoint; gives a ``Plan``: every call (method, URL
with api-version, body), the scheduled event each chosen VM should see and with how much notice, or the reasons
the drill is refused. The notices are the documented ones (``../shared/reference/scheduled-events.md``: Reboot
15 min, Redeploy 10 min, Preempt 30 s) and, for a delete, the scale set's ``terminateNotificationProfile``; a
user's Reboot or Redeploy comes without notice (created Started) when the scale set's ``scheduledEventsPolicy``
approves them automatically.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Literal
from urllib.parse import quote

from pydantic import BaseModel, ConfigDict

DrillKind = Literal["reboot", "redeploy", "evict", "delete"]
KINDS: tuple[DrillKind, ...] = ("reboot", "redeploy", "evict", "delete")
# The Compute api-version the project's Bicep deploys the scale set with (infra/modules/vmss.bicep).
COMPUTE_API_VERSION = "2025-04-01"
# The minimum notice the docs give each event type (Terminate's is the scale set's).
DOCUMENTED_NOTICE_SECONDS = {"Reboot": 900.0, "Redeploy": 600.0, "Preempt": 30.0}
_ACTION = {"reboot": "restart", "redeploy": "redeploy", "delete": "delete"}
_EVENT = {"reboot": "Reboot", "redeploy": "Redeploy", "evict": "Preempt", "delete": "Terminate"}
_SCALE_SET_ID = re.compile(
    r"^/subscriptions/[^/]+/resourceGroups/(?P<group>[^/]+)/providers/Microsoft\.Compute/virtualMachineScaleSets/"
    r"(?P<name>[^/]+)$",
    re.IGNORECASE,
)
_DURATION = re.compile(r"^PT(?:(?P<hours>\d+)H)?(?:(?P<minutes>\d+)M)?(?:(?P<seconds>\d+)S)?$")


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class AutomaticApproval(_Loose):
    automaticallyApprove: bool = False


class ScheduledEventsPolicy(_Loose):
    userInitiatedReboot: AutomaticApproval = AutomaticApproval()
    userInitiatedRedeploy: AutomaticApproval = AutomaticApproval()


class TerminateNotificationProfile(_Loose):
    enable: bool = False
    notBeforeTimeout: str = ""


class ScheduledEventsProfile(_Loose):
    terminateNotificationProfile: TerminateNotificationProfile | None = None


class VmProfile(_Loose):
    priority: str = "Regular"
    scheduledEventsProfile: ScheduledEventsProfile | None = None


class ScaleSetProperties(_Loose):
    orchestrationMode: str = "Uniform"
    scheduledEventsPolicy: ScheduledEventsPolicy = ScheduledEventsPolicy()
    virtualMachineProfile: VmProfile = VmProfile()


class ScaleSet(_Loose):
    """What a drill reads of ``VirtualMachineScaleSets_Get``."""

    id: str
    name: str
    location: str = ""
    properties: ScaleSetProperties = ScaleSetProperties()

    @property
    def uniform(self) -> bool:
        return self.properties.orchestrationMode.lower() != "flexible"

    @property
    def terminate_notice_seconds(self) -> float | None:
        """The Terminate notice the scale set's profile gives, None when it gives none."""
        profile = self.properties.virtualMachineProfile.scheduledEventsProfile or ScheduledEventsProfile()
        terminate = profile.terminateNotificationProfile
        if terminate is None or not terminate.enable:
            return None
        return iso_duration_seconds(terminate.notBeforeTimeout)


class InstanceProperties(_Loose):
    priority: str | None = None


class Instance(_Loose):
    """A scale set's VM as ARM lists it: a Uniform instance (``instanceId``) or a Flexible member (a VM)."""

    id: str
    name: str
    instanceId: str | None = None
    properties: InstanceProperties = InstanceProperties()


@dataclass(frozen=True)
class Call:
    method: str
    url: str
    body: dict[str, Any] | None
    vms: list[str]
    # What ARM answers: a long-running operation polled to its end, or 204 at once.
    answer: str


@dataclass(frozen=True)
class Expected:
    vm: str
    eventType: str
    eventSource: str
    # Seconds from the call to NotBefore; None when the event comes Started (no notice).
    noticeSeconds: float | None
    why: str


@dataclass
class Plan:
    kind: DrillKind
    scaleSet: str
    calls: list[Call] = field(default_factory=list)
    expected: list[Expected] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


class DrillInputError(ValueError):
    """A drill that cannot be planned (bad scale set id, unknown VM); the message says why."""


def iso_duration_seconds(text: str) -> float | None:
    """'PT10M' → 600 (the hours, minutes and seconds ARM writes a notBeforeTimeout with); None if not that."""
    match = _DURATION.match(text.strip().upper())
    if match is None or not any(match.groupdict().values()):
        return None
    parts = {key: int(value or 0) for key, value in match.groupdict().items()}
    return float(parts["hours"] * 3600 + parts["minutes"] * 60 + parts["seconds"])


def check_scale_set_id(scale_set_id: str) -> str:
    if _SCALE_SET_ID.match(scale_set_id) is None:
        raise DrillInputError(
            f"{scale_set_id!r} is not a scale set's resource id "
            "(/subscriptions/…/resourceGroups/…/providers/Microsoft.Compute/virtualMachineScaleSets/NAME)"
        )
    return scale_set_id.rstrip("/")


def choose(instances: list[Instance], wanted: list[str]) -> list[Instance]:
    """The instances named by VM name or instance id (case-insensitive), in the order asked."""
    by_key: dict[str, Instance] = {}
    for instance in instances:
        by_key[instance.name.lower()] = instance
        if instance.instanceId is not None:
            by_key.setdefault(instance.instanceId.lower(), instance)
    unknown = [name for name in wanted if name.lower() not in by_key]
    if unknown:
        known = ", ".join(sorted(instance.name for instance in instances)) or "none"
        raise DrillInputError(f"{unknown} are not VMs of the scale set (its VMs: {known})")
    return list({by_key[name.lower()].id: by_key[name.lower()] for name in wanted}.values())


def plan(
    kind: DrillKind,
    scale_set: ScaleSet,
    chosen: list[Instance],
    *,
    endpoint: str,
    api_version: str = COMPUTE_API_VERSION,
) -> Plan:
    """Every call the drill makes and what each VM should see."""
    result = Plan(kind=kind, scaleSet=scale_set.id)
    base = endpoint.rstrip("/")
    query = f"api-version={api_version}"
    for instance in chosen:
        expected, refusal = _expected(kind, scale_set, instance)
        if refusal:
            result.refusals.append(refusal)
        elif expected is not None:
            result.expected.append(expected)
    if result.refusals or not chosen:
        return result
    if kind == "evict":
        for instance in chosen:
            if scale_set.uniform:
                path = f"{scale_set.id}/virtualMachines/{quote(_instance_id(scale_set, instance), safe='')}"
            else:
                path = instance.id
            result.calls.append(
                Call("POST", f"{base}{path}/simulateEviction?{query}", None, [instance.name], "204 No Content")
            )
        return result
    body = {"instanceIds": [_instance_id(scale_set, instance) for instance in chosen]}
    result.calls.append(
        Call(
            "POST",
            f"{base}{scale_set.id}/{_ACTION[kind]}?{query}",
            body,
            [instance.name for instance in chosen],
            "202 Accepted with Azure-AsyncOperation, polled until the operation ends",
        )
    )
    return result


def _instance_id(scale_set: ScaleSet, instance: Instance) -> str:
    """What instanceIds names: a Uniform instance's id, a Flexible member's VM name."""
    return instance.instanceId if scale_set.uniform and instance.instanceId is not None else instance.name


def _priority(scale_set: ScaleSet, instance: Instance) -> str:
    return instance.properties.priority or scale_set.properties.virtualMachineProfile.priority


def _expected(  # noqa: PLR0911 -- one return per kind and per refusal, each saying why
    kind: DrillKind, scale_set: ScaleSet, instance: Instance
) -> tuple[Expected | None, str]:
    event = _EVENT[kind]
    spot = _priority(scale_set, instance).lower() in ("spot", "low")
    if kind == "evict":
        if not spot:
            return None, f"{instance.name}: simulateEviction applies to Spot VMs only (priority Regular)"
        notice = DOCUMENTED_NOTICE_SECONDS[event]
        return Expected(instance.name, event, "Platform", notice, "the documented notice of a Spot eviction"), ""
    if kind == "delete":
        notice_seconds = scale_set.terminate_notice_seconds
        if spot:
            return None, f"{instance.name}: a Spot VM's delete raises no Terminate (no drill to rehearse)"
        if notice_seconds is None:
            return None, (
                f"{instance.name}: the scale set has no terminateNotificationProfile, so a delete raises no "
                "Terminate (no drill to rehearse; the VM would just go)"
            )
        why = "the scale set's terminateNotificationProfile.notBeforeTimeout"
        return Expected(instance.name, event, "User", notice_seconds, why), ""
    policy = scale_set.properties.scheduledEventsPolicy
    automatic = (policy.userInitiatedReboot if kind == "reboot" else policy.userInitiatedRedeploy).automaticallyApprove
    if automatic:
        why = f"the scale set's scheduledEventsPolicy approves a user's {event} automatically: it comes Started"
        return Expected(instance.name, event, "User", None, why), ""
    return Expected(
        instance.name, event, "User", DOCUMENTED_NOTICE_SECONDS[event], f"the documented notice of a {event}"
    ), ""


def describe(result: Plan) -> str:
    """The plan as a person reads it."""
    lines = [f"drill {result.kind} on {result.scaleSet}"]
    for refusal in result.refusals:
        lines.append(f"  refused: {refusal}")
    for call in result.calls:
        lines.append(f"  {call.method} {call.url}")
        if call.body is not None:
            lines.append(f"      body {json.dumps(call.body)}")
        lines.append(f"      VMs {', '.join(call.vms)}; ARM answers {call.answer}")
    for item in result.expected:
        notice = (
            "no notice (created Started)"
            if item.noticeSeconds is None
            else f"NotBefore {_span(item.noticeSeconds)} after the call"
        )
        lines.append(f"  expect on {item.vm}: {item.eventType} (EventSource {item.eventSource}), {notice}: {item.why}")
    return "\n".join(lines)


def _span(seconds: float) -> str:
    return f"{seconds / 60:g} min" if seconds >= 60 and seconds % 60 == 0 else f"{seconds:g} s"
