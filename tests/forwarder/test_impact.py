"""Proof of impact on the VM (forwarder/impact.py), with the forwarder as a real process against the IMDS emulator:
a Freeze's pause measured from SIGSTOP/SIGCONT, a Reboot's downtime across a restart with a new boot time, a
forwarder restarted without a reboot reporting nothing, and the boot time read from a /proc/stat-shaped file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from contracts.envelope import Envelope
from contracts.wire import ScheduledEventsDocument, VmIdentity
from emulators.imds import ImdsEmulator
from forwarder.durable_state import IMPACT_RESTART, Store
from forwarder.impact import ImpactMeter, read_boot_time
from forwarder.telemetry import IdTracer
from forwarder.worker_parts import WorkerParts
from tests.forwarder.conftest import read_envelopes
from tests.polling import wait_for

ROOT = Path(__file__).resolve().parents[2]


def start(imds: ImdsEmulator, home: Path) -> subprocess.Popen[bytes]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SE_FORWARDER_")}
    return subprocess.Popen(
        [
            sys.executable, "-m", "forwarder", "run",
            "--imds-url", imds.url_for("web_0"),
            "--poll-interval", "0.2",
            "--sink", "jsonl", "--jsonl-path", str(home / "out.jsonl"),
            "--state-dir", str(home / "state"),
            "--hooks-dir", str(home / "hooks"),
            "--boot-time-file", str(home / "stat"),
            "--heartbeat-interval", "3600",
        ],
        cwd=ROOT,
        env=environment,
        stdout=subprocess.DEVNULL,
        stderr=(home / "forwarder.log").open("ab"),
    )  # fmt: skip


def boot(home: Path, at: float) -> None:
    (home / "stat").write_text(f"cpu  1 2 3\nbtime {int(at)}\nprocesses 9\n", encoding="ascii")


def envelopes(home: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_envelopes(home / "out.jsonl") if e["kind"] == kind]


def listed(home: Path, event_id: str) -> bool:
    return any(event_id in str(e["document"]) for e in envelopes(home, "incarnation"))


def stop(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=15)


@contextmanager
def running(imds: ImdsEmulator, home: Path) -> Iterator[subprocess.Popen[bytes]]:
    """The forwarder's process while the block runs, stopped cleanly (SIGTERM) however the block ends."""
    process = start(imds, home)
    try:
        yield process
    finally:
        stop(process)


def up_after_a_reboot(imds: ImdsEmulator, home: Path) -> tuple[dict[str, Any], float, datetime]:
    """The VM down 1.5 s, then booted: the forwarder, started on the new boot, sends its impact report, once (it runs
    on half a second after it). The report, the boot time, and when the report had come."""
    time.sleep(1.5)
    booted = time.time()
    boot(home, booted)
    with running(imds, home):
        (envelope,) = wait_for(lambda: envelopes(home, "impact"), what="the impact report")
        up = datetime.now(UTC)
        time.sleep(0.5)  # the report is sent once
        assert len(envelopes(home, "impact")) == 1
    return envelope, booted, up


def test_a_freezes_pause_is_measured_within_a_tick(imds: ImdsEmulator, tmp_path: Path) -> None:
    boot(tmp_path, time.time() - 3600)
    with running(imds, tmp_path) as process:
        freeze = imds.create_event(EventType="Freeze", Resources=["web_0"], NoticeSeconds=900, DurationInSeconds=9)
        wait_for(lambda: listed(tmp_path, freeze["EventId"]), what="the Freeze forwarded")
        time.sleep(0.5)  # a few ticks
        process.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        time.sleep(2.0)
        process.send_signal(signal.SIGCONT)
        paused = time.monotonic() - stopped
        (envelope,) = wait_for(lambda: envelopes(tmp_path, "impact"), what="the impact report")
    impact = Envelope.from_mapping(envelope).impact
    assert impact is not None
    assert (impact.eventId, impact.eventType, impact.measure) == (freeze["EventId"], "Freeze", "pause")
    assert impact.announcedSeconds == 9
    assert abs(impact.measuredSeconds - paused) <= 0.2
    # A stopped process: the kernel ran on, both clocks saw the same gap.
    assert impact.monotonicGapSeconds is not None
    assert impact.wallGapSeconds is not None
    assert abs(impact.monotonicGapSeconds - impact.wallGapSeconds) < 0.05
    assert abs((impact.end - impact.start).total_seconds() - impact.wallGapSeconds) < 0.01


