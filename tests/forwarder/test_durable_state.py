"""The SQLite spool and state: order, sequence across reopen, bounded with a counter, hook ledger, a full disk."""

from __future__ import annotations

import logging
import sqlite3
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from forwarder import durable_state
from forwarder.decisions import DECISION_LEDGER_KEEP, LedgerEntry
from forwarder.durable_state import (
    HOOK_LEDGER_DAYS,
    SEQUENCE_RESERVE,
    HookJob,
    SpooledEnvelope,
    Store,
    StoreFull,
)
from tests.forwarder.conftest import fill_disk


def body(sequence: int) -> bytes:
    return f'{{"sequence":{sequence}}}'.encode()


def test_sequence_strictly_increases_across_reopen(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite")
    assert [store.enqueue("heartbeat", body) for _ in range(3)] == [0, 1, 2]
    store.close()
    store = Store(tmp_path / "s.sqlite")
    assert store.enqueue("heartbeat", body) == 3
    assert [item.sequence for item in store.peek(10)] == [0, 1, 2, 3]
    assert [item.body for item in store.peek(10)] == [body(s) for s in range(4)]


def test_ack_removes_only_what_was_sent(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite")
    for _ in range(5):
        store.enqueue("heartbeat", body)
    store.ack(store.peek(2))
    assert [item.sequence for item in store.peek(10)] == [2, 3, 4]
    assert store.depth() == 3


def test_full_spool_drops_heartbeats_first_then_the_oldest(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = Store(tmp_path / "s.sqlite", max_entries=4)
    kinds = ["incarnation", "heartbeat", "hook", "heartbeat", "incarnation"]
    with caplog.at_level(logging.ERROR, logger="forwarder.durable_state"):
        for kind in kinds:
            store.enqueue(kind, body)
        assert [(i.sequence, i.kind) for i in store.peek(10)] == [
            (0, "incarnation"), (2, "hook"), (3, "heartbeat"), (4, "incarnation")
        ]  # fmt: skip
        store.enqueue("heartbeat", body)  # full of others but one heartbeat: the older heartbeat goes
        assert [i.sequence for i in store.peek(10)] == [0, 2, 4, 5]
        store.enqueue("heartbeat", body)  # the new heartbeat is itself the one to go
        assert [i.sequence for i in store.peek(10)] == [0, 2, 4, 6]
        store.enqueue("hook", body)  # the last heartbeat goes, then ...
        store.enqueue("hook", body)  # ... with no heartbeat left, the oldest envelope of any kind
        assert [i.sequence for i in store.peek(10)] == [2, 4, 7, 8]
    assert store.counters()["spool_dropped"] == 5
    lines = [r for r in caplog.records if "spool full" in r.getMessage()]
    assert [r.fields["kinds"] for r in lines] == [["heartbeat"]] * 4 + [["incarnation"]]  # type: ignore[attr-defined]


def test_full_spool_drops_the_oldest_loudly_and_counts(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = Store(tmp_path / "s.sqlite", max_entries=3)
    with caplog.at_level(logging.ERROR, logger="forwarder.durable_state"):
        for _ in range(5):
            store.enqueue("heartbeat", body)
    assert [item.sequence for item in store.peek(10)] == [2, 3, 4]
    assert store.counters()["spool_dropped"] == 2
    dropped_lines = [r for r in caplog.records if "spool full" in r.getMessage()]
    assert len(dropped_lines) == 2
    assert dropped_lines[0].fields["sequences"] == [0]  # type: ignore[attr-defined]


def test_state_and_hooks_commit_with_the_envelope(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite")

    def broken(_sequence: int) -> bytes:
        raise RuntimeError("render failed")

    with pytest.raises(RuntimeError):
        store.enqueue("incarnation", broken, state={"last_document": "x"}, hooks=[HookJob("E1", "prepare", "{}")])
    assert store.get_state("last_document") is None
    assert store.hook_jobs("pending") == []
    assert store.enqueue("incarnation", body) == 0  # the failed attempt used no sequence number


def test_a_hook_is_queued_once_per_event_and_phase(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite")
    job = HookJob("E1", "prepare", '{"EventId":"E1"}')
    store.enqueue("incarnation", body, hooks=[job])
    store.mark_hook_running(job)
    store.enqueue("hook", body, hook_done=("E1", "prepare"))
    store.enqueue("incarnation", body, hooks=[job, HookJob("E1", "recover", "{}")])
    assert store.hook_status("E1", "prepare") == "done"
    assert [(j.event_id, j.phase) for j in store.hook_jobs("pending")] == [("E1", "recover")]


def test_the_ledger_keeps_each_phases_outcome_for_the_listener(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite")
    job = HookJob("E1", "prepare", '{"EventId":"E1"}')
    store.enqueue("incarnation", body, hooks=[job])
    assert store.hook_outcome("E1", "prepare") is None  # pending: not finished, so nothing to rest a decision on
    store.mark_hook_running(job)
    assert store.hook_outcome("E1", "prepare") is None
    store.enqueue("hook", body, hook_done=("E1", "prepare"), hook_outcome="failed")
    assert store.hook_outcome("E1", "prepare") == "failed"
    assert store.hook_outcome("E1", "recover") is None
    store.close()
    assert Store(tmp_path / "s.sqlite").hook_outcome("E1", "prepare") == "failed"  # kept across a restart


def test_rejects_are_kept_bounded_and_counted(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite")
    for index in range(105):
        store.reject(f"bad {index}", b"{")
    assert store.counters()["invalid_documents"] == 105
    kept = store.rejects()
    assert len(kept) == 100
    assert kept[-1][0] == "bad 104"


def test_max_entries_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_entries"):
        Store(tmp_path / "s.sqlite", max_entries=0)


def test_the_state_id_is_born_with_the_database_and_kept_in_it(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite")
    state_id = store.state_id
    assert len(state_id) == 32
    int(state_id, 16)
    store.close()
    assert Store(tmp_path / "s.sqlite").state_id == state_id
    assert Store(tmp_path / "other.sqlite").state_id != state_id


def test_a_database_of_an_older_forwarder_is_upgraded_in_place(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite"
    with sqlite3.connect(path) as db:  # the first release's schema, with a phase cut short by a crash
        db.executescript(
            "CREATE TABLE state (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
            "CREATE TABLE hooks (event_id TEXT NOT NULL, phase TEXT NOT NULL, status TEXT NOT NULL,"
            " event TEXT NOT NULL, updated_at TEXT NOT NULL, PRIMARY KEY (event_id, phase));"
            "INSERT INTO state VALUES ('sequence', '41');"
            "INSERT INTO hooks VALUES ('E1', 'prepare', 'running', '{}', '2026-01-01T00:00:00+00:00');"
        )
    store = Store(path)
    assert len(store.state_id) == 32  # a state of unknown birth gets an identifier now, and keeps it
    assert store.enqueue("heartbeat", body) == 41
    assert store.hook_jobs("running") == [HookJob("E1", "prepare", "{}", step="", steps="[]")]


def test_the_ledger_remembers_which_hook_of_a_phase_is_running(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite")
    job = HookJob("E1", "prepare", "{}")
    store.enqueue("incarnation", body, hooks=[job])
    store.mark_hook_running(job)
    store.mark_hook_running(job, step="20-drain", steps='[{"hook":"10-check"}]')
    (running,) = store.hook_jobs("running")
    assert (running.step, running.steps) == ("20-drain", '[{"hook":"10-check"}]')


def test_prune_forgets_only_finished_phases_older_than_the_ledger_keeps(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite")
    jobs = [HookJob("DONE", "prepare", "{}"), HookJob("RUNNING", "prepare", "{}"), HookJob("PENDING", "recover", "{}")]
    store.enqueue("incarnation", body, hooks=jobs)
    store.mark_hook_running(jobs[1])
    store.enqueue("hook", body, hook_done=("DONE", "prepare"))
    now = datetime.now(UTC)
    assert store.prune_hooks(now=now + timedelta(days=HOOK_LEDGER_DAYS - 1)) == 0
    assert store.prune_hooks(now=now + timedelta(days=HOOK_LEDGER_DAYS + 1)) == 1
    assert store.hook_status("DONE", "prepare") is None
    assert store.hook_status("RUNNING", "prepare") == "running"
    assert store.hook_status("PENDING", "recover") == "pending"


def test_a_spool_of_an_older_forwarder_opens_and_keeps_trace_context_from_now_on(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite"
    with sqlite3.connect(path) as db:  # a spool written before envelopes carried a trace context
        db.executescript(
            "CREATE TABLE spool (id INTEGER PRIMARY KEY AUTOINCREMENT, sequence INTEGER NOT NULL,"
            " kind TEXT NOT NULL, body BLOB NOT NULL);"
            "CREATE TABLE state (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
            "INSERT INTO spool (sequence, kind, body) VALUES (7, 'incarnation', X'7B7D');"
            "INSERT INTO state VALUES ('sequence', '8');"
        )
    store = Store(path)
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    store.enqueue("incarnation", body, traceparent=traceparent, tracestate="k=v")
    store.close()
    reopened = Store(path)  # and the trace context outlives a restart
    assert reopened.peek(10) == [
        SpooledEnvelope(1, 7, "incarnation", b"{}"),  # the old row: no context, sent as before
        SpooledEnvelope(2, 8, "incarnation", body(8), traceparent, "k=v"),
    ]


def test_the_decision_ledger_survives_a_restart_and_stays_bounded_by_age_and_count(tmp_path: Path) -> None:
    now = datetime(2026, 11, 21, 6, tzinfo=UTC)
    store = Store(tmp_path / "state.sqlite")
    store.remember_decision(LedgerEntry("d-1", "E1", "executing", now))
    store.remember_decision(LedgerEntry("d-1", "E1", "approved", now, '{"outcome": "approved"}'))
    store.close()
    reopened = Store(tmp_path / "state.sqlite")  # the forwarder restarted
    assert reopened.decision("d-1") == LedgerEntry("d-1", "E1", "approved", now, '{"outcome": "approved"}')
    assert reopened.decision("d-2") is None
    # An entry older than the ledger keeps goes with the next write; beyond the count, the oldest go first.
    later = now + DECISION_LEDGER_KEEP + timedelta(seconds=1)
    reopened.remember_decision(LedgerEntry("d-2", "E2", "refused", later))
    assert reopened.decision("d-1") is None
    for index in range(3, 7):
        reopened.remember_decision(
            LedgerEntry(f"d-{index}", "E", "refused", later + timedelta(seconds=index)), max_entries=3
        )
    assert [reopened.decision(f"d-{i}") is not None for i in range(2, 7)] == [False, False, True, True, True]
    reopened.forget_decision("d-6")
    assert reopened.decision("d-6") is None
    reopened.close()


def test_a_full_disk_refuses_the_write_whole_and_the_reserve_hands_out_sequences_never_used_twice(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "s.sqlite")
    assert [store.enqueue("heartbeat", body) for _ in range(3)] == [0, 1, 2]
    disk = fill_disk(store)

    with pytest.raises(StoreFull):
        store.enqueue("incarnation", body, state={"last_document": "{}"})
    assert store.depth() == 3  # nothing of it kept
    assert store.get_state("last_document") is None
    assert store.full_since is not None
    assert store.write_errors == 1
    assert "disk is full" in store.last_error
    # Sequences for what is sent without being spooled (heartbeats): the reserve, never one spooled.
    assert [store.take_unspooled() for _ in range(2)] == [3, 4]

    # The process dies while the disk is full: the next one starts after the whole reserve (kept up to 64).
    store.close()
    again = Store(tmp_path / "s.sqlite")
    assert again.enqueue("heartbeat", body) == SEQUENCE_RESERVE
    again.close()

    # Room again in the same process: spooling goes on after what the reserve handed out.
    store = Store(tmp_path / "t.sqlite")
    store.enqueue("heartbeat", body)
    disk = fill_disk(store)
    assert store.take_unspooled() == 1
    disk.full = False
    assert store.enqueue("heartbeat", body) == 2
    assert store.full_since is None
    store.close()
    assert Store(tmp_path / "t.sqlite").enqueue("heartbeat", body) == 3  # the reserve unused again: no gap


def test_the_reserve_runs_out_rather_than_reuse_a_sequence(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite")
    fill_disk(store)
    taken = [store.take_unspooled() for _ in range(SEQUENCE_RESERVE + 5)]
    assert taken[:SEQUENCE_RESERVE] == list(range(SEQUENCE_RESERVE))
    assert taken[SEQUENCE_RESERVE:] == [None] * 5


def test_a_store_that_cannot_be_opened_for_want_of_room_is_waited_for_not_crashed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    attempts: list[int] = []

    def full_then_room(path: Path, *, max_entries: int) -> Store:
        attempts.append(1)
        if len(attempts) < 3:
            raise StoreFull("database or disk is full")
        return Store(path, max_entries=max_entries)

    monkeypatch.setattr(durable_state, "Store", full_then_room)
    stop = threading.Event()
    store = durable_state.open_store(tmp_path / "s.sqlite", max_entries=10, stop=stop, first_delay=0.01)
    assert store is not None
    assert len(attempts) == 3
    stop.set()
    assert durable_state.open_store(tmp_path / "t.sqlite", max_entries=10, stop=stop) is None  # stopped meanwhile
