"""How the coordinator's records are laid out as Table Storage entities, both ways, and cut into transactions.

Layout (one table):
- PartitionKey ``event-<n>`` (``event_partition``: n a hash of the EventId), RowKey = EventId: the merged
  EventRecord as JSON, plus ``State``/``Open`` for queries.
- PartitionKey ``budget``, RowKey = scale set: the fleet-wide claims on its "at most N impacted" budget.
- PartitionKey ``alertsent``: one entity per batch that sent cards, naming them; the timer clears those
  outbox entries from the events in bulk and deletes the entity (one write per batch instead of one per event).
- PartitionKey ``key``, RowKey = a name: random keys every instance shares (``shared_key``).
- PartitionKey ``claim-<n>`` (``claim_partition``: n a hash of the name), RowKey = a name: a value bound to it for
  good, first writer wins (``claim``), and the name itself (a RowKey may be a digest of it).
- PartitionKey ``vmgroup-<n>`` (``group_partition``: n a hash of the group's key), RowKey = placement group (or
  scale set, or lone VM): every VM's position (last sequence/incarnation, listed events, last seen) and its
  sighting of each event in one entity, since a group's VMs report together. An event record's ``vms`` is
  assembled from its groups on read (events.assemble).
- The outbox (``staged.py``): history rows kept until the history has them, RowKey ``!<id>`` (no event's or group's
  key begins with ``!``: ``safe_key``), in the partition of the record they were written with (an event's, a VM
  group's: one transaction holds both) or in PartitionKey ``outbox`` when written alone. Reads of events and
  groups leave the ``!`` range out.
- PartitionKey ``setaside``: whole entities a read could not decode, copied here as they were (with ``Reason``,
  ``FromPartition``, ``FromRowKey``) before they were deleted; never read by the pipeline, kept for a person.
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
import os
import re
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

from azure.core.exceptions import HttpResponseError
from pydantic import BaseModel

from coordinator.domain.claims import BudgetRecord
from coordinator.domain.model import EventRecord, SentAlerts, VmGroupRecord, VmRecord
from coordinator.state.store import R, RecordTooLarge, Stored

T = TypeVar("T")

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
CLAIM_PARTITION = "claim"
# Four claims a VM, bound when its first attested envelope arrives: a batch's new VMs are written in one transaction
# per partition, and an instance reads a partition whole to know which names are free (domain/bindings.py). 8 keeps
# a 200-envelope batch of new VMs at about 100 claims a partition (one transaction each), and a 100,000-VM fleet's
# 400,000 claims at 50,000 a partition.
CLAIM_PARTITIONS = 8
SET_ASIDE_PARTITION = "setaside"
# The first character of an outbox entry's RowKey, and the one after it: the range reads of the outbox take and
# reads of events and groups leave out.
STAGED_MARK = "!"
PAST_STAGED = chr(ord(STAGED_MARK) + 1)
TRANSACTION_LIMIT = 100
TRANSACTION_CHARS = 3_000_000
# Table Storage keeps strings as UTF-16: a string property holds 64 KiB, 32,768 code units (a character beyond the
# BMP takes two), and an entity 1 MiB. Records are cut into properties of CHUNK_CHARS code units (Data0..DataN),
# at most MAX_CHUNKS of them: 16 x 30,000 x 2 bytes leaves room for the keys and columns within 1 MiB.
CHUNK_CHARS = 30_000
MAX_CHUNKS = 16
VM_PROPERTY_PREFIX = "V_"
# A VM's position longer than a property is split: its property holds "#<parts>#" and the first part, the others
# follow as W_<hash>_<n> (not V_: a reader of the group's VMs skips them). Stale parts left by a longer position
# are never read (the count says how many). At most MAX_VM_PARTS, so that one VM cannot fill its group's entity:
# the largest position a forwarder can report (100 listed events with their sightings, 50 tags of 512 + 256
# characters) is about 120,000 code units, 4 parts.
VM_PART_PREFIX = "W_"
MAX_VM_PARTS = 6
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
    """A table key for an id that may hold characters Table Storage forbids (ids come from untrusted input). None
    begins with ``STAGED_MARK`` (the outbox's range)."""
    if value and len(value) <= 200 and not _BAD_KEY.search(value) and not value.startswith(STAGED_MARK):
        return value
    digest = hashlib.sha256(value.encode("utf-8")).hexdigest()[:16]
    head = _BAD_KEY.sub("_", value[:150])
    return ("_" + head[1:] if head.startswith(STAGED_MARK) else head) + "~" + digest


def utf16_units(text: str) -> int:
    """How much of a property ``text`` takes: UTF-16 code units (two for a character beyond the BMP)."""
    return len(text) if text.isascii() else len(text.encode("utf-16-le")) // 2


def split_units(text: str, size: int = CHUNK_CHARS) -> list[str]:
    """``text`` cut into pieces of at most ``size`` UTF-16 code units (never inside a character)."""
    if text.isascii():
        return [text[i : i + size] for i in range(0, len(text), size)] or [""]
    pieces, start, units = [], 0, 0
    for index, char in enumerate(text):
        width = 2 if ord(char) > 0xFFFF else 1
        if units + width > size:
            pieces.append(text[start:index])
            start, units = index, 0
        units += width
    pieces.append(text[start:])
    return pieces


def record_entity(
    partition: str, key: str, record: BaseModel, extra: dict[str, Any], *, exclude: set[str] | None = None
) -> Entity:
    data = record.model_dump_json(exclude_defaults=True, exclude=exclude)
    chunks = split_units(data)
    if len(chunks) > MAX_CHUNKS:
        raise RecordTooLarge(
            f"record {partition}/{key} is {utf16_units(data)} UTF-16 code units; an entity holds 1 MiB "
            f"({MAX_CHUNKS} properties of {CHUNK_CHARS})"
        )
    entity: Entity = {"PartitionKey": partition, "RowKey": safe_key(key), "Chunks": len(chunks)}
    entity.update({f"Data{i}": chunk for i, chunk in enumerate(chunks)})
    entity.update(extra)
    return entity


def record_from_entity(entity: Entity, model: type[R], etag: str | None) -> Stored[R]:
    chunks = int(entity.get("Chunks", 1))
    data = "".join(str(entity[f"Data{i}"]) for i in range(chunks))
    return Stored(model.model_validate_json(data), etag)


def revised(record: EventRecord) -> EventRecord:
    """The record as a write stores it: one revision past the one it was read at (``EventRecord.revision``). Set on
    the record itself, which every writer has just made (a change works on a copy, ``lifecycle.clone``), so that
    what the writer keeps is what was stored."""
    record.revision += 1
    return record


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
            # Cards to send, an outcome to record, VMs to see back: the timer keeps the event in view once concluded.
            "Pending": bool(record.pendingAlerts) or record.awaiting_outcome or bool(record.returning),
            # VMs not back in service yet (domain/returns.py): they hold budget, so the fleet cache loads the event.
            "Returning": bool(record.returning),
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


def vm_json(vm: VmRecord) -> str:
    """A VM's position as stored: whole, or without what it keeps only for convenience when that would pass
    MAX_VM_PARTS properties. Trimmed, in this order: its sightings of events it no longer lists, oldest first (kept a
    week for the "gone from every VM" check; the events concluded long before), then the forwarder states it left,
    longest ago first (one that speaks again is taken for a new state, as after PAST_STATES). Never its identity,
    tags, listed events or their sightings: what a decision reads. Raises ``RecordTooLarge`` naming the VM when
    those alone pass the bound (only a forwarder beyond every bound of the envelope's door can send that)."""
    data = vm.model_dump_json(exclude_defaults=True)
    limit = MAX_VM_PARTS * CHUNK_CHARS
    excess = utf16_units(data) - limit
    if excess <= 0:
        return data
    kept, others = dict(vm.sightings), dict(vm.otherStates)
    droppable = [("sighting", e) for e, _ in sorted(kept.items(), key=lambda i: i[1].lastSeen) if e not in vm.listed]
    droppable += [("state", state_id) for state_id, _ in sorted(others.items(), key=lambda i: i[1].lastSeen)]
    for kind, name in droppable:
        dropped = kept.pop(name) if kind == "sighting" else others.pop(name)
        # An estimate ("name":{...},), measured once it says enough was dropped; trimmed further if it falls short.
        excess -= utf16_units(dropped.model_dump_json(exclude_defaults=True)) + utf16_units(name) + 4
        if excess <= 0:
            data = vm.model_copy(update={"sightings": kept, "otherStates": others}).model_dump_json(
                exclude_defaults=True
            )
            excess = utf16_units(data) - limit
            if excess <= 0:
                return data
    data = vm.model_copy(update={"sightings": kept, "otherStates": others}).model_dump_json(exclude_defaults=True)
    raise RecordTooLarge(
        f"VM {vm.identity.name[:64]}'s position is {utf16_units(data)} UTF-16 code units without what can be "
        f"trimmed; at most {limit} ({MAX_VM_PARTS} properties) are kept per VM"
    )


def vm_properties(vm: VmRecord) -> dict[str, str]:
    """The properties that hold one VM of its group: one, or its position split over several (``vm_json``)."""
    name = _vm_property(vm.identity.vmId.lower())
    data = vm_json(vm)
    if utf16_units(data) <= CHUNK_CHARS:
        return {name: data}
    parts = split_units(data, CHUNK_CHARS - 8)  # room for the count before the first part
    suffix = name.removeprefix(VM_PROPERTY_PREFIX)
    properties = {name: f"#{len(parts)}#{parts[0]}"}
    properties.update({f"{VM_PART_PREFIX}{suffix}_{n}": part for n, part in enumerate(parts[1:], start=1)})
    return properties


def _vm_value(entity: Entity, name: str) -> str:
    """A VM's position as stored under property ``name``, its parts joined."""
    value = str(entity[name])
    if not value.startswith("#"):
        return value
    count, _, first = value[1:].partition("#")
    suffix = name.removeprefix(VM_PROPERTY_PREFIX)
    return first + "".join(str(entity[f"{VM_PART_PREFIX}{suffix}_{n}"]) for n in range(1, int(count)))


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
        entity.update(vm_properties(record.vms[vm_id]))
    return entity


def group_from_entity(
    entity: Entity, etag: str | None, unreadable: dict[str, str] | None = None
) -> Stored[VmGroupRecord]:
    """The group with every VM whose property reads as a position; those that do not are left out, and put in
    ``unreadable`` (property -> why) when given, else raise. A blanked property ("") is a VM set aside."""
    vms = {}
    for name, value in entity.items():
        if name.startswith(VM_PROPERTY_PREFIX) and value != "":
            try:
                vm = VmRecord.model_validate_json(_vm_value(entity, name))
            except (ValueError, KeyError) as error:
                if unreadable is None:
                    raise
                unreadable[name] = _why(error)
                continue
            vms[vm.identity.vmId.lower()] = vm
    return Stored(VmGroupRecord(group=str(entity["Group"]), vms=vms), etag)


def _why(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error)[:500]}"


