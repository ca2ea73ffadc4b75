"""The VM side of an approval: the handler behind this VM's relay listener.

Protocol: ``POST /approve`` (relative to the VM's hybrid connection) with a JSON ``ApprovalRequest``. Every
request that parses is answered ``200`` with an ``ApprovalResult``:

- ``approved``      the EventId is in a fresh IMDS document, still ``Scheduled``, names at least one resource,
                    and IMDS accepted the StartRequests POST;
- ``accepted``      as ``approved``, for a request naming ``facts.forceHook``: this VM's own ``force.d/NAME`` hook
                    runs first, and StartRequests follows only if it succeeded and a fresh document still allows it
                    (forwarder/force.py; the decision ends "approved" or "refused" in the ledger);
- ``not-found``     the EventId is not in this VM's document (gone, or an event of another group);
- ``not-scheduled`` the event is already ``Started``;
- ``rejected``      past its notAfter (or without one), dated beyond the event's NotBefore or further ahead than
                    any approval may be valid, issued too far in the future or past, a reused decisionId, a
                    decision whose execution a crash interrupted, no Resources, a force hook not installed here, or
                    a Terminate that does not name this VM.

Anything that cannot be evaluated gets a 4xx with ``{"error": reason}``: wrong method (405), wrong path (404),
not JSON (415), too large (413), schema errors named field by field (400). IMDS trouble is a 503 so the sender
retries. Who may send at all is the Relay's job: the hybrid connection requires client authorization and only
the coordinator's identity holds "Azure Relay Sender" on it.

Why "in this VM's document" is the group check: IMDS delivers an event to every VM of the availability set or
scale-set placement group it affects, and to no other VM. An event found here therefore concerns this VM's
group, and approving it (which starts it for all its ``Resources``) cannot reach a VM outside the group. An
event with an empty ``Resources`` list would say nothing about whom it affects, so it is refused.

Terminate is the exception: it is approved only through the VM it deletes. Azure's guidance is that every VM of
a scale set approves only the EventId relevant to it, and an approved delete is coupled to the scale set's other
pending deletes, so a peer approving someone else's delete would decide that VM's fate without its hooks having
had a say. The listener therefore refuses a Terminate whose ``Resources`` do not include its own IMDS compute
name (never the hostname).

Expiry: a request carries ``notAfter``, the earliest instant at which a condition its decision rested on stops
holding (contracts/approval.py). It is refused from ``NOT_AFTER_TOLERANCE`` (2 s) before then on this VM's clock,
so that what IMDS receives was decided on conditions that still held while the clocks agree within 2 s (checked
when the request arrives and again right before the StartRequests POST: once a request lapses, the coordinator may
send the event to another VM, docs/liveness.md *Liveness*); refused
without one (a coordinator older than this listener: upgrade the coordinator first); and refused when dated later
than the event's NotBefore (+ the tolerance) or more than ``Freshness.max_validity`` (15 min) ahead, so that no
approval is valid far into the future.

At most once: every decisionId is kept in a decision ledger with its event and what was done (``DecisionLedger``;
the forwarder's SQLite state, next to the spool, so it survives a restart; bounded to a day and 10,000 entries,
forwarder/durable_state.py). The ledger says "forcing" while a force hook runs (a repeat meanwhile is answered
"accepted" again and starts nothing), "executing" before the StartRequests POST and "approved" once IMDS took it. The
same decision for the same event again (a sender retry after a lost answer, or a replay after a restart) gets the
stored answer without a second POST; one a crash interrupted (left "forcing" or "executing") is judged again on a
document read now, so it is POSTed again only while the event is still Scheduled (StartRequests starts an event
once; a force hook runs again, so it must be idempotent); a refused one is evaluated again (the document may have
caught up, the coordinator may have decided it again with a new notAfter); a decisionId already used for another event
is a replay and is rejected. IMDS answering an error to the POST leaves the decision unexecuted (503, the sender
retries).

Tracing: each request is a ``listener.approve`` span, a child of the request's W3C ``traceparent`` header (the
coordinator's, so that the approval is one trace from the forwarder's detection of the change to IMDS), or a
new trace without one; its children ``listener.imds_get`` (the fresh document) and ``listener.start_requests``
(the POST, only when made).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Protocol, TypeVar

from contracts.checks import Invalid
from contracts.wire import (
    ApprovalOutcome,
    ApprovalRequest,
    ApprovalResult,
    Attestation,
    HookReport,
    ScheduledEventsDocument,
)
from forwarder.approval_rules import Freshness, PrepareLedger, judge, refuse_not_after, refuse_stale
from forwarder.decisions import DecisionLedger, DecisionStatus, LedgerEntry, MemoryLedger
from forwarder.force import ForceHooks, hook_failure
from forwarder.imds import ImdsDeadlinePassed, ImdsError
from forwarder.logs import fields
from forwarder.proofs import Proofs
from forwarder.relay_protocol import RelayRequest, RelayResponse
from forwarder.telemetry import IdTracer, Span, Tracer, parent

APPROVE_PATH = "/approve"
MAX_BODY = 16 * 1024

log = logging.getLogger("forwarder.approver")
_T = TypeVar("_T")


class ScheduledEventsSource(Protocol):
    """What the approver needs from IMDS; ``forwarder.imds.ImdsClient`` provides it."""

    def get_document(self) -> ScheduledEventsDocument: ...

    def approve(self, event_ids: Iterable[str], *, before: float | None = None) -> None:
        """StartRequests, none of whose attempts starts at or after ``before`` (monotonic; ImdsDeadlinePassed)."""
        ...


# ----------------------------------------------------------------------------------------------- handler


class _Refusal(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class _Lapsed(Exception):
    """The request's validity ended before its StartRequests could go out: refused, nothing sent."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _parse(request: RelayRequest) -> ApprovalRequest:
    if request.path.rstrip("/") != APPROVE_PATH:
        raise _Refusal(404, f"no such resource {request.path!r}; approvals go to POST {APPROVE_PATH}")
    if request.method != "POST":
        raise _Refusal(405, f"method {request.method} is not allowed on {APPROVE_PATH}; use POST")
    content_type = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if content_type != "application/json":
        raise _Refusal(415, f"content type {content_type!r} is not supported; send application/json")
    if len(request.body) > MAX_BODY:
        raise _Refusal(413, f"body of {len(request.body)} bytes exceeds {MAX_BODY}")
    try:
        approval = ApprovalRequest.from_json_bytes(request.body)
    except Invalid as error:
        problems = "; ".join(f"{loc or 'body'}: {message}" for loc, message in error.problems[:5])
        raise _Refusal(400, f"approval request is invalid: {problems}") from None
    for name, value in (("issuedAt", approval.issuedAt), ("expiresAt", approval.expiresAt)):
        if value.tzinfo is None:
            raise _Refusal(400, f"approval request is invalid: {name}: must carry a UTC offset")
    return approval


