"""The IMDS emulator's records (plain data): an event and its transitions, an accepted approval, a VM's removal and
each document content a VM had, each with its summary as the control API and the oracle read it; the errors the
emulator answers a refused input with."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from email.utils import format_datetime
from typing import Any, Literal

from emulators.imds.models import (
    NotBeforeStyle,
    StartDelay,
)
from emulators.imds.versions import EventView, event_view

LifecycleState = Literal["Scheduled", "Started", "Completed", "Canceled"]
# "automatic-approval": a user event created Started (the scheduledEventsPolicy approves user reboots/redeploys).
StartReason = Literal["approval", "notBefore", "hardware-failure", "automatic-approval"]
CancelReason = Literal["request", "vms-removed"]
# How an accepted approval reached the emulator: a VM's StartRequests POST, or the ARM face's acknowledge.
ApprovalPath = Literal["imds", "arm"]
# The event types whose impact deletes the VM.
REMOVING_TYPES = frozenset({"Terminate", "Preempt"})
# Planned platform maintenance walks update domains one at a time, so its Resources stay within one.
UPDATE_DOMAIN_BOUND_TYPES = frozenset({"Freeze", "Reboot", "Redeploy"})


class EmulatorInputError(ValueError):
    """A control-API request or StartRequests body the emulator refuses; the message says why."""


class VmRemovedError(EmulatorInputError):
    """The VM was deleted or evicted; it has no IMDS any more."""


def rfc1123(moment: datetime) -> str:
    """'Mon, 11 Apr 2022 22:26:58 GMT' — the NotBefore format of IMDS."""
    return format_datetime(moment.replace(microsecond=0), usegmt=True)


def iso8601(moment: datetime) -> str:
    """'2022-04-11T22:26:58Z' — the NotBefore format of Microsoft's scheduled-events mock server."""
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def iso_or_none(moment: datetime | None) -> str | None:
    return moment.isoformat().replace("+00:00", "Z") if moment else None


@dataclass(frozen=True)
class VmRemoval:
    """A VM gone for good: which event removed it, and when."""

    vm: str
    event_id: str
    event_type: str
    at: datetime

    def summary(self) -> dict[str, Any]:
        return {"EventId": self.event_id, "EventType": self.event_type, "at": iso_or_none(self.at)}


@dataclass
class EventRecord:
    event_id: str
    event_type: str
    resources: tuple[str, ...]
    source: str
    description: str
    duration: int
    scale_set: str
    scheduled_at: datetime
    not_before: datetime | None
    status: LifecycleState = "Scheduled"
    approved_at: datetime | None = None
    approved_by: list[str] = field(default_factory=list)
    started_at: datetime | None = None
    started_by: StartReason | None = None
    remove_at: datetime | None = None
    removed_at: datetime | None = None
    ref: str | None = None
    # The VMs whose document shows this event (fixed at creation; VMs removed later simply stop reading).
    viewers: frozenset[str] = frozenset()
    # Azure seconds an accepted approval waits before the event starts, or "NotBefore" (approvals are ignored).
    start_delay: StartDelay = 0
    # When the first accepted approval lets the event start (None: not approved, or approvals are ignored).
    start_after: datetime | None = None
    not_before_format: NotBeforeStyle = "RFC1123"
    new_id_when_started: bool = False
    # EventIds the event had before (mock-server mode gives it a new one when it turns Started).
    former_ids: list[str] = field(default_factory=list)
    canceled_by: CancelReason | None = None
    # Terminate/Preempt: when its Resources are gone (set when it starts), and whether that has been applied.
    vms_gone_at: datetime | None = None
    vms_gone: bool = False
    # Every state the event took, with when and why (the truth an oracle judges the pipeline against).
    transitions: list[tuple[datetime, LifecycleState, str]] = field(default_factory=list)

    def enter(self, state: LifecycleState, at: datetime, reason: str) -> None:
        self.status = state
        self.transitions.append((at, state, reason))

    @property
    def live(self) -> bool:
        return self.status in ("Scheduled", "Started")

    def render(self, view: EventView) -> dict[str, Any]:
        """The event as IMDS shows it to one api-version."""
        prefix = "_" if view.underscore_names else ""
        body: dict[str, Any] = {
            "EventId": self.event_id,
            "EventStatus": self.status,
            "EventType": self.event_type,
            "ResourceType": "VirtualMachine",
            "Resources": [prefix + name for name in self.resources],
            "NotBefore": self._not_before_text() if self.status == "Scheduled" else "",
        }
        if view.description:
            body["Description"] = self.description
        if view.event_source:
            body["EventSource"] = self.source
        if view.duration:
            body["DurationInSeconds"] = self.duration
        return body

    def _not_before_text(self) -> str:
        if self.not_before is None:
            return ""
        return iso8601(self.not_before) if self.not_before_format == "ISO8601" else rfc1123(self.not_before)

    def summary(self) -> dict[str, Any]:
        """The global (control API) view, including history."""
        return {
            "EventId": self.event_id,
            "EventType": self.event_type,
            "Resources": list(self.resources),
            "EventSource": self.source,
            "Description": self.description,
            "DurationInSeconds": self.duration,
            "NotBefore": rfc1123(self.not_before) if self.not_before else "",
            "state": self.status,
            "ref": self.ref,
            "scaleSet": self.scale_set,
            "scheduledAt": iso_or_none(self.scheduled_at),
            "approvedAt": iso_or_none(self.approved_at),
            "approvedBy": list(self.approved_by),
            "startedAt": iso_or_none(self.started_at),
            "startedBy": self.started_by,
            "removedAt": iso_or_none(self.removed_at),
            "startDelaySeconds": self.start_delay,
            "startsAfterApproval": iso_or_none(self.start_after),
            "formerEventIds": list(self.former_ids),
            "canceledBy": self.canceled_by,
            "vmsRemovedAt": iso_or_none(self.vms_gone_at) if self.vms_gone else None,
            "viewers": sorted(self.viewers),
            "transitions": [
                {"at": iso_or_none(at), "state": state, "reason": why} for at, state, why in self.transitions
            ],
        }


@dataclass(frozen=True)
class ApprovalRecord:
    event_id: str
    vm: str
    at: datetime
    incarnation: int
    status_before: LifecycleState
    via: ApprovalPath = "imds"

    def summary(self) -> dict[str, Any]:
        return {
            "EventId": self.event_id,
            "vm": self.vm,
            "at": iso_or_none(self.at),
            "incarnation": self.incarnation,
            "statusBefore": self.status_before,
            "via": self.via,
        }


@dataclass
class IncarnationRecord:
    """One document content a VM's IMDS had: its DocumentIncarnation (which may start over after a reset, so
    ``serial`` counts them per VM), since when, the events it listed, the events the one before listed that it no
    longer does, and when it was first and last served in a whole 200 answer (a client read it)."""

    vm: str
    incarnation: int
    serial: int
    at: datetime
    listed: tuple[tuple[str, str], ...]
    gone: tuple[str, ...]
    first_served: datetime | None = None
    last_served: datetime | None = None

    def summary(self) -> dict[str, Any]:
        return {
            "vm": self.vm,
            "incarnation": self.incarnation,
            "serial": self.serial,
            "at": iso_or_none(self.at),
            "listed": [{"EventId": event_id, "EventStatus": status} for event_id, status in self.listed],
            "gone": list(self.gone),
            "firstServed": iso_or_none(self.first_served),
            "lastServed": iso_or_none(self.last_served),
        }


LATEST = event_view("2020-07-01")
