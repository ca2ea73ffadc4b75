"""The StateStore contract (coordinator/state/store.py), held against every store: the in-memory one of the fast
tests and TableStateStore on Azurite. Each test runs on both, so the in-memory store cannot drift from the real one.

``store`` and ``peer`` are two coordinator instances on the same state: for the table store two clients (each with
its own read cache) on one table; the in-memory store has no cache, so both are the one store.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from coordinator.domain.claims import BudgetClaim, BudgetRecord
from coordinator.domain.model import (
    EventRecord,
    SentAlerts,
    VmGroupRecord,
    VmRecord,
    VmSighting,
)
from coordinator.state.commit import commit
from coordinator.state.entities import (
    CHUNK_CHARS,
    DEAD_LETTER_BODY,
    MAX_VM_PARTS,
    claim_partition,
    event_partition,
    group_entity,
    group_partition,
    utf16_units,
)
from coordinator.state.store import ConcurrencyConflict, DeadLetter, RecordTooLarge, StateStore, Stored
from coordinator.state.tables import TableStateStore
from tests.coordinator.helpers import DOC_NOW, event_record, vm, vm_position
from tests.coordinator.memory_store import MemoryStateStore


@pytest.fixture(params=["memory", "tables"])
def stores(request: pytest.FixtureRequest) -> tuple[StateStore, StateStore]:
    if request.param == "memory":
        memory = MemoryStateStore()
        return memory, memory
    azurite = request.getfixturevalue("azurite")  # started only for the table store's runs
    table = "contract" + uuid.uuid4().hex[:12]
    first, second = (TableStateStore.from_connection_string(azurite.connection_string, table_name=table) for _ in "ab")
    return first, second


@pytest.fixture
def store(stores: tuple[StateStore, StateStore]) -> StateStore:
    return stores[0]


@pytest.fixture
def peer(stores: tuple[StateStore, StateStore]) -> StateStore:
    return stores[1]


def saved(record: EventRecord) -> EventRecord:
    """A record as a store gives it back after it wrote it: one revision past the one it carried (store.py)."""
    return record.model_copy(update={"revision": record.revision + 1})


def sighting(*, sequence: int = 1, epoch: int = 0, seen: int = 0) -> VmSighting:
    at = DOC_NOW + timedelta(seconds=seen)
    return VmSighting(firstSeen=at, lastSeen=at, lastSequence=sequence, status="Scheduled", epoch=epoch)


def group(key: str, *vms: VmRecord) -> VmGroupRecord:
    return VmGroupRecord(group=key, vms={v.identity.vmId.lower(): v for v in vms})


def one_partition(prefix: str, count: int, partition_of: Callable[[str], str] = event_partition) -> list[str]:
    """``count`` keys starting with ``prefix`` that share one partition: a transaction is all or nothing within one
    partition (events and VM groups are spread over several, entities.PARTITIONS)."""
    keys = (f"{prefix}{n:03}" for n in itertools.count())
    first = next(keys)
    return [first, *itertools.islice((k for k in keys if partition_of(k) == partition_of(first)), count - 1)]


def without_sightings(record: EventRecord) -> EventRecord:
    return record.model_copy(update={"vms": {}})


# events ----------------------------------------------------------------------------------------------------------
def test_an_insert_gives_an_etag_and_the_record_reads_back_without_its_sightings(store, peer):
    record = event_record("EV-1", vms={"WestNO_0": sighting()}, pendingAlerts=["approved"], groups=["pg:a"])

    etag = store.save_event(record, None)

    for reader in (store, peer):
        stored = reader.get_event("EV-1")
        assert stored == Stored(without_sightings(record), etag)  # sightings live with the VM groups
        assert reader.get_events(["EV-1", "EV-NONE"]) == {"EV-1": stored}
    assert store.get_event("EV-NONE") is None
    assert store.get_events([]) == {}


def test_an_insert_of_an_entity_that_exists_is_refused_and_changes_nothing(store, peer):
    etag = store.save_event(event_record("EV-1"), None)
    budget_etag = store.save_budget(BudgetRecord(scaleSet="web"), None)
    group_etag = store.save_vm_group(group("pg:a", vm_position("a_0", index=1)), None)

    with pytest.raises(ConcurrencyConflict):
        peer.save_event(event_record("EV-1", state="Started"), None)
    with pytest.raises(ConcurrencyConflict):
        peer.save_budget(BudgetRecord(scaleSet="web", claims={"EV-1": claim("EV-1")}), None)
    with pytest.raises(ConcurrencyConflict):
        peer.save_vm_group(group("pg:a", vm_position("a_1", index=2)), None)

    assert store.get_event("EV-1") == Stored(saved(event_record("EV-1")), etag)
    assert store.get_budget("web") == Stored(BudgetRecord(scaleSet="web"), budget_etag)
    assert store.get_vm_groups(["pg:a"]) == {"pg:a": Stored(group("pg:a", vm_position("a_0", index=1)), group_etag)}


def test_an_update_needs_the_etag_of_what_is_stored_and_every_write_gives_a_new_one(store, peer):
    first = store.save_event(event_record("EV-1"), None)
    second = peer.save_event(event_record("EV-1", state="Approved"), first)
    same_again = peer.save_event(event_record("EV-1", state="Approved"), second)

    assert len({first, second, same_again}) == 3  # a new ETag even when the content is the same
    with pytest.raises(ConcurrencyConflict):
        store.save_event(event_record("EV-1", state="Started"), first)
    with pytest.raises(ConcurrencyConflict):
        store.save_event(event_record("EV-1", state="Started"), second)
    assert store.get_event("EV-1") == Stored(saved(event_record("EV-1", state="Approved")), same_again)


def test_a_write_on_an_entity_deleted_since_it_was_read_is_a_conflict(store, peer):
    etag = store.save_event(event_record("EV-1"), None)
    other = store.save_event(event_record("EV-2"), None)
    assert peer.delete_events([("EV-1", etag)]) == 1

    with pytest.raises(ConcurrencyConflict):
        store.save_event(event_record("EV-1", state="Started"), etag)
    with pytest.raises(ConcurrencyConflict):
        store.save_events([(event_record("EV-1", state="Started"), etag), (event_record("EV-2"), other)])
    assert store.get_event("EV-1") is None
    assert store.get_event("EV-2") == Stored(saved(event_record("EV-2")), other)


def test_reads_answer_with_the_ids_asked_for_whatever_characters_they_hold(store):
    ids = ["EV/1", "EV#2?", "EV\\3", "EV\x074", "E" * 300, *(f"EV-{n:02}" for n in range(20))]
    etags = store.save_events([(event_record(i), None) for i in ids])
    keys = ["pg:web", "vmss:sub/rg/web#3", "vm:" + "f" * 250]
    group_etags = store.save_vm_groups(
        [(group(k, vm_position(f"v_{n}", index=n)), None, None) for n, k in enumerate(keys)]
    )

    # More ids than one query may name (14 RowKeys per filter), and some that are no event.
    found = store.get_events([*ids, "EV-NONE", "EV/NONE"])
    assert found == {i: Stored(saved(event_record(i)), e) for i, e in zip(ids, etags, strict=True)}
    assert store.get_vm_groups([*keys, "pg:none"]) == {
        k: Stored(group(k, vm_position(f"v_{n}", index=n)), e)
        for n, (k, e) in enumerate(zip(keys, group_etags, strict=True))
    }


def test_a_cached_read_never_commits_a_stale_record(store, peer):
    etag = store.save_event(event_record("EV-1"), None)
    assert store.get_events(["EV-1"], cached=True)["EV-1"].etag == etag  # what this instance wrote
    newer = peer.save_event(event_record("EV-1", state="Approved"), peer.get_events(["EV-1"])["EV-1"].etag)

    cached = store.get_events(["EV-1"], cached=True)["EV-1"]
    if cached.etag == newer:  # this store reads fresh: the write goes through
        store.save_event(event_record("EV-1", state="Started"), cached.etag)
        return
    assert cached.etag == etag  # the instance's own, older write
    with pytest.raises(ConcurrencyConflict):
        store.save_event(event_record("EV-1", state="Started"), cached.etag)
    # The conflict made the next read, cached or not, the stored one.
    assert store.get_events(["EV-1"], cached=True)["EV-1"] == Stored(
        saved(event_record("EV-1", state="Approved")), newer
    )


def test_a_transaction_is_all_or_nothing(store, peer):
    one, two, three, four = one_partition("EV-", 4)
    etags = store.save_events([(event_record(i), None) for i in (one, two, three)])
    moved = peer.save_event(event_record(two, state="Approved"), etags[1])

    with pytest.raises(ConcurrencyConflict):
        store.save_events(
            [
                (event_record(one, state="Started"), etags[0]),
                (event_record(two, state="Started"), etags[1]),
                (event_record(three, state="Started"), etags[2]),
                (event_record(four), None),
            ]
        )

    assert store.get_events([one, two, three, four]) == {
        one: Stored(saved(event_record(one)), etags[0]),
        two: Stored(saved(event_record(two, state="Approved")), moved),
        three: Stored(saved(event_record(three)), etags[2]),
    }
    written = store.save_events([(event_record(one, state="Started"), etags[0]), (event_record(four), None)])
    assert [s.etag for s in store.get_events([one, four]).values()] == written


def test_writes_to_several_partitions_are_one_transaction_each_and_give_their_etags_in_order(store, peer):
    ids = [f"EV-{n}" for n in range(12)]
    assert len({event_partition(i) for i in ids}) > 1
    etags = store.save_events([(event_record(i), None) for i in ids])

    assert [store.get_events([i])[i].etag for i in ids] == etags
    moved = peer.save_event(event_record(ids[-1], state="Approved"), etags[-1])
    with pytest.raises(ConcurrencyConflict):
        store.save_events([(event_record(i, state="Started"), e) for i, e in zip(ids, etags, strict=True)])
    after = store.get_events(ids)
    assert after[ids[-1]] == Stored(saved(event_record(ids[-1], state="Approved")), moved)
    refused = [i for i in ids[:-1] if event_partition(i) == event_partition(ids[-1])]
    assert refused
    assert all(after[i].record.state == "Scheduled" for i in refused)  # its whole partition's transaction


def test_a_record_named_twice_in_one_transaction_refuses_it(store):
    one, two = one_partition("EV-", 2)
    with pytest.raises(ConcurrencyConflict):
        store.save_events([(event_record(one), None), (event_record(two), None), (event_record(one), None)])
    assert store.get_events([one, two]) == {}


def test_more_than_100_writes_are_cut_into_transactions_each_all_or_nothing(store, peer):
    ids = one_partition("EV-", 105)
    etags = store.save_events([(event_record(i), None) for i in ids])
    assert len(etags) == 105  # (an ETag versions one entity: two entities may have the same one)
    peer.save_event(event_record(ids[103], state="Approved"), etags[103])

    with pytest.raises(ConcurrencyConflict):
        store.save_events([(event_record(i, state="Started"), e) for i, e in zip(ids, etags, strict=True)])

    after = store.get_events(ids)
    assert all(after[i].record.state == "Started" and after[i].etag != etags[n] for n, i in enumerate(ids[:100]))
    assert after[ids[103]].record.state == "Approved"  # moved by the peer: the second transaction is refused
    assert all(
        after[i] == Stored(saved(event_record(i)), etags[n]) for n, i in enumerate(ids) if n in (100, 101, 102, 104)
    )


def test_a_record_too_large_is_refused_before_anything_is_written(store):
    large = event_record("EV-LARGE", description="x" * (4 * CHUNK_CHARS))  # split over several properties
    etag = store.save_event(large, None)
    assert store.get_event("EV-LARGE") == Stored(large, etag)  # ``large`` itself: the write set its revision

    with pytest.raises(RecordTooLarge):
        store.save_events([(event_record("EV-SMALL"), None), (event_record("EV-HUGE", description="x" * 10**6), None)])
    assert store.get_events(["EV-SMALL", "EV-HUGE"]) == {}


def test_the_queries_find_events_by_state_outbox_and_age(store):
    cutoff = DOC_NOW - timedelta(days=30)
    old, recent = DOC_NOW - timedelta(days=40), DOC_NOW - timedelta(days=1)
    records = [
        event_record("open-pending", pendingAlerts=["approved"]),
        event_record("open-started", state="Started", stateSince=old),
        event_record("open-expired", state="Expired", stateSince=old),
        event_record("completed-pending", state="Completed", pendingAlerts=["completed"], stateSince=old),
        event_record("completed-old", state="Completed", stateSince=old),
        event_record("canceled-old", state="Canceled", stateSince=old),
        event_record("canceled-recent", state="Canceled", stateSince=recent),
        event_record("completed-at-cutoff", state="Completed", stateSince=cutoff),
    ]
    etags = dict(zip((r.eventId for r in records), store.save_events([(r, None) for r in records]), strict=True))

    def found(stored: list[Stored[EventRecord]]) -> set[str]:
        assert all(s.etag == etags[s.record.eventId] for s in stored)
        return {s.record.eventId for s in stored}

    assert found(store.open_events()) == {"open-pending", "open-started", "open-expired"}
    assert found(store.closed_events_with_pending_alerts()) == {"completed-pending"}
    assert found(store.concluded_events_before(cutoff)) == {"completed-old", "canceled-old"}
    by_id = {s.record.eventId: s.record for s in store.open_events()}
    assert by_id["open-started"] == saved(event_record("open-started", state="Started", stateSince=old))


def test_deleting_events_keeps_those_changed_since(store, peer):
    etags = store.save_events([(event_record(i), None) for i in ("EV-1", "EV-2")])
    peer.save_event(event_record("EV-2", state="Completed"), etags[1])

    assert store.delete_events([("EV-1", etags[0]), ("EV-2", etags[1]), ("EV-GONE", etags[0])]) == 2
    assert set(store.get_events(["EV-1", "EV-2"])) == {"EV-2"}
    assert store.delete_events([]) == 0
    with pytest.raises(ValueError, match="etag"):
        store.delete_events([("EV-2", None)])


# VM groups -------------------------------------------------------------------------------------------------------
def test_a_vm_group_is_inserted_whole_and_an_update_merges_only_the_vms_it_sends(store, peer):
    a, b = vm_position("web_0", index=1), vm_position("web_1", index=2)
    first = etag = store.save_vm_group(group("pg:web", a, b), None)
    moved_a, moved_b = a.model_copy(update={"lastSequence": 5}), b.model_copy(update={"lastSequence": 9})

    etag = store.save_vm_group(group("pg:web", moved_a, moved_b), etag, vm_ids=[a.identity.vmId])
    assert peer.get_vm_groups(["pg:web"])["pg:web"] == Stored(group("pg:web", moved_a, b), etag)

    # Without vm_ids every VM of the record is sent; a VM it does not hold keeps what is stored.
    c = vm_position("web_2", index=3)
    etag = peer.save_vm_group(group("pg:web", c), etag)
    assert store.get_vm_groups(["pg:web"])["pg:web"] == Stored(group("pg:web", moved_a, b, c), etag)
    assert [s.record.group for s in store.all_vm_groups()] == ["pg:web"]

    with pytest.raises(ConcurrencyConflict):
        store.save_vm_group(group("pg:web", moved_b), first, vm_ids=[b.identity.vmId])
    with pytest.raises(ConcurrencyConflict):
        store.save_vm_group(group("pg:nowhere", a), etag)  # no such group any more (or ever)


def test_vm_groups_in_one_partition_are_written_all_or_nothing(store, peer):
    a, b = vm_position("a_0", index=1), vm_position("b_0", index=2)
    ka, kb = one_partition("pg:", 2, group_partition)
    etags = store.save_vm_groups([(group(ka, a), None, None), (group(kb, b), None, None)])
    moved = peer.save_vm_group(group(kb, b.model_copy(update={"lastSequence": 3})), etags[1])

    later = {"lastSequence": 7}
    with pytest.raises(ConcurrencyConflict):
        store.save_vm_groups([(group(ka, a.model_copy(update=later)), etags[0], None), (group(kb, b), etags[1], None)])

    assert {s.record.group: s for s in store.all_vm_groups()} == {
        ka: Stored(group(ka, a), etags[0]),
        kb: Stored(group(kb, b.model_copy(update={"lastSequence": 3})), moved),
    }


def largest_position(name: str, index: int, **fields: object) -> VmRecord:
    """The largest position a forwarder within the door's bounds reports: 50 tags of 512 + 256 characters, 100
    listed events of 128-character ids, each with its sighting and a failed hook's name."""
    identity = {**vm(name, index=index), "tags": {f"t{i:02}" + "n" * 509: "v" * 256 for i in range(50)}}
    listed = [f"{i:03}" + "E" * 125 for i in range(100)]
    hooks = {"hooks": {"prepare": "failed"}, "failedHooks": {"prepare": "h" * 256}}
    sightings = {e: sighting(seen=n).model_copy(update=hooks) for n, e in enumerate(listed)}
    return VmRecord.model_validate(
        {"identity": identity, "lastSeen": DOC_NOW, "listed": listed, "sightings": sightings, **fields}
    )


