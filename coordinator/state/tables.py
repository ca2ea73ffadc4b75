"""The ``StateStore`` in Azure Table Storage (Azurite locally) through azure-data-tables, with ETag optimistic
concurrency: the entities are those of ``entities.py``, the semantics those of ``store.py``.

The history outbox's writes, reads and deletes are ``table_outbox.TableOutbox``'s, and the log of sent cards, the
shared keys, the claims and the dead letters ``table_logs.TableLogs``'s, both mixed in (store.py says what each
does). Reads may come from a bounded in-process cache of (record, ETag): safe, as every write is conditional on
the ETag (a decision on a stale record never commits; the conflict evicts the entry and the caller re-reads).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from azure.core import MatchConditions
from azure.core.credentials import TokenCredential
from azure.core.exceptions import (
    HttpResponseError,
    ResourceExistsError,
    ResourceModifiedError,
    ResourceNotFoundError,
)
from azure.data.tables import TableClient, TableEntity, TableServiceClient, TableTransactionError, UpdateMode

from coordinator.domain.lru import Lru
from coordinator.domain.model import EventRecord, VmGroupRecord
from coordinator.state.dead_letters import set_aside_letter
from coordinator.state.entities import (
    EVENT_PARTITION,
    PAST_STAGED,
    STAGED_MARK,
    VM_GROUP_PARTITION,
    Write,
    chunks,
    decode,
    event_from_entity,
    event_partition,
    group_entity,
    group_from_entity,
    group_partition,
    is_staged,
    partitions_of,
    safe_key,
    set_aside_copy,
    too_large,
    transactions,
)
from coordinator.state.store import (
    Changed,
    ConcurrencyConflict,
    R,
    RecordTooLarge,
    SetAside,
    SetAsideLog,
    StateStore,
    Stored,
)
from coordinator.state.table_batch import Sessions, TransactionTableClient, transport_of
from coordinator.state.table_budgets import TableBudgets
from coordinator.state.table_logs import TableLogs
from coordinator.state.table_outbox import TableOutbox
from coordinator.state.table_parts import entity_etag

log = logging.getLogger("coordinator")

CACHE_ENTRIES = 50_000
# Azure Tables allows at most 15 discrete comparisons per filter: PartitionKey + 14 RowKeys.
ROWKEYS_PER_QUERY = 14
KEYED_READS = 4  # what a refresh lacks is read by key in at most this many queries, else by one range read


class TableStateStore(TableBudgets, TableOutbox, TableLogs, StateStore):
    """State records in one table. Construct with ``from_connection_string`` (Azurite) or ``from_endpoint``
    (Azure, managed identity: the identity needs "Storage Table Data Contributor" on the account)."""

    def __init__(self, *, table: TableClient, dead_letters: TableClient) -> None:
        self._table = table
        self._dead_letters = dead_letters
        # The Functions worker runs invocations on a thread pool and shares this store between them (Lru: locked).
        self._cache: Lru[tuple[str, str], Stored[Any]] = Lru(CACHE_ENTRIES)
        # Moves at each write this store keeps: a read that saw it move may have been answered before that write. Each
        # write sets it to a ticket of its own (``next`` is atomic; ``+= 1`` from two threads can lose a move).
        self._tickets = itertools.count(1)
        self._writes_kept = 0
        self._set_aside = SetAsideLog()

    @classmethod
    def from_connection_string(
        cls, connection_string: str, *, table_name: str, session: Sessions | None = None
    ) -> TableStateStore:
        """``session`` makes each table client's ``requests`` session (None: the SDK's own)."""

        def client(name: str) -> TableClient:
            return TransactionTableClient.from_connection_string(
                connection_string, table_name=name, **transport_of(session)
            )

        return cls._from_service(TableServiceClient.from_connection_string(connection_string), client, table_name)

    @classmethod
    def from_endpoint(
        cls, endpoint: str, *, credential: TokenCredential, table_name: str, session: Sessions | None = None
    ) -> TableStateStore:
        def client(name: str) -> TableClient:
            return TransactionTableClient(
                endpoint=endpoint, table_name=name, credential=credential, **transport_of(session)
            )

        service = TableServiceClient(endpoint=endpoint, credential=credential)
        return cls._from_service(service, client, table_name)

    @classmethod
    def _from_service(
        cls, service: TableServiceClient, client: Callable[[str], TableClient], table_name: str
    ) -> TableStateStore:
        """The store on its table and its dead letters' (each created if missing; transactions: table_batch.py)."""
        store = cls(table=client(table_name), dead_letters=client(f"{table_name}deadletters"))
        for table in (store._table, store._dead_letters):
            with contextlib.suppress(ResourceExistsError):
                service.create_table(table.table_name)
        return store

    # cache ---------------------------------------------------------------------------------------------------
    # Two invocations of one instance (each its partition's batch) can write or read the same entity (a VM group whose
    # VMs sit on two partitions) and have their answers handled in either order: the last handled must not leave an
    # older ETag cached, or the next write from the cache conflicts and re-reads every entity of its transaction.
    # Which of two ETags is newer cannot be told, so an entry that is not the one expected is forgotten instead.
    def _remember_written(self, partition: str, key: str, stored: Stored[Any], *, over: str | None) -> None:
        """A write's record, kept over nothing or the entry it was conditioned on (``over``: the ETag it matched;
        None: an insert), else forgotten."""
        self._writes_kept = next(self._tickets)
        if over == "*":
            self._cache.put((partition, key), stored)
            return
        self._cache.put_if((partition, key), stored, lambda held: held is None or held.etag == over)

    def _remember_read(self, partition: str, key: str, stored: Stored[Any], *, writes_before: int) -> None:
        """A read's record; if this store kept a write since the read was sent (``writes_before``), only over
        nothing or the same ETag (that write may be newer than what the read saw)."""
        if self._writes_kept == writes_before:
            self._cache.put((partition, key), stored)
            return
        self._cache.put_if((partition, key), stored, lambda held: held is None or held.etag == stored.etag)

    def _forget(self, partition: str, key: str) -> None:
        self._cache.pop((partition, key))

    def _cached(self, partition: str, key: str) -> Stored[Any] | None:
        return self._cache.get((partition, key))

    # reads ---------------------------------------------------------------------------------------------------
    def _get_many(
        self,
        partition_of: Callable[[str], str],
        keys: Iterable[str],
        parse: Callable[[Any, str | None], Stored[R]],
        *,
        cached: bool,
    ) -> dict[str, Stored[R]]:
        """The records found by the keys asked for (``partition_of`` gives each one's partition)."""
        by_partition: dict[str, set[str]] = {}
        for key in keys:
            by_partition.setdefault(partition_of(key), set()).add(safe_key(key))
        found: dict[str, Stored[R]] = {}
        for partition, safe_keys in by_partition.items():
            wanted = sorted(safe_keys)
            if cached:
                for key in wanted:
                    hit = self._cached(partition, key)
                    if hit is not None:
                        found[key] = hit
                wanted = [k for k in wanted if k not in found]
            found.update(self._read_keys(partition, wanted, parse))
        return found

    def _read_keys(
        self, partition: str, keys: Sequence[str], parse: Callable[[Any, str | None], Stored[R]]
    ) -> dict[str, Stored[R]]:
        """The entities of one partition under these RowKeys, parsed and cached, a query per chunk of keys."""
        found: dict[str, Stored[R]] = {}
        for chunk in chunks(list(keys), ROWKEYS_PER_QUERY):
            writes_before = self._writes_kept
            parameters: dict[str, Any] = {"pk": partition}
            clauses = []
            for i, key in enumerate(chunk):
                parameters[f"r{i}"] = key
                clauses.append(f"RowKey eq @r{i}")
            # The SDK substitutes @names by splitting on spaces: keep a space around every parameter.
            query = f"PartitionKey eq @pk and ( {' or '.join(clauses)} )"
            for key, stored in self._decoded(self._table.query_entities(query, parameters=parameters), parse):
                found[key] = stored
                self._remember_read(partition, key, stored, writes_before=writes_before)
        return found

    def _query(
        self, kind: str, condition: str = "", *, select: list[str] | None = None, **parameters: Any
    ) -> Iterable[TableEntity]:
        """The entities of every partition of one kind (a range of PartitionKeys) that meet ``condition``, the outbox
        entries kept there left out (``select``: only those properties, with each entity's ETag and write time)."""
        low, high = partitions_of(kind)
        query = "PartitionKey ge @low and PartitionKey lt @high and ( RowKey lt @mark or RowKey ge @past )" + (
            f" and {condition}" if condition else ""
        )
        return self._table.query_entities(
            query,
            select=select,
            parameters={"low": low, "high": high, "mark": STAGED_MARK, "past": PAST_STAGED, **parameters},
        )

    def _loaded(self, entities: Iterable[TableEntity], parse: Callable[[Any, str | None], Stored[R]]) -> Changed[R]:
        """Every entity parsed and cached (one that cannot be read is set aside and left out), with the latest
        write time among them."""
        found: list[Stored[R]] = []
        latest: datetime | None = None
        writes_before = self._writes_kept  # the query is sent as the iteration starts
        for entity in entities:
            stamp = entity.metadata.get("timestamp")
            if stamp is not None and (latest is None or stamp > latest):
                latest = stamp
            stored = decode(entity, entity_etag(entity), parse)
            if isinstance(stored, str):
                self._set_aside_entity(entity, stored)
                continue
            self._remember_read(str(entity["PartitionKey"]), str(entity["RowKey"]), stored, writes_before=writes_before)
            found.append(stored)
        return Changed(found, latest)

    def _changed(self, kind: str, since: datetime, parse: Callable[[Any, str | None], Stored[R]]) -> Changed[R]:
        """What changed in a partition since a time of the service's clock, listed first by keys, ETags and times:
        what this instance holds at that ETag comes from its cache (most of a wave's changes are its own writes).
        What it lacks is read by key (as it is now: the next refresh lists it again), or, past ``KEYED_READS``
        queries (other instances' writes), by one range read from the first it lacks. Unreadable: set aside."""
        found: dict[tuple[str, str], Stored[R]] = {}
        latest = first_lacked = None
        unknown: dict[str, list[str]] = {}
        listed = ["PartitionKey", "RowKey", "Timestamp"]
        for entity in self._query(kind, "Timestamp ge @since", since=since, select=listed):
            stamp: datetime = entity.metadata.get("timestamp") or since
            latest = stamp if latest is None else max(latest, stamp)
            partition, key = str(entity["PartitionKey"]), str(entity["RowKey"])
            hit = self._cached(partition, key)
            if hit is not None and hit.etag == entity_etag(entity):
                found[(partition, key)] = hit
            else:
                unknown.setdefault(partition, []).append(key)
                first_lacked = stamp if first_lacked is None else min(first_lacked, stamp)
        if first_lacked is not None and sum(map(len, unknown.values())) > KEYED_READS * ROWKEYS_PER_QUERY:
            lacked = {(partition, key) for partition, keys in unknown.items() for key in keys}
            ranged = self._query(kind, "Timestamp ge @since", since=first_lacked)
            read = self._loaded((e for e in ranged if (str(e["PartitionKey"]), str(e["RowKey"])) in lacked), parse)
            return Changed([*found.values(), *read.records], latest)
        for partition, keys in unknown.items():
            for key, stored in self._read_keys(partition, keys, parse).items():
                found[(partition, key)] = stored
        return Changed(list(found.values()), latest)

    def _query_events(self, condition: str, **parameters: Any) -> list[Stored[EventRecord]]:
        return [
            stored
            for _, stored in self._decoded(self._query(EVENT_PARTITION, condition, **parameters), event_from_entity)
        ]

    # entities that cannot be read -----------------------------------------------------------------------------
    def _decoded(
        self, entities: Iterable[TableEntity], parse: Callable[[Any, str | None], Stored[R]]
    ) -> list[tuple[str, Stored[R]]]:
        """Each entity read as its record, by RowKey; one that cannot be is set aside and left out."""
        out = []
        for entity in entities:
            stored = decode(entity, entity_etag(entity), parse)
            if isinstance(stored, str):
                self._set_aside_entity(entity, stored)
            else:
                out.append((str(entity["RowKey"]), stored))
        return out

    def _group(self, entity: Any, etag: str | None) -> Stored[VmGroupRecord]:
        """A VM group without the VMs whose property cannot be read: those are blanked (each VM's next position
        overwrites its property) and set aside; the ETag is the blanking write's."""
        unreadable: dict[str, str] = {}
        stored = group_from_entity(entity, etag, unreadable)
        if not unreadable:
            return stored
        what = f"{entity['PartitionKey']}/{entity['RowKey']} (a VM's position)"
        for name, reason in unreadable.items():
            self._note_set_aside(what, reason, {name: entity[name]}, etag)
        blank = {"PartitionKey": entity["PartitionKey"], "RowKey": entity["RowKey"], **dict.fromkeys(unreadable, "")}
        try:
            metadata = self._table.update_entity(
                blank, mode=UpdateMode.MERGE, etag=etag, match_condition=MatchConditions.IfNotModified
            )
        except (ResourceModifiedError, ResourceNotFoundError):
            return stored  # written since: the next read sees what it holds now
        return Stored(stored.record, str(metadata["etag"]))

    def _set_aside_entity(self, entity: Any, reason: str) -> None:
        """Copies the entity whole to partition ``setaside``, then deletes it If-Match the ETag it was read with
        (one rewritten since is left to the next read); a copy that fails leaves it where it is."""
        partition, key, etag = str(entity["PartitionKey"]), str(entity["RowKey"]), entity_etag(entity)
        self._note_set_aside(f"{partition}/{key}", reason, entity, etag)
        self._forget(partition, key)
        try:
            self._table.upsert_entity(set_aside_copy(entity, reason, datetime.now(UTC)))
            self._table.delete_entity(partition, key, etag=etag, match_condition=MatchConditions.IfNotModified)
        except (ResourceModifiedError, ResourceNotFoundError):
            return
        except HttpResponseError:
            log.exception("state entity %s/%s: could not be moved aside; left out of this read", partition, key)

    def _note_set_aside(self, what: str, reason: str, entity: Any, etag: str | None) -> None:
        log.error("state entity %s cannot be read and is set aside: %s", what, reason)
        try:
            self.put_dead_letters([set_aside_letter(entity, etag, what, reason, datetime.now(UTC))])
        except HttpResponseError:
            log.exception("state entity %s: its dead letter could not be stored", what)
        self._set_aside.add(what, reason)

    def set_aside(self) -> list[SetAside]:
        return self._set_aside.take()

    def get_events(self, event_ids: Iterable[str], *, cached: bool = False) -> dict[str, Stored[EventRecord]]:
        ids = list(event_ids)
        by_key = self._get_many(event_partition, ids, event_from_entity, cached=cached)
        return {i: by_key[safe_key(i)] for i in ids if safe_key(i) in by_key}

    def get_event(self, event_id: str) -> Stored[EventRecord] | None:
        return self.get_events([event_id]).get(event_id)

    def get_vm_groups(self, keys: Iterable[str], *, cached: bool = False) -> dict[str, Stored[VmGroupRecord]]:
        wanted = list(keys)
        by_key = self._get_many(group_partition, wanted, self._group, cached=cached)
        return {k: by_key[safe_key(k)] for k in wanted if safe_key(k) in by_key}

    def open_events(self) -> list[Stored[EventRecord]]:
        return self._query_events("Open eq true")

    def events_changed_since(self, since: datetime | None) -> Changed[EventRecord]:
        if since is not None:
            return self._changed(EVENT_PARTITION, since, event_from_entity)
        return self._loaded(self._query(EVENT_PARTITION, "Open eq true or Returning eq true"), event_from_entity)

    def closed_events_with_pending_alerts(self) -> list[Stored[EventRecord]]:
        return self._query_events("Open eq false and Pending eq true")

    def concluded_events_before(self, cutoff: datetime) -> list[Stored[EventRecord]]:
        return self._query_events("Open eq false and Pending eq false and StateSince lt @cutoff", cutoff=cutoff)

    def delete_events(self, items: Sequence[tuple[str, str | None]]) -> int:
        deleted = 0
        for event_id, etag in items:
            partition, key = event_partition(event_id), safe_key(event_id)
            try:
                # The SDK refuses If-Match without an ETag (ValueError) and answers a delete of a gone entity
                # as done.
                self._table.delete_entity(partition, key, etag=etag, match_condition=MatchConditions.IfNotModified)
            except ResourceModifiedError:
                continue
            finally:
                self._forget(partition, key)
            deleted += 1
        return deleted

    def all_vm_groups(self) -> list[Stored[VmGroupRecord]]:
        return [stored for _, stored in self._decoded(self._query(VM_GROUP_PARTITION), self._group)]

    def vm_groups_changed_since(self, since: datetime | None) -> Changed[VmGroupRecord]:
        if since is not None:
            return self._changed(VM_GROUP_PARTITION, since, self._group)
        return self._loaded(self._query(VM_GROUP_PARTITION), self._group)

    # writes --------------------------------------------------------------------------------------------------
    def _save_one(self, write: Write, *, mode: UpdateMode = UpdateMode.REPLACE) -> str:
        entity, etag, record = write
        partition, key = str(entity["PartitionKey"]), str(entity["RowKey"])
        try:
            if etag is None:
                metadata = self._table.create_entity(entity)
            else:
                metadata = self._table.update_entity(entity, **_condition(etag, mode))
        # Not found: deleted since it was read (housekeeping), which a transaction refuses as a conflict too.
        except (ResourceExistsError, ResourceModifiedError, ResourceNotFoundError) as error:
            self._forget(partition, key)
            raise ConcurrencyConflict(f"{partition}/{key} changed") from error
        except HttpResponseError as error:
            if too_large(error):
                raise RecordTooLarge(f"{partition}/{key}: the table refused it as too large") from error
            raise
        new_etag = str(metadata["etag"])
        self._remember_written(partition, key, Stored(record, new_etag), over=etag)
        return new_etag

    def _save_many(self, writes: list[Write], *, mode: UpdateMode = UpdateMode.REPLACE) -> list[str]:
        etags: dict[int, str] = {}
        for positions in transactions(writes):
            part = [writes[i] for i in positions]
            if len(part) == 1:
                etags[positions[0]] = self._save_one(part[0], mode=mode)
                continue
            operations: list[Any] = []
            for entity, etag, _ in part:
                if etag is None:
                    operations.append(("create", entity))
                else:
                    operations.append(("update", entity, _condition(etag, mode)))
            try:
                results = self._table.submit_transaction(operations)
            except (TableTransactionError, ResourceExistsError, ResourceModifiedError, HttpResponseError) as error:
                for entity, _, _ in part:
                    self._forget(str(entity["PartitionKey"]), str(entity["RowKey"]))
                if too_large(error):
                    raise RecordTooLarge(f"transaction of {len(part)} entities refused as too large") from error
                status = getattr(error, "status_code", None)
                if (
                    isinstance(error, HttpResponseError)
                    and not isinstance(error, TableTransactionError)
                    and status not in (409, 412)
                ):
                    raise
                raise ConcurrencyConflict(f"transaction of {len(part)} entities refused: {error}") from error
            for index, write, result in zip(positions, part, results, strict=True):
                etag = str(result["etag"])
                if not is_staged(write):
                    where = str(write[0]["PartitionKey"]), str(write[0]["RowKey"])
                    self._remember_written(*where, Stored(write[2], etag), over=write[1])
                etags[index] = etag
        return [etags[i] for i in range(len(writes))]

    def prune_vm_group(self, record: VmGroupRecord, etag: str) -> str | None:
        partition, key = group_partition(record.group), safe_key(record.group)
        if record.vms:
            return self._save_one((group_entity(record), etag, record), mode=UpdateMode.REPLACE)
        try:
            self._table.delete_entity(partition, key, etag=etag, match_condition=MatchConditions.IfNotModified)
        except ResourceModifiedError as error:
            raise ConcurrencyConflict(f"{partition}/{key} changed") from error
        finally:
            self._forget(partition, key)
        return None


def _condition(etag: str, mode: UpdateMode) -> dict[str, Any]:
    """An update's options: If-Match the ETag it was read with; "*", over whatever is stored under its key, whole (an
    outbox entry written over: staged.Staged.replaces), refused if it is gone."""
    if etag == "*":
        return {"mode": UpdateMode.REPLACE, "match_condition": MatchConditions.Unconditionally}
    return {"mode": mode, "etag": etag, "match_condition": MatchConditions.IfNotModified}
