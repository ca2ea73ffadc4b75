"""The forwarder daemon: poll IMDS, spool an envelope per change, send the spool, run hooks, send heartbeats.

Three threads, so that no slow part holds up the 1/s poll: the poll loop (caller's thread), the sender (spool ->
sink, with backoff while the sink is down) and the hook worker (one hook at a time). Companions — the relay
listener — are started after the identity is known, told the document after every poll (the listener connects only
while an event it could approve is pending: forwarder/on_demand.py) and stopped first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol, runtime_checkable

from opentelemetry import trace
from pydantic import TypeAdapter, ValidationError

from contracts.document import ScheduledEvent, ScheduledEventsDocument
from contracts.envelope import Envelope, ForwarderHealth, HookPhase, HookReport, HookStep, VmIdentity
from forwarder import __version__
from forwarder.changes import Change, detect
from forwarder.config import ForwarderSettings
from forwarder.durable_state import HookJob, Store
from forwarder.hooks import HookRunner, phase_report
from forwarder.imds import ImdsClient, ImdsError, ImdsInvalidResponse, ImdsUnavailable, InvalidEvent, read_document
from forwarder.logs import fields
from forwarder.retry import Backoff
from forwarder.sinks import Sink, SinkError, UndeliverableEnvelope
from forwarder.telemetry import TRACEPARENT, TRACESTATE, Telemetry, parent, send_spans, traceparent

log = logging.getLogger("forwarder")

LAST_DOCUMENT = "last_document"
# While something keeps failing, repeat its log line at most this often (the first failure is always logged).
FAILURE_LOG_INTERVAL = 60.0
SHUTDOWN_FLUSH_SECONDS = 5.0
# The hook ledger is pruned at start and then this often: a DELETE over a table of a few rows per event.
PRUNE_INTERVAL = 24 * 3600.0
_STEPS = TypeAdapter(list[HookStep])
# ForwarderHealth.lastPollError's bound.
POLL_ERROR_CHARS = 256


class Companion(Protocol):
    """Something that lives as long as the daemon (the relay listener)."""

    def start(self) -> Any: ...

    def stop(self) -> None: ...


@runtime_checkable
class Listener(Companion, Protocol):
    """A companion with a connection whose state the heartbeat reports (the relay listener)."""

    @property
    def connected(self) -> bool: ...


@runtime_checkable
class OnDemand(Protocol):
    """A companion told, after every poll, the document the daemon holds (forwarder/on_demand.py: the listener
    connects only while that document holds an event it could approve)."""

    def update(self, document: ScheduledEventsDocument | None) -> None: ...


CompanionFactory = Callable[[VmIdentity, ImdsClient], Sequence[Companion]]


def _now() -> datetime:
    return datetime.now(UTC)


class _FailureLog:
    """Logs the first failure, then at most once a minute while failing, then the recovery."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._failures = 0
        self._last_logged = 0.0

    def failed(self, error: BaseException, **extra: Any) -> None:
        self._failures += 1
        now = time.monotonic()
        if self._failures == 1 or now - self._last_logged >= FAILURE_LOG_INTERVAL:
            self._last_logged = now
            log.warning(f"{self._what} failing", extra=fields(error=str(error), failures=self._failures, **extra))

    def succeeded(self) -> None:
        if self._failures:
            log.info(f"{self._what} recovered", extra=fields(failures=self._failures))
        self._failures = 0


