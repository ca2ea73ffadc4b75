"""What the shipped queries return on a known history: tests/infra/known_history.py writes its rows with the real
SQLite history writer, ops/kql.py loads them as Log Analytics types them and duckdb-kql runs each file of
infra/queries as it is shipped. Every query file has its expected rows here; now() is pinned to the history's now.
Also: duckdb-kql's result schema is the one Microsoft's language service infers, and the `kql` command of
`python -m ops.history` runs a file or a query and names the query when one fails."""

from __future__ import annotations

import json
import math
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from duckdb import DuckDBPyConnection

from coordinator.adapters.history import SqliteHistory
from infra import build_workbook
from ops import kql
from tests.commands import python_m
from tests.infra import bicep_model as bm
from tests.infra.known_history import Event, Watch, repairs, vm_columns, write_known_history
from tests.infra.kql_language import analyze

QUERIES = {path.name: path for path in sorted((bm.INFRA / "queries").glob("*.kql"))}
# Whole seconds: datetime_diff counts unit boundaries crossed, so sub-second offsets of "now" must not move results.
NOW = datetime.now(UTC).replace(microsecond=0)


def ago(**delta: float) -> datetime:
    """A time of the known history as DuckDB returns it: naive UTC."""
    return (NOW - timedelta(**delta)).replace(tzinfo=None)


@pytest.fixture(scope="module")
def history_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("history") / "history.sqlite"
    write_known_history(path, NOW)
    return path


@pytest.fixture(scope="module")
def con(history_db: Path) -> Iterator[DuckDBPyConnection]:
    connection = kql.load(history_db)
    yield connection
    connection.close()


def shipped(con: DuckDBPyConnection, name: str, text: str | None = None) -> list[dict[str, Any]]:
    return kql.run(con, text or QUERIES[name].read_text(encoding="utf-8"), name=name, now=NOW).records()


def test_events_by_type_and_scaleset(con: DuckDBPyConnection) -> None:
    rows = shipped(con, "events-by-type-and-scaleset.kql")
    assert [row["Events"] for row in rows] == sorted((row["Events"] for row in rows), reverse=True)
    # reboot-old (10 days) is outside the 7 days; reboot-web2 and reboot-user are two Reboots from two VMs;
    # reboot-api0 is api's, seen from its first sighting until it reported the Reboot gone.
    assert sorted(rows, key=lambda row: (row["EventType"], row["ScaleSetName"])) == [
        {"EventType": "Freeze", "ScaleSetName": "web", "Events": 1, "ReportingVms": 2, "FirstSeen": ago(minutes=120),
         "LastSeen": ago(minutes=100)},
        {"EventType": "Reboot", "ScaleSetName": "api", "Events": 1, "ReportingVms": 1, "FirstSeen": ago(days=2),
         "LastSeen": ago(days=2) + timedelta(minutes=6)},
        {"EventType": "Reboot", "ScaleSetName": "web", "Events": 2, "ReportingVms": 2, "FirstSeen": ago(days=3),
         "LastSeen": ago(minutes=180)},
        {"EventType": "Redeploy", "ScaleSetName": "db", "Events": 1, "ReportingVms": 1, "FirstSeen": ago(minutes=30),
         "LastSeen": ago(minutes=30)},
        {"EventType": "Terminate", "ScaleSetName": "web", "Events": 1, "ReportingVms": 1,
         "FirstSeen": ago(minutes=60), "LastSeen": ago(minutes=50)},
    ]  # fmt: skip


def test_expired_unapproved(con: DuckDBPyConnection) -> None:
    rows = shipped(con, "expired-unapproved.kql")
    # reboot-old expired too, 10 days ago: outside the window. The expired card's Alert row (State Expired) is no
    # Transition and is not counted twice.
    assert [row | {"Resources": json.loads(row["Resources"])} for row in rows] == [
        {
            "ExpiredAt": ago(minutes=165),
            "EventId": "reboot-web2",
            "EventType": "Reboot",
            "EventSource": "Platform",
            "ScaleSetName": "web",
            "NotBefore": ago(minutes=165),
            "Resources": ["web_2"],
            "Rule": "everything-else-waits",
            "Action": "wait-for-person",
            "Reason": "waits for a person",
        }
    ]


