"""The SQLite spool and state: order, sequence across reopen, bounded with a counter, hook ledger."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from forwarder.store import HookJob, Store


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


def test_full_spool_drops_the_oldest_loudly_and_counts(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = Store(tmp_path / "s.sqlite", max_entries=3)
    with caplog.at_level(logging.ERROR, logger="forwarder.store"):
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
