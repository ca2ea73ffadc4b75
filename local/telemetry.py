"""python -m local's telemetry: what Application Insights would receive in Azure, collected on this machine.

The coordinator runs in this process (the local function host calls function_app), so its spans and metrics
(adapters/telemetry.py) are collected in-process with the OpenTelemetry SDK: an in-memory span exporter and an
in-memory metric reader with delta temporality, so that each run reads only its own figures even when a test process
runs several. Each forwarder process appends its spans as JSON Lines to ``<workdir>/telemetry/spans-<vm>.jsonl``
(``FORWARDER_LINE`` below). At the end of a run ``finish`` joins both, groups the spans of each approval's trace and
writes ``<workdir>/telemetry.json``:

    {"traces": [{"traceId", "eventId", "spans": [{"name", "service", "startMs", "durationMs", "spanId",
                 "parentSpanId", "attributes"}]}],
     "metrics": {NAME: value}, "metricsByAttributes": {NAME: {"k=v,…": value}}, "problems": [...]}

One trace per approval (an event with a ``coordinator.approval`` span); ``startMs`` is relative to the first span of
that approval's spans, ``durationMs`` the span's own. A metric's value: counters the run's total, histograms
``{"count", "sum", "max"}``, gauges the sum of their last values (by attribute in ``metricsByAttributes``). A line of
a forwarder's file that cannot be read is set aside and named in ``problems`` (file, line, reason); the others count.
"""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import (
    Counter,
    Histogram,
    MeterProvider,
    ObservableCounter,
    UpDownCounter,
    _Gauge,  # the SDK's synchronous gauge (its public name in the API is Gauge)
)
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    HistogramDataPoint,
    InMemoryMetricReader,
    NumberDataPoint,
    Sum,
)
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from coordinator import EVENT_ID as COORDINATOR_EVENT_ID
from coordinator import SERVICE_NAME as COORDINATOR_SERVICE_NAME

TELEMETRY_DIR = "telemetry"
REPORT_FILE = "telemetry.json"
APPROVAL_SPAN = "coordinator.approval"
# The attributes that tie a span to one event (the forwarder's detection lists the events of its document).
EVENT_ID = COORDINATOR_EVENT_ID
EVENT_IDS = "scheduled_events.event_ids"


class ForwarderSpan(BaseModel):
    """``FORWARDER_LINE``: one line of ``spans-<vm>.jsonl`` as the forwarder writes it."""

    model_config = ConfigDict(extra="ignore")

    traceId: str = Field(pattern=r"^[0-9a-f]{32}$")
    spanId: str = Field(pattern=r"^[0-9a-f]{16}$")
    parentSpanId: str = Field(default="", pattern=r"^([0-9a-f]{16})?$")
    name: str = Field(min_length=1, max_length=256)
    service: str = Field(min_length=1, max_length=256)
    startTimeUnixNano: int = Field(ge=0)
    endTimeUnixNano: int = Field(ge=0)
    attributes: dict[str, Any] = Field(default_factory=dict)


FORWARDER_LINE = ForwarderSpan


@dataclass(frozen=True)
class SpanRecord:
    """A span from either side, in one shape."""

    trace_id: str
    span_id: str
    parent_id: str
    name: str
    service: str
    start_ns: int
    end_ns: int
    attributes: Mapping[str, Any]

    def event_ids(self) -> set[str]:
        ids = {str(self.attributes[EVENT_ID])} if EVENT_ID in self.attributes else set()
        listed = self.attributes.get(EVENT_IDS)
        if isinstance(listed, str):
            ids.update(item.strip() for item in listed.split(",") if item.strip())
        return ids


def from_sdk(span: ReadableSpan) -> SpanRecord:
    context = span.context
    assert context is not None
    return SpanRecord(
        trace_id=f"{context.trace_id:032x}",
        span_id=f"{context.span_id:016x}",
        parent_id=f"{span.parent.span_id:016x}" if span.parent is not None else "",
        name=span.name,
        service=str(span.resource.attributes.get(SERVICE_NAME, "")),
        start_ns=span.start_time or 0,
        end_ns=span.end_time or span.start_time or 0,
        attributes=dict(span.attributes or {}),
    )