def set_aside_copy(entity: Entity, reason: str, at: datetime) -> Entity:
    """The whole entity as it was, under partition ``setaside``, with why and where from: a person can read it
    and, once the cause is fixed, put it back."""
    origin = f"{entity['PartitionKey']}~{entity['RowKey']}~{at.astimezone(UTC).strftime('%Y%m%dT%H%M%S%f')}"
    copy = {name: value for name, value in entity.items() if name not in ("PartitionKey", "RowKey")}
    return {
        **copy,
        "PartitionKey": SET_ASIDE_PARTITION,
        "RowKey": safe_key(origin),
        "Reason": reason[:DEAD_LETTER_TEXT],
        "FromPartition": str(entity["PartitionKey"]),
        "FromRowKey": str(entity["RowKey"]),
    }


def decode(entity: Entity, etag: str | None, parse: Callable[[Entity, str | None], Stored[R]]) -> Stored[R] | str:
    """The entity read as its record, or why it cannot be (any failure of a pure decode is the entity's)."""
    try:
        return parse(entity, etag)
    except Exception as error:  # the entity's alone: the caller sets it aside
        return _why(error)


def sent_alerts_entity(record: SentAlerts) -> Entity:
    # Keys sort by when the cards were sent; the random tail keeps two batches of one microsecond apart.
    key = f"{record.sentAt.astimezone(UTC).strftime('%Y%m%dT%H%M%S%f')}-{uuid.uuid4().hex[:12]}"
    return record_entity(SENT_ALERTS_PARTITION, key, record, {})


