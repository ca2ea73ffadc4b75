"""The coordinator: where envelopes, timers and people meet state, rules, history, callback and alerts.

function_app.py hands each trigger's input here. Decision code is pure (state.py, rules.py); this module does the
I/O around it: read records, apply, write with ETags (a conflict means another instance got there first: re-read
and redo, so each decision is taken once), then act on what was committed (send approvals, post alerts, log history).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import random
import threading
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, get_args

from pydantic import ValidationError

from coordinator import rules
from coordinator.alerts import AlertError, AlertSink, build_card, build_vm_card
from coordinator.callback import ApprovalCallback, ApprovalDeliveryError
from coordinator.history import HistorySink
from coordinator.model import (
    AlertKind,
    ApprovalRecord,
    BudgetClaim,
    BudgetRecord,
    DecisionRecord,
    EventRecord,
    Retirement,
    SentAlerts,
    VmGroupRecord,
    VmRecord,
    group_key,
)
from coordinator.retry import backoff_delay
from coordinator.rows import HistoryRow
from coordinator.sightings import (
    EventChange,
    Observation,
    Removal,
    VmUpdate,
    advance,
    apply_observations,
    choose_executor,
    clone,
    event_row,
    merge_vm_records,
    platform_hold,
    raise_alert,
    removals,
    transition,
    vm_observations,
    vm_position,
)
from coordinator.tables import ConcurrencyConflict, DeadLetter, Stored, TableStateStore
from forwarder.approval import ApprovalFacts, ApprovalRequest, ApprovalResult
from forwarder.envelope import Envelope, VmIdentity

log = logging.getLogger("coordinator")

MAX_EVENTS_PER_DOCUMENT = 100
MAX_RESOURCES_PER_EVENT = 1000
# Bounds on what one envelope may carry, so that nothing it holds can break a write for others: Table Storage,
# Log Analytics and SQLite hold 64-bit integers; a VM name is at most 64 characters in Azure (256 is generous).
INT64 = (-(2**63), 2**63 - 1)
MAX_NAME_CHARS = 256
MAX_TEXT_CHARS = 4096
# observedAt is the VM's clock: a replay from the spool may be days old, but not older than this project, and a
# clock far ahead would make the VM look alive for ever.
EARLIEST_OBSERVED = datetime(2000, 1, 1, tzinfo=UTC)
MAX_CLOCK_AHEAD = timedelta(days=1)
APPROVAL_FAILED_AFTER = 3
COMMIT_ATTEMPTS = 8
BULK_ATTEMPTS = 3
# The instance that decides sends at once; the timer takes over only if no outcome was recorded by then (the
# sender crashed between its deciding write and the send).
IN_FLIGHT_GRACE = timedelta(seconds=90)
# A budget claim counts unconditionally this long (its approval is written right after it); then only while its
# event holds an approval.
CLAIM_LEASE = timedelta(seconds=90)
# Cards are sent right after the write that records them; the timer sends those still pending after this.
ALERT_GRACE = timedelta(seconds=30)
# A VM named by a Terminate/Preempt that started (or was approved, or reached NotBefore) is retired once silent this
# long: three of the forwarder's 60 s heartbeats. Shorter than the heartbeat timeout, so no "heartbeat lost" first.
RETIRE_GRACE = timedelta(seconds=180)
# Approvals of one batch go out concurrently, each given this long; a listener that does not answer in time is
# recorded as failed and retried by the timer (the listener is idempotent per decisionId).
APPROVAL_WORKERS = 16
APPROVAL_DEADLINE = timedelta(seconds=30)


def utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class RawMessage:
    """One Event Hubs message as the trigger delivered it (function_app converts func.EventHubEvent)."""

    body: bytes
    partition_key: str | None = None
    sequence_number: int | None = None
    offset: str | None = None
    enqueued_time: datetime | None = None

    def source(self) -> dict[str, Any]:
        return {
            "partitionKey": self.partition_key,
            "sequenceNumber": self.sequence_number,
            "offset": self.offset,
            "enqueuedTime": self.enqueued_time.isoformat() if self.enqueued_time else None,
        }


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
class ManualApproval:
    status: Literal["approved", "sent", "dry-run", "not-found", "conflict"]
    message: str
    event: dict[str, Any] | None = None


class _Fleet:
    """The fleet view for budget rules, loaded at most once per batch/tick and updated as approvals are decided,
    and the fleet-wide budget claims (I/O; the rules themselves stay pure)."""

    def __init__(self, store: TableStateStore) -> None:
        self._store = store
        self._view: rules.FleetView | None = None
        self._open: list[EventRecord] | None = None
        self._deletes: dict[str, EventRecord] | None = None

    def _open_events(self) -> list[EventRecord]:
        if self._open is None:
            self._open = [stored.record for stored in self._store.open_events()]
        return self._open

    def view(self) -> rules.FleetView:
        if self._view is None:
            view = rules.FleetView()
            for record in self._open_events():
                if _holds_budget(record):
                    view = view.with_event(record)
            self._view = view
        return self._view

    def deletes(self) -> dict[str, EventRecord]:
        """The open Terminate events, as this batch/tick last decided them (delete coupling reads these)."""
        if self._deletes is None:
            self._deletes = {r.eventId: r for r in self._open_events() if r.eventType == "Terminate"}
        return self._deletes

    def seed(self, records: list[EventRecord]) -> None:
        """The open events the caller has just read (saves reading them again)."""
        self._open = records

    def note(self, record: EventRecord) -> None:
        """Keeps the delete registry current as events change within a batch or tick."""
        if record.eventType == "Terminate":
            self.deletes()[record.eventId] = record

    def held_in(self, scale_sets: Iterable[str], now: datetime) -> list[str]:
        """Pending deletes of these scale sets that are held back by another one (to re-decide)."""
        wanted = set(scale_sets)
        if not wanted:
            return []
        return sorted(
            r.eventId
            for r in self.deletes().values()
            if r.open
            and r.decision is not None
            and r.decision.heldBy
            and wanted & set(r.scaleSets)
            and r.approval is None
        )

    def add(self, record: EventRecord) -> None:
        if self._view is not None:
            self._view = self._view.with_event(record)

    def claim(self, record: EventRecord, limit: int, now: datetime) -> str:
        """Takes this event's slots in every scale set it impacts, or none. Returns "" when claimed, else why not.

        Each scale set's claims are one entity written with its ETag: of two instances that see the last slot
        free, one write fails, and that instance re-reads and sees the slot taken. A claim is made before the
        approval is written, so a crash in between can leave a claim without an approval: claims older than
        CLAIM_LEASE count only while their event still holds an approval (checked fresh), so none leaks."""
        taken: list[str] = []
        for scale_set, names in sorted(rules.impacted_by(record).items()):
            refused = self._claim_one(scale_set, names, record.eventId, limit, now)
            if refused:
                for held in taken:
                    self.release(held, record.eventId)
                return refused
            taken.append(scale_set)
        return ""

    def _claim_one(self, scale_set: str, names: set[str], event_id: str, limit: int, now: datetime) -> str:
        for _attempt in range(COMMIT_ATTEMPTS):
            stored = self._store.get_budget(scale_set)
            claims = dict(stored.record.claims) if stored else {}
            if event_id in claims:
                return ""
            live = self._live(claims, now)
            impacted = set(names) | self.view().impacted.get(scale_set, frozenset())
            for claim in live.values():
                impacted.update(claim.vms)
            if len(impacted) > limit:
                holders = ", ".join(sorted(live)[:5]) or "approved events"
                return (
                    f"scale set {scale_set or '(none)'!r} would have {len(impacted)} impacted instances (limit "
                    f"{limit}); held fleet-wide by {holders}"
                )
            live[event_id] = BudgetClaim(eventId=event_id, vms=sorted(names), claimedAt=now)
            try:
                self._store.save_budget(BudgetRecord(scaleSet=scale_set, claims=live), stored.etag if stored else None)
                return ""
            except ConcurrencyConflict:
                continue  # another instance claimed or released meanwhile: decide again on what it wrote
        return f"scale set {scale_set!r}: budget contended for {COMMIT_ATTEMPTS} attempts; retried by the timer"

    def _live(self, claims: dict[str, BudgetClaim], now: datetime) -> dict[str, BudgetClaim]:
        old = [event_id for event_id, claim in claims.items() if claim.claimedAt < now - CLAIM_LEASE]
        events = self._store.get_events(old) if old else {}
        return {
            event_id: claim
            for event_id, claim in claims.items()
            if event_id not in old or (event_id in events and _holds_budget(events[event_id].record))
        }

    def release(self, scale_set: str, event_id: str) -> None:
        for _attempt in range(COMMIT_ATTEMPTS):
            stored = self._store.get_budget(scale_set)
            if stored is None or event_id not in stored.record.claims:
                return
            claims = {k: v for k, v in stored.record.claims.items() if k != event_id}
            try:
                self._store.save_budget(BudgetRecord(scaleSet=scale_set, claims=claims), stored.etag)
                return
            except ConcurrencyConflict:
                continue
        log.warning("budget of %s: claim of %s not released (contended); it lapses by itself", scale_set, event_id)


def _etag(stored: Stored[Any] | None) -> str | None:
    return stored.etag if stored else None


def _set_aside(
    mine: dict[str, VmRecord], current: Stored[VmGroupRecord] | None, base: dict[str, tuple[int, int] | None]
) -> set[str]:
    """After a conflict on a VM group: takes out of ``mine`` the VMs not to write. Those already at this batch's
    position (written by an earlier part of this batch, or by an instance that processed the same envelopes), and
    those another instance moved since the position this batch started from: returned, to be redone."""
    stale = set()
    for vm_id, record in list(mine.items()):
        fresh = current.record.vms.get(vm_id) if current else None
        if fresh is None:
            continue
        if vm_position(fresh) == vm_position(record):
            del mine[vm_id]
        elif vm_position(fresh) != base.get(vm_id):
            stale.add(vm_id)
            del mine[vm_id]
    return stale


def _holds_budget(record: EventRecord) -> bool:
    """An event impacts its VMs from the approval until it is gone. An Expired event whose approval was decided
    keeps its slots too: the platform starts it at NotBefore anyway."""
    return record.open and (record.state in ("Approved", "Started") or record.approval is not None)


@dataclass
class _Work:
    """What a batch or tick committed and still has to act on."""

    rows: list[HistoryRow] = field(default_factory=list)
    alerts: list[tuple[str, AlertKind]] = field(default_factory=list)
    deliveries: list[str] = field(default_factory=list)
    records: dict[str, EventRecord] = field(default_factory=dict)


@dataclass
class _Delivery:
    """One approval on its way: what is sent, to whom, and what came back."""

    event_id: str
    decision_id: str
    executor: str
    vm: VmIdentity | None = None
    request: ApprovalRequest | None = None
    intent: HistoryRow | None = None
    result: ApprovalResult | None = None
    failure: str = ""


@dataclass
class _VmBatch:
    groups: dict[str, Stored[VmGroupRecord]]
    key_of: dict[str, str]
    updates: dict[str, VmUpdate] = field(default_factory=dict)
    new_vms: set[str] = field(default_factory=set)
    # VMs whose envelopes could not be processed, and why (dead-lettered by the caller).
    failed: dict[str, str] = field(default_factory=dict)
    # Each VM's (epoch, lastSequence) in the position its observations were derived from (None: no position).
    base: dict[str, tuple[int, int] | None] = field(default_factory=dict)


def _dead_letter_reason(error: Exception) -> str:
    """Why a message was refused, in at most a few hundred characters whatever the message held."""
    if isinstance(error, ValidationError):
        parts = []
        for item in error.errors()[:5]:
            where = ".".join(str(p)[:64] for p in item["loc"]) or "(envelope)"
            parts.append(f"{where}: {str(item['msg'])[:200]}")
        more = f" (+{error.error_count() - 5} more)" if error.error_count() > 5 else ""
        return "invalid envelope: " + "; ".join(parts) + more
    if isinstance(error, UnicodeError):
        return f"body is not UTF-8 text: {str(error)[:300]}"
    if isinstance(error, ValueError):
        return f"refused: {str(error)[:500]}"
    return f"refused: {type(error).__name__}: {str(error)[:500]}"


def _int64(value: int | None, what: str) -> None:
    if value is not None and not INT64[0] <= value <= INT64[1]:
        raise ValueError(f"{what} {str(value)[:40]}… does not fit in 64 bits")


def _text(value: str, what: str, limit: int) -> None:
    if len(value) > limit:
        raise ValueError(f"{what} is {len(value)} characters (limit {limit})")


def _check_bounds(envelope: Envelope, now: datetime) -> None:
    """What the envelope contract leaves open but storage cannot hold: integers beyond 64 bits, timestamps that
    overflow arithmetic, names and texts of any length, too many events or resources."""
    _int64(envelope.sequence, "sequence")
    observed = envelope.observedAt
    if observed < EARLIEST_OBSERVED or observed > now + MAX_CLOCK_AHEAD:
        raise ValueError(
            f"observedAt {observed.isoformat()} is not plausible (before {EARLIEST_OBSERVED.year} or more than "
            f"{MAX_CLOCK_AHEAD.days} day ahead of the coordinator's clock {now.isoformat()})"
        )
    vm = envelope.vm
    for name in ("vmScaleSetName", "placementGroupId", "subscriptionId", "resourceGroupName", "location", "zone"):
        _text(str(getattr(vm, name)), f"vm.{name}", MAX_NAME_CHARS)
    _text(vm.platformFaultDomain, "vm.platformFaultDomain", MAX_NAME_CHARS)
    if envelope.document is not None:
        document = envelope.document
        _int64(document.DocumentIncarnation, "DocumentIncarnation")
        if len(document.Events) > MAX_EVENTS_PER_DOCUMENT:
            raise ValueError(f"document lists {len(document.Events)} events (limit {MAX_EVENTS_PER_DOCUMENT})")
        for event in document.Events:
            where = f"event {event.EventId[:128]}"
            _int64(event.DurationInSeconds, f"{where}: DurationInSeconds")
            if len(event.Resources) > MAX_RESOURCES_PER_EVENT:
                raise ValueError(f"{where} lists {len(event.Resources)} resources (limit {MAX_RESOURCES_PER_EVENT})")
            for resource in event.Resources:
                _text(resource, f"{where}: a resource name", MAX_NAME_CHARS)
            for name in ("ResourceType", "EventSource", "NotBefore"):
                _text(str(getattr(event, name)), f"{where}: {name}", MAX_NAME_CHARS)
            _text(event.Description, f"{where}: Description", MAX_TEXT_CHARS)
    if envelope.hook is not None:
        _int64(envelope.hook.exitCode, "hook.exitCode")
        for step in envelope.hook.steps or ():
            _int64(step.exitCode, f"hook step {step.hook[:64]}: exitCode")


class Coordinator:
    """Fleet logic behind the Functions app. All options are keyword-only; ``clock`` lets tests move time."""

    def __init__(
        self,
        *,
        store: TableStateStore,
        history: HistorySink,
        alerts: AlertSink,
        callback: ApprovalCallback,
        policy: rules.Policy,
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
    ) -> None:
        self.store = store
        self.history = history
        self.alerts = alerts
        self.callback = callback
        self.policy = policy
        self.dry_run = dry_run or policy.dryRun
        self.heartbeat_timeout = heartbeat_timeout
        self._approve_url = approve_url
        self._backoff = approval_backoff
        self._on_new_vm = on_new_vm
        self._housekeeping = housekeeping
        self._housekeeping_interval = housekeeping_interval
        self._housekeeping_due: datetime | None = None
        self.retention = retention
        self.clock = clock
        self._rng = rng or random.Random()  # noqa: S311 -- jitter, not security
        if retire_grace >= heartbeat_timeout:
            raise ValueError(
                f"retire_grace ({retire_grace.total_seconds():.0f} s) must be shorter than heartbeat_timeout "
                f"({heartbeat_timeout.total_seconds():.0f} s): a removed VM is retired before it counts as lost"
            )
        self.retire_grace = retire_grace
        self.approval_workers = approval_workers
        self.approval_deadline = approval_deadline
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    # ---- envelopes in ----------------------------------------------------------------------------------------
    def _validate(self, message: RawMessage, now: datetime) -> Envelope:
        envelope = Envelope.model_validate_json(message.body)
        if message.partition_key and message.partition_key.lower() != envelope.vm.partition_key:
            raise ValueError(
                f"partition key {message.partition_key[:300]!r} is not the envelope's vm.resourceId: a VM reports "
                "only for itself"
            )
        _check_bounds(envelope, now)
        # Unknown identity fields are not kept: the VM's position is stored with its identity.
        vm = VmIdentity.model_validate(envelope.vm.model_dump(include=set(VmIdentity.model_fields)))
        return envelope.model_copy(update={"vm": vm})

    def _dead_letter(
        self, message: RawMessage, reason: str, now: datetime, *, dead: list[DeadLetter], work: _Work, where: str
    ) -> None:
        reason = reason[:2000]
        source = {k: (v[:300] if isinstance(v, str) else v) for k, v in message.source().items()}
        log.warning("dead-letter: %s (%s) refused: %s", where, json.dumps(source), reason)
        dead.append(DeadLetter(reason=reason, body=message.body, received_at=now, source=source))
        details = {**source, "bodyBytes": len(message.body), "bodySha256": hashlib.sha256(message.body).hexdigest()}
        work.rows.append(HistoryRow(TimeGenerated=now, RecordType="DeadLetter", Reason=reason, Details=details))

    def process_batch(self, messages: Sequence[RawMessage]) -> BatchReport:
        """One Event Hubs batch (cardinality many). Bad messages are dead-lettered; the rest goes on."""
        now = self.clock()
        report = BatchReport(received=len(messages))
        work = _Work()
        # Each VM's envelopes in arrival order: the batch's order is its Event Hubs partition's (key = the VM).
        by_vm: dict[str, list[Envelope]] = defaultdict(list)
        raw_of: dict[str, list[RawMessage]] = defaultdict(list)
        dead: list[DeadLetter] = []
        for index, message in enumerate(messages):
            try:
                envelope = self._validate(message, now)
            except Exception as error:  # any failure is this message's alone: set aside, counted
                self._dead_letter(
                    message,
                    _dead_letter_reason(error),
                    now,
                    dead=dead,
                    work=work,
                    where=f"message {index} of the batch",
                )
                continue
            by_vm[envelope.vm.vmId.lower()].append(envelope)
            raw_of[envelope.vm.vmId.lower()].append(message)

        fleet = _Fleet(self.store)
        updates = self._vm_updates(by_vm, cached=True)
        for vm_id, problem in updates.failed.items():
            # Whatever broke on this VM's envelopes costs only this VM (its position does not move).
            for message in raw_of.pop(vm_id, []):
                self._dead_letter(
                    message,
                    f"processing failed: {problem}",
                    now,
                    dead=dead,
                    work=work,
                    where=f"an envelope of VM {vm_id}",
                )
        if dead:
            try:
                self.store.put_dead_letters(dead)
            except Exception:  # the history rows and log lines keep them; the batch's good messages go on
                log.exception("could not store %d dead letters", len(dead))
        report.dead_lettered = len(dead)
        stale = self._apply(updates, now, fleet, report, work)
        for _attempt in range(BULK_ATTEMPTS):
            if not stale:
                break
            # Another instance moved these VMs since this one cached their group (a partition changed hands):
            # what was derived from the old positions may miss a 'gone'. Redo them from the fresh positions;
            # re-applying what was already applied is a no-op.
            for vm_id in stale:
                report.accepted -= updates.updates[vm_id].applied
                report.duplicates -= updates.updates[vm_id].duplicates
            redo = self._vm_updates({vm_id: by_vm[vm_id] for vm_id in stale}, cached=False)
            updates.updates.update(redo.updates)
            updates.new_vms = (updates.new_vms - stale) | redo.new_vms
            stale = self._apply(redo, now, fleet, report, work)
        self._act(work, now, report, last_seen=None)
        if self._on_new_vm is not None:
            # New VMs, and VMs back from silence (housekeeping may have removed what was set up for them).
            for vm_id, update in updates.updates.items():
                if vm_id in updates.new_vms or update.resumed:
                    self._new_vm(update.record.identity)
        return report

    def _apply(self, updates: _VmBatch, now: datetime, fleet: _Fleet, report: BatchReport, work: _Work) -> set[str]:
        """Observations -> events -> VM positions. Returns the VMs whose cached position turned out stale (not
        written: the caller redoes them)."""
        observations: dict[str, list[Observation]] = defaultdict(list)
        for update in updates.updates.values():
            report.accepted += update.applied
            report.duplicates += update.duplicates
            for observation in update.observations:
                observations[observation.event_id].append(observation)
            if update.resumed:
                work.rows.append(self._vm_row(update.record, now, "heartbeat resumed"))
            work.rows.extend(update.rows)
        committed = self._commit_events(observations, now, fleet, report, updates, work=work)
        for change in committed:
            self._collect(change, work)
            self._keep_sightings(change, observations[change.record.eventId], updates)
        report.events_changed += len(committed) + self._release_held(committed, now, fleet, work)
        # VM positions are written after the events: a crash in between replays the envelopes, which the
        # events' per-VM sequence makes harmless.
        return self._save_vm_updates(updates, report)

    def _new_vm(self, vm: VmIdentity) -> None:
        assert self._on_new_vm is not None
        try:
            self._on_new_vm(vm)
        except Exception:  # e.g. the VM's hybrid connection could not be created: retried when it next reports
            log.exception("setting up new VM %s failed", vm.name)

    def _vm_updates(self, by_vm: dict[str, list[Envelope]], *, cached: bool) -> _VmBatch:
        key_of = {vm_id: group_key(envelopes[-1].vm) for vm_id, envelopes in by_vm.items()}
        groups = self.store.get_vm_groups(set(key_of.values()), cached=cached)
        batch = _VmBatch(groups=groups, key_of=key_of)
        for vm_id, envelopes in by_vm.items():
            stored = groups.get(key_of[vm_id])
            previous = stored.record.vms.get(vm_id) if stored else None
            try:
                batch.updates[vm_id] = vm_observations(previous, envelopes)
            except Exception as error:  # contained to this VM; the caller dead-letters its envelopes
                log.exception("VM %s: its envelopes could not be read against its position", vm_id)
                batch.failed[vm_id] = f"{type(error).__name__}: {str(error)[:500]}"
                del key_of[vm_id]
                continue
            batch.base[vm_id] = vm_position(previous) if previous else None
            if previous is None:
                batch.new_vms.add(vm_id)
        return batch

    def _save_vm_updates(self, batch: _VmBatch, report: BatchReport) -> set[str]:
        mine: dict[str, dict[str, VmRecord]] = defaultdict(dict)
        for vm_id, update in batch.updates.items():
            if update.applied:
                mine[batch.key_of[vm_id]][vm_id] = update.record
        stale: set[str] = set()
        if not mine:
            return stale

        def merged(key: str, current: Stored[VmGroupRecord] | None) -> VmGroupRecord:
            vms = dict(current.record.vms) if current else {}
            for vm_id, record in mine[key].items():
                vms[vm_id] = merge_vm_records(record, vms[vm_id]) if vm_id in vms else record
            return VmGroupRecord(group=key, vms=vms)

        groups = batch.groups
        for attempt in range(BULK_ATTEMPTS):
            if attempt:
                groups = self.store.get_vm_groups(mine)
                for key, vms in mine.items():
                    stale |= _set_aside(vms, groups.get(key), batch.base)
            items: list[tuple[VmGroupRecord, str | None, Iterable[str] | None]] = [
                (merged(key, groups.get(key)), _etag(groups.get(key)), vms) for key, vms in mine.items() if vms
            ]
            try:
                self.store.save_vm_groups(items)
                return stale
            except ConcurrencyConflict:
                report.conflicts += 1
        # Another instance wrote one of these groups (its VMs sit on other Event Hubs partitions): merge per VM.
        for key, vms in mine.items():
            for _attempt in range(COMMIT_ATTEMPTS):
                current = self.store.get_vm_groups([key]).get(key)
                stale |= _set_aside(vms, current, batch.base)
                if not vms:
                    break
                try:
                    self.store.save_vm_group(merged(key, current), current.etag if current else None, vm_ids=vms)
                    break
                except ConcurrencyConflict:
                    report.conflicts += 1
        return stale

    # ---- events: read, apply, write with ETags ---------------------------------------------------------------
    def _decide_all(self, changes: Sequence[EventChange], now: datetime, fleet: _Fleet) -> None:
        """Decides the changed events of a batch or tick. The pending deletes among them are decided as one unit
        with those of their scale sets: each one's own verdict is noted first, so that simultaneous deletes
        arriving together are approved together rather than one held by the other. A failure deciding one event
        costs only that event's decision (its observations are still written; the timer decides it again)."""
        for change in changes:
            record = change.record
            if record.eventType == "Terminate" and record.state == "Scheduled" and record.approval is None:
                try:
                    own = rules.evaluate(self.policy, record, rules.FleetView(), now)
                except Exception:
                    log.exception("event %s: its rule could not be evaluated", record.eventId)
                    continue
                provisional = DecisionRecord(
                    decisionId="",
                    rule=own.rule,
                    action=own.action,
                    verdict=own.verdict,
                    reason=own.reason,
                    decidedAt=now,
                )
                fleet.note(record.model_copy(update={"decision": provisional}))
            else:
                fleet.note(record)
        for change in changes:
            try:
                self._decide(change, now, fleet)
            except Exception:
                log.exception("event %s: deciding failed; the timer decides it again", change.record.eventId)
            fleet.note(change.record)

    def _release_held(self, changes: Sequence[EventChange], now: datetime, fleet: _Fleet, work: _Work) -> int:
        """Deletes held back by a delete that changed here (approved, ready, started, gone, expired) are decided
        again at once, not on the next timer run: once the last pending delete of a scale set is ready, all of
        them are approved in this same batch or tick."""
        touched = {scale_set for c in changes if c.record.eventType == "Terminate" for scale_set in c.record.scaleSets}
        here = {c.record.eventId for c in changes}
        released = 0
        for event_id in fleet.held_in(touched, now):
            if event_id in here:
                continue
            try:
                change = self._commit_one(event_id, lambda r: self._redecide(r, now, fleet))
            except ConcurrencyConflict:
                log.warning("held delete %s: contended; the timer decides it again", event_id)
                continue
            if change is not None:
                released += 1
                fleet.note(change.record)
                self._collect(change, work)
        return released

    def _redecide(self, record: EventRecord | None, now: datetime, fleet: _Fleet) -> EventChange | None:
        if record is None:
            return None
        change = EventChange(record=clone(record))
        self._decide(change, now, fleet)
        return change

    def _assemble(
        self, events: dict[str, Stored[EventRecord]], groups: dict[str, Stored[VmGroupRecord]]
    ) -> dict[str, Stored[EventRecord]]:
        """Puts each event's per-VM sightings (kept with the VMs' positions) back into the record."""
        out: dict[str, Stored[EventRecord]] = {}
        for event_id, stored in events.items():
            vms = {}
            for key in stored.record.groups:
                group = groups.get(key)
                for vm in group.record.vms.values() if group else ():
                    sighting = vm.sightings.get(event_id)
                    if sighting is not None:
                        vms[vm.identity.name] = sighting.model_copy(
                            update={
                                "name": vm.identity.name,
                                "vmId": vm.identity.vmId,
                                "resourceId": vm.identity.resourceId,
                                "scaleSet": vm.identity.vmScaleSetName,
                                "placementGroup": vm.identity.placementGroupId,
                            }
                        )
            out[event_id] = Stored(stored.record.model_copy(update={"vms": vms}), stored.etag)
        return out

    def event(self, event_id: str) -> Stored[EventRecord] | None:
        """The event as stored now (fresh read), with its VMs' sightings."""
        stored = self.store.get_events([event_id])
        if event_id not in stored:
            return None
        groups = self.store.get_vm_groups(stored[event_id].record.groups)
        return self._assemble(stored, groups)[event_id]

    def _keep_sightings(self, change: EventChange, observations: list[Observation], batch: _VmBatch) -> None:
        for observation in observations:
            update = batch.updates.get(observation.vm.vmId.lower())
            sighting = change.record.vms.get(observation.vm.name)
            if update is not None and sighting is not None:
                # Stored without the identity fields: the VM's position says them once.
                compact = sighting.model_copy(
                    update={"name": "", "vmId": "", "resourceId": "", "scaleSet": "", "placementGroup": ""}
                )
                sightings = {**update.record.sightings, change.record.eventId: compact}
                update.record = update.record.model_copy(update={"sightings": sightings})

    def _commit_events(
        self,
        observations: dict[str, list[Observation]],
        now: datetime,
        fleet: _Fleet,
        report: BatchReport,
        batch: _VmBatch,
        *,
        work: _Work,
    ) -> list[EventChange]:
        if not observations:
            return []

        failed: set[str] = set()

        def apply(record: EventRecord | None, event_id: str, items: list[Observation]) -> EventChange | None:
            if event_id in failed:
                return None
            try:
                change = apply_observations(record, items, now)
            except Exception as error:
                # Contained to this event: its observations are set aside (logged, a DeadLetter row); the rest
                # of the batch goes on.
                failed.add(event_id)
                vms = sorted({o.vm.name for o in items})
                log.exception("event %s: observations from %s could not be applied", event_id, vms)
                work.rows.append(
                    HistoryRow(
                        TimeGenerated=now,
                        RecordType="DeadLetter",
                        EventId=event_id[:128],
                        Reason=f"observations could not be applied: {type(error).__name__}: {str(error)[:500]}",
                        Details={"vms": vms[:20]},
                    )
                )
                return None
            if change is not None:
                reporting = {batch.key_of[o.vm.vmId.lower()] for o in items if o.vm.vmId.lower() in batch.key_of}
                if not reporting <= set(change.record.groups):
                    change.record.groups = sorted(set(change.record.groups) | reporting)
                    change.changed = True
            return change

        changes: list[EventChange] = []
        # Another instance may write some of these events meanwhile (a placement group's VMs sit on several
        # Event Hubs partitions): re-read them all fresh and retry the transaction a few times, then one by one.
        for attempt in range(BULK_ATTEMPTS):
            stored = self.store.get_events(observations, cached=attempt == 0)
            wanted = {key for s in stored.values() for key in s.record.groups} - set(batch.groups)
            groups = {**self.store.get_vm_groups(wanted, cached=attempt == 0), **batch.groups}
            assembled = self._assemble(stored, groups)
            applied: list[tuple[EventChange, Stored[EventRecord] | None]] = []
            for event_id, items in observations.items():
                current = assembled.get(event_id)
                change = apply(current.record if current else None, event_id, items)
                if change is not None:
                    applied.append((change, current))
            self._decide_all([c for c, _ in applied], now, fleet)
            changes, writes = [], []
            for change, current in applied:
                if not change.changed:
                    continue
                changes.append(change)
                # Only the event itself is written here; new sightings go with the VM positions.
                if current is None or _aggregate(change.record) != _aggregate(current.record):
                    writes.append((change.record, current.etag if current else None))
            try:
                self.store.save_events(writes)
                return changes
            except ConcurrencyConflict:
                report.conflicts += 1
        # Another instance keeps writing these events: redo each one on its own from a fresh read.
        committed = []
        for change in changes:
            event_id = change.record.eventId

            def redo(
                record: EventRecord | None, event_id: str = event_id, items: list[Observation] = observations[event_id]
            ) -> EventChange | None:
                redone = apply(record, event_id, items)
                if redone is not None:
                    self._decide_all([redone], now, fleet)
                return redone

            result = self._commit_one(event_id, redo, report)
            if result is not None:
                committed.append(result)
        return committed

    def _commit_one(
        self,
        event_id: str,
        mutate: Callable[[EventRecord | None], EventChange | None],
        report: BatchReport | TickReport | None = None,
        *,
        read: Stored[EventRecord] | None = None,
    ) -> EventChange | None:
        """Read-modify-write of one event with its ETag; ``read`` is a record just read fresh (the first attempt
        uses it instead of reading again)."""
        for attempt in range(COMMIT_ATTEMPTS):
            current = read if attempt == 0 and read is not None else self.event(event_id)
            change = mutate(current.record if current else None)
            if change is None or not change.changed:
                return None
            try:
                self.store.save_event(change.record, current.etag if current else None)
                return change
            except ConcurrencyConflict:
                if isinstance(report, BatchReport):
                    report.conflicts += 1
        raise ConcurrencyConflict(f"event {event_id}: gave up after {COMMIT_ATTEMPTS} conflicting writes")

    # ---- rules -----------------------------------------------------------------------------------------------
    def _decide(self, change: EventChange, now: datetime, fleet: _Fleet) -> None:
        record = change.record
        if record.state != "Scheduled" or record.approval is not None:
            return
        view = fleet.view() if rules.needs_fleet(self.policy, record, now) else rules.FleetView()
        decision = rules.evaluate(self.policy, record, view, now)
        if record.eventType == "Terminate" and record.scaleSets:
            decision = rules.couple(decision, record, fleet.deletes().values(), now)
        limit = rules.budget_limit(self.policy, decision.rule)
        if decision.verdict == "approve" and not self.dry_run and limit is not None:
            # The rule saw budget left in this instance's view; the claim makes that hold across instances.
            refused = fleet.claim(record, limit, now)
            if refused:
                decision = rules.Decision(decision.rule, decision.action, "wait", refused)
        previous = record.decision
        # A new decision (and row) when the rule, verdict, hold or reason changes (e.g. a hook now failed), not on
        # every re-evaluation that finds the same.
        if previous is None or (
            previous.rule,
            previous.verdict,
            previous.dryRun,
            previous.heldBy,
            previous.reason,
        ) != (decision.rule, decision.verdict, self.dry_run, decision.heldBy, decision.reason):
            record.decision = DecisionRecord(
                decisionId=uuid.uuid4().hex,
                rule=decision.rule,
                action=decision.action,
                verdict=decision.verdict,
                reason=decision.reason,
                decidedAt=now,
                dryRun=self.dry_run,
                actor=f"rule:{decision.rule}",
                heldBy=decision.heldBy,
                heldByVm=decision.heldByVm,
                heldUntil=decision.heldUntil,
            )
            change.rows.append(self._decision_row(record, now))
            change.changed = True
        if decision.verdict == "approve" and not self.dry_run and record.decision is not None:
            record.approval = ApprovalRecord(
                decisionId=record.decision.decisionId,
                rule=decision.rule,
                actor=f"rule:{decision.rule}",
                decidedAt=now,
                nextAttemptAt=now + IN_FLIGHT_GRACE,
            )
            fleet.add(record)
            change.changed = True
            change.approval_decided = True

    def _decision_row(self, record: EventRecord, now: datetime) -> HistoryRow:
        decision = record.decision
        assert decision is not None
        return event_row(
            record,
            now,
            "Decision",
            Rule=decision.rule,
            Action=decision.action,
            DecisionId=decision.decisionId,
            Actor=decision.actor,
            Outcome=decision.verdict,
            Reason=decision.reason,
            DryRun=decision.dryRun,
            Details=(
                {
                    "heldBy": decision.heldBy,
                    "heldByVm": decision.heldByVm,
                    "heldUntil": decision.heldUntil.isoformat() if decision.heldUntil else None,
                }
                if decision.heldBy
                else None
            ),
        )

    # ---- acting on what was committed ------------------------------------------------------------------------
    def _collect(self, change: EventChange, work: _Work) -> None:
        work.rows.extend(change.rows)
        work.records[change.record.eventId] = change.record
        work.alerts.extend((change.record.eventId, kind) for kind in change.alerts)
        # Only the change that decided the approval sends it. Another instance that re-read the record after a
        # conflict sees the approval too, and must not send it again.
        if change.approval_decided and change.record.eventId not in work.deliveries:
            work.deliveries.append(change.record.eventId)

    def _act(
        self,
        work: _Work,
        now: datetime,
        report: BatchReport | TickReport,
        *,
        last_seen: dict[str, datetime] | None,
        settled: dict[str, list[str]] | None = None,
        fleet: _Fleet | None = None,
    ) -> None:
        """Sends the committed approvals and cards. The batch path logs the cards it sent in one write; the timer
        (``settled``: what those logs say was sent) clears them from the events' outbox itself.

        Approvals: the intent (the approval record, written by the deciding write, and an Approval history row)
        is recorded before anything is sent, so a coordinator that dies right after sending still leaves its
        history; they go out concurrently (a bounded pool, each with its own deadline), so a slow or absent
        listener holds up nothing else; each outcome is then written to its event."""
        records: dict[str, EventRecord] = dict(work.records)
        plans = [plan for plan in (self._plan(event_id, now, last_seen) for event_id in work.deliveries) if plan]
        if any(plan.intent is not None for plan in plans):
            work.rows.extend(plan.intent for plan in plans if plan.intent is not None)
            self._write_history(work.rows, report)
            work.rows = []
        self._send_all(plans)
        fleet = fleet or _Fleet(self.store)
        for plan in plans:
            try:
                change = self._commit_one(
                    plan.event_id,
                    lambda r, plan=plan: self._approval_outcome(r, plan=plan, now=now, fleet=fleet),  # type: ignore[misc]
                )
            except ConcurrencyConflict:
                log.warning("approval of %s: outcome not recorded (contended); the timer reconciles", plan.event_id)
                continue
            if change is not None:
                report.approvals_sent += 1
                records[plan.event_id] = change.record
                fleet.note(change.record)
                self._collect(change, work)
        self._release_budgets(records.values())
        sent: dict[str, list[str]] = defaultdict(list)
        if work.alerts:
            for event_id in {e for e, _ in work.alerts if e not in records}:
                current = self.event(event_id)
                if current is not None:
                    records[event_id] = current.record
            for event_id, kind in work.alerts:
                if event_id in records and self._alert(records[event_id], kind, now, work, report):
                    sent[event_id].append(kind)
            if settled is None and sent:
                self._log_sent(sent, now)
        if settled is not None:
            for event_id, kinds in sent.items():
                settled.setdefault(event_id, []).extend(kinds)
            self._clear_sent(settled)
        self._write_history(work.rows, report)

    def _log_sent(self, sent: dict[str, list[str]], now: datetime) -> None:
        try:
            self.store.log_sent_alerts(SentAlerts(sentAt=now, events=dict(sent)))
        except Exception:  # the cards went out; without the log the timer may send them once more
            log.exception("could not record %d sent cards; the timer may send them again", len(sent))

    def _release_budgets(self, records: Iterable[EventRecord]) -> None:
        """Frees the budget slots of events that concluded. Best effort: a claim left behind (a crash here, or
        a conclusion by a path that does not pass here) lapses once its event no longer holds an approval."""
        fleet: _Fleet | None = None
        for record in records:
            if record.open or record.approval is None or rules.budget_limit(self.policy, record.approval.rule) is None:
                continue
            fleet = fleet or _Fleet(self.store)
            for scale_set in sorted(rules.impacted_by(record)):
                try:
                    fleet.release(scale_set, record.eventId)
                except Exception:  # the claim lapses by itself; the batch's real work is done
                    log.exception("budget of %s: releasing the claim of %s failed", scale_set, record.eventId)

    def _clear_sent(self, sent: dict[str, list[str]]) -> None:
        """Clears sent cards from the events' outbox: one transaction, event by event when another instance wrote
        one meanwhile."""
        if not sent:
            return
        stored = self.store.get_events(sent, cached=True)
        items = []
        for event_id, kinds in sent.items():
            current = stored.get(event_id)
            change = _clear_alerts_pending(current.record, kinds) if current else None
            if current is not None and change is not None:
                items.append((change.record, current.etag))
        try:
            self.store.save_events(items)
            return
        except ConcurrencyConflict:
            pass
        for event_id, kinds in sent.items():
            try:
                self._commit_one(event_id, lambda r, kinds=kinds: _clear_alerts_pending(r, kinds))  # type: ignore[misc]
            except ConcurrencyConflict:
                log.warning(
                    "alerts %s of %s sent but still marked pending: the timer may send them again", kinds, event_id
                )

    def _write_history(self, rows: list[HistoryRow], report: BatchReport | TickReport) -> None:
        if not rows:
            return
        try:
            self.history.write(rows)
            report.history_rows += len(rows)
        except Exception:  # history must never stop the pipeline; the sink keeps what it could not send
            log.exception("history: could not write %d rows", len(rows))

    def _alert(
        self, record: EventRecord, kind: AlertKind, now: datetime, work: _Work, report: BatchReport | TickReport
    ) -> bool:
        approve_url = self._approve_url(record.eventId) if self._approve_url else None
        card = build_card(kind, record, now=now, approve_url=approve_url)
        key = f"{record.eventId}-{kind}"
        try:
            self.alerts.send(card, key=key)
        except AlertError as error:
            log.warning("alert %s not delivered, kept pending: %s", key, error)
            if isinstance(report, BatchReport):
                report.alerts_failed += 1
            work.rows.append(_alert_row(record, kind, now, "failed", str(error)))
            return False
        report.alerts_sent += 1
        work.rows.append(_alert_row(record, kind, now, "sent", ""))
        return True

    def _plan(self, event_id: str, now: datetime, last_seen: dict[str, datetime] | None) -> _Delivery | None:
        """What to send for one committed approval, read fresh: the executor and the request (None when no VM
        can execute it; the failure says why). Every approval is sent from a plan, so dry-run is held here: an
        approval decided before dry-run was switched on waits."""
        if self.dry_run:
            return None
        stored = self.event(event_id)
        if stored is None or stored.record.approval is None or stored.record.approval.delivered:
            return None
        record = stored.record
        approval = stored.record.approval
        seen = {name: s.lastSeen for name, s in record.vms.items()}
        if last_seen:
            seen.update({name: last_seen[name] for name in seen if name in last_seen})
        executor = choose_executor(record, seen, now - self.heartbeat_timeout)
        plan = _Delivery(event_id=event_id, decision_id=approval.decisionId, executor=executor.name if executor else "")
        if executor is None:
            within = f"{self.heartbeat_timeout.total_seconds():.0f} s"
            if record.eventType == "Terminate":
                plan.failure = (
                    f"a Terminate is approved only through the VM it deletes, and none of {record.resources[:5]} "
                    f"reported within {within} (no peer may approve it)"
                )
            else:
                plan.failure = f"no VM of {sorted(record.vms)[:10]} reported within {within}"
            return plan
        plan.vm = executor.identity()
        plan.request = ApprovalRequest(
            eventId=record.eventId,
            decisionId=approval.decisionId,
            rule=approval.rule[:256],
            issuedAt=now,
            expiresAt=record.notBefore or now + timedelta(minutes=15),
            # What the decision rested on, for the VM to check against its own IMDS document and hook ledger.
            facts=ApprovalFacts(
                eventType=record.eventType,
                eventSource=record.eventSource,
                durationInSeconds=record.durationInSeconds,
                notBefore=record.notBefore,
                resources=list(record.resources),
                hooksRequired=rules.hooks_required(self.policy, approval.rule, record),
            ),
        )
        plan.intent = _approval_row(
            record,
            approval,
            now,
            vm=executor.name,
            Outcome="sending",
            Reason=f"StartRequests for {record.eventId} going to {executor.name} (attempt {approval.attempts + 1})",
        )
        return plan

    def _send_all(self, plans: Sequence[_Delivery]) -> None:
        """Sends the approvals concurrently, each given ``approval_deadline``. One that has not answered by then is
        recorded as failed and retried later; its thread finishes on its own (the sender has its own timeouts)."""
        futures: dict[concurrent.futures.Future[ApprovalResult], _Delivery] = {}
        for plan in plans:
            if plan.request is not None and plan.vm is not None:
                futures[self._pool().submit(self.callback.send, plan.request, vm=plan.vm)] = plan
        if not futures:
            return
        done, late = concurrent.futures.wait(futures, timeout=self.approval_deadline.total_seconds())
        for future in done:
            plan = futures[future]
            try:
                plan.result = future.result()
            except ApprovalDeliveryError as error:
                plan.failure = str(error)
            except Exception as error:  # a bug or an odd answer in one delivery costs only that delivery
                log.exception("approval of %s through %s failed", plan.event_id, plan.executor)
                plan.failure = f"{type(error).__name__}: {error}"
        for future in late:
            plan = futures[future]
            plan.failure = (
                f"{plan.executor}'s listener did not answer within {self.approval_deadline.total_seconds():g} s; "
                "retried (idempotent by decisionId)"
            )

    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._pool_lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.approval_workers, thread_name_prefix="approval"
                )
            return self._executor

    def _approval_outcome(
        self, record: EventRecord | None, *, plan: _Delivery, now: datetime, fleet: _Fleet
    ) -> EventChange | None:
        decision_id, executor, result, failure = plan.decision_id, plan.executor, plan.result, plan.failure
        if record is None or record.approval is None or record.approval.decisionId != decision_id:
            return None
        record = clone(record)
        change = EventChange(record=record, changed=True)
        approval = record.approval
        assert approval is not None
        approval.attempts += 1
        approval.lastAttemptAt = now
        approval.executor = executor
        approval.outcome = result.outcome if result else "failed"
        approval.reason = (result.reason if result else failure)[:1000]
        change.rows.append(
            _approval_row(
                record,
                approval,
                now,
                vm=executor,
                DecisionId=decision_id,
                Outcome=approval.outcome,
                Reason=approval.reason or f"StartRequests accepted by {executor}",
                DocumentIncarnation=result.documentIncarnation if result else None,
            )
        )
        if result is not None and result.outcome == "approved":
            approval.delivered = True
            approval.nextAttemptAt = None
            # Set before the transition, so that the "approved" card says what holds it.
            self._update_hold(change, fleet.deletes().values(), now)
            if record.state == "Scheduled":
                transition(
                    change,
                    "Approved",
                    now,
                    f"approved by {approval.actor} through {executor}; confirmed when seen Started or gone",
                    Rule=approval.rule,
                    Actor=approval.actor,
                    DecisionId=decision_id,
                    VmName=executor,
                )
            return change
        if result is not None and result.outcome == "not-scheduled":
            # The VM sees it Started already; its next document moves the state.
            approval.nextAttemptAt = None
        else:
            delay = backoff_delay(
                approval.attempts - 1, initial=self._backoff[0], maximum=self._backoff[1], rng=self._rng
            )
            approval.nextAttemptAt = now + timedelta(seconds=max(1.0, delay))
        if result is not None and result.outcome == "rejected":
            # The VM found the decision's facts untrue of its own IMDS document or hook ledger: one card per event
            # (the reason is in the history's Approval row); retries go on in case the record was merely behind.
            raise_alert(change, "approval-refused", now)
        if approval.attempts >= APPROVAL_FAILED_AFTER:
            raise_alert(change, "approval-failed", now)
        return change

    @staticmethod
    def _update_hold(change: EventChange, deletes: Iterable[EventRecord], now: datetime) -> None:
        """Shows an approved delete that the platform holds because another delete of its scale set is pending:
        on the record (the card and summarize() read it) and as an Approval row (Actor platform, Outcome held),
        and again when the hold is lifted or moves to another pending delete."""
        record = change.record
        hold = platform_hold(record, deletes, now)
        previous = record.platformHold
        if (hold.eventId if hold else "") == (previous.eventId if previous else ""):
            return
        record.platformHold = hold
        change.changed = True
        reason = hold.describe() if hold else "no longer held by the platform: no other delete of its scale set pending"
        change.rows.append(
            event_row(
                record,
                now,
                "Approval",
                Actor="platform",
                Outcome="held" if hold else "released",
                Reason=reason,
                DecisionId=record.approval.decisionId if record.approval else "",
                Details=(
                    {
                        "heldBy": hold.eventId,
                        "heldByVm": hold.vm,
                        "until": hold.until.isoformat() if hold.until else None,
                    }
                    if hold
                    else None
                ),
            )
        )

    # ---- the timer -------------------------------------------------------------------------------------------
    def tick(self) -> TickReport:
        """Re-evaluates waiting events, expires, retires VMs that a Terminate/Preempt removed and concludes their
        events, concludes events whose VMs fell silent, retries approvals and alerts that failed, and notices VMs
        whose heartbeat stopped."""
        now = self.clock()
        report = TickReport()
        work = _Work()
        groups = self.store.all_vm_groups()
        last_seen: dict[str, datetime] = {}
        for group in groups:
            for vm in group.record.vms.values():
                last_seen[vm.identity.name] = max(vm.lastSeen, last_seen.get(vm.identity.name, vm.lastSeen))
        silent = frozenset(name for name, seen in last_seen.items() if seen < now - self.heartbeat_timeout)
        fleet = _Fleet(self.store)
        by_key = {g.record.group: g for g in groups}
        stored_open = self.store.open_events()
        fleet.seed([s.record for s in stored_open])
        open_events = self._assemble({s.record.eventId: s for s in stored_open}, by_key)
        report.open_events = len(open_events)
        groups = self._retire(
            groups, removals([s.record for s in open_events.values()], last_seen, now, self.retire_grace), now, work
        )
        retired = {vm.identity.name: vm.retired.eventId for g in groups for vm in g.record.vms.values() if vm.retired}
        report.vms_retired = sum(1 for row in work.rows if row.Outcome == "retired")
        logs = self.store.sent_alert_logs()
        settled: dict[str, list[str]] = defaultdict(list)
        for _, entry in logs:
            for event_id, kinds in entry.events.items():
                settled[event_id].extend(kinds)
        changes: list[EventChange] = []
        for stored in open_events.values():
            record = stored.record
            try:
                change = self._commit_one(
                    record.eventId, lambda r: self._reconsider(r, now, fleet, silent, retired), report, read=stored
                )
            except ConcurrencyConflict:
                log.warning("event %s: contended; the next tick tries again", record.eventId)
                continue
            if change is not None:
                report.events_changed += 1
                self._collect(change, work)
                changes.append(change)
                fleet.note(change.record)
                record = change.record
            approval = record.approval
            if (
                approval is not None
                and not approval.delivered
                and record.state == "Scheduled"
                and approval.nextAttemptAt is not None
                and approval.nextAttemptAt <= now
                and record.eventId not in work.deliveries
            ):
                if approval.attempts == 0 and not approval.outcome:
                    work.rows.append(_unknown_outcome_row(record, approval, now))
                work.deliveries.append(record.eventId)
            self._pending_alerts(record, now, work, settled)
        report.events_changed += self._release_held(changes, now, fleet, work)
        for stored in self.store.closed_events_with_pending_alerts():
            self._pending_alerts(stored.record, now, work, settled)
        self._heartbeats(groups, now, work, report)
        self._run_housekeeping(groups, now, report)
        self._act(work, now, report, last_seen=last_seen, settled=settled, fleet=fleet)
        if logs:
            self.store.delete_sent_alert_logs([key for key, _ in logs])
        return report

    def _reconsider(
        self, record: EventRecord | None, now: datetime, fleet: _Fleet, silent: frozenset[str], retired: dict[str, str]
    ) -> EventChange | None:
        if record is None:
            return None
        change = EventChange(record=clone(record))
        advance(change, now, silent_vms=silent, retired=retired)
        if record.eventType == "Terminate" and record.approval is not None and record.approval.delivered:
            self._update_hold(change, fleet.deletes().values(), now)
        self._decide(change, now, fleet)
        return change

    def _retire(
        self, groups: list[Stored[VmGroupRecord]], found: list[Removal], now: datetime, work: _Work
    ) -> list[Stored[VmGroupRecord]]:
        """Marks each removed VM as gone, with the event that removed it (a Heartbeat row, Outcome retired): no
        'heartbeat lost' for it, its events conclude, its hybrid connection goes with the next housekeeping.
        Returns the groups as written (a group another instance changed meanwhile is left for the next tick)."""
        if not found:
            return groups
        by_name = {r.vm: r for r in found}
        out = []
        for stored in groups:
            retiring = {
                vm_id: vm.model_copy(
                    update={
                        "retired": Retirement(
                            eventId=by_name[vm.identity.name].event_id,
                            eventType=by_name[vm.identity.name].event_type,
                            at=now,
                            reason=by_name[vm.identity.name].reason,
                        )
                    }
                )
                for vm_id, vm in stored.record.vms.items()
                if vm.retired is None and vm.identity.name in by_name
            }
            if not retiring:
                out.append(stored)
                continue
            updated = stored.record.model_copy(update={"vms": {**stored.record.vms, **retiring}})
            try:
                etag = self.store.save_vm_group(updated, stored.etag, vm_ids=retiring)
            except ConcurrencyConflict:
                out.append(stored)  # a VM of the group reported meanwhile: decided again next tick
                continue
            out.append(Stored(updated, etag))
            for vm in retiring.values():
                assert vm.retired is not None
                row = self._vm_row(vm, now, vm.retired.reason)
                work.rows.append(
                    row.model_copy(
                        update={"Outcome": "retired", "EventId": vm.retired.eventId, "EventType": vm.retired.eventType}
                    )
                )
        return out

    @staticmethod
    def _pending_alerts(record: EventRecord, now: datetime, work: _Work, settled: dict[str, list[str]]) -> None:
        """The outbox: cards recorded but not sent (a failed send, or a crash after the write), once the sender
        has had ALERT_GRACE to do it. Cards a batch logged as sent are only cleared."""
        if not record.pendingAlerts or (record.pendingSince is not None and record.pendingSince > now - ALERT_GRACE):
            return
        queued: set[str] = {kind for event_id, kind in work.alerts if event_id == record.eventId}
        queued.update(settled.get(record.eventId, ()))
        for kind in record.pendingAlerts:
            if kind in _TITLED_KINDS and kind not in queued:
                work.alerts.append((record.eventId, kind))  # type: ignore[arg-type]
        work.records.setdefault(record.eventId, record)

    def _heartbeats(self, groups: list[Stored[VmGroupRecord]], now: datetime, work: _Work, report: TickReport) -> None:
        timeout = int(self.heartbeat_timeout.total_seconds())
        for stored in groups:
            lost = {
                vm_id: vm.model_copy(update={"heartbeatLost": True})
                for vm_id, vm in stored.record.vms.items()
                if not vm.heartbeatLost and vm.retired is None and vm.lastSeen < now - self.heartbeat_timeout
            }
            if not lost:
                continue
            updated = stored.record.model_copy(update={"vms": {**stored.record.vms, **lost}})
            try:
                self.store.save_vm_group(updated, stored.etag, vm_ids=lost)
            except ConcurrencyConflict:
                continue  # a VM of the group reported meanwhile, or another instance noticed first: next tick
            for vm in lost.values():
                report.heartbeats_lost += 1
                work.rows.append(self._vm_row(vm, now, f"no envelope for more than {timeout} s"))
                try:
                    self.alerts.send(
                        build_vm_card("heartbeat-lost", vm, now=now, timeout_seconds=timeout),
                        key=f"{vm.identity.vmId}-heartbeat-lost-{vm.lastSeen.strftime('%Y%m%dT%H%M%S')}",
                    )
                    report.alerts_sent += 1
                except AlertError as error:
                    log.warning("heartbeat alert for %s not delivered: %s", vm.identity.name, error)

    def _run_housekeeping(self, groups: list[Stored[VmGroupRecord]], now: datetime, report: TickReport) -> None:
        """Hourly, not every tick: deletes concluded events older than the retention, and lists ARM resources (the
        VMs' hybrid connections) to delete the stale ones."""
        if self._housekeeping_due is not None and now < self._housekeeping_due:
            return
        self._housekeeping_due = now + self._housekeeping_interval
        try:
            old = self.store.concluded_events_before(now - self.retention)
            report.events_purged = self.store.delete_events([(s.record.eventId, s.etag) for s in old])
        except Exception:  # never let cleanup stop the timer's real work; it runs again next hour
            log.exception("purging concluded events failed")
        if self._housekeeping is None:
            return
        last_seen: dict[str, datetime] = {}
        for group in groups:
            for vm in group.record.vms.values():
                if vm.retired is not None:
                    continue  # left out: a connection the fleet does not know is deleted (hybrid_connections_to_delete)
                name = vm.identity.hybrid_connection_name
                last_seen[name] = max(vm.lastSeen, last_seen.get(name, vm.lastSeen))
        try:
            self._housekeeping(last_seen, now)
        except Exception:  # never let cleanup stop the timer's real work; it runs again next hour
            log.exception("housekeeping failed")

    @staticmethod
    def _vm_row(vm: VmRecord, now: datetime, reason: str) -> HistoryRow:
        identity = vm.identity
        return HistoryRow(
            TimeGenerated=now,
            RecordType="Heartbeat",
            VmName=identity.name,
            VmId=identity.vmId,
            VmResourceId=identity.resourceId,
            ScaleSetName=identity.vmScaleSetName,
            PlacementGroupId=identity.placementGroupId,
            ObservedAt=vm.lastSeen,
            Sequence=vm.lastSequence,
            DocumentIncarnation=vm.lastIncarnation,
            Outcome="lost" if vm.heartbeatLost else "resumed",
            Reason=reason,
        )

    # ---- people ----------------------------------------------------------------------------------------------
    def approve_manually(self, event_id: str, *, person: str) -> ManualApproval:
        now = self.clock()
        stored = self.event(event_id)
        if stored is None:
            return ManualApproval("not-found", f"no event {event_id!r} is known")
        if stored.record.state != "Scheduled":
            return ManualApproval(
                "conflict", f"event {event_id} is {stored.record.state}; only Scheduled can be approved"
            )
        if stored.record.approval is not None and stored.record.approval.delivered:
            return ManualApproval(
                "approved", f"event {event_id} was already approved by {stored.record.approval.actor}"
            )

        def decide(record: EventRecord | None) -> EventChange | None:
            if record is None or record.state != "Scheduled":
                return None
            if record.approval is not None and record.approval.delivered:
                return None
            record = clone(record)
            change = EventChange(record=record, changed=True)
            decision_id = uuid.uuid4().hex
            actor = f"person:{person}"
            record.decision = DecisionRecord(
                decisionId=decision_id,
                rule="manual",
                action="manual-approval",
                verdict="approve",
                reason=f"approved by {person} through the coordinator's HTTP endpoint",
                decidedAt=now,
                dryRun=self.dry_run,
                actor=actor,
            )
            change.rows.append(self._decision_row(record, now))
            if self.dry_run:  # recorded as the person's decision; nothing is ever sent in dry-run
                return change
            record.approval = ApprovalRecord(
                decisionId=decision_id,
                rule="manual",
                actor=actor,
                decidedAt=now,
                nextAttemptAt=now + IN_FLIGHT_GRACE,
            )
            return change

        report = TickReport()
        work = _Work()
        change = self._commit_one(event_id, decide)
        if change is None:
            current = self.event(event_id)
            state = current.record.state if current else "gone"
            return ManualApproval("conflict", f"event {event_id} changed meanwhile (now {state}); nothing sent")
        work.rows.extend(change.rows)
        if not self.dry_run:  # in dry-run only the person's decision is logged (by _act, with nothing to send)
            work.deliveries.append(event_id)
        self._act(work, now, report, last_seen=None)
        current = self.event(event_id)
        summary = self.summarize(current.record) if current else None
        approved = current is not None and current.record.approval is not None and current.record.approval.delivered
        status: Literal["dry-run", "approved", "sent"]
        if self.dry_run:
            status, message = "dry-run", f"dry run: {person}'s approval of {event_id} recorded, nothing sent"
        elif approved:
            status, message = "approved", f"event {event_id} approved by {person}"
        else:
            status, message = "sent", f"approval of {event_id} decided; delivery is retried until NotBefore"
        return ManualApproval(status, message, summary)

    def summarize(self, record: EventRecord) -> dict[str, Any]:
        return {
            "eventId": record.eventId,
            "eventType": record.eventType,
            "eventSource": record.eventSource,
            "state": record.state,
            "stateSince": record.stateSince.isoformat(),
            "notBefore": record.notBefore.isoformat() if record.notBefore else None,
            "durationInSeconds": record.durationInSeconds,
            "resources": record.resources,
            "reportingVms": sorted(record.vms),
            "goneFrom": sorted(n for n, s in record.vms.items() if s.status == "Gone"),
            "decision": record.decision.model_dump(mode="json") if record.decision else None,
            "approval": record.approval.model_dump(mode="json") if record.approval else None,
            "heldBy": _held_by(record),
            "failedHooks": {name: dict(s.failedHooks) for name, s in sorted(record.vms.items()) if s.failedHooks},
            "removed": list(record.removed),
            "approveUrl": self._approve_url(record.eventId) if self._approve_url else None,
        }

    def pending(self) -> list[dict[str, Any]]:
        """Open events (not Completed/Canceled), oldest NotBefore first."""
        groups = {g.record.group: g for g in self.store.all_vm_groups()}
        assembled = self._assemble({s.record.eventId: s for s in self.store.open_events()}, groups)
        records = [s.record for s in assembled.values()]
        far = datetime.max.replace(tzinfo=UTC)
        records.sort(key=lambda r: (r.notBefore or far, r.eventId))
        return [self.summarize(r) for r in records]