def test_notice_vs_time_to_approve(con: DuckDBPyConnection) -> None:
    rows = shipped(con, "notice-vs-time-to-approve.kql")
    # Observations are read 200 ms before the row is written, so each span is a second longer than the whole
    # minutes of the history (datetime_diff counts second boundaries): 901 s -> 15.0 minutes, 61 s -> 1.0.
    redeploy = rows.pop(2)
    assert redeploy["EventType"] == "Redeploy"
    assert (redeploy["Events"], redeploy["Approved"], redeploy["MeanNoticeMinutes"]) == (1, 0, 10.0)
    assert math.isnan(redeploy["MeanTimeToApproveMinutes"])  # never approved: avg() of no values
    assert rows == [
        {"EventType": "Freeze", "Events": 1, "Approved": 1, "MeanNoticeMinutes": 15.0, "MeanTimeToApproveMinutes": 1.0},
        # Four Reboots in 30 days (reboot-old included), two approved (reboot-user and reboot-api0, each after a
        # minute).
        {"EventType": "Reboot", "Events": 4, "Approved": 2, "MeanNoticeMinutes": 15.0, "MeanTimeToApproveMinutes": 1.0},
        {"EventType": "Terminate", "Events": 1, "Approved": 1, "MeanNoticeMinutes": 10.0,
         "MeanTimeToApproveMinutes": 2.0},
    ]  # fmt: skip


def test_hooks_failing(con: DuckDBPyConnection) -> None:
    rows = shipped(con, "hooks-failing.kql")
    # web_3's succeeded prepare hook is not a failure; failed and timed-out are.
    assert sorted(rows, key=lambda row: row["VmName"]) == [
        {"VmName": "db_0", "VmResourceId": vm_columns("db_0")["VmResourceId"], "ScaleSetName": "db",
         "HookPhase": "recover", "Failures": 1, "Events": 1, "LastFailure": ago(minutes=25),
         "LastReason": "recover phase timed-out: 30-warm"},
        {"VmName": "web_3", "VmResourceId": vm_columns("web_3")["VmResourceId"], "ScaleSetName": "web",
         "HookPhase": "prepare", "Failures": 1, "Events": 1, "LastFailure": ago(minutes=59),
         "LastReason": "prepare phase failed: 10-check failed"},
    ]  # fmt: skip


def test_event_timeline(con: DuckDBPyConnection) -> None:
    text = QUERIES["event-timeline.kql"].read_text(encoding="utf-8")
    # As shipped, eventId is "": nothing is the expected result, not the rows about no event (Heartbeat rows, whose
    # EventId is "" in Log Analytics).
    assert shipped(con, "event-timeline.kql") == []
    # As the workbook fills it in from its EventId parameter.
    filled = text.replace(build_workbook.EVENT_ID_LINE, 'let eventId = "terminate-web3";')
    rows = shipped(con, "event-timeline.kql", filled)
    times = [row["TimeGenerated"] for row in rows]
    assert times == sorted(times)
    assert times[0] == ago(minutes=60)
    assert times[-1] == ago(minutes=39)  # its VM's end, measured once the VM was retired
    # Rows written at the same instant come in no defined order (as in Kusto): compare them as a multiset.
    assert sorted((row["RecordType"], row["State"], row["Outcome"], row["Actor"]) for row in rows) == sorted([
        ("Observation", "Scheduled", "", "platform"),
        ("Hook", "Scheduled", "failed", "10-check"),
        ("Hook", "Scheduled", "succeeded", "20-drain"),
        ("Decision", "Scheduled", "approve", "rule:terminate-after-prepare-hooks"),
        ("Transition", "Approved", "", ""),
        ("Approval", "Approved", "failed", "rule:terminate-after-prepare-hooks"),
        ("Approval", "Approved", "approved", "rule:terminate-after-prepare-hooks"),
        ("Alert", "Approved", "failed", "teams"),
        ("Alert", "Approved", "sent", "teams"),
        ("Observation", "Approved", "", "platform"),
        ("Transition", "Started", "", ""),
        ("Impact", "Started", "removed", "coordinator"),
    ])  # fmt: skip