def test_a_vm_position_longer_than_a_property_is_split_and_read_back_whole(store, peer):
    large = largest_position("web_0", 1)  # 4 properties' worth: refused whole before (the batch failed)
    small = vm_position("web_1", index=2)
    etag = store.save_vm_group(group("pg:web", large, small), None)
    assert peer.get_vm_groups(["pg:web"])["pg:web"] == Stored(group("pg:web", large, small), etag)

    # Shrunk back into one property: the parts it no longer needs are left behind and never read.
    shrunk = large.model_copy(update={"listed": [], "sightings": {}})
    etag = peer.save_vm_group(group("pg:web", shrunk, small), etag, vm_ids=[large.identity.vmId])
    assert store.get_vm_groups(["pg:web"])["pg:web"] == Stored(group("pg:web", shrunk, small), etag)

    # Characters beyond the BMP take two UTF-16 code units of a property's 32,768: split by those, not characters.
    astral = vm_position("web_2", index=3, listed=["\U0001f600" * 128], sightings={"\U0001f600" * 128: sighting()})
    wide = astral.model_copy(
        update={"identity": astral.identity.model_copy(update={"tags": {"t": "\U0001f600" * 256}})}
    )
    wide = wide.model_copy(update={"otherStates": {}, "stateConflict": ["\U0001f600" * 20_000]})
    etag = store.save_vm_group(group("pg:web", wide), etag, vm_ids=[wide.identity.vmId])
    assert peer.get_vm_groups(["pg:web"])["pg:web"].record.vms[wide.identity.vmId.lower()] == wide


