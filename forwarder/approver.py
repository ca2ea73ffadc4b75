"""The VM side of an approval: the handler behind this VM's relay listener.

Protocol: ``POST /approve`` (relative to the VM's hybrid connection) with a JSON ``ApprovalRequest``. Every
request that parses is answered ``200`` with an ``ApprovalResult``:

- ``approved``      the EventId is in a fresh IMDS document, still ``Scheduled``, names at least one resource,
                    and IMDS accepted the StartRequests POST;
- ``not-found``     the EventId is not in this VM's document (gone, or an event of another group);
- ``not-scheduled`` the event is already ``Started``;
- ``rejected``      expired, issued too far in the future or past, a reused decisionId, no Resources, or a
                    Terminate that does not name this VM.

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

Idempotency: a decisionId is remembered with its event and result until it expires. The same decision for the
same event again (a sender retry) gets the stored answer without a second IMDS POST when it was approved; a
refused one is evaluated again (the document may have caught up). A decisionId already used for a different
event is a replay and is rejected. Decisions are kept in memory, bounded by count and by their expiry; after a
restart an old request is still refused once it has expired.

Tracing: each request is a ``listener.approve`` span, a child of the request's W3C ``traceparent`` header (the
coordinator's, so that the approval is one trace from the forwarder's detection of the change to IMDS), or a
new trace without one; its children ``listener.imds_get`` (the fresh document) and ``listener.start_requests``
(the POST, only when made).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Protocol, TypeVar

from opentelemetry import trace
from pydantic import ValidationError

from contracts.approval import ApprovalOutcome, ApprovalRequest, ApprovalResult
from contracts.attestation import Attestation, decision_nonce
from contracts.document import ScheduledEvent, ScheduledEventsDocument
from forwarder.imds import ImdsError
from forwarder.logs import fields
from forwarder.relay_protocol import RelayRequest, RelayResponse
from forwarder.telemetry import IdTracer, parent

APPROVE_PATH = "/approve"
MAX_BODY = 16 * 1024

log = logging.getLogger("forwarder.approver")
_T = TypeVar("_T")


class ScheduledEventsSource(Protocol):
    """What the approver needs from IMDS; ``forwarder.imds.ImdsClient`` provides it."""

    def get_document(self) -> ScheduledEventsDocument: ...

    def approve(self, event_ids: Iterable[str]) -> None: ...


@dataclass(frozen=True)
class Freshness:
    """How much clock disagreement and request age are tolerated."""

    clock_skew: timedelta = timedelta(minutes=2)
    max_age: timedelta = timedelta(minutes=30)


# ----------------------------------------------------------------------------------------------- pure decisions


def refuse_stale(approval: ApprovalRequest, *, now: datetime, freshness: Freshness) -> str | None:
    """Why the request is too old, too new or already expired; None when its time window is acceptable."""
    if approval.expiresAt <= approval.issuedAt:
        return f"expiresAt {approval.expiresAt.isoformat()} is not after issuedAt {approval.issuedAt.isoformat()}"
    if approval.expiresAt <= now:
        return f"expired at {approval.expiresAt.isoformat()}"
    if approval.issuedAt > now + freshness.clock_skew:
        return f"issuedAt {approval.issuedAt.isoformat()} is in the future beyond the {freshness.clock_skew} skew"
    if approval.issuedAt < now - freshness.max_age - freshness.clock_skew:
        return f"issuedAt {approval.issuedAt.isoformat()} is older than {freshness.max_age}"
    return None


PrepareLedger = Callable[[str], str | None]


def refuse_facts(
    approval: ApprovalRequest, event: ScheduledEvent, *, vm_name: str, prepare_outcome: PrepareLedger | None
) -> str | None:
    """Why the decision's facts do not hold on this VM (its IMDS document, its own hook ledger); None when they
    do. One VM's word to the coordinator never reaches IMDS unchecked: this is the last line of defence."""
    facts = approval.facts
    if facts is None:
        return "the request names no facts to check against this VM's IMDS document (upgrade the coordinator)"
    differences = facts.differences(event)
    if differences:
        return "facts differ from this VM's IMDS document: " + "; ".join(differences)
    if vm_name in facts.hooksRequired:
        outcome = prepare_outcome(event.EventId) if prepare_outcome is not None else None
        if outcome != "succeeded":
            return (
                f"the decision rested on {vm_name}'s prepare hooks, and its own ledger says "
                f"{outcome or 'they have not finished'}"
            )
    return None


