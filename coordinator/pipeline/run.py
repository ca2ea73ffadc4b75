"""One run of the coordinator: an Event Hubs batch, a timer tick or a person's approval, as one object.

Every stage is a function of the ``Run``: the parts it talks to (``Parts``), the frozen options (``Options``), the
policy, the run's one ``now``, the fleet as this run sees it (``Fleet``), what the run has committed and still has to
act on (``Work``) and its counts (``Report``). Nothing else is handed from stage to stage. ``Run.enter`` notes each
stage as it starts (``Run.stages``), so a test can read the order a run took.
"""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from contracts.approval import NOT_AFTER_TOLERANCE, ApprovalRequest, ApprovalResult
from contracts.envelope import VmIdentity
from coordinator.adapters.callback import ApprovalCallback
from coordinator.adapters.census import Census
from coordinator.adapters.delivery_queue import DeliveryQueue
from coordinator.adapters.gates import MonitorReader
from coordinator.adapters.history import HistorySink
from coordinator.adapters.repairs import RepairsClient
from coordinator.adapters.teams import AlertSink
from coordinator.domain.attestation import Attestations
from coordinator.domain.lifecycle import EventChange
from coordinator.domain.model import AlertKind, EventRecord, VmRecord
from coordinator.domain.policy import Policy
from coordinator.domain.rows import HistoryRow
from coordinator.pipeline.fleet import Fleet
from coordinator.state.staged import Outbox
from coordinator.state.store import Staged, StateStore

__all__ = ["Delivery", "Options", "Parts", "Report", "Run", "RunKind", "Sending", "Stage", "Work"]

# A VM named by a Terminate/Preempt that started (or was approved, or reached NotBefore) is retired once silent this
# long: three of the forwarder's 60 s heartbeats. Shorter than the heartbeat timeout, so no "heartbeat lost" first.
RETIRE_GRACE = timedelta(seconds=180)
# Approvals of one run go out concurrently, each given this long; a listener that does not answer in time is
# recorded as failed and retried by the timer (the listener is idempotent per decisionId).
APPROVAL_WORKERS = 16
APPROVAL_DEADLINE = timedelta(seconds=30)
# With a delivery queue (Parts.deliveries), a batch, tick or person's approval gives each approval only this long and
# hands what has not been answered to the queue, whose run has the whole approval deadline: the partition's next
# batch and the next tick wait for no listener. A listener answers in 5-41 ms (p50-p99, benchmarks.approval_latency)
# and an on-demand one connecting as the approval is sent within 0.1 s (benchmarks.cold_listener); 3 s leaves the
# sender two or three of its 1 s "no listener" retries, while a hung listener costs the next batch at most 3 s.
IN_RUN_DELIVERY = timedelta(seconds=3)
# A VM whose listener did not answer the approval's last attempt is passed over for a peer that can execute it at
# once; it counts as gone, so that its approval may go through remote acknowledge (no VM checks that), only once it
# has also been silent this long: two and a half of the forwarder's 60 s heartbeats, not a slow Relay or network.
EXECUTOR_SILENCE = timedelta(seconds=150)
# An approval a listener answered "approved" must be seen Started or gone within this (from the answer, or from the
# end of a platform hold), else a "not-started" card names the listener's answer. A VM on a host of its own starts
# within seconds of StartRequests; one on a shared host may wait for the other tenants. 5 min is a third of the
# shortest routine notice (15 min): people hear of it before NotBefore, ordinary short waits stay quiet.
START_BOUND = timedelta(seconds=300)
# A heartbeat whose forwarder has had no good IMDS poll for longer than this shows IMDS failing (pipeline/health.py):
# a forwarder polls every second and heartbeats every minute, so a minute is many failed polls, one heartbeat.
IMDS_FAILING_AFTER = timedelta(seconds=60)
# With no good poll at all since the forwarder started (no last good poll to age), this many failed polls in a row.
IMDS_FAILING_ERRORS = 60

# "delivery": an approval a run handed to the delivery queue, continued (function_app.continue_approval).
RunKind = Literal["batch", "tick", "person", "delivery"]
# The stages in the order a run may enter them; the tail (deliver -> cards -> budgets -> history) ends every run.
Stage = Literal[
    "ingest", "fold", "decide", "timer", "person", "continue", "deliver", "cards", "budgets", "history", "repairs"
]


def utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True, kw_only=True)
class Options:
    """The coordinator's settings, built once (``wiring.py``, from ``CoordinatorSettings``) and fixed for a run.
    Each has its default here, so that a test names only what it changes: ``Options(heartbeat_timeout=...)``. A new
    setting is one field in ``settings.py``, one here and one line in ``wiring.build_options``."""

    dry_run: bool = False
    heartbeat_timeout: timedelta = timedelta(minutes=5)
    approve_url: Callable[[str], str] | None = None
    approval_backoff: tuple[float, float] = (5.0, 120.0)
    housekeeping_interval: timedelta = timedelta(hours=1)
    retention: timedelta = timedelta(days=30)
    retire_grace: timedelta = RETIRE_GRACE
    approval_workers: int = APPROVAL_WORKERS
    approval_deadline: timedelta = APPROVAL_DEADLINE
    in_run_delivery: timedelta = IN_RUN_DELIVERY
    executor_silence: timedelta = EXECUTOR_SILENCE
    start_bound: timedelta = START_BOUND
    imds_failing_after: timedelta = IMDS_FAILING_AFTER
    imds_failing_errors: int = IMDS_FAILING_ERRORS
    # With remote acknowledge on: approvals no VM's listener can execute (no VM reported within heartbeat_timeout)
    # go through the Maintenance RP instead.
    remote_acknowledge_fallback: bool = False
    # Envelopes and approval answers without an IMDS attested document are refused (pipeline/attest.py). Off here
    # so that tests of other stages need no documents; COORDINATOR_REQUIRE_ATTESTATION defaults to on.
    require_attestation: bool = False
    # How far a VM's clock may disagree with the coordinator's: its listener refuses a request from this long before
    # the request's notAfter, so none is sent later (COORDINATOR_CLOCK_TOLERANCE_SECONDS).
    not_after_tolerance: timedelta = NOT_AFTER_TOLERANCE
    # A batch returns once its approvals are sent and its VM positions written; its tail (the answers awaited and
    # committed, cards, budgets, history) runs after it on the Coordinator's ``after_batch`` executor, so that its
    # partition's next batch waits for no listener, card sink or history upload (docs/liveness.md, *The tail
    # after the batch*). Off: each batch ends with its own tail (the stages' tests read its outcomes at once). On
    # only with that executor (the Coordinator refuses the one without the other).
    tail_after_batch: bool = False
    # A scale set's automatic repairs are resumed after this long suspended, its events over or not
    # (pipeline/repairs.py).
    repairs_bound: timedelta = timedelta(hours=2)

    def __post_init__(self) -> None:
        if self.retire_grace >= self.heartbeat_timeout:
            raise ValueError(
                f"retire_grace ({self.retire_grace.total_seconds():.0f} s) must be shorter than heartbeat_timeout "
                f"({self.heartbeat_timeout.total_seconds():.0f} s): a removed VM is retired before it counts as lost"
            )


@dataclass(frozen=True, kw_only=True)
class Parts:
    """What a run talks to: its state, history and card sinks, the approval paths, Azure Monitor for gates, ARM's
    census, the clock its ``now`` is read from and the backoff's jitter. Built once (``wiring.py``); a coordinator's
    runs take them as they are when each starts (``Coordinator.parts``, replaced with ``dataclasses.replace``)."""

    store: StateStore
    history: HistorySink
    alerts: AlertSink
    callback: ApprovalCallback
    # The Maintenance RP's acknowledge (preview), for rules that ask for it and as the fallback (Options).
    remote_acknowledge: ApprovalCallback | None = None
    # Azure Monitor, for the policy's alert and logQuery gates (None: such gates read as errors and hold).
    monitor: MonitorReader | None = None
    # Where approvals a run could not deliver within in_run_delivery continue (None: each run waits the whole
    # approval deadline for its own, as before the queue).
    deliveries: DeliveryQueue | None = None
    rng: random.Random = field(default_factory=random.Random)
    # IMDS attested documents: the verifier and the VM bindings read (pipeline/attest.py). None: not checked.
    attestations: Attestations | None = None
    # ARM's census of the fleet (adapters/census.py), kept in memory for the instance's runs; None: the census is
    # what the VMs report (tests and tools that build the coordinator by hand).
    census: Census | None = None
    # A scale set's automatic repairs through ARM (pipeline/repairs.py); None: not suspended around events.
    repairs: RepairsClient | None = None
    # Each run's ``now`` is read from it as the run starts; tests move it.
    clock: Callable[[], datetime] = utcnow


