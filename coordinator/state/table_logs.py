"""The table's logs and keys, mixed into ``TableStateStore`` (tables.py): the log of sent cards (one entity per batch
that sent cards, cleared by the timer), the keys every instance shares, the claims bound for good, and the dead
letters (their own table). The entities are those of entities.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from azure.core.exceptions import ResourceExistsError, ResourceNotFoundError
from azure.data.tables import TableClient, TableEntity, TableTransactionError

from coordinator.domain.model import SentAlerts
from coordinator.state.dead_letters import dead_letter_order, dead_letter_transactions
from coordinator.state.entities import (
    KEY_PARTITION,
    SENT_ALERTS_PARTITION,
    TRANSACTION_LIMIT,
    Entity,
    chunks,
    claim_entity,
    claim_from_entity,
    claim_name,
    claim_partition,
    claim_transactions,
    key_entity,
    key_from_entity,
    safe_key,
    sent_alerts_entity,
    sent_alerts_from_entity,
)
from coordinator.state.store import DeadLetter, R, Stored
from coordinator.state.table_parts import TableParts


class TableLogs(TableParts):
    """What ``TableStateStore`` keeps beside the records; it gives the tables and its reads."""

    _dead_letters: TableClient

    def _decoded(
        self, entities: Iterable[TableEntity], parse: Callable[[Any, str | None], Stored[R]]
    ) -> list[tuple[str, Stored[R]]]:
        raise NotImplementedError

    # the log of sent cards -----------------------------------------------------------------------------------
    def log_sent_alerts(self, record: SentAlerts) -> None:
        self._table.create_entity(sent_alerts_entity(record))

    def sent_alert_logs(self) -> list[tuple[str, SentAlerts]]:
        entities = self._table.query_entities("PartitionKey eq @pk", parameters={"pk": SENT_ALERTS_PARTITION})
        return [(key, stored.record) for key, stored in self._decoded(entities, sent_alerts_from_entity)]

    def delete_sent_alert_logs(self, keys: Sequence[str]) -> None:
        for chunk in chunks(list(dict.fromkeys(keys)), TRANSACTION_LIMIT):
            try:
                self._table.submit_transaction(
                    [("delete", {"PartitionKey": SENT_ALERTS_PARTITION, "RowKey": key}) for key in chunk]
                )
            except TableTransactionError as error:
                if error.status_code != 404:
                    raise
                # One is gone already (a timer run that overlapped this one deleted it), which refuses the whole
                # transaction: delete them one by one, where the SDK answers a delete of a gone entity as done.
                for key in chunk:
                    self._table.delete_entity(SENT_ALERTS_PARTITION, key)

    # keys ----------------------------------------------------------------------------------------------------
    def shared_key(self, name: str) -> bytes:
        # Readable only by identities with data access to this table (e.g. the approval form's anti-forgery key).
        with contextlib.suppress(ResourceExistsError):
            self._table.create_entity(key_entity(name))
        return key_from_entity(self._table.get_entity(KEY_PARTITION, safe_key(name)))

    def claim(self, name: str, value: str) -> str:
        with contextlib.suppress(ResourceExistsError):
            self._table.create_entity(claim_entity(name, value))
            return value
        return claim_from_entity(self._table.get_entity(claim_partition(name), safe_key(name)))

    def claimed(self, name: str) -> str | None:
        try:
            return claim_from_entity(self._table.get_entity(claim_partition(name), safe_key(name)))
        except ResourceNotFoundError:
            return None

    def claims_in(self, partition: str) -> dict[str, str]:
        entities = self._table.query_entities(
            "PartitionKey eq @pk", parameters={"pk": partition}, select=["Name", "Value"]
        )
        return {name: claim_from_entity(e) for e in entities if (name := claim_name(e)) is not None}

    def claim_many(self, items: Sequence[tuple[str, str]]) -> dict[str, str]:
        bound: dict[str, str] = {}
        for part in claim_transactions([claim_entity(name, value) for name, value in dict(items).items()]):
            self._claim_transaction(part, bound)
        return bound

    def _claim_transaction(self, part: list[Entity], bound: dict[str, str]) -> None:
        """One partition's claims inserted together, into ``bound``. The whole transaction is refused for one name
        bound already: its value is read and the rest sent again. An index that names an entity not there is not
        trusted: each claim is then made alone."""
        while part:
            try:
                self._table.submit_transaction([("create", e) for e in part])
            except TableTransactionError as error:
                if error.status_code != 409:
                    raise
                taken = part.pop(error.index if 0 <= error.index < len(part) else 0)
                found = self.claimed(str(taken["Name"]))
                if found is None:
                    for entity in (taken, *part):
                        bound[str(entity["Name"])] = self.claim(str(entity["Name"]), str(entity["Value"]))
                    return
                bound[str(taken["Name"])] = found
                continue
            bound.update({str(e["Name"]): str(e["Value"]) for e in part})
            return

    # dead letters --------------------------------------------------------------------------------------------
    def put_dead_letters(self, letters: Sequence[DeadLetter]) -> None:
        # Inserted, not upserted: Azurite looks an upserted entity up in its partition, and a 50,000-row storm took
        # 27 s instead of 10 s (in Azure an insert is the cheaper operation too).
        for part in dead_letter_transactions(letters):
            try:
                self._dead_letters.submit_transaction([("create", e) for e in part])
            except TableTransactionError as error:
                if error.status_code != 409:
                    raise
                # A row key is the arrival time and 48 random bits: one that exists is this very transaction's,
                # landed by an attempt whose answer was lost (a transaction is all or none).

    def dead_letters(self) -> list[dict[str, Any]]:
        return sorted((dict(e) for e in self._dead_letters.list_entities()), key=dead_letter_order)
