"""`python -m ops.cost`: listener-hours and dollars per VM per month, from a known history written through
the real SqliteHistory, and from assumed rates; exact figures, and the errors for bad arguments."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from coordinator.adapters.history import SqliteHistory
from coordinator.domain.rows import HistoryRow
from ops.cost import main

T0 = datetime(2026, 11, 1, tzinfo=UTC)
DAY = timedelta(days=1)
MIN = timedelta(minutes=1)


def seen(vm: str, event: str, kind: str, status: str, at: datetime, **extra: Any) -> HistoryRow:
    return HistoryRow(
        TimeGenerated=at + timedelta(seconds=1),
        RecordType="Observation",
        EventId=event,
        EventType=kind,
        EventStatus=status,
        VmName=vm,
        ObservedAt=at,
        **extra,
    )


@pytest.fixture
def history(tmp_path: Path) -> Path:
    """Ten days, three VMs. a: a Freeze Scheduled 30 min and a Reboot overlapping it (00:20-00:50), one connection
    of 50 min; b: the same Freeze (its group) 30 min, and c's Terminate (a peer's: no listener); c: its own Terminate,
    never seen again after it (deleted at NotBefore, 15 min)."""
    path = tmp_path / "history.sqlite"
    store = SqliteHistory(path)
    d1, d2 = T0 + DAY, T0 + 2 * DAY
    store.write(
        [
            HistoryRow(TimeGenerated=T0, RecordType="Heartbeat", VmName="c"),
            seen("a", "E1", "Freeze", "Scheduled", d1, Resources=["a", "b"]),
            seen("b", "E1", "Freeze", "Scheduled", d1, Resources=["a", "b"]),
            seen("a", "E1", "Freeze", "Scheduled", d1 + 10 * MIN, Resources=["a", "b"]),
            seen("a", "E2", "Reboot", "Scheduled", d1 + 20 * MIN, Resources=["a"]),
            seen("a", "E1", "Freeze", "Started", d1 + 30 * MIN, Resources=["a", "b"]),
            seen("b", "E1", "Freeze", "Started", d1 + 30 * MIN, Resources=["a", "b"]),
            seen("b", "E1", "Freeze", "Gone", d1 + 40 * MIN),
            seen("a", "E2", "Reboot", "Gone", d1 + 50 * MIN),
            seen("b", "T1", "Terminate", "Scheduled", d2, Resources=["c"], NotBefore=d2 + 15 * MIN),
            seen("c", "T1", "Terminate", "Scheduled", d2, Resources=["c"], NotBefore=d2 + 15 * MIN),
            HistoryRow(TimeGenerated=T0 + 10 * DAY, RecordType="Heartbeat", VmName="b"),
        ]
    )
    store.close()
    return path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(list(argv)) == 0
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    return report


def test_cost_from_a_known_history(history: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = run(capsys, "--history", str(history))
    # Connected: a 50 + 1 min, b 30 + 1 min, c 15 + 1 min (60 s grace each) = 98 min over 10 days and 3 VMs.
    hours = 98 / 60 * 730 / (10 * 24) / 3
    assert report["source"] == "history"
    assert report["vms"] == 3
    assert report["period_days"] == 10.0
    assert report["events_per_vm_month"] == round(4 * 730 / 240 / 3, 3)  # (a,E1) (a,E2) (b,E1) (c,T1)
    assert report["on_demand"]["listener_hours_per_vm_month"] == round(hours, 4)
    assert report["on_demand"]["usd_per_vm_month"] == round(hours * 0.0134, 6) == 0.022191
    assert report["always_on"] == {"listener_hours_per_vm_month": 730.0, "usd_per_vm_month": 9.782}


def test_cost_from_history_billing_whole_hours_without_grace(history: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = run(capsys, "--history", str(history), "--grace-seconds", "0", "--round-up-hours", "--vms", "6")
    # Three connections of under an hour each, billed as 3 hours, spread over the 6 VMs of the fleet.
    assert report["on_demand"]["usd_per_vm_month"] == round(3 * 730 / 240 / 6 * 0.0134, 6) == 0.020379


def test_cost_from_assumed_rates(capsys: pytest.CaptureFixture[str]) -> None:
    default = run(capsys)
    # 4 events x (15 min + 60 s) = 64 min a month.
    assert default["source"] == "assumed rates"
    assert default["on_demand"] == {"listener_hours_per_vm_month": 1.0667, "usd_per_vm_month": 0.014293}
    assert default["always_on"]["usd_per_vm_month"] == 9.782
    custom = run(
        capsys, "--events-per-vm-month", "2", "--scheduled-minutes", "29", "--grace-seconds", "60", "--price", "0.02"
    )
    assert custom["on_demand"] == {"listener_hours_per_vm_month": 1.0, "usd_per_vm_month": 0.02}
    assert custom["always_on"] == {"listener_hours_per_vm_month": 730.0, "usd_per_vm_month": 14.6}
    rounded = run(capsys, "--round-up-hours")
    assert rounded["on_demand"]["usd_per_vm_month"] == 4 * 0.0134


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--price", "0"], "--price must be > 0, got '0'"),
        (["--price", "cheap"], "--price must be a number, got 'cheap'"),
        (["--grace-seconds", "-1"], "--grace-seconds must be >= 0, got '-1'"),
        (["--events-per-vm-month", "nan"], "--events-per-vm-month must be >= 0, got 'nan'"),
        (["--vms", "0"], "--vms must be >= 1, got 0"),
        (["--history", "h.sqlite", "--events-per-vm-month", "3"], "not allowed with argument"),
        (["--history", "h.sqlite", "--scheduled-minutes", "3"], "with --history the history says how long"),
    ],
)
def test_bad_arguments_are_refused_naming_them(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_unusable_histories_are_refused_naming_the_file(
    tmp_path: Path, history: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.sqlite"
    assert main(["--history", str(missing)]) == 2
    assert f"--history {missing}: no such file" in capsys.readouterr().err
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_text("not a database")
    assert main(["--history", str(garbage)]) == 2
    assert "not a readable history database" in capsys.readouterr().err
    short = tmp_path / "short.sqlite"
    store = SqliteHistory(short)
    store.write([seen("a", "E1", "Freeze", "Scheduled", T0), seen("a", "E1", "Freeze", "Started", T0 + 5 * MIN)])
    store.close()
    assert main(["--history", str(short)]) == 2
    assert "too little to scale to a month; give the period it stands for with --period-days" in (
        capsys.readouterr().err
    )
    assert main(["--history", str(history), "--vms", "2"]) == 2
    assert "--vms 2: the history names 3 VMs" in capsys.readouterr().err