class Approver:
    """``RelayListener`` handler that executes approvals against IMDS (see the module docstring for the rules)."""

    def __init__(
        self,
        *,
        imds: ScheduledEventsSource,
        vm_name: str,
        prepare_outcome: PrepareLedger | None = None,
        freshness: Freshness | None = None,
        clock: Callable[[], datetime] = _utcnow,
        ledger: DecisionLedger | None = None,
        tracer: Tracer | None = None,
        attest: Callable[[str], Attestation] | None = None,
        force: ForceHooks | None = None,
    ) -> None:
        self._imds = imds
        self._vm_name = vm_name  # this VM's IMDS compute name: a Terminate must name it
        self._prepare_outcome = prepare_outcome  # this VM's own hook ledger
        self._freshness = freshness or Freshness()
        self._clock = clock
        # What was done with each decisionId: durable (the forwarder's state) in the daemon, in memory without one.
        self._ledger: DecisionLedger = ledger if ledger is not None else MemoryLedger()
        self._tracer = tracer or IdTracer()  # the forwarder's (forwarder/telemetry.py); ids only by default
        # IMDS's attested document for a nonce (ImdsClient.get_attestation): each answer proves this VM gave it.
        self._proofs = Proofs(attest)
        # This VM's force hooks (the daemon's hooks folder and sender); without them a force request is refused.
        self._force = force
        self._forcing: dict[str, str] = {}  # decisionId -> EventId (upper case) whose force hook runs now
        # One approval at a time: the IMDS calls are quick, and serialising makes "approve once per decision" exact.
        self._lock = threading.Lock()
        self.imds_posts = 0
        # The last document read (with when its read began, monotonic) and the events POSTed since: a request that
        # arrived before that read is judged on it (as fresh as one read on its arrival), unless its own event was
        # POSTed since. Approvals that arrive together then cost one read, not one each, of IMDS's ~5 requests/s.
        self._document: tuple[float, ScheduledEventsDocument] | None = None
        self._posted_since: set[str] = set()
        self.imds_reads = 0

    def __call__(self, request: RelayRequest) -> RelayResponse:
        with self._tracer.start_as_current_span("listener.approve", parent=parent(request.headers)) as span:
            response = self._answer(request, span)
            span.set_attribute("http.response.status_code", response.status_code)
            return response

    def _answer(self, request: RelayRequest, span: Span) -> RelayResponse:
        started = time.perf_counter()
        record: dict[str, object] = {"requestId": request.id, "method": request.method, "path": request.path}
        try:
            approval = _parse(request)
            record.update(
                eventId=approval.eventId,
                decisionId=approval.decisionId,
                rule=approval.rule,
                notAfter=approval.notAfter.isoformat() if approval.notAfter else None,
                policyVersion=approval.policyVersion,
            )
            span.set_attribute("scheduled_events.event_id", approval.eventId)
            span.set_attribute("scheduled_events.decision_id", approval.decisionId)
            # The proof first: a VM whose delete this approval starts has no IMDS a moment after StartRequests, and
            # requests arriving while it is made share the one document read that follows (IMDS: ~5 requests/s).
            arrived = time.monotonic()
            proof = self._proofs.proof(approval.decisionId)
            result, replayed = self._decide(approval, arrived)
        except _Refusal as refusal:
            record.update(status=refusal.status, reason=refusal.reason)
            # 503: IMDS could not be asked (the sender retries); 4xx: the request could not be evaluated.
            span.set_attribute("scheduled_events.outcome", "unavailable" if refusal.status == 503 else "refused")
            log.warning("approval request refused", extra=fields(**record, ms=_ms(started)))
            return RelayResponse.json(refusal.status, {"error": refusal.reason})
        if proof is not None:
            result = result.replace(attestation=proof)
        record.update(status=200, outcome=result.outcome, incarnation=result.documentIncarnation, idempotent=replayed)
        span.set_attribute("scheduled_events.outcome", result.outcome)
        span.set_attribute("scheduled_events.idempotent", replayed)
        if result.reason:
            record["reason"] = result.reason
        log.info("approval request answered", extra=fields(**record, ms=_ms(started)))
        return RelayResponse(200, "OK", {"Content-Type": "application/json"}, result.to_json_bytes())

    def _decide(self, approval: ApprovalRequest, arrived: float) -> tuple[ApprovalResult, bool]:
        with self._lock:
            now = self._clock()
            prior = self._ledger.decision(approval.decisionId)
            if prior is not None and prior.event_id != approval.eventId:
                reason = f"decisionId {approval.decisionId!r} was already used for event {prior.event_id!r}"
                return self._result(approval, "rejected", reason, None), False
            if prior is not None and (prior.status == "approved" or approval.decisionId in self._forcing):
                # Executed, or its force hook runs now in this process: the stored answer ("accepted" meanwhile).
                return ApprovalResult.from_json_bytes(prior.result), True
            # A decision left "executing" (or "forcing") by a crash is judged again like a new one: whether IMDS took
            # the first POST is unknown, but StartRequests acts once per event (a started event is no longer
            # Scheduled), and the judgement below needs the event still Scheduled in a document read now, so a second
            # POST can only start what the first did not (refusing it instead lost the approval until NotBefore).
            stale = refuse_stale(approval, now=now, freshness=self._freshness)
            if stale is not None:
                return self._refuse(approval, stale, None, now), False
            document = self._fresh_document(approval.eventId, arrived)
            outcome, reason = self._judge(approval, document)
            if outcome == "approved" and approval.facts is not None and approval.facts.forceHook:
                return self._start_force(approval, approval.facts.forceHook, document, now), False
            if outcome == "approved":
                outcome, reason = self._execute(approval, now)
            result = self._result(approval, outcome, reason, document.DocumentIncarnation)
            return self._remember(approval, "approved" if outcome == "approved" else "refused", result, now), False

    def _judge(self, approval: ApprovalRequest, document: ScheduledEventsDocument) -> tuple[ApprovalOutcome, str]:
        """``judge`` on a fresh document, then the request's notAfter again (called under the lock)."""
        outcome, reason = judge(
            approval,
            document,
            vm_name=self._vm_name,
            prepare_outcome=self._prepare_outcome,
            now=self._clock(),
            freshness=self._freshness,
        )
        lapsed = refuse_not_after(approval, now=self._clock(), freshness=self._freshness)
        if outcome == "approved" and lapsed is not None:
            # Checked again right before the POST: the fresh read may have waited (IMDS's rate limit, a slow answer),
            # and once a request lapses the coordinator may send the event to a peer.
            return "rejected", lapsed
        return outcome, reason

    def _execute(self, approval: ApprovalRequest, now: datetime) -> tuple[ApprovalOutcome, str]:
        """StartRequests for a request judged executable (called under the lock): "approved", or "rejected" when it
        lapsed before the POST could go out. IMDS refusing or unreachable raises ``_Refusal`` (503), nothing kept."""
        # Written (durably) before the POST: a crash from here until IMDS answers leaves "executing", judged again on
        # the next request for it.
        self._ledger.remember_decision(LedgerEntry(approval.decisionId, approval.eventId, "executing", now))
        with self._tracer.start_as_current_span(
            "listener.start_requests",
            attributes={"scheduled_events.event_id": approval.eventId},
        ):
            self._posted_since.add(approval.eventId.upper())
            # The last instant the POST may start: the check above is not the last word while the POST waits for
            # IMDS's rate limit or a retry, and a reroute to a peer follows the lapse by 1 s.
            before = time.monotonic() + self._remaining(approval)
            try:
                self._imds_call(lambda: self._imds.approve([approval.eventId], before=before))
            except _Lapsed as lapse:
                self._ledger.forget_decision(approval.decisionId)  # nothing was sent
                return "rejected", lapse.reason
            except _Refusal:
                self._ledger.forget_decision(approval.decisionId)  # IMDS refused or was unreachable
                self._document = None  # what IMDS holds now is unknown
                raise
        self.imds_posts += 1
        return "approved", ""

    def _start_force(
        self, approval: ApprovalRequest, name: str, document: ScheduledEventsDocument, now: datetime
    ) -> ApprovalResult:
        """A request judged executable that names a force hook (called under the lock): "accepted", its decision
        recorded "forcing" (durably, before the answer and the hook) and the hook started on its own thread; or
        "rejected" when the hook is not installed here, another force of the event runs, or no time is left."""
        event, incarnation, force = document.event(approval.eventId), document.DocumentIncarnation, self._force
        path = force.installed(name) if force is not None else None
        if force is None or path is None or event is None:
            folder = force.folder if force is not None else "force.d (this listener runs no force hooks)"
            reason = f"force hook {name} is not installed on this VM: no executable {folder}/{name}"
            return self._refuse(approval, reason, incarnation, now)
        if self._vm_name not in event.Resources:
            # Its hook drains this VM: only a VM the event names may run it (the coordinator sends it to one).
            reason = f"a force request for {approval.eventId}, which does not name this VM ({self._vm_name})"
            return self._refuse(approval, reason, incarnation, now)
        busy = [d for d, e in self._forcing.items() if e == approval.eventId.upper()]
        if busy:
            reason = f"a force hook for event {approval.eventId} already runs, for decision {busy[0]!r}"
            return self._refuse(approval, reason, incarnation, now)
        tolerance = self._freshness.not_after_tolerance
        deadline = force.deadline(approval, event, now=self._clock(), tolerance=tolerance)
        if deadline <= time.monotonic():
            return self._refuse(approval, f"no time left to run force hook {name} within its bound", incarnation, now)
        by = (approval.deadline - tolerance).isoformat()
        reason = f"force hook {name} running; StartRequests once it succeeds, by {by}"
        result = self._remember(approval, "forcing", self._result(approval, "accepted", reason, incarnation), now)
        self._forcing[approval.decisionId] = approval.eventId.upper()
        force.start(path, event, deadline=deadline, then=lambda report: self._forced(approval, name, report))
        return result

    def _forced(self, approval: ApprovalRequest, name: str, report: HookReport) -> None:
        """After the force hook, on its thread: StartRequests only if it succeeded and the event, judged again on a
        document read since it ended, may still start (as ``_decide``); otherwise the decision is refused."""
        ended = time.monotonic()
        with self._lock:
            try:
                outcome: ApprovalOutcome = "rejected"
                incarnation: int | None = None
                if report.outcome != "succeeded":
                    reason = hook_failure(name, report)
                else:
                    try:
                        document = self._fresh_document(approval.eventId, ended)
                        incarnation = document.DocumentIncarnation
                        outcome, reason = self._judge(approval, document)
                        if outcome == "approved":
                            outcome, reason = self._execute(approval, self._clock())
                    except (_Refusal, _Lapsed) as refusal:
                        outcome, reason = "rejected", f"force hook {name} succeeded, then {refusal.reason}"
                result = self._result(approval, outcome, reason, incarnation)
                self._remember(approval, "approved" if outcome == "approved" else "refused", result, self._clock())
                level = logging.INFO if outcome == "approved" else logging.WARNING
                what = fields(eventId=approval.eventId, decisionId=approval.decisionId, outcome=outcome, reason=reason)
                log.log(level, "force request decided after its hook", extra=what)
            finally:
                del self._forcing[approval.decisionId]

    def _fresh_document(self, event_id: str, arrived: float) -> ScheduledEventsDocument:
        """This VM's document as read after the request arrived (``arrived``, monotonic): the last one read, when
        its read began since then and its event was not POSTed since, else read now (called under the lock)."""
        last = self._document
        if last is not None and last[0] >= arrived and event_id.upper() not in self._posted_since:
            return last[1]
        began = time.monotonic()
        with self._tracer.start_as_current_span("listener.imds_get") as get:
            document = self._imds_call(self._imds.get_document)
            get.set_attribute("scheduled_events.incarnation", document.DocumentIncarnation)
        self.imds_reads += 1
        self._document, self._posted_since = (began, document), set()
        return document

    def _remaining(self, approval: ApprovalRequest) -> float:
        """Seconds, by this VM's clock, until the request is refused as expired (``refuse_not_after``)."""
        until = approval.deadline - self._freshness.not_after_tolerance
        return (until - self._clock()).total_seconds()

    @staticmethod
    def _imds_call(call: Callable[[], _T]) -> _T:
        try:
            return call()
        except ImdsDeadlinePassed as error:
            raise _Lapsed(f"expired while waiting to reach IMDS: {error}") from error
        except ImdsError as error:
            raise _Refusal(503, f"IMDS is unavailable, retry: {error}") from error

    @staticmethod
    def _result(
        approval: ApprovalRequest, outcome: ApprovalOutcome, reason: str, incarnation: int | None
    ) -> ApprovalResult:
        return ApprovalResult(
            outcome=outcome,
            eventId=approval.eventId,
            decisionId=approval.decisionId,
            documentIncarnation=incarnation,
            reason=reason,
        )

    def _refuse(self, approval: ApprovalRequest, reason: str, incarnation: int | None, now: datetime) -> ApprovalResult:
        return self._remember(approval, "refused", self._result(approval, "rejected", reason, incarnation), now)

    def _remember(
        self, approval: ApprovalRequest, status: DecisionStatus, result: ApprovalResult, now: datetime
    ) -> ApprovalResult:
        entry = LedgerEntry(approval.decisionId, approval.eventId, status, now, result.to_json_bytes().decode())
        self._ledger.remember_decision(entry)
        return result


def _ms(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 2)
