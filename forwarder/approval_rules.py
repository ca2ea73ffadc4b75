"""What a VM's listener checks before it approves, without I/O: the request's dates (``refuse_stale``: its
notAfter, issued too early or too late; ``Freshness`` holds the tolerances) and the decision's facts against this VM's
own IMDS document and hook ledger (``judge``, ``refuse_facts``). Why each rule exists: ``forwarder/approver.py``'s
docstring, the handler that applies them; ``local.direct_callback`` judges with the same rules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from contracts.wire import (
    NOT_AFTER_TOLERANCE,
    ApprovalOutcome,
    ApprovalRequest,
    ScheduledEvent,
    ScheduledEventsDocument,
)

__all__ = ["Freshness", "PrepareLedger", "judge", "refuse_facts", "refuse_not_after", "refuse_stale"]


@dataclass(frozen=True)
class Freshness:
    """How much clock disagreement and request age are tolerated, and how far ahead a request may be valid."""

    clock_skew: timedelta = timedelta(minutes=2)
    max_age: timedelta = timedelta(minutes=30)
    # Refused from this long before notAfter (the clocks of this VM and the coordinator may disagree this much).
    not_after_tolerance: timedelta = NOT_AFTER_TOLERANCE
    # No request is valid further ahead than this: a coordinator's notAfter is at most its approval deadline (30 s,
    # at most 10 min) after it sends, and Azure's longest routine notice is 15 min.
    max_validity: timedelta = timedelta(minutes=15)


def refuse_not_after(approval: ApprovalRequest, *, now: datetime, freshness: Freshness) -> str | None:
    """Why the request's notAfter forbids executing it now: there is none, it lies further ahead than any approval
    may be valid or past the event's NotBefore, or it has come (from ``not_after_tolerance`` before it, on this VM's
    clock). None when it allows it."""
    if approval.notAfter is None:
        return (
            "the request names no notAfter, so how long its decision holds is unknown (a coordinator older than this "
            "listener: upgrade the coordinator)"
        )
    if approval.notAfter > now + freshness.max_validity:
        return (
            f"notAfter {approval.notAfter.isoformat()} is more than {freshness.max_validity} ahead: no approval is "
            "valid that long"
        )
    not_before = approval.facts.notBefore if approval.facts is not None else None
    if not_before is not None and approval.notAfter > not_before + freshness.not_after_tolerance:
        return (
            f"notAfter {approval.notAfter.isoformat()} is after the event's NotBefore {not_before.isoformat()}: no "
            "approval is valid past it"
        )
    deadline = approval.deadline
    if now >= deadline - freshness.not_after_tolerance:
        why = f" ({approval.notAfterReason})" if approval.notAfterReason and deadline == approval.notAfter else ""
        return (
            f"expired at {deadline.isoformat()}{why}: refused from {freshness.not_after_tolerance.total_seconds():g} s "
            "before it on this VM's clock"
        )
    return None


def refuse_stale(approval: ApprovalRequest, *, now: datetime, freshness: Freshness) -> str | None:
    """Why the request's dates forbid executing it now (its notAfter, ``refuse_not_after``; issued too early or too
    late); None when they allow it."""
    if approval.expiresAt <= approval.issuedAt:
        return f"expiresAt {approval.expiresAt.isoformat()} is not after issuedAt {approval.issuedAt.isoformat()}"
    expiry = refuse_not_after(approval, now=now, freshness=freshness)
    if expiry is not None:
        return expiry
    if approval.issuedAt > now + freshness.clock_skew:
        return f"issuedAt {approval.issuedAt.isoformat()} is in the future beyond the {freshness.clock_skew} skew"
    if approval.issuedAt < now - freshness.max_age - freshness.clock_skew:
        return f"issuedAt {approval.issuedAt.isoformat()} is older than {freshness.max_age}"
    return None


PrepareLedger = Callable[[str], str | None]


def refuse_facts(
    approval: ApprovalRequest,
    event: ScheduledEvent,
    *,
    vm_name: str,
    prepare_outcome: PrepareLedger | None,
    now: datetime | None = None,
    skew: timedelta = Freshness.clock_skew,
) -> str | None:
    """Why the decision's facts do not hold on this VM (its IMDS document, its own hook ledger, its clock ``now``);
    None when they do. One VM's word to the coordinator never reaches IMDS unchecked: this is the last line of
    defence."""
    facts = approval.facts
    if facts is None:
        return "the request names no facts to check against this VM's IMDS document (upgrade the coordinator)"
    differences = facts.differences(event)
    if differences:
        return "facts differ from this VM's IMDS document: " + "; ".join(differences)
    near = facts.nearNotBeforeSeconds
    if near is not None:
        # The NotBefore compared above is this VM's own; an approval made for NotBefore's last minutes waits for them.
        if facts.notBefore is None or now is None:
            missing = "this VM's document names no NotBefore" if now is not None else "no clock was given to check it"
            return f"the decision rested on NotBefore being within {near} s, and {missing}"
        left = (facts.notBefore - now).total_seconds()
        if left > near + skew.total_seconds():
            return (
                f"the decision rested on NotBefore being within {near} s, and it is {left:.0f} s away on this VM's "
                "clock"
            )
    if vm_name in facts.hooksRequired:
        outcome = prepare_outcome(event.EventId) if prepare_outcome is not None else None
        if outcome != "succeeded":
            return (
                f"the decision rested on {vm_name}'s prepare hooks, and its own ledger says "
                f"{outcome or 'they have not finished'}"
            )
    return None


def judge(
    approval: ApprovalRequest,
    document: ScheduledEventsDocument,
    *,
    vm_name: str,
    prepare_outcome: PrepareLedger | None = None,
    now: datetime | None = None,
    freshness: Freshness = Freshness(),
) -> tuple[ApprovalOutcome, str]:
    """Whether the event may be approved on this VM (`vm_name`: its IMDS compute name), on a fresh document read at
    `now` (this VM's clock). `prepare_outcome(event_id)` reads this VM's own hook ledger: the prepare phase's
    outcome, None if not finished."""
    event = document.event(approval.eventId)
    if event is None:
        return "not-found", "the event is not in this VM's scheduled-events document"
    if event.EventStatus != "Scheduled":
        return "not-scheduled", f"the event is {event.EventStatus}"
    if not event.Resources:
        return "rejected", "the event names no Resources, so its reach is unknown"
    if event.EventType == "Terminate" and not event.concerns(vm_name):
        deleted = ", ".join(event.Resources)
        return "rejected", (
            f"Terminate of {deleted} can be approved only by {' or '.join(event.Resources)} itself, not by "
            f"{vm_name} (Azure: each VM approves only the EventId relevant to it)"
        )
    refusal = refuse_facts(
        approval, event, vm_name=vm_name, prepare_outcome=prepare_outcome, now=now, skew=freshness.clock_skew
    )
    if refusal is not None:
        return "rejected", refusal
    return "approved", ""
