"""The coordinator's telemetry: every metric instrument and span it records, on the OpenTelemetry API alone.

The stages call the functions here where the data already is (ingest: batch age; fold: forwarder health; decide: the
decision's span; act: the approval's span, latency and notice; outbox: cards; timer: the fleet's census; record: what
the history rows say happened). Without an SDK configured these calls cost next to nothing (the API's no-op
providers); function_app.py configures the Azure Monitor distro once when ``APPLICATIONINSIGHTS_CONNECTION_STRING`` is
set, and ``python -m local`` collects the same telemetry in-process (local/telemetry.py). Metric names, units and
attributes are a contract with the workbook (infra/build_workbook.py) and docs/operations.md, *Telemetry*.

Traces: each approval is one trace, started by the forwarder that first reported the event (``forwarder.detect``);
its W3C ``traceparent`` arrives in the Event Hubs message's application properties, is kept on the event record
(``EventRecord.traceparent``), and the coordinator's ``coordinator.decide`` and ``coordinator.approval`` spans are its
children; the Relay request carries it on to the VM's listener (``inject``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from datetime import datetime

from opentelemetry import metrics, propagate, trace
from opentelemetry.context import Context as TraceContext
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from contracts.envelope import ForwarderHealth, VmIdentity
from coordinator.domain.rows import HistoryRow

SERVICE_NAME = "scheduled-events-coordinator"
SCOPE = "coordinator"
# "00-" + 32 hex trace id + "-" + 16 hex span id + "-" + 2 hex flags.
TRACEPARENT_CHARS = 55
# The attribute names of the spans and metrics (the forwarder's spans use the same event id and decision id names).
EVENT_ID = "scheduled_events.event_id"
DECISION_ID = "scheduled_events.decision_id"
EVENT_TYPE = "scheduled_events.event_type"
STATE = "scheduled_events.state"
RULE = "scheduled_events.rule"
VERDICT = "scheduled_events.verdict"
OUTCOME = "scheduled_events.outcome"
VM = "scheduled_events.vm"
SCALE_SET = "scheduled_events.scale_set"
KIND = "scheduled_events.alert_kind"
CONDITION = "scheduled_events.condition"
REASON = "scheduled_events.reason"
ATTRIBUTES = frozenset(
    {EVENT_ID, DECISION_ID, EVENT_TYPE, STATE, RULE, VERDICT, OUTCOME, VM, SCALE_SET, KIND, CONDITION, REASON}
    | {"scheduled_events.action", "scheduled_events.dry_run"}
)

_tracer = trace.get_tracer(SCOPE)
_meter = metrics.get_meter(SCOPE)
_W3C = TraceContextTextMapPropagator()
# Every metric's name and unit, in the order declared (the workbook's queries and docs/coordinator.md use these).
METRICS: dict[str, str] = {}


def _counter(name: str, unit: str, description: str) -> metrics.Counter:
    METRICS[name] = unit
    return _meter.create_counter(name, unit=unit, description=description)


# The API's synchronous gauge type is named _Gauge (what create_gauge returns); there is no public alias.
def _gauge(name: str, unit: str, description: str) -> metrics._Gauge:
    METRICS[name] = unit
    return _meter.create_gauge(name, unit=unit, description=description)


def _histogram(name: str, unit: str, description: str) -> metrics.Histogram:
    METRICS[name] = unit
    return _meter.create_histogram(name, unit=unit, description=description)


EVENTS_DETECTED = _counter(
    "scheduled_events.events.detected",
    "{event}",
    "Events first reported by a VM, by type",
)
TRANSITIONS = _counter(
    "scheduled_events.events.transitions",
    "{transition}",
    "Event state changes, by type and new state",
)
OPEN_EVENTS = _gauge(
    "scheduled_events.events.open",
    "{event}",
    "Open events at the timer's last run, by type and state",
)
DECISIONS = _counter(
    "scheduled_events.decisions",
    "{decision}",
    "Decisions made (or changed), by rule and verdict",
)
APPROVAL_LATENCY = _histogram(
    "scheduled_events.approval.latency",
    "s",
    "From the event's first report to the listener's 'approved', by type and rule",
)
NOTICE_LEFT = _histogram(
    "scheduled_events.approval.notice_left",
    "s",
    "NotBefore minus the time of approval, by type",
)
APPROVALS_REFUSED = _counter(
    "scheduled_events.approvals.refused",
    "{approval}",
    "Approvals the VM's listener refused, by rule",
)
EXPIRED = _counter(
    "scheduled_events.events.expired_unapproved",
    "{event}",
    "Events whose NotBefore passed unapproved",
)
DEAD_LETTERS = _counter(
    "scheduled_events.dead_letters",
    "{message}",
    "Messages or observations set aside, by reason",
)
BATCH_AGE = _histogram(
    "scheduled_events.batch.age",
    "s",
    "From a message's enqueuing in Event Hubs to its processing",
)
ALERTS = _counter(
    "scheduled_events.alerts",
    "{card}",
    "Cards posted, by kind and outcome (sent | failed)",
)
VMS = _gauge(
    "scheduled_events.vms",
    "{vm}",
    "VMs at the timer's last run by condition: reporting, silent, retired, unhealthy (IMDS failing)",
)
VM_CONDITIONS = _counter(
    "scheduled_events.vm.conditions",
    "{vm}",
    "VM conditions noticed (Heartbeat rows): lost, resumed, retired, reset, conflict, imds-failing, imds-recovered",
)
POLL_AGE = _gauge(
    "scheduled_events.forwarder.poll_age",
    "s",
    "Per VM: from the forwarder's last good IMDS poll to its latest heartbeat (-1: none since start)",
)
POLL_ERRORS = _gauge(
    "scheduled_events.forwarder.consecutive_poll_errors",
    "{poll}",
    "Per VM: failed polls in a row",
)
SPOOL_DEPTH = _gauge(
    "scheduled_events.forwarder.spool_depth",
    "{envelope}",
    "Per VM: envelopes waiting to be sent",
)
DROPPED = _gauge(
    "scheduled_events.forwarder.dropped",
    "{envelope}",
    "Per VM: envelopes the forwarder's bounded spool evicted since it was made",
)
STATE_FULL = _gauge(
    "scheduled_events.forwarder.state_full",
    "s",
    "Per VM: how long the forwarder's state directory has been full at its latest heartbeat (0: it can write)",
)
IMPACT = _histogram(
    "scheduled_events.impact.measured",
    "s",
    "What events did to VMs, measured (Impact rows): a Freeze's pause, a Reboot's downtime, how long a removed VM "
    "was heard after its removal began; by type and measure",
)

# The conditions of the census gauge: each is set every run, zero included, so a condition that ended reads 0.
VM_CENSUS = ("reporting", "silent", "retired", "unhealthy")
_open_series: set[tuple[str, str]] = set()


# ---- traces ------------------------------------------------------------------------------------------------------


def context_of(traceparent: str, tracestate: str = "") -> TraceContext | None:
    """The remote span context a W3C ``traceparent`` names; None when it is empty or malformed (a forwarder's word,
    never trusted to be well-formed)."""
    if not traceparent:
        return None
    carrier = {"traceparent": traceparent[:TRACEPARENT_CHARS]}
    if tracestate:
        carrier["tracestate"] = tracestate[:512]
    context = _W3C.extract(carrier)
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def valid_traceparent(traceparent: str | None) -> str:
    """``traceparent`` (its 55 characters of version 00) when it parses as W3C trace context, else "": the event
    record keeps only a valid one, of bounded size."""
    return traceparent[:TRACEPARENT_CHARS] if traceparent and context_of(traceparent) is not None else ""


def _link(traceparent: str, tracestate: str) -> Link | None:
    context = context_of(traceparent, tracestate)
    return Link(trace.get_current_span(context).get_span_context()) if context is not None else None


@contextmanager
def batch_span(size: int, contexts: Iterable[tuple[str, str]]) -> Iterator[Span]:
    """``coordinator.batch``: one batch of Event Hubs messages (OpenTelemetry messaging conventions for a batch
    receive: not a child of any message, since they belong to many traces, but linked to each message's context;
    under the host's invocation span when the host traces)."""
    links = [link for parent, state in contexts if (link := _link(parent, state)) is not None]
    with _tracer.start_as_current_span(
        "coordinator.batch",
        kind=SpanKind.CONSUMER,
        links=links,
        attributes={
            "messaging.system": "eventhubs",
            "messaging.operation.type": "process",
            "messaging.batch.message_count": size,
        },
    ) as span:
        yield span


def decided(
    traceparent: str,
    *,
    started_ns: int,
    event_id: str,
    event_type: str,
    rule: str,
    verdict: str,
    action: str,
    dry_run: bool,
) -> None:
    """``coordinator.decide``, a child of the event's trace (of the batch or tick deciding it when the event has no
    trace): one span per decision made or changed (from when the evaluation started), not per re-evaluation that
    finds the same."""
    span = _tracer.start_span(
        "coordinator.decide",
        context=context_of(traceparent),
        start_time=started_ns,
        attributes={
            EVENT_ID: event_id,
            EVENT_TYPE: event_type,
            RULE: rule,
            VERDICT: verdict,
            "scheduled_events.action": action,
            "scheduled_events.dry_run": dry_run,
        },
    )
    span.end()


def now_ns() -> int:
    return time.time_ns()


@contextmanager
def approval_span(traceparent: str, *, event_id: str, decision_id: str, vm: str) -> Iterator[Span]:
    """``coordinator.approval``, a child of the event's trace, around one approval's delivery (the Relay request
    inside it carries the span on to the listener: ``inject``)."""
    with _tracer.start_as_current_span(
        "coordinator.approval",
        context=context_of(traceparent),
        kind=SpanKind.CLIENT,
        attributes={EVENT_ID: event_id, DECISION_ID: decision_id, VM: vm},
        record_exception=True,
        set_status_on_exception=True,
    ) as span:
        yield span


def approval_answered(span: Span, outcome: str) -> None:
    span.set_attribute(OUTCOME, outcome)
    if outcome not in ("approved", "not-scheduled"):
        span.set_status(Status(StatusCode.ERROR, outcome))


def inject(headers: MutableMapping[str, str]) -> None:
    """Adds the current span's ``traceparent`` (and ``tracestate``) to an outgoing request's headers. Without an SDK
    the current span is the event's remote context itself, so the listener still joins the forwarder's trace."""
    propagate.inject(headers)


# ---- metrics -----------------------------------------------------------------------------------------------------


def event_detected(event_type: str) -> None:
    EVENTS_DETECTED.add(1, {EVENT_TYPE: event_type})


def message_age(enqueued: datetime | None, now: datetime) -> None:
    if enqueued is not None:
        BATCH_AGE.record(max(0.0, (now - enqueued).total_seconds()))


def approved(event_type: str, rule: str, *, detected: datetime, not_before: datetime | None, now: datetime) -> None:
    """The listener answered 'approved' for an event still Scheduled: how long since it was first reported, and how
    much of its notice was left."""
    APPROVAL_LATENCY.record(max(0.0, (now - detected).total_seconds()), {EVENT_TYPE: event_type, RULE: rule})
    if not_before is not None:
        NOTICE_LEFT.record((not_before - now).total_seconds(), {EVENT_TYPE: event_type})


def alert(kind: str, outcome: str) -> None:
    ALERTS.add(1, {KIND: kind, OUTCOME: outcome})


def _reason_class(reason: str) -> str:
    """A dead letter's reason without its particulars ('invalid envelope', 'refused', 'processing failed', …), so
    the attribute has few values."""
    return reason.split(":", 1)[0][:40]


def history_written(rows: Iterable[HistoryRow]) -> None:
    """Counts what the history rows say happened: the rows are the one account of it, so the metrics and the history
    cannot disagree (and a row is counted once, by the writer that committed it)."""
    for row in rows:
        if row.RecordType == "Transition":
            TRANSITIONS.add(1, {EVENT_TYPE: row.EventType, STATE: row.State})
            if row.State == "Expired":
                EXPIRED.add(1, {EVENT_TYPE: row.EventType})
        elif row.RecordType == "Decision":
            DECISIONS.add(1, {RULE: row.Rule, VERDICT: row.Outcome, "scheduled_events.dry_run": bool(row.DryRun)})
        elif row.RecordType == "Approval" and row.Outcome == "rejected":
            APPROVALS_REFUSED.add(1, {RULE: row.Rule, EVENT_TYPE: row.EventType})
        elif row.RecordType == "DeadLetter":
            DEAD_LETTERS.add(1, {REASON: _reason_class(row.Reason)})
        elif row.RecordType == "Heartbeat":
            VM_CONDITIONS.add(1, {CONDITION: row.Outcome})
        elif row.RecordType == "Impact" and row.MeasuredSeconds is not None:
            IMPACT.record(
                row.MeasuredSeconds, {EVENT_TYPE: row.EventType, "scheduled_events.impact": row.ImpactMeasure}
            )


def forwarder_health(vm: VmIdentity, health: ForwarderHealth, at: datetime) -> None:
    """What a heartbeat says of its forwarder, per VM (the workbook lists the worst)."""
    attributes = {VM: vm.name, SCALE_SET: vm.vmScaleSetName}
    age = health.poll_age_seconds(at)
    if age is not None:  # no good poll yet (e.g. the start-up heartbeat): no age to report, the poll errors tell
        POLL_AGE.set(age, attributes)
    POLL_ERRORS.set(health.consecutivePollErrors, attributes)
    SPOOL_DEPTH.set(health.spoolDepth, attributes)
    DROPPED.set(health.dropped, attributes)
    full = health.stateFullSince
    STATE_FULL.set(max(0.0, (at - full).total_seconds()) if full is not None else 0.0, attributes)


def census(vms: Mapping[str, int], open_events: Mapping[tuple[str, str], int]) -> None:
    """The timer's count of VMs by condition and of open events by (type, state); a series that emptied reads 0."""
    for condition in VM_CENSUS:
        VMS.set(vms.get(condition, 0), {CONDITION: condition})
    _open_series.update(open_events)
    for event_type, state in sorted(_open_series):
        OPEN_EVENTS.set(open_events.get((event_type, state), 0), {EVENT_TYPE: event_type, STATE: state})
