"""The coordinator as function_app.py calls it: the parts and settings, and one method per kind of run.

Each run (an Event Hubs batch, a timer tick, a person's approval) is one ``Run`` (pipeline/run.py) that its stages
take in order, and ends with the same tail (pipeline/tail.py). An Event Hubs batch reads as the pipeline:

1. ``ingest``  bytes -> validated envelopes per VM, in arrival order; dead letters for the rest;
2. ``fold``    envelopes -> observations -> event records and VM positions (pure: ``sightings``), each changed
               event decided (``decide``: pure rules + the fleet's budget) inside the same ETag-checked write;
3. the tail    approvals delivered -> cards posted -> budgets released -> history written.

Every read-modify-write goes through ``state.commit`` (``state.events.commit_event`` for one event): a conflict
means another instance got there first, so the stage re-reads and redoes, and each decision is taken once.
See docs/architecture.md.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from contracts.envelope import VmIdentity
from coordinator.adapters import telemetry
from coordinator.adapters.delivery_queue import QueuedDelivery
from coordinator.adapters.heap import HEAP
from coordinator.domain.model import EventRecord
from coordinator.domain.policy import Policy
from coordinator.pipeline import delivery, fold, handover, ingest, outbox, people, record, tail, timer
from coordinator.pipeline.fleet import Fleet
from coordinator.pipeline.fleet_cache import FleetCache
from coordinator.pipeline.housekeeping import Housekeeping
from coordinator.pipeline.ingest import Channel, RawMessage
from coordinator.pipeline.people import ManualApproval
from coordinator.pipeline.run import Options, Parts, Report, Run, RunKind
from coordinator.state.events import read_event
from coordinator.state.store import Stored

__all__ = ["Coordinator", "set_graces"]

log = logging.getLogger("coordinator")
# Threads a coordinator instance sets new VMs up on (``Coordinator._set_up``).
SETUP_THREADS = 4


def set_graces(*, history: timedelta | None = None, cards: timedelta | None = None) -> None:
    """For the whole process: after how long the timer takes over a run's history rows left in the outbox
    (``record.OUTBOX_GRACE``, 60 s) and its cards left unsent (``outbox.ALERT_GRACE``, 30 s), read at each tick.
    Local stacks shorten them (local/host.py); the deployed app keeps them. None leaves one as it is."""
    if history is not None:
        record.OUTBOX_GRACE = history
    if cards is not None:
        outbox.ALERT_GRACE = cards


class Coordinator:
    """Fleet logic behind the Functions app: ``Coordinator(parts, options, policy)``, the three built once
    (``wiring.py``, from the settings), and the instance's own machinery: ``after_batch``, the executor a batch's
    tail runs on once the batch has returned (with ``Options.tail_after_batch``; None: each batch ends with its own
    tail), ``on_new_vm`` and ``housekeeping`` (a new VM's hybrid connection made, silent VMs' deleted: wiring.py).

    Each run takes ``parts``, ``options`` and ``policy`` as they are when it starts. To replace one (a slower
    callback, another clock, another policy), assign it whole between runs:
    ``coordinator.parts = dataclasses.replace(coordinator.parts, callback=slower)``. A replacement is checked as
    the constructor checks (contradictory settings are refused at once, not at the first run), and a replaced
    store gets a fresh fleet cache."""

    def __init__(
        self,
        parts: Parts,
        options: Options,
        policy: Policy,
        *,
        after_batch: concurrent.futures.Executor | None = None,
        on_new_vm: Callable[[VmIdentity], None] | None = None,
        housekeeping: Callable[[dict[str, datetime], datetime], None] | None = None,
        shadow: Policy | None = None,
    ) -> None:
        _refuse_contradictions(parts, options, after_batch)
        self._parts = parts
        self._options = options
        self.policy = policy
        self.shadow = shadow  # a candidate policy, decided beside ``policy`` and never sent (pipeline/shadow.py)
        self.after_batch = after_batch
        self.on_new_vm = on_new_vm
        self._tails: set[concurrent.futures.Future[None]] = set()
        self._housekeeping = Housekeeping(cleanup=housekeeping)
        # The open events and the census, kept across runs (pipeline/fleet.py); a new one for a replaced store.
        self._fleet = FleetCache(parts.store)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        # New VMs' setup (``on_new_vm``: ARM calls, each within its deadline), off the batches' path when their tails
        # are: a scale-out's batch of new VMs held its partition for an ARM round trip or two per VM, and for 20 s
        # per call while ARM hung. One at a time per VM, on threads of their own (not the tails').
        self._setup: concurrent.futures.ThreadPoolExecutor | None = None
        self._setting_up: dict[str, concurrent.futures.Future[None]] = {}

    @property
    def parts(self) -> Parts:
        """What the runs talk to (``Parts``); replaced whole, between runs."""
        return self._parts

    @parts.setter
    def parts(self, parts: Parts) -> None:
        _refuse_contradictions(parts, self._options, self.after_batch)
        self._parts = parts

    @property
    def options(self) -> Options:
        """The runs' settings (``Options``); replaced whole, between runs."""
        return self._options

    @options.setter
    def options(self, options: Options) -> None:
        _refuse_contradictions(self._parts, options, self.after_batch)
        self._options = options

    def start(self, kind: RunKind) -> Run:
        """A new run with the parts, options and policy as they are now."""
        parts = self._parts
        now = parts.clock()
        if self._fleet.store is not parts.store:
            self._fleet = FleetCache(parts.store)
        return Run(
            kind=kind,
            parts=parts,
            options=self._options,
            policy=self.policy,
            shadow=self.shadow,
            now=now,
            fleet=Fleet(parts.store, self._fleet, census=parts.census.at(now) if parts.census is not None else None),
            pool=self._pool,
            report=Report(kind=kind),
        )

    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        """The approval senders' threads, started on first use and kept for the process."""
        with self._pool_lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self._options.approval_workers, thread_name_prefix="approval"
                )
            return self._executor

    def process_batch(self, messages: Sequence[RawMessage], *, channel: Channel = "vms") -> Report:
        """One Event Hubs batch (cardinality many) from the VMs' hub or, ``channel="platform"``, from Event Grid's.
        Bad messages are dead-lettered; the rest goes on."""
        with telemetry.batch_span(len(messages), ((m.traceparent, m.tracestate) for m in messages)):
            return self.run_batch(messages, channel=channel).report

    def run_batch(self, messages: Sequence[RawMessage], *, channel: Channel = "vms") -> Run:
        """The batch as a run: ingest -> fold (decide inside its write) -> the tail."""
        run = self.start("batch")
        run.report.received = len(messages)
        arrivals = ingest.read_batch(run, messages, channel)
        updates = fold.fold(run, arrivals)
        if self.after_batch is None:
            tail.finish(run)
        else:
            self._finish_later(run)
        if self.on_new_vm is not None:
            # New VMs, and VMs back from silence (housekeeping may have removed what was set up for them).
            for vm_id, update in updates.updates.items():
                if vm_id in updates.new_vms or update.resumed:
                    self._set_up(vm_id, update.record.identity)
        return run

    def _set_up(self, vm_id: str, vm: VmIdentity) -> None:
        """A new VM's setup: in line when the batch ends with its own tail, else on the setup threads (once at a
        time per VM: one queued or running is not queued again)."""
        if self.after_batch is None:
            self._new_vm(vm)
            return
        with self._pool_lock:
            if vm_id in self._setting_up:
                return
            if self._setup is None:
                self._setup = concurrent.futures.ThreadPoolExecutor(SETUP_THREADS, thread_name_prefix="vm-setup")
            try:
                future = self._setup.submit(self._new_vm, vm)
            except RuntimeError:  # shut down: the process is stopping; set up when the VM next reports
                return
            self._setting_up[vm_id] = future
        future.add_done_callback(lambda _done: self._set_up_done(vm_id))

    def _set_up_done(self, vm_id: str) -> None:
        with self._pool_lock:
            self._setting_up.pop(vm_id, None)

    def _finish_later(self, batch: Run) -> None:
        """The batch's tail, after the batch (docs/liveness.md, *The tail after the batch*): its approvals are on
        their way, its events and VM positions written, and every history row it made in the outbox (most with the
        write they describe; the rest staged here); the answers are awaited and committed, the cards posted, the
        budgets freed and the history written while its partition goes on. What it decided is in the fleet cache
        before the next batch starts. A process that stops first leaves the approval records (the timer sends them
        again after their in-flight grace, same decisionIds), the cards in the events' outboxes and the rows in the
        outbox: the timer posts and writes them."""
        assert self.after_batch is not None
        record.stage_loose(batch)
        batch.fleet.absorb(batch.work.uncached())

        def finish() -> None:
            try:
                tail.finish(batch)
                log.info("batch tail %s", json.dumps(batch.report.as_dict()))
            except Exception:
                log.exception("the tail of a batch of %d messages failed", batch.report.received)

        try:
            future = self.after_batch.submit(finish)
        except RuntimeError:  # shut down: the process is stopping
            log.warning("the tail of a batch of %d messages not run: stopping", batch.report.received)
            return
        with self._pool_lock:
            self._tails.add(future)
        future.add_done_callback(self._tail_done)

    def _tail_done(self, future: concurrent.futures.Future[None]) -> None:
        with self._pool_lock:
            self._tails.discard(future)

    def drain(self, timeout: float = 30.0) -> bool:
        """Waits for the tails of the batches that have returned (``after_batch``) and the new VMs' setups; True
        when none is left. For a
        host that stops, and for whoever reads a batch's outcomes and history right after it."""
        with self._pool_lock:
            tails = [*self._tails, *self._setting_up.values()]
        return not concurrent.futures.wait(tails, timeout=timeout).not_done

    def close(self, timeout: float = 10.0) -> None:
        """Lets the batches' tails end (at most ``timeout``), then stops this instance's threads."""
        if not self.drain(timeout):
            log.warning("stopping with batch tails still running after %.0f s: the timer recovers them", timeout)
        if self.after_batch is not None:
            self.after_batch.shutdown(wait=False, cancel_futures=True)
        with self._pool_lock:
            executors, self._executor, self._setup = (self._executor, self._setup), None, None
        # Outside the lock: a setup cancelled here calls back ``_set_up_done``, which takes it.
        for executor in executors:
            if executor is not None:
                executor.shutdown(wait=False, cancel_futures=True)

    def _new_vm(self, vm: VmIdentity) -> None:
        assert self.on_new_vm is not None
        try:
            self.on_new_vm(vm)
        except Exception:  # e.g. the VM's hybrid connection could not be created: retried when it next reports
            log.exception("setting up new VM %s failed", vm.name)

    def tick(self) -> Report:
        """The timer's run (pipeline/timer.py), ending with the tail."""
        run = self.start("tick")
        census = run.parts.census
        if census is not None:
            census.refresh_if_due(run.now)
        timer.tick(run, self._housekeeping)
        if census is not None and run.report.vms_retired:
            census.membership_changed()  # the scale sets shrank: read again at the next tick
        HEAP.tick()
        return run.report

    def continue_delivery(self, message: bytes) -> Report:
        """An approval a run handed to the delivery queue (``function_app.continue_approval``), delivered with the
        whole approval deadline while its record still says it was handed over; then the tail. A message that is
        not a ``QueuedDelivery`` raises (the host retries it, then sets it aside in the poison queue)."""
        queued = QueuedDelivery.model_validate_json(message)
        stored = read_event(self.parts.store, queued.eventId)
        wait = handover.lapse_wait(stored.record if stored is not None else None, queued, self.parts.clock())
        if wait:
            time.sleep(wait.total_seconds())  # the unanswered request lapses in a few seconds (handover.lapse_wait)
        run = self.start("delivery")
        delivery.take_over(run, queued)
        tail.finish(run)
        return run.report

    def approve_manually(self, event_id: str, *, person: str) -> ManualApproval:
        """A person's approval of one event (pipeline/people.py), ending with the tail."""
        return people.approve_manually(self.start("person"), event_id, person=person)

    def event(self, event_id: str) -> Stored[EventRecord] | None:
        """The event as stored now (fresh read), with its VMs' sightings."""
        return read_event(self.parts.store, event_id)

    def summarize(self, record: EventRecord) -> dict[str, Any]:
        return people.summarize(record, approve_url=self.options.approve_url)

    def pending(self) -> list[dict[str, Any]]:
        """Open events (not Completed/Canceled), oldest NotBefore first."""
        return people.pending(self.parts.store, approve_url=self.options.approve_url)


def _refuse_contradictions(parts: Parts, options: Options, after_batch: concurrent.futures.Executor | None) -> None:
    """Settings that cannot go together, refused when the coordinator is built (or a part or option replaced), not
    at the first run. ``Options`` checks its own (``Options.__post_init__``)."""
    if options.require_attestation and parts.attestations is None:
        raise ValueError("require_attestation needs attestations (the verifier and its trust anchors)")
    if options.tail_after_batch != (after_batch is not None):
        raise ValueError(
            "Options.tail_after_batch goes with the after_batch executor the batches' tails run on: both or neither"
        )
