"""The end-of-run summary and its verdict (pure, no I/O): what happened against what should have.

``RunFacts`` is gathered by ``local.observe`` from the emulators, the history store and the state table;
``summarize`` compares it with the expectations and lists every failure in words.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from local.expectations import Expected

Sighting = tuple[str, str, str]  # (vm name, EventId, Scheduled | Started | Gone)


Document = tuple[str, str, int, list[tuple[str, str]]]  # (vm, stateId, sequence, [(EventId, EventStatus)])


def sightings_from_documents(documents: Iterable[Document]) -> set[Sighting]:
    """What the coordinator must have logged, from what the forwarders sent: each incarnation envelope lists events;
    an event a VM listed and a later document of the same VM no longer lists is 'Gone' for that VM. 'Later' is by
    sequence within one forwarder state (``stateId``): a forwarder whose state was wiped starts its sequence again,
    and its first document says nothing about what the lost state had listed."""
    by_state: dict[tuple[str, str], list[tuple[int, list[tuple[str, str]]]]] = {}
    for vm, state_id, sequence, events in documents:
        by_state.setdefault((vm, state_id), []).append((sequence, events))
    result: set[Sighting] = set()
    for (vm, _state_id), items in by_state.items():
        listed: set[str] = set()
        for _sequence, events in sorted(items, key=lambda item: item[0]):
            now = {event_id for event_id, _ in events}
            result.update((vm, event_id, "Gone") for event_id in listed - now)
            result.update((vm, event_id, status) for event_id, status in events)
            listed = now
    return result


# What ``--json`` reports per event besides the summary's columns, when nothing is known of it.
NO_DETAILS: dict[str, Any] = {
    "approvedThrough": None,
    "approvedAfterSeenMs": None,
    "startedAfterSeenMs": None,
    "heldBy": None,
}


@dataclass(frozen=True)
class RunFacts:
    expected: list[Expected]
    imds_events: list[dict[str, Any]]
    imds_approvals: list[dict[str, Any]]
    coordinator_states: dict[str, str]
    envelopes_sent: dict[str, int]
    envelopes_delivered: int
    last_sequence_sent: dict[str, int]
    last_sequence_applied: dict[str, int]
    sightings_sent: set[Sighting]
    sightings_logged: set[Sighting]
    dead_letters: int
    failed_batches: int
    expected_dead_letters: int = 0
    latencies_ms: dict[str, list[float]] = field(default_factory=dict)
    # Per EventId: approvedThrough, approvedAfterSeenMs, startedAfterSeenMs, heldBy (see ``event_details``).
    event_details: dict[str, dict[str, Any]] = field(default_factory=dict)
    cards: list[dict[str, str | None]] = field(default_factory=list)  # {kind, eventId, vm} per card written


@dataclass
class Summary:
    events_by_state: dict[str, int]
    approvals_expected: int
    approvals_made: int
    approvals_expected_made: int
    envelopes_sent: int
    envelopes_delivered: int
    sightings_sent: int
    sightings_logged: int
    dead_letters: int
    latencies_ms: dict[str, dict[str, float]]
    events: list[dict[str, Any]]
    failures: list[str]
    cards: list[dict[str, str | None]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__) | {"ok": self.ok}

    def render(self) -> list[str]:
        lines = ["", "── summary " + "─" * 69]
        lines.append(f"{'event':<20}{'type':<11}{'expected':<13}{'imds':<11}{'coordinator':<13}rule")
        for row in self.events:
            lines.append(
                f"{row['label']:<20}{row['type']:<11}{row['expected']:<13}{row['imds']:<11}{row['coordinator']:<13}"
                f"{row['rule']}"
            )
        states = ", ".join(f"{state} {count}" for state, count in sorted(self.events_by_state.items()))
        lines.append(f"events by final state (coordinator): {states or 'none'}")
        lines.append(
            f"approvals: made {self.approvals_made}, expected {self.approvals_expected} "
            f"(expected and made: {self.approvals_expected_made})"
        )
        lines.append(
            f"envelopes: sent {self.envelopes_sent}, delivered to ingest_envelopes {self.envelopes_delivered}; "
            f"event sightings sent {self.sightings_sent}, logged {self.sightings_logged}; "
            f"dead letters {self.dead_letters}"
        )
        for step, figures in self.latencies_ms.items():
            p50, worst, count = figures["p50"], figures["max"], figures["n"]
            lines.append(f"latency seen→{step}: p50 {p50:,.0f} ms, max {worst:,.0f} ms (n={count:.0f})")
        if self.failures:
            lines.append(f"FAILED ({len(self.failures)}):")
            lines.extend(f"  - {failure}" for failure in self.failures)
        else:
            lines.append("OK: every expectation of this run held")
        return lines


def percentile(values: list[float], fraction: float) -> float:
    """Nearest-rank percentile; ``values`` must not be empty."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(fraction * len(ordered) - 1e-9)))
    return ordered[rank - 1]


