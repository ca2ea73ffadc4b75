"""The forwarder's tracing: one W3C trace per change, carried to the coordinator and back to the listener.

Takes: the `telemetry_spans_file` setting (None = export off). Gives: `Telemetry`, with the tracer the daemon
and the listener use (`tracer`), `traceparent(span)` to put a span's context on the wire, `parent(headers)` to
continue a context read from the wire, `current()` (the context a thread hands to another), `use_span` and
`send_spans(...)` around a send of spooled envelopes. With export on, each finished span is appended to the spans
file as one JSON line (`span_line`; format in docs/forwarder.md).

Why the trace context is kept even with export off: the forwarder's trace id is the one the coordinator's and the
listener's spans join, so every span gets valid random W3C ids whether or not it is recorded.

Why not OpenTelemetry here (the coordinator uses it): the forwarder needs a W3C `traceparent`/`tracestate` pair,
random ids, a current span per thread and a line per finished span, a few spans per change. The OpenTelemetry API
alone (with `typing-extensions`, which it loads) stayed resident at 0.96 MiB in a daemon that must stay as small as
a bare poller (docs/forwarder.md, *Footprint*; `python -m benchmarks.forwarder_footprint`), and the SDK before it
cost 1.9 MiB. The wire format is the W3C Trace Context recommendation's, parsed as the OpenTelemetry propagator
parses it (tests/forwarder/test_trace_context.py holds the two to the same answers).
"""

from __future__ import annotations

import contextvars
import json
import random
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from forwarder.durable_state import SpooledEnvelope

__all__ = [
    "INVALID",
    "SERVICE_NAME",
    "TRACEPARENT",
    "TRACESTATE",
    "IdTracer",
    "RecordingTracer",
    "Span",
    "SpanContext",
    "Telemetry",
    "Tracer",
    "current",
    "parent",
    "send_spans",
    "span_line",
    "traceparent",
    "use_span",
]

SERVICE_NAME = "scheduled-events-forwarder"
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
SAMPLED = 0x01
# W3C Trace Context, section 3.2 (traceparent) and 3.3 (tracestate), as opentelemetry-api's propagator reads them.
_TRACEPARENT = re.compile(r"^[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?[ \t]*$")
_KEY = r"[a-z][_0-9a-z\-\*\/]{0,255}|[a-z0-9][_0-9a-z\-\*\/]{0,240}@[a-z][_0-9a-z\-\*\/]{0,13}"
_VALUE = r"[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
_MEMBER = re.compile(f"^[ \t]*({_KEY})=({_VALUE})[ \t]*$")
MAX_TRACESTATE_MEMBERS, MAX_TRACESTATE_CHARS = 32, 8192

Attributes = Mapping[str, str | bool | int | float]


@dataclass(frozen=True, slots=True)
class SpanContext:
    """What travels: the trace and span ids, the trace flags and the vendors' tracestate ("" when none)."""

    trace_id: int
    span_id: int
    trace_flags: int = SAMPLED
    trace_state: str = ""

    @property
    def is_valid(self) -> bool:
        return self.trace_id != 0 and self.span_id != 0


# No span: a span started under it is a root (a new trace).
INVALID = SpanContext(0, 0, 0)
_CURRENT: contextvars.ContextVar[SpanContext] = contextvars.ContextVar("forwarder_span", default=INVALID)


class Span:
    """A span's ids and, when its tracer records (``on_end``), its name, parent, times and attributes, written
    when it ends."""

    __slots__ = ("_on_end", "attributes", "context", "end_time", "name", "parent", "start_time")

    def __init__(
        self,
        name: str,
        context: SpanContext,
        *,
        parent: SpanContext | None,
        start_time: int,
        attributes: Attributes | None,
        on_end: Callable[[Span], None] | None,
    ) -> None:
        self.name = name
        self.context = context
        self.parent = parent
        self.start_time = start_time
        self.end_time: int | None = None
        self.attributes: dict[str, str | bool | int | float] = dict(attributes or {}) if on_end else {}
        self._on_end = on_end

    def is_recording(self) -> bool:
        return self._on_end is not None and self.end_time is None

    def set_attribute(self, key: str, value: str | bool | int | float) -> None:
        if self.is_recording():
            self.attributes[key] = value

    def end(self, end_time: int | None = None) -> None:
        if self.end_time is None:
            self.end_time = end_time if end_time is not None else time.time_ns()
            if self._on_end is not None:
                self._on_end(self)