# Every kind a card can be built for: a pending entry of any other string (a record written by a newer coordinator)
# is left alone rather than sent as a card this code cannot title.
_TITLED_KINDS: frozenset[str] = frozenset(get_args(AlertKind))


def _approval_row(
    record: EventRecord, approval: ApprovalRecord, now: datetime, *, vm: str, **values: Any
) -> HistoryRow:
    """An ``Approval`` history row: the event's and the approval's columns, then ``values`` (outcome, reason)."""
    columns: dict[str, Any] = {
        "TimeGenerated": now,
        "RecordType": "Approval",
        "EventId": record.eventId,
        "EventType": record.eventType,
        "EventSource": record.eventSource,
        "State": record.state,
        "NotBefore": record.notBefore,
        "VmName": vm,
        "Rule": approval.rule,
        "DecisionId": approval.decisionId,
        "Actor": approval.actor,
    }
    return HistoryRow.model_validate(columns | values)


def _aggregate(record: EventRecord) -> str:
    """The part of a record that lives in the event entity (sightings live with the VMs)."""
    return record.model_dump_json(exclude={"vms"})


def _clear_alerts_pending(record: EventRecord | None, kinds: list[str]) -> EventChange | None:
    if record is None or not set(kinds) & set(record.pendingAlerts):
        return None
    record = clone(record)
    record.pendingAlerts = [k for k in record.pendingAlerts if k not in kinds]
    if not record.pendingAlerts:
        record.pendingSince = None
    return EventChange(record=record, changed=True)


