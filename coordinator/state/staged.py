"""The outbox's entities: history rows kept in the state until the history has them (``store.Staged``).

An entry's RowKey is ``!<id>`` (``entities.STAGED_MARK``: no event's or group's key begins with it), in the partition
of the record it was written with, so that one transaction holds both (an event's partition, a VM group's), or in
PartitionKey ``outbox`` when written alone. Pure, as entities.py: every store builds and reads entries here.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from pydantic import BaseModel

from coordinator.domain.rows import HistoryRow
from coordinator.state.entities import (
    EVENT_PARTITION,
    PARTITIONS,
    STAGED_MARK,
    VM_GROUP_PARTITION,
    Entity,
    Write,
    event_partition,
    group_partition,
    record_entity,
    record_from_entity,
    utf16_units,
)
from coordinator.state.store import Staged

OUTBOX_PARTITION = "outbox"
# An entry holds at most this many UTF-16 code units of rows, so that an event (at most 480,000) and its entry fit
# one transaction (entities.TRANSACTION_CHARS); more rows are cut into more entries (``staged_pieces``).
STAGED_CHARS = 400_000


class _StagedRows(BaseModel):
    """An outbox entry as stored."""

    near: str
    at: datetime
    rows: list[HistoryRow]


def staged_partition(near: str) -> str:
    """Where an outbox entry lives: with the record it was written with (``event:<EventId>``, ``group:<key>``), else
    in the outbox's own partition."""
    kind, _, key = near.partition(":")
    if kind == "event":
        return event_partition(key)
    if kind == "group":
        return group_partition(key)
    return OUTBOX_PARTITION


def staged_partitions() -> list[str]:
    """Every partition an outbox entry may live in."""
    return [
        *(f"{EVENT_PARTITION}-{n}" for n in range(PARTITIONS)),
        *(f"{VM_GROUP_PARTITION}-{n}" for n in range(PARTITIONS)),
        OUTBOX_PARTITION,
    ]


def staged_entity(staged: Staged) -> Entity:
    record = _StagedRows(near=staged.near, at=staged.at, rows=list(staged.rows))
    entity = record_entity(staged_partition(staged.near), staged.id, record, {"Staged": True})
    # Not through safe_key, which keeps every other key out of this range.
    entity["RowKey"] = STAGED_MARK + staged.id
    return entity


def staged_from_entity(entity: Entity) -> Staged:
    stored = record_from_entity(entity, _StagedRows, None).record
    return Staged(
        near=stored.near, id=str(entity["RowKey"]).removeprefix(STAGED_MARK), rows=tuple(stored.rows), at=stored.at
    )


def staged_pieces(near: str, rows: Sequence[HistoryRow], at: datetime) -> list[Staged]:
    """``rows`` as outbox entries near one record, each within ``STAGED_CHARS`` (a row alone past it raises
    ``RecordTooLarge`` when stored: the door bounds every field, so none is), each with an id of its own."""
    pieces: list[Staged] = []
    part: list[HistoryRow] = []
    size = 0
    for row in rows:
        units = _units(row)
        if part and size + units > STAGED_CHARS:
            pieces.append(Staged(near=near, id=uuid.uuid4().hex, rows=tuple(part), at=at))
            part, size = [], 0
        part.append(row)
        size += units
    if part:
        pieces.append(Staged(near=near, id=uuid.uuid4().hex, rows=tuple(part), at=at))
    return pieces


def _units(row: HistoryRow) -> int:
    """What a row takes of an entry (``STAGED_CHARS``): its JSON in UTF-16 code units and a separator."""
    return utf16_units(row.model_dump_json(exclude_defaults=True)) + 1


def with_staged(writes: list[Write], staged: Sequence[Staged], near: Callable[[BaseModel], str]) -> list[Write]:
    """The writes with each outbox entry placed right after the record it is near (``transactions`` keeps them in
    one transaction). An entry near no record of ``writes`` is refused: it would be written without its record."""
    by_near: dict[str, list[Staged]] = {}
    for entry in staged:
        by_near.setdefault(entry.near, []).append(entry)
    out: list[Write] = []
    for write in writes:
        out.append(write)
        for entry in by_near.pop(near(write[2]), []):
            # "*": over whatever is stored under its id (a store writes it If-Match *, refused if it is gone).
            etag = "*" if entry.replaces else None
            out.append((staged_entity(entry), etag, _StagedRows(near=entry.near, at=entry.at, rows=[])))
    if by_near:
        raise ValueError(f"outbox entries near {sorted(by_near)[:3]}, which this write does not write")
    return out


@dataclass
class Outbox:
    """A run's side of the outbox: its clock (``at``, every entry's time), and the entries it knows were stored
    (``written``: a write refused stores none, and one whose fate is unknown is left to the timer)."""

    at: datetime
    written: list[Staged] = field(default_factory=list)
    # Rows of these RecordTypes are not this write's to store (fold's event writes leave Observation rows to the VM
    # positions, which hold the sightings they describe).
    leave: frozenset[str] = frozenset()

    def pieces(self, near: str, rows: Sequence[HistoryRow]) -> list[Staged]:
        kept = [row for row in rows if row.RecordType not in self.leave]
        return staged_pieces(near, kept, self.at) if kept else []

    def joined(self, near: str, rows: Sequence[HistoryRow]) -> list[Staged]:
        """``pieces``, but added to the last entry this run stored near the same record when both fit one entry:
        written over it (``Staged.replaces``). An approval's outcome joins its decision's entry, and the tail deletes
        one entry per approval instead of two (benchmarks/wave_budgets.py: 500 deletes fewer a wave)."""
        kept = [row for row in rows if row.RecordType not in self.leave]
        entry = next((e for e in reversed(self.written) if e.near == near), None)
        if not kept or entry is None or sum(map(_units, (*entry.rows, *kept))) > STAGED_CHARS:
            return staged_pieces(near, kept, self.at) if kept else []
        return [Staged(near=near, id=entry.id, rows=(*entry.rows, *kept), at=entry.at, replaces=True)]

    def wrote(self, entries: Sequence[Staged]) -> None:
        """Notes ``entries`` stored: an entry written over another takes its place."""
        ids = {entry.id for entry in entries}
        self.written[:] = [entry for entry in self.written if entry.id not in ids]
        self.written.extend(entries)
