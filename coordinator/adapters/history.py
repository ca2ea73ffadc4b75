"""History: a row per observation, transition, decision, approval, hook, heartbeat, dead letter and alert.

In Azure: a Log Analytics custom table through the Logs Ingestion API (``LogsIngestionClient.upload``). Locally: an
embedded SQLite store with the same columns (from history_columns.json), read by the operator tool
``python -m ops.history``.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections.abc import MutableMapping, Sequence
from datetime import UTC
from pathlib import Path
from typing import Any, Protocol

from azure.core.credentials import TokenCredential
from azure.core.exceptions import AzureError
from azure.core.pipeline.transport import RequestsTransport
from azure.monitor.ingestion import LogsIngestionClient, LogsUploadError

from coordinator.adapters import deadline
from coordinator.domain.rows import HistoryRow, column_types, history_schema

log = logging.getLogger("coordinator.adapters.history")

# The total deadline of one upload, the SDK's retries included: history is the last step of every run's tail,
# which waits for it; rows not sent by then stay pending for the next write.
UPLOAD_DEADLINE_SECONDS = 15.0

_SQLITE_TYPES = {
    "datetime": "TEXT",
    "string": "TEXT",
    "dynamic": "TEXT",
    "int": "INTEGER",
    "long": "INTEGER",
    "boolean": "INTEGER",
    "real": "REAL",
}
DEFAULT_SQLITE_PATH = ".local/history.sqlite"


class HistorySink(Protocol):
    def write(self, rows: Sequence[HistoryRow]) -> None: ...


class SqliteHistory:
    """The local history store. One table, the columns of history_columns.json, ISO-8601 UTC datetimes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if str(path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._table = history_schema()["table"]
        self._types = column_types()
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        columns = ", ".join(f'"{name}" {_SQLITE_TYPES[kind]}' for name, kind in self._types.items())
        with self._db:
            self._db.execute(f'CREATE TABLE IF NOT EXISTS "{self._table}" ({columns})')
            # A store made before a column existed gets it added (new columns are appended, never changed).
            present = {row[1] for row in self._db.execute(f'PRAGMA table_info("{self._table}")')}
            for name, kind in self._types.items():
                if name not in present:
                    self._db.execute(f'ALTER TABLE "{self._table}" ADD COLUMN "{name}" {_SQLITE_TYPES[kind]}')
            self._db.execute(f'CREATE INDEX IF NOT EXISTS ix_event ON "{self._table}" (EventId, TimeGenerated)')
            self._db.execute(f'CREATE INDEX IF NOT EXISTS ix_time ON "{self._table}" (TimeGenerated)')
        names = list(self._types)
        self._insert = f'INSERT INTO "{self._table}" ({", ".join(names)}) VALUES ({", ".join("?" for _ in names)})'  # noqa: S608

    def _values(self, row: HistoryRow) -> tuple[Any, ...]:
        values: list[Any] = []
        for name, kind in self._types.items():
            value = getattr(row, name)
            if value is None or value == "":
                values.append(None)
            elif kind == "datetime":
                values.append(value.astimezone(UTC).isoformat())
            elif kind == "dynamic":
                values.append(json.dumps(value, separators=(",", ":")))
            elif kind == "boolean":
                values.append(int(value))
            else:
                values.append(value)
        return tuple(values)

    def write(self, rows: Sequence[HistoryRow]) -> None:
        if not rows:
            return
        with self._lock, self._db:
            self._db.executemany(self._insert, [self._values(row) for row in rows])

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        with self._lock:
            cursor = self._db.execute(sql, tuple(params))
            names = [d[0] for d in cursor.description or ()]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def close(self) -> None:
        self._db.close()


class LogsIngestionHistory:
    """History to Log Analytics via the Logs Ingestion API (DCR stream from history_columns.json).

    Rows that fail to upload are kept (bounded) and re-sent with the next write: history never blocks the
    pipeline, and a dropped row is logged and counted rather than silently lost.
    """

    def __init__(
        self,
        *,
        endpoint: str,
        rule_id: str,
        credential: TokenCredential,
        stream_name: str | None = None,
        max_pending: int = 50_000,
        enforce_https: bool = True,
        deadline_seconds: float = UPLOAD_DEADLINE_SECONDS,
        client: LogsIngestionClient | None = None,
    ) -> None:
        self._client = client or LogsIngestionClient(
            endpoint=endpoint, credential=credential, transport=RequestsTransport(session=deadline.session())
        )
        self._deadline = deadline_seconds
        self._rule_id = rule_id
        self._stream = stream_name or history_schema()["stream"]
        self._max_pending = max_pending
        self._enforce_https = enforce_https
        self._pending: list[MutableMapping[str, Any]] = []
        self.dropped = 0
        self._lock = threading.Lock()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def write(self, rows: Sequence[HistoryRow]) -> None:
        with self._lock:
            logs: list[MutableMapping[str, Any]] = [*self._pending, *(row.to_log() for row in rows)]
            self._pending = []
            if not logs:
                return
            failed: list[MutableMapping[str, Any]] = []

            def on_error(error: LogsUploadError) -> None:
                failed.extend(dict(item) for item in error.failed_logs)
                log.warning("history upload failed for %d rows: %s", len(error.failed_logs), error.error)

            try:
                # enforce_https is a per-call option of the SDK's pipeline (the constructor ignores it); timeout
                # bounds its retries, the deadline every byte of every attempt.
                with deadline.deadline(self._deadline, f"Logs Ingestion upload of {len(logs)} rows"):
                    self._client.upload(
                        rule_id=self._rule_id,
                        stream_name=self._stream,
                        logs=logs,
                        on_error=on_error,
                        enforce_https=self._enforce_https,
                        timeout=self._deadline,
                    )
            except (AzureError, deadline.DeadlineExceeded) as error:
                log.warning("history upload failed for %d rows: %s", len(logs), error)
                failed = logs
            if len(failed) > self._max_pending:
                self.dropped += len(failed) - self._max_pending
                log.error("history: dropped %d rows (pending bound %d)", self.dropped, self._max_pending)
                failed = failed[-self._max_pending :]
            self._pending = failed
