"""The outbox part of the StateStore contract (coordinator/state/store.py, ``Staged``), held against the in-memory
store and TableStateStore on Azurite, as test_state_contract.py holds the rest: history rows stored in the
transaction of the record they describe (both or neither), or alone; read back whole; deleted once written; never
seen by a read of events or VM groups."""

from __future__ import annotations

import dataclasses
import uuid
from datetime import timedelta

import pytest

from coordinator.domain.history_rows import dead_letter_row
from coordinator.domain.model import VmGroupRecord
from coordinator.domain.rows import HistoryRow
from coordinator.state.entities import safe_key
from coordinator.state.staged import STAGED_CHARS, Outbox, staged_pieces
from coordinator.state.store import ConcurrencyConflict, Staged, StateStore
from coordinator.state.tables import TableStateStore
from tests.coordinator.helpers import DOC_NOW, event_record, vm_position
from tests.coordinator.memory_store import MemoryStateStore


@pytest.fixture(params=["memory", "tables"])
def store(request: pytest.FixtureRequest) -> StateStore:
    if request.param == "memory":
        return MemoryStateStore()
    azurite = request.getfixturevalue("azurite")  # started only for the table store's runs
    return TableStateStore.from_connection_string(azurite.connection_string, table_name="ob" + uuid.uuid4().hex[:12])


def rows(*reasons: str) -> tuple[HistoryRow, ...]:
    return tuple(dead_letter_row(now=DOC_NOW, reason=reason, details={}) for reason in reasons)


def entry(near: str, *reasons: str, seconds: int = 0) -> Staged:
    return Staged(near=near, id=uuid.uuid4().hex, rows=rows(*reasons), at=DOC_NOW + timedelta(seconds=seconds))


def reasons(store: StateStore) -> list[list[str]]:
    return [[row.Reason for row in staged.rows] for staged in store.outbox()]


def test_rows_are_stored_with_the_event_they_describe_and_read_back_whole(store: StateStore):
    first = entry("event:EV-1", "decided", "sending")
    etag = store.save_event(event_record("EV-1"), None, staged=[first])
    assert store.outbox() == [first]  # the rows as given, their RecordIds with them
    later = entry("event:EV-1", "answered", seconds=1)
    store.save_event(event_record("EV-1", state="Approved"), etag, staged=[later])
    assert reasons(store) == [["decided", "sending"], ["answered"]]  # oldest first

    # Reads of events never see them.
    assert list(store.get_events(["EV-1"])) == ["EV-1"]
    assert [s.record.eventId for s in store.open_events()] == ["EV-1"]
    assert [s.record.eventId for s in store.events_changed_since(None).records] == ["EV-1"]
    assert [s.record.eventId for s in store.events_changed_since(DOC_NOW - timedelta(days=9999)).records] == ["EV-1"]
    assert store.set_aside() == []

    store.unstage([first])
    assert reasons(store) == [["answered"]]
    store.unstage([first, later])  # one already gone counts as deleted
    assert store.outbox() == []


def test_a_refused_write_stores_none_of_its_rows(store: StateStore):
    etag = store.save_event(event_record("EV-1"), None)
    store.save_event(event_record("EV-1", state="Started"), etag)
    with pytest.raises(ConcurrencyConflict):
        store.save_event(event_record("EV-1", state="Approved"), etag, staged=[entry("event:EV-1", "approved")])
    with pytest.raises(ConcurrencyConflict):
        store.save_event(event_record("EV-1"), None, staged=[entry("event:EV-1", "new")])
    assert store.outbox() == []


def test_an_entry_written_over_takes_its_ids_place_whole_and_is_refused_once_it_is_gone(store: StateStore):
    # An approval's outcome joins its decision's entry (Outbox.joined): written over it, in the outcome's write.
    decided = entry("event:EV-1", "decided")
    etag = store.save_event(event_record("EV-1"), None, staged=[decided])
    joined = Staged(
        near=decided.near, id=decided.id, rows=(*decided.rows, *rows("answered")), at=decided.at, replaces=True
    )
    etag = store.save_event(event_record("EV-1", state="Approved"), etag, staged=[joined])
    assert store.outbox() == [dataclasses.replace(joined, replaces=False)]  # one entry: one delete once written
    store.unstage([joined])
    assert store.outbox() == []

    # Gone (the timer wrote and deleted it): the write is refused whole, its event too; nothing is stored again.
    with pytest.raises(ConcurrencyConflict):
        store.save_event(event_record("EV-1", state="Started"), etag, staged=[joined])
    assert store.outbox() == []
    stored = store.get_event("EV-1")
    assert stored is not None
    assert stored.record.state == "Approved"