def test_a_vms_oldest_sightings_of_events_it_no_longer_lists_make_room_beyond_its_bound(store):
    position = largest_position("web_0", 1)
    gone = {f"GONE-{n:03}": sighting(seen=n - 1000).model_copy(update={"hooks": {"p": "x" * 500}}) for n in range(400)}
    position = position.model_copy(update={"sightings": {**position.sightings, **gone}})
    etag = store.save_vm_group(group("pg:web", position), None)

    (kept,) = store.get_vm_groups(["pg:web"])["pg:web"].record.vms.values()
    assert set(position.listed) <= set(kept.sightings)  # listed: kept, however old
    assert "GONE-000" not in kept.sightings  # the oldest of the rest went first...
    assert "GONE-399" in kept.sightings  # ...and the newest stayed
    assert kept.identity == position.identity  # tags, what a decision reads, are never trimmed
    assert utf16_units(kept.model_dump_json(exclude_defaults=True)) <= MAX_VM_PARTS * CHUNK_CHARS

    # Beyond every bound of the door (tags of control characters, six times longer as JSON): refused, nothing written.
    escaped = {f"t{i:02}" + "\x01" * 509: "\x01" * 256 for i in range(50)}
    hostile = position.model_copy(update={"identity": position.identity.model_copy(update={"tags": escaped})})
    with pytest.raises(RecordTooLarge, match=r"web_0's position is .* without what can be trimmed"):
        store.save_vm_group(group("pg:web", hostile), etag)
    assert store.get_vm_groups(["pg:web"])["pg:web"].etag == etag


