"""What every stage of the coordinator is handed: its parts and settings (``Context``), what a batch or tick has
committed and still has to act on (``Work``), and the counts it reports (``BatchReport``, ``TickReport``).

``Context`` holds no logic. ``coordinator.service.Coordinator`` is a ``Context`` whose public methods run the stages
(ingest, fold, decide, act, record; the timer; the people's routes), each a module of functions that take it.
"""

from __future__ import annotations

import concurrent.futures
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from contracts.envelope import VmIdentity
from coordinator.adapters.callback import ApprovalCallback
from coordinator.adapters.gates import MonitorReader
from coordinator.adapters.history import HistorySink
from coordinator.adapters.teams import AlertSink
from coordinator.domain.lifecycle import EventChange
from coordinator.domain.model import AlertKind, EventRecord, VmRecord
from coordinator.domain.policy import Policy
from coordinator.domain.rows import HistoryRow
from coordinator.state.tables import TableStateStore

# A VM named by a Terminate/Preempt that started (or was approved, or reached NotBefore) is retired once silent this
# long: three of the forwarder's 60 s heartbeats. Shorter than the heartbeat timeout, so no "heartbeat lost" first.
RETIRE_GRACE = timedelta(seconds=180)
# Approvals of one batch go out concurrently, each given this long; a listener that does not answer in time is
# recorded as failed and retried by the timer (the listener is idempotent per decisionId).
APPROVAL_WORKERS = 16
APPROVAL_DEADLINE = timedelta(seconds=30)
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


def utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass
class BatchReport:
    received: int = 0
    accepted: int = 0
    dead_lettered: int = 0
    duplicates: int = 0
    events_changed: int = 0
    approvals_sent: int = 0
    alerts_sent: int = 0
    alerts_failed: int = 0
    history_rows: int = 0
    conflicts: int = 0

    def count_conflict(self) -> None:
        self.conflicts += 1

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class TickReport:
    open_events: int = 0
    events_changed: int = 0
    approvals_sent: int = 0
    alerts_sent: int = 0
    heartbeats_lost: int = 0
    vms_retired: int = 0
    history_rows: int = 0
    events_purged: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class Work:
    """What a batch or tick committed and still has to act on."""

    rows: list[HistoryRow] = field(default_factory=list)
    alerts: list[tuple[str, AlertKind]] = field(default_factory=list)
    deliveries: list[str] = field(default_factory=list)
    records: dict[str, EventRecord] = field(default_factory=dict)
    # Cards about VMs rather than events (two forwarders reporting as one VM).
    vm_alerts: list[tuple[VmRecord, AlertKind]] = field(default_factory=list)

    def collect(self, change: EventChange) -> None:
        """Takes in a committed change: its history rows, its record, its cards and (once) its approval."""
        self.rows.extend(change.rows)
        self.records[change.record.eventId] = change.record
        self.alerts.extend((change.record.eventId, kind) for kind in change.alerts)
        # Only the change that decided the approval sends it. Another instance that re-read the record after a
        # conflict sees the approval too, and must not send it again.
        if change.approval_decided and change.record.eventId not in self.deliveries:
            self.deliveries.append(change.record.eventId)


class Context:
    """The coordinator's parts (state, history, alerts, approval path, policy) and settings. All options are
    keyword-only; ``clock`` lets tests move time. Attributes without a leading underscore may be replaced by tests
    (a slower callback, another clock): every stage reads them when it runs."""

    def __init__(
        self,
        *,
        store: TableStateStore,
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
        self.dry_run = dry_run or policy.dryRun
        self.heartbeat_timeout = heartbeat_timeout
        self.approve_url = approve_url
        self.approval_backoff = approval_backoff
        self.on_new_vm = on_new_vm
        self.housekeeping = housekeeping
        self.housekeeping_interval = housekeeping_interval
        self.housekeeping_due: datetime | None = None
        self.retention = retention
        self.clock = clock
        self.rng = rng or random.Random()  # noqa: S311 -- jitter, not security
        if retire_grace >= heartbeat_timeout:
            raise ValueError(
                f"retire_grace ({retire_grace.total_seconds():.0f} s) must be shorter than heartbeat_timeout "
                f"({heartbeat_timeout.total_seconds():.0f} s): a removed VM is retired before it counts as lost"
            )
        self.retire_grace = retire_grace
        self.approval_workers = approval_workers
        self.approval_deadline = approval_deadline
        self.start_bound = start_bound
        self.imds_failing_after = imds_failing_after
        self.imds_failing_errors = imds_failing_errors
        # The Maintenance RP's acknowledge (preview), for rules that ask for it and, with the fallback on, for
        # approvals no VM's listener can execute (no VM reported within heartbeat_timeout).
        self.remote_acknowledge = remote_acknowledge
        self.remote_acknowledge_fallback = remote_acknowledge_fallback
        # Azure Monitor, for the policy's alert and logQuery gates (None: such gates read as errors and hold).
        self.monitor = monitor
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def pool(self) -> concurrent.futures.ThreadPoolExecutor:
        """The approval senders' threads, started on first use and kept for the process."""
        with self._pool_lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.approval_workers, thread_name_prefix="approval"
                )
            return self._executor
