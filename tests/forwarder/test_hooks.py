"""Hooks within their budgets (forwarder/hooks.py): each hook is told its event and its budget, the time to
NotBefore less the margin and the grace, at most the configured maximum; it is stopped at the budget (SIGTERM, then
SIGKILL after the grace), so no hook of a prepare phase outlives NotBefore. Real processes, real signals."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from contracts.wire import ScheduledEvent
from forwarder.hooks import HookRunner

# The local stack's time scale: Azure's 30 s of a Preempt's notice and 10 minutes of a Terminate's, in real seconds.
TIME_SCALE = 60.0


def event(event_type: str, notice: float, *, status: str = "Scheduled") -> ScheduledEvent:
    not_before = datetime.now(UTC) + timedelta(seconds=notice)
    return ScheduledEvent.from_mapping(
        {
            "EventId": f"{event_type}-1",
            "EventType": event_type,
            "ResourceType": "VirtualMachine",
            "Resources": ["web_0"],
            "EventStatus": status,
            "NotBefore": "" if status == "Started" else not_before.strftime("%a, %d %b %Y %H:%M:%S GMT"),
            "Description": "",
            "EventSource": "Platform",
            "DurationInSeconds": -1,
        }
    )


def install(tmp_path: Path, phase: str, name: str, script: str) -> Path:
    folder = tmp_path / f"{phase}.d"
    folder.mkdir(parents=True, exist_ok=True)
    hook = folder / name
    hook.write_text("#!/bin/sh\n" + script, encoding="utf-8")
    hook.chmod(0o755)
    return hook


# Prints what it was told, then holds on through SIGTERM: only the SIGKILL ends it.
STUBBORN = (
    'echo "$SCHEDULED_EVENT_ID $SCHEDULED_EVENT_TYPE $SCHEDULED_EVENT_BUDGET_SECONDS $SCHEDULED_EVENT_DEADLINE"\n'
    "trap 'echo got TERM' TERM\nwhile true; do sleep 0.05; done\n"
)


def test_a_preempts_hook_is_stopped_within_its_budget_before_not_before(tmp_path: Path) -> None:
    # 30 s of notice is whole seconds at the time scale: NotBefore's resolution; 4 s keeps the arithmetic clear.
    notice = max(30 / TIME_SCALE, 4.0)
    install(tmp_path, "prepare", "10-checkpoint", STUBBORN)
    runner = HookRunner(hooks_dir=tmp_path, timeout=120, margin=0.5, grace=0.5)
    preempt = event("Preempt", notice)
    started = time.monotonic()
    report = runner.run(preempt, phase="prepare", vm_name="web_0")
    ended = time.monotonic()
    step = report.steps[0] if report.steps else None
    assert step is not None
    assert step.outcome == "timed-out"
    assert report.outcome == "timed-out"
    told = step.outputTail.splitlines()[0].split()
    assert told[:2] == ["Preempt-1", "Preempt"]
    budget = float(told[2])
    # NotBefore is whole seconds (RFC 1123): the budget is the notice less margin and grace, within that second.
    assert notice - 1 - 1.0 <= budget <= notice - 1.0
    assert step.budgetSeconds == round(budget, 3)
    assert step.budgetUsed is not None
    assert step.budgetUsed >= 1.0
    assert report.budgetSeconds == step.budgetSeconds
    assert "got TERM" in step.outputTail
    assert "SIGKILL 0.5 s later" in step.outputTail
    # Killed a grace after its budget, so gone the margin before NotBefore.
    assert ended - started <= budget + 0.5 + 0.3
    not_before = preempt.not_before()
    assert not_before is not None
    assert datetime.now(UTC) <= not_before - timedelta(seconds=0.5) + timedelta(seconds=0.2)


def test_a_hook_that_ends_on_sigterm_is_not_killed(tmp_path: Path) -> None:
    install(tmp_path, "prepare", "10-drain", "trap 'echo drained; exit 0' TERM\nwhile true; do sleep 0.05; done\n")
    runner = HookRunner(hooks_dir=tmp_path, timeout=1.0, margin=0.1, grace=5.0)
    started = time.monotonic()
    report = runner.run(event("Freeze", 600), phase="prepare", vm_name="web_0")
    assert time.monotonic() - started < 3.0  # the grace of 5 s was not waited out
    step = report.steps[0] if report.steps else None
    assert step is not None
    assert step.outcome == "timed-out"
    assert step.budgetSeconds == 1.0  # the maximum: NotBefore is far
    assert "drained" in step.outputTail
    assert "it ended on SIGTERM" in step.outputTail


def test_a_terminates_hook_gets_its_minutes(tmp_path: Path) -> None:
    # Ten minutes of notice at the local stack's time scale: 10 s. The stack's maximum is 30 s.
    notice = 600 / TIME_SCALE
    install(tmp_path, "prepare", "10-drain", 'echo "$SCHEDULED_EVENT_BUDGET_SECONDS"\nsleep 2\n')
    runner = HookRunner(hooks_dir=tmp_path, timeout=30, margin=5 / TIME_SCALE, grace=3 / TIME_SCALE)
    report = runner.run(event("Terminate", notice), phase="prepare", vm_name="web_0")
    step = report.steps[0] if report.steps else None
    assert step is not None
    assert step.outcome == "succeeded"
    budget = float(step.outputTail.split()[0])
    assert notice - 1 - 0.2 <= budget <= notice  # the notice less 0.13 s, within NotBefore's second
    assert step.budgetUsed is not None
    assert 0.15 < step.budgetUsed < 0.3


def test_recover_and_started_events_get_the_maximum(tmp_path: Path) -> None:
    for phase in ("prepare", "recover"):
        install(tmp_path, phase, "10-say", 'echo "$SCHEDULED_EVENT_BUDGET_SECONDS"\n')
    runner = HookRunner(hooks_dir=tmp_path, timeout=7, margin=1, grace=1)
    near = event("Reboot", 3)
    started = event("Reboot", 0, status="Started")
    for report in (
        runner.run(near, phase="recover", vm_name="web_0"),
        runner.run(started, phase="prepare", vm_name="web_0"),
    ):
        assert report.steps is not None
        assert report.steps[0].outputTail.strip() == "7.000"


def test_a_hook_with_no_time_left_is_not_started(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    install(tmp_path, "prepare", "10-first", "sleep 0.1\n")
    install(tmp_path, "prepare", "20-late", f"touch {marker}\n")
    runner = HookRunner(hooks_dir=tmp_path, timeout=60, margin=2.5, grace=0.5)
    report = runner.run(event("Preempt", 2), phase="prepare", vm_name="web_0")
    assert report.steps is not None
    assert [s.outcome for s in report.steps] == ["timed-out", "timed-out"]
    assert all(s.budgetSeconds == 0.0 and "not started" in s.outputTail for s in report.steps)
    assert not marker.exists()
