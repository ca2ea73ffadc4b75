"""History: a row per observation, transition, decision, approval, hook, heartbeat, dead letter and alert.

In Azure: a Log Analytics custom table through the Logs Ingestion API (``LogsIngestionClient.upload``). Locally: an
embedded SQLite store with the same columns (from history_columns.json), read by the operator tool
``python -m ops.history``.

A write either takes every row it was given or raises ``HistoryError``: the rows stay in the state's outbox, and the
timer writes them again (pipeline/record.py). Writing a row twice adds nothing to the SQLite store, which keeps a row
once by its ``RecordId``; Log Analytics has no such key, so a query that must count exactly counts distinct RecordIds. A
row a sink cannot serialise (a non-finite number: JSON has none) is set aside alone, logged and counted
(``set_aside``), and the rest of the write goes on.
"""

from __future__ import annotations

import json
import logging
import math
import sqlite3
import threading
from collections.abc import Mapping, MutableMapping, Sequence
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
# which waits for it; rows not sent by then stay in the outbox for the timer.
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
    def write(self, rows: Sequence[HistoryRow]) -> None:
        """Takes every row (one it cannot serialise set aside, logged and counted), or raises ``HistoryError``."""


class HistoryError(Exception):
    """The sink did not take the rows (or not all of them): they are to be written again."""


def unserialisable(values: Mapping[str, Any]) -> str:
    """Why a row's values cannot be written as JSON ("" when they can): a non-finite number, which JSON has not."""
    try:
        json.dumps(values, allow_nan=False)
    except (ValueError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return ""


def _set_aside(row: HistoryRow, why: str) -> None:
    log.error(
        "history: row %s (%s, event %r) cannot be serialised and is set aside: %s",
        row.RecordId,
        row.RecordType,
        row.EventId,
        why,
    )


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
            # One row per RecordId (rows of a store made before RecordId have none, and are all kept): a row written
            # again is ignored.
            self._db.execute(f'CREATE UNIQUE INDEX IF NOT EXISTS ix_record ON "{self._table}" (RecordId)')
        names = list(self._types)
        self._insert = (
            f'INSERT OR IGNORE INTO "{self._table}" ({", ".join(names)}) VALUES ({", ".join("?" for _ in names)})'  # noqa: S608
        )
        self.set_aside = 0

    def _values(self, row: HistoryRow) -> tuple[Any, ...]:
        values: list[Any] = []
        for name, kind in self._types.items():
            value = getattr(row, name)
            if value is None or value == "":
                values.append(None)
            elif kind == "datetime":
                values.append(value.astimezone(UTC).isoformat())
            elif kind == "dynamic":
                values.append(json.dumps(value, separators=(",", ":"), allow_nan=False))
            elif isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{name} is {value}: not a finite number")
            elif kind == "boolean":
                values.append(int(value))
            else:
                values.append(value)
        return tuple(values)

    def write(self, rows: Sequence[HistoryRow]) -> None:
        written: list[tuple[HistoryRow, tuple[Any, ...]]] = []
        for row in rows:
            try:
                written.append((row, self._values(row)))
            except (ValueError, TypeError) as error:
                self._set_aside(row, f"{type(error).__name__}: {error}")
        if not written:
            return
        try:
            with self._lock, self._db:
                self._db.executemany(self._insert, [values for _, values in written])
            return
        except OverflowError:
            pass  # an integer SQLite cannot hold (beyond 64 bits): row by row, and that row set aside
        except sqlite3.Error as error:
            raise HistoryError(f"SQLite refused {len(written)} rows: {error}") from error
        for row, values in written:
            try:
                with self._lock, self._db:
                    self._db.execute(self._insert, values)
            except OverflowError as error:
                self._set_aside(row, f"{type(error).__name__}: {error}")
            except sqlite3.Error as error:
                raise HistoryError(f"SQLite refused a row: {error}") from error

    def _set_aside(self, row: HistoryRow, why: str) -> None:
        self.set_aside += 1
        _set_aside(row, why)

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        with self._lock:
            cursor = self._db.execute(sql, tuple(params))
            names = [d[0] for d in cursor.description or ()]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def close(self) -> None:
        self._db.close()


class LogsIngestionHistory:
    """History to Log Analytics via the Logs Ingestion API (DCR stream from history_columns.json).

    An upload that fails, whole or in part, raises ``HistoryError``: its rows stay in the outbox and are uploaded
    again by the timer (those of its chunks the service took are then in the table twice, with one RecordId). A row
    that is not JSON (the SDK writes ``Infinity`` for a non-finite number, and the service refuses the whole
    chunk that holds it) is set aside alone before the upload.
    """

    def __init__(
        self,
        *,
        endpoint: str,
        rule_id: str,
        credential: TokenCredential,
        stream_name: str | None = None,
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
        self._enforce_https = enforce_https
        self.set_aside = 0
        self._lock = threading.Lock()

    def write(self, rows: Sequence[HistoryRow]) -> None:
        logs: list[MutableMapping[str, Any]] = []
        for row in rows:
            values = row.to_log()
            why = unserialisable(values)
            if why:
                self.set_aside += 1
                _set_aside(row, why)
            else:
                logs.append(values)
        if not logs:
            return
        failed: list[Any] = []

        def on_error(error: LogsUploadError) -> None:
            failed.extend(error.failed_logs)
            log.warning("history upload failed for %d rows: %s", len(error.failed_logs), error.error)

        with self._lock:
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
                raise HistoryError(f"history upload of {len(logs)} rows failed: {error}") from error
        if failed:
            raise HistoryError(f"history upload: {len(failed)} of {len(logs)} rows refused")
