"""The forwarder's durable state: the spool of unsent envelopes, the sequence counter, the last document, the
hook ledger, the listener's decision ledger and counters — one SQLite file in WAL mode.

Why SQLite rather than segment files: an incarnation change must, all at once or not at all, take the next
sequence number, spool its envelope, remember the document and queue its hooks. One SQLite transaction gives
exactly that across kill -9 and power loss (WAL + synchronous=FULL), it ships with Python (nothing to install on
the VM), and writes happen only on a change, a heartbeat or a hook report, never per poll, so its cost is nil.
Delivery is at-least-once: an envelope sent but not yet acknowledged when the process dies is sent again with
the same sequence, which the consumer uses to drop the duplicate.

A full disk is not a crash: a write that finds the file system full raises `StoreFull` (SQLite's SQLITE_FULL,
ENOSPC) after rolling back, and the store keeps how long and how often (`full_since`, `write_errors`,
`last_error`) for the heartbeats. The callers back off and try again; nothing they meant to write is lost (the
poll loop re-reads the change from IMDS, the hook worker keeps its report). Heartbeats still go out: a block of
`SEQUENCE_RESERVE` sequence numbers is kept reserved on disk ahead of the last one used, and `take_unspooled()`
hands them out without writing. The marker file `<spool>.reserve-unused` says none was: a restart that finds it
gone starts after the reserve, so no sequence is ever used twice (deleting a file needs no space).
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from forwarder import state_schema
from forwarder.decisions import DECISION_LEDGER_ENTRIES, DECISION_LEDGER_KEEP, DecisionStatus, LedgerEntry
from forwarder.logs import fields

log = logging.getLogger("forwarder.durable_state")

# A finished hook is remembered this long, far longer than any event stays in a document.
HOOK_LEDGER_DAYS = 30
KEEP_REJECTS = 100
STATE_ID = "state_id"
SEQUENCE = "sequence"
# The first sequence a restart may use when the marker is gone: what the reserve may have handed out is skipped.
SEQUENCE_RESERVED = "sequence_reserved"
# Heartbeats are due every minute: a reserve of 64 reports an hour of a full disk, and costs a write every 32
# envelopes (and a gap of at most 64 in the sequence after a full disk, which the coordinator takes as it comes).
SEQUENCE_RESERVE = 64
# forwarder/impact.py's watch of a Reboot or Redeploy of this VM (JSON; "" when none): the event and the last poll
# before the VM went down, which must outlive the reboot to measure its downtime.
IMPACT_RESTART = "impact.restart"
# forwarder/impact.py's last sign of life that outlives a reboot (ISO time of the last poll, written at each heartbeat
# and at a clean stop): the lower bound of a downtime whose event this VM never saw listed before it went down.
IMPACT_ALIVE = "impact.alive"
# StoreFull.last_error's bound (ForwarderHealth.lastStateError).
STATE_ERROR_CHARS = 256


class StoreFull(Exception):
    """The state directory's file system is full: nothing of the write was kept; try again later."""