@dataclass
class Report:
    """What a run did, in counts. A batch and a tick count different things: ``as_dict`` gives those of its kind."""

    kind: RunKind
    received: int = 0
    accepted: int = 0
    dead_lettered: int = 0
    duplicates: int = 0
    open_events: int = 0
    events_changed: int = 0
    approvals_sent: int = 0
    alerts_sent: int = 0
    alerts_failed: int = 0
    alerts_held: int = 0  # cards left pending for the timer: the run's time for cards spent, or a card failed
    heartbeats_lost: int = 0
    vms_retired: int = 0
    history_rows: int = 0
    events_purged: int = 0
    vms_purged: int = 0
    copies_removed: int = 0  # stray copies of moved VMs removed from their old groups (pipeline/housekeeping.py)
    vms_moved: int = 0  # positions moved to the group ARM places their VM in (pipeline/positions.py)
    budgets_purged: int = 0
    conflicts: int = 0
    # Approvals handed to the delivery queue (no answer within in_run_delivery).
    deliveries_continued: int = 0
    # State entities its reads could not decode and set aside (store.py): the rest of the fleet went on.
    set_aside: int = 0
    # Outbox entries the timer took over from runs that did not write them (pipeline/record.py, ``adopt``).
    history_adopted: int = 0
    # The timer's: claims of VMs ARM's census vouched for, written from the instance's backlog (pipeline/bindings.py).
    bindings_written: int = 0

    def count_conflict(self) -> None:
        self.conflicts += 1

    def as_dict(self) -> dict[str, int]:
        counts = {name: value for name, value in asdict(self).items() if name != "kind"}
        return {name: counts[name] for name in _REPORTED[self.kind]}


_CARDS = ("alerts_sent", "alerts_failed", "alerts_held")
# What a delivery's run (function_app.continue_approval) counts; a person's counts the deliveries it continued too.
_DELIVERED = ("events_changed", "approvals_sent", *_CARDS, "history_rows", "set_aside")
_REPORTED: dict[RunKind, tuple[str, ...]] = {
    "batch": (
        "received",
        "accepted",
        "dead_lettered",
        "duplicates",
        "events_changed",
        "approvals_sent",
        *_CARDS,
        "history_rows",
        "conflicts",
        "vms_moved",
        "set_aside",
        "deliveries_continued",
    ),
    "tick": (
        "open_events",
        "events_changed",
        "approvals_sent",
        "alerts_sent",
        "alerts_held",
        "heartbeats_lost",
        "vms_retired",
        "history_rows",
        "events_purged",
        "vms_purged",
        "copies_removed",
        "budgets_purged",
        "set_aside",
        "deliveries_continued",
        "history_adopted",
        "bindings_written",
    ),
    "person": (*_DELIVERED, "deliveries_continued"),
    "delivery": _DELIVERED,
}


@dataclass
class Delivery:
    """One approval on its way (pipeline/act.py): what is sent, to whom, and what came back."""

    event_id: str
    decision_id: str
    executor: str
    # The path it takes: the Relay sender (Parts.callback) or the Maintenance RP's acknowledge (remote_acknowledge).
    callback: ApprovalCallback
    vm: VmIdentity | None = None
    request: ApprovalRequest | None = None
    intent: HistoryRow | None = None
    result: ApprovalResult | None = None
    failure: str = ""
    # The event's trace (EventRecord.traceparent): the approval's span and the listener's continue it.
    traceparent: str = ""
    # Not answered within the run's time: handed to the delivery queue.
    continued: bool = False
    # Failed without reaching the VM's listener (ApprovalDeliveryError.unreached): it cannot be executing it.
    unreached: bool = False
    # Reached the VM's listener, which went away before answering (ApprovalDeliveryError.answer_lost): unknown.
    answer_lost: bool = False
    # Not sent: another VM (or decision) may still execute an earlier request until then (approvals.reroute_at).
    wait_until: datetime | None = None


