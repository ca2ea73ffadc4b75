"""The hook worker thread: runs the hook phases the poll loop queued, one at a time, and spools each phase's report.

Takes: the daemon's `WorkerParts` (its store's hook ledger is where the poll loop queues a phase in the same
transaction as the change that needs it; `spooled` is called after each report is spooled), the hook runner and the
daemon's stop event. Gives: `HookWorker.run` for the thread, `wake()` for the poll loop, and
`recover_interrupted`, run once at start, before the thread. Phases run on this thread, not the poll loop's, so that
a hook that takes minutes never holds up the 1 s poll. Each phase is a `forwarder.hooks` span in the trace of the
change that queued it, and its one `hook` envelope is spooled in the transaction that marks the phase done: a phase
is reported once.
"""

from __future__ import annotations

import json
import logging
import threading
from datetime import UTC, datetime

from contracts.checks import Invalid
from contracts.wire import HookPhase, HookReport, HookStep, ScheduledEvent, VmIdentity
from forwarder.durable_state import HookJob, StoreFull
from forwarder.envelopes import envelope_of
from forwarder.hooks import HookRunner, phase_report
from forwarder.logs import fields
from forwarder.retry import Backoff
from forwarder.telemetry import TRACEPARENT, TRACESTATE, parent, traceparent, use_span
from forwarder.worker_parts import WorkerParts

log = logging.getLogger("forwarder")


class HookWorker:
    """Runs queued phases. `counters` is the daemon's: this thread counts `hooks_run` (phases)."""

    def __init__(
        self,
        parts: WorkerParts,
        *,
        runner: HookRunner,
        stop: threading.Event,
    ) -> None:
        self._parts = parts
        self._runner = runner
        self._stop = stop
        self._wake = threading.Event()

    def wake(self) -> None:
        """A phase was queued (or the daemon is stopping): look at the ledger now."""
        self._wake.set()

    def recover_interrupted(self, identity: VmIdentity) -> None:
        """A phase still marked running was cut short by a crash or kill: report it failed, naming the hook that
        was running (or the phase, when none had started), with the hooks that had finished; never rerun it."""
        for job in self._parts.store.hook_jobs("running"):
            phase: HookPhase = "prepare" if job.phase == "prepare" else "recover"
            try:
                finished = [HookStep.from_mapping(step) for step in json.loads(job.steps)]
            except (Invalid, ValueError, TypeError):
                # Only this process writes it; an unreadable list loses the finished steps, not the report.
                log.warning("the finished steps of an interrupted phase are unreadable", extra=fields(phase=phase))
                finished = []
            interrupted = HookStep(
                hook=job.step or f"{phase}.d",
                outcome="failed",
                durationSeconds=0.0,
                outputTail="interrupted: the forwarder stopped while this hook ran; the phase is not run again",
            )
            log.warning(
                "hook phase was interrupted by a forwarder restart",
                extra=fields(event_id=job.event_id, phase=phase, hook=interrupted.hook),
            )
            report = phase_report(job.event_id, phase, [*finished, interrupted])
            self._spool_report(identity, report, done=job, context=(job.traceparent, job.tracestate))

    def run(self, identity: VmIdentity) -> None:
        backoff = Backoff(initial=1.0, maximum=60.0)
        while not self._stop.is_set():
            jobs = self._parts.store.hook_jobs("pending")
            if not jobs:
                self._wake.wait()
                self._wake.clear()
                continue
            for job in jobs:
                if self._stop.is_set():
                    return
                try:
                    self._run_phase(identity, job)
                except StoreFull:
                    # Not started (it could not be marked running, so it would run again after a crash): the
                    # phase stays pending and is tried again when the disk has room.
                    log.error("a hook phase waits for room on the state disk", extra=fields(event_id=job.event_id))
                    self._stop.wait(backoff.next_delay())
                    break
                backoff.reset()

    def _run_phase(self, identity: VmIdentity, job: HookJob) -> None:
        event = ScheduledEvent.from_json_bytes(job.event)
        phase: HookPhase = "prepare" if job.phase == "prepare" else "recover"
        self._parts.store.mark_hook_running(job)

        def progress(hook: str, finished: tuple[HookStep, ...]) -> None:
            try:
                self._parts.store.mark_hook_running(
                    job, step=hook, steps=json.dumps([step.to_mapping() for step in finished], separators=(",", ":"))
                )
            except StoreFull:
                # Only what a crash would report as interrupted: the phase goes on.
                log.warning("the running hook could not be recorded (state disk full)", extra=fields(hook=hook))

        # The phase, in the trace of the change that queued it; its report is sent in that span's context.
        span = self._parts.tracer.start_span(
            "forwarder.hooks",
            parent=parent({TRACEPARENT: job.traceparent, TRACESTATE: job.tracestate}),
            attributes={
                "vm.name": identity.name,
                "scheduled_events.event_id": job.event_id,
                "scheduled_events.hook_phase": phase,
            },
        )
        with use_span(span):
            try:
                report = self._runner.run(event, phase=phase, vm_name=identity.name, on_step=progress)
            except Exception as exc:  # a bug here must not silently end hook processing for good
                log.exception("running hooks failed", extra=fields(event_id=job.event_id, phase=phase))
                failed = HookStep(
                    hook=f"{phase}.d",
                    outcome="failed",
                    durationSeconds=0.0,
                    outputTail=f"the forwarder could not run the hooks: {exc}"[:1024],
                )
                report = phase_report(job.event_id, phase, [failed])
            span.set_attribute("scheduled_events.hook_outcome", report.outcome)
            self._parts.counters["hooks_run"] += 1
            self._spool_report(identity, report, done=job, context=traceparent(span))

    def _spool_report(
        self, identity: VmIdentity, report: HookReport, *, done: HookJob, context: tuple[str, str]
    ) -> None:
        """One `hook` envelope per phase, spooled in the same transaction that marks the phase done, with the
        trace context (traceparent, tracestate) it is sent in."""
        build = envelope_of("hook", identity, self._parts.store.state_id, datetime.now(UTC), hook=report)
        backoff = Backoff(initial=1.0, maximum=60.0)
        while True:
            try:
                self._parts.store.enqueue(
                    "hook",
                    build,
                    hook_done=(done.event_id, done.phase),
                    hook_outcome=report.outcome,
                    traceparent=context[0],
                    tracestate=context[1],
                )
                break
            except StoreFull:
                # The phase has run: its report waits here for room, never runs it again. Stopped first, the phase
                # is still marked running, and the restart reports it interrupted.
                if self._stop.wait(backoff.next_delay()):
                    return
        self._parts.spooled()
