"""The forwarder's tracing: one W3C trace per change, carried to the coordinator and back to the listener.

Takes: the `telemetry_spans_file` setting (None = export off). Gives: `Telemetry`, with the tracer the daemon
and the listener use (`tracer`), `traceparent(span)` to put a span's context on the wire, `parent(headers)` to
continue a context read from the wire, `send_spans(...)` around a send of spooled envelopes, and `shutdown()`.
With export on, each finished span is appended to the spans file as one JSON line (`span_line`; format in
docs/forwarder.md).

Why two tracers. The trace context must exist even with export off: the forwarder's trace id is the one the
coordinator's and the listener's spans join, so an id-less no-op tracer would break the trace downstream.
`IdTracer` gives every span valid random W3C ids and records nothing; it needs only `opentelemetry-api`
(~0.2 MiB). Recording needs `opentelemetry-sdk` (~0.9 MiB more, measured in benchmarks/forwarder_footprint.py),
imported only when a spans file is configured, so a forwarder with telemetry off never loads it.
"""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util import types

from forwarder.durable_state import SpooledEnvelope

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

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
        return trace.NonRecordingSpan(span_context)


def _hex(value: int, width: int) -> str:
    return format(value, f"0{width}x")


def span_line(span: ReadableSpan) -> str:
    """One finished span as the spans file's JSON line (what the local collector reads)."""
    context = span.get_span_context()
    assert context is not None  # an SDK span always has one
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


def _exporter(path: Path) -> SpanExporter:
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult  # noqa: PLC0415 - export is on

    class JsonLinesSpanExporter(SpanExporter):
        """Appends each span as one JSON line; the file is opened per export (spans are rare: a change, an
        approval), so a rotated or removed file is simply created again."""

        def __init__(self) -> None:
            self._lock = threading.Lock()

        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            text = "".join(span_line(span) + "\n" for span in spans)
            try:
                with self._lock, path.open("a", encoding="utf-8") as out:
                    out.write(text)
            except OSError:
                return SpanExportResult.FAILURE
            return SpanExportResult.SUCCESS

    return JsonLinesSpanExporter()


class Telemetry:
    """The tracer and its lifetime. `Telemetry()` records nothing (ids only); `Telemetry(spans_file=PATH)`
    records every span with the OpenTelemetry SDK and appends it to PATH when it ends."""

    def __init__(self, *, spans_file: Path | None = None) -> None:
        self.spans_file = spans_file
        self._provider: SdkTracerProvider | None = None
        if spans_file is None:
            self.tracer: trace.Tracer = IdTracer()
            return
        # Only here: a forwarder with telemetry off never imports the SDK.
        from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
        from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: PLC0415

        spans_file.parent.mkdir(parents=True, exist_ok=True)
        # Resource(...) rather than Resource.create(): no resource detectors, no entry-point scan at start.
        provider = TracerProvider(resource=Resource({"service.name": SERVICE_NAME}), shutdown_on_exit=False)
        # Synchronous: a line per span, a few per change; no export thread, no queue to lose on a kill.
        provider.add_span_processor(SimpleSpanProcessor(_exporter(spans_file)))
        self._provider = provider
        self.tracer = provider.get_tracer("forwarder")

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()


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
