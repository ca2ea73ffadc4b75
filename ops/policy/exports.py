"""Read the history rows to replay: the local SQLite store, or the Log Analytics table exported as JSON or CSV.

Takes a path; gives ``HistoryRow``s in the order they were written, and the rows set aside (with the row's number
and why). Accepted shapes, each with the columns of coordinator/history_columns.json:

- SQLite: the file ``adapters/history.py`` writes (table ScheduledEventsHistory_CL), opened read-only.
- JSON: a list of objects, one per row, as ``az monitor log-analytics query -w WORKSPACE --analytics-query
  "ScheduledEventsHistory_CL" -o json`` prints them (every value may be a string; ``dynamic`` columns as JSON text
  or as JSON); or the Log Analytics query API's response
  (``{"tables": [{"columns": [{"name": ...}], "rows": [[...]]}]}``).
- CSV: a header row then one row per record, as the portal's "Export to CSV (all columns)" writes it: a datetime
  column's header may carry " [UTC]" ("TimeGenerated [UTC]") and its value be "11/24/2026, 11:37:42.810 PM" or
  ISO-8601; dynamic columns are JSON text; booleans true/false.

Columns Log Analytics adds to every table (TenantId, Type, SourceSystem, TableName, _ResourceId, _ItemId, ...) are
ignored; any other column not in history_columns.json is an error (the export is not of this table). Rows are
ordered by TimeGenerated, rows of one instant in the order the coordinator writes them (observations and hook
reports before the decision they led to), then in the order they were written. The SQLite store's own order (rowid)
is not enough: each batch stamps its rows with the time it began and writes them last, so of two batches running side
by side the one that decided first may write after the other. A row that does not validate is set aside and
counted, never fatal.
"""

from __future__ import annotations

import csv
import json
import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from coordinator import HistoryRow, column_types, history_schema
from ops.policy.adapters import InputError

# Columns Log Analytics gives every table (and `az ... query` adds TableName): not part of the history's schema.
SYSTEM_COLUMNS = frozenset(
    {"TenantId", "Type", "SourceSystem", "TableName", "MG", "ManagementGroupName", "Computer", "RawData"}
)
# Within one instant, the order the coordinator writes a batch's rows (exports lose the write order).
_WRITE_ORDER = {"Observation": 0, "Hook": 1, "Heartbeat": 1, "DeadLetter": 1, "Transition": 2, "Decision": 3}
_PORTAL_TIME = "%m/%d/%Y, %I:%M:%S.%f %p"


@dataclass
class Rows:
    rows: list[HistoryRow] = field(default_factory=list)
    # (row number in the input, 1-based, why it was set aside)
    set_aside: list[tuple[int, str]] = field(default_factory=list)
    source: str = ""
    kind: str = ""


def read_history(path: str | Path) -> Rows:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"history {path}: no such file")
    with path.open("rb") as head:
        magic = head.read(16)
    if magic.startswith(b"SQLite format 3"):
        return _rows(path, "sqlite", _sqlite(path))
    text = path.read_text(encoding="utf-8-sig", errors="replace")
    if path.suffix.lower() == ".json" or text.lstrip().startswith(("[", "{")):
        return _rows(path, "json", _json(path, text))
    if path.suffix.lower() == ".csv" or "TimeGenerated" in text.split("\n", 1)[0]:
        return _rows(path, "csv", list(csv.DictReader(text.splitlines())))
    raise InputError(f"history {path}: not a SQLite database, JSON or CSV export (see --help for the shapes)")


def _sqlite(path: Path) -> list[dict[str, Any]]:
    table = history_schema()["table"]
    try:
        db = sqlite3.connect(f"file:{path.resolve()}?mode=ro", uri=True)
        try:
            cursor = db.execute(f'SELECT * FROM "{table}" ORDER BY rowid')  # noqa: S608 -- from history_columns.json
            names = [d[0] for d in cursor.description or ()]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
        finally:
            db.close()
    except sqlite3.Error as error:
        raise InputError(f"history {path}: cannot read table {table}: {error}") from error


def _json(path: Path, text: str) -> list[dict[str, Any]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise InputError(f"history {path}: not valid JSON: {error}") from error
    if isinstance(data, dict) and isinstance(data.get("tables"), list) and data["tables"]:
        table = data["tables"][0]
        names = [str(c.get("name", "")) for c in table.get("columns", [])]
        return [dict(zip(names, row, strict=False)) for row in table.get("rows", [])]
    if isinstance(data, list):
        return [item if isinstance(item, dict) else {"(row)": item} for item in data]
    raise InputError(f"history {path}: JSON must be a list of row objects or a query response with 'tables'")


def _rows(path: Path, kind: str, raw: list[dict[str, Any]]) -> Rows:
    found = Rows(source=str(path), kind=kind)
    columns = {_column(name) for item in raw for name in item} - {"(row)"}
    unknown = sorted(c for c in columns - set(column_types()) if c not in SYSTEM_COLUMNS and not c.startswith("_"))
    if unknown:
        raise InputError(
            f"history {path}: unknown columns {', '.join(unknown)} (expected those of coordinator/history_columns.json)"
        )
    missing = sorted({"TimeGenerated", "RecordType", "EventId"} - columns) if raw else []
    if missing:
        raise InputError(f"history {path}: required columns missing: {', '.join(missing)}")
    for number, item in enumerate(raw, start=1):
        try:
            found.rows.append(history_row(item))
        except (InputError, ValidationError, ValueError) as error:
            found.set_aside.append((number, _why(error)))
    positions = {id(row): i for i, row in enumerate(found.rows)}
    found.rows.sort(key=lambda r: (r.TimeGenerated, _WRITE_ORDER.get(r.RecordType, 4), positions[id(r)]))
    return found


def _why(error: Exception) -> str:
    if isinstance(error, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
    return str(error)


def _column(name: str) -> str:
    return name.removesuffix(" [UTC]").strip()


def history_row(item: Mapping[str, Any]) -> HistoryRow:
    """One exported row -> HistoryRow: values converted by their column's type; empty values left out."""
    if "(row)" in item:
        raise InputError(f"not an object: {item['(row)']!r}")
    types = column_types()
    values: dict[str, Any] = {}
    for name, value in item.items():
        column = _column(name)
        if column not in types or value is None or value == "":
            continue
        values[column] = _convert(column, types[column], value)
    return HistoryRow.model_validate(values)


def _convert(column: str, kind: str, value: Any) -> Any:
    if kind == "datetime" and isinstance(value, str):
        return _time(column, value)
    if kind == "dynamic" and isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as error:
            raise InputError(f"{column}: not JSON: {value[:80]!r}") from error
    if kind == "boolean" and isinstance(value, str):
        if value.lower() not in {"true", "false", "1", "0"}:
            raise InputError(f"{column}: not a boolean: {value!r}")
        return value.lower() in {"true", "1"}
    return value


def _time(column: str, value: str) -> datetime:
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        try:
            parsed = datetime.strptime(value, _PORTAL_TIME)
        except ValueError as error:
            raise InputError(f"{column}: not a time: {value!r} (ISO-8601 or '11/24/2026, 11:37:42.810 PM')") from error
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