def test_a_reboots_downtime_is_measured_across_the_restart(imds: ImdsEmulator, tmp_path: Path) -> None:
    boot(tmp_path, time.time() - 3600)
    with running(imds, tmp_path):
        reboot = imds.create_event(EventType="Reboot", Resources=["web_0"], NoticeSeconds=900)
        wait_for(lambda: listed(tmp_path, reboot["EventId"]), what="the Reboot forwarded")
        time.sleep(0.5)
        down = datetime.now(UTC)
    envelope, booted, up = up_after_a_reboot(imds, tmp_path)
    impact = Envelope.from_mapping(envelope).impact
    assert impact is not None
    assert (impact.eventId, impact.eventType, impact.measure, impact.clock) == (
        reboot["EventId"],
        "Reboot",
        "restart",
        "wall",
    )
    assert impact.bootTime == datetime.fromtimestamp(int(booted), UTC)
    # From its last poll (within a poll of the stop) to its first poll after the start.
    assert (down - impact.start).total_seconds() <= 0.2 + 0.1
    assert impact.end <= up
    assert 1.5 <= impact.measuredSeconds <= (up - impact.start).total_seconds()


def test_a_forwarder_restart_without_a_reboot_reports_nothing(imds: ImdsEmulator, tmp_path: Path) -> None:
    boot(tmp_path, time.time() - 3600)
    with running(imds, tmp_path):
        reboot = imds.create_event(EventType="Redeploy", Resources=["web_0"], NoticeSeconds=900)
        wait_for(lambda: listed(tmp_path, reboot["EventId"]), what="the Redeploy forwarded")
    with running(imds, tmp_path):  # same boot time: only the forwarder restarted
        wait_for(lambda: len(envelopes(tmp_path, "heartbeat")) >= 2, what="the second start")
        time.sleep(1.0)
    assert envelopes(tmp_path, "impact") == []


def test_a_reboot_never_seen_listed_is_measured_from_the_last_sign_of_life(imds: ImdsEmulator, tmp_path: Path) -> None:
    """A Reboot approved by a peer (or at once) and started between two polls: the forwarder never saw it listed
    and kept no watch. Its clean stop kept the last poll's time; after the boot the first document lists the Reboot
    as Started, and that names the downtime's event. A second start on the same boot reports nothing more."""
    boot(tmp_path, time.time() - 3600)
    with running(imds, tmp_path):
        wait_for(lambda: envelopes(tmp_path, "heartbeat"), what="the forwarder up")
        time.sleep(0.5)  # a few polls
        down = datetime.now(UTC)
    reboot = imds.create_event(EventType="Reboot", Resources=["web_0"], EventStatus="Started", DurationInSeconds=-1)
    envelope, booted, up = up_after_a_reboot(imds, tmp_path)
    impact = Envelope.from_mapping(envelope).impact
    assert impact is not None
    assert (impact.eventId, impact.eventType, impact.measure) == (reboot["EventId"], "Reboot", "restart")
    assert impact.bootTime == datetime.fromtimestamp(int(booted), UTC)
    assert (down - impact.start).total_seconds() <= 0.2 + 0.1  # the last poll before the stop
    assert 1.5 <= impact.measuredSeconds <= (up - impact.start).total_seconds()
    with running(imds, tmp_path):  # the same boot, the Reboot still listed: measured once
        wait_for(lambda: len(envelopes(tmp_path, "heartbeat")) >= 3, what="the third start")
        time.sleep(1.0)
    assert len(envelopes(tmp_path, "impact")) == 1


def test_a_reboot_of_the_guests_own_reports_nothing(imds: ImdsEmulator, tmp_path: Path) -> None:
    """The VM booted after its last sign of life but its first document lists no Started Reboot or Redeploy of it
    (a reboot from inside the guest, or an event still only Scheduled): no event to name, no report."""
    boot(tmp_path, time.time() - 3600)
    with running(imds, tmp_path):
        wait_for(lambda: envelopes(tmp_path, "heartbeat"), what="the forwarder up")
        time.sleep(0.5)
    imds.create_event(EventType="Reboot", Resources=["web_0"], NoticeSeconds=900)  # Scheduled, not what rebooted it
    boot(tmp_path, time.time() + 1)
    with running(imds, tmp_path):
        wait_for(lambda: len(envelopes(tmp_path, "incarnation")) >= 2, what="the Reboot forwarded")
        time.sleep(1.0)
    assert envelopes(tmp_path, "impact") == []


def test_the_boot_time_is_read_from_proc_stat_or_a_file_like_it(tmp_path: Path) -> None:
    real = read_boot_time(Path("/proc/stat"))
    assert real is not None
    assert real < datetime.now(UTC)
    boot(tmp_path, 1_800_000_000)
    assert read_boot_time(tmp_path / "stat") == datetime.fromtimestamp(1_800_000_000, UTC)
    assert read_boot_time(tmp_path / "missing") is None


