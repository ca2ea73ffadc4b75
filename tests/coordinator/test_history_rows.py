"""History rows: one builder per RecordType, and every row of a type carries the same columns, each a column of
coordinator/history_columns.json with its type. Calls every builder in each of its cases; a RecordType without a
builder, a builder not called here, or a row built anywhere else in the coordinator fails."""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, get_args

import pytest

from contracts.envelope import HookReport, HookStep, VmIdentity
from coordinator.domain import history_rows
from coordinator.domain.history_rows import (
    RecordType,
    alert_row,
    approval_row,
    dead_letter_row,
    decision_row,
    heartbeat_row,
    hook_row,
    impact_row,
    observation_row,
    position_of,
    repairs_row,
    shadow_row,
    transition_row,
)
from coordinator.domain.model import EventRecord, VmRecord
from coordinator.domain.rows import HistoryRow, column_types, history_schema
from coordinator.domain.side_records import ReturnWatch, ShadowVerdict, VmReturn
from tests.coordinator.helpers import decision_record

NOW = datetime(2026, 11, 18, 10, 0, tzinfo=UTC)
COORDINATOR = Path(__file__).resolve().parents[2] / "coordinator"
# Python types of the Log Analytics column types (history_columns.json).
PYTHON_TYPES: dict[str, tuple[type, ...]] = {
    "datetime": (datetime,),
    "string": (str,),
    "int": (int,),
    "long": (int,),
    "boolean": (bool,),
    "dynamic": (list, dict),
    "real": (float,),
}


# The rule that decided the record's event, as its decision names it.
DECIDED = {"decisionId": "d1", "rule": "deletes", "actor": "rule:deletes"}
# The approval of that decision through web_0, as its Transition and Approval rows name it.
APPROVED = {"rule": DECIDED["rule"], "actor": DECIDED["actor"], "decision_id": DECIDED["decisionId"], "vm": "web_0"}


def returning(*, gates: list[str] | None = None) -> EventRecord:
    """A completed Reboot whose VM web_0 is watched back into service (domain/returns.py)."""
    watch = ReturnWatch(
        rule="reboots",
        since=NOW - timedelta(seconds=42),
        bound=NOW + timedelta(seconds=558),
        gates=gates or [],
        vms={"web_0": VmReturn()},
    )
    return record().model_copy(update={"state": "Completed", "returnToService": watch})


def record(*, held: bool = True) -> EventRecord:
    """A Terminate waiting for another delete (``held``) or for its hooks."""
    hold: dict[str, Any] = (
        {
            "heldBy": "E2",
            "heldByVm": "web_2",
            "heldUntil": NOW + timedelta(minutes=20),
            "holdKind": "delete",
            "holdName": "E2",
            "holdSince": NOW - timedelta(minutes=1),
        }
        if held
        else {}
    )
    return EventRecord(
        eventId="E1",
        eventType="Terminate",
        resources=["web_0", "web_1"],
        durationInSeconds=-1,
        notBefore=NOW + timedelta(minutes=15),
        stateSince=NOW,
        createdAt=NOW,
        decision=decision_record(action="approve-after-hooks", reason="waiting", decidedAt=NOW, **DECIDED, **hold),
    )


VM = VmIdentity(
    name="web_0",
    vmId="00000000-0000-4000-8000-000000000000",
    resourceId="/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachineScaleSets/web/"
    "virtualMachines/0",
    vmScaleSetName="web",
    placementGroupId="pg-web",
)
POSITION = VmRecord(identity=VM, lastSequence=9, lastSeen=NOW - timedelta(seconds=30), lastIncarnation=4)
PHASE = HookReport(
    eventId="E1",
    phase="prepare",
    outcome="failed",
    durationSeconds=3.0,
    steps=[HookStep(hook="10-drain", outcome="failed", durationSeconds=3.0, exitCode=2, outputTail="no")],
)
ONE_HOOK = HookReport(
    eventId="E1", phase="prepare", outcome="succeeded", hook="20-flush", durationSeconds=1.0, outputTail="ok"
)

