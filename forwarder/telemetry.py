"""The forwarder's tracing: one W3C trace per change, carried to the coordinator and back to the listener.

Takes: the `telemetry_spans_file` setting (None = export off). Gives: `Telemetry`, with the tracer the daemon
and the listener use (`tracer`), `traceparent(span)` to put a span's context on the wire, `parent(headers)` to
continue a context read from the wire, and `send_spans(...)` around a send of spooled envelopes.
With export on, each finished span is appended to the spans file as one JSON line (`span_line`; format in
docs/forwarder.md).

Why two tracers. The trace context must exist even with export off: the forwarder's trace id is the one the
coordinator's and the listener's spans join, so an id-less no-op tracer would break the trace downstream.
`IdTracer` gives every span valid random W3C ids and records nothing; it needs only `opentelemetry-api`.
`RecordingTracer` gives the same ids and writes each span as it ends. Why not the OpenTelemetry SDK for that (as
before): it cost a recording forwarder about 1.9 MiB (it loads psutil, the metrics API and the semantic
conventions) for a line per span, a few spans per change; the daemon must stay as small as a bare poller
(docs/forwarder.md, *Footprint*). The spans are the API's (`trace.Span`), so `use_span`, the propagator and the
listener's spans work on them unchanged.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util import types

from forwarder.durable_state import SpooledEnvelope

SERVICE_NAME = "scheduled-events-forwarder"
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
_PROPAGATOR = TraceContextTextMapPropagator()
# Sampled, so that a coordinator with a parent-based sampler records its part of a trace the forwarder began.
_SAMPLED = trace.TraceFlags(trace.TraceFlags.SAMPLED)


class IdTracer(trace.NoOpTracer):
    """Spans with valid random W3C ids that record nothing: the context travels, nothing is exported.

    A child keeps its parent's trace id (and flags and tracestate); a root gets a new trace id, sampled. The
    no-op tracer's `start_as_current_span` calls this `start_span`.
    """

    def start_span(  # noqa: PLR0917 - the API's signature
        self,
        name: str,
        context: Context | None = None,
        kind: trace.SpanKind = trace.SpanKind.INTERNAL,
        attributes: types.Attributes = None,
        links: trace._Links = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> trace.Span:
        above = trace.get_current_span(context).get_span_context()
        span_id = random.getrandbits(64) or 1  # 0 is the invalid id
        if above.is_valid:
            span_context = trace.SpanContext(above.trace_id, span_id, False, above.trace_flags, above.trace_state)
        else:
            trace_id = random.getrandbits(128) or 1
            span_context = trace.SpanContext(trace_id, span_id, is_remote=False, trace_flags=_SAMPLED)
        return self._span(name, span_context, above, start_time, attributes)

    def _span(
        self,
        name: str,
        ids: trace.SpanContext,
        above: trace.SpanContext,
        start_time: int | None,
        attributes: types.Attributes,
    ) -> trace.Span:
        """The span for these ids (``above``: the parent's, invalid for a root); this tracer records nothing."""
        return trace.NonRecordingSpan(ids)


class RecordedSpan(trace.NonRecordingSpan):
    """A span that keeps its name, parent, times and attributes, and is written (``on_end``) when it ends."""

    def __init__(
        self,
        name: str,
        context: trace.SpanContext,
        *,
        parent: trace.SpanContext | None,
        start_time: int,
        attributes: types.Attributes,
        on_end: Callable[[RecordedSpan], None],
    ) -> None:
        super().__init__(context)
        self.name = name
        self.parent = parent
        self.start_time = start_time
        self.end_time: int | None = None
        self.attributes: dict[str, types.AttributeValue] = dict(attributes or {})
        self._on_end = on_end

    def is_recording(self) -> bool:
        return self.end_time is None

    def set_attribute(self, key: str, value: types.AttributeValue) -> None:
        if self.end_time is None:
            self.attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, types.AttributeValue]) -> None:
        for key, value in attributes.items():
            self.set_attribute(key, value)

    def update_name(self, name: str) -> None:
        self.name = name

    def end(self, end_time: int | None = None) -> None:
        if self.end_time is None:
            self.end_time = end_time if end_time is not None else time.time_ns()
            self._on_end(self)