def read_forwarder_spans(folder: Path) -> tuple[list[SpanRecord], list[str]]:
    """Every span in ``folder/spans-*.jsonl``, and a problem (file:line: reason) for each line that is not one."""
    spans: list[SpanRecord] = []
    problems: list[str] = []
    for path in sorted(folder.glob("spans-*.jsonl")) if folder.is_dir() else []:
        with path.open(encoding="utf-8", errors="replace") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    item = ForwarderSpan.model_validate_json(line)
                except ValidationError as error:
                    first = error.errors()[0]
                    where = ".".join(str(p) for p in first["loc"]) or "(line)"
                    problems.append(f"{path.name}:{number}: {where}: {first['msg']}"[:300])
                    continue
                spans.append(
                    SpanRecord(
                        trace_id=item.traceId,
                        span_id=item.spanId,
                        parent_id=item.parentSpanId,
                        name=item.name,
                        service=item.service,
                        start_ns=item.startTimeUnixNano,
                        end_ns=max(item.endTimeUnixNano, item.startTimeUnixNano),
                        attributes=item.attributes,
                    )
                )
    return spans, problems


def approval_traces(spans: Iterable[SpanRecord]) -> list[dict[str, Any]]:
    """One entry per approval: each (trace, event) with a ``coordinator.approval`` span, holding that trace's spans
    about the event (those naming it, and those naming no event), in start order, times relative to the first."""
    by_trace: dict[str, list[SpanRecord]] = defaultdict(list)
    for span in spans:
        by_trace[span.trace_id].append(span)
    traces = []
    for trace_id, members in sorted(by_trace.items()):
        approved = sorted({e for s in members if s.name == APPROVAL_SPAN for e in s.event_ids()})
        for event_id in approved:
            mine = sorted(
                (s for s in members if not s.event_ids() or event_id in s.event_ids()), key=lambda s: s.start_ns
            )
            first = mine[0].start_ns
            traces.append(
                {
                    "traceId": trace_id,
                    "eventId": event_id,
                    "spans": [
                        {
                            "name": s.name,
                            "service": s.service,
                            "startMs": round((s.start_ns - first) / 1e6, 3),
                            "durationMs": round((s.end_ns - s.start_ns) / 1e6, 3),
                            "spanId": s.span_id,
                            "parentSpanId": s.parent_id,
                            "attributes": {k: v for k, v in s.attributes.items() if isinstance(v, str | int | float)},
                        }
                        for s in mine
                    ],
                }
            )
    return traces


def shared_traces(traces: list[dict[str, Any]]) -> list[tuple[list[str], str, list[dict[str, Any]]]]:
    """The approvals' traces as printed: approvals whose traces share spans (one detection of two events, one batch
    deciding both) are one block, each span once, times from the block's first span; the rest one block each."""
    blocks: list[tuple[list[str], str, dict[str, dict[str, Any]]]] = []
    for item in traces:
        spans = {span["spanId"]: span for span in item["spans"]}
        for events, trace_id, held in blocks:
            shared = next((span_id for span_id in spans if span_id in held), None)
            if trace_id == item["traceId"] and shared is not None:
                # Each approval's times count from its own first span: align them on a span both hold.
                offset = held[shared]["startMs"] - spans[shared]["startMs"]
                for span_id, span in spans.items():
                    held.setdefault(span_id, span | {"startMs": span["startMs"] + offset})
                events.append(item["eventId"])
                break
        else:
            blocks.append(([item["eventId"]], item["traceId"], dict(spans)))
    printed = []
    for events, trace_id, held in blocks:
        first = min(span["startMs"] for span in held.values())
        ordered = sorted(held.values(), key=lambda span: span["startMs"])
        printed.append((events, trace_id, [span | {"startMs": span["startMs"] - first} for span in ordered]))
    return printed


