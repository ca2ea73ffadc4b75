"""``python -m ops.history`` as a user runs it (a subprocess): finding an event the way a local run names it, a
pasted KQL query, a database that is not one, a misspelt option, and a table that does not cut the reason."""

from __future__ import annotations

import json
import sqlite3
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from coordinator.adapters.history import SqliteHistory
from coordinator.domain.rows import HistoryRow
from ops.history import LOCAL_RUN_FILE
from tests.commands import python_m

NOW = datetime.now(UTC).replace(microsecond=0)
FREEZE = "4A0FA015-D90C-4E58-8325-EA20A7142413"
REBOOT = "4A0FB016-0000-4000-8000-000000000001"
LONG_REASON = (
    "rule 'freeze-in-the-night' approves only inside its window (0 1 1 1 * for 1m, Europe/Oslo); the next opening "
    "is after NotBefore, so the event is left to expire (onNotBefore: expire)"
)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return python_m("ops.history", *args)


@pytest.fixture
def local_history(tmp_path: Path) -> Path:
    """A history as a local run leaves it: the database and, beside it, the run's record naming its events."""
    db = tmp_path / "history.sqlite"
    store = SqliteHistory(db)
    store.write(
        [
            HistoryRow(TimeGenerated=NOW, RecordType="Observation", EventId=FREEZE, EventType="Freeze", VmName="web_0"),
            HistoryRow(
                TimeGenerated=NOW + timedelta(seconds=1),
                RecordType="Decision",
                EventId=FREEZE,
                EventType="Freeze",
                Rule="freeze-in-the-night",
                Outcome="wait",
                Reason=LONG_REASON,
            ),
            HistoryRow(TimeGenerated=NOW, RecordType="Observation", EventId=REBOOT, EventType="Reboot", VmName="db_0"),
        ]
    )
    store.close()
    record = {"scenario": "fleet-controls", "timeScale": 60, "refs": {"windowed": FREEZE, "manual-tag": REBOOT}}
    (tmp_path / LOCAL_RUN_FILE).write_text(json.dumps(record), encoding="utf-8")
    return db


@pytest.mark.parametrize("name", ["windowed", "WINDOWED", FREEZE, FREEZE.lower(), "4a0fa015", "4A0FA015-D9"])
def test_timeline_finds_an_event_by_ref_prefix_or_id_in_any_case(local_history: Path, name: str) -> None:
    done = run("--db", str(local_history), "--json", "timeline", name)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [row["RecordType"] for row in rows] == ["Observation", "Decision"]


def test_timeline_says_when_nothing_matches_and_when_a_prefix_is_ambiguous(local_history: Path) -> None:
    nothing = run("--db", str(local_history), "timeline", "freeze-web")
    assert nothing.returncode == 1
    assert nothing.stdout == ""
    assert "no event in" in nothing.stderr
    assert "'freeze-web'" in nothing.stderr
    ambiguous = run("--db", str(local_history), "timeline", "4a0f")
    assert ambiguous.returncode == 2
    assert f"begins 2 EventIds ({FREEZE}, {REBOOT})" in ambiguous.stderr


def test_events_name_a_local_runs_events_by_their_ref(local_history: Path) -> None:
    done = run("--db", str(local_history), "--json", "events", "--since", "1h")
    assert done.returncode == 0, done.stderr
    assert {json.loads(line)["Ref"] for line in done.stdout.splitlines()} == {"windowed", "manual-tag"}


def test_the_table_prints_the_reason_whole(local_history: Path) -> None:
    done = run("--db", str(local_history), "timeline", "windowed")
    assert done.returncode == 0, done.stderr
    assert LONG_REASON in done.stdout


def test_a_pasted_kql_query_longer_than_a_file_name_runs(local_history: Path) -> None:
    query = "ScheduledEventsHistory_CL | where " + " or ".join(f'RecordType == "Kind{n}"' for n in range(20))
    query += ' or RecordType == "Decision" | project Rule'
    assert len(query.encode()) > 255
    assert "/" not in query
    done = run("--db", str(local_history), "--json", "kql", query)
    assert done.returncode == 0, done.stderr
    assert [json.loads(line) for line in done.stdout.splitlines()] == [{"Rule": "freeze-in-the-night"}]


@pytest.mark.parametrize("command", [["events"], ["timeline", "x"], ["sql", "SELECT 1"], ["kql", "print 1"]])
def test_a_file_that_is_not_a_history_is_refused_in_one_line(tmp_path: Path, command: list[str]) -> None:
    text = tmp_path / "notes.sqlite"
    text.write_text("not a database\n", encoding="utf-8")
    other = tmp_path / "other.sqlite"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE t (x)")
    for db_path, reason in ((text, "not an SQLite database"), (other, "not a history database")):
        done = run("--db", str(db_path), *command)
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1, done.stderr
        assert str(db_path) in done.stderr
        assert reason in done.stderr
        assert "Traceback" not in done.stderr
    assert text.read_text(encoding="utf-8") == "not a database\n", "a read-only tool changed the file"


def test_an_unknown_option_is_named_before_a_missing_command(local_history: Path) -> None:
    alone = run("--bogus")
    assert alone.returncode == 2
    assert "unrecognized arguments: --bogus" in alone.stderr
    missing = run("--db", str(local_history))
    assert missing.returncode == 2
    assert "a command is required: timeline, events, sql or kql" in missing.stderr
