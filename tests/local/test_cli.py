"""``python -m local`` as a user runs it: bad arguments, and Ctrl-C stopping every child process."""

from __future__ import annotations

import fcntl
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def children_of_run(workdir: Path) -> list[str]:
    """The forwarders of this run: their command lines name its per-VM folders (--state-dir, --hooks-dir)."""
    found = subprocess.run(["pgrep", "-f", str(workdir / "vms")], capture_output=True, text=True, check=False)
    return found.stdout.split()


def test_a_bad_scenario_is_refused_with_the_reason(tmp_path: Path) -> None:
    scenario = tmp_path / "bad.yaml"
    scenario.write_text("name: bad\nvms: []\n", encoding="utf-8")
    completed = subprocess.run(
        [sys.executable, "-m", "local", "--scenario", str(scenario), "--workdir", str(tmp_path / "w")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 2
    assert "bad.yaml" in completed.stderr
    assert "vms" in completed.stderr


def test_a_missing_policy_file_is_refused(tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "local", "--policy", str(tmp_path / "none.yaml"), "--workdir", str(tmp_path / "w")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
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
        completed = subprocess.run(
            [sys.executable, "-m", "local", "--workdir", str(workdir)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert completed.returncode == 1
    assert "another local run is using" in completed.stderr
    assert not (workdir / "logs").exists(), "the running one's files were touched"
