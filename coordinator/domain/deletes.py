"""Deletes and evictions, as the platform runs them: which VMs a Terminate or Preempt removes, the pending deletes
of a scale set that hold an approved one, and their decisions coupled so they are approved together.

Pure: takes event records (and a decision from coordinator/domain/evaluation.py); gives the VMs leaving or removed,
the platform's hold on an approved delete, and the decision a pending delete gets beside its siblings.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from coordinator.domain.evaluation import Decision
from coordinator.domain.model import EventRecord, PlatformHold
from coordinator.domain.observations import minus

__all__ = [
    "REMOVING_EVENTS",
    "Removal",
    "couple",
    "leaving_vms",
    "may_be_held",
    "pending_delete",
    "platform_hold",
    "ready_to_go",
    "removal_evidence",
    "removals",
]

# The events that remove the VMs they name (a deleted or evicted VM stops answering IMDS for good).
REMOVING_EVENTS = frozenset({"Terminate", "Preempt"})


@dataclass(frozen=True)
class Removal:
    """A VM that a Terminate/Preempt removed: retire it (gone for good) with this event as the reason."""

    vm: str
    event_id: str
    event_type: str
    reason: str
    # When the removal went ahead, as far as the coordinator knows (removal_start), for the VM's Impact row.
    started: datetime | None = None


def removal_evidence(record: EventRecord, now: datetime) -> str | None:
    """Why a Terminate/Preempt has removed (or is removing) the VMs it names, or None: it was seen Started (by any
    VM), or its NotBefore has passed (the platform goes at NotBefore whatever happens), or it was approved
    (StartRequests accepted) and is not held by another pending delete (an approved delete may go at once, before
    any poll sees Started)."""
    if record.eventType not in REMOVING_EVENTS or record.state in ("Canceled",):
        return None
    if record.everStarted:
        return "seen Started"
    if record.notBefore is not None and now >= record.notBefore:
        return f"its NotBefore {record.notBefore.isoformat()} passed"
    if record.approval is not None and record.approval.delivered and record.platformHold is None:
        return "approved through the platform and not held by another pending delete"
    return None


def removal_start(record: EventRecord) -> datetime | None:
    """When a delete went ahead, as far as the coordinator knows: its approval's decision, if it was delivered,
    else its NotBefore (the platform goes then whatever happens); None when neither is known."""
    times = [record.notBefore] if record.notBefore is not None else []
    if record.approval is not None and record.approval.delivered:
        times.append(record.approval.decidedAt)
    return min(times, default=None)


def leaving_vms(events: Iterable[EventRecord], now: datetime) -> dict[str, str]:
    """The VMs that an open Terminate/Preempt is removing now (VM name -> that event's id): no approval of another
    event may be sent through them, their listener may be gone before it answers. An approval decided for the
    removal counts from the deciding write, before it is delivered: approvals of one batch go out together, and a
    Freeze sent through a VM whose delete is being approved beside it would reach a listener that is leaving."""
    leaving: dict[str, str] = {}
    for record in events:
        decided = record.eventType in REMOVING_EVENTS and record.approval is not None
        if record.open and (decided or removal_evidence(record, now) is not None):
            for name in record.resources:
                leaving.setdefault(name, record.eventId)
    return leaving


def removals(
    events: Iterable[EventRecord], last_seen: dict[str, datetime], now: datetime, grace: timedelta
) -> list[Removal]:
    """Which silent VMs were removed, and by which event: a Terminate or Preempt naming the VM has removal evidence
    (``removal_evidence``), and then the VM has been silent for ``grace`` (longer than a forwarder's heartbeat
    interval: a VM that is still there keeps talking). Silence alone is never enough (that is a lost heartbeat,
    alerted)."""
    found: dict[str, Removal] = {}
    for record in events:
        evidence = removal_evidence(record, now)
        if evidence is None:
            continue
        for name in record.resources:
            seen = last_seen.get(name)
            if name in found or seen is None or seen >= minus(now, grace):
                continue
            found[name] = Removal(
                vm=name,
                event_id=record.eventId,
                event_type=record.eventType,
                reason=(
                    f"removed by {record.eventType} {record.eventId} ({evidence}); silent since {seen.isoformat()}"
                    f" (more than {int(grace.total_seconds())} s)"
                ),
                started=removal_start(record),
            )
    return sorted(found.values(), key=lambda r: r.vm)


def pending_delete(record: EventRecord, now: datetime) -> bool:
    """A delete the platform still waits on: an open Terminate, Scheduled, not approved, NotBefore ahead."""
    return (
        record.eventType == "Terminate"
        and record.state == "Scheduled"
        and record.approval is None
        and (record.notBefore is None or record.notBefore > now)
    )


def may_be_held(record: EventRecord) -> bool:
    """Whether the platform may hold this event for another delete: an approved, open Terminate not yet started
    (anything else has no siblings worth reading)."""
    return record.eventType == "Terminate" and record.approval is not None and not record.everStarted and record.open


def platform_hold(record: EventRecord, siblings: Iterable[EventRecord], now: datetime) -> PlatformHold | None:
    """An approved delete that has not started while another delete of its scale set is pending is held by the
    platform ("Approve all pending deletes"): the pending one that holds it longest (latest NotBefore)."""
    if not may_be_held(record):
        return None
    mine = set(record.scaleSets)
    holders = [
        s for s in siblings if s.eventId != record.eventId and mine & set(s.scaleSets) and pending_delete(s, now)
    ]
    if not holders:
        return None
    far = datetime.max.replace(tzinfo=UTC)
    holder = max(holders, key=lambda s: (s.notBefore or far, s.eventId))
    since = record.platformHold.since if record.platformHold and record.platformHold.eventId == holder.eventId else now
    return PlatformHold(eventId=holder.eventId, vm=", ".join(holder.resources[:3]), until=holder.notBefore, since=since)


def ready_to_go(record: EventRecord) -> bool:
    """Whether a pending delete's own rule approves it (its stored decision says approve, or held only by
    another delete)."""
    decision = record.decision
    return decision is not None and (decision.verdict == "approve" or bool(decision.heldBy))


def couple(decision: Decision, record: EventRecord, deletes: Iterable[EventRecord], now: datetime) -> Decision:
    """The pending deletes of a scale set are decided as one unit: the platform holds an approved delete while
    another delete of its scale set is pending ("Approve all pending deletes"), and simultaneous deletes go
    only when all are approved. So a Terminate that its own rule approves waits while another pending Terminate
    of the same scale set is not ready, naming the one that holds it (the latest NotBefore among them: the
    longest the hold can last); once every one is ready they are approved together."""
    if record.eventType != "Terminate" or decision.verdict != "approve":
        return decision
    mine = set(record.scaleSets)
    blockers = [
        other
        for other in deletes
        if other.eventId != record.eventId
        and mine & set(other.scaleSets)
        and pending_delete(other, now)
        and not ready_to_go(other)
    ]
    if not blockers:
        return decision
    far = datetime.max.replace(tzinfo=UTC)
    holder = max(blockers, key=lambda other: (other.notBefore or far, other.eventId))
    vm = ", ".join(holder.resources[:3]) or holder.eventId
    until = holder.notBefore.isoformat() if holder.notBefore else "its NotBefore"
    why = holder.decision.reason if holder.decision is not None else "not decided yet"
    scale_set = ", ".join(sorted(mine & set(holder.scaleSets)))
    more = f" (and {len(blockers) - 1} more)" if len(blockers) > 1 else ""
    return Decision(
        decision.rule,
        decision.action,
        "wait",
        f"ready ({decision.reason}), held with the pending deletes of scale set {scale_set}: delete of {vm} "
        f"({holder.eventId}){more} is not ready ({why[:300]}), pending until {until}; deletes of a scale set are "
        "approved together once each is ready",
        heldBy=holder.eventId,
        heldByVm=vm,
        heldUntil=holder.notBefore,
        holdKind="delete",
        holdName=holder.eventId,
        escalation=decision.escalation,  # the ladder's steps reached are taken whatever holds the approval
    )
