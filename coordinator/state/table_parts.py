"""What ``TableStateStore`` (tables.py) gives the parts mixed into it (table_outbox.py, table_budgets.py): its table
and its writes; and how an entity read from the table tells its ETag.
"""

from __future__ import annotations

from azure.data.tables import TableClient, TableEntity, UpdateMode

from coordinator.state.entities import Write


class TableParts:
    """The table and the writes of ``TableStateStore``, which its parts build on."""

    _table: TableClient

    def _save_one(self, write: Write, *, mode: UpdateMode = UpdateMode.REPLACE) -> str:
        raise NotImplementedError

    def _save_many(self, writes: list[Write], *, mode: UpdateMode = UpdateMode.REPLACE) -> list[str]:
        raise NotImplementedError


def entity_etag(entity: TableEntity) -> str:
    return str(entity.metadata["etag"])
