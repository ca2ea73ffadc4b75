"""A ``StateStore`` in memory, for fast tests of what runs on the store (commit, events, the stages).

It keeps the very entities ``TableStateStore`` would (coordinator/state/entities.py builds and reads both), so
the records that come back, the keys, the columns the queries read and the records refused as too large are the
same; what it adds is the table's behaviour: a fresh ETag per write, inserts refused when present, If-Match
updates and deletes, MERGE for VM groups, transactions all or nothing. It has no read cache (a cached read is
fresh, which the protocol allows). tests/coordinator/test_state_contract.py holds it to the same tests as the
real store on Azurite.

Here rather than in coordinator/state: nothing deployed or local runs on it (the local mode and the benchmarks run
Azurite, to be what Azure is), and coordinator/ ships whole in the Functions package.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from coordinator.domain.claims import BudgetRecord
from coordinator.domain.model import EventRecord, SentAlerts, VmGroupRecord
from coordinator.state.dead_letters import dead_letter_order, dead_letter_transactions, set_aside_letter
from coordinator.state.entities import (
    BUDGET_PARTITION,
    EVENT_PARTITION,
    KEY_PARTITION,
    SENT_ALERTS_PARTITION,
    SET_ASIDE_PARTITION,
    STAGED_MARK,
    VM_GROUP_PARTITION,
    Entity,
    Write,
    budget_entity,
    budget_from_entity,
    claim_entity,
    claim_from_entity,
    claim_name,
    claim_partition,
    decode,
    event_entity,
    event_from_entity,
    event_partition,
    group_entity,
    group_from_entity,
    group_partition,
    is_staged,
    key_entity,
    key_from_entity,
    partitions_of,
    revised,
    safe_key,
    sent_alerts_entity,
    sent_alerts_from_entity,
    set_aside_copy,
    transactions,
)
from coordinator.state.staged import (
    OUTBOX_PARTITION,
    staged_entity,
    staged_from_entity,
    staged_partition,
    staged_partitions,
    with_staged,
)
from coordinator.state.store import (
    Changed,
    ConcurrencyConflict,
    DeadLetter,
    R,
    SetAside,
    SetAsideLog,
    Staged,
    StateStore,
    Stored,
)

Key = tuple[str, str]
# Partitions that are one partition (the others are a kind spread over several: entities.partitions_of).
_SINGLE = frozenset({BUDGET_PARTITION, SENT_ALERTS_PARTITION, KEY_PARTITION, SET_ASIDE_PARTITION, OUTBOX_PARTITION})


class MemoryStateStore(StateStore):
    """The state in two dicts (the table and the dead letters), one lock: the stages run on threads."""

    def __init__(self) -> None:
        self._entities: dict[Key, tuple[Entity, str]] = {}
        self._dead_letters: dict[Key, Entity] = {}
        self._lock = threading.Lock()
        self._versions = itertools.count(1)
        self._set_aside = SetAsideLog()
        # When each entity was last written, by the store's clock (the table's Timestamp): strictly increasing.
        self._stamps: dict[Key, datetime] = {}
        self._clock = datetime.min.replace(tzinfo=UTC)

    def _new_etag(self, key: Key) -> str:
        # Under the lock: every write of any entity gets an ETag no entity had before, and a later Timestamp.
        self._clock = max(datetime.now(UTC), self._clock + timedelta(microseconds=1))
        self._stamps[key] = self._clock
        return f'W/"{next(self._versions)}"'

    def _changed(
        self,
        kind: str,
        since: datetime | None,
        parse: Callable[[Entity, str | None], Stored[R]],
        where: Callable[[Entity], bool],
    ) -> Changed[R]:
        low, high = partitions_of(kind)
        with self._lock:
            rows = [
                (dict(e), etag, self._stamps[key])
                for key, (e, etag) in sorted(self._entities.items())
                if low <= key[0] < high
                and not key[1].startswith(STAGED_MARK)
                and (since is None or self._stamps[key] >= since)
            ]
        rows = [row for row in rows if since is not None or where(row[0])]
        decoded = [self._decode(e, etag, parse) for e, etag, _ in rows]
        return Changed(
            [stored for stored in decoded if stored is not None], max((stamp for *_, stamp in rows), default=None)
        )

    # the table -----------------------------------------------------------------------------------------------
    def _get(
        self, partition_of: Callable[[str], str], keys: Iterable[str], parse: Callable[[Entity, str | None], Stored[R]]
    ) -> dict[str, Stored[R]]:
        wanted = list(keys)
        with self._lock:
            found = {k: self._entities.get((partition_of(k), safe_key(k))) for k in wanted}
        decoded = {k: self._decode(dict(hit[0]), hit[1], parse) for k, hit in found.items() if hit is not None}
        return {k: stored for k, stored in decoded.items() if stored is not None}

    def _scan(self, partition: str, where: Callable[[Entity], bool] = lambda _: True) -> list[tuple[Entity, str]]:
        """The entities of one partition, or of every partition of a kind (``partitions_of``, the outbox entries kept
        there left out), that ``where`` keeps, in (PartitionKey, RowKey) order (the table's)."""
        single = partition in _SINGLE
        low, high = (partition, partition + "\0") if single else partitions_of(partition)
        with self._lock:
            rows = [
                (dict(e), etag)
                for (p, r), (e, etag) in sorted(self._entities.items())
                if low <= p < high and (single or not r.startswith(STAGED_MARK))
            ]
        return [(e, etag) for e, etag in rows if where(e)]

    def _decoded(
        self, partition: str, parse: Callable[[Entity, str | None], Stored[R]], where: Callable[[Entity], bool]
    ) -> list[tuple[str, Stored[R]]]:
        decoded = [(str(e["RowKey"]), self._decode(e, etag, parse)) for e, etag in self._scan(partition, where)]
        return [(key, stored) for key, stored in decoded if stored is not None]

    # entities that cannot be read, as TableStateStore sets them aside -----------------------------------------
    def _decode(self, entity: Entity, etag: str, parse: Callable[[Entity, str | None], Stored[R]]) -> Stored[R] | None:
        stored = decode(entity, etag, parse)
        if not isinstance(stored, str):
            return stored
        key = (str(entity["PartitionKey"]), str(entity["RowKey"]))
        self._note(f"{key[0]}/{key[1]}", stored, entity, etag)
        with self._lock:
            copy = set_aside_copy(entity, stored, datetime.now(UTC))
            copy_key = (str(copy["PartitionKey"]), str(copy["RowKey"]))
            self._entities[copy_key] = (copy, self._new_etag(copy_key))
            if key in self._entities and self._entities[key][1] == etag:
                del self._entities[key]
        return None

    def _group(self, entity: Entity, etag: str | None) -> Stored[VmGroupRecord]:
        unreadable: dict[str, str] = {}
        stored = group_from_entity(entity, etag, unreadable)
        if not unreadable:
            return stored
        for name, reason in unreadable.items():
            self._note(
                f"{entity['PartitionKey']}/{entity['RowKey']} (a VM's position)", reason, {name: entity[name]}, etag
            )
        key = (str(entity["PartitionKey"]), str(entity["RowKey"]))
        with self._lock:
            if key not in self._entities or self._entities[key][1] != etag:
                return stored
            new_etag = self._new_etag(key)
            self._entities[key] = ({**self._entities[key][0], **dict.fromkeys(unreadable, "")}, new_etag)
        return Stored(stored.record, new_etag)

    def _note(self, what: str, reason: str, entity: Entity, etag: str | None) -> None:
        self.put_dead_letters([set_aside_letter(entity, etag, what, reason, datetime.now(UTC))])
        self._set_aside.add(what, reason)

    def set_aside(self) -> list[SetAside]:
        return self._set_aside.take()

    def _commit(self, writes: Sequence[Write], *, merge: bool = False) -> list[str]:
        """One transaction: every condition is checked before anything is written."""
        with self._lock:
            keys = [(str(e["PartitionKey"]), str(e["RowKey"])) for e, _, _ in writes]
            if len(set(keys)) < len(keys):
                raise ConcurrencyConflict("an entity can appear only once in a transaction")
            for key, (_, etag, _) in zip(keys, writes, strict=True):
                current = self._entities.get(key)
                # "*": over whatever is stored (If-Match *), refused only when nothing is.
                if (current is not None) if etag is None else (current is None or etag not in ("*", current[1])):
                    raise ConcurrencyConflict(f"{key[0]}/{key[1]} changed")
            etags = []
            for key, (entity, etag, _) in zip(keys, writes, strict=True):
                # MERGE keeps the properties not sent (a group's other VMs); a REPLACE, "*" or an insert does not.
                keep = merge and etag not in (None, "*")
                stored = {**self._entities[key][0], **entity} if keep else dict(entity)
                new_etag = self._new_etag(key)
                self._entities[key] = (stored, new_etag)
                etags.append(new_etag)
            return etags

    def _save_many(self, writes: list[Write], *, merge: bool = False) -> list[str]:
        etags: dict[int, str] = {}
        for positions in transactions(writes):
            for index, etag in zip(positions, self._commit([writes[i] for i in positions], merge=merge), strict=True):
                etags[index] = etag
        return [etags[i] for i in range(len(writes))]

    def _save_with_staged(
        self, writes: list[Write], staged: Sequence[Staged], near: Callable[[Any], str], *, merge: bool = False
    ) -> list[str]:
        together = with_staged(writes, staged, near)
        etags = self._save_many(together, merge=merge)
        return [etag for write, etag in zip(together, etags, strict=True) if not is_staged(write)]

    # events --------------------------------------------------------------------------------------------------
    def get_events(self, event_ids: Iterable[str], *, cached: bool = False) -> dict[str, Stored[EventRecord]]:
        return self._get(event_partition, event_ids, event_from_entity)

    def get_event(self, event_id: str) -> Stored[EventRecord] | None:
        return self.get_events([event_id]).get(event_id)

    def _events(self, where: Callable[[Entity], bool]) -> list[Stored[EventRecord]]:
        return [stored for _, stored in self._decoded(EVENT_PARTITION, event_from_entity, where)]

    def open_events(self) -> list[Stored[EventRecord]]:
        return self._events(lambda e: e["Open"] is True)

    def events_changed_since(self, since: datetime | None) -> Changed[EventRecord]:
        return self._changed(
            EVENT_PARTITION, since, event_from_entity, lambda e: e["Open"] is True or e.get("Returning") is True
        )

    def closed_events_with_pending_alerts(self) -> list[Stored[EventRecord]]:
        return self._events(lambda e: e["Open"] is False and e["Pending"] is True)

    def concluded_events_before(self, cutoff: datetime) -> list[Stored[EventRecord]]:
        return self._events(lambda e: e["Open"] is False and e["Pending"] is False and e["StateSince"] < cutoff)

    def save_event(self, record: EventRecord, etag: str | None, *, staged: Sequence[Staged] = ()) -> str:
        return self.save_events([(record, etag)], staged=staged)[0]

    def save_events(
        self, items: Sequence[tuple[EventRecord, str | None]], *, staged: Sequence[Staged] = ()
    ) -> list[str]:
        writes: list[Write] = [(event_entity(revised(r)), e, r) for r, e in items]
        return self._save_with_staged(writes, staged, lambda r: f"event:{r.eventId}")

    def delete_events(self, items: Sequence[tuple[str, str | None]]) -> int:
        deleted = 0
        for event_id, etag in items:
            if etag is None:
                raise ValueError("IfNotModified must be specified with etag.")  # as azure-data-tables says
            key = (event_partition(event_id), safe_key(event_id))
            with self._lock:
                current = self._entities.get(key)
                if current is not None and current[1] != etag:
                    continue
                self._entities.pop(key, None)
            deleted += 1
        return deleted

    # VM groups -----------------------------------------------------------------------------------------------
    def get_vm_groups(self, keys: Iterable[str], *, cached: bool = False) -> dict[str, Stored[VmGroupRecord]]:
        return self._get(group_partition, keys, self._group)

    def all_vm_groups(self) -> list[Stored[VmGroupRecord]]:
        return [stored for _, stored in self._decoded(VM_GROUP_PARTITION, self._group, lambda _: True)]

    def vm_groups_changed_since(self, since: datetime | None) -> Changed[VmGroupRecord]:
        return self._changed(VM_GROUP_PARTITION, since, self._group, lambda _: True)

    def prune_vm_group(self, record: VmGroupRecord, etag: str) -> str | None:
        if record.vms:
            return self._commit([(group_entity(record), etag, record)])[0]
        key = (group_partition(record.group), safe_key(record.group))
        with self._lock:
            current = self._entities.get(key)
            if current is None or current[1] != etag:
                raise ConcurrencyConflict(f"{key[0]}/{key[1]} changed")
            del self._entities[key]
        return None

    def save_vm_groups(
        self,
        items: Sequence[tuple[VmGroupRecord, str | None, Iterable[str] | None]],
        *,
        staged: Sequence[Staged] = (),
    ) -> list[str]:
        writes: list[Write] = [(group_entity(r, None if e is None else v), e, r) for r, e, v in items]
        return self._save_with_staged(writes, staged, lambda r: f"group:{r.group}", merge=True)

    # the outbox ----------------------------------------------------------------------------------------------
    def stage(self, staged: Sequence[Staged]) -> None:
        for entry in staged:
            self._commit([(staged_entity(entry), None, VmGroupRecord(group=""))])

    def outbox(self) -> list[Staged]:
        found: list[Staged] = []
        for partition in staged_partitions():
            with self._lock:
                entities = [
                    dict(e)
                    for (p, r), (e, _) in sorted(self._entities.items())
                    if p == partition and r.startswith(STAGED_MARK)
                ]
            found.extend(staged_from_entity(entity) for entity in entities)
        return sorted(found, key=lambda entry: entry.at)

    def unstage(self, staged: Iterable[Staged]) -> None:
        with self._lock:
            for entry in staged:
                self._entities.pop((staged_partition(entry.near), STAGED_MARK + entry.id), None)

    # budgets -------------------------------------------------------------------------------------------------
    def get_budget(self, scale_set: str) -> Stored[BudgetRecord] | None:
        with self._lock:
            hit = self._entities.get((BUDGET_PARTITION, safe_key(scale_set)))
        return budget_from_entity(dict(hit[0]), hit[1]) if hit is not None else None

    def budget_etag(self, scale_set: str) -> str | None:
        with self._lock:
            hit = self._entities.get((BUDGET_PARTITION, safe_key(scale_set)))
        return hit[1] if hit is not None else None

    def save_budget(self, record: BudgetRecord, etag: str | None) -> str:
        return self._commit([(budget_entity(record), etag, record)])[0]

    def save_budgets(self, writes: Sequence[tuple[BudgetRecord, str | None]]) -> list[str]:
        return self._save_many([(budget_entity(record), etag, record) for record, etag in writes])

    def budgets(self) -> list[Stored[BudgetRecord]]:
        return [budget_from_entity(e, etag) for e, etag in self._scan(BUDGET_PARTITION)]

    def delete_budget(self, key: str, etag: str) -> bool:
        with self._lock:
            current = self._entities.get((BUDGET_PARTITION, safe_key(key)))
            if current is not None and current[1] != etag:
                return False
            self._entities.pop((BUDGET_PARTITION, safe_key(key)), None)
        return True

    # sent cards ----------------------------------------------------------------------------------------------
    def log_sent_alerts(self, record: SentAlerts) -> None:
        self._commit([(sent_alerts_entity(record), None, record)])

    def sent_alert_logs(self) -> list[tuple[str, SentAlerts]]:
        logs = self._decoded(SENT_ALERTS_PARTITION, sent_alerts_from_entity, lambda _: True)
        return [(key, stored.record) for key, stored in logs]

    def delete_sent_alert_logs(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                self._entities.pop((SENT_ALERTS_PARTITION, key), None)

    # keys and dead letters -----------------------------------------------------------------------------------
    def shared_key(self, name: str) -> bytes:
        with self._lock:
            key = (KEY_PARTITION, safe_key(name))
            if key not in self._entities:
                self._entities[key] = (key_entity(name), self._new_etag(key))
            entity = self._entities[key][0]
        return key_from_entity(entity)

    def claim(self, name: str, value: str) -> str:
        with self._lock:
            key = (claim_partition(name), safe_key(name))
            if key not in self._entities:
                self._entities[key] = (claim_entity(name, value), self._new_etag(key))
            return claim_from_entity(self._entities[key][0])

    def claimed(self, name: str) -> str | None:
        with self._lock:
            found = self._entities.get((claim_partition(name), safe_key(name)))
        return claim_from_entity(found[0]) if found else None

    def claims_in(self, partition: str) -> dict[str, str]:
        with self._lock:
            found = [e for (p, _), (e, _) in self._entities.items() if p == partition]
        return {name: claim_from_entity(e) for e in found if (name := claim_name(e)) is not None}

    def claim_many(self, items: Sequence[tuple[str, str]]) -> dict[str, str]:
        # Each transaction's outcome, once its refused claims are left out, is each claim's alone.
        return {name: self.claim(name, value) for name, value in dict(items).items()}

    def put_dead_letters(self, letters: Sequence[DeadLetter]) -> None:
        for part in dead_letter_transactions(letters):
            with self._lock:
                self._dead_letters.update({(e["PartitionKey"], e["RowKey"]): dict(e) for e in part})

    def dead_letters(self) -> list[dict[str, Any]]:
        with self._lock:
            return sorted((dict(e) for e in self._dead_letters.values()), key=dead_letter_order)