def judge(
    approval: ApprovalRequest,
    document: ScheduledEventsDocument,
    *,
    vm_name: str,
    prepare_outcome: PrepareLedger | None = None,
) -> tuple[ApprovalOutcome, str]:
    """Whether the event may be approved on this VM (`vm_name`: its IMDS compute name), on a fresh document.
    `prepare_outcome(event_id)` reads this VM's own hook ledger: the prepare phase's outcome, None if not finished."""
    event = document.event(approval.eventId)
    if event is None:
        return "not-found", "the event is not in this VM's scheduled-events document"
    if event.EventStatus != "Scheduled":
        return "not-scheduled", f"the event is {event.EventStatus}"
    if not event.Resources:
        return "rejected", "the event names no Resources, so its reach is unknown"
    if event.EventType == "Terminate" and not event.concerns(vm_name):
        deleted = ", ".join(event.Resources)
        return "rejected", (
            f"Terminate of {deleted} can be approved only by {' or '.join(event.Resources)} itself, not by "
            f"{vm_name} (Azure: each VM approves only the EventId relevant to it)"
        )
    refusal = refuse_facts(approval, event, vm_name=vm_name, prepare_outcome=prepare_outcome)
    if refusal is not None:
        return "rejected", refusal
    return "approved", ""


# ----------------------------------------------------------------------------------------------- handler


@dataclass(frozen=True)
class _Decision:
    eventId: str
    expiresAt: datetime
    result: ApprovalResult