@dataclass
class Sending:
    """Approvals on their way, sent together: each send's future and the plans it carries, and until when (the
    ``time.monotonic()`` clock) their answers are awaited."""

    futures: dict[concurrent.futures.Future[Any], list[Delivery]]
    # Whether one not answered by then is handed to the delivery queue (act.hands_over), else recorded as failed.
    handing_over: bool
    within: float
    until: float
    # Released as each send starts (act._submit).
    leaving: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))

    @property
    def plans(self) -> list[Delivery]:
        return [plan for group in self.futures.values() for plan in group]

    def departed(self, seconds: float, *, at_most: int) -> bool:
        """Waits, ``seconds`` at most in all, until the first ``at_most`` sends (the pool's width) have started;
        whether they had."""
        until = time.monotonic() + seconds
        waited = min(len(self.futures), at_most)
        return all(self.leaving.acquire(timeout=max(0.0, until - time.monotonic())) for _ in range(waited))


@dataclass
class Work:
    """What a run committed and still has to act on: history rows, cards, approvals to deliver, the records as
    committed (and the ETag of each one this run wrote: the next write of it is conditional on that, not on a
    re-read), the approvals sent whose outcome is still to be committed."""

    rows: list[HistoryRow] = field(default_factory=list)
    alerts: list[tuple[str, AlertKind]] = field(default_factory=list)
    deliveries: list[str] = field(default_factory=list)
    records: dict[str, EventRecord] = field(default_factory=dict)
    etags: dict[str, str] = field(default_factory=dict)
    sent: list[Delivery] = field(default_factory=list)
    # Sends whose answers the tail awaits (Options.tail_after_batch: a batch's tail, after the batch returned);
    # ``deliver`` moves their plans to ``sent`` once answered.
    sending: list[Sending] = field(default_factory=list)
    # Cards about VMs rather than events (two forwarders reporting as one VM).
    vm_alerts: list[tuple[VmRecord, AlertKind]] = field(default_factory=list)
    # The group a carded VM's position was read from, where its sent card is cleared, by vmId (``vm_alert``; none:
    # the group the run places it in, ``Fleet.group_of``).
    vm_groups: dict[str, str] = field(default_factory=dict)
    # Budget claims of withdrawn approvals, as (EventId, claim key): freed by the tail's budgets step.
    releases: list[tuple[str, str]] = field(default_factory=list)
    # The decisionIds of the approvals this run decided, in any attempt of its writes: one whose write landed while
    # its answer was lost is met again on the retry's re-read, and is still this run's to send (decide.decide).
    decided: set[str] = field(default_factory=set)
    # The records this run put into the instance's fleet cache, as put: a batch puts what it committed there before
    # it returns, and its tail, after it, only what it committed since (``uncached``): put again, the batch's own
    # records could overwrite newer ones a later batch cached meanwhile.
    cached: dict[str, EventRecord] = field(default_factory=dict)
    # The deliveries planned before the writes that decide them (attempt.intend), by EventId: ``planning`` holds each
    # with the change it was planned for until that change is committed (``collect``), then ``planned`` until sent.
    planning: dict[str, tuple[EventChange, Delivery]] = field(default_factory=dict)
    planned: dict[str, Delivery] = field(default_factory=dict)
    # The outbox entries this run stored (with the writes their rows describe, or alone): deleted once the history
    # has the rows (pipeline/record.py). Those the timer took over from a run that stopped are among them.
    staged: list[Staged] = field(default_factory=list)
    # Events a batch wrote undecided, their gates still being read when its other approvals were decided
    # (decide.decide_all): decided again once those are sent and the batch's VM positions written (fold).
    awaiting_gates: list[str] = field(default_factory=list)
    # Events a run held because ARM's census was not usable: decided again by its tail if a read lands (tail.py).
    awaiting_census: list[str] = field(default_factory=list)

    def unstaged(self) -> list[HistoryRow]:
        """The run's rows not in the outbox yet."""
        kept = {row.RecordId for entry in self.staged for row in entry.rows}
        return [row for row in self.rows if row.RecordId not in kept]

    def vm_alert(self, vm: VmRecord, kind: AlertKind, *, group: str) -> None:
        """Queues a card about ``vm``, whose position was read from ``group``."""
        self.vm_alerts.append((vm, kind))
        self.vm_groups[vm.identity.vmId.lower()] = group

    def forget(self, vm_ids: set[str]) -> None:
        """Drops what this run derived for ``vm_ids`` (lowercase vmIds) and has not staged: their rows and VM cards.
        Their positions were not written (another instance moved them): their sightings, and so these rows, are
        derived again from the fresh positions, or by a later batch. Kept, they were written twice (once as derived
        from the stale position), each with its own RecordId."""
        kept = {row.RecordId for entry in self.staged for row in entry.rows}
        self.rows = [row for row in self.rows if row.RecordId in kept or row.VmId.lower() not in vm_ids]
        self.vm_alerts = [(r, kind) for r, kind in self.vm_alerts if r.identity.vmId.lower() not in vm_ids]

    def intend(self, change: EventChange, plan: Delivery) -> None:
        """A plan for the approval ``change`` holds, made before the change is written: sent only if it commits."""
        self.planning[change.record.eventId] = (change, plan)

    def uncached(self) -> list[EventRecord]:
        """The records committed since the run last put them into the fleet cache, now counted as put there."""
        fresh = [r for event_id, r in self.records.items() if self.cached.get(event_id) is not r]
        self.cached.update((r.eventId, r) for r in fresh)
        return fresh

    def collect(self, change: EventChange) -> None:
        """Takes in a committed change: its history rows, its record, its cards, (once) its approval and the claims
        of an approval it withdrew."""
        self.rows.extend(change.rows)
        self.records[change.record.eventId] = change.record
        self.alerts.extend((change.record.eventId, kind) for kind in change.alerts)
        self.releases.extend((change.record.eventId, key) for key in change.released)
        # Only the change that decided the approval sends it. Another instance that re-read the record after a
        # conflict sees the approval too, and must not send it again.
        if change.approval_decided and change.record.eventId not in self.deliveries:
            self.deliveries.append(change.record.eventId)
        planning = self.planning.get(change.record.eventId)
        if planning is not None and planning[0] is change:
            del self.planning[change.record.eventId]
            self.planned[change.record.eventId] = planning[1]


