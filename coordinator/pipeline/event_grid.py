"""Event Grid as a second source (preview): ``ScheduledEventEmitted`` events of the system topic
``Microsoft.ResourceNotifications.MaintenanceResources``, routed by an event subscription to the envelopes' Event Hub.

Takes a message body that is not an envelope (``is_event_grid``: a JSON array, or an object with ``eventType`` and
no ``schema``); gives the events validated against their own schema (``GridEvent``), each bad one set aside with a
reason; then (``sightings``) the observations each VM an event names gives, which ``fold.py`` folds into the same
event records and VM groups as the envelopes' observations.

Keying: an Event Grid event names its VMs by instance name (``Resources``, the same names IMDS lists) under a
scale set or VM ARM id (``data.resourceInfo.id``). A VM whose forwarder already reported (a VM group holds a VM of
that name in that subscription and resource group) is that VM, with its vmId: one VM, one record. Otherwise the VM
is agentless: an identity is made from its ARM id (vmId ``arm-`` + a hash of it), kept in its scale set's group
with ``agentless`` set (no heartbeat is expected of it).

Trust: these events arrive on the platform's own Event Hub, which only the system topic's identity may send to (an
Event Grid event on the VMs' hub is dead-lettered in ingest.py), so their facts are the platform's: they replace
facts a VM reported first, whose claim is then kept as the conflict (domain/event_merge.py). Their sightings still
sit below every forwarder position (epoch ``EVENT_GRID_EPOCH``): a VM's own forwarder has the last word on its own
status (Event Grid may publish late or twice); an Event Grid sighting is never a Relay executor
(``approvals.choose_executor``). Status order: sequence = eventTime in microseconds, so a
duplicate (same Event Grid ``id``, identical payload) or an older status is a no-op. ``Completed`` is folded as
seen Started then gone; ``Canceled`` as gone.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from contracts.document import ScheduledEvent
from contracts.envelope import VmIdentity
from coordinator.domain.arm_ids import resource_group
from coordinator.domain.model import VmRecord, group_key
from coordinator.domain.observations import Observation, ObservationKind
from coordinator.state.store import StateStore

# Below every forwarder state's epoch (they count from 0): a forwarder's sighting of its own VM always wins.
EVENT_GRID_EPOCH = -1
MAX_RESOURCES = 1000
_RESOURCE = re.compile(
    r"^/subscriptions/(?P<subscription>[^/]+)/resourcegroups/(?P<group>[^/]+)/providers/microsoft\.compute/"
    r"(?P<kind>virtualmachines|virtualmachinescalesets)/(?P<name>[^/]+)"
    r"/providers/microsoft\.maintenance/scheduledevents/(?P<event>[^/]+)$",
    re.IGNORECASE,
)


class GridScheduledEvent(BaseModel):
    """``data.resourceInfo.properties``: the IMDS fields, with the Event Grid-only statuses Completed and Canceled."""

    model_config = ConfigDict(extra="allow", frozen=True)

    EventId: str = Field(min_length=1, max_length=128)
    EventType: str = Field(min_length=1, max_length=64)
    ResourceType: str = Field(default="VirtualMachine", max_length=64)
    Resources: list[str] = Field(min_length=1, max_length=MAX_RESOURCES)
    EventStatus: Literal["Scheduled", "Started", "Completed", "Canceled"]
    NotBefore: str = Field(default="", max_length=64)
    Description: str = Field(default="", max_length=4096)
    EventSource: str = Field(default="Platform", max_length=64)
    DurationInSeconds: int = Field(default=-1, ge=-1, le=2**63 - 1)

    @field_validator("Resources")
    @classmethod
    def _names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not 1 <= len(name) <= 256:
                raise ValueError(f"a resource name of {len(name)} characters (1 to 256)")
        return value


class GridResourceInfo(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    id: str = Field(min_length=1, max_length=1024)
    name: str = Field(default="", max_length=128)
    type: str = Field(default="", max_length=128)
    location: str = Field(default="", max_length=64)
    properties: GridScheduledEvent


class GridData(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    resourceInfo: GridResourceInfo
    apiVersion: str = Field(default="", max_length=64)


class GridEvent(BaseModel):
    """One Event Grid event (Event Grid schema) of the Maintenance resources system topic."""

    model_config = ConfigDict(extra="allow", frozen=True)

    id: str = Field(min_length=1, max_length=128)
    topic: str = Field(default="", max_length=1024)
    subject: str = Field(default="", max_length=1024)
    eventType: Literal["Microsoft.ResourceNotifications.MaintenanceResources.ScheduledEventEmitted"]
    eventTime: datetime
    data: GridData
    dataVersion: str = Field(default="", max_length=64)
    metadataVersion: str = Field(default="", max_length=64)

    @field_validator("eventTime")
    @classmethod
    def _aware(cls, value: datetime) -> datetime:
        if value.tzinfo is None:
            raise ValueError("eventTime must carry a UTC offset")
        if not datetime(2000, 1, 1, tzinfo=UTC) <= value <= datetime(2999, 1, 1, tzinfo=UTC):
            raise ValueError(f"eventTime {value.isoformat()} is not plausible")
        return value

    def resource(self) -> re.Match[str]:
        match = _RESOURCE.match(self.data.resourceInfo.id)
        if match is None:
            raise ValueError(
                f"data.resourceInfo.id {self.data.resourceInfo.id[:300]!r} is not a VM's or scale set's "
                "scheduled event (…/providers/Microsoft.Compute/{virtualMachines|virtualMachineScaleSets}/{name}"
                "/providers/Microsoft.Maintenance/scheduledevents/{EventId})"
            )
        if match.group("event").lower() != self.data.resourceInfo.properties.EventId.lower():
            raise ValueError(
                f"data.resourceInfo.id names event {match.group('event')[:128]!r}, its properties "
                f"{self.data.resourceInfo.properties.EventId[:128]!r}"
            )
        return match


def is_event_grid(parsed: Any) -> bool:
    """Event Grid delivers to Event Hubs one event per message or an array of them; an envelope is an object with
    ``schema``."""
    return isinstance(parsed, list) or (isinstance(parsed, dict) and "eventType" in parsed and "schema" not in parsed)


def read_events(parsed: Any) -> list[GridEvent | Exception]:
    """Each event of a message validated on its own: a bad one is its reason, the others go on."""
    items = parsed if isinstance(parsed, list) else [parsed]
    if not items:
        return [ValueError("an empty array (no Event Grid event)")]
    out: list[GridEvent | Exception] = []
    for item in items[:MAX_RESOURCES]:
        try:
            event = GridEvent.model_validate(item)
            event.resource()
            out.append(event)
        except Exception as error:  # this event's alone
            out.append(error)
    return out


@dataclass(frozen=True)
class Sighting:
    """One VM named by one Event Grid event."""

    identity: VmIdentity
    key: str  # its VM group


def _identity(event: GridEvent, name: str) -> VmIdentity:
    resource = event.resource()
    subscription, group = resource.group("subscription"), resource.group("group")
    scale_set = resource.group("name") if resource.group("kind").lower() == "virtualmachinescalesets" else ""
    # The VM id the docs assemble from these parts (subscription, resource group, instance name).
    arm_id = f"/subscriptions/{subscription}/resourceGroups/{group}/providers/Microsoft.Compute/virtualMachines/{name}"
    digest = hashlib.sha256(arm_id.lower().encode()).hexdigest()[:32]
    return VmIdentity(
        name=name,
        vmId=f"arm-{digest}",
        resourceId=arm_id,
        subscriptionId=subscription,
        resourceGroupName=group,
        vmScaleSetName=scale_set,
        location=event.data.resourceInfo.location,
    )


def where(identity: VmIdentity) -> tuple[str, str, str]:
    """Where a VM is as Event Grid names it, in lower case: the subscription and resource group of its resource id
    (ARM's, checked at the door against the census, or bound to its attested vmId), not the ``subscriptionId`` and
    ``resourceGroupName`` beside it, which only the VM says: a VM writing another group's name there would take the
    platform's sightings of the VM of its name in that group. Then its name."""
    found = resource_group(identity.resourceId)
    subscription, group = (found.subscription, found.name) if found else ("", "")
    return subscription.lower(), group.lower(), identity.name.lower()


def _known_vms(store: StateStore) -> dict[tuple[str, str, str], tuple[str, VmRecord]]:
    """Every VM a group holds, by (subscription, resource group, name) in lower case -> (group key, record)."""
    known: dict[tuple[str, str, str], tuple[str, VmRecord]] = {}
    for stored in store.all_vm_groups():
        for vm in stored.record.vms.values():
            where_ = where(vm.identity)
            # A forwarder's identity wins over an agentless one of the same VM.
            if where_ not in known or (known[where_][1].agentless and not vm.agentless):
                known[where_] = (stored.record.group, vm)
    return known


def observations_of(event: GridEvent, identity: VmIdentity) -> list[Observation]:
    """The observations one event gives for one VM it names."""
    properties = event.data.resourceInfo.properties
    micros = int(event.eventTime.timestamp() * 1_000_000)

    def observation(kind: ObservationKind, sequence: int, scheduled: ScheduledEvent | None = None) -> Observation:
        return Observation(
            kind=kind,
            event_id=properties.EventId,
            vm=identity,
            sequence=sequence,
            observed_at=event.eventTime,
            event=scheduled,
            epoch=EVENT_GRID_EPOCH,
            platform=True,
        )

    def listed(status: Literal["Scheduled", "Started"], sequence: int) -> Observation:
        # NotBefore is "" once Started, as IMDS shows it (the record keeps the one announced while Scheduled).
        not_before = "" if status == "Started" else properties.NotBefore
        scheduled = ScheduledEvent.model_validate(
            {**properties.model_dump(), "EventStatus": status, "NotBefore": not_before}
        )
        return observation("listed", sequence, scheduled)

    gone = observation("gone", micros)
    if properties.EventStatus in ("Scheduled", "Started"):
        return [listed(properties.EventStatus, micros)]
    if properties.EventStatus == "Completed":
        # It ran: seen Started, then gone (the record concludes Completed, not Canceled).
        return [listed("Started", micros - 1), gone]
    return [gone]


def sightings(
    store: StateStore, events: list[GridEvent], *, speaking: dict[str, tuple[str, VmRecord]]
) -> dict[str, tuple[Sighting, list[Observation]]]:
    """The Event Grid events' observations by the VM they name (vmId, lower case), with the VM's identity and group.
    ``speaking``: the VMs whose forwarder speaks in this batch (vmId -> group key, record), a new one included."""
    if not events:
        return {}
    known = _known_vms(store)
    for key, record in speaking.values():
        known[where(record.identity)] = (key, record)
    per_vm: dict[str, tuple[Sighting, list[Observation]]] = {}
    for event in events:
        resource = event.resource()
        for name in event.data.resourceInfo.properties.Resources:
            named = (resource.group("subscription").lower(), resource.group("group").lower(), name.lower())
            if named in known:
                key, record = known[named]
                sighting = Sighting(identity=record.identity, key=key)
            else:
                identity = _identity(event, name)
                sighting = Sighting(identity=identity, key=group_key(identity))
            vm_id = sighting.identity.vmId.lower()
            per_vm.setdefault(vm_id, (sighting, []))[1].extend(observations_of(event, sighting.identity))
    return per_vm


def describe(error: Exception) -> str:
    """Why an Event Grid event was refused, in a few hundred characters."""
    if isinstance(error, ValidationError):
        parts = [
            f"{'.'.join(str(p)[:64] for p in item['loc']) or '(event)'}: {str(item['msg'])[:200]}"
            for item in error.errors()[:5]
        ]
        return "; ".join(parts)
    return str(error)[:500]
