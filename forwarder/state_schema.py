"""The forwarder state file's tables (forwarder/durable_state.py), and how a file an older forwarder wrote is
brought up to date: columns added since are added on open, each with a default, so an older forwarder can still
write to a newer file.
"""

from __future__ import annotations

import sqlite3

__all__ = ["ADDED_COLUMNS", "SCHEMA", "migrate"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS spool (id INTEGER PRIMARY KEY AUTOINCREMENT, sequence INTEGER NOT NULL,
    kind TEXT NOT NULL, body BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS state (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS hooks (event_id TEXT NOT NULL, phase TEXT NOT NULL, status TEXT NOT NULL,
    event TEXT NOT NULL, updated_at TEXT NOT NULL, step TEXT NOT NULL DEFAULT '', steps TEXT NOT NULL DEFAULT '[]',
    outcome TEXT NOT NULL DEFAULT '', PRIMARY KEY (event_id, phase));
CREATE TABLE IF NOT EXISTS rejects (id INTEGER PRIMARY KEY AUTOINCREMENT, at TEXT NOT NULL, reason TEXT NOT NULL,
    body BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS decisions (decision_id TEXT PRIMARY KEY, event_id TEXT NOT NULL, status TEXT NOT NULL,
    at TEXT NOT NULL, result TEXT NOT NULL DEFAULT '');
CREATE INDEX IF NOT EXISTS decisions_at ON decisions (at);
"""
# Columns added after the first release: a database written by an older forwarder gets them on open (and an
# older forwarder still writes to a newer database: every added column has a default).
ADDED_COLUMNS = {
    "hooks": {
        "step": "TEXT NOT NULL DEFAULT ''",
        "steps": "TEXT NOT NULL DEFAULT '[]'",
        "outcome": "TEXT NOT NULL DEFAULT ''",
        # The trace context of the change that queued the phase: its hook report joins that trace.
        "traceparent": "TEXT NOT NULL DEFAULT ''",
        "tracestate": "TEXT NOT NULL DEFAULT ''",
    },
    # The W3C trace context of the change that spooled the envelope, so that a replay after an outage or a
    # restart still carries it ("" for envelopes that start no trace, and for rows spooled by older forwarders).
    "spool": {
        "traceparent": "TEXT NOT NULL DEFAULT ''",
        "tracestate": "TEXT NOT NULL DEFAULT ''",
    },
}


def migrate(db: sqlite3.Connection) -> None:
    """Adds the columns a file written by an older forwarder lacks (inside the caller's transaction)."""
    for table, columns in ADDED_COLUMNS.items():
        present = {str(row[1]) for row in db.execute(f"PRAGMA table_info({table})")}
        for column, definition in columns.items():
            if column not in present:
                db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")
