"""How long an approval may be executed: the earliest instant at which a condition its decision rested on stops
holding (its ``notAfter``), and when an "approve before NotBefore" approval can still be sent.

Pure: takes the policy, the rule that approved, the event and the time; gives a ``Bound`` (the instant, and which
condition it is). pipeline/decide.py records the bound on the approval when it decides (and again whenever it
decides a retry again); pipeline/act.py caps it with the delivery's own deadline in the request, which the VM's
listener refuses from ``NOT_AFTER_TOLERANCE`` before it (contracts/approval.py). docs/coordinator.md, "Approvals
expire", has the figures behind the constants.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from contracts.approval import NOT_AFTER_TOLERANCE
from coordinator.domain.model import EventRecord
from coordinator.domain.policy import Policy, Rule

__all__ = [
    "DELIVERY_TIME",
    "GATE_RESULT_MAX_AGE",
    "SEND_MARGIN",
    "TIMER_PERIOD",
    "Bound",
    "approval_bound",
    "deadline_lead",
    "person_bound",
    "request_bound",
    "sendable",
]

# The timer's period (function_app.py, schedule "0 * * * * *"): a waiting event is decided again once a minute.
TIMER_PERIOD = timedelta(seconds=60)
# From the `now` of the run that decides to the approval reaching the VM's listener: the tick's own work before it
# sends (benchmarks.deadline_approval on Azurite, load 7.7: 500 open events p50 0.29 s, max 0.41 s; 2,000 open
# events p50 1.3 s, max 2.3 s) and the delivery through Relay (p99 6.5 ms to a connected listener, 91 ms to one
# still connecting).
DELIVERY_TIME = timedelta(seconds=3)
# An "approve before NotBefore" approval (onNotBefore: approve) is decided, and so sent, only while at least this is
# left before NotBefore (its send deadline is NotBefore minus this): its delivery, then the listener's tolerance.
SEND_MARGIN = DELIVERY_TIME + NOT_AFTER_TOLERANCE
# A gate's result is what a decision rested on for one timer period at most: every tick reads the gates again.
GATE_RESULT_MAX_AGE = TIMER_PERIOD


@dataclass(frozen=True)
class Bound:
    """An instant after which an approval must not be executed, and the condition that ends then."""

    at: datetime
    why: str


def deadline_lead(rule: Rule) -> timedelta:
    """How long before NotBefore an ``onNotBefore: approve`` rule approves an event it holds: its
    ``approveBeforeSeconds``, but at least a timer period plus the send margin. The tick that decides may come up to
    a period after the deadline, and the approval must still leave SEND_MARGIN before NotBefore (with
    approveBeforeSeconds 60, a tick in the last seconds before NotBefore approved what could only land after it)."""
    return max(timedelta(seconds=rule.approveBeforeSeconds), TIMER_PERIOD + SEND_MARGIN)


def approval_bound(
    policy: Policy, rule_name: str, record: EventRecord, now: datetime, *, at_deadline: bool
) -> Bound | None:
    """Until when the conditions of the named rule's approval, decided at ``now``, hold: the event's NotBefore, the
    next blackout's start, and unless the rule approved at the deadline (``at_deadline``: its window or gates held,
    and NotBefore let it go), its window's end and its gates' results' age limit. None: nothing ends it (no
    NotBefore, no blackout, no window, no gate)."""
    rule = policy.rule(rule_name)
    bounds = [Bound(blackout.next_open(now), f"blackout {blackout.name!r} opens") for blackout in policy.blackouts]
    if record.notBefore is not None:
        bounds.append(Bound(record.notBefore, "the event's NotBefore"))
    if rule is not None and not at_deadline:
        closes = rule.window.open_until(now) if rule.window is not None else None
        if closes is not None:
            bounds.append(Bound(closes, f"rule {rule.name!r}'s window closes"))
        if rule.gates:
            age = f"{GATE_RESULT_MAX_AGE.total_seconds():g} s old"
            bounds.append(Bound(now + GATE_RESULT_MAX_AGE, f"the results of gates {', '.join(rule.gates)} are {age}"))
    return min(bounds, key=lambda bound: bound.at, default=None)


def person_bound(record: EventRecord) -> Bound | None:
    """A person's approval holds until the event's NotBefore (blackouts, windows and gates are the rules', and a
    person may approve through them)."""
    return Bound(record.notBefore, "the event's NotBefore") if record.notBefore is not None else None


def request_bound(bound: Bound | None, now: datetime, deadline: timedelta, *, tolerance: timedelta) -> Bound:
    """A request's notAfter, sent at ``now``: the approval's bound, or the delivery's deadline when that comes first
    (an attempt not answered by then is recorded as failed, and the retry is decided again). The deadline is given
    the listener's tolerance, so that the listener accepts the request for the whole of it."""
    delivery = Bound(
        now + deadline + tolerance, f"the delivery's deadline, {deadline.total_seconds():g} s after sending"
    )
    return bound if bound is not None and bound.at <= delivery.at else delivery


def sendable(not_after: datetime, now: datetime, *, tolerance: timedelta) -> bool:
    """Whether a request with this notAfter may still be sent: the listener refuses it from ``tolerance`` (how far
    the two clocks may disagree; NOT_AFTER_TOLERANCE unless configured) before its notAfter."""
    return now < not_after - tolerance
