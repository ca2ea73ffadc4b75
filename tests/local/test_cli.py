"""``python -m local`` as a user runs it: bad arguments, and Ctrl-C stopping every child process."""

from __future__ import annotations

import fcntl
import json
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from tests.commands import ROOT, python_m


def local(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return python_m("local", *args, timeout=timeout)


def children_of_run(workdir: Path) -> list[str]:
    """The forwarders of this run: their command lines name its per-VM folders (--state-dir, --hooks-dir)."""
    found = subprocess.run(["pgrep", "-f", str(workdir / "vms")], capture_output=True, text=True, check=False)
    return found.stdout.split()


def test_a_bad_scenario_is_refused_with_the_reason(tmp_path: Path) -> None:
    scenario = tmp_path / "bad.yaml"
    scenario.write_text("name: bad\nvms: []\n", encoding="utf-8")
    completed = local("--scenario", str(scenario), "--workdir", str(tmp_path / "w"))
    assert completed.returncode == 2
    assert "bad.yaml" in completed.stderr
    assert "vms" in completed.stderr


def test_a_missing_policy_file_is_refused(tmp_path: Path) -> None:
    completed = local("--policy", str(tmp_path / "none.yaml"), "--workdir", str(tmp_path / "w"))
    assert completed.returncode == 2
    assert "none.yaml does not exist" in completed.stderr


@pytest.mark.slow
def test_ctrl_c_stops_every_child_process(tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "local", "--workdir", str(workdir), "--quiet"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        # A test runner may start children with SIGINT ignored; a terminal's Ctrl-C is not.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # noqa: PLW1509
    )
    try:
        deadline = time.monotonic() + 60
        while len(children_of_run(workdir)) < 7 and time.monotonic() < deadline:  # fleet-demo has 7 VMs
            time.sleep(0.2)
        started = len(children_of_run(workdir))
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    left = children_of_run(workdir)
    print(f"figures: forwarder processes running before Ctrl-C {started}, after {len(left)}")
    assert started == 7
    assert process.returncode == 130
    assert b"every child process was stopped" in output
    assert left == []


def test_a_second_run_on_the_same_work_folder_is_refused(tmp_path: Path) -> None:
    workdir = tmp_path / "w"
    workdir.mkdir()
    with (workdir / ".lock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as a running `python -m local` holds it
        completed = local("--workdir", str(workdir))
    assert completed.returncode == 1
    assert "another local run is using" in completed.stderr
    assert not (workdir / "logs").exists(), "the running one's files were touched"


BAD_POLICY = "rules:\n  - name: a\n    match: {eventTyp: [Freeze]}\n    action: approve-nw\n"


def test_a_bad_policy_is_refused_before_anything_starts_naming_file_and_lines(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_POLICY, encoding="utf-8")
    started = time.monotonic()
    done = local("--policy", str(bad), "--workdir", str(tmp_path / "w"))
    assert time.monotonic() - started < 30, "the run was not refused at once"
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        f"local: policy {bad}: invalid policy: {bad}:3: rules.0.match.eventTyp: Extra inputs are not permitted; "
        f"{bad}:4: rules.0.action: Input should be 'approve-now', 'approve-after-hooks', 'approve-within-budget', "
        "'wait-for-person' or 'never-approve'"
    ]
    assert not (tmp_path / "w" / "logs").exists(), "the stack was started"


def test_a_scenario_naming_a_bad_or_missing_policy_is_refused(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text(BAD_POLICY, encoding="utf-8")
    scenario = tmp_path / "s.yaml"
    for policy, says in (
        ("bad.yaml", f"{tmp_path / 'bad.yaml'}:3: rules.0.match.eventTyp"),
        ("none.yaml", "does not exist"),
    ):
        scenario.write_text(f"name: s\npolicy: {policy}\nvms: [{{name: a}}]\n", encoding="utf-8")
        done = local("--scenario", str(scenario), "--workdir", str(tmp_path / "w"))
        assert done.returncode == 2
        assert len(done.stderr.splitlines()) == 1
        assert "(named by scenario 's')" in done.stderr
        assert says in done.stderr


@pytest.fixture(scope="module")
def json_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The docs' example scenario (its own policy), once, with --json: as a user pipes it into jq."""
    workdir = tmp_path_factory.mktemp("json-run")
    scenario = ROOT / "emulators" / "scenarios" / "documented-example.yaml"
    done = local("--scenario", str(scenario), "--time-scale", "120", "--json", "--workdir", str(workdir), timeout=240)
    return done, workdir


@pytest.mark.slow
def test_json_writes_one_document_on_stdout_and_the_rest_on_stderr(
    json_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    done, _ = json_run
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["ok"] is True
    assert [(e["label"], e["expected"], e["imds"]) for e in summary["events"]] == [
        ("live-migration", "approve", "approved")
    ]
    if shutil.which("jq") is not None:
        piped = subprocess.run(["jq", "-e", ".ok"], input=done.stdout, capture_output=True, text=True, check=False)
        assert piped.returncode == 0, piped.stderr
    assert "OK: every expectation of this run held" in done.stderr
    assert f"policy {ROOT / 'coordinator' / 'policies' / 'default.yaml'};" in done.stderr


@pytest.mark.slow
def test_the_live_timeline_is_in_time_order(json_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    done, _ = json_run
    clock = re.compile(r"^(\d\d:\d\d:\d\d\.\d{3})  ")
    times = [match[1] for line in done.stderr.splitlines() if (match := clock.match(line))]
    assert len(times) >= 4
    assert times == sorted(times)


@pytest.mark.slow
def test_the_runs_history_answers_to_the_names_the_run_printed(
    json_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    done, workdir = json_run
    event_id = json.loads(done.stdout)["events"][0]["eventId"]
    db = str(workdir / "history.sqlite")
    for name in ("live-migration", event_id[:8], event_id.lower()):
        found = python_m("ops.history", "--db", db, "--json", "timeline", name)
        assert found.returncode == 0, found.stderr
        assert "Decision" in {json.loads(line)["RecordType"] for line in found.stdout.splitlines()}


def _first_seconds(workdir: Path, into: Path, seconds: float) -> Path:
    """The run's history cut to its first ``seconds`` (its local-run.json beside it): a run short whatever the
    machine's speed (a card the timer sent 30 s late once made the whole run 37 s of history, an hour at 120x)."""
    into.mkdir()
    shutil.copy(workdir / "local-run.json", into / "local-run.json")
    with sqlite3.connect(workdir / "history.sqlite") as source, sqlite3.connect(into / "history.sqlite") as copy:
        source.backup(copy)
    with sqlite3.connect(into / "history.sqlite") as copy:
        [first] = copy.execute("SELECT MIN(TimeGenerated) FROM ScheduledEventsHistory_CL").fetchone()
        cut = (datetime.fromisoformat(first) + timedelta(seconds=seconds)).isoformat()
        copy.execute("DELETE FROM ScheduledEventsHistory_CL WHERE TimeGenerated > ?", (cut,))
    return into / "history.sqlite"


@pytest.mark.slow
def test_the_cost_tool_measures_the_run_in_azure_time(
    json_run: tuple[subprocess.CompletedProcess[str], Path], tmp_path: Path
) -> None:
    _, workdir = json_run
    history = _first_seconds(workdir, tmp_path / "short", seconds=10)

    def cost(*args: str) -> subprocess.CompletedProcess[str]:
        return python_m("ops.cost", "--history", str(history), *args)

    short = cost()  # 10 s at 120x: 20 minutes of Azure time, too little to scale to a month
    assert short.returncode == 2, short.stdout
    assert "of Azure time (a local run of 'documented-example' at time scale 120, local-run.json)" in short.stderr
    scaled = cost("--period-days", "30")
    assert scaled.returncode == 0, scaled.stderr
    assert json.loads(scaled.stdout)["time_scale"] == 120
