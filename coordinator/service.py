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
import random
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from contracts.approval import NOT_AFTER_TOLERANCE
from contracts.envelope import VmIdentity
from coordinator.adapters import telemetry
from coordinator.adapters.callback import ApprovalCallback
from coordinator.adapters.census import Census
from coordinator.adapters.delivery_queue import DeliveryQueue, QueuedDelivery
from coordinator.adapters.gates import MonitorReader
from coordinator.adapters.history import HistorySink
from coordinator.adapters.teams import AlertSink
from coordinator.domain.attestation import Attestations
from coordinator.domain.model import EventRecord
from coordinator.domain.policy import Policy
from coordinator.pipeline import delivery, fold, handover, ingest, outbox, people, record, tail, timer
from coordinator.pipeline.fleet import Fleet
from coordinator.pipeline.fleet_cache import FleetCache
from coordinator.pipeline.ingest import Channel, RawMessage
from coordinator.pipeline.people import ManualApproval
from coordinator.pipeline.run import (
    APPROVAL_DEADLINE,
    APPROVAL_WORKERS,
    EXECUTOR_SILENCE,
    IMDS_FAILING_AFTER,
    IMDS_FAILING_ERRORS,
    IN_RUN_DELIVERY,
    RETIRE_GRACE,
    START_BOUND,
    Options,
    Parts,
    Report,
    Run,
    RunKind,
)
from coordinator.state.events import read_event
from coordinator.state.store import StateStore, Stored

__all__ = ["Coordinator", "set_graces"]

log = logging.getLogger("coordinator")


def utcnow() -> datetime:
    return datetime.now(UTC)


def set_graces(*, history: timedelta | None = None, cards: timedelta | None = None) -> None:
    """For the whole process: after how long the timer takes over a run's history rows left in the outbox
    (``record.OUTBOX_GRACE``, 60 s) and its cards left unsent (``outbox.ALERT_GRACE``, 30 s), read at each tick.
    Local stacks shorten them (local/host.py); the deployed app keeps them. None leaves one as it is."""
    if history is not None:
        record.OUTBOX_GRACE = history
    if cards is not None:
        outbox.ALERT_GRACE = cards


