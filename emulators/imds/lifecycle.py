"""The pure lifecycle of scheduled events across simulated VMs — no sockets, no threads, no reading the time.

Every public method (``EmulatorState``'s) takes ``now`` and first advances the world to it: scenario steps that
fell due, events whose NotBefore passed (Scheduled → Started) and Started events whose impact is over (removed).
Transitions are applied at the instant they were due, in time order, so results do not depend on when anybody
polls.

Per VM, the document shows the events that concern its placement group (or only itself when the VM is
isolated); its DocumentIncarnation is its own counter, incremented whenever that VM's content changes.

A VM deleted by a Terminate or evicted by a Preempt is gone: from then on it has no document at all (the server
answers none of its requests), and no new event may name it.
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta

from emulators.imds.models import (
    DEFAULT_DURATION_SECONDS,
    DEFAULT_NOTICE_SECONDS,
    EventCreate,
    FaultSpec,
    Scenario,
    default_description,
)
from emulators.imds.records import (
    LATEST,
    REMOVING_TYPES,
    UPDATE_DOMAIN_BOUND_TYPES,
    ApprovalRecord,
    CancelReason,
    EmulatorInputError,
    EventRecord,
    IncarnationRecord,
    StartReason,
    VmRemoval,
    iso_or_none,
)
from emulators.imds.vm_models import ScaleSetSpec, VmSpec

# The docs' rough timeline: Started → removed about 10 minutes later. The emulator keeps a Started event at least
# this long (Azure seconds, scaled) even when DurationInSeconds is shorter, so a 1-per-second poller sees it.
DEFAULT_STARTED_MIN_SECONDS = 600.0


class Lifecycle:
    """The events' lifecycle across the scenario's VMs and the documents it gives each VM; ``EmulatorState`` is its
    public face."""

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
        # Keyed by the EventId an event was created with; `_keys` also knows its current and former ids.
        self.events: dict[str, EventRecord] = {}
        self._keys: dict[str, str] = {}
        self.approvals: list[ApprovalRecord] = []
        self.removed: dict[str, VmRemoval] = {}
        # VMs changed (update_vm) or added (add_vm) so far: with the counts of VMs and removals, what says that the
        # ARM face's lists must be made again.
        self.vm_changes = 0
        self.incarnations: dict[str, int] = dict.fromkeys(self.vms, 1)
        self._signatures: dict[str, str] = dict.fromkeys(self.vms, "[]")
        self._start = start
        self._now = start
        self._next_step = 0
        # The steps in time order, each with its index in the file (errors name it): a step listed after a later
        # one was applied late, so an event created and canceled between them was never in any document.
        self._steps = sorted(enumerate(scenario.steps), key=lambda item: item[1].at)
        self._refs: dict[str, str] = {}
        self.step_errors: list[str] = []
        self._dirty: set[str] = set()  # VMs whose document content may have changed since the last refresh
        self._on_fault = on_fault
        self._new_event_id = new_event_id or (lambda: str(uuid.uuid4()).upper())
        # Every document content of every VM (its first: incarnation 1, no events).
        self.incarnation_log: dict[str, list[IncarnationRecord]] = {
            name: [IncarnationRecord(name, 1, 0, start, (), ())] for name in self.vms
        }

    # ---- time -------------------------------------------------------------------------------------------------------

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
            self._release_approved(moment)
            self._refresh_views()
        self._now = now

    def _next_due(self) -> tuple[datetime, Callable[[datetime], None]] | None:
        candidates: list[tuple[datetime, int, Callable[[datetime], None]]] = []
        for record in self.events.values():
            if record.vms_gone_at is not None and not record.vms_gone:
                candidates.append((record.vms_gone_at, 0, functools.partial(self._remove_vms, record)))
            if record.status == "Started" and record.remove_at is not None:
                candidates.append((record.remove_at, 0, functools.partial(self._remove, record)))
            elif record.status == "Scheduled" and record.not_before is not None:
                candidates.append((record.not_before, 1, functools.partial(self._start_on_time, record)))
                # Only an approval that can take effect is due (a held delete is released by whatever unblocks it),
                # so that every due action makes progress.
                if (
                    record.start_after is not None
                    and record.start_after < record.not_before
                    and not self._terminate_blocked(record, record.start_after)
                ):
                    candidates.append((record.start_after, 1, functools.partial(self._start_approved, record)))
        if self._next_step < len(self._steps):
            step_at = self._start + self.scaled(self._steps[self._next_step][1].at)
            candidates.append((step_at, 2, self._run_step))
        if not candidates:
            return None
        moment, _, action = min(candidates, key=lambda item: (item[0], item[1]))
        return moment, action

    # ---- transitions ------------------------------------------------------------------------------------------------

    def _start_event(self, record: EventRecord, at: datetime, reason: StartReason) -> None:
        self._dirty |= record.viewers
        record.enter("Started", at, reason)
        record.started_at = at
        record.started_by = reason
        hold = max(float(record.duration), self.started_min_seconds)
        record.remove_at = at + self.scaled(hold)
        if record.new_id_when_started:
            record.former_ids.append(record.event_id)
            record.event_id = self._unused_event_id()
            self._keys[record.event_id] = self._keys[record.former_ids[0]]
        if record.event_type in REMOVING_TYPES:
            record.vms_gone_at = at + self.scaled(self.scenario.vmGoneAfterStartedSeconds)

    def _start_on_time(self, record: EventRecord, at: datetime) -> None:
        self._start_event(record, at, "notBefore")

    def _start_approved(self, record: EventRecord, at: datetime) -> None:
        self._start_event(record, at, "approval")

    def _remove(self, record: EventRecord, at: datetime) -> None:
        self._dirty |= record.viewers
        record.enter("Completed", at, "impact over")
        record.removed_at = at
        record.remove_at = None

    def _remove_vms(self, record: EventRecord, at: datetime) -> None:
        """The delete or eviction is done: its VMs are gone. Events still Scheduled for nothing but gone VMs
        will never happen, so they are canceled (the VMs that share them see them leave)."""
        record.vms_gone = True
        for name in record.resources:
            self.removed.setdefault(name, VmRemoval(name, record.event_id, record.event_type, at))
        for other in self.events.values():
            if other.status == "Scheduled" and all(name in self.removed for name in other.resources):
                self._cancel(other, at, by="vms-removed")

    def _terminate_blocked(self, record: EventRecord, at: datetime) -> bool:
        """'Approve all pending deletes': an approved Terminate waits while another Terminate of the same scale
        set is pending, i.e. Scheduled with no approval that has taken effect by ``at`` (which also makes
        simultaneous deletes all-or-nothing before the timeout)."""
        if record.event_type != "Terminate":
            return False
        return any(
            other is not record
            and other.event_type == "Terminate"
            and other.status == "Scheduled"
            and (other.start_after is None or other.start_after > at)
            and other.scale_set == record.scale_set
            for other in self.events.values()
        )

    def _release_approved(self, at: datetime) -> None:
        for record in list(self.events.values()):
            if (
                record.status == "Scheduled"
                and record.start_after is not None
                and record.start_after <= at
                and not self._terminate_blocked(record, at)
            ):
                self._start_event(record, at, "approval")

    def _run_step(self, at: datetime) -> None:
        index, step = self._steps[self._next_step]
        self._next_step += 1
        if step.create is not None:
            spec = EventCreate.model_validate(step.create.model_dump(exclude={"ref"}))
            try:
                record = self._create(spec, at, ref=step.create.ref)
            except EmulatorInputError as error:
                # Set aside and counted; the rest of the scenario keeps playing.
                self.step_errors.append(f"steps.{index}.create: {error}")
                return
            if step.create.ref:
                self._refs[step.create.ref] = record.event_id
        elif step.cancel is not None:
            canceled = self._find(self._refs.get(step.cancel, step.cancel))
            # A scenario may race its own cancel against an approval; a started event simply is not canceled.
            if canceled is not None and canceled.status == "Scheduled":
                self._cancel(canceled, at, by="request")
        elif step.fault is not None:
            self._apply_fault(step.fault)

    def _apply_fault(self, spec: FaultSpec) -> None:
        if spec.kind == "incarnation-reset":
            self.reset_incarnation(spec.vm)
        elif self._on_fault is not None:
            self._on_fault(spec)

    def _cancel(self, record: EventRecord, at: datetime, *, by: CancelReason) -> None:
        self._dirty |= record.viewers
        record.enter("Canceled", at, by)
        record.removed_at = at
        record.canceled_by = by

    def _find(self, event_id: str) -> EventRecord | None:
        key = self._keys.get(event_id.upper())
        return self.events.get(key) if key is not None else None

    def _unused_event_id(self) -> str:
        event_id = self._new_event_id()
        while event_id in self._keys:
            event_id = self._new_event_id()
        return event_id

    def _check_resources(self, spec: EventCreate, source: str) -> str:
        """Refuses what Azure never sends for these VMs (EmulatorInputError naming VMs and the reason); returns
        the scale set of a Terminate."""
        unknown = [name for name in spec.Resources if name not in self.vms]
        if unknown:
            raise EmulatorInputError(f"Resources names unknown VMs {unknown}; known VMs: {list(self.vms)}")
        gone = [name for name in spec.Resources if name in self.removed]
        if gone:
            raise EmulatorInputError(
                "Resources names VMs that no longer exist: " + "; ".join(self._removal_text(name) for name in gone)
            )
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
            spot = [f"{vm.name} (priority {vm.priority})" for vm in vms if vm.priority != "Regular"]
            if spot:
                raise EmulatorInputError(
                    f"Terminate notifications are not available for Spot/low-priority VMs: {', '.join(spot)}; "
                    "their deletion raises no Terminate (an eviction is a Preempt)"
                )
        if spec.EventType == "Preempt":
            regular = [vm.name for vm in vms if vm.priority == "Regular"]
            if regular:
                raise EmulatorInputError(f"Preempt concerns Spot VMs only; {regular} have priority Regular")
        if source == "Platform" and spec.EventType in UPDATE_DOMAIN_BOUND_TYPES:
            domains: dict[str, list[str]] = {}
            for vm in vms:
                domains.setdefault(vm.platformUpdateDomain, []).append(vm.name)
            if len(domains) > 1:
                spread = "; ".join(f"update domain {domain}: {names}" for domain, names in sorted(domains.items()))
                raise EmulatorInputError(
                    f"platform maintenance ({spec.EventType}) stays within one update domain, but Resources span "
                    f"{len(domains)} ({spread}); create one event per update domain"
                )
        return scale_set

    def _removal_text(self, vm_name: str) -> str:
        removal = self.removed[vm_name]
        return f"{vm_name} was removed by {removal.event_type} {removal.event_id} at {iso_or_none(removal.at)}"

    def _create(self, spec: EventCreate, at: datetime, *, ref: str | None = None) -> EventRecord:
        source = spec.EventSource or ("User" if spec.EventType == "Terminate" else "Platform")
        scale_set = self._check_resources(spec, source)
        event_id = spec.EventId or self._unused_event_id()
        if event_id in self._keys:
            raise EmulatorInputError(f"EventId {event_id} already exists")
        if spec.EventType == "Terminate":
            notice = self.scenario.scaleSets.get(scale_set, ScaleSetSpec()).terminateNotBeforeSeconds
        else:
            notice = DEFAULT_NOTICE_SECONDS[spec.EventType]
        if spec.NoticeSeconds is not None:
            notice = spec.NoticeSeconds
        created_started = spec.EventStatus == "Started"
        record = EventRecord(
            event_id=event_id,
            event_type=spec.EventType,
            resources=tuple(spec.Resources),
            source=source,
            description=spec.Description
            if spec.Description is not None
            else default_description(spec.EventType, source=source, created_started=created_started),
            duration=spec.DurationInSeconds
            if spec.DurationInSeconds is not None
            else DEFAULT_DURATION_SECONDS[spec.EventType],
            scale_set=scale_set,
            scheduled_at=at,
            not_before=None,
            ref=ref,
            start_delay=spec.StartDelaySeconds
            if spec.StartDelaySeconds is not None
            else self.scenario.startDelaySeconds,
            not_before_format=spec.NotBeforeFormat or self.scenario.notBeforeFormat,
            new_id_when_started=spec.NewEventIdWhenStarted
            if spec.NewEventIdWhenStarted is not None
            else self.scenario.newEventIdWhenStarted,
        )
        record.viewers = frozenset(
            name for name in self.vms if name not in self.removed and self.visible_to(record, name)
        )
        record.transitions.append((at, "Scheduled", "created"))
        self._dirty |= record.viewers
        self.events[event_id] = record
        self._keys[event_id] = event_id
        if created_started:
            # Nothing was scheduled: a hardware failure (Platform), or a user operation approved automatically.
            record.new_id_when_started = False
            self._start_event(record, at, "automatic-approval" if source == "User" else "hardware-failure")
        else:
            record.not_before = spec.NotBefore or at + self.scaled(notice)
        return record

    # ---- views ------------------------------------------------------------------------------------------------------

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
            for log in self.incarnation_log.values():
                log[0].at = now

    def _live_for(self, vm_name: str) -> list[EventRecord]:
        return [record for record in self.events.values() if record.live and vm_name in record.viewers]

    def _refresh_views(self) -> None:
        dirty, self._dirty = self._dirty - self.removed.keys(), set()
        for name in dirty:
            signature = json.dumps([record.render(LATEST) for record in self._live_for(name)], sort_keys=True)
            if signature != self._signatures[name]:
                self._signatures[name] = signature
                self.incarnations[name] += 1
                self._log_incarnation(name)

    def _log_incarnation(self, vm_name: str) -> None:
        log = self.incarnation_log[vm_name]
        listed = tuple((record.event_id, record.status) for record in self._live_for(vm_name))
        now_ids = {event_id for event_id, _ in listed}
        gone = tuple(event_id for event_id, _ in log[-1].listed if event_id not in now_ids)
        log.append(IncarnationRecord(vm_name, self.incarnations[vm_name], len(log), self._now, listed, gone))

    def reset_incarnation(self, vm_name: str | None) -> None:
        """As after IMDS was disabled for 24 hours: the VM's counter starts over."""
        for name in [vm_name] if vm_name is not None else list(self.vms):
            self.incarnations[name] = 1
            if name not in self.removed:
                self._log_incarnation(name)