def test_silent_forwarders(con: DuckDBPyConnection) -> None:
    rows = shipped(con, "silent-forwarders.kql")
    # web_5 resumed, web_3 was removed by a Terminate, db_1 went silent 2 days ago (outside the 1-day lookback).
    assert rows == [
        {
            "VmName": "web_4",
            "VmResourceId": vm_columns("web_4")["VmResourceId"],
            "ScaleSetName": "web",
            "LostAt": ago(minutes=90),
            "LastEnvelopeAt": ago(minutes=95),
            "SilentMinutes": 95,
            "Reason": "no envelope for 300 s",
        }
    ]


def test_alert_cards_failing(con: DuckDBPyConnection) -> None:
    rows = shipped(con, "alert-cards-failing.kql")
    # The approval-failed card failed once and then went out: it still shows (the rule's window decides how long).
    assert sorted(rows, key=lambda row: row["Card"]) == [
        {"Card": "approval-failed", "Failures": 1, "Events": 1, "LastFailure": ago(minutes=58),
         "LastEventId": "terminate-web3", "LastReason": "Teams webhook refused card: HTTP 503 after 3 attempts"},
        {"Card": "approval-refused", "Failures": 2, "Events": 1, "LastFailure": ago(minutes=28),
         "LastEventId": "redeploy-db0", "LastReason": "Teams webhook refused card: HTTP 400"},
    ]  # fmt: skip


def test_every_query_file_has_its_results_tested() -> None:
    tested = {
        name.removeprefix("test_").replace("_", "-") + ".kql"
        for name, value in globals().items()
        if name.startswith("test_") and callable(value)
    }
    assert set(QUERIES) <= tested, f"no results test for {sorted(set(QUERIES) - tested)}"


def test_the_engine_returns_the_schema_the_language_service_infers(con: DuckDBPyConnection) -> None:
    """duckdb-kql's columns, in order and with their types, are those Kusto's own binder infers: the engine does not
    rename, drop or retype a column (join's EventId1, project-rename, arg_max's columns, count()'s long)."""
    texts = {name: path.read_text(encoding="utf-8") for name, path in QUERIES.items()}
    inferred = analyze(texts)
    for name, text in texts.items():
        result = kql.run(con, text, name=name, now=NOW)
        assert list(zip(result.columns, result.types, strict=True)) == list(inferred[name].columns), name


def test_strings_read_as_empty_never_null(con: DuckDBPyConnection) -> None:
    # Log Analytics has no null strings: a Heartbeat row's EventId is "" there, so isempty() is true, as here.
    rows = kql.run(
        con, 'ScheduledEventsHistory_CL | where RecordType == "Heartbeat" | summarize n = countif(isempty(EventId))'
    ).records()
    assert rows == [{"n": 5}]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return python_m("ops.history", *args)


def test_cli_runs_a_query_file_and_a_query_text(history_db: Path) -> None:
    done = run_cli("--db", str(history_db), "--json", "kql", "infra/queries/hooks-failing.kql")
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert sorted((row["VmName"], row["HookPhase"], row["Failures"]) for row in rows) == [
        ("db_0", "recover", 1),
        ("web_3", "prepare", 1),
    ]
    # Datetimes as Log Analytics prints them: ISO-8601 UTC.
    assert {row["LastFailure"] for row in rows} == {
        (NOW - timedelta(minutes=25)).isoformat(),
        (NOW - timedelta(minutes=59)).isoformat(),
    }
    done = run_cli("--db", str(history_db), "kql", "ScheduledEventsHistory_CL | summarize n = count() by RecordType")
    assert done.returncode == 0, done.stderr
    table = done.stdout.splitlines()
    assert table[0].split() == ["RecordType", "n"]
    assert sorted(line.split()[0] for line in table[1:]) == sorted(
        [
            "Alert",
            "Approval",
            "Decision",
            "Heartbeat",
            "Hook",
            "Impact",
            "Observation",
            "Repairs",
            "Shadow",
            "Transition",
        ]
    )