class Coordinator:
    """Fleet logic behind the Functions app. All options are keyword-only; ``clock`` lets tests move time.
    Attributes without a leading underscore may be replaced (a slower callback, another clock, another policy):
    each run takes them as they are when it starts."""

    def __init__(
        self,
        *,
        store: StateStore,
        history: HistorySink,
        alerts: AlertSink,
        callback: ApprovalCallback,
        policy: Policy,
        dry_run: bool = False,
        heartbeat_timeout: timedelta = timedelta(minutes=5),
        approve_url: Callable[[str], str] | None = None,
        approval_backoff: tuple[float, float] = (5.0, 120.0),
        on_new_vm: Callable[[VmIdentity], None] | None = None,
        housekeeping: Callable[[dict[str, datetime], datetime], None] | None = None,
        housekeeping_interval: timedelta = timedelta(hours=1),
        retention: timedelta = timedelta(days=30),
        clock: Callable[[], datetime] = utcnow,
        rng: random.Random | None = None,
        retire_grace: timedelta = RETIRE_GRACE,
        approval_workers: int = APPROVAL_WORKERS,
        approval_deadline: timedelta = APPROVAL_DEADLINE,
        start_bound: timedelta = START_BOUND,
        imds_failing_after: timedelta = IMDS_FAILING_AFTER,
        imds_failing_errors: int = IMDS_FAILING_ERRORS,
        remote_acknowledge: ApprovalCallback | None = None,
        remote_acknowledge_fallback: bool = False,
        not_after_tolerance: timedelta = NOT_AFTER_TOLERANCE,
        monitor: MonitorReader | None = None,
        deliveries: DeliveryQueue | None = None,
        in_run_delivery: timedelta = IN_RUN_DELIVERY,
        executor_silence: timedelta = EXECUTOR_SILENCE,
        attestations: Attestations | None = None,
        require_attestation: bool = False,
        census: Census | None = None,
        after_batch: concurrent.futures.Executor | None = None,
    ) -> None:
        self.store = store
        self.history = history
        self.alerts = alerts
        self.callback = callback
        self.policy = policy
        self.dry_run = dry_run
        self.heartbeat_timeout = heartbeat_timeout
        self.approve_url = approve_url
        self.approval_backoff = approval_backoff
        self.on_new_vm = on_new_vm
        self.housekeeping_interval = housekeeping_interval
        self.retention = retention
        self.clock = clock
        self.rng = rng or random.Random()  # noqa: S311 -- jitter, not security
        self.retire_grace = retire_grace
        self.approval_workers = approval_workers
        self.approval_deadline = approval_deadline
        self.start_bound = start_bound
        self.imds_failing_after = imds_failing_after
        self.imds_failing_errors = imds_failing_errors
        self.remote_acknowledge = remote_acknowledge
        self.remote_acknowledge_fallback = remote_acknowledge_fallback
        self.not_after_tolerance = not_after_tolerance
        self.monitor = monitor
        self.deliveries = deliveries
        self.in_run_delivery = in_run_delivery
        self.executor_silence = executor_silence
        self.attestations = attestations
        self.require_attestation = require_attestation
        # ARM's census of the fleet (adapters/census.py), kept in memory for this instance's runs; None: the census
        # is what the VMs report (tests and tools that build the coordinator by hand).
        self.census = census
        # Where a batch's tail runs once the batch has returned (Options.tail_after_batch); None: each batch ends
        # with its own tail. wiring.py gives the deployed app one.
        self.after_batch = after_batch
        self._tails: set[concurrent.futures.Future[None]] = set()
        self._housekeeping = timer.Housekeeping(cleanup=housekeeping)
        # The open events and the census, kept across runs (pipeline/fleet.py); a new one for a replaced store.
        self._fleet = FleetCache(store)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        if require_attestation and attestations is None:
            raise ValueError("require_attestation needs attestations (the verifier and its trust anchors)")
        self.options()  # refuses contradictory settings now, not at the first run

    def options(self) -> Options:
        return Options(
            dry_run=self.dry_run,
            heartbeat_timeout=self.heartbeat_timeout,
            approve_url=self.approve_url,
            approval_backoff=self.approval_backoff,
            housekeeping_interval=self.housekeeping_interval,
            retention=self.retention,
            retire_grace=self.retire_grace,
            approval_workers=self.approval_workers,
            approval_deadline=self.approval_deadline,
            in_run_delivery=self.in_run_delivery,
            executor_silence=self.executor_silence,
            start_bound=self.start_bound,
            imds_failing_after=self.imds_failing_after,
            imds_failing_errors=self.imds_failing_errors,
            remote_acknowledge_fallback=self.remote_acknowledge_fallback,
            not_after_tolerance=self.not_after_tolerance,
            require_attestation=self.require_attestation,
            tail_after_batch=self.after_batch is not None,
        )

    def start(self, kind: RunKind) -> Run:
        """A new run with the parts and settings as they are now."""
        parts = Parts(
            store=self.store,
            history=self.history,
            alerts=self.alerts,
            callback=self.callback,
            remote_acknowledge=self.remote_acknowledge,
            monitor=self.monitor,
            deliveries=self.deliveries,
            attestations=self.attestations,
            rng=self.rng,
            pool=self._pool,
        )
        now = self.clock()
        if self._fleet.store is not self.store:
            self._fleet = FleetCache(self.store)
        return Run(
            kind=kind,
            parts=parts,
            options=self.options(),
            policy=self.policy,
            now=now,
            fleet=Fleet(self.store, self._fleet, census=self.census.at(now) if self.census is not None else None),
            report=Report(kind=kind),
        )

    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        """The approval senders' threads, started on first use and kept for the process."""
        with self._pool_lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.approval_workers, thread_name_prefix="approval"
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
                    self._new_vm(update.record.identity)
        return run

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
        """Waits for the tails of the batches that have returned (``after_batch``); True when none is left. For a
        host that stops, and for whoever reads a batch's outcomes and history right after it."""
        with self._pool_lock:
            tails = list(self._tails)
        return not concurrent.futures.wait(tails, timeout=timeout).not_done

    def close(self, timeout: float = 10.0) -> None:
        """Lets the batches' tails end (at most ``timeout``), then stops this instance's threads."""
        if not self.drain(timeout):
            log.warning("stopping with batch tails still running after %.0f s: the timer recovers them", timeout)
        if self.after_batch is not None:
            self.after_batch.shutdown(wait=False, cancel_futures=True)
        with self._pool_lock:
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
                self._executor = None

    def _new_vm(self, vm: VmIdentity) -> None:
        assert self.on_new_vm is not None
        try:
            self.on_new_vm(vm)
        except Exception:  # e.g. the VM's hybrid connection could not be created: retried when it next reports
            log.exception("setting up new VM %s failed", vm.name)

    def tick(self) -> Report:
        """The timer's run (pipeline/timer.py), ending with the tail."""
        run = self.start("tick")
        if self.census is not None:
            self.census.refresh_if_due(run.now)
        timer.tick(run, self._housekeeping)
        if self.census is not None and run.report.vms_retired:
            self.census.membership_changed()  # the scale sets shrank: read again at the next tick
        return run.report

    def continue_delivery(self, message: bytes) -> Report:
        """An approval a run handed to the delivery queue (``function_app.continue_approval``), delivered with the
        whole approval deadline while its record still says it was handed over; then the tail. A message that is
        not a ``QueuedDelivery`` raises (the host retries it, then sets it aside in the poison queue)."""
        queued = QueuedDelivery.model_validate_json(message)
        stored = read_event(self.store, queued.eventId)
        wait = handover.lapse_wait(stored.record if stored is not None else None, queued, self.clock())
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
        return read_event(self.store, event_id)

    def summarize(self, record: EventRecord) -> dict[str, Any]:
        return people.summarize(record, approve_url=self.approve_url)

    def pending(self) -> list[dict[str, Any]]:
        """Open events (not Completed/Canceled), oldest NotBefore first."""
        return people.pending(self.store, approve_url=self.approve_url)
