"""Every accepted StartRequests judged (pure): WRONG when the policy could not have allowed it at any decision time
within the slack before it was accepted (``oracle.allowed``'s upper set; the slack grows by the time the executing
VM's forwarder was paused just before: ``Facts.delivery_slack``), DUPLICATE when its event had one already."""

from __future__ import annotations

from oracle.allowed import Judge
from oracle.facts import INF, Facts
from oracle.intervals import Intervals, seconds
from oracle.truth import Approval, Event
from oracle.verdict import Finding

__all__ = ["approval_findings"]


def approval_findings(run: Facts, judges: dict[str, Judge]) -> list[Finding]:
    findings = []
    by_event: dict[str, list[Approval]] = {}
    for approval in sorted(run.truth.approvals, key=lambda a: a.at):
        event = run.events.get(approval.eventId.upper())
        at = seconds(approval.at)
        if event is None:
            findings.append(Finding("wrong", approval.eventId, approval.eventId[:8], "approval of an unknown event"))
            continue
        by_event.setdefault(event.eventId, []).append(approval)
        judge = judges[event.eventId]
        window = Intervals(((at - run.delivery_slack(approval.vm, at), at + 1e-6),))
        if judge.upper & window:
            continue
        ok, why = judge.allows(at, surely=False)
        if ok and at not in run.scheduled(event):
            left = run.left_scheduled(event) - run.start
            why = f"the event was {approval.statusBefore} (it left Scheduled at +{left:.1f}s)"
        distance = judge.upper.distance(at)
        outside = f"; nearest allowed instant {distance:.1f} s away" if distance != INF else "; never allowed"
        outside += _history_note(run, event, at)
        findings.append(
            Finding(
                "wrong",
                event.eventId,
                run.label(event),
                f"StartRequests through {approval.vm} ({approval.via}) at +{at - run.start:.1f}s: {why}{outside}",
            )
        )
    for event_id, approvals in by_event.items():
        for extra in approvals[1:]:
            event = run.events[event_id.upper()]
            first = approvals[0]
            findings.append(
                Finding(
                    "duplicate",
                    event_id,
                    run.label(event),
                    f"StartRequests through {extra.vm} ({extra.via}) at +{seconds(extra.at) - run.start:.1f}s after "
                    f"one through {first.vm} ({first.via}) at +{seconds(first.at) - run.start:.1f}s",
                )
            )
    return findings


def _history_note(run: Facts, event: Event, at: float) -> str:
    """What the coordinator's history says of this approval: when it decided to approve, how often it sent it."""
    ids = {event.eventId.upper(), *(former.upper() for former in event.formerIds)}
    steps = [step for step in run.truth.history if step.eventId.upper() in ids and seconds(step.at) <= at + 1.0]
    decided = [step for step in steps if step.kind == "Decision" and step.outcome == "approve"]
    sent = [step for step in steps if step.kind == "Approval" and step.outcome == "sending"]
    if not decided:
        return ""
    note = f"; history: decided approve at +{seconds(decided[-1].at) - run.start:.1f}s"
    if len(sent) > 1:
        note += f", sent {len(sent)} times (last: {sent[-1].reason[:80]})"
    return note