@dataclass(kw_only=True)
class Run:
    """One batch, tick or person's approval: everything its stages read and write."""

    kind: RunKind
    parts: Parts
    options: Options
    policy: Policy
    now: datetime
    fleet: Fleet
    # A candidate policy evaluated beside ``policy``, its decisions recorded and never sent (pipeline/shadow.py).
    shadow: Policy | None = None
    # The approval senders' threads, the instance's, kept for the process (started on first use).
    pool: Callable[[], concurrent.futures.ThreadPoolExecutor]
    work: Work = field(default_factory=Work)
    report: Report
    stages: list[Stage] = field(default_factory=list)
    # When the service last heard VMs this run read the positions of (positions.last_heard: heartbeats count): an
    # approval's executor is judged by these, as the timer judges every VM, not by when it last listed a change.
    heard: dict[str, datetime] = field(default_factory=dict)

    def outbox(self, *, leave: frozenset[str] = frozenset()) -> Outbox:
        """Where a write of this run notes the outbox entries it stores (``Work.staged``), at the run's time;
        ``leave``: the RecordTypes that write does not store."""
        return Outbox(at=self.now, written=self.work.staged, leave=leave)

    @property
    def tail_after_batch(self) -> bool:
        """Whether this run is a batch whose tail runs after it returns (``Options.tail_after_batch``)."""
        return self.options.tail_after_batch and self.kind == "batch"

    @property
    def dry_run(self) -> bool:
        """Nothing is sent: the setting, or the policy's own ``dryRun``."""
        return self.options.dry_run or self.policy.dryRun

    def enter(self, stage: Stage) -> None:
        self.stages.append(stage)
