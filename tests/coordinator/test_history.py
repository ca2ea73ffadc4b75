"""History: the SQLite store and CLI locally; the Logs Ingestion path with the real SDK against a loopback
capture server (there is no local Log Analytics: the server is a recorder, named as such)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from azure.core.credentials import AccessToken
from azure.monitor.ingestion import LogsIngestionClient

from coordinator.adapters.history import HistoryError, LogsIngestionHistory, SqliteHistory
from coordinator.domain.rows import HistoryRow, column_types, history_schema
from ops.history import main, parse_since
from tests.loopback import QuietHandler

REPO = Path(__file__).resolve().parents[2]
NOW = datetime(2026, 11, 20, 12, 0, tzinfo=UTC)


def test_history_row_has_exactly_the_columns_of_the_one_definition():
    assert list(HistoryRow.model_fields) == list(column_types())
    assert history_schema()["table"].endswith("_CL")
    assert history_schema()["stream"].startswith("Custom-")
    for column in history_schema()["columns"]:
        assert set(column) == {"name", "type", "description"}


def rows() -> list[HistoryRow]:
    return [
        HistoryRow(TimeGenerated=NOW, RecordType="Observation", EventId="E1", EventStatus="Scheduled", VmName="a"),
        HistoryRow(
            TimeGenerated=NOW + timedelta(seconds=1),
            RecordType="Transition",
            EventId="E1",
            PreviousState="Scheduled",
            State="Approved",
            Rule="short-freeze",
            Resources=["a", "b"],
            DryRun=False,
        ),
        HistoryRow(TimeGenerated=NOW - timedelta(days=30), RecordType="Observation", EventId="E0", VmName="a"),
    ]


def test_sqlite_store_and_cli(tmp_path, capsys):
    path = tmp_path / "h.sqlite"
    store = SqliteHistory(path)
    store.write(rows())
    stored = store.query(
        "SELECT Resources, DryRun, TimeGenerated FROM ScheduledEventsHistory_CL WHERE State='Approved'"
    )
    assert stored == [
        {"Resources": '["a","b"]', "DryRun": 0, "TimeGenerated": (NOW + timedelta(seconds=1)).isoformat()}
    ]
    store.close()

    assert main(["--db", str(path), "--json", "timeline", "E1"]) == 0
    timeline = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(t["RecordType"], t["State"]) for t in timeline] == [("Observation", None), ("Transition", "Approved")]

    since = (NOW - timedelta(days=7)).isoformat()
    assert main(["--db", str(path), "--json", "events", "--since", since]) == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(e["EventId"], e["State"]) for e in events] == [("E1", "Approved")]

    assert (
        main(["--db", str(path), "sql", "SELECT RecordType, count(*) AS n FROM ScheduledEventsHistory_CL GROUP BY 1"])
        == 0
    )
    assert "Observation  2" in capsys.readouterr().out
    assert main(["--db", str(path), "sql", "DELETE FROM ScheduledEventsHistory_CL"]) == 2  # read-only
    assert "readonly" in capsys.readouterr().err
    assert main(["--db", str(tmp_path / "missing.sqlite"), "timeline", "E1"]) == 2


def test_cli_runs_as_a_module(tmp_path):
    path = tmp_path / "h.sqlite"
    SqliteHistory(path).write(rows())
    result = subprocess.run(
        [sys.executable, "-m", "ops.history", "--db", str(path), "timeline", "E1"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    )
    assert "Transition" in result.stdout
    assert "short-freeze" in result.stdout


def test_parse_since():
    assert parse_since("7d", now=NOW) == NOW - timedelta(days=7)
    assert parse_since("90m", now=NOW) == NOW - timedelta(minutes=90)
    with pytest.raises(ValueError, match="--since 'soon'"):
        parse_since("soon")


class CaptureServer:
    """Records Logs Ingestion API calls on loopback (a recorder: no local Log Analytics exists)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.fail_next = 0
        outer = self

        class Handler(QuietHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                outer.calls.append(
                    {"path": self.path, "auth": self.headers.get("Authorization", ""), "logs": json.loads(body)}
                )
                status = 503 if outer.fail_next else 204
                outer.fail_next = max(0, outer.fail_next - 1)
                self.respond(status)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def capture() -> Iterator[CaptureServer]:
    server = CaptureServer()
    server.thread.start()
    yield server
    server.server.shutdown()
    server.server.server_close()


class StaticTokenCredential:
    """Stands in for the managed identity (no Entra ID here); the SDK still sends it as a bearer token."""

    def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
        assert scopes[0].startswith("https://monitor.azure.com")
        return AccessToken("local-token", int(NOW.timestamp()) + 10**9)


def test_logs_ingestion_upload_with_the_real_sdk(capture):
    client = LogsIngestionClient(endpoint=capture.url, credential=StaticTokenCredential(), retry_total=0)
    sink = LogsIngestionHistory(
        endpoint=capture.url,
        rule_id="dcr-00000000",
        credential=StaticTokenCredential(),
        enforce_https=False,
        client=client,
    )
    sink.write(rows())
    assert len(capture.calls) == 1
    call = capture.calls[0]
    assert call["path"].startswith(
        "/dataCollectionRules/dcr-00000000/streams/Custom-ScheduledEventsHistory?api-version="
    )
    assert call["auth"] == "Bearer local-token"
    logs = call["logs"]
    assert [row["RecordType"] for row in logs] == ["Observation", "Transition", "Observation"]
    assert logs[1]["Resources"] == ["a", "b"]
    assert logs[1]["TimeGenerated"] == "2026-11-20T12:00:01Z"
    assert set().union(*logs) <= set(column_types())  # only declared columns (the DCR drops unknown ones)

    assert [row["RecordId"] for row in logs] == [row.RecordId for row in rows()]

    # The service refuses: the write says so (the rows stay in the outbox, and the timer writes them again).
    capture.fail_next = 1
    with pytest.raises(HistoryError):
        sink.write(rows()[:1])


def test_a_row_that_is_not_json_is_set_aside_alone_and_the_rest_is_uploaded(capture, caplog):
    """``measuredSeconds: Infinity`` (or 1e308 past a float) made the SDK write ``Infinity``, which is not JSON: a
    strict endpoint refused the whole upload, and every later one that carried it again."""
    client = LogsIngestionClient(endpoint=capture.url, credential=StaticTokenCredential(), retry_total=0)
    sink = LogsIngestionHistory(
        endpoint=capture.url, rule_id="dcr-1", credential=StaticTokenCredential(), enforce_https=False, client=client
    )
    poison = HistoryRow(TimeGenerated=NOW, RecordType="Impact", EventId="E1", MeasuredSeconds=float("inf"))
    past = HistoryRow(TimeGenerated=NOW, RecordType="Impact", EventId="E2", MeasuredSeconds=float("1e308") * 10)
    sink.write([*rows()[:2], poison, past, rows()[2]])
    assert [row["RecordType"] for row in capture.calls[-1]["logs"]] == ["Observation", "Transition", "Observation"]
    assert sink.set_aside == 2
    assert f"row {poison.RecordId} (Impact, event 'E1') cannot be serialised and is set aside" in caplog.text


def test_the_local_store_keeps_a_row_once_and_sets_aside_one_it_cannot_hold(tmp_path, caplog):
    store = SqliteHistory(tmp_path / "h.sqlite")
    store.write(rows())
    store.write(rows())  # a retried upload, an outbox written twice: nothing more
    big = HistoryRow(TimeGenerated=NOW, RecordType="Impact", EventId="E3", DurationInSeconds=2**70)
    inf = HistoryRow(TimeGenerated=NOW, RecordType="Impact", EventId="E4", MeasuredSeconds=float("inf"))
    store.write([big, inf, HistoryRow(TimeGenerated=NOW, RecordType="Heartbeat", VmName="c")])
    table = history_schema()["table"]
    found = store.query(f'SELECT RecordType, EventId, RecordId FROM "{table}" ORDER BY rowid')
    store.close()
    assert [(r["RecordType"], r["EventId"]) for r in found] == [
        ("Observation", "E1"),
        ("Transition", "E1"),
        ("Observation", "E0"),
        ("Heartbeat", None),
    ]
    assert [r["RecordId"] for r in found[:3]] == [row.RecordId for row in rows()]
    assert store.set_aside == 2
    assert f"row {big.RecordId} (Impact, event 'E3') cannot be serialised" in caplog.text


def test_a_row_has_one_id_for_one_content():
    again = rows()
    assert [row.RecordId for row in rows()] == [row.RecordId for row in again]
    assert len({row.RecordId for row in again}) == 3
    assert HistoryRow.model_validate_json(again[1].model_dump_json()).RecordId == again[1].RecordId
    assert HistoryRow(TimeGenerated=NOW, RecordType="Observation", RecordId="given").RecordId == "given"


def test_a_store_made_before_the_hold_columns_gets_them_and_keeps_its_rows(tmp_path):
    import sqlite3

    path = tmp_path / "old.sqlite"
    table = history_schema()["table"]
    old_columns = [name for name in column_types() if name not in ("HoldKind", "HoldName", "HoldSince", "HeldUntil")]
    with sqlite3.connect(path) as db:
        db.execute(f'CREATE TABLE "{table}" ({", ".join(old_columns)})')
        db.execute(f'INSERT INTO "{table}" (TimeGenerated, RecordType) VALUES (?, ?)', ("2026-01-01T00:00:00", "Old"))
    store = SqliteHistory(path)
    now = datetime(2026, 11, 18, tzinfo=UTC)
    store.write([HistoryRow(TimeGenerated=now, RecordType="Decision", HoldKind="gate", HoldName="app", HoldSince=now)])
    found = store.query(f'SELECT RecordType, HoldKind, HoldName, HoldSince FROM "{table}" ORDER BY rowid')
    store.close()
    assert found == [
        {"RecordType": "Old", "HoldKind": None, "HoldName": None, "HoldSince": None},
        {"RecordType": "Decision", "HoldKind": "gate", "HoldName": "app", "HoldSince": now.isoformat()},
    ]