class RecordingTracer(IdTracer):
    """`IdTracer`'s ids, with every span recorded and appended to ``path`` as one JSON line when it ends (the file
    is opened per span: spans are rare, and a rotated or removed file is simply created again)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._lock = threading.Lock()

    def _span(
        self,
        name: str,
        ids: trace.SpanContext,
        above: trace.SpanContext,
        start_time: int | None,
        attributes: types.Attributes,
    ) -> trace.Span:
        return RecordedSpan(
            name,
            ids,
            parent=above if above.is_valid else None,
            start_time=start_time if start_time is not None else time.time_ns(),
            attributes=attributes,
            on_end=self._write,
        )

    def _write(self, span: RecordedSpan) -> None:
        try:
            with self._lock, self._path.open("a", encoding="utf-8") as out:
                out.write(span_line(span) + "\n")
        except OSError:
            pass  # tracing never stops the forwarder; the next span tries again


def _hex(value: int, width: int) -> str:
    return format(value, f"0{width}x")


def span_line(span: RecordedSpan) -> str:
    """One finished span as the spans file's JSON line (what the local collector reads)."""
    context = span.get_span_context()
    parent = span.parent
    attributes = {k: v for k, v in (span.attributes or {}).items() if isinstance(v, str | bool | int | float)}
    return json.dumps(
        {
            "traceId": _hex(context.trace_id, 32),
            "spanId": _hex(context.span_id, 16),
            "parentSpanId": _hex(parent.span_id, 16) if parent is not None else "",
            "name": span.name,
            "service": SERVICE_NAME,
            "startTimeUnixNano": span.start_time,
            "endTimeUnixNano": span.end_time,
            "attributes": attributes,
        },
        separators=(",", ":"),
    )


class Telemetry:
    """The tracer and its lifetime. `Telemetry()` records nothing (ids only); `Telemetry(spans_file=PATH)`
    records every span and appends it to PATH when it ends (synchronously: no export thread, no queue to lose on a
    kill)."""

    def __init__(self, *, spans_file: Path | None = None) -> None:
        self.spans_file = spans_file
        if spans_file is None:
            self.tracer: trace.Tracer = IdTracer()
            return
        spans_file.parent.mkdir(parents=True, exist_ok=True)
        self.tracer = RecordingTracer(spans_file)


def traceparent(span: trace.Span) -> tuple[str, str]:
    """The span's context as W3C headers: (traceparent, tracestate); tracestate is "" when empty."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get(TRACEPARENT, ""), carrier.get(TRACESTATE, "")


def parent(headers: Mapping[str, str]) -> Context:
    """The context to continue from W3C headers (lower-case `traceparent`, `tracestate`); an empty context, so a
    new trace, when there is none or it is invalid."""
    return _PROPAGATOR.extract({k: v for k, v in headers.items() if k in (TRACEPARENT, TRACESTATE) and v})


@contextmanager
def send_spans(
    tracer: trace.Tracer, items: Sequence[SpooledEnvelope], *, vm_name: str
) -> Iterator[list[SpooledEnvelope]]:
    """A `forwarder.send` span around one send, for each item spooled with a trace context (a child of it).
    Yields the items as they go on the wire: each traced one carrying its send span's context, so that the
    coordinator's spans hang under the send that delivered the envelope. A failed send ends them with the error."""
    spans: list[trace.Span] = []
    outgoing: list[SpooledEnvelope] = []
    for item in items:
        if not item.traceparent:
            outgoing.append(item)
            continue
        span = tracer.start_span(
            "forwarder.send",
            context=parent({TRACEPARENT: item.traceparent, TRACESTATE: item.tracestate}),
            kind=trace.SpanKind.PRODUCER,
            attributes={"vm.name": vm_name, "scheduled_events.sequence": item.sequence},
        )
        spans.append(span)
        sent_parent, sent_state = traceparent(span)
        outgoing.append(replace(item, traceparent=sent_parent, tracestate=sent_state))
    try:
        yield outgoing
    except Exception as exc:
        for span in spans:
            span.set_attribute("error.type", type(exc).__name__)
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)[:256]))
        raise
    finally:
        for span in spans:
            span.end()