def sent_alerts_from_entity(entity: Entity, etag: str | None) -> Stored[SentAlerts]:
    return record_from_entity(entity, SentAlerts, etag)


def key_entity(name: str) -> Entity:
    """A new random 32-byte key named ``name`` (kept only if no instance created one first)."""
    return {"PartitionKey": KEY_PARTITION, "RowKey": safe_key(name), "Key": base64.b64encode(os.urandom(32)).decode()}


def key_from_entity(entity: Entity) -> bytes:
    return base64.b64decode(entity["Key"])


def claim_partition(name: str) -> str:
    """The partition a claim lives in: from its name alone, so that every instance finds (and binds) it there."""
    return f"{CLAIM_PARTITION}-{zlib.crc32(name.encode('utf-8')) % CLAIM_PARTITIONS}"


def claim_entity(name: str, value: str) -> Entity:
    return {"PartitionKey": claim_partition(name), "RowKey": safe_key(name), "Name": name, "Value": value}


def claim_from_entity(entity: Entity) -> str:
    return str(entity["Value"])


def claim_transactions(entities: list[Entity]) -> Iterator[list[Entity]]:
    """Claims cut into transactions: one partition each, at most 100."""
    by_partition: dict[str, list[Entity]] = {}
    for entity in entities:
        by_partition.setdefault(str(entity["PartitionKey"]), []).append(entity)
    for group in by_partition.values():
        for start in range(0, len(group), TRANSACTION_LIMIT):
            yield group[start : start + TRANSACTION_LIMIT]