class Tracer:
    """Spans with valid random W3C ids. A child keeps its parent's trace id, flags and tracestate; a root gets a new
    trace id, sampled (so that a coordinator with a parent-based sampler records its part of the trace). Records
    nothing unless given ``record`` (called with each span as it ends)."""

    def __init__(self, record: Callable[[Span], None] | None = None) -> None:
        self._record = record

    def start_span(
        self,
        name: str,
        *,
        parent: SpanContext | None = None,
        start_time: int | None = None,
        attributes: Attributes | None = None,
    ) -> Span:
        """A span under ``parent`` (the current span's when None; ``INVALID``: a root, whatever is current)."""
        above = current() if parent is None else parent
        span_id = random.getrandbits(64) or 1  # 0 is the invalid id
        if above.is_valid:
            ids = SpanContext(above.trace_id, span_id, above.trace_flags, above.trace_state)
        else:
            ids = SpanContext(random.getrandbits(128) or 1, span_id)
        return Span(
            name,
            ids,
            parent=above if above.is_valid else None,
            start_time=start_time if start_time is not None else time.time_ns(),
            attributes=attributes,
            on_end=self._record,
        )

    @contextmanager
    def start_as_current_span(
        self, name: str, *, parent: SpanContext | None = None, attributes: Attributes | None = None
    ) -> Iterator[Span]:
        """A span, current inside the block, ended after it."""
        with use_span(self.start_span(name, parent=parent, attributes=attributes)) as span:
            yield span


class IdTracer(Tracer):
    """Ids only: the context travels, nothing is recorded."""


class RecordingTracer(Tracer):
    """Every span appended to ``path`` as one JSON line when it ends (the file is opened per span: spans are rare,
    and a rotated or removed file is simply created again)."""

    def __init__(self, path: Path) -> None:
        super().__init__(record=self._write)
        self._path = path
        self._lock = threading.Lock()

    def _write(self, span: Span) -> None:
        try:
            with self._lock, self._path.open("a", encoding="utf-8") as out:
                out.write(span_line(span) + "\n")
        except OSError:
            pass  # tracing never stops the forwarder; the next span tries again


@contextmanager
def use_span(span: Span) -> Iterator[Span]:
    """``span`` current inside the block (its children's parent, what ``current`` gives), ended after it; an
    exception leaving the block is noted on it (``error.type``)."""
    token = _CURRENT.set(span.context)
    try:
        yield span
    except BaseException as exc:
        span.set_attribute("error.type", type(exc).__name__)
        raise
    finally:
        _CURRENT.reset(token)
        span.end()


def current() -> SpanContext:
    """The current span's context in this thread (``INVALID`` when none): what a thread started for the span's work
    passes as ``parent``."""
    return _CURRENT.get()


def span_line(span: Span) -> str:
    """One finished span as the spans file's JSON line (what the local collector reads)."""
    context = span.context
    attributes = {k: v for k, v in span.attributes.items() if isinstance(v, str | bool | int | float)}
    return json.dumps(
        {
            "traceId": format(context.trace_id, "032x"),
            "spanId": format(context.span_id, "016x"),
            "parentSpanId": format(span.parent.span_id, "016x") if span.parent is not None else "",
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
            self.tracer: Tracer = IdTracer()
            return
        spans_file.parent.mkdir(parents=True, exist_ok=True)
        self.tracer = RecordingTracer(spans_file)


def traceparent(span: Span) -> tuple[str, str]:
    """The span's context as W3C headers: (traceparent, tracestate); tracestate is "" when empty, both "" for a span
    without valid ids."""
    context = span.context
    if not context.is_valid:
        return "", ""
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}", context.trace_state


def parent(headers: Mapping[str, str]) -> SpanContext:
    """The context to continue from W3C headers (lower-case `traceparent`, `tracestate`); ``INVALID``, so a new
    trace, when there is none or it is malformed. A malformed tracestate is dropped, the traceparent kept."""
    header = headers.get(TRACEPARENT, "")
    match = _TRACEPARENT.search(header) if header else None
    if match is None:
        return INVALID
    version, trace_id, span_id, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest) or trace_id == "0" * 32 or span_id == "0" * 16:
        return INVALID
    return SpanContext(int(trace_id, 16), int(span_id, 16), int(flags, 16), _trace_state(headers.get(TRACESTATE, "")))


def _trace_state(header: str) -> str:
    """The tracestate header's list-members, or "" when it breaks the recommendation's rules (as the OpenTelemetry
    propagator drops it): a malformed member, a key twice, more than 32 members or 8,192 characters."""
    if not header or len(header) > MAX_TRACESTATE_CHARS:
        return ""
    members: list[str] = []
    keys: set[str] = set()
    for item in header.split(","):
        if not item.strip():
            continue
        member = _MEMBER.match(item)
        if member is None or member.group(1) in keys:
            return ""
        keys.add(member.group(1))
        members.append(f"{member.group(1)}={member.group(2)}")
    return ",".join(members) if len(members) <= MAX_TRACESTATE_MEMBERS else ""


@contextmanager
def send_spans(tracer: Tracer, items: Sequence[SpooledEnvelope], *, vm_name: str) -> Iterator[list[SpooledEnvelope]]:
    """A `forwarder.send` span around one send, for each item spooled with a trace context (a child of it).
    Yields the items as they go on the wire: each traced one carrying its send span's context, so that the
    coordinator's spans hang under the send that delivered the envelope. A failed send ends them with the error."""
    spans: list[Span] = []
    outgoing: list[SpooledEnvelope] = []
    for item in items:
        if not item.traceparent:
            outgoing.append(item)
            continue
        span = tracer.start_span(
            "forwarder.send",
            parent=parent({TRACEPARENT: item.traceparent, TRACESTATE: item.tracestate}),
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
        raise
    finally:
        for span in spans:
            span.end()