class Forwarder:
    """One VM's forwarder. `run()` blocks until `stop()` (the CLI calls it from SIGTERM/SIGINT)."""

    def __init__(
        self,
        *,
        settings: ForwarderSettings,
        imds: ImdsClient,
        store: Store,
        sink: Sink,
        companions: CompanionFactory | None = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.settings = settings
        self.imds = imds
        self.store = store
        self.sink = sink
        # Owned by the daemon (shut down with it); given when the listener shares it (cli.main).
        self.telemetry = telemetry or Telemetry(spans_file=settings.telemetry_spans_file)
        self.hooks = HookRunner(hooks_dir=settings.hooks_dir, timeout=settings.hook_timeout)
        self._companion_factory = companions
        self._companions: list[Companion] = []
        self._stop = threading.Event()
        self._send_wake = threading.Event()
        self._hook_wake = threading.Event()
        self._threads: list[threading.Thread] = []
        self.identity: VmIdentity | None = None
        self._last_document: ScheduledEventsDocument | None = None
        self._last_canonical: str | None = None
        self._last_raw: bytes | None = None
        self._last_bad: bytes | None = None
        self._bad_events: frozenset[bytes] = frozenset()  # the set-aside events of the last document read
        self.counters: dict[str, int] = dict.fromkeys(
            ("polls", "changes", "imds_errors", "sent", "send_failures", "hooks_run"), 0
        )
        # Health, as heartbeats report it (ForwarderHealth); written by the poll loop only.
        self._last_good_poll: datetime | None = None
        self._consecutive_poll_errors = 0
        self._last_poll_error = ""
        self._imds_failures = _FailureLog("IMDS poll")
        self._send_failures = _FailureLog("sending to the sink")
        self._restore()

    # --- lifecycle ---------------------------------------------------------------------------------------
    def _restore(self) -> None:
        saved = self.store.get_state(LAST_DOCUMENT)
        if saved is None:
            return
        try:
            self._last_document = ScheduledEventsDocument.model_validate_json(saved)
            self._last_canonical = saved
        except ValidationError:
            # Only this process writes it; if it is unreadable, forwarding the current document once more is the
            # safe side (a repeated incarnation changes nothing downstream), losing a change is not.
            log.warning("the remembered document is unreadable; the next document is forwarded as new")

    def stop(self) -> None:
        self._stop.set()
        self._send_wake.set()
        self._hook_wake.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def run(self) -> None:
        log.info(
            "forwarder starting",
            extra=fields(
                version=__version__, imds=self.imds.base_url, spool=str(self.store.path), spool_depth=self.store.depth()
            ),
        )
        self._prune_hook_ledger()
        identity = self._wait_for_identity()
        if identity is None:
            self._shutdown()
            return
        self.identity = identity
        log.info(
            "identity",
            extra=fields(
                name=identity.name, resource_id=identity.resourceId, vm_id=identity.vmId, state_id=self.store.state_id
            ),
        )
        self._recover_interrupted_hooks()
        for target, name in ((self._sender_loop, "sender"), (self._hook_loop, "hooks")):
            thread = threading.Thread(target=target, name=f"forwarder-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        try:
            # "This VM's forwarder is up" as soon as it knows who it is: the first scheduled-events call may take
            # two minutes while IMDS wakes the service up, and the coordinator should not think the VM silent.
            self._heartbeat()
            self._start_companions(identity)
            self._poll_loop()
        finally:
            self._shutdown()

    def _wait_for_identity(self) -> VmIdentity | None:
        backoff = Backoff(initial=1.0, maximum=60.0)
        failures = _FailureLog("reading instance metadata")
        while not self._stop.is_set():
            try:
                identity = self.imds.get_identity()
            except ImdsError as exc:
                failures.failed(exc)
                self._stop.wait(backoff.next_delay())
            else:
                failures.succeeded()
                return identity
        return None

    def _start_companions(self, identity: VmIdentity) -> None:
        if self._companion_factory is None:
            return
        try:
            companions = self._companion_factory(identity, self.imds)
        except Exception:
            # A broken listener setup must not take the forwarding of events down with it.
            log.exception("the companions could not be built; forwarding continues without them")
            return
        for companion in companions:
            try:
                companion.start()
            except Exception:
                log.exception("a companion failed to start", extra=fields(companion=type(companion).__name__))
            else:
                self._companions.append(companion)

    def _shutdown(self) -> None:
        self.stop()
        for companion in self._companions:
            try:
                companion.stop()
            except Exception:
                log.exception("a companion failed to stop", extra=fields(companion=type(companion).__name__))
        self.hooks.stop()
        for thread in self._threads:
            thread.join(SHUTDOWN_FLUSH_SECONDS + 5)
        self.sink.close()
        self.telemetry.shutdown()
        self.imds.close()
        depth = self.store.depth()
        self.store.close()
        log.info("forwarder stopped", extra=fields(unsent=depth, **self.counters))

    # --- polling -----------------------------------------------------------------------------------------
    def _poll_loop(self) -> None:
        interval = self.settings.poll_interval
        backoff = Backoff(initial=max(interval, 1.0), maximum=60.0)
        next_heartbeat = time.monotonic() + self.settings.heartbeat_interval  # the first one went out in run()
        next_prune = time.monotonic() + PRUNE_INTERVAL
        next_poll = time.monotonic()
        while not self._stop.is_set():
            delay = interval
            try:
                self.poll_once()
            except ImdsUnavailable as exc:
                self._poll_failed(exc)
                self._imds_failures.failed(exc, status=exc.status)
                delay = backoff.next_delay(retry_after=exc.retry_after)
            except ImdsInvalidResponse as exc:
                self._poll_failed(exc)
                self._imds_failures.failed(exc)
            else:
                self._last_good_poll = _now()
                self._consecutive_poll_errors = 0
                self._imds_failures.succeeded()
                backoff.reset()
            # After a failed poll too: the last document read still says whether an event is pending.
            self._update_companions()
            now = time.monotonic()
            if now >= next_heartbeat:
                self._heartbeat()
                next_heartbeat = now + self.settings.heartbeat_interval
            if now >= next_prune:
                self._prune_hook_ledger()
                next_prune = now + PRUNE_INTERVAL
            # Keep a steady cadence; after a stall, start again from now rather than catching up in a burst.
            next_poll = max(next_poll + delay, now) if delay == interval else now + delay
            self._stop.wait(max(0.0, next_poll - time.monotonic()))

    def _update_companions(self) -> None:
        for companion in self._companions:
            if isinstance(companion, OnDemand):
                try:
                    companion.update(self._last_document)
                except Exception:
                    log.exception("a companion failed to update", extra=fields(companion=type(companion).__name__))

    def _poll_failed(self, error: ImdsError) -> None:
        self.counters["imds_errors"] += 1
        self._consecutive_poll_errors += 1
        # IMDS errors name the status and the reason, never a credential (the poll sends none).
        self._last_poll_error = f"{type(error).__name__}: {error}"[:POLL_ERROR_CHARS]

    def poll_once(self) -> Change | None:
        """Read the document once; spool an envelope and queue hooks if it changed. Raises ImdsError."""
        identity = self.identity
        if identity is None:
            raise RuntimeError("poll_once() needs the identity; call run() or set .identity")
        polled_at = time.time_ns()  # the start of the forwarder.detect span, if this poll sees a change
        raw = self.imds.get_document_bytes()
        self.counters["polls"] += 1
        if raw == self._last_raw:
            return None  # the common case: same bytes as a second ago, nothing parsed, nothing allocated to keep
        try:
            parsed = read_document(raw)
        except ImdsInvalidResponse as exc:
            if raw != self._last_bad:
                self._last_bad = raw
                self.store.reject(str(exc), raw)
                log.error(
                    "invalid scheduled-events document set aside; nothing forwarded and no hook run",
                    extra=fields(reason=str(exc), body=raw[:200].decode("utf-8", errors="replace")),
                )
            raise
        self._last_bad = None
        document = parsed.document
        self._set_aside(parsed.invalid)
        set_aside = frozenset(bad.event_id for bad in parsed.invalid if bad.event_id is not None)
        change = detect(self._last_document, self._last_canonical, document, vm_name=identity.name, set_aside=set_aside)
        self._last_raw = raw
        if change is None:
            return None
        observed = _now()

        def build(sequence: int) -> bytes:
            return Envelope(
                kind="incarnation",
                vm=identity,
                observedAt=observed,
                sequence=sequence,
                forwarder=__version__,
                stateId=self.store.state_id,
                document=document,
            ).to_json_bytes()

        # The approval's trace starts here, at the poll that saw the change; its context is spooled with the
        # envelope so that it travels with it whenever it is sent, and queued with the hooks it starts.
        detect_span = self.telemetry.tracer.start_span(
            "forwarder.detect",
            context=trace.set_span_in_context(trace.INVALID_SPAN),  # a root, whatever the caller's context
            start_time=polled_at,
            attributes={
                "vm.name": identity.name,
                "scheduled_events.event_ids": ",".join(e.EventId for e in document.Events),
                "scheduled_events.incarnation": document.DocumentIncarnation,
            },
        )
        with trace.use_span(detect_span, end_on_exit=True):
            span_parent, span_state = traceparent(detect_span)
            jobs = [
                HookJob(e.EventId, phase, e.model_dump_json(), traceparent=span_parent, tracestate=span_state)
                for phase, events in (("prepare", change.prepare), ("recover", change.recover))
                for e in events
            ]
            sequence = self.store.enqueue(
                "incarnation",
                build,
                state={LAST_DOCUMENT: change.canonical},
                hooks=jobs,
                traceparent=span_parent,
                tracestate=span_state,
            )
            detect_span.set_attribute("scheduled_events.sequence", sequence)
        self._last_document, self._last_canonical = document, change.canonical
        self.counters["changes"] += 1
        log.info(
            "document changed",
            extra=fields(
                incarnation=document.DocumentIncarnation,
                reason=change.reason,
                sequence=sequence,
                events=[f"{e.EventId}:{e.EventType}:{e.EventStatus}" for e in document.Events],
                prepare=[e.EventId for e in change.prepare],
                recover=[e.EventId for e in change.recover],
            ),
        )
        for before, after in change.renamed:
            log.info(
                "event renamed as it started; same maintenance: no recover for the old id, no prepare for the new",
                extra=fields(
                    event_id=before.EventId,
                    new_event_id=after.EventId,
                    event_type=after.EventType,
                    resources=after.Resources,
                ),
            )
        self._send_wake.set()
        if jobs:
            self._hook_wake.set()
        return change

    def _set_aside(self, invalid: tuple[InvalidEvent, ...]) -> None:
        """Count, keep and log each invalid event once per distinct content (it stays bad at every poll)."""
        seen = self._bad_events
        self._bad_events = frozenset(bad.body for bad in invalid)
        for bad in invalid:
            if bad.body in seen:
                continue
            self.store.reject(bad.reason, bad.body, counter="invalid_events")
            log.error(
                "invalid scheduled event set aside; the document's other events are forwarded, no hook runs for it",
                extra=fields(reason=bad.reason, event_id=bad.event_id, body=bad.body[:200].decode("utf-8", "replace")),
            )

    def _prune_hook_ledger(self) -> None:
        pruned = self.store.prune_hooks()
        if pruned:
            log.info("hook ledger pruned", extra=fields(forgotten=pruned))

    def _heartbeat(self) -> None:
        identity = self.identity
        if identity is None:
            return
        stored = self.store.counters()
        depth = self.store.depth()
        counters = {"invalid_documents": 0, "invalid_events": 0, **stored, **self.counters, "spool_depth": depth}
        health = ForwarderHealth(
            lastGoodPollAt=self._last_good_poll,
            pollErrors=self.counters["imds_errors"],
            consecutivePollErrors=self._consecutive_poll_errors,
            lastPollError=self._last_poll_error,
            spoolDepth=depth,
            dropped=stored.get("spool_dropped", 0),
            sendErrors=self.counters["send_failures"],
            listenerConnected=self._listener_connected(),
        )
        observed = _now()

        def build(sequence: int) -> bytes:
            # Unknown envelope fields are kept by contract; the counters let the coordinator see a sick VM.
            return Envelope.model_validate(
                {
                    "kind": "heartbeat",
                    "vm": identity,
                    "observedAt": observed,
                    "sequence": sequence,
                    "forwarder": __version__,
                    "stateId": self.store.state_id,
                    "counters": counters,
                    "health": health,
                }
            ).to_json_bytes()

        self.store.enqueue("heartbeat", build)
        self._send_wake.set()

    def _listener_connected(self) -> bool | None:
        """Whether the relay listener's control channel is up; None when no listener is configured. A listener
        configured but not (yet) running counts as not connected."""
        states = [c.connected for c in self._companions if isinstance(c, Listener)]
        if states:
            return all(states)
        return False if self.settings.relay_enabled else None

    # --- sending -----------------------------------------------------------------------------------------
    def _sender_loop(self) -> None:
        backoff = Backoff(initial=1.0, maximum=60.0)
        deadline: float | None = None
        while True:
            if self._stop.is_set() and deadline is None:
                deadline = time.monotonic() + SHUTDOWN_FLUSH_SECONDS
            if deadline is not None and time.monotonic() >= deadline:
                break
            items = self.store.peek(self.settings.send_batch_max)
            if not items:
                if self._stop.is_set():
                    break
                self._send_wake.wait()
                self._send_wake.clear()
                continue
            try:
                with send_spans(self.telemetry.tracer, items, vm_name=self._identity().name) as outgoing:
                    self.sink.send(outgoing, partition_key=self._identity().partition_key)
            except UndeliverableEnvelope as exc:
                log.error(
                    "envelope can never be delivered; set aside",
                    extra=fields(reason=str(exc), sequence=exc.item.sequence),
                )
                self.store.reject(f"undeliverable envelope: {exc}", exc.item.body, counter="undeliverable_envelopes")
                self.store.ack([exc.item])
            except Exception as exc:  # SinkError, and whatever else an SDK or credential raises: keep spooling
                self.counters["send_failures"] += 1
                self._send_failures.failed(
                    exc, spool_depth=self.store.depth(), unexpected=not isinstance(exc, SinkError)
                )
                if deadline is not None:
                    break
                self._send_wake.clear()
                self._stop.wait(backoff.next_delay())
            else:
                self.store.ack(items)
                self.counters["sent"] += len(items)
                self._send_failures.succeeded()
                backoff.reset()
        depth = self.store.depth()
        if depth:
            log.warning(
                "stopping with unsent envelopes; they are kept and sent after the restart", extra=fields(unsent=depth)
            )

    def _identity(self) -> VmIdentity:
        assert self.identity is not None  # the sender starts after the identity is known
        return self.identity

    # --- hooks -------------------------------------------------------------------------------------------
    def _recover_interrupted_hooks(self) -> None:
        """A phase still marked running was cut short by a crash or kill: report it failed, naming the hook that
        was running (or the phase, when none had started), with the hooks that had finished; never rerun it."""
        for job in self.store.hook_jobs("running"):
            phase: HookPhase = "prepare" if job.phase == "prepare" else "recover"
            try:
                finished = _STEPS.validate_json(job.steps)
            except ValidationError:
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
            self._spool_hook_report(report, done=job, context=(job.traceparent, job.tracestate))

    def _hook_loop(self) -> None:
        identity = self.identity
        assert identity is not None
        while not self._stop.is_set():
            jobs = self.store.hook_jobs("pending")
            if not jobs:
                self._hook_wake.wait()
                self._hook_wake.clear()
                continue
            for job in jobs:
                if self._stop.is_set():
                    return
                event = ScheduledEvent.model_validate_json(job.event)
                phase: HookPhase = "prepare" if job.phase == "prepare" else "recover"
                self.store.mark_hook_running(job)

                def progress(hook: str, finished: tuple[HookStep, ...], job: HookJob = job) -> None:
                    self.store.mark_hook_running(job, step=hook, steps=_STEPS.dump_json(list(finished)).decode())

                # The phase, in the trace of the change that queued it; its report is sent in that span's context.
                span = self.telemetry.tracer.start_span(
                    "forwarder.hooks",
                    context=parent({TRACEPARENT: job.traceparent, TRACESTATE: job.tracestate}),
                    attributes={
                        "vm.name": identity.name,
                        "scheduled_events.event_id": job.event_id,
                        "scheduled_events.hook_phase": phase,
                    },
                )
                with trace.use_span(span, end_on_exit=True):
                    try:
                        report = self.hooks.run(event, phase=phase, vm_name=identity.name, on_step=progress)
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
                    self.counters["hooks_run"] += 1
                    self._spool_hook_report(report, done=job, context=traceparent(span))

    def _spool_hook_report(self, report: HookReport, *, done: HookJob, context: tuple[str, str]) -> None:
        """One `hook` envelope per phase, spooled in the same transaction that marks the phase done, with the
        trace context (traceparent, tracestate) it is sent in."""
        identity = self.identity
        assert identity is not None
        observed = _now()

        def build(sequence: int) -> bytes:
            return Envelope(
                kind="hook",
                vm=identity,
                observedAt=observed,
                sequence=sequence,
                forwarder=__version__,
                stateId=self.store.state_id,
                hook=report,
            ).to_json_bytes()

        self.store.enqueue(
            "hook",
            build,
            hook_done=(done.event_id, done.phase),
            hook_outcome=report.outcome,
            traceparent=context[0],
            tracestate=context[1],
        )
        self._send_wake.set()
