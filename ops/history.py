"""Query the local history (the SQLite store the local pipeline writes, same columns as the Log Analytics table)::

python -m ops.history [--db PATH] timeline EVENT        (an EventId, a prefix of one, any case, or a scenario ref)
python -m ops.history [--db PATH] events --since 7d
python -m ops.history [--db PATH] sql "SELECT RecordType, count(*) AS n FROM ScheduledEventsHistory_CL
                                       GROUP BY RecordType"
python -m ops.history [--db PATH] kql infra/queries/hooks-failing.kql   (or the KQL text itself)

Exit codes: 0 done, 1 no event matches (timeline), 2 bad input (the database, the query, an option; the message
names it and says why). The database is opened read-only: no command writes to it.
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
from typing import Any, NoReturn

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from coordinator import DEFAULT_SQLITE_PATH, history_schema
from ops import command

OK, NO_MATCH, BAD_INPUT = 0, 1, 2
_SINCE = re.compile(r"^(\d+)([smhd])$")
TABLE = str(history_schema()["table"])
# Written by the local runner (``python -m local``) beside the history it makes: what the history itself cannot say
# about that run (its time scale, the scenario's names for its events).
LOCAL_RUN_FILE = "local-run.json"
# A table cell is cut at this width; the last column never is (nothing follows it to align).
CELL_WIDTH = 60


class HistoryInputError(ValueError):
    """The database or an argument cannot be used; the message names it and says why."""


class LocalRun(BaseModel):
    """What a local run says about its history (``LOCAL_RUN_FILE``)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    scenario: str
    # Durations in the run were those of Azure divided by this (a 15-minute notice lasted 15 s at 60).
    timeScale: float = Field(gt=0)
    # The scenario's ref of each event it created -> the EventId the emulator gave it.
    refs: dict[str, str] = Field(default_factory=dict)


def local_run_path(db: str | Path) -> Path:
    return Path(db).with_name(LOCAL_RUN_FILE)


def read_local_run(db: str | Path) -> LocalRun | None:
    """The local run that wrote ``db`` (None for a history no local run wrote, e.g. an export from Azure)."""
    path = local_run_path(db)
    try:
        return LocalRun.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValidationError) as error:
        raise HistoryInputError(f"{path}: not a local run's record: {error}") from None


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


def open_history(db: str | Path) -> sqlite3.Connection:
    """The history database, read-only; refuses a file that is missing, not SQLite, or has no history table."""
    path = Path(db)
    if not path.is_file():
        raise HistoryInputError(f"history database {db} does not exist (see --db)")
    connection = sqlite3.connect(f"file:{path.resolve()}?mode=ro", uri=True)
    try:
        found = connection.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (TABLE,))
        if found.fetchone() is None:
            raise HistoryInputError(f"history database {db}: no table {TABLE} (not a history database)")
    except sqlite3.DatabaseError as error:
        connection.close()
        raise HistoryInputError(f"history database {db}: not an SQLite database ({error})") from None
    except HistoryInputError:
        connection.close()
        raise
    return connection


