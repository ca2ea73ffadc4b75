"""The budget entities, mixed into ``TableStateStore`` (tables.py): one entity per budget domain in the budget
partition, each holding that domain's claims, written If-Match (or inserted) so that of two instances claiming the
last slot one is refused. The entities are those of entities.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from azure.core import MatchConditions
from azure.core.exceptions import ResourceModifiedError
from azure.data.tables import TableEntity

from coordinator.domain.claims import BudgetRecord
from coordinator.state.entities import BUDGET_PARTITION, budget_entity, budget_from_entity, safe_key
from coordinator.state.store import Stored
from coordinator.state.table_parts import TableParts, entity_etag


class TableBudgets(TableParts):
    """The budgets of ``TableStateStore``; it gives the table and its writes."""

    def get_budget(self, scale_set: str) -> Stored[BudgetRecord] | None:
        # Read without setting aside: a budget that cannot be read raises, which holds the decisions it counts
        # (read as empty, it would approve beyond its limit).
        entity = self._budget_entity(scale_set)
        return budget_from_entity(entity, entity_etag(entity)) if entity is not None else None

    def budget_etag(self, scale_set: str) -> str | None:
        entity = self._budget_entity(scale_set, select=["PartitionKey"])  # the ETag alone, not the claims
        return entity_etag(entity) if entity is not None else None

    def _budget_entity(self, scale_set: str, **options: Any) -> TableEntity | None:
        parameters = {"pk": BUDGET_PARTITION, "rk": safe_key(scale_set)}
        query = "PartitionKey eq @pk and RowKey eq @rk"
        return next(iter(self._table.query_entities(query, parameters=parameters, **options)), None)

    def save_budget(self, record: BudgetRecord, etag: str | None) -> str:
        return self._save_one((budget_entity(record), etag, record))

    def save_budgets(self, writes: Sequence[tuple[BudgetRecord, str | None]]) -> list[str]:
        return self._save_many([(budget_entity(record), etag, record) for record, etag in writes])

    def budgets(self) -> list[Stored[BudgetRecord]]:
        entities = self._table.query_entities("PartitionKey eq @pk", parameters={"pk": BUDGET_PARTITION})
        return [budget_from_entity(e, entity_etag(e)) for e in entities]

    def delete_budget(self, key: str, etag: str) -> bool:
        try:
            self._table.delete_entity(
                BUDGET_PARTITION, safe_key(key), etag=etag, match_condition=MatchConditions.IfNotModified
            )
        except ResourceModifiedError:
            return False
        return True
