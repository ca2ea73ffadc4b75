"""What the oracle says of one run (pure data): its findings (wrong, missed, duplicate, late, lost; an escalation
step's findings are of the same kinds, their detail naming the step: ``oracle.ladders``), each event's verdict and the
report printed; and the timing it grants the pipeline (``Bounds``). How they are reached: ``oracle.check``."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Literal

from oracle.intervals import Intervals, seconds
from oracle.truth import Approval, Event

__all__ = ["KINDS", "Bounds", "EventVerdict", "Finding", "FindingKind", "Report"]

FindingKind = Literal["wrong", "missed", "duplicate", "late", "lost"]
KINDS: tuple[FindingKind, ...] = ("wrong", "missed", "duplicate", "late", "lost")


@dataclass(frozen=True)
class Bounds:
    """The pipeline's timing as the oracle grants it (real seconds)."""

    latency: float = 5.0  # from surely allowed and reportable to StartRequests accepted: poll, hub, decide, relay
    slack: float = 3.0  # from a decision to its StartRequests accepted, when nothing slows the delivery
    # After an outage or stall of L seconds: clients retrying with doubling backoff try again within about 2 L, then
    # reconnect (``recover``); an approval that failed meanwhile is retried by the timer (``retry``: its first
    # backoff, coordinator/domain/retry.py).
    recover: float = 5.0
    retry: float = 10.0
    boot: float = 4.0  # a forwarder restarted: until it has read IMDS and its listener can take a request
    conclude: float = 10.0  # IMDS concluded an event: until the coordinator surely knows
    send: float = 3.0  # a document read: until its envelope is surely in the hub (outside outages)


@dataclass(frozen=True)
class Finding:
    kind: FindingKind
    event_id: str
    label: str
    detail: str

    def line(self) -> str:
        return f"{self.kind.upper():<9} {self.label:<24} {self.detail}"


@dataclass
class EventVerdict:
    event: Event
    label: str
    rule: str
    upper: Intervals
    lower: Intervals
    due: float | None
    approvals: list[Approval]

    @property
    def outcome(self) -> str:
        if self.approvals:
            return "approved"
        return "due" if self.due is not None else "either/none"


@dataclass
class Report:
    findings: list[Finding]
    verdicts: list[EventVerdict]
    checked_incarnations: int
    start: float = 0.0

    def counts(self) -> dict[str, int]:
        counted = Counter(finding.kind for finding in self.findings)
        return {kind: counted.get(kind, 0) for kind in KINDS}

    @property
    def ok(self) -> bool:
        return not self.findings

    def _explain(self, verdict: EventVerdict) -> list[str]:
        def spans(intervals: Intervals) -> str:
            shown = [f"[{lo - self.start:+.1f}, {hi - self.start:+.1f})" for lo, hi in intervals.spans]
            return " ".join(shown).replace("inf", "end") or "none"

        event = verdict.event
        not_before = f"{seconds(event.notBefore) - self.start:+.1f}s" if event.notBefore is not None else "-"
        states = ", ".join(f"{t.state} {seconds(t.at) - self.start:+.1f}s ({t.reason})" for t in event.transitions)
        return [
            f"{event.eventId} {event.eventSource} {event.durationInSeconds}s on {', '.join(event.resources)}; "
            f"seen by {', '.join(event.viewers)}; NotBefore {not_before}",
            f"states: {states}",
            f"allowed (upper, judges wrong): {spans(verdict.upper)}",
            f"surely allowed and deliverable (lower, decides due): {spans(verdict.lower)}",
        ]

    def lines(self, *, explain: bool = False) -> list[str]:
        """The events (with ``explain``: each one's facts, allowed sets and states), the counts, the findings."""
        out = [f"{'event':<24}{'type':<10}{'rule':<34}{'outcome':<12}due      approvals"]
        for v in self.verdicts:
            due = f"+{v.due - self.start:6.1f}s" if v.due is not None else "   -    "
            made = ", ".join(f"+{seconds(a.at) - self.start:.1f}s {a.vm}/{a.via}" for a in v.approvals) or "-"
            out.append(f"{v.label:<24}{v.event.eventType:<10}{v.rule[:33]:<34}{v.outcome:<12}{due} {made}")
            if explain:
                out.extend(f"    {line}" for line in self._explain(v))
        counts = self.counts()
        out.append(
            "oracle: "
            + ", ".join(f"{kind} {counts[kind]}" for kind in KINDS)
            + f" ({len(self.verdicts)} events, {self.checked_incarnations} incarnations read by forwarders)"
        )
        out.extend(f"  {finding.line()}" for finding in self.findings)
        return out