# Every builder in each of its cases: the least it is given, and every option it has.
CASES: dict[Callable[..., HistoryRow], list[Callable[[], HistoryRow]]] = {
    observation_row: [
        lambda: observation_row(
            record=record(), now=NOW, vm=VM, status="Scheduled", incarnation=1, observed_at=NOW, sequence=3
        ),
        lambda: observation_row(
            record=record(),
            now=NOW,
            vm=VM,
            status="Scheduled",
            incarnation=2,
            observed_at=NOW,
            sequence=4,
            outcome="conflict",
            reason="web_0 claims EventType 'Reboot'",
            details={"claimed": {"EventType": "Reboot"}},
        ),
    ],
    transition_row: [
        lambda: transition_row(record=record(), now=NOW, previous="Scheduled", reason="seen Started"),
        lambda: transition_row(record=record(), now=NOW, previous="Scheduled", reason="approved", **APPROVED),
    ],
    decision_row: [
        lambda: decision_row(record=record(), now=NOW),
        lambda: decision_row(record=record(held=False), now=NOW),
    ],
    repairs_row: [
        lambda: repairs_row(
            scale_set="/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachineScaleSets/web",
            action="Suspend",
            outcome="suspended",
            reason="1 event(s) in flight on its VMs",
            events=["E1"],
            now=NOW,
        ),
    ],
    shadow_row: [
        lambda: shadow_row(
            record=record().model_copy(
                update={
                    "shadow": ShadowVerdict(
                        rule="r",
                        action="approve-now",
                        verdict="approve",
                        reason="now",
                        decidedAt=NOW,
                        policyVersion="v",
                        approveAt=NOW,
                    )
                }
            ),
            now=NOW,
        ),
    ],
    approval_row: [
        lambda: approval_row(record=record(), now=NOW, outcome="unknown", reason="no recorded outcome"),
        lambda: approval_row(
            record=record(),
            now=NOW,
            outcome="approved",
            reason="StartRequests accepted by web_0",
            incarnation=5,
            details={"heldBy": "E2"},
            **APPROVED,
        ),
    ],
    hook_row: [
        lambda: hook_row(
            record=record(), now=NOW, vm=VM, observed_at=NOW, sequence=5, hook=PHASE, phase_outcome="failed"
        ),
        lambda: hook_row(
            record=record(), now=NOW, vm=VM, observed_at=NOW, sequence=6, hook=ONE_HOOK, phase_outcome="failed"
        ),
    ],
    heartbeat_row: [
        lambda: heartbeat_row(vm=VM, now=NOW, outcome="lost", reason="silent", observed_at=NOW, sequence=9),
        lambda: heartbeat_row(
            vm=VM,
            now=NOW,
            outcome="retired",
            reason="removed by Terminate E1",
            observed_at=NOW,
            sequence=9,
            incarnation=4,
            actor="forwarder",
            event_id="E1",
            event_type="Terminate",
            details={"epoch": 1},
        ),
    ],
    impact_row: [
        lambda: impact_row(
            record=record(),
            now=NOW,
            vm=VM,
            measure="removed",
            measured_seconds=0.0,
            start=None,
            end=NOW,
            observed_at=NOW,
            sequence=9,
            actor="coordinator",
        ),
        lambda: impact_row(
            record=record(),
            now=NOW,
            vm=VM,
            measure="pause",
            measured_seconds=5.02,
            start=NOW - timedelta(seconds=5.1),
            end=NOW,
            observed_at=NOW,
            sequence=9,
            actor="forwarder",
            details={"clock": "monotonic"},
        ),
        lambda: impact_row(
            record=returning(),
            now=NOW,
            vm=VM,
            measure="return-to-service",
            measured_seconds=None,
            start=NOW - timedelta(seconds=42),
            end=NOW,
            observed_at=NOW,
            sequence=-1,
            actor="coordinator",
            details={"bound": NOW.isoformat(), "gates": ["ready"]},
            outcome="back",
            reason="web_0 back in service 42 s after the Reboot completed",
            returned=("reboots", 42.0),
        ),
    ],
    dead_letter_row: [
        lambda: dead_letter_row(now=NOW, reason="invalid envelope", details={"bodyBytes": 3}),
        lambda: dead_letter_row(now=NOW, reason="could not be applied", details={"vms": ["web_0"]}, event_id="E1"),
    ],
    alert_row: [
        lambda: alert_row(about=record(), kind="new-event", now=NOW, outcome="sent"),
        lambda: alert_row(about=VM, kind="heartbeat-lost", now=NOW, outcome="failed", reason="HTTP 500"),
    ],
}