def _key(attributes: Mapping[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(attributes.items()))


def metric_values(data: Any) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """A metric reader's collection as {NAME: value} and {NAME: {attributes: value}} (see the module's docstring)."""
    totals: dict[str, Any] = {}
    by_attributes: dict[str, dict[str, Any]] = {}
    if data is None:
        return totals, by_attributes
    for resource_metrics in data.resource_metrics:
        for scope in resource_metrics.scope_metrics:
            for metric in scope.metrics:
                points = list(metric.data.data_points)
                if not points:
                    continue
                if isinstance(metric.data, Sum | Gauge):
                    numbers = [p for p in points if isinstance(p, NumberDataPoint)]
                    totals[metric.name] = sum(p.value for p in numbers)
                    by_attributes[metric.name] = {_key(p.attributes or {}): p.value for p in numbers}
                else:
                    histograms = [p for p in points if isinstance(p, HistogramDataPoint)]
                    count = sum(p.count for p in histograms)
                    totals[metric.name] = {
                        "count": count,
                        "sum": round(sum(p.sum for p in histograms), 3),
                        "max": round(max(p.max for p in histograms), 3) if count else None,
                    }
                    by_attributes[metric.name] = {_key(p.attributes or {}): p.count for p in histograms}
    return totals, by_attributes


@dataclass
class Report:
    traces: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    metrics_by_attributes: dict[str, dict[str, Any]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "traces": self.traces,
            "metrics": self.metrics,
            "metricsByAttributes": self.metrics_by_attributes,
            "problems": self.problems,
        }

    def write(self, workdir: Path) -> Path:
        path = workdir / REPORT_FILE
        path.write_text(json.dumps(self.as_dict(), indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8")
        return path

    def render(self) -> list[str]:
        """Per approval, its trace's stages with their durations (the summary prints these)."""
        lines = ["", "── traces (one per approval; ms from the trace's first span) " + "─" * 19]
        for events, trace_id, spans in shared_traces(self.traces):
            lines.append(f"event{'s' * (len(events) > 1)} {', '.join(e[:8] for e in events)}  trace {trace_id}")
            for span in spans:
                start, duration = span["startMs"], span["durationMs"]
                lines.append(f"  {start:>9,.0f} ms  {span['name']:<26}{duration:>9,.1f} ms  {span['service']}")
        if not self.traces:
            lines.append("no approval was traced")
        for problem in self.problems[:10]:
            lines.append(f"telemetry problem: {problem}")
        return lines


class Collector:
    """The process's OpenTelemetry SDK, installed once (providers are global and set once per process); ``begin``
    starts a run's collection, ``finish`` ends it."""

    _installed: Collector | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        resource = Resource.create({SERVICE_NAME: COORDINATOR_SERVICE_NAME})
        self.exporter = InMemorySpanExporter()
        provider = TracerProvider(resource=resource, sampler=ALWAYS_ON)
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        delta = AggregationTemporality.DELTA
        self.reader = InMemoryMetricReader(
            preferred_temporality={
                Counter: delta,
                UpDownCounter: delta,
                Histogram: delta,
                ObservableCounter: delta,
                # A gauge reports only what was set during the run (an earlier run's VMs are not this run's).
                _Gauge: delta,
            }
        )
        trace.set_tracer_provider(provider)
        metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=[self.reader]))

    @classmethod
    def install(cls) -> Collector:
        with cls._lock:
            if cls._installed is None:
                cls._installed = Collector()
            return cls._installed

    def begin(self) -> None:
        """Forgets what earlier runs of this process recorded."""
        self.exporter.clear()
        self.reader.get_metrics_data()

    def finish(self, workdir: Path) -> Report:
        """This run's telemetry, joined with the forwarders' spans under ``workdir``, written to telemetry.json."""
        spans = [from_sdk(span) for span in self.exporter.get_finished_spans()]
        forwarder_spans, problems = read_forwarder_spans(workdir / TELEMETRY_DIR)
        totals, by_attributes = metric_values(self.reader.get_metrics_data())
        report = Report(
            traces=approval_traces([*spans, *forwarder_spans]),
            metrics=totals,
            metrics_by_attributes=by_attributes,
            problems=problems,
        )
        report.write(workdir)
        return report
