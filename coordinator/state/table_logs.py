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
from coordinator.state.entities import (
    CLAIM_PARTITION,
    KEY_PARTITION,
    SENT_ALERTS_PARTITION,
    TRANSACTION_LIMIT,
    chunks,
    claim_entity,
    claim_from_entity,
    dead_letter_transactions,
    key_entity,
    key_from_entity,
    safe_key,
    sent_alerts_entity,
    sent_alerts_from_entity,
)
from coordinator.state.store import DeadLetter, R, Stored


class TableLogs:
    """What ``TableStateStore`` keeps beside the records; it gives the tables and its reads."""

    _table: TableClient
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
        return claim_from_entity(self._table.get_entity(CLAIM_PARTITION, safe_key(name)))

    def claimed(self, name: str) -> str | None:
        try:
            return claim_from_entity(self._table.get_entity(CLAIM_PARTITION, safe_key(name)))
        except ResourceNotFoundError:
            return None

    # dead letters --------------------------------------------------------------------------------------------
    def put_dead_letters(self, letters: Sequence[DeadLetter]) -> None:
        for part in dead_letter_transactions(letters):
            self._dead_letters.submit_transaction([("upsert", e) for e in part])

    def dead_letters(self) -> list[dict[str, Any]]:
        return [dict(e) for e in self._dead_letters.list_entities()]