def _declared_types() -> set[str]:
    """The RecordTypes history_columns.json names ("Observation | Transition | ... ." in the column's description)."""
    column = next(c for c in history_schema()["columns"] if c["name"] == "RecordType")
    return {name.strip() for name in column["description"].rstrip(".").split("|")}


def _builders() -> dict[str, Callable[..., HistoryRow]]:
    return {
        name: function
        for name, function in inspect.getmembers(history_rows, inspect.isfunction)
        if function.__module__ == history_rows.__name__ and function.__annotations__.get("return") == "HistoryRow"
    }


def _rows() -> dict[str, list[HistoryRow]]:
    rows: dict[str, list[HistoryRow]] = {}
    for cases in CASES.values():
        for case in cases:
            row = case()
            rows.setdefault(row.RecordType, []).append(row)
    return rows


def test_every_builder_is_called_here_with_keyword_only_arguments() -> None:
    assert {builder.__name__ for builder in CASES} == set(_builders())
    for name, builder in _builders().items():
        kinds = {p.kind for p in inspect.signature(builder).parameters.values()}
        assert kinds == {inspect.Parameter.KEYWORD_ONLY}, name


def test_each_record_type_has_exactly_one_builder() -> None:
    made_by: dict[str, set[str]] = {}
    for builder, cases in CASES.items():
        for case in cases:
            made_by.setdefault(case().RecordType, set()).add(builder.__name__)
    assert set(get_args(RecordType)) == _declared_types(), "RecordType and history_columns.json disagree"
    assert set(made_by) == set(get_args(RecordType)), "a RecordType without a builder (or a builder of no type)"
    assert all(len(builders) == 1 for builders in made_by.values()), made_by


def test_every_row_of_a_record_type_carries_the_same_columns() -> None:
    for record_type, rows in _rows().items():
        columns = [row.model_fields_set for row in rows]
        assert all(c == columns[0] for c in columns), (record_type, [sorted(c ^ columns[0]) for c in columns])


def test_the_columns_are_history_columns_of_their_types_and_each_is_used() -> None:
    types = column_types()
    for record_type, rows in _rows().items():
        columns = rows[0].model_fields_set
        assert columns <= set(types), (record_type, sorted(columns - set(types)))
        for column in sorted(columns):
            values = [getattr(row, column) for row in rows]
            for value in values:
                expected = PYTHON_TYPES[types[column]]
                wrong = not isinstance(value, expected) or (types[column] != "boolean" and isinstance(value, bool))
                assert value is None or not wrong, (record_type, column, value)
            # A column no case fills is either not this type's, or its case is missing here.
            assert any(v is not None and v != "" for v in values), (record_type, column)


def test_a_decision_row_needs_a_decision() -> None:
    with pytest.raises(ValueError, match="no decision"):
        decision_row(record=record().model_copy(update={"decision": None}), now=NOW)


def _history_rows_built(path: Path) -> list[int]:
    made: list[int] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call):
            continue
        func: Any = node.func
        if (isinstance(func, ast.Name) and func.id == "HistoryRow") or (
            isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "HistoryRow"
        ):
            made.append(node.lineno)
    return made


# Parsed at collection, before any test starts a thread: in a full run on CPython 3.11.7 an ast.parse made while other
# threads ran (Azurite readers, approval senders) failed once with "SystemError: AST constructor recursion depth
# mismatch" (the AST constructor's recursion bookkeeping is not safe there); parsing up front avoids it.
BUILT = {path: _history_rows_built(path) for path in sorted(COORDINATOR.rglob("*.py"))}


@pytest.mark.parametrize("path", sorted(BUILT), ids=lambda p: str(p.relative_to(COORDINATOR)))
def test_only_the_builders_make_history_rows(path: Path) -> None:
    if path.name == "history_rows.py" and path.parent.name == "domain":
        return
    made = BUILT[path]
    assert not made, f"{path}: HistoryRow built on lines {made}; use a builder of coordinator/domain/history_rows.py"


def test_a_heartbeat_row_at_a_vms_stored_position():
    assert heartbeat_row(
        **position_of(POSITION), now=NOW, outcome="lost", reason="silent", event_id="E1"
    ) == heartbeat_row(
        vm=VM,
        now=NOW,
        observed_at=NOW - timedelta(seconds=30),
        sequence=9,
        incarnation=4,
        outcome="lost",
        reason="silent",
        event_id="E1",
    )
