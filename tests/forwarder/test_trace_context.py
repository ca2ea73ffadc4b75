"""forwarder.telemetry's W3C trace context, held to opentelemetry-api's propagator (what the coordinator uses, and
what the forwarder used before it stopped loading it): the same headers give the same context, and a span's
context goes on the wire as the propagator writes it. Spans, current spans and the spans file are tested through
the daemon in test_telemetry.py and tests/relay/test_tracing.py."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from forwarder.telemetry import INVALID, IdTracer, SpanContext, current, parent, traceparent, use_span

OTEL = TraceContextTextMapPropagator()
HEX = "0123456789abcdef"


def _otel(headers: dict[str, str]) -> tuple[int, int, int, str] | None:
    context = trace.get_current_span(OTEL.extract(headers)).get_span_context()
    if not context.is_valid:
        return None
    return context.trace_id, context.span_id, int(context.trace_flags), context.trace_state.to_header()


def _ours(headers: dict[str, str]) -> tuple[int, int, int, str] | None:
    context = parent(headers)
    if not context.is_valid:
        return None
    return context.trace_id, context.span_id, context.trace_flags, context.trace_state


def _hex(size: int) -> st.SearchStrategy[str]:
    return st.text(HEX, min_size=size, max_size=size)


# Mostly well-formed headers with one part mutated at a time: where the parsers could disagree.
VERSIONS = st.sampled_from(["00", "01", "cc", "ff", "0", "000", "0A"])
TRACE_IDS = st.one_of(_hex(32), st.just("0" * 32), _hex(31), st.text(HEX + "ABCDEF-", min_size=32, max_size=32))
SPAN_IDS = st.one_of(_hex(16), st.just("0" * 16), _hex(17), st.text(HEX + "G", min_size=16, max_size=16))
FLAGS = st.one_of(_hex(2), st.sampled_from(["0", "001", "zz"]))
TAILS = st.sampled_from(["", "-", "-what-comes-next", " ", "\t", "  x"])
KEYS = st.one_of(
    st.from_regex(r"\A[a-z][_0-9a-z\-\*/]{0,6}\Z"),
    st.from_regex(r"\A[a-z0-9][a-z0-9]{0,4}@[a-z][a-z]{0,3}\Z"),
    st.sampled_from(["Upper", "1abc", "", "a b", "k=v"]),
)
VALUES = st.one_of(st.from_regex(r"\A[\x21-\x2b\x2d-\x3c\x3e-\x7e]{1,8}\Z"), st.sampled_from(["", " x", "a=b", "a,b"]))
MEMBERS = st.builds(lambda k, v, eq: f"{k}{eq}{v}", KEYS, VALUES, st.sampled_from(["=", "=", "=", ""]))
STATES = st.one_of(
    st.none(),
    st.lists(MEMBERS, max_size=5).map(",".join),
    st.lists(MEMBERS, max_size=3).map(" , ".join),
    st.builds(lambda n: ",".join(f"k{i}=v" for i in range(n)), st.integers(30, 34)),
)


HEADERS = st.builds("{}-{}-{}-{}{}".format, VERSIONS, TRACE_IDS, SPAN_IDS, FLAGS, TAILS)


@settings(max_examples=600, deadline=None)
@given(HEADERS, STATES)
def test_headers_give_the_context_the_opentelemetry_propagator_gives(header: str, state: str | None) -> None:
    headers = {"traceparent": header}
    if state is not None:
        headers["tracestate"] = state

    assert _ours(headers) == _otel(headers)


def test_no_header_a_malformed_one_or_an_all_zero_id_starts_a_new_trace() -> None:
    assert parent({}) == INVALID
    assert parent({"traceparent": "garbage"}) == INVALID
    assert parent({"traceparent": f"00-{'0' * 32}-{'1' * 16}-01"}) == INVALID
    assert IdTracer().start_span("root", parent=parent({})).parent is None


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 2**128 - 1), st.integers(1, 2**64 - 1), st.integers(0, 255), STATES)
def test_a_span_goes_on_the_wire_as_the_propagator_writes_its_context(
    trace_id: int, span_id: int, flags: int, state: str | None
) -> None:
    headers = {"traceparent": f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}", "tracestate": state or ""}
    above = parent(headers)
    span = IdTracer().start_span("child", parent=above)
    carrier: dict[str, str] = {}
    otel_span = trace.NonRecordingSpan(
        trace.SpanContext(
            above.trace_id,
            span.context.span_id,
            False,
            trace.TraceFlags(above.trace_flags),
            trace.TraceState.from_header([above.trace_state]) if above.trace_state else None,
        )
    )
    OTEL.inject(carrier, context=trace.set_span_in_context(otel_span))

    assert traceparent(span) == (carrier["traceparent"], carrier.get("tracestate", ""))
    assert span.context.trace_id == trace_id
    assert span.parent == above


def test_a_span_is_current_inside_its_block_only_and_in_its_own_thread_only() -> None:
    tracer = IdTracer()
    seen_elsewhere: list[SpanContext] = []
    with tracer.start_as_current_span("outer") as outer:
        child = tracer.start_span("child")
        thread = threading.Thread(target=lambda: seen_elsewhere.append(current()))
        thread.start()
        thread.join()
    assert child.parent == outer.context
    assert child.context.trace_id == outer.context.trace_id
    assert seen_elsewhere == [INVALID]  # a thread starts with no span: it is handed ``current()`` explicitly
    assert current() == INVALID
    assert tracer.start_span("after").parent is None


def test_a_recorded_span_notes_the_error_that_left_its_block() -> None:
    ended: list[tuple[str, dict[str, object]]] = []
    tracer = IdTracer(record=lambda span: ended.append((span.name, dict(span.attributes))))

    with pytest.raises(TimeoutError), use_span(tracer.start_span("send", attributes={"vm.name": "vm-1"})):
        raise TimeoutError("no answer")

    assert ended == [("send", {"vm.name": "vm-1", "error.type": "TimeoutError"})]