class _Refusal(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
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
        approval = ApprovalRequest.model_validate_json(request.body)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in item['loc']) or 'body'}: {item['msg']}" for item in error.errors()[:5]
        )
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
        max_decisions: int = 10_000,
        tracer: trace.Tracer | None = None,
        attest: Callable[[str], Attestation] | None = None,
    ) -> None:
        self._imds = imds
        self._vm_name = vm_name  # this VM's IMDS compute name: a Terminate must name it
        self._prepare_outcome = prepare_outcome  # this VM's own hook ledger
        self._freshness = freshness or Freshness()
        self._clock = clock
        self._max_decisions = max_decisions
        self._tracer = tracer or IdTracer()  # the forwarder's (forwarder/telemetry.py); ids only by default
        # IMDS's attested document for a nonce (ImdsClient.get_attestation): each answer proves this VM gave it.
        self._attest = attest
        # One approval at a time: the IMDS calls are quick, and serialising makes "approve once per decision" exact.
        self._lock = threading.Lock()
        self._decisions: OrderedDict[str, _Decision] = OrderedDict()
        self.imds_posts = 0

    def __call__(self, request: RelayRequest) -> RelayResponse:
        with self._tracer.start_as_current_span(
            "listener.approve", context=parent(request.headers), kind=trace.SpanKind.SERVER
        ) as span:
            response = self._answer(request, span)
            span.set_attribute("http.response.status_code", response.status_code)
            return response

    def _answer(self, request: RelayRequest, span: trace.Span) -> RelayResponse:
        started = time.perf_counter()
        record: dict[str, object] = {"requestId": request.id, "method": request.method, "path": request.path}
        try:
            approval = _parse(request)
            record.update(eventId=approval.eventId, decisionId=approval.decisionId, rule=approval.rule)
            span.set_attribute("scheduled_events.event_id", approval.eventId)
            span.set_attribute("scheduled_events.decision_id", approval.decisionId)
            # The proof first: a VM whose delete this approval starts has no IMDS a moment after StartRequests.
            proof = self._proof(approval.decisionId)
            result, replayed = self._decide(approval)
        except _Refusal as refusal:
            record.update(status=refusal.status, reason=refusal.reason)
            # 503: IMDS could not be asked (the sender retries); 4xx: the request could not be evaluated.
            span.set_attribute("scheduled_events.outcome", "unavailable" if refusal.status == 503 else "refused")
            log.warning("approval request refused", extra=fields(**record, ms=_ms(started)))
            return RelayResponse.json(refusal.status, {"error": refusal.reason})
        if proof is not None:
            result = result.model_copy(update={"attestation": proof})
        record.update(status=200, outcome=result.outcome, incarnation=result.documentIncarnation, idempotent=replayed)
        span.set_attribute("scheduled_events.outcome", result.outcome)
        span.set_attribute("scheduled_events.idempotent", replayed)
        if result.reason:
            record["reason"] = result.reason
        log.info("approval request answered", extra=fields(**record, ms=_ms(started)))
        return RelayResponse(200, "OK", {"Content-Type": "application/json"}, result.model_dump_json().encode())

    def _decide(self, approval: ApprovalRequest) -> tuple[ApprovalResult, bool]:
        with self._lock:
            now = self._clock()
            self._prune(now)
            prior = self._decisions.get(approval.decisionId)
            if prior is not None and prior.eventId != approval.eventId:
                reason = f"decisionId {approval.decisionId!r} was already used for event {prior.eventId!r}"
                return self._result(approval, "rejected", reason, None), False
            if prior is not None and prior.result.outcome == "approved":
                return prior.result, True
            stale = refuse_stale(approval, now=now, freshness=self._freshness)
            if stale is not None:
                return self._remember(approval, self._result(approval, "rejected", stale, None)), False
            with self._tracer.start_as_current_span("listener.imds_get", kind=trace.SpanKind.CLIENT) as get:
                document = self._imds_call(self._imds.get_document)
                get.set_attribute("scheduled_events.incarnation", document.DocumentIncarnation)
            outcome, reason = judge(approval, document, vm_name=self._vm_name, prepare_outcome=self._prepare_outcome)
            if outcome == "approved":
                with self._tracer.start_as_current_span(
                    "listener.start_requests",
                    kind=trace.SpanKind.CLIENT,
                    attributes={"scheduled_events.event_id": approval.eventId},
                ):
                    self._imds_call(lambda: self._imds.approve([approval.eventId]))
                self.imds_posts += 1
            result = self._result(approval, outcome, reason, document.DocumentIncarnation)
            return self._remember(approval, result), False

    def _proof(self, decision_id: str) -> Attestation | None:
        """IMDS's attested document for the decision (contracts.attestation.decision_nonce), which the answer carries:
        the coordinator then knows this VM answered, not another instance listening on this hybrid connection.
        Without one (IMDS refused it) the answer goes as it is, and a coordinator requiring proof sends again."""
        if self._attest is None:
            return None
        try:
            return self._attest(decision_nonce(decision_id))
        except (ImdsError, ValueError) as error:
            log.warning("approval answer without proof", extra=fields(decisionId=decision_id, error=str(error)))
            return None

    @staticmethod
    def _imds_call(call: Callable[[], _T]) -> _T:
        try:
            return call()
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

    def _remember(self, approval: ApprovalRequest, result: ApprovalResult) -> ApprovalResult:
        self._decisions[approval.decisionId] = _Decision(approval.eventId, approval.expiresAt, result)
        self._decisions.move_to_end(approval.decisionId)
        while len(self._decisions) > self._max_decisions:
            self._decisions.popitem(last=False)
        return result

    def _prune(self, now: datetime) -> None:
        # Once past expiry (plus skew) a request is refused on its own dates, so its decision need not be kept.
        horizon = now - self._freshness.clock_skew
        expired = [key for key, decision in self._decisions.items() if decision.expiresAt < horizon]
        for key in expired:
            del self._decisions[key]


def _ms(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 2)