# entities that cannot be read ------------------------------------------------------------------------------------
def overwrite(store: StateStore, entity: dict[str, object]) -> None:
    """Writes an entity as it is, behind the store's back: what damage, or another version's layout, leaves."""
    if isinstance(store, MemoryStateStore):
        key = (str(entity["PartitionKey"]), str(entity["RowKey"]))
        store._entities[key] = ({**store._entities.get(key, ({}, ""))[0], **entity}, 'W/"damaged"')
    else:
        assert isinstance(store, TableStateStore)
        store._table.upsert_entity(entity)


def test_an_event_that_cannot_be_read_is_set_aside_and_the_others_are_read(store, peer):
    store.save_events([(event_record(i), None) for i in ("EV-1", "EV-2", "EV-3")])
    overwrite(
        store, {"PartitionKey": event_partition("EV-2"), "RowKey": "EV-2", "Data0": '{"eventId": "EV-2", "state": 7'}
    )

    assert [s.record.eventId for s in peer.open_events()] == ["EV-1", "EV-3"]  # no exception: the rest goes on
    (item,) = peer.set_aside()
    assert item.what == f"{event_partition('EV-2')}/EV-2"
    assert "ValidationError" in item.reason
    assert peer.set_aside() == []  # listed once
    assert store.get_event("EV-2") is None  # moved away, so the event starts afresh from its next sighting
    assert store.save_event(event_record("EV-2"), None)
    (letter,) = store.dead_letters()
    assert str(letter["Reason"]).startswith(f"state entity {event_partition('EV-2')}/EV-2 set aside: ValidationError")
    assert json.loads(base64.b64decode(str(letter["BodyBase64"])))["Data0"] == '{"eventId": "EV-2", "state": 7'


