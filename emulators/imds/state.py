"""The IMDS emulator's state as its faces use it (pure: no sockets, no threads, no reading the time): every operation
takes ``now`` and first advances the lifecycle (emulators/imds/lifecycle.py) to it, then applies what it made due at
once."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import ValidationError

from emulators.imds.lifecycle import Lifecycle
from emulators.imds.models import EventCreate, FaultSpec, StartRequestsBody, describe_validation_error
from emulators.imds.records import (
    ApprovalPath,
    ApprovalRecord,
    EmulatorInputError,
    EventRecord,
    IncarnationRecord,
    VmRemovedError,
)
from emulators.imds.versions import event_view
from emulators.imds.vm_models import VmSpec


class EmulatorState(Lifecycle):
    def _require_present(self, vm_name: str) -> None:
        if vm_name in self.removed:
            raise VmRemovedError(f"VM {self._removal_text(vm_name)}; it has no IMDS any more")

    def _settle(self, now: datetime) -> None:
        """After an operation: applies what it made due at once (a delete that started removes its VMs now)."""
        self.advance(now)
        self._refresh_views()

    def document(self, vm_name: str, api_version: str, now: datetime, *, served: bool = False) -> dict[str, Any]:
        """The VM's document now; ``served``: a client reads it in a whole answer (recorded in the incarnation
        log, so that what a forwarder saw can be told from what it could not have seen)."""
        self.advance(now)
        self._require_present(vm_name)
        view = event_view(api_version)
        events = [record.render(view) for record in self._live_for(vm_name) if view.shows_type(record.event_type)]
        if served:
            current = self.incarnation_log[vm_name][-1]
            current.first_served = current.first_served or now
            current.last_served = now
        return {"DocumentIncarnation": self.incarnations[vm_name], "Events": events}

    def create_event(self, spec: EventCreate, now: datetime, *, ref: str | None = None) -> EventRecord:
        self.advance(now)
        record = self._create(spec, now, ref=ref)
        self._settle(now)
        return record

    def cancel_event(self, event_id: str, now: datetime) -> EventRecord:
        self.advance(now)
        record = self._find(event_id)
        if record is None:
            raise EmulatorInputError(f"no event {event_id!r}")
        if record.status != "Scheduled":
            raise EmulatorInputError(
                f"event {record.event_id} is {record.status}; only a Scheduled event can be canceled"
            )
        self._cancel(record, now, by="request")
        self._release_approved(now)  # a canceled delete no longer holds back approved ones
        self._settle(now)
        return record

    def acknowledging_vm(self, event_id: str, candidates: list[str], now: datetime) -> str | None:
        """Which of these VMs (an ARM acknowledge's resource) sees the live event, so that the acknowledge
        approves it as that VM's StartRequests would; None when none does (ARM's 404)."""
        self.advance(now)
        record = self._find(event_id)
        if record is None or not record.live or record.event_id != event_id.upper():
            return None
        # A VM the event names first (its own event), else any of the resource's VMs that sees it.
        ordered = sorted(candidates, key=lambda name: name not in record.resources)
        return next((name for name in ordered if name in record.viewers and name not in self.removed), None)

    def approve(
        self, vm_name: str, body: StartRequestsBody, now: datetime, *, via: ApprovalPath = "imds"
    ) -> list[ApprovalRecord]:
        """IMDS POST StartRequests. All ids must be valid for this VM (live, visible to it, and the id the event
        has now), else nothing is applied and EmulatorInputError names the bad ids; approving an already approved
        or Started event is accepted (200), as the docs say. The approval is recorded when accepted, even when the
        platform lets the event start only later (StartDelaySeconds) or at NotBefore."""
        self.advance(now)
        self._require_present(vm_name)
        requested = [item.EventId for item in body.StartRequests]
        bad = [
            event_id
            for event_id in requested
            if (record := self._find(event_id)) is None
            or record.event_id != event_id.upper()
            or not record.live
            or vm_name not in record.viewers
        ]
        if bad:
            raise EmulatorInputError(f"EventId not valid for VM {vm_name!r}: {bad}")
        accepted: list[ApprovalRecord] = []
        for event_id in dict.fromkeys(item.upper() for item in requested):
            record = self.events[self._keys[event_id]]
            accepted.append(
                ApprovalRecord(
                    event_id=event_id,
                    vm=vm_name,
                    at=now,
                    incarnation=self.incarnations[vm_name],
                    status_before=record.status,
                    via=via,
                )
            )
            record.approved_by.append(vm_name)
            if record.status == "Scheduled" and record.approved_at is None:
                record.approved_at = now
                if record.start_delay != "NotBefore":
                    record.start_after = now + self.scaled(record.start_delay)
        self.approvals.extend(accepted)
        self._release_approved(now)
        self._settle(now)
        return accepted

    def update_vm(self, vm_name: str, changes: dict[str, Any]) -> VmSpec:
        """The VM with ``changes`` applied (validated as a whole); who it is (name, ids, scale set) cannot change."""
        if vm_name not in self.vms:
            raise EmulatorInputError(f"no VM {vm_name!r}; known VMs: {list(self.vms)}")
        fixed = sorted(
            set(changes)
            & {"name", "vmId", "resourceId", "subscriptionId", "resourceGroupName", "vmScaleSetName", "computerName"}
        )
        if fixed:
            raise EmulatorInputError(f"{fixed} say which VM this is and cannot change; add another VM instead")
        try:
            spec = VmSpec.model_validate({**self.vms[vm_name].model_dump(), **changes})
        except ValidationError as error:
            raise EmulatorInputError(describe_validation_error(error, source=f"VM {vm_name}")) from error
        # Who sees an event is settled when it is created: a changed placement group counts for later events.
        self.vms[vm_name] = spec
        self.vm_changes += 1
        return spec

    def add_vm(self, spec: VmSpec) -> None:
        """A VM that joins now (scale-out): it sees the events created from now on."""
        if spec.name.lower() in {name.lower() for name in self.vms}:
            raise EmulatorInputError(f"a VM named {spec.name!r} exists already (names are case-insensitive)")
        self.vms[spec.name] = spec
        self.vm_changes += 1
        self.incarnations[spec.name] = 1
        self._signatures[spec.name] = "[]"
        # Its documents' record for the oracle starts with its first, as for the scenario's VMs at the start.
        self.incarnation_log[spec.name] = [IncarnationRecord(spec.name, 1, 0, self._now, (), ())]

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

    def incarnation_summaries(self, now: datetime) -> list[dict[str, Any]]:
        self.advance(now)
        return [entry.summary() for log in self.incarnation_log.values() for entry in log]

    def removal_summaries(self, now: datetime) -> dict[str, dict[str, Any]]:
        self.advance(now)
        return {name: removal.summary() for name, removal in self.removed.items()}

    def vm_summaries(self, now: datetime) -> list[dict[str, Any]]:
        self.advance(now)
        summaries = []
        for vm in self.vms.values():
            removal = self.removed.get(vm.name)
            summaries.append(
                {
                    **vm.model_dump(),
                    "DocumentIncarnation": self.incarnations[vm.name],
                    # A removed VM reads nothing any more.
                    "events": [] if removal else [record.event_id for record in self._live_for(vm.name)],
                    "removed": removal.summary() if removal else None,
                }
            )
        return summaries
