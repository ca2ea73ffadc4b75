"""``python -m ops.cost --history`` on a local run's history (a subprocess, as a user runs it): the run played Azure's
durations faster by its time scale, which the cost tool reads beside the history and undoes before it measures."""

from __future__ import annotations

import json
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from coordinator.adapters.history import SqliteHistory
from coordinator.domain.rows import HistoryRow
from ops.history import LOCAL_RUN_FILE
from tests.commands import python_m

T0 = datetime(2026, 11, 1, tzinfo=UTC)


def cost(*args: str) -> subprocess.CompletedProcess[str]:
    return python_m("ops.cost", *args)


def write_history(folder: Path, *, scale: float, span: timedelta) -> Path:
    """web_0 sees a Freeze Scheduled for 15 Azure minutes, then Started; the history covers ``span`` of Azure
    time. Written at ``scale``: every duration divided by it, as a local run at that time scale plays them."""
    folder.mkdir()
    path = folder / "history.sqlite"

    def at(azure: timedelta) -> datetime:
        return T0 + azure / scale

    def seen(status: str, azure: timedelta) -> HistoryRow:
        return HistoryRow(
            TimeGenerated=at(azure),
            ObservedAt=at(azure),
            RecordType="Observation",
            EventId="E1",
            EventType="Freeze",
            EventStatus=status,
            VmName="web_0",
            Resources=["web_0"],
            NotBefore=at(timedelta(minutes=16)),
        )

    store = SqliteHistory(path)
    store.write(
        [
            seen("Scheduled", timedelta(minutes=1)),
            seen("Started", timedelta(minutes=16)),
            HistoryRow(TimeGenerated=at(span), RecordType="Heartbeat", VmName="web_0"),
        ]
    )
    store.close()
    return path


def report(*args: str) -> dict[str, Any]:
    done = cost(*args)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_a_local_runs_history_is_measured_in_azure_time(tmp_path: Path) -> None:
    real = report("--history", str(write_history(tmp_path / "azure", scale=1, span=timedelta(hours=2))))
    played = write_history(tmp_path / "local", scale=60, span=timedelta(hours=2))
    (played.parent / LOCAL_RUN_FILE).write_text(json.dumps({"scenario": "fleet-demo", "timeScale": 60, "refs": {}}))
    local = report("--history", str(played))
    assert local["time_scale"] == 60
    assert real["time_scale"] == 1
    for key in ("on_demand", "always_on", "period_days", "events_per_vm_month"):
        assert local[key] == real[key]
    # The same history without the run's record: --time-scale says it.
    (played.parent / LOCAL_RUN_FILE).unlink()
    assert report("--history", str(played), "--time-scale", "60")["on_demand"] == real["on_demand"]


def test_a_local_run_too_short_to_scale_is_refused_naming_its_time_scale(tmp_path: Path) -> None:
    played = write_history(tmp_path / "local", scale=60, span=timedelta(minutes=25))
    (played.parent / LOCAL_RUN_FILE).write_text(json.dumps({"scenario": "fleet-demo", "timeScale": 60, "refs": {}}))
    done = cost("--history", str(played))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"ops.cost: --history {played}: it covers 24 minutes of Azure time (a local run of 'fleet-demo' at time "
        f"scale 60, {LOCAL_RUN_FILE}), too little to scale to a month; give the period it stands for with --period-days"
    ]
    assert report("--history", str(played), "--period-days", "30")["time_scale"] == 60


def test_a_broken_run_record_is_named(tmp_path: Path) -> None:
    played = write_history(tmp_path / "local", scale=60, span=timedelta(hours=2))
    (played.parent / LOCAL_RUN_FILE).write_text("{}")
    done = cost("--history", str(played))
    assert done.returncode == 2
    assert f"{played.parent / LOCAL_RUN_FILE}: not a local run's record" in done.stderr
    assert "Traceback" not in done.stderr