def test_a_vm_whose_position_cannot_be_read_is_set_aside_and_its_next_position_overwrites_it(store, peer):
    a, b = vm_position("web_0", index=1), vm_position("web_1", index=2)
    store.save_vm_group(group("pg:web", a, b), None)
    entity = group_entity(group("pg:web", a), [a.identity.vmId])
    (name,) = (n for n in entity if n.startswith("V_"))
    overwrite(store, {"PartitionKey": group_partition("pg:web"), "RowKey": "pg:web", name: "{not a position"})

    stored = peer.get_vm_groups(["pg:web"])["pg:web"]
    assert stored.record == group("pg:web", b)
    assert [item.what for item in peer.set_aside()] == [f"{group_partition('pg:web')}/pg:web (a VM's position)"]
    assert [s.record for s in store.all_vm_groups()] == [group("pg:web", b)]  # blanked: not set aside again
    assert store.set_aside() == peer.set_aside() == []
    moved = a.model_copy(update={"lastSequence": 9})
    etag = peer.save_vm_group(group("pg:web", moved, b), stored.etag, vm_ids=[a.identity.vmId])
    assert store.get_vm_groups(["pg:web"])["pg:web"] == Stored(group("pg:web", moved, b), etag)


# budgets ---------------------------------------------------------------------------------------------------------
def claim(event_id: str) -> BudgetClaim:
    return BudgetClaim(eventId=event_id, vms=["web_0"], claimedAt=DOC_NOW)


def test_a_budget_s_etag_alone_says_whether_it_changed_since_it_was_read(store, peer):
    assert store.budget_etag("zone:westeurope/1") is None
    etag = store.save_budget(BudgetRecord(scaleSet="zone:westeurope/1"), None)
    assert store.budget_etag("zone:westeurope/1") == etag == store.get_budget("zone:westeurope/1").etag

    newer = peer.save_budget(BudgetRecord(scaleSet="zone:westeurope/1", claims={"EV-1": claim("EV-1")}), etag)

    assert store.budget_etag("zone:westeurope/1") == newer != etag  # another instance's write, seen at once


def test_a_budget_is_always_read_fresh_and_written_if_match(store, peer):
    assert store.get_budget("zone:westeurope/1") is None
    etag = store.save_budget(BudgetRecord(scaleSet="zone:westeurope/1"), None)
    claimed = BudgetRecord(scaleSet="zone:westeurope/1", claims={"EV-1": claim("EV-1")})

    newer = peer.save_budget(claimed, peer.get_budget("zone:westeurope/1").etag)

    assert store.get_budget("zone:westeurope/1") == Stored(claimed, newer)  # not what this instance wrote
    with pytest.raises(ConcurrencyConflict):
        store.save_budget(BudgetRecord(scaleSet="zone:westeurope/1"), etag)


