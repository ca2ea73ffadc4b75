"""KQL on the local history: the SQLite store (history.py) loaded into an in-memory DuckDB table typed as the Log
Analytics table is, and the query run by duckdb-kql (translates KQL to DuckDB SQL; it refuses what it does not
support rather than guess). Behind ``python -m ops.history kql FILE_OR_QUERY``.

Local tooling only: duckdb-kql is in requirements-dev.txt, not in the Functions app's requirements.txt, and is
imported when a query runs, so this module imports anywhere.
"""

from __future__ import annotations

import json
import sqlite3
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coordinator import column_types, history_schema

if TYPE_CHECKING:
    from duckdb import DuckDBPyConnection

# Log Analytics column type -> DuckDB type, as duckdb-kql maps them back (TIMESTAMP is datetime, JSON is dynamic).
_DUCKDB_TYPES = {
    "datetime": "TIMESTAMP",
    "string": "VARCHAR",
    "dynamic": "JSON",
    "int": "INTEGER",
    "long": "BIGINT",
    "boolean": "BOOLEAN",
    "real": "DOUBLE",
}


class KqlQueryError(ValueError):
    """The query could not run; the message names the query and the engine's reason."""


@dataclass(frozen=True)
class KqlResult:
    columns: list[str]
    # Each column's Kusto type (string, long, datetime, dynamic, ...), as duckdb-kql maps the DuckDB types back.
    types: list[str]
    rows: list[tuple[Any, ...]]

    def records(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, row, strict=True)) for row in self.rows]


def _value(value: Any, kind: str) -> Any:
    """A SQLite value as Log Analytics holds it, for the JSON lines DuckDB reads."""
    if value is None:
        # A Log Analytics string is never null: a column left out of an ingested row reads as "" (isempty), and
        # SqliteHistory stores "" as NULL.
        return "" if kind == "string" else None
    if kind == "datetime":
        # TIMESTAMP without a zone, in UTC: duckdb-kql runs its connection in UTC, as Kusto's datetimes are.
        return datetime.fromisoformat(value).astimezone(UTC).replace(tzinfo=None).isoformat(sep=" ")
    if kind == "dynamic":
        return json.loads(value)
    if kind == "boolean":
        return bool(value)
    return value


def load(db_path: str | Path) -> DuckDBPyConnection:
    """An in-memory DuckDB connection holding the history table, read from the SQLite file (opened read-only)."""
    import duckdb_kql  # noqa: PLC0415 -- local tooling only, see the module docstring

    table = history_schema()["table"]
    types = column_types()
    source = sqlite3.connect(f"file:{Path(db_path).resolve()}?mode=ro", uri=True)
    try:
        names = ", ".join(f'"{name}"' for name in types)
        rows = source.execute(f'SELECT {names} FROM "{table}"').fetchall()  # noqa: S608 -- names from history_columns.json
    except sqlite3.Error as error:
        raise KqlQueryError(f"{db_path}: not a history database: {error}") from error
    finally:
        source.close()
    con = duckdb_kql.connect()
    duckdb_types = {name: _DUCKDB_TYPES[kind] for name, kind in types.items()}
    # Through a JSON-lines file that DuckDB reads with the table's types: executemany inserts a few hundred rows a
    # second, this some hundred thousand.
    with tempfile.TemporaryDirectory(prefix="history-kql-") as folder:
        lines = Path(folder) / "history.jsonl"
        with lines.open("w", encoding="utf-8") as out:
            for row in rows:
                record = {name: _value(value, kind) for (name, kind), value in zip(types.items(), row, strict=True)}
                out.write(json.dumps(record, separators=(",", ":")) + "\n")
        con.execute(
            f'CREATE TABLE "{table}" AS SELECT * '  # noqa: S608 -- the table name comes from history_columns.json
            "FROM read_json(?, format = 'newline_delimited', columns = ?)",
            [str(lines), duckdb_types],
        )
    return con


def run(con: DuckDBPyConnection, text: str, *, name: str = "query", now: datetime | None = None) -> KqlResult:
    """Run one KQL query, read-only. ``now`` pins now()/ago() (tests); by default they are the current time."""
    import duckdb  # noqa: PLC0415 -- local tooling only, see the module docstring
    import duckdb_kql  # noqa: PLC0415
    from duckdb_kql.types import kusto_type  # noqa: PLC0415

    query_now = now.astimezone(UTC).replace(tzinfo=None) if now is not None else None
    try:
        relation = duckdb_kql.kql(con, text, allow_write=False, query_now=query_now)
        rows = relation.fetchall()
    except (duckdb_kql.KqlError, duckdb.Error) as error:
        raise KqlQueryError(f"{name}: {type(error).__name__}: {error}") from error
    return KqlResult(columns=list(relation.columns), types=[kusto_type(t) for t in relation.types], rows=rows)


def query_text(file_or_query: str) -> tuple[str, str]:
    """(name, KQL): a ``.kql`` path or a path to an existing file is read (named by its path), anything else is the
    query itself."""
    path = Path(file_or_query)
    if file_or_query.endswith(".kql") or _names_a_file(path):
        try:
            return str(path), path.read_text(encoding="utf-8")
        except OSError as error:
            raise KqlQueryError(f"{file_or_query}: cannot read the query file: {error.strerror}") from error
    return "query", file_or_query


def _names_a_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):
        # Text no file can be named (longer than a file name may be, or holding a NUL): a pasted query.
        return False


def rows_for_display(result: KqlResult) -> list[dict[str, Any]]:
    """Records with datetimes in ISO-8601 UTC, as Log Analytics shows them."""
    shown = []
    for record in result.records():
        for key, value in record.items():
            if isinstance(value, datetime):
                record[key] = value.replace(tzinfo=UTC).isoformat()
        shown.append(record)
    return shown
