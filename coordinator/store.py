"""Fleet state in Azure Table Storage (Azurite locally), with ETag optimistic concurrency.

Layout (one table):
- PartitionKey ``event``, RowKey = EventId: the merged EventRecord as JSON, plus ``State``/``Open`` for queries.
- PartitionKey ``vm``, RowKey = vmId: the VmRecord (last sequence/incarnation, listed events, last seen).
One partition per kind lets a batch write all its events (or VMs) in one transaction (at most 100 operations,
all-or-nothing: if any ETag is stale nothing is written and the caller redoes that part one by one).
Dead letters go to a second table, one row per refused message.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import re
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Generic, TypeVar

from azure.core import MatchConditions
from azure.core.credentials import TokenCredential
from azure.core.exceptions import HttpResponseError, ResourceExistsError, ResourceModifiedError
from azure.data.tables import TableClient, TableServiceClient, TableTransactionError, UpdateMode
from pydantic import BaseModel

from coordinator.model import EventRecord, VmRecord

EVENT_PARTITION = "event"
VM_PARTITION = "vm"
TRANSACTION_LIMIT = 100
# Azure Tables allows at most 15 discrete comparisons per filter: PartitionKey + 14 RowKeys.
ROWKEYS_PER_QUERY = 14
# A string property holds at most 64 KiB (32K UTF-16 code units); larger records are split over Data0..DataN.
CHUNK_CHARS = 30_000
MAX_CHUNKS = 30
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


def _to_entity(partition: str, key: str, record: BaseModel, extra: dict[str, Any]) -> dict[str, Any]:
    data = record.model_dump_json()
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


def _event_entity(record: EventRecord) -> dict[str, Any]:
    return _to_entity(
        EVENT_PARTITION,
        record.eventId,
        record,
        {"State": record.state, "Open": record.open, "EventType": record.eventType},
    )


def _vm_entity(record: VmRecord) -> dict[str, Any]:
    return _to_entity(
        VM_PARTITION,
        record.identity.vmId.lower(),
        record,
        {"VmName": record.identity.name, "LastSeen": record.lastSeen, "HeartbeatLost": record.heartbeatLost},
    )


def _chunks(items: Sequence[str], size: int) -> Iterator[Sequence[str]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


class TableStateStore:
    """State records in one table. Construct with ``from_connection_string`` (Azurite) or ``from_endpoint``
    (Azure, managed identity: the identity needs "Storage Table Data Contributor" on the account)."""

    def __init__(self, *, table: TableClient, dead_letters: TableClient) -> None:
        self._table = table
        self._dead_letters = dead_letters

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

    # reads ---------------------------------------------------------------------------------------------------
    def _get_many(self, partition: str, keys: Iterable[str], model: type[R]) -> dict[str, Stored[R]]:
        wanted = sorted({safe_key(k) for k in keys})
        found: dict[str, Stored[R]] = {}
        for chunk in _chunks(wanted, ROWKEYS_PER_QUERY):
            parameters: dict[str, Any] = {"pk": partition}
            clauses = []
            for i, key in enumerate(chunk):
                parameters[f"r{i}"] = key
                clauses.append(f"RowKey eq @r{i}")
            # The SDK substitutes @names by splitting on spaces: keep a space around every parameter.
            query = f"PartitionKey eq @pk and ( {' or '.join(clauses)} )"
            for entity in self._table.query_entities(query, parameters=parameters):
                found[str(entity["RowKey"])] = _from_entity(entity, model)
        return found

    def get_events(self, event_ids: Iterable[str]) -> dict[str, Stored[EventRecord]]:
        ids = list(event_ids)
        by_key = self._get_many(EVENT_PARTITION, ids, EventRecord)
        return {i: by_key[safe_key(i)] for i in ids if safe_key(i) in by_key}

    def get_event(self, event_id: str) -> Stored[EventRecord] | None:
        return self.get_events([event_id]).get(event_id)

    def get_vms(self, vm_ids: Iterable[str]) -> dict[str, Stored[VmRecord]]:
        ids = [i.lower() for i in vm_ids]
        by_key = self._get_many(VM_PARTITION, ids, VmRecord)
        return {i: by_key[safe_key(i)] for i in ids if safe_key(i) in by_key}

    def open_events(self) -> list[Stored[EventRecord]]:
        query = "PartitionKey eq @pk and Open eq true"
        return [
            _from_entity(e, EventRecord) for e in self._table.query_entities(query, parameters={"pk": EVENT_PARTITION})
        ]

    def all_vms(self) -> list[Stored[VmRecord]]:
        query = "PartitionKey eq @pk"
        return [_from_entity(e, VmRecord) for e in self._table.query_entities(query, parameters={"pk": VM_PARTITION})]

    # writes --------------------------------------------------------------------------------------------------
    def _save_one(self, entity: dict[str, Any], etag: str | None) -> str:
        try:
            if etag is None:
                metadata = self._table.create_entity(entity)
            else:
                metadata = self._table.update_entity(
                    entity, mode=UpdateMode.REPLACE, etag=etag, match_condition=MatchConditions.IfNotModified
                )
        except (ResourceExistsError, ResourceModifiedError) as error:
            raise ConcurrencyConflict(f"{entity['PartitionKey']}/{entity['RowKey']} changed") from error
        return str(metadata["etag"])

    def _save_many(self, entities: list[tuple[dict[str, Any], str | None]]) -> list[str]:
        etags: list[str] = []
        for start in range(0, len(entities), TRANSACTION_LIMIT):
            part = entities[start : start + TRANSACTION_LIMIT]
            if len(part) == 1:
                etags.append(self._save_one(*part[0]))
                continue
            operations: list[Any] = []
            for entity, etag in part:
                if etag is None:
                    operations.append(("create", entity))
                else:
                    options = {
                        "mode": UpdateMode.REPLACE,
                        "etag": etag,
                        "match_condition": MatchConditions.IfNotModified,
                    }
                    operations.append(("update", entity, options))
            try:
                results = self._table.submit_transaction(operations)
            except (TableTransactionError, ResourceExistsError, ResourceModifiedError) as error:
                raise ConcurrencyConflict(f"transaction of {len(part)} entities refused: {error}") from error
            except HttpResponseError as error:
                if error.status_code in (409, 412):
                    raise ConcurrencyConflict(f"transaction of {len(part)} entities refused: {error}") from error
                raise
            etags.extend(str(r["etag"]) for r in results)
        return etags

    def save_event(self, record: EventRecord, etag: str | None) -> str:
        return self._save_one(_event_entity(record), etag)

    def save_events(self, items: Sequence[tuple[EventRecord, str | None]]) -> list[str]:
        """All or nothing per transaction of 100; raises ConcurrencyConflict when any ETag is stale."""
        return self._save_many([(_event_entity(r), e) for r, e in items])

    def save_vm(self, record: VmRecord, etag: str | None) -> str:
        return self._save_one(_vm_entity(record), etag)

    def save_vms(self, items: Sequence[tuple[VmRecord, str | None]]) -> list[str]:
        return self._save_many([(_vm_entity(r), e) for r, e in items])

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

    # The body is kept up to 48 KiB (base64 fits one property); its hash and size identify the whole message.
    BODY_LIMIT = 48 * 1024

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
