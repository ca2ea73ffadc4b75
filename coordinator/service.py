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
import logging
import random
import threading
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from contracts.envelope import VmIdentity
from coordinator.adapters import telemetry
from coordinator.adapters.callback import ApprovalCallback
from coordinator.adapters.gates import MonitorReader
from coordinator.adapters.history import HistorySink
from coordinator.adapters.teams import AlertSink
from coordinator.domain.model import EventRecord
from coordinator.domain.policy import Policy
from coordinator.pipeline import fold, ingest, people, tail, timer
from coordinator.pipeline.fleet import Fleet, FleetCache
from coordinator.pipeline.ingest import RawMessage
from coordinator.pipeline.people import ManualApproval
from coordinator.pipeline.run import (
    APPROVAL_DEADLINE,
    APPROVAL_WORKERS,
    IMDS_FAILING_AFTER,
    IMDS_FAILING_ERRORS,
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

__all__ = ["Coordinator"]

log = logging.getLogger("coordinator")


def utcnow() -> datetime:
    return datetime.now(UTC)


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
        monitor: MonitorReader | None = None,
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
        self.monitor = monitor
        self._housekeeping = timer.Housekeeping(cleanup=housekeeping)
        # The open events and the census, kept across runs (pipeline/fleet.py); a new one for a replaced store.
        self._fleet = FleetCache(store)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
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
            start_bound=self.start_bound,
            imds_failing_after=self.imds_failing_after,
            imds_failing_errors=self.imds_failing_errors,
            remote_acknowledge_fallback=self.remote_acknowledge_fallback,
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
            rng=self.rng,
            pool=self._pool,
        )
        if self._fleet.store is not self.store:
            self._fleet = FleetCache(self.store)
        return Run(
            kind=kind,
            parts=parts,
            options=self.options(),
            policy=self.policy,
            now=self.clock(),
            fleet=Fleet(self.store, self._fleet),
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

    def process_batch(self, messages: Sequence[RawMessage]) -> Report:
        """One Event Hubs batch (cardinality many). Bad messages are dead-lettered; the rest goes on."""
        with telemetry.batch_span(len(messages), ((m.traceparent, m.tracestate) for m in messages)):
            return self.run_batch(messages).report

    def run_batch(self, messages: Sequence[RawMessage]) -> Run:
        """The batch as a run: ingest -> fold (decide inside its write) -> the tail."""
        run = self.start("batch")
        run.report.received = len(messages)
        arrivals = ingest.read_batch(run, messages)
        updates = fold.fold(run, arrivals)
        tail.finish(run)
        if self.on_new_vm is not None:
            # New VMs, and VMs back from silence (housekeeping may have removed what was set up for them).
            for vm_id, update in updates.updates.items():
                if vm_id in updates.new_vms or update.resumed:
                    self._new_vm(update.record.identity)
        return run

    def _new_vm(self, vm: VmIdentity) -> None:
        assert self.on_new_vm is not None
        try:
            self.on_new_vm(vm)
        except Exception:  # e.g. the VM's hybrid connection could not be created: retried when it next reports
            log.exception("setting up new VM %s failed", vm.name)

    def tick(self) -> Report:
        """The timer's run (pipeline/timer.py), ending with the tail."""
        run = self.start("tick")
        timer.tick(run, self._housekeeping)
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
