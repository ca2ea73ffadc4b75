"""One path per alert condition: a Log Analytics alert rule (infra/modules/alerts.bicep) never fires on a condition
the coordinator already sends a Teams card for (coordinator.model.AlertKind), so no one gets the same expired event
or silent VM twice; and every rule fires on the condition it is there for.

How: for each card kind, the history rows the coordinator writes when that condition happens (known_history's
builders, shaped as the coordinator's rows), written with the real SQLite writer; each rule's query runs on them
with duckdb-kql and must return nothing (the rules fire on a row count above 0)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, get_args

import pytest

from coordinator.adapters.history import SqliteHistory
from coordinator.domain.model import AlertKind
from coordinator.domain.rows import HistoryRow
from ops import kql
from tests.infra import bicep_model as bm
from tests.infra.known_history import Event, Watch, heartbeat
from tests.infra.test_kql import alert_query_file, alert_rules

NOW = datetime.now(UTC).replace(microsecond=0)


def _event(event_type: str = "Reboot") -> Event:
    return Event("e-1", event_type, ["web_0"], NOW + timedelta(minutes=10))


def _with_card(event: Event, kind: str) -> list[HistoryRow]:
    event.alert(NOW, kind)
    return event.rows


def _new_event() -> list[HistoryRow]:
    event = _event()
    event.observed(NOW, "web_0")
    event.decided(NOW, "everything-else-waits", "wait-for-person", "wait", "waits for a person")
    return _with_card(event, "new-event")


def _approved() -> list[HistoryRow]:
    event = _event()
    event.decided(NOW, "short-freeze", "approve-now", "approve", "approves at once")
    event.moved(NOW, "Approved", "approved by rule short-freeze")
    event.approval(NOW, "web_0", "approved", "StartRequests accepted", "short-freeze")
    return _with_card(event, "approved")


def _started_without_notice() -> list[HistoryRow]:
    event = _event("Freeze")
    event.observed(NOW, "web_0", "Started")
    event.moved(NOW, "Started", "first seen Started")
    return _with_card(event, "started-without-notice")


def _moved_to(state: str, kind: str) -> Callable[[], list[HistoryRow]]:
    def rows() -> list[HistoryRow]:
        event = _event()
        event.moved(NOW, state, f"now {state}")
        return _with_card(event, kind)

    return rows


def _approval(outcome: str, kind: str, actor: str = "") -> Callable[[], list[HistoryRow]]:
    def rows() -> list[HistoryRow]:
        event = _event()
        event.approval(NOW, "web_0", outcome, f"listener answered {outcome}", "short-freeze", actor=actor)
        return _with_card(event, kind)

    return rows


def _completed() -> list[HistoryRow]:
    event = _event("Freeze")
    event.impact(NOW, "web_0", "pause", 5.0, start=NOW - timedelta(seconds=5), end=NOW)
    event.moved(NOW, "Completed", "gone from every reporting VM (1) after Started")
    return _with_card(event, "completed")


def _facts_conflict() -> list[HistoryRow]:
    event = _event()
    event.observed(NOW, "web_1", outcome="conflict")
    return _with_card(event, "facts-conflict")


def _escalation(step: int) -> Callable[[], list[HistoryRow]]:
    """An escalation ladder's step: the Decision row that took it (its reason names it), then its card."""

    def rows() -> list[HistoryRow]:
        event = _event()
        event.observed(NOW, "web_0")
        reason = f"waits for a person; escalation step {step} of 8 (notify, 600 s before NotBefore): tell sre"
        event.decided(NOW, "reboots-escalate", "wait-for-person", "wait", reason)
        return _with_card(event, f"escalation-{step}")

    return rows


def _return_late() -> list[HistoryRow]:
    """A VM not back in service by its rule's bound after the event completed: its Impact row (late), then the
    event's card."""
    event = _event("Reboot")
    completed = NOW - timedelta(seconds=60)
    event.moved(completed, "Completed", "gone from every reporting VM (1) after Started")
    waiting = "gate ready failing (HTTP 503, expected [200])"
    event.returned(NOW, "web_0", "late", Watch("reboots-one-at-a-time", completed, 60), waiting=waiting)
    return _with_card(event, "return-late")


