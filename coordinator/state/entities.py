"""How the coordinator's records are laid out as Table Storage entities, both ways, and cut into transactions.

Layout (one table):
- PartitionKey ``event-<n>`` (``event_partition``: n a hash of the EventId), RowKey = EventId: the merged
  EventRecord as JSON, plus ``State``/``Open`` for queries.
- PartitionKey ``budget``, RowKey = scale set: the fleet-wide claims on its "at most N impacted" budget.
- PartitionKey ``alertsent``: one entity per batch that sent cards, naming them; the timer clears those
  outbox entries from the events in bulk and deletes the entity (one write per batch instead of one per event).
- PartitionKey ``key``, RowKey = a name: random keys every instance shares (``shared_key``).
- PartitionKey ``vmgroup-<n>`` (``group_partition``: n a hash of the group's key), RowKey = placement group (or
  scale set, or lone VM): every VM's position (last sequence/incarnation, listed events, last seen) and its
  sighting of each event in one entity, since a group's VMs report together. An event record's ``vms`` is
  assembled from its groups on read (events.assemble).
Events and VM groups are each spread over ``PARTITIONS`` partitions: Table Storage serves about 2,000 entity
operations per second per partition, and one partition per kind put every event (and every group) of a
100,000-VM wave on one server's share. A batch writes its events (or groups) in one transaction per partition (at
most 100 operations, all-or-nothing: if any ETag is stale nothing of it is written and the caller redoes).
Dead letters go to a second table, one row per refused message, one partition per day.

Pure: every store builds and reads its entities here (TableStateStore, and the in-memory store of the tests), so
what is stored and how it is read back cannot drift apart, and every store refuses the same records as too large.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import uuid
import zlib
from collections.abc import Iterable, Iterator, Sequence
from datetime import UTC
from typing import Any

from pydantic import BaseModel

from coordinator.domain.model import BudgetRecord, EventRecord, SentAlerts, VmGroupRecord, VmRecord
from coordinator.state.store import DeadLetter, R, RecordTooLarge, Stored

EVENT_PARTITION = "event"
VM_GROUP_PARTITION = "vmgroup"
# Partitions per kind. More spreads the load further but cuts a batch's writes into more transactions (each a
# request): a 10,000-VM wave batch of 100 envelopes writes about 30 groups and 25 events, so 4 partitions keep about
# 8 groups per transaction, and a 100,000-VM wave's busiest partition at a quarter of the table's operations
# (benchmarks/wave.py prints the busiest partition's rate).
PARTITIONS = 4
BUDGET_PARTITION = "budget"
SENT_ALERTS_PARTITION = "alertsent"
KEY_PARTITION = "key"
TRANSACTION_LIMIT = 100
TRANSACTION_CHARS = 3_000_000
# A string property holds at most 64 KiB (32K UTF-16 code units); larger records are split over Data0..DataN.
CHUNK_CHARS = 30_000
MAX_CHUNKS = 30
VM_PROPERTY_PREFIX = "V_"
# A dead letter keeps the body's first 16 KiB (base64: 21,848 characters), the reason and source up to 8,000
# characters each: every property fits a string property and the entity its 1 MiB, however large the message.
DEAD_LETTER_BODY = 16 * 1024
DEAD_LETTER_TEXT = 8000
_BAD_KEY = re.compile(r"[/\\#?\x00-\x1f\x7f-\x9f]")

Entity = dict[str, Any]
# One entity to write: the entity, the ETag it is conditional on (None: insert), and the record it holds.
Write = tuple[Entity, str | None, BaseModel]


def event_partition(event_id: str) -> str:
    """The partition an event lives in: from its id alone, so that every instance finds (and creates) it there."""
    return f"{EVENT_PARTITION}-{zlib.crc32(event_id.encode('utf-8')) % PARTITIONS}"


def group_partition(group: str) -> str:
    """The partition a VM group lives in, from its key."""
    return f"{VM_GROUP_PARTITION}-{zlib.crc32(group.encode('utf-8')) % PARTITIONS}"


def partitions_of(kind: str) -> tuple[str, str]:
    """The range of PartitionKeys of one kind (``ge`` the first, ``lt`` the second): every partition of it."""
    return f"{kind}-", f"{kind}."


def safe_key(value: str) -> str:
    """A table key for an id that may hold characters Table Storage forbids (ids come from untrusted input)."""
    if value and len(value) <= 200 and not _BAD_KEY.search(value):
        return value
    digest = hashlib.sha256(value.encode("utf-8")).hexdigest()[:16]
    return _BAD_KEY.sub("_", value[:150]) + "~" + digest


def record_entity(
    partition: str, key: str, record: BaseModel, extra: dict[str, Any], *, exclude: set[str] | None = None
) -> Entity:
    data = record.model_dump_json(exclude_defaults=True, exclude=exclude)
    chunks = [data[i : i + CHUNK_CHARS] for i in range(0, len(data), CHUNK_CHARS)] or [""]
    if len(chunks) > MAX_CHUNKS:
        raise RecordTooLarge(f"record {partition}/{key} is {len(data)} characters; the entity limit is 1 MiB")
    entity: Entity = {"PartitionKey": partition, "RowKey": safe_key(key), "Chunks": len(chunks)}
    entity.update({f"Data{i}": chunk for i, chunk in enumerate(chunks)})
    entity.update(extra)
    return entity


def record_from_entity(entity: Entity, model: type[R], etag: str | None) -> Stored[R]:
    chunks = int(entity.get("Chunks", 1))
    data = "".join(str(entity[f"Data{i}"]) for i in range(chunks))
    return Stored(model.model_validate_json(data), etag)


def event_entity(record: EventRecord) -> Entity:
    return record_entity(
        event_partition(record.eventId),
        record.eventId,
        record,
        # Columns for the queries (open events, pending cards, housekeeping).
        {
            "State": record.state,
            "Open": record.open,
            "EventType": record.eventType,
            "Pending": bool(record.pendingAlerts),
            "StateSince": record.stateSince,
        },
        # The per-VM sightings are stored with each VM's position (VmGroupRecord), not here.
        exclude={"vms"},
    )


def event_from_entity(entity: Entity, etag: str | None) -> Stored[EventRecord]:
    return record_from_entity(entity, EventRecord, etag)


def budget_entity(record: BudgetRecord) -> Entity:
    return record_entity(BUDGET_PARTITION, record.scaleSet, record, {})


def budget_from_entity(entity: Entity, etag: str | None) -> Stored[BudgetRecord]:
    return record_from_entity(entity, BudgetRecord, etag)


def _vm_property(vm_id: str) -> str:
    """The property that holds one VM of a group (a VM id comes from input: hashed into a valid property name)."""
    return VM_PROPERTY_PREFIX + hashlib.blake2b(vm_id.encode("utf-8"), digest_size=10).hexdigest()


def _vm_json(vm: VmRecord) -> str:
    data = vm.model_dump_json(exclude_defaults=True)
    if len(data) <= CHUNK_CHARS:
        return data
    # Sightings of events the VM no longer lists are kept only for a week's "gone" checks: drop the oldest of
    # them rather than refuse the VM's position (its listed events, at most 100, always fit).
    kept = dict(vm.sightings)
    for event_id, _ in sorted(kept.items(), key=lambda item: item[1].lastSeen):
        if len(data) <= CHUNK_CHARS:
            break
        if event_id not in vm.listed:
            del kept[event_id]
            data = vm.model_copy(update={"sightings": kept}).model_dump_json(exclude_defaults=True)
    if len(data) > CHUNK_CHARS:
        raise RecordTooLarge(f"VM {vm.identity.name}'s position is {len(data)} characters; a property holds 30,000")
    return data


def group_entity(record: VmGroupRecord, vm_ids: Iterable[str] | None = None) -> Entity:
    """One property per VM, so that a write can MERGE just the VMs it moved (a batch moves a few of a group's
    VMs: the rest of the group is neither serialized nor sent)."""
    entity: Entity = {
        "PartitionKey": group_partition(record.group),
        "RowKey": safe_key(record.group),
        "Group": record.group,
        "Vms": len(record.vms),
    }
    for vm_id in record.vms if vm_ids is None else vm_ids:
        entity[_vm_property(vm_id)] = _vm_json(record.vms[vm_id])
    return entity


def group_from_entity(entity: Entity, etag: str | None) -> Stored[VmGroupRecord]:
    vms = {}
    for name, value in entity.items():
        if name.startswith(VM_PROPERTY_PREFIX):
            vm = VmRecord.model_validate_json(str(value))
            vms[vm.identity.vmId.lower()] = vm
    return Stored(VmGroupRecord(group=str(entity["Group"]), vms=vms), etag)


def sent_alerts_entity(record: SentAlerts) -> Entity:
    # Keys sort by when the cards were sent; the random tail keeps two batches of one microsecond apart.
    key = f"{record.sentAt.astimezone(UTC).strftime('%Y%m%dT%H%M%S%f')}-{uuid.uuid4().hex[:12]}"
    return record_entity(SENT_ALERTS_PARTITION, key, record, {})


def sent_alerts_from_entity(entity: Entity) -> tuple[str, SentAlerts]:
    return str(entity["RowKey"]), record_from_entity(entity, SentAlerts, None).record


def key_entity(name: str) -> Entity:
    """A new random 32-byte key named ``name`` (kept only if no instance created one first)."""
    return {"PartitionKey": KEY_PARTITION, "RowKey": safe_key(name), "Key": base64.b64encode(os.urandom(32)).decode()}


def key_from_entity(entity: Entity) -> bytes:
    return base64.b64decode(entity["Key"])


def dead_letter_entity(letter: DeadLetter) -> Entity:
    """The reason, the source, the body's first 16 KiB as base64, and the SHA-256 and size that identify the whole
    message, however large it was."""
    received = letter.received_at.astimezone(UTC)
    return {
        "PartitionKey": received.strftime("%Y-%m-%d"),
        "RowKey": f"{received.strftime('%H%M%S%f')}-{uuid.uuid4().hex[:12]}",
        "Reason": letter.reason[:DEAD_LETTER_TEXT],
        "Source": json.dumps(letter.source, default=str)[:DEAD_LETTER_TEXT],
        "BodyBase64": base64.b64encode(letter.body[:DEAD_LETTER_BODY]).decode("ascii"),
        "BodyBytes": len(letter.body),
        "BodySha256": hashlib.sha256(letter.body).hexdigest(),
    }


def dead_letter_transactions(letters: Sequence[DeadLetter]) -> Iterator[list[Entity]]:
    """The dead letters' entities in transactions: one partition (day) each, at most 100 entities."""
    by_day: dict[str, list[Entity]] = {}
    for letter in letters:
        entity = dead_letter_entity(letter)
        by_day.setdefault(entity["PartitionKey"], []).append(entity)
    for entities in by_day.values():
        for start in range(0, len(entities), TRANSACTION_LIMIT):
            yield entities[start : start + TRANSACTION_LIMIT]


def _entity_chars(entity: Entity) -> int:
    return sum(len(str(value)) for value in entity.values())


def transactions(items: list[Write]) -> Iterator[list[int]]:
    """Cuts writes into transactions, given as positions in ``items``: one partition each (a transaction cannot
    span two), at most 100 operations and about 3 MB (the service's limit is 4 MiB); partitions in the order they
    first appear."""
    by_partition: dict[str, list[int]] = {}
    for index, item in enumerate(items):
        by_partition.setdefault(str(item[0]["PartitionKey"]), []).append(index)
    for positions in by_partition.values():
        part: list[int] = []
        size = 0
        for index in positions:
            chars = _entity_chars(items[index][0])
            if part and (len(part) == TRANSACTION_LIMIT or size + chars > TRANSACTION_CHARS):
                yield part
                part, size = [], 0
            part.append(index)
            size += chars
        if part:
            yield part


def chunks(items: Sequence[str], size: int) -> Iterator[Sequence[str]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]
