"""``python -m ops.policy simulate`` as a user runs it (a subprocess): what a history cannot tell is named once, by
``--help``, not repeated on every run; a run says only how the policy's gates were taken."""

from __future__ import annotations

import os
import subprocess
from datetime import UTC, datetime
from pathlib import Path

from coordinator.adapters.history import SqliteHistory
from coordinator.domain.policy_file import DEFAULT_POLICY_PATH
from coordinator.domain.rows import HistoryRow
from ops.policy.replay import LIMITS
from tests.commands import ROOT, python_m

FLEET_CONTROLS = ROOT / "emulators" / "scenarios" / "policies" / "fleet-controls.yaml"
EVENT = "0F6412ED-40AC-459F-B16B-6C8807B60A58"


def simulate(*args: str) -> subprocess.CompletedProcess[str]:
    # --help unwrapped: a hyphenated word is not split across lines.
    return python_m("ops.policy", "simulate", *args, env={**os.environ, "COLUMNS": "1000"})


def history(tmp_path: Path) -> Path:
    """One short Freeze, seen and approved at once by the default policy's short-freeze."""
    path = tmp_path / "history.sqlite"
    at = datetime(2026, 11, 24, 23, 37, tzinfo=UTC)
    event = {"EventId": EVENT, "EventType": "Freeze", "EventSource": "Platform", "DurationInSeconds": 5}
    store = SqliteHistory(path)
    store.write(
        [
            HistoryRow(
                TimeGenerated=at, RecordType="Observation", VmName="web_0", EventStatus="Scheduled", **event
            ),
            HistoryRow(
                TimeGenerated=at, RecordType="Decision", Rule="short-freeze", Action="approve-now", Outcome="approve",
                Reason="rule 'short-freeze' approves at once", **event,
            ),
        ]
    )  # fmt: skip
    store.close()
    return path


def test_a_run_names_the_limits_in_one_line_and_help_lists_them(tmp_path: Path) -> None:
    recorded = history(tmp_path)
    done = simulate("--policy", str(DEFAULT_POLICY_PATH), "--history", str(recorded))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].endswith(": 0 would differ")
    assert lines[1:] == ["not reconstructed from a history (8 limits): python -m ops.policy simulate --help"]
    listed = " ".join(simulate("--help").stdout.split())
    for limit in LIMITS:
        assert " ".join(limit.split()) in listed


def test_a_run_with_a_gated_policy_says_how_the_gates_were_taken(tmp_path: Path) -> None:
    done = simulate("--policy", str(FLEET_CONTROLS), "--history", str(history(tmp_path)), "--gates", "failing")
    assert "health gates (app-health) taken to be failing (--gates)" in done.stdout.splitlines()
