"""Fleet state in Azure Table Storage (Azurite locally), with ETag optimistic concurrency.

Layout (one table):
- PartitionKey ``event``, RowKey = EventId: the merged EventRecord as JSON, plus ``State``/``Open`` for queries.
- PartitionKey ``budget``, RowKey = scale set: the fleet-wide claims on its "at most N impacted" budget.
- PartitionKey ``alertsent``: one entity per batch that sent cards, naming them; the timer clears those
  outbox entries from the events in bulk and deletes the entity (one write per batch instead of one per event).
- PartitionKey ``key``, RowKey = a name: random keys every instance shares (``shared_key``).
- PartitionKey ``vmgroup``, RowKey = placement group (or scale set, or lone VM): every VM's position (last
  sequence/incarnation, listed events, last seen) and its sighting of each event in one entity, since a group's
  VMs report together. An event record's ``vms`` is assembled from its groups on read (events.assemble).
One partition per kind lets a batch write all its events (or groups) in one transaction (at most 100 operations,
all-or-nothing: if any ETag is stale nothing is written and the caller redoes that part one by one).
Dead letters go to a second table, one row per refused message.

Reads may come from a bounded in-process cache of (record, ETag). That is safe because every write is
conditional on the ETag: a decision taken on a stale record never commits; the conflict evicts the entry and the
caller re-reads. It saves most reads when several batches touch the same event (a maintenance wave).

Longer than 400 lines on purpose: the whole table layout (keys, entity splitting, transactions, the cache) is in one
place, so that what is stored and how it is read back cannot drift apart.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Generic, TypeVar

from azure.core import MatchConditions
from azure.core.credentials import TokenCredential
from azure.core.exceptions import HttpResponseError, ResourceExistsError, ResourceModifiedError
from azure.data.tables import TableClient, TableServiceClient, TableTransactionError, UpdateMode
from pydantic import BaseModel

from coordinator.domain.model import BudgetRecord, EventRecord, SentAlerts, VmGroupRecord, VmRecord

EVENT_PARTITION = "event"
VM_GROUP_PARTITION = "vmgroup"
BUDGET_PARTITION = "budget"
SENT_ALERTS_PARTITION = "alertsent"
KEY_PARTITION = "key"
CACHE_ENTRIES = 50_000
TRANSACTION_LIMIT = 100
TRANSACTION_CHARS = 3_000_000
# Azure Tables allows at most 15 discrete comparisons per filter: PartitionKey + 14 RowKeys.
ROWKEYS_PER_QUERY = 14
# A string property holds at most 64 KiB (32K UTF-16 code units); larger records are split over Data0..DataN.
CHUNK_CHARS = 30_000
MAX_CHUNKS = 30
VM_PROPERTY_PREFIX = "V_"
_BAD_KEY = re.compile(r"[/\\#?\x00-\x1f\x7f-\x9f]")

R = TypeVar("R", bound=BaseModel)


class ConcurrencyConflict(Exception):
    """Another writer changed (or created) the entity since it was read; re-read and redo."""


class RecordTooLarge(ValueError):
    """The record does not fit in one table entity (1 MiB)."""


def safe_key(value: str) -> str:
    """A table key for an id that may hold characters Table Storage forbids (ids come from untrusted input)."""
    if value and len(value) <= 200 and not _BAD_KEY.search(value):
        return value
    digest = hashlib.sha256(value.encode("utf-8")).hexdigest()[:16]
    return _BAD_KEY.sub("_", value[:150]) + "~" + digest


@dataclass
class Stored(Generic[R]):
    record: R
    etag: str | None


def _to_entity(
    partition: str, key: str, record: BaseModel, extra: dict[str, Any], *, exclude: set[str] | None = None
) -> dict[str, Any]:
    data = record.model_dump_json(exclude_defaults=True, exclude=exclude)
    chunks = [data[i : i + CHUNK_CHARS] for i in range(0, len(data), CHUNK_CHARS)] or [""]
    if len(chunks) > MAX_CHUNKS:
        raise RecordTooLarge(f"record {partition}/{key} is {len(data)} characters; the entity limit is 1 MiB")
    entity: dict[str, Any] = {"PartitionKey": partition, "RowKey": safe_key(key), "Chunks": len(chunks)}
    entity.update({f"Data{i}": chunk for i, chunk in enumerate(chunks)})
    entity.update(extra)
    return entity


def _from_entity(entity: dict[str, Any], model: type[R]) -> Stored[R]:
    chunks = int(entity.get("Chunks", 1))
    data = "".join(str(entity[f"Data{i}"]) for i in range(chunks))
    etag = entity.metadata["etag"] if hasattr(entity, "metadata") else None
    return Stored(model.model_validate_json(data), etag)


def _event_from_entity(entity: dict[str, Any]) -> Stored[EventRecord]:
    return _from_entity(entity, EventRecord)


def _budget_from_entity(entity: dict[str, Any]) -> Stored[BudgetRecord]:
    return _from_entity(entity, BudgetRecord)


def _event_entity(record: EventRecord) -> dict[str, Any]:
    return _to_entity(
        EVENT_PARTITION,
        record.eventId,
        record,
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


def _group_entity(record: VmGroupRecord, vm_ids: Iterable[str] | None = None) -> dict[str, Any]:
    """One property per VM, so that a write can MERGE just the VMs it moved (a batch moves a few of a group's
    VMs: the rest of the group is neither serialized nor sent)."""
    entity: dict[str, Any] = {
        "PartitionKey": VM_GROUP_PARTITION,
        "RowKey": safe_key(record.group),
        "Group": record.group,
        "Vms": len(record.vms),
    }
    for vm_id in record.vms if vm_ids is None else vm_ids:
        entity[_vm_property(vm_id)] = _vm_json(record.vms[vm_id])
    return entity


def _group_from_entity(entity: dict[str, Any]) -> Stored[VmGroupRecord]:
    vms = {}
    for name, value in entity.items():
        if name.startswith(VM_PROPERTY_PREFIX):
            vm = VmRecord.model_validate_json(str(value))
            vms[vm.identity.vmId.lower()] = vm
    etag = entity.metadata["etag"] if hasattr(entity, "metadata") else None
    return Stored(VmGroupRecord(group=str(entity["Group"]), vms=vms), etag)


def _entity_chars(entity: dict[str, Any]) -> int:
    return sum(len(str(value)) for value in entity.values())


def _transactions(
    items: list[tuple[dict[str, Any], str | None, BaseModel]],
) -> Iterator[list[tuple[dict[str, Any], str | None, BaseModel]]]:
    """Cuts writes into transactions of at most 100 operations and about 3 MB (the service's limit is 4 MiB)."""
    part: list[tuple[dict[str, Any], str | None, BaseModel]] = []
    size = 0
    for item in items:
        chars = _entity_chars(item[0])
        if part and (len(part) == TRANSACTION_LIMIT or size + chars > TRANSACTION_CHARS):
            yield part
            part, size = [], 0
        part.append(item)
        size += chars
    if part:
        yield part


def _chunks(items: Sequence[str], size: int) -> Iterator[Sequence[str]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


class TableStateStore:
    """State records in one table. Construct with ``from_connection_string`` (Azurite) or ``from_endpoint``
    (Azure, managed identity: the identity needs "Storage Table Data Contributor" on the account)."""

    def __init__(self, *, table: TableClient, dead_letters: TableClient) -> None:
        self._table = table
        self._dead_letters = dead_letters
        self._cache: OrderedDict[tuple[str, str], Stored[Any]] = OrderedDict()
        # The Functions worker runs invocations on a thread pool and shares this store between them.
        self._cache_lock = threading.Lock()

    @classmethod
    def from_connection_string(cls, connection_string: str, *, table_name: str) -> TableStateStore:
        service = TableServiceClient.from_connection_string(connection_string)
        return cls._from_service(service, table_name)

    @classmethod
    def from_endpoint(cls, endpoint: str, *, credential: TokenCredential, table_name: str) -> TableStateStore:
        return cls._from_service(TableServiceClient(endpoint=endpoint, credential=credential), table_name)

    @classmethod
    def _from_service(cls, service: TableServiceClient, table_name: str) -> TableStateStore:
        store = cls(
            table=service.get_table_client(table_name),
            dead_letters=service.get_table_client(f"{table_name}deadletters"),
        )
        for client in (store._table, store._dead_letters):
            with contextlib.suppress(ResourceExistsError):
                service.create_table(client.table_name)
        return store

    # cache ---------------------------------------------------------------------------------------------------
    def _remember(self, partition: str, key: str, stored: Stored[Any]) -> None:
        with self._cache_lock:
            self._cache[(partition, key)] = stored
            self._cache.move_to_end((partition, key))
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)

    def _forget(self, partition: str, key: str) -> None:
        with self._cache_lock:
            self._cache.pop((partition, key), None)

    def _cached(self, partition: str, key: str) -> Stored[Any] | None:
        with self._cache_lock:
            return self._cache.get((partition, key))

    # reads ---------------------------------------------------------------------------------------------------
    def _get_many(
        self, partition: str, keys: Iterable[str], parse: Callable[[Any], Stored[R]], *, cached: bool
    ) -> dict[str, Stored[R]]:
        wanted = sorted({safe_key(k) for k in keys})
        found: dict[str, Stored[R]] = {}
        if cached:
            for key in wanted:
                hit = self._cached(partition, key)
                if hit is not None:
                    found[key] = hit
            wanted = [k for k in wanted if k not in found]
        for chunk in _chunks(wanted, ROWKEYS_PER_QUERY):
            parameters: dict[str, Any] = {"pk": partition}
            clauses = []
            for i, key in enumerate(chunk):
                parameters[f"r{i}"] = key
                clauses.append(f"RowKey eq @r{i}")
            # The SDK substitutes @names by splitting on spaces: keep a space around every parameter.
            query = f"PartitionKey eq @pk and ( {' or '.join(clauses)} )"
            for entity in self._table.query_entities(query, parameters=parameters):
                stored = parse(entity)
                found[str(entity["RowKey"])] = stored
                self._remember(partition, str(entity["RowKey"]), stored)
        return found

    def get_events(self, event_ids: Iterable[str], *, cached: bool = False) -> dict[str, Stored[EventRecord]]:
        ids = list(event_ids)
        by_key = self._get_many(EVENT_PARTITION, ids, _event_from_entity, cached=cached)
        return {i: by_key[safe_key(i)] for i in ids if safe_key(i) in by_key}

    def get_event(self, event_id: str) -> Stored[EventRecord] | None:
        return self.get_events([event_id]).get(event_id)

    def get_vm_groups(self, keys: Iterable[str], *, cached: bool = False) -> dict[str, Stored[VmGroupRecord]]:
        wanted = list(keys)
        by_key = self._get_many(VM_GROUP_PARTITION, wanted, _group_from_entity, cached=cached)
        return {k: by_key[safe_key(k)] for k in wanted if safe_key(k) in by_key}

    def get_budget(self, scale_set: str) -> Stored[BudgetRecord] | None:
        """Always a fresh read: a claim decides against what every instance holds now."""
        return self._get_many(BUDGET_PARTITION, [scale_set], _budget_from_entity, cached=False).get(safe_key(scale_set))

    def open_events(self) -> list[Stored[EventRecord]]:
        query = "PartitionKey eq @pk and Open eq true"
        entities = self._table.query_entities(query, parameters={"pk": EVENT_PARTITION})
        return [_from_entity(e, EventRecord) for e in entities]

    def closed_events_with_pending_alerts(self) -> list[Stored[EventRecord]]:
        """Concluded events whose last cards are still in the outbox (open ones come with open_events)."""
        query = "PartitionKey eq @pk and Open eq false and Pending eq true"
        entities = self._table.query_entities(query, parameters={"pk": EVENT_PARTITION})
        return [_from_entity(e, EventRecord) for e in entities]

    def concluded_events_before(self, cutoff: datetime) -> list[Stored[EventRecord]]:
        """Completed/Canceled events that concluded before ``cutoff`` and have no card left to send."""
        query = "PartitionKey eq @pk and Open eq false and Pending eq false and StateSince lt @cutoff"
        entities = self._table.query_entities(query, parameters={"pk": EVENT_PARTITION, "cutoff": cutoff})
        return [_from_entity(e, EventRecord) for e in entities]

    def delete_events(self, items: Sequence[tuple[str, str | None]]) -> int:
        """Deletes events If-Match their ETag (one changed meanwhile stays); returns how many were deleted."""
        deleted = 0
        for event_id, etag in items:
            key = safe_key(event_id)
            try:
                self._table.delete_entity(
                    EVENT_PARTITION, key, etag=etag, match_condition=MatchConditions.IfNotModified
                )
            except ResourceModifiedError:
                continue
            finally:
                self._forget(EVENT_PARTITION, key)
            deleted += 1
        return deleted

    def all_vm_groups(self) -> list[Stored[VmGroupRecord]]:
        entities = self._table.query_entities("PartitionKey eq @pk", parameters={"pk": VM_GROUP_PARTITION})
        return [_group_from_entity(e) for e in entities]

    # writes --------------------------------------------------------------------------------------------------
    def _save_one(
        self, entity: dict[str, Any], etag: str | None, record: BaseModel, *, mode: UpdateMode = UpdateMode.REPLACE
    ) -> str:
        partition, key = str(entity["PartitionKey"]), str(entity["RowKey"])
        try:
            if etag is None:
                metadata = self._table.create_entity(entity)
            else:
                metadata = self._table.update_entity(
                    entity, mode=mode, etag=etag, match_condition=MatchConditions.IfNotModified
                )
        except (ResourceExistsError, ResourceModifiedError) as error:
            self._forget(partition, key)
            raise ConcurrencyConflict(f"{partition}/{key} changed") from error
        new_etag = str(metadata["etag"])
        self._remember(partition, key, Stored(record, new_etag))
        return new_etag

    def _save_many(
        self, items: list[tuple[dict[str, Any], str | None, BaseModel]], *, mode: UpdateMode = UpdateMode.REPLACE
    ) -> list[str]:
        etags: list[str] = []
        for part in _transactions(items):
            if len(part) == 1:
                etags.append(self._save_one(*part[0], mode=mode))
                continue
            operations: list[Any] = []
            for entity, etag, _ in part:
                if etag is None:
                    operations.append(("create", entity))
                else:
                    options = {
                        "mode": mode,
                        "etag": etag,
                        "match_condition": MatchConditions.IfNotModified,
                    }
                    operations.append(("update", entity, options))
            try:
                results = self._table.submit_transaction(operations)
            except (TableTransactionError, ResourceExistsError, ResourceModifiedError, HttpResponseError) as error:
                for entity, _, _ in part:
                    self._forget(str(entity["PartitionKey"]), str(entity["RowKey"]))
                status = getattr(error, "status_code", None)
                if (
                    isinstance(error, HttpResponseError)
                    and not isinstance(error, TableTransactionError)
                    and status not in (409, 412)
                ):
                    raise
                raise ConcurrencyConflict(f"transaction of {len(part)} entities refused: {error}") from error
            for (entity, _, record), result in zip(part, results, strict=True):
                etag = str(result["etag"])
                self._remember(str(entity["PartitionKey"]), str(entity["RowKey"]), Stored(record, etag))
                etags.append(etag)
        return etags

    def save_event(self, record: EventRecord, etag: str | None) -> str:
        return self._save_one(_event_entity(record), etag, record)

    def save_events(self, items: Sequence[tuple[EventRecord, str | None]]) -> list[str]:
        """All or nothing per transaction of 100; raises ConcurrencyConflict when any ETag is stale."""
        return self._save_many([(_event_entity(r), e, r) for r, e in items])

    def save_vm_group(self, record: VmGroupRecord, etag: str | None, *, vm_ids: Iterable[str] | None = None) -> str:
        """Creates the group (etag None) or merges the VMs ``vm_ids`` (default: all) into it, If-Match ``etag``."""
        return self.save_vm_groups([(record, etag, vm_ids)])[0]

    def save_vm_groups(self, items: Sequence[tuple[VmGroupRecord, str | None, Iterable[str] | None]]) -> list[str]:
        """``record`` is the whole group as it is after the write (kept in the cache); only ``vm_ids`` are sent."""
        entities: list[tuple[dict[str, Any], str | None, BaseModel]] = [
            (_group_entity(r, None if e is None else v), e, r) for r, e, v in items
        ]
        return self._save_many(entities, mode=UpdateMode.MERGE)

    def save_budget(self, record: BudgetRecord, etag: str | None) -> str:
        return self._save_one(_to_entity(BUDGET_PARTITION, record.scaleSet, record, {}), etag, record)

    def log_sent_alerts(self, record: SentAlerts) -> None:
        key = f"{record.sentAt.astimezone(UTC).strftime('%Y%m%dT%H%M%S%f')}-{uuid.uuid4().hex[:12]}"
        self._table.create_entity(_to_entity(SENT_ALERTS_PARTITION, key, record, {}))

    def sent_alert_logs(self) -> list[tuple[str, SentAlerts]]:
        entities = self._table.query_entities("PartitionKey eq @pk", parameters={"pk": SENT_ALERTS_PARTITION})
        return [(str(e["RowKey"]), _from_entity(e, SentAlerts).record) for e in entities]

    def delete_sent_alert_logs(self, keys: Sequence[str]) -> None:
        for chunk in _chunks(keys, TRANSACTION_LIMIT):
            self._table.submit_transaction(
                [("delete", {"PartitionKey": SENT_ALERTS_PARTITION, "RowKey": key}) for key in chunk]
            )

    # keys ----------------------------------------------------------------------------------------------------
    def shared_key(self, name: str) -> bytes:
        """A random 32-byte key shared by every instance of the coordinator (e.g. the approval form's
        anti-forgery key): created once by whichever instance asks first (insert-only, so the first writer
        wins and the others read its key), readable only by identities with data access to this table."""
        key = safe_key(name)
        with contextlib.suppress(ResourceExistsError):
            self._table.create_entity(
                {"PartitionKey": KEY_PARTITION, "RowKey": key, "Key": base64.b64encode(os.urandom(32)).decode()}
            )
        return base64.b64decode(self._table.get_entity(KEY_PARTITION, key)["Key"])

    # dead letters --------------------------------------------------------------------------------------------
    def put_dead_letters(self, letters: Sequence[DeadLetter]) -> None:
        by_day: dict[str, list[dict[str, Any]]] = {}
        for letter in letters:
            by_day.setdefault(letter.received_at.strftime("%Y-%m-%d"), []).append(letter.entity())
        for day, entities in by_day.items():
            for start in range(0, len(entities), TRANSACTION_LIMIT):
                part = entities[start : start + TRANSACTION_LIMIT]
                for entity in part:
                    entity["PartitionKey"] = day
                self._dead_letters.submit_transaction([("upsert", e) for e in part])

    def dead_letters(self) -> list[dict[str, Any]]:
        return [dict(e) for e in self._dead_letters.list_entities()]


@dataclass(frozen=True)
class DeadLetter:
    """A message refused at the door: kept with the reason so that a person can look at it; never acted on."""

    reason: str
    body: bytes
    received_at: datetime
    source: dict[str, Any]

    # A string property holds 64 KiB of UTF-16 (32K characters) and an entity 1 MiB: the body's first 16 KiB are
    # kept (base64: 21,848 characters), the reason and source up to 8,000 characters each; the SHA-256 and size
    # identify the whole message, however large it was.
    BODY_LIMIT = 16 * 1024

    def entity(self) -> dict[str, Any]:
        return {
            "PartitionKey": self.received_at.astimezone(UTC).strftime("%Y-%m-%d"),
            "RowKey": f"{self.received_at.astimezone(UTC).strftime('%H%M%S%f')}-{uuid.uuid4().hex[:12]}",
            "Reason": self.reason[:8000],
            "Source": json.dumps(self.source, default=str)[:8000],
            "BodyBase64": base64.b64encode(self.body[: self.BODY_LIMIT]).decode("ascii"),
            "BodyBytes": len(self.body),
            "BodySha256": hashlib.sha256(self.body).hexdigest(),
        }