def claim_name(entity: Entity) -> str | None:
    """The name a claim binds (None: an entity without one is not a claim this code wrote)."""
    name = entity.get("Name")
    return name if isinstance(name, str) else None


def _entity_chars(entity: Entity) -> int:
    return sum(len(str(value)) for value in entity.values())


def is_staged(write: Write) -> bool:
    return str(write[0]["RowKey"]).startswith(STAGED_MARK)


def transactions(items: list[Write]) -> Iterator[list[int]]:
    """Cuts writes into transactions, given as positions in ``items``: one partition each (a transaction cannot
    span two), at most 100 operations and about 3 MB (the service's limit is 4 MiB); partitions in the order they
    first appear. An outbox entry stays in the transaction of the record before it (``with_staged``)."""
    by_partition: dict[str, list[list[int]]] = {}
    unit_of: dict[int, list[int]] = {}
    for index, item in enumerate(items):
        partition = str(item[0]["PartitionKey"])
        before = index - 1
        if is_staged(item) and before in unit_of and str(items[before][0]["PartitionKey"]) == partition:
            unit = unit_of[before]
            unit.append(index)
        else:
            unit = [index]
            by_partition.setdefault(partition, []).append(unit)
        unit_of[index] = unit
    for units in by_partition.values():
        yield from packed(
            units,
            lambda unit: sum(_entity_chars(items[index][0]) for index in unit),
            count=TRANSACTION_LIMIT,
            size=TRANSACTION_CHARS,
        )


def packed(
    units: Iterable[Sequence[T]], chars: Callable[[Sequence[T]], int], *, count: int, size: int
) -> Iterator[list[T]]:
    """Units, each kept whole and in order, packed into parts of at most ``count`` items and ``size`` characters
    (``chars`` weighs a unit; one over either bound is a part of its own)."""
    part: list[T] = []
    total = 0
    for unit in units:
        weight = chars(unit)
        if part and (len(part) + len(unit) > count or total + weight > size):
            yield part
            part, total = [], 0
        part.extend(unit)
        total += weight
    if part:
        yield part


def chunks(items: Sequence[str], size: int) -> Iterator[Sequence[str]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


# What the service answers for what this module should have refused (an entity over 1 MiB, whose other VMs a MERGE
# does not send, is known only to the table): RecordTooLarge, which the stages contain to its record.
_TOO_LARGE_CODES = ("PropertyValueTooLarge", "EntityTooLarge", "RequestBodyTooLarge")


def too_large(error: HttpResponseError) -> bool:
    return error.status_code in (400, 413) and any(code in str(error) for code in _TOO_LARGE_CODES)
