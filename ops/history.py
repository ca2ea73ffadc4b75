"""Query the local history (the SQLite store the local pipeline writes, same columns as the Log Analytics table)::

python -m ops.history [--db PATH] timeline EVENT_ID
python -m ops.history [--db PATH] events --since 7d
python -m ops.history [--db PATH] sql "SELECT RecordType, count(*) AS n FROM ScheduledEventsHistory_CL
                                       GROUP BY RecordType"
python -m ops.history [--db PATH] kql infra/queries/hooks-failing.kql   (or the KQL text itself)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sqlite3
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from coordinator.adapters.history import DEFAULT_SQLITE_PATH, SqliteHistory
from coordinator.domain.rows import history_schema

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
    from ops import kql  # noqa: PLC0415 -- needs duckdb-kql, a development requirement only

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
    parser = argparse.ArgumentParser(prog="python -m ops.history", description="Query the local history.")
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
