"""One poll: read the document, set aside what is invalid, and on a change spool its `incarnation` envelope and queue
the hook phases it starts, in one transaction.

Takes: the IMDS client, the store, the tracer, the daemon's counters (this counts `polls` and `changes`), and two
callbacks: `spooled` (wakes the sender) and `queued` (wakes the hook worker). Gives: `Poller.poll_once(identity)`,
called by the daemon's poll loop, which owns the cadence, the backoff and the health of the polls; and `document`,
the last valid document read, which the daemon hands to its companions. The last document is kept in the store, so a
restart forwards only what changed while it was down.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime

from contracts.checks import Invalid
from contracts.wire import ScheduledEventsDocument, VmIdentity
from forwarder.changes import Change, detect
from forwarder.durable_state import HookJob
from forwarder.envelopes import envelope_of
from forwarder.imds import ImdsClient, ImdsInvalidResponse, InvalidEvent, read_document
from forwarder.logs import fields
from forwarder.telemetry import INVALID, traceparent, use_span
from forwarder.worker_parts import WorkerParts

log = logging.getLogger("forwarder")

LAST_DOCUMENT = "last_document"


class Poller:
    """Turns polls into envelopes; called from the poll loop only, so its state needs no lock."""

    def __init__(
        self,
        parts: WorkerParts,
        *,
        imds: ImdsClient,
        queued: Callable[[], None],
    ) -> None:
        self._parts = parts
        self._imds = imds
        self._queued = queued
        self._last_document: ScheduledEventsDocument | None = None
        self._last_canonical: str | None = None
        self._last_raw: bytes | None = None
        self._last_bad: bytes | None = None
        self._bad_events: frozenset[bytes] = frozenset()  # the set-aside events of the last document read
        self._restore()

    @property
    def document(self) -> ScheduledEventsDocument | None:
        """The last valid document read (or remembered from before a restart); None before the first."""
        return self._last_document

    def _restore(self) -> None:
        saved = self._parts.store.get_state(LAST_DOCUMENT)
        if saved is None:
            return
        try:
            self._last_document = ScheduledEventsDocument.from_json_bytes(saved)
            self._last_canonical = saved
        except Invalid:
            # Only this process writes it; if it is unreadable, forwarding the current document once more is the
            # safe side (a repeated incarnation changes nothing downstream), losing a change is not.
            log.warning("the remembered document is unreadable; the next document is forwarded as new")

    def poll_once(self, identity: VmIdentity) -> Change | None:
        """Read the document once; spool an envelope and queue hooks if it changed. Raises ImdsError, and
        StoreFull when the change could not be spooled (it is read as a change again next time)."""
        polled_at = time.time_ns()  # the start of the forwarder.detect span, if this poll sees a change
        raw = self._imds.get_document_bytes()
        self._parts.counters["polls"] += 1
        if raw == self._last_raw:
            return None  # the common case: same bytes as a second ago, nothing parsed, nothing allocated to keep
        try:
            parsed = read_document(raw)
        except ImdsInvalidResponse as exc:
            if raw != self._last_bad:
                self._parts.store.reject(str(exc), raw)  # before it counts as seen: a full disk retries it
                self._last_bad = raw
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
        if change is None:
            self._last_raw = raw
            return None
        build = envelope_of("incarnation", identity, self._parts.store.state_id, datetime.now(UTC), document=document)
        # The approval's trace starts here, at the poll that saw the change; its context is spooled with the
        # envelope so that it travels with it whenever it is sent, and queued with the hooks it starts.
        detect_span = self._parts.tracer.start_span(
            "forwarder.detect",
            parent=INVALID,  # a root, whatever the caller's context
            start_time=polled_at,
            attributes={
                "vm.name": identity.name,
                "scheduled_events.event_ids": ",".join(e.EventId for e in document.Events),
                "scheduled_events.incarnation": document.DocumentIncarnation,
            },
        )
        with use_span(detect_span):
            span_parent, span_state = traceparent(detect_span)
            jobs = [
                HookJob(e.EventId, phase, e.to_json_bytes().decode(), traceparent=span_parent, tracestate=span_state)
                for phase, events in (("prepare", change.prepare), ("recover", change.recover))
                for e in events
            ]
            sequence = self._parts.store.enqueue(
                "incarnation",
                build,
                state={LAST_DOCUMENT: change.canonical},
                hooks=jobs,
                traceparent=span_parent,
                tracestate=span_state,
            )
            detect_span.set_attribute("scheduled_events.sequence", sequence)
        # Only once the change is spooled: when the store could not take it (StoreFull, a full disk), the same bytes
        # are read as a change again at the next poll, so it is never lost.
        self._last_raw = raw
        self._last_document, self._last_canonical = document, change.canonical
        self._parts.counters["changes"] += 1
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
        self._parts.spooled()
        if jobs:
            self._queued()
        return change

    def _set_aside(self, invalid: tuple[InvalidEvent, ...]) -> None:
        """Count, keep and log each invalid event once per distinct content (it stays bad at every poll)."""
        self._bad_events &= frozenset(bad.body for bad in invalid)
        for bad in invalid:
            if bad.body in self._bad_events:
                continue
            self._parts.store.reject(bad.reason, bad.body, counter="invalid_events")
            self._bad_events |= {bad.body}  # once counted (a full disk raises before: counted at the next poll)
            log.error(
                "invalid scheduled event set aside; the document's other events are forwarded, no hook runs for it",
                extra=fields(reason=bad.reason, event_id=bad.event_id, body=bad.body[:200].decode("utf-8", "replace")),
            )
