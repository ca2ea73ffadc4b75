"""Force hooks: the VM's half of an escalation ladder's last step.

An approval request whose ``facts.forceHook`` names a hook says: "shortly before NotBefore, run your own installed
hook of this name first (a forced drain, say), then StartRequests". The coordinator only names it: the VM runs
``{hooks_dir}/force.d/NAME`` (the forwarder's hooks folder, beside prepare.d/ and recover.d/) if it is installed and
executable here, and nothing else. The approver (forwarder/approver.py) judges such a request as any other, answers
"accepted" and records the decision "forcing"; this module runs the hook on a thread of its own (never the relay
listener's or the poll loop's), through the daemon's ``HookRunner`` (the event as JSON on stdin, SCHEDULED_EVENT_*
with SCHEDULED_EVENT_PHASE=force, its session TERMed then KILLed), reports it as one ``hook`` envelope of phase
"force" (its one step), and hands its report back to the approver, which judges again on a fresh document before
any StartRequests.

The bound (``force_deadline``): the hook's SIGKILL lands before the earlier of the request's last instant (its
deadline less the clock tolerance, less ``post_reserve`` for the fresh read and the POST) and the event's NotBefore
less the hook margin; at most ``hook_timeout``. A force hook may run again for one decision (after a restart, or a
repeat once it was refused), so it must be idempotent, as prepare hooks are.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

from contracts.wire import HOOK_NAME, ApprovalRequest, HookReport, HookStep, ScheduledEvent, VmIdentity
from forwarder.durable_state import StoreFull
from forwarder.envelopes import envelope_of
from forwarder.hooks import HookRunner, phase_report
from forwarder.logs import fields
from forwarder.retry import Backoff
from forwarder.telemetry import IdTracer, SpanContext, current, traceparent, use_span
from forwarder.worker_parts import WorkerParts

__all__ = ["FORCE_DIR", "FORCE_POST_RESERVE", "ForceHooks", "force_deadline", "hook_failure"]

log = logging.getLogger("forwarder.force")

FORCE_DIR = "force.d"
# Seconds kept between the hook's SIGKILL and the request's last instant: the fresh read and the StartRequests POST
# (each a few hundred ms through IMDS's limiter).
FORCE_POST_RESERVE = 2.0
_NAME = re.compile(HOOK_NAME)  # the contract's: checked again here, the name becomes a path


def force_deadline(
    approval: ApprovalRequest,
    event: ScheduledEvent,
    *,
    now: datetime,
    monotonic: float,
    tolerance: timedelta,
    margin: float,
    grace: float,
    reserve: float = FORCE_POST_RESERVE,
) -> float:
    """The monotonic time of the force hook's SIGTERM, so that its SIGKILL, ``grace`` later, lands before the
    earlier of (the request's deadline - ``tolerance`` - ``reserve``) and (NotBefore - ``margin``). The wall clock
    (``now``) is read once; from ``monotonic`` on, a clock step cannot stretch it."""
    kill_by = approval.deadline - tolerance - timedelta(seconds=reserve)
    not_before = event.not_before()
    if not_before is not None:
        kill_by = min(kill_by, not_before - timedelta(seconds=margin))
    return monotonic + (kill_by - now).total_seconds() - grace


def hook_failure(name: str, report: HookReport) -> str:
    """Why the force hook's run forbids StartRequests, e.g. "force hook drain failed (exit 1)"."""
    step = report.steps[0] if report.steps else None
    if step is None:
        return f"force hook {name} did not run: {report.outputTail}"
    said = (step.outputTail.strip().splitlines() or [""])[-1].strip("[]")
    if step.outcome == "timed-out":
        return f"force hook {name} timed out ({said})"
    if step.exitCode is not None and step.exitCode >= 0:
        return f"force hook {name} failed (exit {step.exitCode})"
    if step.exitCode is not None:
        return f"force hook {name} failed (signal {-step.exitCode}; {said})"
    return f"force hook {name} failed ({said})"


class ForceHooks:
    """This VM's force hooks, each run on a thread of its own and reported as a ``hook`` envelope (phase "force").

    ``runner``: the daemon's (its hooks folder, ``hook_timeout``, margin and grace; its ``stop()`` kills a running
    force hook too). ``parts``: where the report is spooled (the daemon's store and sender); without it (tests)
    nothing is reported. ``stop``: the daemon's, which ends a report's wait for room on a full disk."""

    def __init__(
        self,
        runner: HookRunner,
        *,
        identity: VmIdentity,
        parts: WorkerParts | None = None,
        stop: threading.Event | None = None,
        post_reserve: float = FORCE_POST_RESERVE,
    ) -> None:
        self.runner = runner
        self.identity = identity
        self.post_reserve = post_reserve
        self._parts = parts
        self._stop = stop or threading.Event()
        self._tracer = parts.tracer if parts is not None else IdTracer()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    @property
    def folder(self) -> Path:
        return self.runner.hooks_dir / FORCE_DIR

    def installed(self, name: str) -> Path | None:
        """``force.d/NAME`` when it is an executable file here; None otherwise."""
        path = self.folder / name
        if _NAME.fullmatch(name) and path.is_file() and os.access(path, os.X_OK):
            return path
        return None

    def deadline(
        self, approval: ApprovalRequest, event: ScheduledEvent, *, now: datetime, tolerance: timedelta
    ) -> float:
        """``force_deadline`` with the runner's margin and grace."""
        return force_deadline(
            approval,
            event,
            now=now,
            monotonic=time.monotonic(),
            tolerance=tolerance,
            margin=self.runner.margin,
            grace=self.runner.grace,
            reserve=self.post_reserve,
        )

    def start(self, path: Path, event: ScheduledEvent, *, deadline: float, then: Callable[[HookReport], None]) -> None:
        """Runs the hook on its own thread, SIGTERM at ``deadline`` (monotonic); then ``then(report)`` (the
        approver's second judgement), then the report is spooled. The span joins the caller's trace."""
        context = current()
        thread = threading.Thread(
            target=self._run, args=(path, event, deadline, then, context), name="forwarder-force", daemon=True
        )
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def join(self, timeout: float) -> None:
        """Waits for the force hooks' threads (the daemon's stop, after ``runner.stop()`` killed their hooks)."""
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout)

    def _run(
        self,
        path: Path,
        event: ScheduledEvent,
        deadline: float,
        then: Callable[[HookReport], None],
        context: SpanContext,
    ) -> None:
        span = self._tracer.start_span(
            "forwarder.hooks",
            parent=context,
            attributes={
                "vm.name": self.identity.name,
                "scheduled_events.event_id": event.EventId,
                "scheduled_events.hook_phase": "force",
            },
        )
        with use_span(span):
            try:
                report = self.runner.run_hook(path, event, phase="force", vm_name=self.identity.name, deadline=deadline)
            except Exception as exc:  # a bug here must still end in a refusal and a report
                log.exception("running a force hook failed", extra=fields(event_id=event.EventId, hook=path.name))
                failed = HookStep(
                    hook=path.name,
                    outcome="failed",
                    durationSeconds=0.0,
                    outputTail=f"the forwarder could not run the hook: {exc}"[:1024],
                )
                report = phase_report(event.EventId, "force", [failed])
            span.set_attribute("scheduled_events.hook_outcome", report.outcome)
            try:
                then(report)
            except Exception:
                log.exception("deciding after a force hook failed", extra=fields(event_id=event.EventId))
            finally:
                self._report(report, traceparent(span))

    def _report(self, report: HookReport, context: tuple[str, str]) -> None:
        """The phase's one ``hook`` envelope, in the span's trace; on a full disk it waits for room (or the stop)."""
        if self._parts is None:
            return
        store = self._parts.store
        build = envelope_of("hook", self.identity, store.state_id, datetime.now(UTC), hook=report)
        backoff = Backoff(initial=1.0, maximum=60.0)
        while True:
            try:
                store.enqueue("hook", build, traceparent=context[0], tracestate=context[1])
                break
            except StoreFull:
                if self._stop.wait(backoff.next_delay()):
                    return
        self._parts.spooled()
