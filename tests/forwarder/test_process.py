"""The forwarder as a real process: kill -9 while Event Hubs is down, restart, nothing lost and order kept;
SIGTERM exits cleanly; `once`; configuration errors."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from emulators.eventhubs import EventHubsEmulator
from emulators.imds import ImdsEmulator
from tests.forwarder.conftest import HUB, hub_envelopes, read_envelopes, write_hook
from tests.polling import wait_for

ROOT = Path(__file__).resolve().parents[2]


def forwarder(*args: str, env: dict[str, str] | None = None, log: Path | None = None) -> subprocess.Popen[bytes]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SE_FORWARDER_")}
    environment.update(env or {})
    return subprocess.Popen(
        [sys.executable, "-m", "forwarder", *args],
        cwd=ROOT,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=log.open("ab") if log else subprocess.PIPE,
    )


def spool_depth(state_dir: Path) -> int:
    path = state_dir / "forwarder.sqlite"
    if not path.exists():
        return 0
    with sqlite3.connect(path, timeout=5) as db:
        try:
            return int(db.execute("SELECT COUNT(*) FROM spool").fetchone()[0])
        except sqlite3.OperationalError:
            return 0


@pytest.mark.slow
def test_kill_9_with_hub_down_then_restart_loses_nothing(
    imds: ImdsEmulator, eventhubs: EventHubsEmulator, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    log = tmp_path / "forwarder.log"
    env = {
        "SE_FORWARDER_IMDS_URL": imds.url_for("web_0"),
        "SE_FORWARDER_SINK": "eventhub",
        # The VM's managed identity, as in Azure: a token from the IMDS emulator, checked by the Event Hubs emulator.
        "SE_FORWARDER_EVENTHUB_NAMESPACE": eventhubs.rest_namespace,
        "SE_FORWARDER_EVENTHUB_NAME": HUB,
        "SE_FORWARDER_STATE_DIR": str(state),
        "SE_FORWARDER_HOOKS_DIR": str(tmp_path / "hooks"),
        "SE_FORWARDER_POLL_INTERVAL": "0.25",
        "SE_FORWARDER_HEARTBEAT_INTERVAL": "0.5",
    }
    first = forwarder("run", env=env, log=log)
    try:
        wait_for(lambda: hub_envelopes(eventhubs), timeout=30, what="the first envelope in the hub")
        eventhubs.stop()
        imds.create_event(EventType="Reboot", Resources=["web_0"], NoticeSeconds=900)
        wait_for(lambda: spool_depth(state) >= 3, timeout=20, what="envelopes spooled while the hub is down")
    finally:
        first.kill()  # SIGKILL: no flush, no goodbye
        first.wait(10)
    assert first.returncode == -signal.SIGKILL
    spooled = spool_depth(state)
    assert spooled >= 3

    eventhubs.start()
    second = forwarder("run", env=env, log=log)
    try:
        imds.create_event(EventType="Freeze", Resources=["web_1"], NoticeSeconds=900)
        wait_for(
            lambda: any(e.get("document", {}).get("DocumentIncarnation") == 3 for e in hub_envelopes(eventhubs)),
            timeout=30,
            what="incarnation 3 after the restart",
        )
        # The prepare phase the kill cut short is reported by the restarted forwarder; sent before it is stopped
        # (an envelope spooled after the stop's flush is kept for the next start, which this test does not make).
        wait_for(lambda: any(e["kind"] == "hook" for e in hub_envelopes(eventhubs)), timeout=30, what="the hook report")
        second.send_signal(signal.SIGTERM)
        second.wait(15)
    finally:
        if second.poll() is None:
            second.kill()
    assert second.returncode == 0, log.read_text()[-2000:]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert lines[-1]["msg"] == "forwarder stopped"
    assert all({"ts", "level", "msg"} <= line.keys() for line in lines)

    envelopes = hub_envelopes(eventhubs)
    sequences = [e["sequence"] for e in envelopes]
    # At-least-once: a batch sent just before the kill may come again with the same sequence; nothing is missing
    # and, once the repeats are dropped, the order is the spool's order.
    first_seen = list(dict.fromkeys(sequences))
    assert first_seen == list(range(len(first_seen)))
    incarnations = [e["document"]["DocumentIncarnation"] for e in envelopes if e["kind"] == "incarnation"]
    assert list(dict.fromkeys(incarnations)) == [1, 2, 3]
    assert spool_depth(state) == 0


def test_a_phase_cut_short_by_kill_9_is_reported_failed_naming_the_hook(imds: ImdsEmulator, tmp_path: Path) -> None:
    hooks = tmp_path / "hooks" / "prepare.d"
    write_hook(hooks, "10-quick", "echo quick done\n")
    # The slow hook leaves its process id for the test to clean up (it lives in a session of its own).
    write_hook(hooks, "20-slow", f"echo $$ >> {tmp_path}/slow-runs\nexec sleep 30\n")
    output = tmp_path / "envelopes.jsonl"
    args = (
        "run",
        "--imds-url", imds.url_for("web_0"),
        "--sink", "jsonl",
        "--jsonl-path", str(output),
        "--state-dir", str(tmp_path / "state"),
        "--hooks-dir", str(tmp_path / "hooks"),
        "--poll-interval", "0.1",
    )  # fmt: skip
    slow_runs = tmp_path / "slow-runs"
    first = forwarder(*args, log=tmp_path / "forwarder.log")
    try:
        created = imds.create_event(EventType="Reboot", Resources=["web_0"], NoticeSeconds=900)
        wait_for(slow_runs.exists, timeout=20, what="the slow hook to start")
    finally:
        first.kill()
        first.wait(10)
    os.kill(int(slow_runs.read_text().split()[0]), signal.SIGKILL)

    second = forwarder(*args, log=tmp_path / "forwarder.log")
    try:
        hooks_sent = wait_for(
            lambda: [e for e in read_envelopes(output) if e["kind"] == "hook"], timeout=20, what="the phase report"
        )
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(15)
    (report,) = (e["hook"] for e in hooks_sent)
    assert (report["eventId"], report["phase"]) == (created["EventId"], "prepare")
    assert (report["outcome"], report["hook"]) == ("failed", "20-slow")
    assert [(s["hook"], s["outcome"]) for s in report["steps"]] == [("10-quick", "succeeded"), ("20-slow", "failed")]
    assert "interrupted" in report["steps"][1]["outputTail"]
    assert len(slow_runs.read_text().split()) == 1, "an interrupted hook is never run again"
    assert len({e["stateId"] for e in read_envelopes(output)}) == 1, "same state directory, same state"


def test_sigterm_exits_cleanly_and_quickly(imds: ImdsEmulator, tmp_path: Path) -> None:
    process = forwarder(
        "run",
        "--imds-url", imds.url_for("web_2"),
        "--sink", "stdout",
        "--state-dir", str(tmp_path / "state"),
        "--hooks-dir", str(tmp_path / "hooks"),
    )  # fmt: skip
    assert process.stdout is not None
    beat, first = (json.loads(process.stdout.readline()) for _ in range(2))
    assert (beat["kind"], beat["sequence"]) == ("heartbeat", 0)  # "up", before the first poll
    assert first["kind"] == "incarnation"
    assert first["vm"]["name"] == "web_2"
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=10)
    assert process.returncode == 0
    assert json.loads(stderr.decode().splitlines()[-1])["msg"] == "forwarder stopped"


def test_once_prints_document_and_identity(imds: ImdsEmulator) -> None:
    created = imds.create_event(EventType="Freeze", Resources=["web_1"], NoticeSeconds=900)
    result = subprocess.run(
        [sys.executable, "-m", "forwarder", "once", "--imds-url", imds.url_for("web_1")],
        cwd=ROOT,
        capture_output=True,
        timeout=30,
        check=True,
    )
    output = json.loads(result.stdout)
    assert output["identity"]["name"] == "web_1"
    assert output["document"]["Events"][0]["EventId"] == created["EventId"]


def test_configuration_error_exits_2_naming_the_field(tmp_path: Path) -> None:
    process = forwarder("run", "--sink", "stdout", "--poll-interval", "fast", "--state-dir", str(tmp_path))
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 2
    message = stderr.decode()
    assert "poll_interval = 'fast' (from flag --poll-interval)" in message
    assert "valid number" in message


def test_once_against_nothing_fails_clearly(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "forwarder",
            "once",
            "--imds-url",
            "http://127.0.0.1:9",
            "--imds-first-call-timeout",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 3
    assert b"Connection refused" in result.stderr