def test_a_runs_outbox_joins_rows_to_the_entry_it_stored_near_the_same_record_when_they_fit():
    outbox = Outbox(at=DOC_NOW + timedelta(seconds=5))
    decided = entry("event:EV-1", "decided")
    outbox.wrote([decided, entry("event:EV-2", "other")])
    [joined] = outbox.joined("event:EV-1", rows("answered"))
    assert (joined.id, joined.at, joined.replaces) == (decided.id, decided.at, True)
    assert [row.Reason for row in joined.rows] == ["decided", "answered"]
    outbox.wrote([joined])
    assert [e.id for e in outbox.written].count(decided.id) == 1  # took the entry's place

    # Near a record it stored nothing with, or too much for one entry: entries of their own.
    [alone] = outbox.joined("event:EV-3", rows("answered"))
    assert (alone.replaces, alone.at) == (False, outbox.at)
    big = rows("x" * (STAGED_CHARS // 2), "y" * (STAGED_CHARS // 2))
    assert all(not e.replaces for e in outbox.joined("event:EV-1", big))


def test_rows_of_many_events_go_each_with_its_event_in_its_transaction(store: StateStore):
    ids = [f"EV-{n}" for n in range(12)]  # over several partitions
    staged = [entry(f"event:{event_id}", event_id) for event_id in ids]
    etags = store.save_events([(event_record(i), None) for i in ids], staged=staged)
    assert sorted(r[0] for r in reasons(store)) == sorted(ids)
    assert [store.get_events([i])[i].etag for i in ids] == etags  # the events' ETags, in order, none of the rows'
    with pytest.raises(ValueError, match="EV-OTHER"):
        store.save_events([(event_record("EV-NEW"), None)], staged=[entry("event:EV-OTHER", "lost")])
    assert store.get_event("EV-NEW") is None


def test_rows_are_stored_with_the_vm_group_they_describe_and_groups_never_read_them(store: StateStore):
    group = VmGroupRecord(group="pg:a", vms={"x": vm_position("a_0", index=1)})
    store.save_vm_group(group, None, staged=[entry("group:pg:a", "heartbeat")])
    assert reasons(store) == [["heartbeat"]]
    assert [s.record.group for s in store.all_vm_groups()] == ["pg:a"]
    assert [s.record.group for s in store.vm_groups_changed_since(None).records] == ["pg:a"]
    assert list(store.get_vm_groups(["pg:a"])) == ["pg:a"]
    assert store.set_aside() == []


def test_rows_of_no_record_are_stored_alone(store: StateStore):
    alone = entry("", "dead letter")
    near = entry("event:EV-GONE", "of an event not written")
    store.stage([alone, near])
    assert {staged.id: staged for staged in store.outbox()} == {alone.id: alone, near.id: near}
    assert store.get_event("EV-GONE") is None
    store.unstage([alone, near])
    assert store.outbox() == []


def test_no_event_or_group_key_is_in_the_outbox_range(store: StateStore):
    store.save_event(event_record("!outbox-lookalike"), None)
    store.save_vm_group(VmGroupRecord(group="!g", vms={"x": vm_position("a_0", index=1)}), None)
    assert store.outbox() == []
    assert list(store.get_events(["!outbox-lookalike"])) == ["!outbox-lookalike"]
    assert list(store.get_vm_groups(["!g"])) == ["!g"]
    assert not safe_key("!outbox-lookalike").startswith("!")


def test_many_rows_are_cut_into_entries_that_each_fit():
    many = rows(*(f"r{n}" * 500 for n in range(300)))
    pieces = staged_pieces("event:EV-1", many, DOC_NOW)
    assert len(pieces) > 1
    assert [row for piece in pieces for row in piece.rows] == list(many)
    assert all(
        sum(len(r.model_dump_json(exclude_defaults=True)) + 1 for r in piece.rows) <= STAGED_CHARS for piece in pieces
    )
    assert len({piece.id for piece in pieces}) == len(pieces)