def _rows(connection: sqlite3.Connection, sql: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
    cursor = connection.execute(sql, params)
    names = [d[0] for d in cursor.description or ()]
    return [dict(zip(names, r, strict=True)) for r in cursor.fetchall()]


def matching_events(connection: sqlite3.Connection, wanted: str, run: LocalRun | None) -> list[str]:
    """The EventIds ``wanted`` names: a scenario ref of the local run, else the EventId in any case, else every
    EventId it begins (an 8-character prefix is what the local run prints)."""
    if run is not None:
        by_ref = {ref.lower(): event_id for ref, event_id in run.refs.items()}
        if wanted.lower() in by_ref:
            return [by_ref[wanted.lower()]]
    text = wanted.strip().upper()
    if not text:
        return []
    found = _rows(
        connection,
        f'SELECT DISTINCT EventId FROM "{TABLE}" WHERE upper(substr(EventId, 1, ?)) = ? ORDER BY EventId',  # noqa: S608 -- the table name comes from history_columns.json
        (len(text), text),
    )
    ids = [str(row["EventId"]) for row in found]
    exact = [event_id for event_id in ids if event_id.upper() == text]
    return exact or ids


def timeline(connection: sqlite3.Connection, event_id: str) -> list[dict[str, Any]]:
    return _rows(
        connection,
        "SELECT TimeGenerated, RecordType, VmName, EventStatus, PreviousState, State, Rule, Action, Actor, Outcome, "  # noqa: S608 -- the table name comes from history_columns.json
        f'Reason FROM "{TABLE}" WHERE EventId = ? ORDER BY TimeGenerated, rowid',
        (event_id,),
    )


def events_since(connection: sqlite3.Connection, since: datetime, run: LocalRun | None) -> list[dict[str, Any]]:
    rows = _rows(
        connection,
        # The table name comes from history_columns.json; values are bound parameters.
        "SELECT EventId, min(EventType) AS EventType, min(TimeGenerated) AS FirstSeen, max(TimeGenerated) AS LastRow, "  # noqa: S608
        "count(DISTINCT VmName) AS Vms, "
        f'(SELECT State FROM "{TABLE}" t2 WHERE t2.EventId = t.EventId ORDER BY TimeGenerated DESC, rowid DESC '
        f'LIMIT 1) AS State FROM "{TABLE}" t WHERE EventId IS NOT NULL AND TimeGenerated >= ? '
        "GROUP BY EventId ORDER BY FirstSeen",
        (since.astimezone(UTC).isoformat(),),
    )
    if run is None:
        return rows
    # A local run's events also by the scenario's names for them, which its timeline printed.
    names = {event_id: ref for ref, event_id in run.refs.items()}
    return [{"EventId": row["EventId"], "Ref": names.get(str(row["EventId"]))} | row for row in rows]


def _print_table(rows: list[dict[str, Any]]) -> None:
    if not rows:
        print("(no rows)")
        return
    names = list(rows[0])

    def cell(row: dict[str, Any], name: str) -> str:
        return str(row[name] if row[name] is not None else "")

    widths = {n: min(CELL_WIDTH, max(len(n), *(len(cell(r, n)) for r in rows))) for n in names}
    widths[names[-1]] = 0  # the last column is printed whole (a reason cut mid-sentence says nothing)
    print("  ".join(n.ljust(widths[n]) for n in names).rstrip())
    for row in rows:
        cells = [cell(row, n)[: widths[n]].ljust(widths[n]) for n in names[:-1]]
        print("  ".join([*cells, cell(row, names[-1])]).rstrip())


def _kql(db: str, file_or_query: str, *, as_json: bool) -> int:
    from ops import kql  # noqa: PLC0415 -- needs duckdb-kql, a development requirement only

    try:
        name, text = kql.query_text(file_or_query)
        rows = kql.rows_for_display(kql.run(kql.load(db), text, name=name))
    except kql.KqlQueryError as error:
        print(f"kql: {error}", file=sys.stderr)
        return BAD_INPUT
    _print(rows, as_json=as_json)
    return OK


def _print(rows: list[dict[str, Any]], *, as_json: bool) -> None:
    if as_json:
        for row in rows:
            print(json.dumps(row))
    else:
        _print_table(rows)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=command.prog("ops.history"),
        description="Query the local history (read-only).",
        epilog="exit codes: 0 done, 1 no event matches (timeline), 2 bad input (the database, the query, an option)",
    )
    parser.add_argument(
        "--db",
        default=os.environ.get("COORDINATOR_HISTORY_SQLITE_PATH", DEFAULT_SQLITE_PATH),
        help="SQLite file (default: $COORDINATOR_HISTORY_SQLITE_PATH or %(default)s)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    # Not required here: argparse would report a missing command before an unknown option (`--bogus` alone read
    # "the following arguments are required: command"); main() says which is wrong.
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser("timeline", help="every row of one event, in order").add_argument(
        "event",
        metavar="EVENT",
        help="an EventId, a prefix of one (the 8 characters a local run prints), any case, or a scenario ref "
        "(a local run's history)",
    )
    commands.add_parser("events", help="events seen since a time").add_argument("--since", default="7d")
    commands.add_parser("sql", help="a read-only SQL query").add_argument("query")
    commands.add_parser(
        "kql", help="a KQL query (a .kql file or the text) on the history, as in Log Analytics (duckdb-kql)"
    ).add_argument("file_or_query")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.error("a command is required: timeline, events, sql or kql")
    try:
        connection = open_history(args.db)
    except HistoryInputError as error:
        print(error, file=sys.stderr)
        return BAD_INPUT
    try:
        if args.command == "kql":
            return _kql(args.db, args.file_or_query, as_json=args.json)
        return _command(connection, args)
    except (HistoryInputError, ValueError) as error:
        print(error, file=sys.stderr)
        return BAD_INPUT
    finally:
        connection.close()


def _command(connection: sqlite3.Connection, args: argparse.Namespace) -> int:
    if args.command == "timeline":
        run = read_local_run(args.db)
        ids = matching_events(connection, args.event, run)
        if not ids:
            print(
                f"timeline: no event in {args.db} matches {args.event!r} (an EventId, a prefix of one, or a scenario "
                "ref of the local run); list them with: events --since 7d",
                file=sys.stderr,
            )
            return NO_MATCH
        if len(ids) > 1:
            shown = ", ".join(ids[:5]) + (", …" if len(ids) > 5 else "")
            raise HistoryInputError(
                f"timeline: {args.event!r} begins {len(ids)} EventIds ({shown}); give more of the one you mean"
            )
        rows = timeline(connection, ids[0])
    elif args.command == "events":
        rows = events_since(connection, parse_since(args.since), read_local_run(args.db))
    else:
        try:
            rows = _rows(connection, args.query)
        except sqlite3.Error as error:
            raise HistoryInputError(f"sql: {error}") from None
    _print(rows, as_json=args.json)
    return OK


def cli() -> NoReturn:
    """The console command ``sefleet-history``."""
    command.run(main)


if __name__ == "__main__":
    cli()