def test_cli_names_the_query_that_fails(history_db: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.kql"
    broken.write_text("ScheduledEventsHistory_CL | where HookPhaze == 'prepare'", encoding="utf-8")
    done = run_cli("--db", str(history_db), "kql", str(broken))
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.startswith(f"kql: {broken}: ")
    assert "HookPhaze" in done.stderr
    done = run_cli("--db", str(history_db), "kql", "ScheduledEventsHistory_CL | where")
    assert done.returncode == 2
    assert done.stderr.startswith("kql: query: KqlSyntaxError")
    done = run_cli("--db", str(history_db), "kql", str(tmp_path / "missing.kql"))
    assert done.returncode == 2
    assert "missing.kql: cannot read the query file" in done.stderr


def test_announced_vs_measured(con: DuckDBPyConnection) -> None:
    # Per event and VM, its longest measure: web_0's second pause, web_1's beyond the 5 s announced; a Reboot's
    # downtime with nothing announced; the removed VM heard 7 minutes after its removal began. The return-to-service
    # rows measure no impact: reboot-api0, whose only Impact rows they are, is not here (nor with a null measure).
    rows = shipped(con, "announced-vs-measured.kql")
    assert [{k: v for k, v in row.items() if k != "ImpactStart"} for row in rows] == [
        {"EventType": "Freeze", "EventId": "freeze-web", "VmName": "web_0", "Measure": "pause",
         "AnnouncedSeconds": 5, "MeasuredSeconds": 4.8, "OverAnnounced": False},
        {"EventType": "Freeze", "EventId": "freeze-web", "VmName": "web_1", "Measure": "pause",
         "AnnouncedSeconds": 5, "MeasuredSeconds": 6.3, "OverAnnounced": True},
        {"EventType": "Reboot", "EventId": "reboot-user", "VmName": "web_1", "Measure": "restart",
         "AnnouncedSeconds": -1, "MeasuredSeconds": 93.5, "OverAnnounced": False},
        {"EventType": "Terminate", "EventId": "terminate-web3", "VmName": "web_3", "Measure": "removed",
         "AnnouncedSeconds": -1, "MeasuredSeconds": 420.0, "OverAnnounced": False},
    ]  # fmt: skip
    assert rows[0]["ImpactStart"] == ago(minutes=108, seconds=5)


def test_shadow_report(con: DuckDBPyConnection) -> None:
    # Only the events with Shadow rows, latest NotBefore first. freeze-web: both approved at once; its longest impact is
    # web_1's pause, not its return to service (72 s, no measure of the Freeze). reboot-web2: the
    # candidate's rule reboot-off-peak would have approved it (its later wait does not undo that), the live policy
    # let it expire. reboot-user: the candidate never approved (its last rule named), the live did. Columns of no
    # matching row are null (an unmatched string too, here; Log Analytics has no null strings and shows "").
    rows = shipped(con, "shadow-report.kql")
    day3 = ago(days=3)
    assert rows == [
        {"EventId": "freeze-web", "EventType": "Freeze", "NotBefore": ago(minutes=105), "CandidateRule": "short-freeze",
         "WouldApproveAt": ago(minutes=119), "ApprovedAt": ago(minutes=119), "ApprovedBy": "short-freeze",
         "ExpiredAt": None, "StartedAt": ago(minutes=110), "MeasuredSeconds": 6.3, "Differs": False},
        {"EventId": "reboot-web2", "EventType": "Reboot", "NotBefore": ago(minutes=165),
         "CandidateRule": "reboot-off-peak", "WouldApproveAt": ago(minutes=172), "ApprovedAt": None,
         "ApprovedBy": None, "ExpiredAt": ago(minutes=165), "StartedAt": None, "MeasuredSeconds": None,
         "Differs": True},
        {"EventId": "reboot-user", "EventType": "Reboot", "NotBefore": day3 + timedelta(minutes=15),
         "CandidateRule": "user-after-drain", "WouldApproveAt": None, "ApprovedAt": day3 + timedelta(minutes=1),
         "ApprovedBy": "user-initiated", "ExpiredAt": None, "StartedAt": day3 + timedelta(minutes=2),
         "MeasuredSeconds": 93.5, "Differs": True},
    ]  # fmt: skip


def test_escalations(con: DuckDBPyConnection) -> None:
    # One row per step taken: reboot-web2's first decision, 15 minutes before NotBefore, took both steps of its rule's
    # ladder at once (the first due 20 minutes before, so 300 s late; the second on time). reboot-old's decision took
    # them too, 10 days ago: outside the 7 days. The other decisions took no step (no escalation in their Details).
    rows = shipped(con, "escalations.kql")
    assert [row | {"Owners": json.loads(row["Owners"])} for row in rows] == [
        {"TimeGenerated": ago(minutes=180), "EventId": "reboot-web2", "EventType": "Reboot",
         "Rule": "everything-else-waits", "Step": 1, "Of": 2, "Do": "notify", "LeadSeconds": 1200,
         "StepAt": ago(minutes=185), "Owners": ["team-web"], "LateSeconds": 300},
        {"TimeGenerated": ago(minutes=180), "EventId": "reboot-web2", "EventType": "Reboot",
         "Rule": "everything-else-waits", "Step": 2, "Of": 2, "Do": "notify", "LeadSeconds": 900,
         "StepAt": ago(minutes=180), "Owners": ["sre-oncall"], "LateSeconds": 0},
    ]  # fmt: skip


def test_repairs(con: DuckDBPyConnection) -> None:
    # Per scale set, latest suspension first: db's repairs still suspended for redeploy-db0 (no ResumedAt, 30 minutes
    # so far); web's suspended for freeze-web until it completed, and for reboot-user until the bound (2 hours), after
    # a Suspend that failed (counted on each of web's rows).
    rows = shipped(con, "repairs.kql")
    day3 = ago(days=3)
    assert [row | {"Events": json.loads(row["Events"])} for row in rows] == [
        {"ScaleSetName": "db", "SuspendedAt": ago(minutes=30), "ResumedAt": None, "SuspendedMinutes": 30.0,
         "Events": ["redeploy-db0"], "Failures": 0, "LastFailureReason": None},
        {"ScaleSetName": "web", "SuspendedAt": ago(minutes=119), "ResumedAt": ago(minutes=100),
         "SuspendedMinutes": 19.0, "Events": ["freeze-web"], "Failures": 1, "LastFailureReason": "ARM: HTTP 429"},
        {"ScaleSetName": "web", "SuspendedAt": day3 + timedelta(minutes=2),
         "ResumedAt": day3 + timedelta(hours=2, minutes=2), "SuspendedMinutes": 120.0, "Events": ["reboot-user"],
         "Failures": 1, "LastFailureReason": "ARM: HTTP 429"},
    ]  # fmt: skip


def test_repairs_never_suspended_and_suspended_before_the_window(tmp_path: Path) -> None:
    # api's Suspend only failed: one row, its failures and no suspension. web's repairs were suspended 7 days and an
    # hour ago and resumed inside the window: that Resume alone shows nothing.
    path = tmp_path / "repairs.sqlite"
    store = SqliteHistory(path)
    store.write([
        repairs(NOW - timedelta(minutes=20), "api", "Suspend", "failed", ["e-1"], reason="ARM: HTTP 403"),
        repairs(NOW - timedelta(minutes=19), "api", "Suspend", "failed", ["e-1"], reason="ARM: HTTP 409"),
        repairs(NOW - timedelta(days=7, hours=1), "web", "Suspend", "suspended", ["e-2"], reason="in flight"),
        repairs(NOW - timedelta(days=7) + timedelta(hours=1), "web", "Resume", "resumed", ["e-2"], reason="over"),
    ])  # fmt: skip
    store.close()
    con = kql.load(path)
    try:
        rows = shipped(con, "repairs.kql")
    finally:
        con.close()
    assert rows == [
        {"ScaleSetName": "api", "SuspendedAt": None, "ResumedAt": None, "SuspendedMinutes": None, "Events": None,
         "Failures": 2, "LastFailureReason": "ARM: HTTP 409"},
    ]  # fmt: skip


def test_return_to_service(con: DuckDBPyConnection) -> None:
    # Latest completion first, then per VM. freeze-web (short-freeze: back within 60 s): web_0 back after 3 s; web_1
    # late (what it waited for: its ready gate), then back 72 s after the completion. reboot-api0 (api-reboots: within
    # 600 s): api_0 late, its recover hooks never reported, abandoned a day past the bound: never back. Columns of no
    # matching row are null (WaitedFor too, here; Log Analytics shows "").
    rows = shipped(con, "return-to-service.kql")
    freeze, api = ago(minutes=100), ago(days=2) + timedelta(minutes=6)
    gate = "web_1 not back in service 60 s after the Freeze completed: gate ready failing (HTTP 503, expected [200])"
    hooks = "api_0 not back in service 600 s after the Reboot completed: recover hooks not reported yet"
    assert rows == [
        {"EventType": "Freeze", "EventId": "freeze-web", "VmName": "web_0", "Rule": "short-freeze",
         "CompletedAt": freeze, "BackBy": freeze + timedelta(seconds=60), "BackAt": freeze + timedelta(seconds=3),
         "ReturnToServiceSeconds": 3.0, "WasLate": False, "Abandoned": False, "WaitedFor": None},
        {"EventType": "Freeze", "EventId": "freeze-web", "VmName": "web_1", "Rule": "short-freeze",
         "CompletedAt": freeze, "BackBy": freeze + timedelta(seconds=60), "BackAt": freeze + timedelta(seconds=72),
         "ReturnToServiceSeconds": 72.0, "WasLate": True, "Abandoned": False, "WaitedFor": gate},
        {"EventType": "Reboot", "EventId": "reboot-api0", "VmName": "api_0", "Rule": "api-reboots",
         "CompletedAt": api, "BackBy": api + timedelta(seconds=600), "BackAt": None, "ReturnToServiceSeconds": None,
         "WasLate": True, "Abandoned": True, "WaitedFor": hooks},
    ]  # fmt: skip


def test_return_to_service_still_late_and_still_within_its_bound(tmp_path: Path) -> None:
    # e-1 completed 5 minutes ago: web_0 went late (no row since: still watched, neither back nor abandoned), web_1 is
    # back. e-2 completed a minute ago, its VM within its bound: no row yet, so not shown.
    completed = NOW - timedelta(minutes=5)
    late = Event("e-1", "Reboot", ["web_0", "web_1"], completed - timedelta(minutes=10))
    late.moved(completed, "Completed", "gone from every reporting VM (2) after Started")
    watch = Watch("reboots", completed, 120)
    late.returned(completed + timedelta(seconds=40), "web_1", "back", watch)
    late.returned(completed + timedelta(seconds=120), "web_0", "late", watch, waiting="recover hooks failed (30-warm)")
    fresh = Event("e-2", "Reboot", ["web_2"], NOW - timedelta(minutes=10))
    fresh.moved(NOW - timedelta(minutes=1), "Completed", "gone from every reporting VM (1) after Started")
    path = tmp_path / "returns.sqlite"
    store = SqliteHistory(path)
    store.write(late.rows + fresh.rows)
    store.close()
    con = kql.load(path)
    try:
        rows = shipped(con, "return-to-service.kql")
    finally:
        con.close()
    assert [(row["EventId"], row["VmName"], row["BackAt"], row["WasLate"], row["Abandoned"]) for row in rows] == [
        ("e-1", "web_0", None, True, False),
        ("e-1", "web_1", (completed + timedelta(seconds=40)).replace(tzinfo=None), False, False),
    ]
    assert (
        rows[0]["WaitedFor"]
        == "web_0 not back in service 120 s after the Reboot completed: recover hooks failed (30-warm)"
    )