def test_racing_writers_through_commit_each_land_once(store, peer):
    """Two instances on threads, each claiming ten events in one budget: every claim lands, none twice. Their first
    claims both read the entity before either writes (a barrier), so that they collide on every run, not only when
    the threads happen to interleave."""
    store.save_budget(BudgetRecord(scaleSet="web"), None)
    conflicts = []
    both_read = threading.Barrier(2, timeout=30)
    waited: set[str] = set()

    def claim_one(instance: StateStore, event_id: str) -> None:
        def read(_attempt: int) -> Stored[BudgetRecord]:
            stored = instance.get_budget("web")
            assert stored is not None
            return stored

        def claimed(stored: Stored[BudgetRecord]) -> BudgetRecord:
            if event_id.endswith("-0") and event_id not in waited:  # each thread's first read, not its retry
                waited.add(event_id)
                both_read.wait()
            return BudgetRecord(scaleSet="web", claims={**stored.record.claims, event_id: claim(event_id)})

        commit(
            read,
            claimed,
            lambda record, stored: instance.save_budget(record, stored.etag),
            what="budget web",
            attempts=100,
            on_conflict=lambda: conflicts.append(1),
        )

    def claim_all(instance: StateStore, prefix: str) -> None:
        for n in range(10):
            claim_one(instance, f"{prefix}-{n}")

    threads = [threading.Thread(target=claim_all, args=(s, p)) for s, p in ((store, "A"), (peer, "B"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    final = store.get_budget("web")
    assert final is not None
    assert sorted(final.record.claims) == sorted(f"{p}-{n}" for p in "AB" for n in range(10))
    assert conflicts or store is peer  # two clients on one table did collide


# the log of sent cards, shared keys, dead letters ----------------------------------------------------------------
def test_sent_card_logs_come_oldest_first_and_a_delete_of_one_already_gone_is_fine(store, peer):
    for minutes in (2, 0, 1):
        sent_at = DOC_NOW + timedelta(minutes=minutes)
        store.log_sent_alerts(SentAlerts(sentAt=sent_at, events={f"EV-{minutes}": ["approved"]}))

    logs = store.sent_alert_logs()
    assert [entry.sentAt for _, entry in logs] == [DOC_NOW + timedelta(minutes=m) for m in (0, 1, 2)]
    assert logs[0][1] == SentAlerts(sentAt=DOC_NOW, events={"EV-0": ["approved"]})

    store.delete_sent_alert_logs([key for key, _ in logs[:2]])
    assert store.sent_alert_logs() == logs[2:]
    # Two timer runs that overlap (a past-due run) settle the same logs: the second finds some gone.
    peer.delete_sent_alert_logs([logs[0][0], logs[2][0], logs[2][0]])
    assert store.sent_alert_logs() == []
    store.delete_sent_alert_logs([key for key, _ in logs])
    store.delete_sent_alert_logs([])


def test_a_shared_key_is_made_once_for_every_instance(store, peer):
    key = store.shared_key("approval-form")

    assert len(key) == 32
    assert peer.shared_key("approval-form") == key == store.shared_key("approval-form")
    assert peer.shared_key("another/purpose#") not in (key, b"")


def test_a_claim_binds_the_first_value_for_every_instance(store, peer):
    assert store.claimed("vm-resource:/subscriptions/s/rg#1") is None

    assert store.claim("vm-resource:/subscriptions/s/rg#1", "vm-a") == "vm-a"
    assert peer.claim("vm-resource:/subscriptions/s/rg#1", "vm-b") == "vm-a"
    assert (
        peer.claimed("vm-resource:/subscriptions/s/rg#1")
        == store.claimed("vm-resource:/subscriptions/s/rg#1")
        == "vm-a"
    )
    assert store.claimed("vm-resource:another") is None


def test_claims_made_together_keep_the_first_values_and_write_every_other(store, peer):
    # One name bound already by another instance, in the middle of a partition's transaction: the transaction is
    # refused whole by the table, sent again without it, and that name answers with the value it holds.
    names = [f"vm-name:web_{n}" for n in range(250)]
    taken = [n for n in names if claim_partition(n) == claim_partition(names[0])][3]
    assert peer.claim(taken, "vm-other") == "vm-other"

    bound = store.claim_many([(name, f"vm-{name}") for name in names])

    assert bound == {name: "vm-other" if name == taken else f"vm-{name}" for name in names}
    assert {name: peer.claimed(name) for name in names} == bound
    assert store.claim_many([(names[1], "vm-late")]) == {names[1]: f"vm-{names[1]}"}
    partition = claim_partition(names[0])
    assert store.claims_in(partition) == {n: v for n, v in bound.items() if claim_partition(n) == partition}
    assert store.claims_in("claim-none") == {}


@pytest.mark.parametrize("where", ["first", "last"])
def test_a_claim_bound_already_at_either_end_of_a_transaction_keeps_its_value(store, peer, where):
    # The table names the refused operation by its index in the transaction; at 0 and at the last one too.
    names = [
        n for n in (f"vm-name:db_{n}" for n in range(400)) if claim_partition(n) == claim_partition("vm-name:db_0")
    ]
    names = names[:12]
    taken = names[0] if where == "first" else names[-1]
    assert peer.claim(taken, "vm-other") == "vm-other"

    bound = store.claim_many([(name, f"vm-{name}") for name in names])

    assert bound == {name: "vm-other" if name == taken else f"vm-{name}" for name in names}
    assert {name: peer.claimed(name) for name in names} == bound


def test_nothing_to_write_writes_nothing(store):
    assert store.save_events([]) == []
    assert store.save_vm_groups([]) == []
    assert store.claim_many([]) == {}
    store.unstage([])
    store.delete_sent_alert_logs([])
    assert store.events_changed_since(None).records == []


def test_dead_letters_are_kept_in_full_up_to_their_limits(store):
    day = DOC_NOW.replace(hour=23)
    letters = [DeadLetter(reason=f"bad {n}", body=b"{", received_at=day, source={"n": n}) for n in range(105)]
    huge = DeadLetter(reason="r" * 10_000, body=b"z" * 100_000, received_at=day + timedelta(hours=1), source={})

    store.put_dead_letters([*letters, huge])
    store.put_dead_letters([])

    stored = store.dead_letters()
    assert len(stored) == 106
    assert {str(row["PartitionKey"])[:10] for row in stored} == {"2022-04-11", "2022-04-12"}
    assert all(
        set(row) == {"PartitionKey", "RowKey", "Reason", "Source", "BodyBase64", "BodyBytes", "BodySha256"}
        for row in stored
    )
    assert sorted(row["Reason"] for row in stored[:105]) == sorted(f"bad {n}" for n in range(105))
    last = stored[-1]
    assert (len(last["Reason"]), last["BodyBytes"]) == (8000, 100_000)
    assert last["BodyBase64"] == base64.b64encode(huge.body[:DEAD_LETTER_BODY]).decode()
    assert last["BodySha256"] == hashlib.sha256(huge.body).hexdigest()


def test_a_storm_of_dead_letters_spreads_over_the_days_partitions_and_reads_back_in_arrival_order(store):
    start = DOC_NOW.replace(hour=1)
    letters = [
        DeadLetter(reason=f"bad {n}", body=b"{", received_at=start + timedelta(milliseconds=n), source={})
        for n in range(450)
    ]

    for at in range(0, 450, 150):  # three instances' batches
        store.put_dead_letters(letters[at : at + 150])

    stored = store.dead_letters()
    assert [row["Reason"] for row in stored] == [f"bad {n}" for n in range(450)]
    partitions = {str(row["PartitionKey"]) for row in stored}
    assert {p[:10] for p in partitions} == {start.strftime("%Y-%m-%d")}
    assert len(partitions) >= 2  # each batch's second transaction goes to the partition after its first's


# changes ---------------------------------------------------------------------------------------------------------
def test_changes_since_a_watermark_give_what_any_instance_wrote_after_it_and_nothing_older(store, peer):
    store.save_event(event_record("EV-OLD"), None)
    store.save_event(event_record("EV-DONE", state="Completed"), None)
    store.save_vm_group(group("pg:old", vm_position("WestNO_0", index=1)), None)

    events, groups = store.events_changed_since(None), store.vm_groups_changed_since(None)

    assert [s.record.eventId for s in events.records] == ["EV-OLD"]  # the first load: every open event
    assert [s.record.group for s in groups.records] == ["pg:old"]  # every group
    assert events.watermark is not None
    assert groups.watermark is not None
    # Azurite compares Timestamps to the millisecond: what is 1 ms later is later.
    after = max(events.watermark, groups.watermark) + timedelta(milliseconds=1)
    time.sleep(0.005)  # the next writes come after ``after``
    etag = peer.save_event(event_record("EV-NEW", state="Canceled"), None)
    peer.save_vm_group(group("pg:new", vm_position("WestNO_1", index=2)), None)

    changed = store.events_changed_since(after)
    assert [(s.record.eventId, s.etag) for s in changed.records] == [("EV-NEW", etag)]  # concluded ones too
    assert changed.watermark is not None
    assert changed.watermark >= after
    assert [s.record.group for s in store.vm_groups_changed_since(after).records] == ["pg:new"]
    assert store.events_changed_since(changed.watermark + timedelta(milliseconds=1)).records == []


def test_what_changed_is_the_latest_of_each_whether_this_store_or_another_wrote_it(store, peer):
    start = store.events_changed_since(None).watermark or DOC_NOW
    time.sleep(0.005)
    mine, theirs = store.save_events([(event_record(i), None) for i in ("EV-MINE", "EV-THEIRS")])
    later = peer.save_event(event_record("EV-THEIRS", state="Approved"), theirs)
    new = peer.save_event(event_record("EV-PEER"), None)

    changed = store.events_changed_since(start)

    assert sorted((s.record.eventId, s.record.state, s.etag) for s in changed.records) == [
        ("EV-MINE", "Scheduled", mine),
        ("EV-PEER", "Scheduled", new),
        ("EV-THEIRS", "Approved", later),  # written here, then by the peer: the peer's
    ]


def test_the_table_store_reads_whole_only_what_it_lacks_of_the_changes(azurite: Any) -> None:
    """Another instance's write before thirty of this one's: only that entity is read whole (its body), not every
    change from it on (a write of this instance landing between the listing and the check used to make ~500 events
    of a wave read again)."""
    table = "changed" + uuid.uuid4().hex[:12]
    store, peer = (TableStateStore.from_connection_string(azurite.connection_string, table_name=table) for _ in "ab")
    start = store.events_changed_since(None).watermark or DOC_NOW
    time.sleep(0.005)
    theirs = peer.save_event(event_record("EV-PEER"), None)
    time.sleep(0.005)
    mine = store.save_events([(event_record(f"EV-{i:02}"), None) for i in range(30)])
    whole: list[str] = []
    query = store._table.query_entities

    def counted(*args: Any, **kwargs: Any) -> Any:
        for entity in query(*args, **kwargs):
            if kwargs.get("select") is None:
                whole.append(str(entity["RowKey"]))
            yield entity

    store._table.query_entities = counted  # type: ignore[method-assign]
    changed = store.events_changed_since(start)

    assert whole == ["EV-PEER"]
    assert sorted((s.record.eventId, s.etag) for s in changed.records) == sorted(
        [("EV-PEER", theirs), *((f"EV-{i:02}", etag) for i, etag in enumerate(mine))]
    )

    # All known now: nothing read whole, and the watermark is the changes' latest time, not the one asked from (a
    # listing without Timestamps kept it where it was: each refresh listed every change since the last unknown one).
    whole.clear()
    again = store.events_changed_since(start)
    assert whole == []
    assert again.watermark is not None
    assert store.events_changed_since(again.watermark + timedelta(milliseconds=1)).records == []


def test_the_table_store_reads_another_instances_many_changes_in_one_range_not_by_key(azurite: Any) -> None:
    """Past KEYED_READS queries of keys (another instance wrote most of a wave), what is lacked is read by one range
    query from the first lacked, not 5 queries of 14 keys a refresh."""
    table = "ranged" + uuid.uuid4().hex[:12]
    store, peer = (TableStateStore.from_connection_string(azurite.connection_string, table_name=table) for _ in "ab")
    start = store.events_changed_since(None).watermark or DOC_NOW
    time.sleep(0.005)
    theirs = peer.save_events([(event_record(f"EV-{i:02}"), None) for i in range(70)])
    mine = store.save_event(event_record("EV-MINE"), None)
    queries: list[str] = []
    query = store._table.query_entities

    def counted(*args: Any, **kwargs: Any) -> Any:
        queries.append("listing" if kwargs.get("select") else "whole")
        return query(*args, **kwargs)

    store._table.query_entities = counted  # type: ignore[method-assign]
    changed = store.events_changed_since(start)

    assert queries == ["listing", "whole"]
    assert sorted((s.record.eventId, s.etag) for s in changed.records) == sorted(
        [("EV-MINE", mine), *((f"EV-{i:02}", etag) for i, etag in enumerate(theirs))]
    )


# housekeeping ----------------------------------------------------------------------------------------------------
def test_a_pruned_group_keeps_only_the_vms_given_and_goes_when_none_is_left(store, peer):
    a, b = vm_position("a_0", index=1), vm_position("b_0", index=2)
    etag = store.save_vm_group(group("pg:web", a, b), None)
    moved = peer.save_vm_group(group("pg:web", a, b), etag, vm_ids=[a.identity.vmId])
    with pytest.raises(ConcurrencyConflict):
        store.prune_vm_group(group("pg:web", b), etag)  # changed since: kept whole

    pruned = store.prune_vm_group(group("pg:web", b), moved)

    assert pruned is not None
    assert store.get_vm_groups(["pg:web"]) == {"pg:web": Stored(group("pg:web", b), pruned)}
    assert store.prune_vm_group(group("pg:web"), pruned) is None
    assert store.get_vm_groups(["pg:web"]) == {}


def test_budgets_are_listed_and_deleted_only_unchanged(store, peer):
    claim = BudgetClaim(eventId="EV-1", vms=["web_0"], claimedAt=DOC_NOW)
    empty = store.save_budget(BudgetRecord(scaleSet="web"), None)
    held = store.save_budget(BudgetRecord(scaleSet="zone:westeurope/1", claims={"EV-1": claim}), None)
    assert {s.record.scaleSet: s.etag for s in store.budgets()} == {"web": empty, "zone:westeurope/1": held}

    changed = peer.save_budget(BudgetRecord(scaleSet="web", claims={"EV-1": claim}), empty)
    assert store.delete_budget("web", empty) is False
    assert store.delete_budget("web", changed) is True
    assert [s.record.scaleSet for s in store.budgets()] == ["zone:westeurope/1"]


def test_a_write_answered_after_a_later_one_of_the_same_instance_leaves_no_older_etag_cached(azurite: Any) -> None:
    """Two invocations of one instance write one VM group (its VMs on two partitions): the first's answer is handled
    only after the second met its conflict, read again and wrote. The group this store then holds is the newest:
    a write from it is not refused (an older ETag kept made the next batch conflict and read every group of its
    transaction again)."""
    table = "ordered" + uuid.uuid4().hex[:12]
    store = TableStateStore.from_connection_string(azurite.connection_string, table_name=table)
    a, b = vm_position("web_0", index=1), vm_position("web_1", index=2)
    first = store.save_vm_group(group("pg:web", a, b), None)
    answered, release = threading.Event(), threading.Event()
    update = store._table.update_entity

    def held_back(entity: Any, **kwargs: Any) -> Any:
        result = update(entity, **kwargs)  # written in the table; its answer handled once released
        answered.set()
        release.wait(10)
        return result

    store._table.update_entity = held_back  # type: ignore[method-assign,assignment]
    moved_a = a.model_copy(update={"lastSequence": 5})
    slow = threading.Thread(target=store.save_vm_group, args=(group("pg:web", moved_a), first))
    slow.start()
    assert answered.wait(10)
    store._table.update_entity = update  # type: ignore[method-assign]
    moved_b = b.model_copy(update={"lastSequence": 9})
    with pytest.raises(ConcurrencyConflict):
        store.save_vm_group(group("pg:web", moved_b), first, vm_ids=[b.identity.vmId])
    fresh = store.get_vm_groups(["pg:web"])["pg:web"]
    newest = store.save_vm_group(group("pg:web", moved_b), fresh.etag, vm_ids=[b.identity.vmId])
    release.set()
    slow.join(10)

    held = store.get_vm_groups(["pg:web"], cached=True)["pg:web"]
    assert held == Stored(group("pg:web", moved_a, moved_b), newest)
    moved_again = moved_a.model_copy(update={"lastSequence": 6})
    store.save_vm_group(group("pg:web", moved_again), held.etag, vm_ids=[a.identity.vmId])


def test_a_read_answered_before_a_write_of_the_same_instance_but_handled_after_it_is_not_kept(azurite: Any) -> None:
    """One invocation's read of a group is answered, then another's write of it lands and is kept: the read, handled
    last, does not put the older group back in the cache."""
    table = "readrace" + uuid.uuid4().hex[:12]
    store = TableStateStore.from_connection_string(azurite.connection_string, table_name=table)
    a = vm_position("web_0", index=1)
    first = store.save_vm_group(group("pg:web", a), None)
    answered, release = threading.Event(), threading.Event()
    query = store._table.query_entities

    def held_back(*args: Any, **kwargs: Any) -> Any:
        entities = list(query(*args, **kwargs))  # answered now; handled once released
        answered.set()
        release.wait(10)
        return iter(entities)

    store._table.query_entities = held_back  # type: ignore[method-assign]
    slow = threading.Thread(target=store.get_vm_groups, args=(["pg:web"],))
    slow.start()
    assert answered.wait(10)
    store._table.query_entities = query  # type: ignore[method-assign]
    moved = a.model_copy(update={"lastSequence": 5})
    newest = store.save_vm_group(group("pg:web", moved), first)
    release.set()
    slow.join(10)

    assert store.get_vm_groups(["pg:web"], cached=True)["pg:web"] == Stored(group("pg:web", moved), newest)
