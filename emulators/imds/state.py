"""The pure lifecycle of scheduled events across simulated VMs — no sockets, no threads, no reading the time.

Every public method takes ``now`` and first advances the world to it: scenario steps that fell due, events whose
NotBefore passed (Scheduled → Started) and Started events whose impact is over (removed). Transitions are
applied at the instant they were due, in time order, so results do not depend on when anybody polls.

Per VM, the document shows the events that concern its placement group (or only itself when the VM is
isolated); its DocumentIncarnation is its own counter, incremented whenever that VM's content changes.
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from email.utils import format_datetime
from typing import Any, Literal

from emulators.imds.models import (
    DEFAULT_DESCRIPTIONS,
    DEFAULT_DURATION_SECONDS,
    DEFAULT_NOTICE_SECONDS,
    EventCreate,
    FaultSpec,
    ScaleSetSpec,
    Scenario,
    StartRequestsBody,
    VmSpec,
)
from emulators.imds.versions import EventView, event_view

LifecycleState = Literal["Scheduled", "Started", "Completed", "Canceled"]
StartReason = Literal["approval", "notBefore", "hardware-failure"]

# The docs' rough timeline: Started → removed about 10 minutes later. The emulator keeps a Started event at least
# this long (Azure seconds, scaled) even when DurationInSeconds is shorter, so a 1-per-second poller sees it.
DEFAULT_STARTED_MIN_SECONDS = 600.0


class EmulatorInputError(ValueError):
    """A control-API request or StartRequests body the emulator refuses; the message says why."""


def rfc1123(moment: datetime) -> str:
    """'Mon, 11 Apr 2022 22:26:58 GMT' — the NotBefore format of IMDS."""
    return format_datetime(moment.replace(microsecond=0), usegmt=True)


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat().replace("+00:00", "Z") if moment else None


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
    # The VMs whose document shows this event (fixed at creation: the fleet does not change).
    viewers: frozenset[str] = frozenset()

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
            "NotBefore": rfc1123(self.not_before) if self.status == "Scheduled" and self.not_before else "",
        }
        if view.description:
            body["Description"] = self.description
        if view.event_source:
            body["EventSource"] = self.source
        if view.duration:
            body["DurationInSeconds"] = self.duration
        return body

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
            "scheduledAt": _iso(self.scheduled_at),
            "approvedAt": _iso(self.approved_at),
            "approvedBy": list(self.approved_by),
            "startedAt": _iso(self.started_at),
            "startedBy": self.started_by,
            "removedAt": _iso(self.removed_at),
        }


@dataclass(frozen=True)
class ApprovalRecord:
    event_id: str
    vm: str
    at: datetime
    incarnation: int
    status_before: LifecycleState

    def summary(self) -> dict[str, Any]:
        return {
            "EventId": self.event_id,
            "vm": self.vm,
            "at": _iso(self.at),
            "incarnation": self.incarnation,
            "statusBefore": self.status_before,
        }


LATEST = event_view("2020-07-01")


class EmulatorState:
    def __init__(
        self,
        scenario: Scenario,
        *,
        start: datetime,
        time_scale: float = 1.0,
        started_min_seconds: float = DEFAULT_STARTED_MIN_SECONDS,
        on_fault: Callable[[FaultSpec], None] | None = None,
        new_event_id: Callable[[], str] | None = None,
    ) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        if start.tzinfo is None:
            raise ValueError("start must be timezone-aware")
        self.scenario = scenario
        self.time_scale = time_scale
        self.started_min_seconds = started_min_seconds
        self.vms: dict[str, VmSpec] = {vm.name: vm for vm in scenario.vms}
        self.events: dict[str, EventRecord] = {}
        self.approvals: list[ApprovalRecord] = []
        self.incarnations: dict[str, int] = dict.fromkeys(self.vms, 1)
        self._signatures: dict[str, str] = dict.fromkeys(self.vms, "[]")
        self._start = start
        self._now = start
        self._next_step = 0
        self._refs: dict[str, str] = {}
        self.step_errors: list[str] = []
        self._dirty: set[str] = set()  # VMs whose document content may have changed since the last refresh
        self._on_fault = on_fault
        self._new_event_id = new_event_id or (lambda: str(uuid.uuid4()).upper())

    # ---- time ------------------------------------------------------------------------------------------------

    def scaled(self, azure_seconds: float) -> timedelta:
        return timedelta(seconds=azure_seconds / self.time_scale)

    def advance(self, now: datetime) -> None:
        """Applies, in time order, everything that fell due up to ``now``."""
        now = max(now, self._now)  # a clock never runs backwards for the state
        while True:
            due = self._next_due()
            if due is None or due[0] > now:
                break
            moment, action = due
            self._now = max(self._now, moment)
            action(moment)
            self._release_terminates(moment)
            self._refresh_views()
        self._now = now

    def _next_due(self) -> tuple[datetime, Callable[[datetime], None]] | None:
        candidates: list[tuple[datetime, int, Callable[[datetime], None]]] = []
        for record in self.events.values():
            if record.status == "Started" and record.remove_at is not None:
                candidates.append((record.remove_at, 0, functools.partial(self._remove, record)))
            elif record.status == "Scheduled" and record.not_before is not None:
                candidates.append((record.not_before, 1, functools.partial(self._start_on_time, record)))
        if self._next_step < len(self.scenario.steps):
            step_at = self._start + self.scaled(self.scenario.steps[self._next_step].at)
            candidates.append((step_at, 2, self._run_step))
        if not candidates:
            return None
        moment, _, action = min(candidates, key=lambda item: (item[0], item[1]))
        return moment, action

    # ---- transitions -----------------------------------------------------------------------------------------

    def _start_event(self, record: EventRecord, at: datetime, reason: StartReason) -> None:
        self._dirty |= record.viewers
        record.status = "Started"
        record.started_at = at
        record.started_by = reason
        hold = max(float(record.duration), self.started_min_seconds)
        record.remove_at = at + self.scaled(hold)

    def _start_on_time(self, record: EventRecord, at: datetime) -> None:
        self._start_event(record, at, "notBefore")

    def _remove(self, record: EventRecord, at: datetime) -> None:
        self._dirty |= record.viewers
        record.status = "Completed"
        record.removed_at = at
        record.remove_at = None

    def _terminate_blocked(self, record: EventRecord) -> bool:
        """'Approve all pending deletes': an approved Terminate waits while another Terminate of the same scale
        set is pending unapproved (which also makes simultaneous deletes all-or-nothing before the timeout)."""
        if record.event_type != "Terminate":
            return False
        return any(
            other is not record
            and other.event_type == "Terminate"
            and other.status == "Scheduled"
            and other.approved_at is None
            and other.scale_set == record.scale_set
            for other in self.events.values()
        )

    def _release_terminates(self, at: datetime) -> None:
        for record in list(self.events.values()):
            if record.status == "Scheduled" and record.approved_at is not None and not self._terminate_blocked(record):
                self._start_event(record, at, "approval")

    def _run_step(self, at: datetime) -> None:
        step = self.scenario.steps[self._next_step]
        self._next_step += 1
        if step.create is not None:
            spec = EventCreate.model_validate(step.create.model_dump(exclude={"ref"}))
            try:
                record = self._create(spec, at, ref=step.create.ref)
            except EmulatorInputError as error:
                # Set aside and counted; the rest of the scenario keeps playing.
                self.step_errors.append(f"steps.{self._next_step - 1}.create: {error}")
                return
            if step.create.ref:
                self._refs[step.create.ref] = record.event_id
        elif step.cancel is not None:
            target = self._refs.get(step.cancel, step.cancel.upper())
            canceled = self.events.get(target)
            # A scenario may race its own cancel against an approval; a started event simply is not canceled.
            if canceled is not None and canceled.status == "Scheduled":
                self._cancel(canceled, at)
        elif step.fault is not None:
            self._apply_fault(step.fault)

    def _apply_fault(self, spec: FaultSpec) -> None:
        if spec.kind == "incarnation-reset":
            self.reset_incarnation(spec.vm)
        elif self._on_fault is not None:
            self._on_fault(spec)

    def _cancel(self, record: EventRecord, at: datetime) -> None:
        self._dirty |= record.viewers
        record.status = "Canceled"
        record.removed_at = at

    def _create(self, spec: EventCreate, at: datetime, *, ref: str | None = None) -> EventRecord:
        unknown = [name for name in spec.Resources if name not in self.vms]
        if unknown:
            raise EmulatorInputError(f"Resources names unknown VMs {unknown}; known VMs: {list(self.vms)}")
        event_id = spec.EventId or self._new_event_id()
        if event_id in self.events:
            raise EmulatorInputError(f"EventId {event_id} already exists")
        vms = [self.vms[name] for name in spec.Resources]
        scale_set = ""
        if spec.EventType == "Terminate":
            scale_sets = {vm.vmScaleSetName for vm in vms}
            if "" in scale_sets or len(scale_sets) != 1:
                raise EmulatorInputError(
                    "Terminate exists only for scale-set VMs, all of one scale set "
                    f"(Resources {spec.Resources} are in scale sets {sorted(scale_sets)})"
                )
            scale_set = scale_sets.pop()
            profile = self.scenario.scaleSets.get(scale_set, ScaleSetSpec())
            if not profile.terminateNotification:
                raise EmulatorInputError(
                    f"scale set {scale_set!r} has terminate notifications disabled; its deletes raise no event"
                )
            notice = profile.terminateNotBeforeSeconds
        else:
            notice = DEFAULT_NOTICE_SECONDS[spec.EventType]
        if spec.EventType == "Preempt":
            regular = [vm.name for vm in vms if vm.priority == "Regular"]
            if regular:
                raise EmulatorInputError(f"Preempt concerns Spot VMs only; {regular} have priority Regular")
        if spec.NoticeSeconds is not None:
            notice = spec.NoticeSeconds
        record = EventRecord(
            event_id=event_id,
            event_type=spec.EventType,
            resources=tuple(spec.Resources),
            source=spec.EventSource or ("User" if spec.EventType == "Terminate" else "Platform"),
            description=spec.Description if spec.Description is not None else DEFAULT_DESCRIPTIONS[spec.EventType],
            duration=spec.DurationInSeconds
            if spec.DurationInSeconds is not None
            else DEFAULT_DURATION_SECONDS[spec.EventType],
            scale_set=scale_set,
            scheduled_at=at,
            not_before=None,
            ref=ref,
        )
        record.viewers = frozenset(name for name in self.vms if self.visible_to(record, name))
        self._dirty |= record.viewers
        if spec.EventStatus == "Started":
            self._start_event(record, at, "hardware-failure")
        else:
            record.not_before = spec.NotBefore or at + self.scaled(notice)
        self.events[event_id] = record
        return record

    # ---- views -----------------------------------------------------------------------------------------------

    def isolated(self, vm_name: str) -> bool:
        """Whether the VM receives only its own events (per VM, or for its whole scale set)."""
        vm = self.vms[vm_name]
        scale_set = self.scenario.scaleSets.get(vm.vmScaleSetName) if vm.vmScaleSetName else None
        return vm.isolated or (scale_set is not None and scale_set.isolated)

    def visible_to(self, record: EventRecord, vm_name: str) -> bool:
        if vm_name in record.resources:
            return True
        group = self.vms[vm_name].placementGroupId
        if not group or self.isolated(vm_name):
            return False
        return any(not self.isolated(name) and self.vms[name].placementGroupId == group for name in record.resources)

    def begin(self, now: datetime) -> None:
        """Moves scenario time 0 to ``now`` (the server calls it on start) if nothing has happened yet."""
        if self._next_step == 0 and not self.events and now > self._start:
            self._start = self._now = now

    def _live_for(self, vm_name: str) -> list[EventRecord]:
        return [record for record in self.events.values() if record.live and vm_name in record.viewers]

    def _refresh_views(self) -> None:
        dirty, self._dirty = self._dirty, set()
        for name in dirty:
            signature = json.dumps([record.render(LATEST) for record in self._live_for(name)], sort_keys=True)
            if signature != self._signatures[name]:
                self._signatures[name] = signature
                self.incarnations[name] += 1

    # ---- public operations -----------------------------------------------------------------------------------

    def document(self, vm_name: str, api_version: str, now: datetime) -> dict[str, Any]:
        self.advance(now)
        view = event_view(api_version)
        events = [record.render(view) for record in self._live_for(vm_name) if view.shows_type(record.event_type)]
        return {"DocumentIncarnation": self.incarnations[vm_name], "Events": events}

    def create_event(self, spec: EventCreate, now: datetime, *, ref: str | None = None) -> EventRecord:
        self.advance(now)
        record = self._create(spec, now, ref=ref)
        self._refresh_views()
        return record

    def cancel_event(self, event_id: str, now: datetime) -> EventRecord:
        self.advance(now)
        record = self.events.get(event_id.upper())
        if record is None:
            raise EmulatorInputError(f"no event {event_id!r}")
        if record.status != "Scheduled":
            raise EmulatorInputError(
                f"event {record.event_id} is {record.status}; only a Scheduled event can be canceled"
            )
        self._cancel(record, now)
        self._release_terminates(now)  # a canceled delete no longer holds back approved ones
        self._refresh_views()
        return record

    def approve(self, vm_name: str, body: StartRequestsBody, now: datetime) -> list[ApprovalRecord]:
        """IMDS POST StartRequests. All ids must be valid for this VM (live and visible to it), else nothing is
        applied and EmulatorInputError names the bad ids; approving an already approved or Started event is
        accepted (200), as the docs say."""
        self.advance(now)
        requested = [item.EventId for item in body.StartRequests]
        bad = [
            event_id
            for event_id in requested
            if (record := self.events.get(event_id.upper())) is None or not record.live or vm_name not in record.viewers
        ]
        if bad:
            raise EmulatorInputError(f"EventId not valid for VM {vm_name!r}: {bad}")
        accepted: list[ApprovalRecord] = []
        for event_id in dict.fromkeys(item.upper() for item in requested):
            record = self.events[event_id]
            accepted.append(
                ApprovalRecord(
                    event_id=event_id,
                    vm=vm_name,
                    at=now,
                    incarnation=self.incarnations[vm_name],
                    status_before=record.status,
                )
            )
            record.approved_by.append(vm_name)
            if record.status == "Scheduled" and record.approved_at is None:
                record.approved_at = now
        self.approvals.extend(accepted)
        self._release_terminates(now)
        self._refresh_views()
        return accepted

    def reset_incarnation(self, vm_name: str | None) -> None:
        """As after IMDS was disabled for 24 hours: the VM's counter starts over."""
        for name in [vm_name] if vm_name is not None else list(self.vms):
            self.incarnations[name] = 1

    def apply_fault(self, spec: FaultSpec, now: datetime) -> None:
        self.advance(now)
        if spec.vm is not None and spec.vm not in self.vms:
            raise EmulatorInputError(f"fault names unknown VM {spec.vm!r}; known VMs: {list(self.vms)}")
        self._apply_fault(spec)

    def event_summaries(self, now: datetime) -> list[dict[str, Any]]:
        self.advance(now)
        return [record.summary() for record in self.events.values()]

    def approval_summaries(self, now: datetime) -> list[dict[str, Any]]:
        self.advance(now)
        return [approval.summary() for approval in self.approvals]

    def vm_summaries(self, now: datetime) -> list[dict[str, Any]]:
        self.advance(now)
        return [
            {
                **vm.model_dump(),
                "DocumentIncarnation": self.incarnations[vm.name],
                "events": [record.event_id for record in self._live_for(vm.name)],
            }
            for vm in self.vms.values()
        ]
