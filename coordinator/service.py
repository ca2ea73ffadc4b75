"""The coordinator as function_app.py calls it: one object whose methods run the stages, each in its own module.

An Event Hubs batch passes each stage once, in order (``process_batch`` reads as the pipeline):

1. ``ingest``  bytes -> validated envelopes per VM, in arrival order; dead letters for the rest;
2. ``fold``    envelopes -> observations -> event records and VM positions (pure: ``sightings``), each changed
               event decided (``decide``, pure rules + the fleet's budget) inside the same ETag-checked write;
3. ``act``     approvals out to the VMs and their outcomes committed, then the cards (``outbox``);
4. ``record``  the history rows.

The timer (``timer.tick``) and the people's routes (``people``) reuse the same stages. Every read-modify-write goes
through ``commit.commit`` (``events.commit_event`` for one event): a conflict means another instance got there
first, so the stage re-reads and redoes, and each decision is taken once. See docs/architecture.md.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from contracts.envelope import VmIdentity
from coordinator.adapters import telemetry
from coordinator.domain.model import EventRecord
from coordinator.pipeline import act, event_grid, fold, ingest, people, timer
from coordinator.pipeline.context import BatchReport, Context, TickReport, Work
from coordinator.pipeline.decide import Fleet
from coordinator.pipeline.ingest import RawMessage
from coordinator.pipeline.people import ManualApproval
from coordinator.pipeline.record import write_history
from coordinator.state.commit import BULK_ATTEMPTS
from coordinator.state.events import read_event
from coordinator.state.store import Stored

log = logging.getLogger("coordinator")


class Coordinator(Context):
    """Fleet logic behind the Functions app (the parts and options are ``Context``'s, all keyword-only)."""

    def process_batch(self, messages: Sequence[RawMessage]) -> BatchReport:
        """One Event Hubs batch (cardinality many). Bad messages are dead-lettered; the rest goes on."""
        with telemetry.batch_span(len(messages), ((m.traceparent, m.tracestate) for m in messages)):
            return self._process_batch(messages)

    def _process_batch(self, messages: Sequence[RawMessage]) -> BatchReport:
        now = self.clock()
        report = BatchReport(received=len(messages))
        work = Work()
        arrivals = ingest.read_batch(messages, now, work)
        fleet = Fleet(self.store)
        updates = fold.vm_updates(self, arrivals.by_vm, cached=True, traces=arrivals.traces)
        event_grid.add_to_batch(self, updates, arrivals.grid)
        report.duplicates += arrivals.grid_duplicates
        report.dead_lettered = ingest.set_aside(self, arrivals, updates.failed, now, work)
        stale = fold.fold(self, updates, now, fleet, report=report, work=work)
        for _attempt in range(BULK_ATTEMPTS):
            if stale - arrivals.by_vm.keys():
                # Only Event Grid spoke for these in this batch: nothing to redo them from; the platform's next
                # event for them (or their forwarder) writes their sightings.
                log.warning("Event Grid sightings of %s not written (contended)", sorted(stale - arrivals.by_vm.keys()))
                stale &= arrivals.by_vm.keys()
            if not stale:
                break
            # Another instance moved these VMs since this one cached their group (a partition changed hands):
            # what was derived from the old positions may miss a 'gone'. Redo them from the fresh positions;
            # re-applying what was already applied is a no-op.
            for vm_id in stale:
                report.accepted -= updates.updates[vm_id].applied
                report.duplicates -= updates.updates[vm_id].duplicates
            redo = fold.vm_updates(
                self, {vm_id: arrivals.by_vm[vm_id] for vm_id in stale}, cached=False, traces=arrivals.traces
            )
            updates.updates.update(redo.updates)
            updates.new_vms = (updates.new_vms - stale) | redo.new_vms
            stale = fold.fold(self, redo, now, fleet, report=report, work=work)
        act.act(self, work, now, report, last_seen=None, fleet=fleet)
        write_history(self, work.rows, report)
        if self.on_new_vm is not None:
            # New VMs, and VMs back from silence (housekeeping may have removed what was set up for them).
            for vm_id, update in updates.updates.items():
                if vm_id in updates.new_vms or update.resumed:
                    self._new_vm(update.record.identity)
        return report

    def _new_vm(self, vm: VmIdentity) -> None:
        assert self.on_new_vm is not None
        try:
            self.on_new_vm(vm)
        except Exception:  # e.g. the VM's hybrid connection could not be created: retried when it next reports
            log.exception("setting up new VM %s failed", vm.name)

    def tick(self) -> TickReport:
        """The timer's run (coordinator/pipeline/timer.py)."""
        return timer.tick(self)

    def approve_manually(self, event_id: str, *, person: str) -> ManualApproval:
        """A person's approval of one event (coordinator/pipeline/people.py)."""
        return people.approve_manually(self, event_id, person=person)

    def event(self, event_id: str) -> Stored[EventRecord] | None:
        """The event as stored now (fresh read), with its VMs' sightings."""
        return read_event(self.store, event_id)

    def summarize(self, record: EventRecord) -> dict[str, Any]:
        return people.summarize(self, record)

    def pending(self) -> list[dict[str, Any]]:
        """Open events (not Completed/Canceled), oldest NotBefore first."""
        return people.pending(self)