# A VM card's condition is its Heartbeat row (its Alert row, as every card's, says only whether it was sent).
CARDED: dict[str, Callable[[], list[HistoryRow]]] = {
    "new-event": _new_event,
    "approved": _approved,
    "started-without-notice": _started_without_notice,
    "canceled": _moved_to("Canceled", "canceled"),
    "expired": _moved_to("Expired", "expired"),
    "completed": _completed,
    "approval-failed": _approval("failed", "approval-failed"),
    "approval-refused": _approval("rejected", "approval-refused"),
    "not-started": _approval("not-started", "not-started", actor="platform"),
    "facts-conflict": _facts_conflict,
    "heartbeat-lost": lambda: [heartbeat(NOW, "web_0", "lost", NOW - timedelta(minutes=10), "no envelope for 600 s")],
    "forwarder-conflict": lambda: [heartbeat(NOW, "web_0", "conflict", NOW, "two forwarder states in turn")],
    "imds-failing": lambda: [heartbeat(NOW, "web_0", "imds-failing", NOW, "no good IMDS poll for 120 s")],
    **{f"escalation-{step}": _escalation(step) for step in range(1, 9)},
    "return-late": _return_late,
}


def _cards_failing() -> list[HistoryRow]:
    event = _event()
    event.alert(NOW, "expired", "failed", "Teams webhook refused card: HTTP 400")
    return event.rows


# Each rule's own condition (nobody else alerts it): the rows it must fire on. A new rule needs its entry here.
OWN_CONDITION: dict[str, Callable[[], list[HistoryRow]]] = {
    "cardsFailing": _cards_failing,
}


def fires(query: str, rows: list[HistoryRow], folder: Path) -> list[dict[str, Any]]:
    """The rows a rule's query returns on a history holding just these rows (the rule fires if there are any)."""
    path = folder / f"history-{len(list(folder.iterdir()))}.sqlite"
    store = SqliteHistory(path)
    store.write(rows)
    store.close()
    con = kql.load(path)
    try:
        return kql.run(con, query, now=NOW).records()
    finally:
        con.close()


def carded_conditions_it_fires_on(query: str, folder: Path) -> list[str]:
    return [kind for kind, rows in CARDED.items() if fires(query, rows(), folder)]


def test_every_card_kind_has_its_history_rows_here() -> None:
    assert set(CARDED) == set(get_args(AlertKind))


@pytest.mark.parametrize("rule", sorted(alert_rules()))
def test_no_rule_repeats_a_coordinator_card(rule: str, tmp_path: Path) -> None:
    criterion = alert_rules()[rule]
    # The test reads a rule as "fires when the query returns rows"; another shape needs teaching it.
    assert (criterion["timeAggregation"], criterion["operator"], criterion["threshold"]) == ("Count", "GreaterThan", 0)
    query = alert_query_file(criterion).read_text(encoding="utf-8")
    assert carded_conditions_it_fires_on(query, tmp_path) == [], (
        f"alert rule {rule} fires on conditions the coordinator already sends a card for: two paths to Teams"
    )


def test_every_rule_fires_on_its_own_condition(tmp_path: Path) -> None:
    rules = alert_rules()
    assert set(OWN_CONDITION) == set(rules), "declare each alert rule's own condition in OWN_CONDITION"
    for rule, rows in OWN_CONDITION.items():
        query = alert_query_file(rules[rule]).read_text(encoding="utf-8")
        assert fires(query, rows(), tmp_path), f"alert rule {rule} does not fire on its own condition"


def test_a_rule_repeating_a_card_is_caught(tmp_path: Path) -> None:
    """The check is not vacuous: the queries of the rules this project had before (each one the coordinator also
    cards) are flagged, each for its condition."""
    silent = (bm.INFRA / "queries" / "silent-forwarders.kql").read_text(encoding="utf-8")
    assert carded_conditions_it_fires_on(silent, tmp_path) == ["heartbeat-lost"]
    expired = 'ScheduledEventsHistory_CL | where RecordType == "Transition" and State == "Expired" | project EventId'
    assert carded_conditions_it_fires_on(expired, tmp_path) == ["expired"]
    failing = (
        'ScheduledEventsHistory_CL | where RecordType == "Approval" and Outcome in ("failed", "rejected")'
        " | summarize count() by EventId, VmName"
    )
    assert carded_conditions_it_fires_on(failing, tmp_path) == ["approval-failed", "approval-refused"]
