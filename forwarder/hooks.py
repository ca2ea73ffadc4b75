"""Local prepare/recover hooks: executables in `{hooks_dir}/prepare.d` and `{hooks_dir}/recover.d`, run in name
order with the event as JSON on stdin and as SCHEDULED_EVENT_* environment variables, each under a timeout.

Only the runner lives here; which events need hooks is decided in forwarder/changes.py, and the once-per-event
ledger is kept in forwarder/store.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from forwarder.document import ScheduledEvent
from forwarder.envelope import HookPhase, HookReport
from forwarder.logs import fields

log = logging.getLogger("forwarder.hooks")

OUTPUT_TAIL = 2048
# What a hook inherits from the forwarder's environment; nothing else (in particular no SE_FORWARDER_* settings).
_INHERITED = ("PATH", "LANG", "LC_ALL", "TZ", "HOME")


def hook_environment(event: ScheduledEvent, *, phase: HookPhase, vm_name: str) -> dict[str, str]:
    env = {k: os.environ[k] for k in _INHERITED if k in os.environ}
    env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    env.update(
        SCHEDULED_EVENT_ID=event.EventId,
        SCHEDULED_EVENT_TYPE=event.EventType,
        SCHEDULED_EVENT_STATUS=event.EventStatus,
        SCHEDULED_EVENT_NOT_BEFORE=event.NotBefore,
        SCHEDULED_EVENT_DURATION=str(event.DurationInSeconds),
        SCHEDULED_EVENT_SOURCE=event.EventSource,
        SCHEDULED_EVENT_RESOURCES=",".join(event.Resources),
        SCHEDULED_EVENT_DESCRIPTION=event.Description,
        SCHEDULED_EVENT_PHASE=phase,
        VM_NAME=vm_name,
    )
    return env


class HookRunner:
    """Runs one phase's hooks for one event, sequentially; `stop()` kills a running hook (on shutdown)."""

    def __init__(self, *, hooks_dir: Path, timeout: float) -> None:
        self.hooks_dir = hooks_dir
        self.timeout = timeout
        self._lock = threading.Lock()
        self._current: subprocess.Popen[bytes] | None = None
        self._stopping = threading.Event()

    def executables(self, phase: HookPhase) -> list[Path]:
        folder = self.hooks_dir / f"{phase}.d"
        try:
            entries = sorted(folder.iterdir(), key=lambda p: p.name)
        except FileNotFoundError:
            return []
        # Like run-parts: skip editor leftovers and anything not executable (a README beside the hooks).
        return [
            p
            for p in entries
            if p.is_file() and os.access(p, os.X_OK) and not p.name.startswith(".") and not p.name.endswith("~")
        ]

    def run(self, event: ScheduledEvent, *, phase: HookPhase, vm_name: str) -> list[HookReport]:
        """One report per hook; a single "not-run" report when the phase has no hooks (so the coordinator can
        tell "nothing to prepare" from "the VM never answered")."""
        hooks = self.executables(phase)
        if not hooks:
            return [
                HookReport(
                    eventId=event.EventId,
                    phase=phase,
                    outcome="not-run",
                    durationSeconds=0.0,
                    outputTail=f"no executable hooks in {self.hooks_dir / (phase + '.d')}",
                )
            ]
        stdin = json.dumps(event.model_dump(mode="json")).encode("utf-8")
        env = hook_environment(event, phase=phase, vm_name=vm_name)
        return [self._run_one(path, event, phase=phase, stdin=stdin, env=env) for path in hooks]

    def _run_one(
        self, path: Path, event: ScheduledEvent, *, phase: HookPhase, stdin: bytes, env: dict[str, str]
    ) -> HookReport:
        started = time.monotonic()
        with self._lock:
            if self._stopping.is_set():
                return self._report(
                    event, phase, path, "failed", duration=0.0, exit_code=None, tail="not started: stopping"
                )
            try:
                # A session of its own, so that a timeout kills the hook's children too.
                process = subprocess.Popen(  # noqa: S603 - the operator's own executables from the hooks folder
                    [str(path)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd="/",
                    start_new_session=True,
                )
            except OSError as exc:
                return self._report(
                    event, phase, path, "failed", duration=0.0, exit_code=None, tail=f"cannot start: {exc}"
                )
            self._current = process
        timed_out = False
        try:
            output, _ = process.communicate(stdin, timeout=self.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            self._kill(process)
            output, _ = process.communicate()
        finally:
            with self._lock:
                self._current = None
        duration = time.monotonic() - started
        tail = output[-OUTPUT_TAIL:].decode("utf-8", errors="replace")
        if timed_out:
            outcome = "timed-out"
            tail = (tail + f"\n[killed after {self.timeout:g} s]").lstrip("\n")
        elif self._stopping.is_set() and process.returncode < 0:
            outcome = "failed"
            tail = (tail + "\n[killed: forwarder stopped while the hook ran]").lstrip("\n")
        else:
            outcome = "succeeded" if process.returncode == 0 else "failed"
        return self._report(event, phase, path, outcome, duration=duration, exit_code=process.returncode, tail=tail)

    @staticmethod
    def _report(
        event: ScheduledEvent,
        phase: HookPhase,
        path: Path,
        outcome: str,
        *,
        duration: float,
        exit_code: int | None,
        tail: str,
    ) -> HookReport:
        report = HookReport.model_validate(
            {
                "eventId": event.EventId,
                "phase": phase,
                "outcome": outcome,
                "hook": path.name,
                "durationSeconds": round(duration, 3),
                "exitCode": exit_code,
                "outputTail": tail[-OUTPUT_TAIL:],
            }
        )
        level = logging.INFO if outcome == "succeeded" else logging.WARNING
        log.log(
            level,
            "hook finished",
            extra=fields(
                event_id=event.EventId,
                phase=phase,
                hook=path.name,
                outcome=outcome,
                exit_code=exit_code,
                duration_s=report.durationSeconds,
            ),
        )
        return report

    @staticmethod
    def _kill(process: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)

    def stop(self) -> None:
        with self._lock:
            self._stopping.set()
            if self._current is not None:
                self._kill(self._current)