VM = VmIdentity(name="web_0", vmId="00000000-0000-0000-0000-000000000001", resourceId="/vm/web_0")
# A Freeze of web_0 as its forwarder first sees it: already Started.
STARTED_FREEZE = ScheduledEventsDocument.from_mapping(
    {
        "DocumentIncarnation": 2,
        "Events": [
            {
                "EventId": "F1", "EventType": "Freeze", "ResourceType": "VirtualMachine", "Resources": ["web_0"],
                "EventStatus": "Started", "NotBefore": "", "Description": "", "EventSource": "Platform",
                "DurationInSeconds": 1,
            }
        ],
    }
)  # fmt: skip


def meter_on(store: Store, tmp_path: Path) -> ImpactMeter:
    """A meter whose tick thread does not run: only the poll loop's calls read the clocks."""
    parts = WorkerParts(store=store, tracer=IdTracer(), counters={}, spooled=lambda: None)
    return ImpactMeter(parts, tick=0.1, boot_time_file=tmp_path / "stat", stop=threading.Event())


def spooled_pause(store: Store) -> float:
    (spooled,) = store.peek(10)
    report = Envelope.from_json_bytes(spooled.body).impact
    assert report is not None
    assert (report.eventId, report.measure) == ("F1", "pause")
    return report.measuredSeconds


def test_a_pause_right_after_the_poll_that_lists_the_freeze_is_measured(tmp_path: Path) -> None:
    """A Freeze approved at once starts within the poll that listed it: the VM may be paused before the tick thread
    has read the clocks even once. The poll is the sign of life the pause is measured from."""
    store = Store(tmp_path / "state.db")
    meter = meter_on(store, tmp_path)
    meter.polled(STARTED_FREEZE, VM)
    time.sleep(0.8)  # paused before any tick (the tick thread is not even running here)
    meter.before_poll(VM)
    assert 0.6 <= spooled_pause(store) <= 1.0


def test_a_pause_before_the_freeze_was_first_seen_is_measured_from_the_late_poll(tmp_path: Path) -> None:
    """A peer approved the Freeze at once: this VM was paused before its forwarder ever saw it listed, and its
    first sight of it is Started. The poll due during the pause starts late by the pause: that lateness is its
    measure."""
    store = Store(tmp_path / "state.db")
    meter = meter_on(store, tmp_path)
    due = time.monotonic()
    time.sleep(0.8)  # the poll due now runs 0.8 s late: the process was stopped
    meter.before_poll(VM, due=due)
    meter.polled(STARTED_FREEZE, VM)
    meter.before_poll(VM, due=time.monotonic())  # the next poll, on time, spools it
    assert 0.6 <= spooled_pause(store) <= 1.0
    # On time, a poll's lateness is no pause: a Freeze first seen Started then reports none from it.
    quiet_store = Store(tmp_path / "quiet.db")
    quiet = meter_on(quiet_store, tmp_path)
    quiet.before_poll(VM, due=time.monotonic())
    quiet.polled(STARTED_FREEZE, VM)
    quiet.before_poll(VM, due=time.monotonic())
    assert quiet_store.peek(10) == []


def test_a_measure_beyond_a_week_is_a_clock_that_stepped_and_is_not_reported(tmp_path: Path) -> None:
    """The contract bounds every figure of seconds to a week (contracts.envelope.MAX_SECONDS): a restart whose last
    poll the wall clock puts 8 days back is not an event's downtime. The meter reports nothing, and goes on; an
    announced DurationInSeconds the contract cannot carry is sent as not announced (-1)."""
    store = Store(tmp_path / "state.db")
    now = datetime.now(UTC)
    for name, days, announced in (("R-LATE", 8, 30), ("R-SAID", 0, 10**9)):
        store.put_state(
            IMPACT_RESTART,
            json.dumps(
                {
                    "eventId": name,
                    "eventType": "Reboot",
                    "announced": announced,
                    "lastPollAt": (now - timedelta(days=days, seconds=5)).isoformat(),
                }
            ),
        )
        boot(tmp_path, now.timestamp() - 1)
        meter_on(store, tmp_path).before_poll(VM)
        assert store.get_state(IMPACT_RESTART) == ""  # the watch ends either way: the next start reports nothing
    (spooled,) = store.peek(10)
    report = Envelope.from_json_bytes(spooled.body).impact
    assert report is not None
    assert (report.eventId, report.announcedSeconds) == ("R-SAID", -1)
    assert 4 <= report.measuredSeconds <= 60
