"""History: a row per observation, transition, decision, approval, hook, heartbeat, dead letter and alert.

In Azure: a Log Analytics custom table through the Logs Ingestion API (``LogsIngestionClient.upload``). Locally: an
embedded SQLite store with the same columns (from history_columns.json) and a CLI::

    python -m coordinator.history [--db PATH] timeline EVENT_ID
    python -m coordinator.history [--db PATH] events --since 7d
    python -m coordinator.history [--db PATH] sql "SELECT RecordType, count(*) AS n FROM ScheduledEventsHistory_CL
                                                      GROUP BY RecordType"
    python -m coordinator.history [--db PATH] kql infra/queries/hooks-failing.kql   (or the KQL text itself)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sqlite3
import sys
import threading
from collections.abc import MutableMapping, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

from azure.core.credentials import TokenCredential
from azure.core.exceptions import AzureError
from azure.monitor.ingestion import LogsIngestionClient, LogsUploadError

from coordinator.rows import HistoryRow, column_types, history_schema

log = logging.getLogger("coordinator.history")

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
        client: LogsIngestionClient | None = None,
    ) -> None:
        self._client = client or LogsIngestionClient(endpoint=endpoint, credential=credential)
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
                # enforce_https is a per-call option of the SDK's pipeline (the constructor ignores it).
                self._client.upload(
                    rule_id=self._rule_id,
                    stream_name=self._stream,
                    logs=logs,
                    on_error=on_error,
                    enforce_https=self._enforce_https,
                )
            except AzureError as error:
                log.warning("history upload failed for %d rows: %s", len(logs), error)
                failed = logs
            if len(failed) > self._max_pending:
                self.dropped += len(failed) - self._max_pending
                log.error("history: dropped %d rows (pending bound %d)", self.dropped, self._max_pending)
                failed = failed[-self._max_pending :]
            self._pending = failed


_SINCE = re.compile(r"^(\d+)([smhd])$")


def parse_since(value: str, *, now: datetime | None = None) -> datetime:
    """'7d', '12h', '30m', '45s', or an ISO-8601 timestamp -> aware UTC datetime."""
    now = now or datetime.now(UTC)
    match = _SINCE.match(value.strip())
    if match:
        unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[match.group(2)]
        return now - timedelta(**{unit: int(match.group(1))})
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError as error:
        raise ValueError(f"--since {value!r}: use e.g. 7d, 12h, 30m or an ISO-8601 time") from error
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def timeline(store: SqliteHistory, event_id: str) -> list[dict[str, Any]]:
    table = history_schema()["table"]
    return store.query(
        "SELECT TimeGenerated, RecordType, VmName, EventStatus, PreviousState, State, Rule, Action, Actor, Outcome, "  # noqa: S608 -- the table name comes from history_columns.json
        f'Reason FROM "{table}" WHERE EventId = ? ORDER BY TimeGenerated, rowid',
        (event_id,),
    )


def events_since(store: SqliteHistory, since: datetime) -> list[dict[str, Any]]:
    table = history_schema()["table"]
    return store.query(
        # The table name comes from history_columns.json; values are bound parameters.
        "SELECT EventId, min(EventType) AS EventType, min(TimeGenerated) AS FirstSeen, max(TimeGenerated) AS LastRow, "  # noqa: S608
        "count(DISTINCT VmName) AS Vms, "
        f'(SELECT State FROM "{table}" t2 WHERE t2.EventId = t.EventId ORDER BY TimeGenerated DESC, rowid DESC '
        f'LIMIT 1) AS State FROM "{table}" t WHERE EventId IS NOT NULL AND TimeGenerated >= ? '
        "GROUP BY EventId ORDER BY FirstSeen",
        (since.astimezone(UTC).isoformat(),),
    )


def _print_table(rows: list[dict[str, Any]]) -> None:
    if not rows:
        print("(no rows)")
        return
    names = list(rows[0])
    widths = {n: min(60, max(len(n), *(len(str(r[n] if r[n] is not None else "")) for r in rows))) for n in names}
    print("  ".join(n.ljust(widths[n]) for n in names))
    for row in rows:
        cells = (str(row[n] if row[n] is not None else "")[: widths[n]].ljust(widths[n]) for n in names)
        print("  ".join(cells).rstrip())


def _kql(db: str, file_or_query: str, *, as_json: bool) -> int:
    from coordinator import kql  # noqa: PLC0415 -- needs duckdb-kql, a development requirement only

    try:
        name, text = kql.query_text(file_or_query)
        rows = kql.rows_for_display(kql.run(kql.load(db), text, name=name))
    except kql.KqlQueryError as error:
        print(f"kql: {error}", file=sys.stderr)
        return 2
    if as_json:
        for row in rows:
            print(json.dumps(row))
    else:
        _print_table(rows)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m coordinator.history", description="Query the local history.")
    parser.add_argument(
        "--db",
        default=os.environ.get("COORDINATOR_HISTORY_SQLITE_PATH", DEFAULT_SQLITE_PATH),
        help="SQLite file (default: $COORDINATOR_HISTORY_SQLITE_PATH or %(default)s)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("timeline", help="every row of one event, in order").add_argument("event_id")
    commands.add_parser("events", help="events seen since a time").add_argument("--since", default="7d")
    commands.add_parser("sql", help="a read-only SQL query").add_argument("query")
    commands.add_parser(
        "kql", help="a KQL query (a .kql file or the text) on the history, as in Log Analytics (duckdb-kql)"
    ).add_argument("file_or_query")
    args = parser.parse_args(argv)
    if not Path(args.db).exists():
        print(f"history database {args.db} does not exist (see --db)", file=sys.stderr)
        return 2
    if args.command == "kql":
        return _kql(args.db, args.file_or_query, as_json=args.json)
    store = SqliteHistory(args.db)
    try:
        if args.command == "timeline":
            rows = timeline(store, args.event_id)
        elif args.command == "events":
            rows = events_since(store, parse_since(args.since))
        else:
            # Read-only: the query runs on a connection opened with mode=ro.
            readonly = sqlite3.connect(f"file:{Path(args.db).resolve()}?mode=ro", uri=True)
            try:
                cursor = readonly.execute(args.query)
                names = [d[0] for d in cursor.description or ()]
                rows = [dict(zip(names, r, strict=True)) for r in cursor.fetchall()]
            except sqlite3.Error as error:
                print(f"sql: {error}", file=sys.stderr)
                return 2
            finally:
                readonly.close()
    except ValueError as error:
        print(str(error), file=sys.stderr)
        return 2
    finally:
        store.close()
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        _print_table(rows)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:
        # The reader left (e.g. `| head`): what it did not read is not an error of this command. Python's
        # documented way out: point stdout at devnull so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)  # 128 + SIGPIPE, as a shell reports a command killed by a closed pipe
