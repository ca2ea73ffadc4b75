"""Local prepare/recover hooks: executables in `{hooks_dir}/prepare.d` and `{hooks_dir}/recover.d`, run in name
order with the event as JSON on stdin and as SCHEDULED_EVENT_* environment variables, each within its budget.

A hook's budget is the time left to the event's NotBefore less a margin, at most the configured maximum (a recover
phase, or an event already Started, has the maximum). At the budget the hook's process group gets SIGTERM, and
SIGKILL after a grace; the budget is counted so that the KILL lands the margin before NotBefore: a hook that runs
past NotBefore cannot happen, whatever it does with the TERM. A force hook (`{hooks_dir}/force.d/NAME`, named by an
approval request) runs alone, through `run_hook`, within the bound forwarder/force.py gives it.

Only the runner lives here; which events need hooks is decided in forwarder/changes.py, and the once-per-event
ledger is kept in forwarder/durable_state.py.
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
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

from contracts.wire import (
    MAX_HOOK_STEPS,
    STEP_OUTPUT_TAIL,
    HookOutcome,
    HookPhase,
    HookReport,
    HookStep,
    ScheduledEvent,
    phase_outcome,
)
from forwarder.logs import fields

log = logging.getLogger("forwarder.hooks")

OUTPUT_TAIL = 2048
# What a hook inherits from the forwarder's environment; nothing else (in particular no SE_FORWARDER_* settings).
_INHERITED = ("PATH", "LANG", "LC_ALL", "TZ", "HOME")


def hook_environment(
    event: ScheduledEvent, *, phase: HookPhase, vm_name: str, budget: float, deadline: datetime
) -> dict[str, str]:
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
        # What the hook has: SIGTERM comes after BUDGET_SECONDS, at DEADLINE (UTC, ISO 8601), SIGKILL a grace later.
        SCHEDULED_EVENT_BUDGET_SECONDS=f"{budget:.3f}",
        SCHEDULED_EVENT_DEADLINE=deadline.isoformat(timespec="milliseconds"),
        VM_NAME=vm_name,
    )
    return env


def phase_deadline(
    event: ScheduledEvent, phase: HookPhase, *, now: datetime, monotonic: float, margin: float, grace: float
) -> float | None:
    """The monotonic time by which a phase's last hook must have been sent SIGTERM: NotBefore less the margin and
    the grace (so that its SIGKILL, a grace later, still lands the margin before NotBefore). None when the phase
    has no NotBefore to keep (recover, or an event already Started): then only the maximum bounds each hook. The
    wall clock is read once, here; from then on the monotonic clock counts, so a clock step cannot stretch it."""
    not_before = event.not_before() if phase == "prepare" else None
    if not_before is None:
        return None
    return monotonic + (not_before - now).total_seconds() - margin - grace


def phase_report(
    event_id: str,
    phase: HookPhase,
    steps: Sequence[HookStep],
    *,
    tails: Sequence[str] = (),
    tail: str = "",
) -> HookReport:
    """The one report of a phase: its outcome over every step (`phase_outcome`), the first hook that did not
    succeed, and that hook's (else the last hook's) exit code and output. `tails` are the steps' longer outputs,
    in the same order; `tail` is the output when there is no step to show."""
    failed = next((i for i, s in enumerate(steps) if s.outcome != "succeeded"), None)
    shown = failed if failed is not None else len(steps) - 1
    if shown >= 0:
        tail = tails[shown] if shown < len(tails) else steps[shown].outputTail
    budget = steps[0].budgetSeconds if steps else None
    duration = round(sum(s.durationSeconds for s in steps), 3)
    return HookReport(
        eventId=event_id,
        phase=phase,
        outcome=phase_outcome(list(steps)),
        hook=steps[failed].hook if failed is not None else "",
        durationSeconds=duration,
        exitCode=steps[shown].exitCode if shown >= 0 else None,
        outputTail=tail[-OUTPUT_TAIL:],
        steps=list(steps),
        budgetSeconds=budget,
        budgetUsed=budget_used(duration, budget),
    )


def budget_used(duration: float, budget: float | None) -> float | None:
    """The share of its budget a hook (or a phase) used; None without a budget."""
    if budget is None:
        return None
    return round(duration / budget, 3) if budget > 0 else (0.0 if duration <= 0 else 1.0)


class HookRunner:
    """Runs one phase's hooks for one event, sequentially; `stop()` kills a running hook (on shutdown).

    ``timeout`` is the most any hook is given; ``margin`` how long before NotBefore every hook of a prepare phase
    must be gone; ``grace`` the time between a hook's SIGTERM and its SIGKILL."""

    def __init__(self, *, hooks_dir: Path, timeout: float, margin: float = 5.0, grace: float = 3.0) -> None:
        self.hooks_dir = hooks_dir
        self.timeout = timeout
        self.margin = margin
        self.grace = grace
        self._lock = threading.Lock()
        # The hooks running now: a prepare or recover phase's (the hook worker) and force hooks (forwarder/force.py).
        self._current: set[subprocess.Popen[bytes]] = set()
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

    def run(
        self,
        event: ScheduledEvent,
        *,
        phase: HookPhase,
        vm_name: str,
        on_step: Callable[[str, tuple[HookStep, ...]], None] | None = None,
    ) -> HookReport:
        """Run every hook of the phase in name order and give ONE report for the phase (`phase_report`).

        A failing hook does not stop the phase, like run-parts without --exit-on-error: the hooks are independent
        steps (drain the load balancer, checkpoint, flush), the maintenance may go ahead at NotBefore whatever
        they say, and a VM is better prepared with every step that can succeed than with the first failure
        only. The phase still fails if any hook did not succeed. `on_step(hook, finished_steps)` is called
        before each hook starts, so the ledger can name the hook a crash interrupted.
        """
        folder = self.hooks_dir / f"{phase}.d"
        hooks = self.executables(phase)
        if not hooks:
            # A phase without hooks is "not-run" (steps=[]), so the coordinator can tell "nothing to prepare"
            # from "the VM never answered"; the policy says what it means.
            return phase_report(event.EventId, phase, (), tail=f"no executable hooks in {folder}")
        if len(hooks) > MAX_HOOK_STEPS:
            # The report could not list them all, and a phase whose report hides a step is not a phase anyone can
            # trust: fail it without running anything, and say why.
            reason = f"not run: {folder} holds {len(hooks)} executables, more than the {MAX_HOOK_STEPS} allowed"
            log.error("too many hooks", extra=fields(event_id=event.EventId, phase=phase, hooks=len(hooks)))
            step = HookStep(hook=f"{phase}.d", outcome="failed", durationSeconds=0.0, outputTail=reason)
            return phase_report(event.EventId, phase, (step,))
        stdin = json.dumps(event.to_mapping()).encode("utf-8")
        deadline = phase_deadline(
            event, phase, now=datetime.now(UTC), monotonic=time.monotonic(), margin=self.margin, grace=self.grace
        )
        steps: list[HookStep] = []
        tails: list[str] = []
        for path in hooks:
            if on_step is not None:
                on_step(path.name, tuple(steps))
            step, tail = self._run_one(path, event, phase=phase, stdin=stdin, vm_name=vm_name, deadline=deadline)
            steps.append(step)
            tails.append(tail)
        report = phase_report(event.EventId, phase, steps, tails=tails)
        level = logging.INFO if report.outcome == "succeeded" else logging.WARNING
        log.log(
            level,
            "hook phase finished",
            extra=fields(
                event_id=event.EventId,
                phase=phase,
                outcome=report.outcome,
                failed_hook=report.hook,
                hooks=[s.hook for s in steps],
                duration_s=report.durationSeconds,
            ),
        )
        return report

    def run_hook(
        self, path: Path, event: ScheduledEvent, *, phase: HookPhase, vm_name: str, deadline: float
    ) -> HookReport:
        """One named hook (a force hook, forwarder/force.py) as its phase's one step: SIGTERM at ``deadline``
        (monotonic) or after ``timeout``, whichever comes first, SIGKILL a grace later."""
        stdin = json.dumps(event.to_mapping()).encode("utf-8")
        step, tail = self._run_one(path, event, phase=phase, stdin=stdin, vm_name=vm_name, deadline=deadline)
        return phase_report(event.EventId, phase, (step,), tails=(tail,))

    def _run_one(
        self,
        path: Path,
        event: ScheduledEvent,
        *,
        phase: HookPhase,
        stdin: bytes,
        vm_name: str,
        deadline: float | None,
    ) -> tuple[HookStep, str]:
        """One hook within its budget: its step, and the last OUTPUT_TAIL characters of its output (the step keeps
        less)."""
        started = time.monotonic()
        budget = self.timeout if deadline is None else max(0.0, min(self.timeout, deadline - started))
        with self._lock:
            if self._stopping.is_set():
                return self._step(
                    event, phase, path, "failed", duration=0.0, exit_code=None, tail="not started: stopping"
                )
            if budget <= 0:
                # Too close to NotBefore for this hook to end in time: starting it would be the one way to run past.
                return self._step(
                    event,
                    phase,
                    path,
                    "timed-out",
                    duration=0.0,
                    exit_code=None,
                    tail="not started: no time left before NotBefore (less its margin and grace)",
                    budget=0.0,
                )
            env = hook_environment(
                event,
                phase=phase,
                vm_name=vm_name,
                budget=budget,
                deadline=datetime.now(UTC) + timedelta(seconds=budget),
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
                return self._step(
                    event, phase, path, "failed", duration=0.0, exit_code=None, tail=f"cannot start: {exc}"
                )
            self._current.add(process)
        timed_out = killed = False
        try:
            output, _ = process.communicate(stdin, timeout=budget)
        except subprocess.TimeoutExpired:
            timed_out = True
            self._signal(process, signal.SIGTERM)
            try:
                output, _ = process.communicate(timeout=self.grace)
            except subprocess.TimeoutExpired:
                killed = True
                self._kill(process)
                output, _ = process.communicate()
        finally:
            with self._lock:
                self._current.discard(process)
        duration = time.monotonic() - started
        tail = output[-OUTPUT_TAIL:].decode("utf-8", errors="replace")
        outcome: HookOutcome
        if timed_out:
            outcome = "timed-out"
            how = f"SIGKILL {self.grace:g} s later" if killed else "it ended on SIGTERM"
            tail = (tail + f"\n[stopped at its budget of {budget:.1f} s: SIGTERM, {how}]").lstrip("\n")
        elif self._stopping.is_set() and process.returncode < 0:
            outcome = "failed"
            tail = (tail + "\n[killed: forwarder stopped while the hook ran]").lstrip("\n")
        else:
            outcome = "succeeded" if process.returncode == 0 else "failed"
        return self._step(
            event, phase, path, outcome, duration=duration, exit_code=process.returncode, tail=tail, budget=budget
        )

    @staticmethod
    def _step(
        event: ScheduledEvent,
        phase: HookPhase,
        path: Path,
        outcome: HookOutcome,
        *,
        duration: float,
        exit_code: int | None,
        tail: str,
        budget: float | None = None,
    ) -> tuple[HookStep, str]:
        tail = tail[-OUTPUT_TAIL:]
        step = HookStep(
            hook=path.name,
            outcome=outcome,
            durationSeconds=round(duration, 3),
            exitCode=exit_code,
            outputTail=tail[-STEP_OUTPUT_TAIL:],
            budgetSeconds=None if budget is None else round(budget, 3),
            budgetUsed=budget_used(duration, budget),
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
                duration_s=step.durationSeconds,
                budget_s=step.budgetSeconds,
            ),
        )
        return step, tail

    @staticmethod
    def _signal(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
        """``sig`` to the hook's whole session (its children too)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)

    @classmethod
    def _kill(cls, process: subprocess.Popen[bytes]) -> None:
        cls._signal(process, signal.SIGKILL)

    def stop(self) -> None:
        with self._lock:
            self._stopping.set()
            for process in self._current:
                self._kill(process)
