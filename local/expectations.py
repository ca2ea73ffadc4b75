"""What a run should end with, decided before looking at what happened (pure, no I/O).

For every event the IMDS emulator created, the policy's first matching rule says whether the coordinator should
approve it: ``approve`` (approve-now; approve-after-hooks when the forwarders have a prepare hook that succeeds),
``no-approval`` (wait-for-person, never-approve, no rule; and every event that appeared already Started) or
``either`` (a budget rule depends on the rest of the fleet; a notice too short for any pipeline to act on).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any, Literal

from coordinator.model import EventRecord
from coordinator.rules import Policy, first_match

Expectation = Literal["approve", "no-approval", "either"]
# An approval needs a poll, an Event Hubs hop, a decision and a relay round trip; below this notice (real
# seconds) the platform may start the event first, and no expectation is set.
MIN_NOTICE_SECONDS = 3.0


@dataclass(frozen=True)
class Expected:
    event_id: str
    label: str
    event_type: str
    approval: Expectation
    rule: str
    terminal_state: str  # the coordinator's state once the event is over: Completed or Canceled


def _parse_time(value: Any) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        if value.endswith("GMT"):
            return parsedate_to_datetime(value).astimezone(UTC)
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except (TypeError, ValueError):
        return None


def expect(event: dict[str, Any], policy: Policy, *, prepare_hooks: bool) -> Expected:
    """The expectation for one event as listed by the IMDS emulator's ``GET /_emulator/events``."""
    scheduled_at = _parse_time(event.get("scheduledAt")) or datetime.now(UTC)
    record = EventRecord(
        eventId=str(event["EventId"]),
        eventType=str(event["EventType"]),
        eventSource=str(event.get("EventSource") or "Platform"),
        resources=[str(name) for name in event.get("Resources", [])],
        durationInSeconds=int(event.get("DurationInSeconds", -1)),
        stateSince=scheduled_at,
        createdAt=scheduled_at,
    )
    label = str(event.get("ref") or record.eventId)
    terminal = "Canceled" if event.get("state") == "Canceled" else "Completed"
    rule = first_match(policy, record, scheduled_at)
    rule_name = rule.name if rule is not None else "(no rule matched)"
    approval: Expectation
    if (
        event.get("startedBy") == "hardware-failure"
        or rule is None
        or rule.action in ("wait-for-person", "never-approve")
    ):
        approval = "no-approval"
    elif rule.action == "approve-within-budget" or (rule.action == "approve-after-hooks" and not prepare_hooks):
        approval = "either"
    else:
        approval = "approve"
    not_before = _parse_time(event.get("NotBefore"))
    if approval == "approve" and (
        not_before is None or (not_before - scheduled_at).total_seconds() < MIN_NOTICE_SECONDS
    ):
        approval = "either"
    if approval == "approve" and event.get("state") == "Canceled":
        approval = "either"
    return Expected(record.eventId, label, record.eventType, approval, rule_name, terminal)


def expect_all(events: list[dict[str, Any]], policy: Policy, *, prepare_hooks: bool) -> list[Expected]:
    return [expect(event, policy, prepare_hooks=prepare_hooks) for event in events]