def _held_by(record: EventRecord) -> dict[str, Any] | None:
    """What holds the event back, in words and by EventId: the platform (an approved delete waiting for another
    pending delete of its scale set) or the coordinator (a ready delete waiting for its siblings to be ready)."""
    if record.open and record.platformHold is not None:
        hold = record.platformHold
        return {
            "by": "platform",
            "eventId": hold.eventId,
            "vm": hold.vm,
            "until": hold.until.isoformat() if hold.until else None,
            "reason": hold.describe(),
        }
    decision = record.decision
    if record.state == "Scheduled" and record.approval is None and decision is not None and decision.heldBy:
        return {
            "by": "coordinator",
            "eventId": decision.heldBy,
            "vm": decision.heldByVm,
            "until": decision.heldUntil.isoformat() if decision.heldUntil else None,
            "reason": decision.reason,
        }
    return None


def _unknown_outcome_row(record: EventRecord, approval: ApprovalRecord, now: datetime) -> HistoryRow:
    return event_row(
        record,
        now,
        "Approval",
        Rule=approval.rule,
        DecisionId=approval.decisionId,
        Actor=approval.actor,
        Outcome="unknown",
        Reason=(
            f"approval decided at {approval.decidedAt.isoformat()} has no recorded outcome (the sender stopped before "
            "recording it); sent again with the same decisionId (the listener answers a repeat without approving twice)"
        ),
    )


def _alert_row(record: EventRecord, kind: str, now: datetime, outcome: str, reason: str) -> HistoryRow:
    return HistoryRow(
        TimeGenerated=now,
        RecordType="Alert",
        EventId=record.eventId,
        EventType=record.eventType,
        EventSource=record.eventSource,
        State=record.state,
        Action=kind,
        Actor="teams",
        Outcome=outcome,
        Reason=reason,
    )
