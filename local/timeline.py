"""The live timeline: history rows in, one terminal line per step of an event's path out (pure, no I/O).

An event's path is seen → decided (by which rule) → approved → started → completed (or canceled / expired).
Latencies are measured from the moment a forwarder first observed the event (the envelope's ``observedAt``), so
they show what the pipeline adds, not how long the platform's notice was.
"""

from __future__ import annotations

import heapq
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from coordinator import TERMINAL_STATES

# The coordinator's own: an Expired event (NotBefore passed without an approval) is still started and completed by
# the platform, so a run that took it as concluded ended before the coordinator did (and judged it Expired).
TERMINAL = TERMINAL_STATES


def parse_time(value: Any) -> datetime | None:
    if isinstance(value, datetime):
        return value
    if not isinstance(value, str) or not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


@dataclass
class EventPath:
    event_id: str
    event_type: str = ""
    first_observed: datetime | None = None
    reporters: set[str] = field(default_factory=set)
    rule: str = ""
    verdict: str = ""
    approved_at: datetime | None = None
    approved_via: str = ""
    held_by: str = ""  # what the coordinator says holds the event back (an EventId), "" when nothing does
    state: str = "Scheduled"
    state_at: datetime | None = None  # the logged time of the transition that set ``state``
    steps: dict[str, datetime] = field(default_factory=dict)

    def latency_ms(self, step: str) -> float | None:
        at = self.steps.get(step)
        if at is None or self.first_observed is None:
            return None
        return (at - self.first_observed).total_seconds() * 1000.0


def moment(row: dict[str, Any]) -> datetime | None:
    """The time a row's lines show: an observation's when the forwarder observed it, any other row's when it was
    logged."""
    logged = parse_time(row.get("TimeGenerated"))
    if row.get("RecordType") == "Observation":
        return parse_time(row.get("ObservedAt")) or logged
    return logged


class InTimeOrder:
    """Holds lines back ``delay`` and lets them out in the order of their times. Rows reach the history in the order
    their writers finish (each batch, the timer, in parallel), not in the order of the times they show: a batch that
    began first may log last, and an observation shows when it was observed, before it was logged."""

    def __init__(self, delay: timedelta) -> None:
        self.delay = delay
        self._held: list[tuple[datetime, int, str]] = []
        self._order = itertools.count()  # lines of one time keep the order they came in

    def add(self, at: datetime, lines: list[str]) -> None:
        for line in lines:
            heapq.heappush(self._held, (at, next(self._order), line))

    def due(self, now: datetime) -> list[str]:
        """The lines whose time is ``delay`` or more before ``now``, in time order."""
        out = []
        while self._held and self._held[0][0] <= now - self.delay:
            out.append(heapq.heappop(self._held)[2])
        return out

    def flush(self) -> list[str]:
        return [heapq.heappop(self._held)[2] for _ in range(len(self._held))]


def details(row: dict[str, Any]) -> dict[str, Any]:
    """A history row's ``Details`` (JSON text in SQLite, a dict elsewhere); {} when absent or not an object."""
    value = row.get("Details")
    if isinstance(value, str) and value:
        try:
            value = json.loads(value)
        except ValueError:
            return {}
    return value if isinstance(value, dict) else {}


def _short(event_id: str) -> str:
    return event_id[:8]


def _clock(at: datetime | None) -> str:
    return at.strftime("%H:%M:%S.%f")[:-3] if at is not None else "--:--:--.---"


def _since(path: EventPath, at: datetime | None) -> str:
    if at is None or path.first_observed is None:
        return ""
    # Two clocks: a VM's observedAt is its own, a step's time the service's. A step logged "before" the event was
    # observed means that VM's clock runs ahead; the path then starts at the earliest moment either shows (a latency
    # is never negative).
    path.first_observed = min(path.first_observed, at)
    return f"+{(at - path.first_observed).total_seconds() * 1000.0:,.0f} ms"


def _ms(delta: timedelta) -> str:
    return f"{delta.total_seconds() * 1000.0:,.0f} ms"


