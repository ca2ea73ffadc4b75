"""An event's lifecycle: the change being made to its record, its state transitions, the cards they raise, and how
it concludes from what its VMs said.

Pure: the stages (coordinator/pipeline/) and coordinator/domain/event_merge.py start an ``EventChange`` from a
``clone`` of the stored record, move it with ``transition`` and ``advance``, and write it with an ETag; the change
carries its history rows and the cards it raised (``raise_alert``), committed in the same write.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from coordinator.domain.history_rows import approval_row, transition_row
from coordinator.domain.model import AlertKind, EventRecord, LostAnswer, State
from coordinator.domain.observations import Observation
from coordinator.domain.rows import HistoryRow
from coordinator.domain.side_records import refused_force

__all__ = [
    "EventChange",
    "advance",
    "approval_step",
    "clone",
    "force_refused",
    "lost_answer",
    "raise_alert",
    "sender_gone",
    "started_unanswered",
    "transition",
]


@dataclass
class EventChange:
    """One event record being changed, with the history rows and the cards the change brings."""

    record: EventRecord
    rows: list[HistoryRow] = field(default_factory=list)
    alerts: list[AlertKind] = field(default_factory=list)
    changed: bool = False
    # This change (not an earlier write it re-read) decided the approval: only its writer sends it.
    approval_decided: bool = False
    # The observation that created the record (None: the record existed): its envelope's trace is the event's.
    created_from: Observation | None = None
    # The budget claims of an approval this change withdrew (its conditions no longer held): the tail frees them.
    released: list[str] = field(default_factory=list)


def clone(record: EventRecord) -> EventRecord:
    """A copy safe to change: containers copied, sightings and decisions shared (they are replaced, never
    changed in place), the approval copied (its attempt counters are). Much cheaper than a deep copy."""
    return record.model_copy(
        update={
            "resources": list(record.resources),
            "vms": dict(record.vms),
            "alerts": list(record.alerts),
            "pendingAlerts": list(record.pendingAlerts),
            "groups": list(record.groups),
            "approval": record.approval.model_copy() if record.approval else None,
        }
    )


def approval_step(
    record: EventRecord,
    now: datetime,
    *,
    outcome: str,
    reason: str,
    vm: str = "",
    actor: str = "",
    incarnation: int | None = None,
    details: dict[str, Any] | None = None,
) -> HistoryRow:
    """The Approval row of a step of the record's approval: its rule and decision, and its actor unless ``actor``
    names another (the platform's word on it); ``vm`` the VM the step concerns ("" when none)."""
    approval = record.approval
    assert approval is not None
    return approval_row(
        record=record,
        now=now,
        vm=vm,
        rule=approval.rule,
        decision_id=approval.decisionId,
        actor=actor or approval.actor,
        outcome=outcome,
        reason=reason,
        incarnation=incarnation,
        details=details,
    )


def raise_alert(change: EventChange, kind: AlertKind, now: datetime) -> None:
    """Once per kind per event. The kind goes into the record's outbox (``pendingAlerts``) in the same write as
    the transition that causes it, so a crash before the card is sent leaves it for the timer, not lost."""
    record = change.record
    if kind not in record.alerts:
        record.alerts.append(kind)
        record.pendingAlerts.append(kind)
        record.pendingSince = record.pendingSince or now
        change.alerts.append(kind)
        change.changed = True


def transition(change: EventChange, to: State, now: datetime, reason: str, *, executor: str = "") -> None:
    """Moves the event to ``to``, with its Transition row; an approval's transition (``executor``: the VM that
    executed it) names the approval's rule, actor and decision, and that VM."""
    record = change.record
    previous = record.state
    record.state = to
    record.stateSince = now
    change.changed = True
    approval = record.approval if executor else None
    approved = (
        {"rule": approval.rule, "actor": approval.actor, "decision_id": approval.decisionId, "vm": executor}
        if approval is not None
        else {}
    )
    change.rows.append(transition_row(record=record, now=now, previous=previous, reason=reason, **approved))
    alert_for: dict[str, AlertKind] = {"Approved": "approved", "Canceled": "canceled", "Expired": "expired"}
    if to in alert_for:
        raise_alert(change, alert_for[to], now)
    elif to == "Completed" and any(s.impactSeconds is not None for s in record.vms.values()):
        # What the event did, measured, beside what was announced: only when some VM's impact is known.
        raise_alert(change, "completed", now)


def advance(
    change: EventChange,
    now: datetime,
    *,
    silent_vms: frozenset[str] = frozenset(),
    retired: dict[str, str] | None = None,
    heard: Mapping[str, datetime] | None = None,
) -> None:
    """Derives the state from what the VMs said. ``silent_vms`` are VMs whose forwarder stopped reporting: they
    count as 'gone' once at least one VM has seen the event leave (a deleted VM never reports again). ``retired``
    (VM name -> the event that removed it) are VMs known to be gone for good: they count as gone at once, so an
    event only they reported concludes ("VM removed"). ``heard``: when the service last heard each VM that has a
    forwarder (the timer's fleet view; None in a batch, which does not have it)."""
    record = change.record
    if not record.open:
        return
    retired = retired or {}
    removed_here = {name for name, by in retired.items() if by == record.eventId and name in record.resources}
    if removed_here - set(record.removed):
        record.removed = sorted(set(record.removed) | removed_here)
        change.changed = True
    # A "gone" counts only from a VM the event names (issue 21): the peers of its placement group see it too, but
    # whether it is over is the named VMs' to say. Only when none of them reported it (no forwarder there) do the
    # peers' sightings say it.
    named = [s for s in record.vms.values() if s.name in record.resources]
    sightings = named or list(record.vms.values())
    gone = [s for s in sightings if s.status == "Gone" or s.name in retired]
    remaining = [s for s in sightings if s.status != "Gone" and s.name not in silent_vms and s.name not in retired]
    approved = record.approval is not None and record.approval.delivered
    if record.everStarted and record.state not in ("Started",):
        _seen_started(change, now, approved=approved)
    unheard = _unheard(record, retired, heard, silent_vms)
    only_retired = not any(s.status == "Gone" for s in gone)
    waiting = not named and _named_may_still_list(record, heard, silent_vms, retired)
    if gone and not remaining and not (unheard and only_retired) and not waiting:
        if record.removed:
            removed = ", ".join(record.removed)
            transition(change, "Completed", now, f"VM removed: {removed} left with this {record.eventType}")
        elif record.everStarted:
            transition(change, "Completed", now, f"gone from every reporting VM ({len(gone)}) after Started")
        elif approved:
            transition(
                change, "Completed", now, f"gone from every reporting VM ({len(gone)}) after approval; Started not seen"
            )
        else:
            others = sorted({retired[s.name] for s in gone if s.name in retired})
            why = f" (VM removed by {', '.join(others)})" if others else ""
            transition(change, "Canceled", now, f"gone from every reporting VM ({len(gone)}) without starting{why}")
        return
    if record.state == "Scheduled" and record.notBefore is not None and now >= record.notBefore and not approved:
        transition(change, "Expired", now, f"NotBefore {record.notBefore.isoformat()} passed without approval")


def _unheard(
    record: EventRecord, retired: dict[str, str], heard: Mapping[str, datetime] | None, silent: frozenset[str]
) -> list[str]:
    """The VMs the event names that have not reported it and may still: a retired VM counts as gone, but not for an
    event whose named VMs have not reported it yet (their envelopes may be held back, e.g. by an Event Hubs outage):
    only a VM that saw it leave can say it is over. The timer, which knows when each VM was last heard, lets a named
    VM heard since the event was first seen say it by not listing it (a VM's envelopes arrive in order): one that
    missed the event (a throttled poll) and whose only reporter was then deleted would otherwise leave it open."""
    first_seen = _first_seen(record)
    return [
        name
        for name in record.resources
        if name not in record.vms
        and name not in retired
        and (heard is None or _may_still_list(name, first_seen, heard, silent))
    ]


def _named_may_still_list(
    record: EventRecord, heard: Mapping[str, datetime] | None, silent: frozenset[str], retired: dict[str, str]
) -> bool:
    """Whether a VM the event names, none of which reported it, may still list it, so the peers' 'gone' does not
    conclude it yet: a named VM with a forwarder that has not been heard since the event was first seen (its
    envelope listing it may be on its way), or, in a batch (``heard`` None), any named VM: the timer, which knows
    who has a forwarder and when each was last heard, concludes it. A named VM without a forwarder, silent or
    removed never lists it."""
    if heard is None:
        return any(name not in retired for name in record.resources)
    first_seen = _first_seen(record)
    return any(name not in retired and _may_still_list(name, first_seen, heard, silent) for name in record.resources)


def _first_seen(record: EventRecord) -> datetime | None:
    return min((s.firstSeen for s in record.vms.values()), default=None)


def _may_still_list(
    name: str, first_seen: datetime | None, heard: Mapping[str, datetime], silent: frozenset[str]
) -> bool:
    """Whether VM ``name``'s envelopes may still list an event first seen at ``first_seen``: it has a forwarder, not
    silent, and it has not been heard since (what it sent since would have come after any envelope listing it)."""
    return name in heard and name not in silent and (first_seen is None or heard[name] < first_seen)


def _seen_started(change: EventChange, now: datetime, *, approved: bool) -> None:
    record = change.record
    reason = "seen Started"
    if not record.seenScheduled:
        reason = "appeared directly as Started (no notice: e.g. hardware failure)"
    elif not approved:
        reason = _started_unapproved(record)
    went_unapproved = record.seenScheduled and record.state == "Scheduled" and _went_at_not_before(record, now)
    transition(change, "Started", now, reason)
    if went_unapproved:
        # Its NotBefore passed without approval: the same card whether a run saw it Expired first or its first
        # sight after NotBefore is Started (which of the two comes first is only the timer's and the VM's timing).
        raise_alert(change, "expired", now)
    if not approved and (row := started_unanswered(record, now)) is not None:
        change.rows.append(row)


def lost_answer(change: EventChange, now: datetime, *, executor: str, reason: str) -> None:
    """A request of the event's approval reached ``executor``'s listener, which went away before it answered (the
    relay's 502): its outcome is unknown, IMDS may have accepted it. Kept on the approval (its decision's first such
    request); when the event was already seen Started, the row that says what that means comes now
    (``started_unanswered``), else with the Started transition (``advance``). Nothing is sent because of it."""
    approval = change.record.approval
    if approval is None or approval.lostAnswer is not None:
        return
    approval.lostAnswer = LostAnswer(executor=executor, sentAt=now, reason=reason[:1000])
    change.changed = True
    if change.record.state != "Scheduled" and (row := started_unanswered(change.record, now)) is not None:
        change.rows.append(row)


def sender_gone(change: EventChange, now: datetime) -> None:
    """An approval decided and never answered (no outcome: its sender stopped between the deciding write and
    recording one) whose event left Scheduled before the timer's retry was due: nothing sends it again, so nothing
    would say what became of it. Once its in-flight grace (``nextAttemptAt``) has passed, one Approval row says what is
    known, outcome ``unknown``: the listener may have executed it (its ledger knows), the event started or ended
    without it."""
    record = change.record
    approval = record.approval
    if approval is None or not record.awaiting_outcome or record.state == "Scheduled":
        return
    if approval.nextAttemptAt is not None and approval.nextAttemptAt > now:
        return
    to = f" to {approval.executor}" if approval.executor else ""
    approval.outcome = "unknown"
    approval.reason = (
        f"approval decided at {approval.decidedAt.isoformat()}{to} has no recorded outcome (its sender stopped before "
        f"recording one, or it waited for an earlier request to lapse), and the event was {record.state} before a "
        f"retry was due (seen Started "
        f"{record.startedSeenAt.isoformat() if record.startedSeenAt else 'never'}, NotBefore "
        f"{record.notBefore.isoformat() if record.notBefore else 'none'}); whether its StartRequests was made only "
        "the listener's ledger knows"
    )
    approval.nextAttemptAt = None
    change.rows.append(approval_step(record, now, vm=approval.executor, outcome="unknown", reason=approval.reason))
    change.changed = True


def started_unanswered(record: EventRecord, now: datetime) -> HistoryRow | None:
    """The Approval row (Actor platform, Outcome ``started``) of an event seen Started before its NotBefore after a
    request of its approval reached its executor and the answer was lost (``lost_answer``); None otherwise.

    The platform starts an event before its NotBefore once StartRequests for it is accepted, and only a listener's
    answer says that this approval's was: with that answer lost (a VM deleted by the Terminate it had just executed
    answers nothing, and no retry can reach it), the early start is the only sign. The row says what is known: the
    request reached the executor, its answer was lost, the event started early. It claims no approval (Outcome
    ``approved`` is the listener's answer) and moves the event to no Approved state."""
    approval = record.approval
    lost = approval.lostAnswer if approval is not None else None
    started, not_before = record.startedSeenAt, record.notBefore
    if approval is None or approval.delivered or lost is None or started is None or not_before is None:
        return None
    if started >= not_before:
        return None  # at or after NotBefore the platform starts it whatever: the start says nothing of the request
    early = (not_before - started).total_seconds()
    only = (
        f"; a Terminate is executed only by the VM it deletes, {lost.executor}"
        if record.eventType == "Terminate"
        else ""
    )
    return approval_step(
        record,
        now,
        vm=lost.executor,
        actor="platform",
        outcome="started",
        reason=(
            f"seen Started at {started.isoformat()}, {early:.1f} s before its NotBefore {not_before.isoformat()}, "
            f"after approval {approval.decisionId}, sent at {lost.sentAt.isoformat()}, reached {lost.executor}'s "
            f"listener, whose answer was lost{only}: started early, as an accepted StartRequests starts it; most "
            f"likely this approval's, not confirmed by any answer ({lost.reason[:600]})"
        ),
        details={
            "requestSentAt": lost.sentAt.isoformat(),
            "startedSeenAt": started.isoformat(),
            "notBefore": not_before.isoformat(),
            "secondsBeforeNotBefore": round(early, 3),
        },
    )


def _went_at_not_before(record: EventRecord, now: datetime) -> bool:
    """Started at or after its NotBefore with no approval from here that may have started it (none, or one that
    failed or was refused; one awaiting or having lost its answer may be what started it)."""
    approval = record.approval
    if approval is not None and (approval.lostAnswer is not None or approval.outcome in ("", "continued")):
        return False
    if approval is not None and approval.outcome == "accepted" and not force_refused(record):
        return False  # its VM's force hook ran, and its StartRequests may be what started it
    started = record.startedSeenAt or now
    return record.notBefore is not None and started >= record.notBefore


def force_refused(record: EventRecord) -> str:
    """The VM that refused the event's force approval, "" if none did: its executor reported its force phase other
    than succeeded, and its listener refuses a force request whose hook did not succeed (forwarder/approver.py), so
    that request executes nothing more. Its own word, about its own approval only."""
    approval = record.approval
    if approval is None or not approval.forceHook or not approval.executor:
        return ""
    sighting = record.vms.get(approval.executor)
    outcome = sighting.hooks.get("force", "") if sighting is not None else ""
    return approval.executor if outcome and outcome != "succeeded" else ""


def _started_unapproved(record: EventRecord) -> str:
    """The Started transition's reason when no listener's answer says that the event's approval was executed."""
    approval = record.approval
    if approval is not None and approval.lostAnswer is not None:
        lost = approval.lostAnswer
        early = (
            record.startedSeenAt is not None
            and record.notBefore is not None
            and record.startedSeenAt < record.notBefore
        )
        when = (
            "before its NotBefore: most likely that approval's start (unconfirmed)"
            if early
            else "at or after NotBefore"
        )
        return (
            f"seen Started {when}, after approval {approval.decisionId} reached {lost.executor}, whose answer was lost"
        )
    if approval is not None and approval.outcome == "accepted":
        ran = "failed: the platform started it" if force_refused(record) else "ran: most likely its StartRequests"
        return (
            f"seen Started after {approval.executor} accepted approval {approval.decisionId} and its force hook "
            f"{approval.forceHook} {ran}"
        )
    if approval is not None and approval.outcome in ("", "continued"):
        to = f" to {approval.executor}" if approval.executor else ""
        return (
            f"seen Started while approval {approval.decisionId}{to} awaited its answer (NotBefore passed, approved "
            "elsewhere, or that approval; its answer, if one comes, is recorded)"
        )
    refused = refused_force(record.escalation)
    if refused is not None and approval is None:
        return (
            f"seen Started after {refused.refusedBy} refused the force step's approval: its force hook {refused.hook} "
            "failed, and no other approval came from here (NotBefore passed or approved elsewhere)"
        )
    return "seen Started without an approval from here (NotBefore passed or approved elsewhere)"
