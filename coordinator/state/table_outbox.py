"""The outbox in Table Storage, mixed into ``TableStateStore`` (tables.py): the writes of events and VM groups with
the outbox entries near them (one transaction each: ``staged.with_staged``), and the outbox's own writes, reads and
deletes. Entries live in the ``!`` range of their partition (``staged.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from azure.data.tables import TableTransactionError, UpdateMode

from coordinator.domain.model import EventRecord, VmGroupRecord
from coordinator.state.entities import (
    PAST_STAGED,
    STAGED_MARK,
    TRANSACTION_LIMIT,
    Write,
    chunks,
    event_entity,
    group_entity,
    is_staged,
    revised,
)
from coordinator.state.staged import staged_entity, staged_from_entity, staged_partition, staged_partitions, with_staged
from coordinator.state.store import Staged
from coordinator.state.table_parts import TableParts


class TableOutbox(TableParts):
    """What ``TableStateStore`` does with the outbox; it gives the table and its writes."""

    def _set_aside_entity(self, entity: Any, reason: str) -> None:
        raise NotImplementedError

    def _save_with_staged(
        self, writes: list[Write], staged: Sequence[Staged], near: Callable[[Any], str], mode: UpdateMode
    ) -> list[str]:
        """The records' writes with the outbox entries near them, in their transactions; the records' new ETags."""
        if not staged:
            return self._save_many(writes, mode=mode)
        together = with_staged(writes, staged, near)
        etags = self._save_many(together, mode=mode)
        return [etag for write, etag in zip(together, etags, strict=True) if not is_staged(write)]

    def save_event(self, record: EventRecord, etag: str | None, *, staged: Sequence[Staged] = ()) -> str:
        if not staged:
            return self._save_one((event_entity(revised(record)), etag, record))
        return self.save_events([(record, etag)], staged=staged)[0]

    def save_events(
        self, items: Sequence[tuple[EventRecord, str | None]], *, staged: Sequence[Staged] = ()
    ) -> list[str]:
        writes: list[Write] = [(event_entity(revised(r)), e, r) for r, e in items]
        return self._save_with_staged(writes, staged, lambda r: f"event:{r.eventId}", UpdateMode.REPLACE)

    def save_vm_groups(
        self,
        items: Sequence[tuple[VmGroupRecord, str | None, Iterable[str] | None]],
        *,
        staged: Sequence[Staged] = (),
    ) -> list[str]:
        # ``record`` is the whole group as it is after the write (kept in the cache); only ``vm_ids`` are sent.
        writes: list[Write] = [(group_entity(r, None if e is None else v), e, r) for r, e, v in items]
        return self._save_with_staged(writes, staged, lambda r: f"group:{r.group}", UpdateMode.MERGE)

    def stage(self, staged: Sequence[Staged]) -> None:
        for entry in staged:
            self._table.create_entity(staged_entity(entry))

    def outbox(self) -> list[Staged]:
        found: list[Staged] = []
        for partition in staged_partitions():
            entities = self._table.query_entities(
                "PartitionKey eq @pk and RowKey ge @mark and RowKey lt @past",
                parameters={"pk": partition, "mark": STAGED_MARK, "past": PAST_STAGED},
            )
            for entity in entities:
                try:
                    found.append(staged_from_entity(entity))
                except Exception as error:  # the entry's alone: set aside as any entity that cannot be read
                    self._set_aside_entity(entity, f"{type(error).__name__}: {str(error)[:500]}")
        return sorted(found, key=lambda entry: entry.at)

    def unstage(self, staged: Iterable[Staged]) -> None:
        by_partition: dict[str, list[str]] = {}
        for entry in staged:
            by_partition.setdefault(staged_partition(entry.near), []).append(STAGED_MARK + entry.id)
        for partition, keys in by_partition.items():
            for chunk in chunks(list(dict.fromkeys(keys)), TRANSACTION_LIMIT):
                deletes: list[Any] = [("delete", {"PartitionKey": partition, "RowKey": key}) for key in chunk]
                try:
                    self._table.submit_transaction(deletes)
                except TableTransactionError as error:
                    if error.status_code != 404:
                        raise
                    # One is gone already (the timer and a tail both wrote its rows): one by one, where the SDK
                    # answers a delete of a gone entity as done.
                    for key in chunk:
                        self._table.delete_entity(partition, key)