class Timeline:
    """Feed history rows (dicts with the history table's columns, as SQLite returns them) in order with ``add``;
    each call returns the lines to print. ``paths`` keeps every event's path for the summary."""

    def __init__(self, *, labels: dict[str, str] | None = None) -> None:
        self.paths: dict[str, EventPath] = {}
        self.dead_letters = 0
        self.retired: set[str] = set()  # VMs the coordinator retired (a delete removed them)
        self.resets: list[str] = []  # VMs whose forwarder state the coordinator saw reset, in order
        self.labels = dict(labels or {})

    def label(self, event_id: str) -> str:
        return self.labels.get(event_id, _short(event_id))

    def _line(self, at: datetime | None, path: EventPath, step: str, detail: str) -> str:
        clock = at.strftime("%H:%M:%S.%f")[:-3] if at is not None else "--:--:--.---"
        latency = _since(path, at)
        return (
            f"{clock}  {self.label(path.event_id):<18} {path.event_type:<9} {step:<10} {latency:>11}  {detail}".rstrip()
        )

    def add(self, row: dict[str, Any]) -> list[str]:
        kind = str(row.get("RecordType") or "")
        at = parse_time(row.get("TimeGenerated"))
        if kind == "DeadLetter":
            self.dead_letters += 1
            return [f"{_clock(at)}  {'(dead letter)':<18} {'':<9} {'refused':<10} {'':>11}  {row.get('Reason') or ''}"]
        if kind == "Heartbeat":
            return [self._heartbeat(row, at)]
        event_id = str(row.get("EventId") or "")
        handler = self._handlers.get(kind)
        if not event_id or handler is None:
            return []
        path = self.paths.get(event_id)
        if path is None:
            path = self.paths[event_id] = EventPath(event_id=event_id)
        path.event_type = path.event_type or str(row.get("EventType") or "")
        return handler(path, row, at)

    @property
    def _handlers(self) -> dict[str, Callable[[EventPath, dict[str, Any], datetime | None], list[str]]]:
        return {
            "Observation": self._observation,
            "Decision": self._decision,
            "Approval": self._approval,
            "Transition": self._transition,
            "Hook": self._hook,
        }

    def _heartbeat(self, row: dict[str, Any], at: datetime | None) -> str:
        vm = str(row.get("VmName") or "")
        outcome = str(row.get("Outcome") or "")
        detail = outcome
        if outcome == "retired":
            self.retired.add(vm)
            event_id = str(row.get("EventId") or "")
            by = f" by {self.label(event_id)} ({row.get('EventType') or ''})" if event_id else ""
            detail = f"retired{by}: {row.get('Reason') or ''}".rstrip(": ")
        elif outcome == "reset":
            self.resets.append(vm)
            info = details(row)
            detail = (
                f"reset: forwarder state {str(info.get('oldState') or '?')[:8]} → "
                f"{str(info.get('newState') or '?')[:8]}, sequence {info.get('lastSequence')} → "
                f"{info.get('newSequence')}"
            )
        elif outcome == "conflict":
            info = details(row)
            detail = (
                f"conflict: forwarder states {str(info.get('state') or '?')[:8]} and "
                f"{str(info.get('otherState') or '?')[:8]} both send as this VM"
            )
        return f"{_clock(at)}  {vm:<18} {'':<9} {'heartbeat':<10} {'':>11}  {detail}"

    def _decision(self, path: EventPath, row: dict[str, Any], at: datetime | None) -> list[str]:
        path.rule = str(row.get("Rule") or "")
        path.verdict = str(row.get("Outcome") or "")
        path.held_by = str(details(row).get("heldBy") or "")
        if at is not None:
            path.steps.setdefault("decided", at)
        return [self._line(at, path, "decided", f"rule {path.rule} → {path.verdict}: {row.get('Reason') or ''}")]

    def _approval(self, path: EventPath, row: dict[str, Any], at: datetime | None) -> list[str]:
        outcome = str(row.get("Outcome") or "")
        vm = str(row.get("VmName") or "")
        if outcome == "sending":
            return []  # the intent written before the send; the outcome row follows
        if outcome == "held":
            path.held_by = str(details(row).get("heldBy") or path.held_by)
            # The coordinator's reason says it already: "held by the platform: delete of … pending until …".
            return [self._line(at, path, "held", str(row.get("Reason") or "held by the platform"))]
        if outcome == "released":
            path.held_by = ""
        if outcome != "approved":
            return [self._line(at, path, "approval", f"{outcome}: {row.get('Reason') or ''}")]
        path.approved_at = path.approved_at or at
        path.approved_via = path.approved_via or vm
        path.held_by = ""
        if at is not None:
            path.steps.setdefault("approved", at)
        return [self._line(at, path, "approved", f"StartRequests accepted through {vm}")]

    def _transition(self, path: EventPath, row: dict[str, Any], at: datetime | None) -> list[str]:
        state = str(row.get("State") or "")
        # Rows reach the history in the order their writers finish: the timer's Expired may be logged after the
        # batch that, a moment later, saw the event Started. The latest transition by its time is the state.
        if state and (at is None or path.state_at is None or at >= path.state_at):
            path.state, path.state_at = state, at or path.state_at
        if at is not None:
            path.steps.setdefault(state.lower(), at)
        if state == "Approved":
            return []  # the Approval row already said so
        return [self._line(at, path, state.lower(), str(row.get("Reason") or ""))]

    def _hook(self, path: EventPath, row: dict[str, Any], at: datetime | None) -> list[str]:
        outcome = str(row.get("Outcome") or "")
        if outcome == "not-run":
            return []
        return [self._line(at, path, "hook", f"{row.get('HookPhase') or ''} on {row.get('VmName') or ''}: {outcome}")]

    def _observation(self, path: EventPath, row: dict[str, Any], at: datetime | None) -> list[str]:
        vm = str(row.get("VmName") or "")
        observed = moment(row)
        status = str(row.get("EventStatus") or "")
        first = path.first_observed is None
        if first or (observed is not None and path.first_observed is not None and observed < path.first_observed):
            # Rows come in the order their writers finish: a VM that observed earlier may be logged later.
            path.first_observed = observed
            if observed is not None:
                path.steps["seen"] = observed
        path.reporters.add(vm)
        if first:
            resources = row.get("Resources")
            if isinstance(resources, str):
                try:
                    resources = json.loads(resources)
                except ValueError:
                    resources = [resources]
            affected = ", ".join(resources) if isinstance(resources, list) else ""
            if at is not None and observed is not None and at < observed:
                logged = f"logged {_ms(observed - at)} before it by the service's clock ({vm}'s clock runs ahead)"
            else:
                logged = f"logged {_since(path, at)}" if at is not None else ""
            return [self._line(observed, path, "seen", f"{status} by {vm}; affects {affected}; {logged}".rstrip("; "))]
        return []

    def open_events(self) -> list[str]:
        return sorted(e for e, p in self.paths.items() if p.state not in TERMINAL)