def _is_full(error: BaseException) -> bool:
    if isinstance(error, sqlite3.OperationalError):
        return getattr(error, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "disk is full" in str(error)
    return isinstance(error, OSError) and error.errno == errno.ENOSPC


@dataclass(frozen=True)
class SpooledEnvelope:
    id: int
    sequence: int
    kind: str
    body: bytes
    # W3C trace context to send with the envelope (Event Hubs application properties); "" when none.
    traceparent: str = ""
    tracestate: str = ""


@dataclass(frozen=True)
class HookJob:
    event_id: str
    phase: str
    event: str  # the event as JSON, exactly what the hook gets on stdin
    # While the phase runs: the hook running now and the steps (HookStep JSON list) finished before it, so that
    # a phase cut short by a crash is reported with what did run and the hook that was interrupted.
    step: str = ""
    steps: str = "[]"
    # W3C trace context of the change that queued the phase ("" for none).
    traceparent: str = ""
    tracestate: str = ""


class Store:
    """Thread-safe (one connection behind a lock; every call is short)."""

    def __init__(self, path: Path, *, max_entries: int = 10_000) -> None:
        if max_entries < 1:
            raise ValueError("spool max_entries must be at least 1")
        self.path = path
        self.max_entries = max_entries
        self._lock = threading.Lock()
        # What the heartbeats say of the writes: full since when (None: writable), failures since the start.
        self.full_since: datetime | None = None
        self.write_errors = 0
        self.last_error = ""
        self._marker = path.with_name(path.name + ".reserve-unused")
        # Run under the lock once the transaction that queued them has committed (never after a rollback).
        self._on_commit: list[Callable[[], None]] = []
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(state_schema.SCHEMA)
        except (sqlite3.OperationalError, OSError) as error:
            if _is_full(error):
                raise StoreFull(f"cannot open the state at {path}: {error}") from error
            raise
        with self._tx() as db:
            state_schema.migrate(db)
            # Created with the database and kept in it: a wiped or re-created state directory gets a new one,
            # which is how the coordinator tells "this forwarder lost its state" from a replay of old sequences.
            # 128 random bits as uuid4().hex gave them, without the uuid module (it and libuuid stay resident).
            db.execute("INSERT OR IGNORE INTO state (key, value) VALUES (?, ?)", (STATE_ID, os.urandom(16).hex()))
            self.state_id = str(self._get(db, STATE_ID))
            sequence = int(self._get(db, SEQUENCE) or 0)
            reserved = int(self._get(db, SEQUENCE_RESERVED) or 0)
        # The next sequence, whether spooled or handed out unspooled; the first one the disk does not reserve.
        self._next = reserved if reserved > sequence and not self._marker.exists() else sequence
        self._reserved = max(reserved, self._next)
        if self._next != sequence:
            log.warning(
                "the last run handed out reserved sequences while the disk was full; starting after them",
                extra=fields(sequence=self._next, skipped=self._next - sequence),
            )
        try:
            with self._tx() as db:
                self._top_up(db, self._next)
        except StoreFull:
            log.error("the state directory is full; the spool cannot be written until there is room")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction. A full file system raises StoreFull (rolled back) and is counted; the first
        write that succeeds after it clears ``full_since``."""
        with self._lock:
            self._on_commit.clear()
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    yield self._db
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
                self._db.execute("COMMIT")
            except (sqlite3.OperationalError, OSError) as error:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                if not _is_full(error):
                    raise
                self.write_errors += 1
                self.last_error = f"{type(error).__name__}: {error}"[:STATE_ERROR_CHARS]
                if self.full_since is None:
                    self.full_since = datetime.now(UTC)
                    log.error("the state directory is full: writes are retried", extra=fields(error=str(error)))
                raise StoreFull(str(error)) from error
            for action in self._on_commit:
                action()
            if self.full_since is not None:
                log.info("the state directory can be written again", extra=fields(full_since=str(self.full_since)))
                self.full_since = None

    def _top_up(self, db: sqlite3.Connection, sequence: int) -> None:
        """Within a write that makes ``sequence`` the next one: keeps the reserve ahead of it and, once that is
        committed, the marker that says none of the reserve was handed out (true again now that the next sequence
        is durable past all that was)."""
        self._put(db, SEQUENCE, str(sequence))
        reserved = self._reserved
        if reserved < sequence + SEQUENCE_RESERVE // 2:
            reserved = sequence + SEQUENCE_RESERVE
            self._put(db, SEQUENCE_RESERVED, str(reserved))

        def committed() -> None:
            self._next, self._reserved = sequence, reserved
            try:
                if not self._marker.exists():
                    self._marker.touch()
                    _sync_directory(self._marker.parent)
            except OSError as error:  # no marker: a restart skips the reserve, which is always safe
                log.warning("the reserve marker could not be written", extra=fields(error=str(error)))

        self._on_commit.append(committed)

    def take_unspooled(self) -> int | None:
        """A sequence number for an envelope sent without being spooled (a heartbeat while the disk is full), from
        the reserve; None when it is used up. Writes nothing: it deletes the marker, which a restart reads."""
        with self._lock:
            if self._next >= self._reserved:
                return None
            try:
                self._marker.unlink(missing_ok=True)
                _sync_directory(self._marker.parent)
            except OSError:
                return None  # not known to be durable: no sequence outside the spool
            sequence = self._next
            self._next += 1
            return sequence

    # --- state -----------------------------------------------------------------------------------------------
    def _get(self, db: sqlite3.Connection, key: str) -> str | None:
        row = db.execute("SELECT value FROM state WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    @staticmethod
    def _put(db: sqlite3.Connection, key: str, value: str) -> None:
        db.execute(
            "INSERT INTO state (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = ?", (key, value, value)
        )

    def get_state(self, key: str) -> str | None:
        with self._lock:
            return self._get(self._db, key)

    def put_state(self, key: str, value: str) -> None:
        """Keeps one value of the state, durably (raises StoreFull without room)."""
        with self._tx() as db:
            self._put(db, key, value)

    def _bump(self, db: sqlite3.Connection, counter: str, by: int = 1) -> None:
        current = int(self._get(db, f"counter.{counter}") or 0)
        self._put(db, f"counter.{counter}", str(current + by))

    def counters(self) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute("SELECT key, value FROM state WHERE key LIKE 'counter.%'").fetchall()
        return {str(k).removeprefix("counter."): int(v) for k, v in rows}

    # --- spool -----------------------------------------------------------------------------------------------
    def enqueue(
        self,
        kind: str,
        build: Callable[[int], bytes],
        *,
        state: dict[str, str] | None = None,
        hooks: Sequence[HookJob] = (),
        hook_done: tuple[str, str] | None = None,
        hook_outcome: str = "",
        traceparent: str = "",
        tracestate: str = "",
    ) -> int:
        """Spool one envelope under the next sequence number, in the same transaction as the state it implies
        (the last document, the hooks it queues, the hook run it reports). Returns the sequence.

        `build(sequence)` renders the envelope; `traceparent`/`tracestate` are kept and sent with it. A full
        spool drops envelopes, loudly: heartbeats first (oldest first), since the next heartbeat says all an
        older one said; then the oldest of the others.
        """
        with self._tx() as db:
            # Past any sequence handed out unspooled meanwhile (the database's own may be behind it).
            sequence = max(int(self._get(db, SEQUENCE) or 0), self._next)
            db.execute(
                "INSERT INTO spool (sequence, kind, body, traceparent, tracestate) VALUES (?, ?, ?, ?, ?)",
                (sequence, kind, build(sequence), traceparent, tracestate),
            )
            self._top_up(db, sequence + 1)
            for key, value in (state or {}).items():
                self._put(db, key, value)
            now = datetime.now(UTC).isoformat()
            for job in hooks:
                db.execute(
                    "INSERT OR IGNORE INTO hooks (event_id, phase, status, event, updated_at, traceparent, tracestate)"
                    " VALUES (?, ?, 'pending', ?, ?, ?, ?)",
                    (job.event_id, job.phase, job.event, now, job.traceparent, job.tracestate),
                )
            if hook_done is not None:
                db.execute(
                    "UPDATE hooks SET status = 'done', outcome = ?, updated_at = ? WHERE event_id = ? AND phase = ?",
                    (hook_outcome, now, *hook_done),
                )
            depth = int(db.execute("SELECT COUNT(*) FROM spool").fetchone()[0])
            excess = depth - self.max_entries
            if excess > 0:
                # No DELETE ... RETURNING: older VM images ship SQLite < 3.35.
                dropped = db.execute(
                    "SELECT id, sequence, kind FROM spool ORDER BY kind != 'heartbeat', id LIMIT ?", (excess,)
                ).fetchall()
                db.executemany("DELETE FROM spool WHERE id = ?", [(r[0],) for r in dropped])
                self._bump(db, "spool_dropped", len(dropped))
                log.error(
                    "spool full: dropped unsent envelopes (heartbeats first, then the oldest)",
                    extra=fields(
                        dropped=len(dropped),
                        sequences=[int(r[1]) for r in dropped[:10]],
                        kinds=sorted({str(r[2]) for r in dropped}),
                        max_entries=self.max_entries,
                    ),
                )
        return sequence

    def peek(self, limit: int) -> list[SpooledEnvelope]:
        """The oldest unsent envelopes, in order."""
        with self._lock:
            rows = self._db.execute(
                "SELECT id, sequence, kind, body, traceparent, tracestate FROM spool ORDER BY id LIMIT ?", (limit,)
            ).fetchall()
        return [SpooledEnvelope(int(r[0]), int(r[1]), str(r[2]), bytes(r[3]), str(r[4]), str(r[5])) for r in rows]

    def ack(self, items: Sequence[SpooledEnvelope]) -> None:
        if not items:
            return
        with self._tx() as db:
            db.executemany("DELETE FROM spool WHERE id = ?", [(item.id,) for item in items])

    def depth(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM spool").fetchone()[0])

    # --- hooks -----------------------------------------------------------------------------------------------
    def hook_jobs(self, status: str) -> list[HookJob]:
        with self._lock:
            rows = self._db.execute(
                "SELECT event_id, phase, event, step, steps, traceparent, tracestate FROM hooks WHERE status = ?"
                " ORDER BY rowid",
                (status,),
            ).fetchall()
        return [HookJob(*(str(value) for value in row)) for row in rows]

    def mark_hook_running(self, job: HookJob, *, step: str = "", steps: str = "[]") -> None:
        """Recorded before the phase starts and before each of its hooks (`step`, after the finished `steps`): a
        forwarder killed mid-phase reports it interrupted, naming the hook, and never reruns it."""
        with self._tx() as db:
            db.execute(
                "UPDATE hooks SET status = 'running', updated_at = ?, step = ?, steps = ?"
                " WHERE event_id = ? AND phase = ?",
                (datetime.now(UTC).isoformat(), step, steps, job.event_id, job.phase),
            )

    def hook_status(self, event_id: str, phase: str) -> str | None:
        with self._lock:
            row = self._db.execute(
                "SELECT status FROM hooks WHERE event_id = ? AND phase = ?", (event_id, phase)
            ).fetchone()
        return None if row is None else str(row[0])

    def hook_outcome(self, event_id: str, phase: str) -> str | None:
        """The phase's reported outcome once it is done (what the listener checks before it approves on the
        strength of this VM's hooks); None while it is pending, running or unknown."""
        with self._lock:
            row = self._db.execute(
                "SELECT outcome FROM hooks WHERE event_id = ? AND phase = ? AND status = 'done'", (event_id, phase)
            ).fetchone()
        return None if row is None or not row[0] else str(row[0])

    def prune_hooks(self, *, now: datetime | None = None) -> int:
        """Forget finished phases older than HOOK_LEDGER_DAYS. Cheap: the ledger holds two rows per event at most."""
        cutoff = ((now or datetime.now(UTC)) - timedelta(days=HOOK_LEDGER_DAYS)).isoformat()
        with self._tx() as db:
            return db.execute("DELETE FROM hooks WHERE status = 'done' AND updated_at < ?", (cutoff,)).rowcount

    # --- the listener's decision ledger ------------------------------------------------------------------------
    def decision(self, decision_id: str) -> LedgerEntry | None:
        with self._lock:
            row = self._db.execute(
                "SELECT decision_id, event_id, status, at, result FROM decisions WHERE decision_id = ?", (decision_id,)
            ).fetchone()
        if row is None:
            return None
        status: DecisionStatus = row[2]
        return LedgerEntry(str(row[0]), str(row[1]), status, datetime.fromisoformat(str(row[3])), str(row[4]))

    def remember_decision(
        self, entry: LedgerEntry, *, keep: timedelta = DECISION_LEDGER_KEEP, max_entries: int = DECISION_LEDGER_ENTRIES
    ) -> None:
        """Records (or replaces) the entry, durably before it returns, and forgets entries older than ``keep`` and
        beyond the newest ``max_entries``."""
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO decisions (decision_id, event_id, status, at, result) VALUES (?, ?, ?, ?, ?)",
                (entry.decision_id, entry.event_id, entry.status, entry.at.astimezone(UTC).isoformat(), entry.result),
            )
            cutoff = (entry.at - keep).astimezone(UTC).isoformat()
            db.execute("DELETE FROM decisions WHERE at < ?", (cutoff,))
            db.execute(
                "DELETE FROM decisions WHERE decision_id IN (SELECT decision_id FROM decisions ORDER BY at DESC"
                " LIMIT -1 OFFSET ?)",
                (max_entries,),
            )

    def forget_decision(self, decision_id: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM decisions WHERE decision_id = ?", (decision_id,))

    # --- bad input -------------------------------------------------------------------------------------------
    def reject(self, reason: str, body: bytes, *, counter: str = "invalid_documents") -> None:
        """Set a bad item aside (the last few are kept for inspection) and count it."""
        with self._tx() as db:
            db.execute(
                "INSERT INTO rejects (at, reason, body) VALUES (?, ?, ?)",
                (datetime.now(UTC).isoformat(), reason, body[:65536]),
            )
            db.execute("DELETE FROM rejects WHERE id <= (SELECT MAX(id) FROM rejects) - ?", (KEEP_REJECTS,))
            self._bump(db, counter)

    def rejects(self) -> list[tuple[str, bytes]]:
        with self._lock:
            rows = self._db.execute("SELECT reason, body FROM rejects ORDER BY id").fetchall()
        return [(str(r[0]), bytes(r[1])) for r in rows]


def _sync_directory(directory: Path) -> None:
    """Makes a file's creation or removal in ``directory`` durable before anything relies on it."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def open_store(path: Path, *, max_entries: int, stop: threading.Event, first_delay: float = 1.0) -> Store | None:
    """The store, opened once the file system has room for it (a full disk is waited out with backoff, not a
    crash loop); None when ``stop`` was set first."""
    delay = first_delay
    while not stop.is_set():
        try:
            return Store(path, max_entries=max_entries)
        except StoreFull as error:
            log.error("the state directory is full; opening again later", extra=fields(error=str(error), delay=delay))
            stop.wait(delay)
            delay = min(delay * 2, 60.0)
    return None
