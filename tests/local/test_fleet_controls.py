"""The policy's fleet controls through the whole local pipeline (real processes and protocols), with the
fleet-controls scenario and its own policy: a zone budget, a tag asking for a person, a health gate served by a
local HTTP page (failing, then passing), and a closed window."""

from __future__ import annotations

import http.server
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from emulators.imds import Scenario
from local.stack import LocalStack
from tests.local.conftest import Outcome, Runner

SCENARIOS = Path(__file__).resolve().parents[2] / "emulators" / "scenarios"


class HealthPage(http.server.BaseHTTPRequestHandler):
    status = 503

    def do_GET(self) -> None:
        self.send_response(type(self).status)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        return


@pytest.fixture
def health() -> Iterator[tuple[str, type[HealthPage]]]:
    handler = type("Page", (HealthPage,), {"status": 503})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/health", handler
    server.shutdown()


def held_by_gate(history: Path) -> bool:
    if not history.exists():
        return False
    try:
        with sqlite3.connect(history) as db:
            query = "SELECT 1 FROM ScheduledEventsHistory_CL WHERE RecordType = 'Decision' AND HoldKind = 'gate'"
            return db.execute(query).fetchone() is not None
    except sqlite3.OperationalError:  # the table is not there yet
        return False


def rows(outcome: Outcome, where: str, *args: Any) -> list[dict[str, Any]]:
    with sqlite3.connect(outcome.stack.history_path) as db:
        db.row_factory = sqlite3.Row
        query = f"SELECT * FROM ScheduledEventsHistory_CL WHERE {where} ORDER BY rowid"
        return [dict(row) for row in db.execute(query, args).fetchall()]


@pytest.mark.slow
def test_budget_tag_gate_and_window_each_hold_what_they_should(
    run_pipeline: Runner, health: tuple[str, type[HealthPage]], tmp_path: Path
) -> None:
    url, page = health
    policy = (SCENARIOS / "policies" / "fleet-controls.yaml").read_text(encoding="utf-8")
    policy_path = tmp_path / "fleet-controls.yaml"
    policy_path.write_text(policy.replace("http://127.0.0.1:8765/health", url), encoding="utf-8")

    def heal(stack: LocalStack) -> None:
        # The gated Redeploy (600 s notice: 5 s at time scale 120) is held while the page says 503; once the
        # history shows the hold, the page recovers and the next tick approves.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not held_by_gate(stack.history_path):
            time.sleep(0.1)
        page.status = 200

    outcome = run_pipeline(
        Scenario.from_file(SCENARIOS / "fleet-controls.yaml"),
        time_scale=120.0,
        timeout=90.0,
        policy_path=policy_path,
        during=heal,
    )
    assert outcome.finished, "the scenario did not finish in time"
    assert outcome.summary.ok, outcome.summary.failures
    events = {row["label"]: row for row in outcome.summary.events}

    # Budget: one Reboot at a time in zone 1. Both were approved, the second only after it was held by the zone.
    first, second = events["zone-first"], events["zone-second"]
    assert first["approvedThrough"] == "web_0"
    assert second["approvedThrough"] == "web_1"
    budget_holds = rows(outcome, "RecordType = 'Decision' AND HoldKind = 'budget'")
    assert {row["HoldName"] for row in budget_holds} == {"zone:westeurope/1"}
    assert {row["EventId"] for row in budget_holds} <= {first["eventId"], second["eventId"]}
    assert len({row["EventId"] for row in budget_holds}) == 1

    # Tag: db_0 asked for a person; nobody approved.
    manual = events["manual-tag"]
    assert manual["approvedThrough"] is None
    assert {row["Rule"] for row in rows(outcome, "RecordType = 'Decision' AND EventId = ?", manual["eventId"])} == {
        "manual-by-tag"
    }

    # Gate: held while the page said 503 (named, with since when), approved once it said 200.
    gated = events["gated"]
    assert gated["approvedThrough"] == "app_0"
    decisions = rows(outcome, "RecordType = 'Decision' AND EventId = ?", gated["eventId"])
    assert [(row["Outcome"], row["HoldKind"], row["HoldName"]) for row in decisions] == [
        ("wait", "gate", "app-health"),
        ("approve", None, None),
    ]
    assert decisions[0]["HoldSince"] is not None
    assert "HTTP 503" in decisions[0]["Reason"]

    # Window: closed for the whole run; the Freeze waited, named its window and its next opening, and expired.
    windowed = events["windowed"]
    assert windowed["approvedThrough"] is None
    held = rows(outcome, "RecordType = 'Decision' AND EventId = ?", windowed["eventId"])
    assert [(row["HoldKind"], row["HoldName"]) for row in held] == [("window", "freeze-in-the-night")]
    assert held[0]["HeldUntil"].endswith("T00:00:00+00:00")  # 01:00 Oslo on 1 January = 00:00 UTC
    assert "left to expire (onNotBefore: expire)" in held[0]["Reason"]