def _event_failures(item: Expected, *, made: bool, coordinator: str) -> list[str]:
    event = f"{item.label} ({item.event_type})"
    # Whose word the expectation is: the scenario's (an ``expect`` of its step), else the policy's rule.
    said = "the scenario expects" if item.computed is not None else f"rule {item.rule} says"
    failures = []
    if item.approval == "approve" and not made:
        failures.append(f"{event}: {said} it is approved; it was not")
    elif item.approval == "no-approval" and made:
        failures.append(f"{event}: approved, although {said} it is not")
    if item.computed not in (None, "either", item.approval):
        failures.append(
            f"{event}: the scenario expects {item.approval}, but rule {item.rule} alone says {item.computed}: "
            "the scenario and its policy disagree"
        )
    if coordinator != item.terminal_state:
        failures.append(f"{event}: coordinator state {coordinator}, expected {item.terminal_state}")
    return failures


def summarize(facts: RunFacts) -> Summary:
    failures: list[str] = []
    approved_ids = {str(item["EventId"]) for item in facts.imds_approvals}
    imds_state = {str(e["EventId"]): str(e.get("state", "")) for e in facts.imds_events}
    rows: list[dict[str, Any]] = []
    expected_approve = expected_made = 0
    for item in facts.expected:
        made = item.event_id in approved_ids
        coordinator = facts.coordinator_states.get(item.event_id, "(never seen)")
        if item.approval == "approve":
            expected_approve += 1
            expected_made += made
        failures.extend(_event_failures(item, made=made, coordinator=coordinator))
        rows.append(
            {
                "label": item.label,
                "type": item.event_type,
                "expected": item.approval,
                "imds": ("approved" if made else imds_state.get(item.event_id, "?").lower()),
                "coordinator": coordinator,
                "rule": item.rule,
                "eventId": item.event_id,
            }
            | NO_DETAILS
            | facts.event_details.get(item.event_id, {})
        )
    if not facts.envelopes_sent:
        failures.append("no envelope reached Event Hubs: see the forwarder logs")
    for vm, sent in sorted(facts.last_sequence_sent.items()):
        applied = facts.last_sequence_applied.get(vm)
        if applied != sent:
            failures.append(f"{vm}: last envelope sequence sent {sent}, applied by the coordinator {applied}")
    missing = sorted(facts.sightings_sent - facts.sightings_logged)
    if missing:
        shown = ", ".join(f"{vm}/{event[:8]}/{status}" for vm, event, status in missing[:5])
        failures.append(f"{len(missing)} event sightings sent but never logged: {shown}")
    if facts.dead_letters != facts.expected_dead_letters:
        failures.append(f"dead letters: {facts.dead_letters}, expected {facts.expected_dead_letters}")
    if facts.failed_batches:
        failures.append(f"{facts.failed_batches} batches failed every retry of ingest_envelopes")
    latencies = {
        step: {"p50": percentile(values, 0.5), "max": max(values), "n": float(len(values))}
        for step, values in facts.latencies_ms.items()
        if values
    }
    return Summary(
        events_by_state=dict(Counter(facts.coordinator_states.values())),
        approvals_expected=expected_approve,
        approvals_made=len(approved_ids),
        approvals_expected_made=expected_made,
        envelopes_sent=sum(facts.envelopes_sent.values()),
        envelopes_delivered=facts.envelopes_delivered,
        sightings_sent=len(facts.sightings_sent),
        sightings_logged=len(facts.sightings_logged & facts.sightings_sent),
        dead_letters=facts.dead_letters,
        latencies_ms=latencies,
        events=rows,
        failures=failures,
        cards=facts.cards,
    )


def to_json(summary: Summary) -> str:
    return json.dumps(summary.as_dict(), indent=2, sort_keys=True)
