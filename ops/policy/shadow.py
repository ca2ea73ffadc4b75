"""The counterfactual report: what a candidate policy would have done, beside what happened (pure over history rows).

Per event, from its own rows: when the candidate first would have approved it (its first ``Shadow`` row with
verdict approve, written by a coordinator running ``COORDINATOR_SHADOW_POLICY``; or, with ``dry_run``, its first
``Decision`` row made in dry-run mode with verdict approve), when the live policy approved it (its ``Approved``
transition) or let it expire, when the platform started it (its ``Started`` transition), NotBefore, and the impact
each VM measured (its ``Impact`` rows). ``python -m ops.policy shadow-report --history FILE`` prints it;
``infra/queries/shadow-report.kql`` is the same over Log Analytics.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from coordinator import HistoryRow

__all__ = ["Counterfactual", "counterfactuals", "summary"]


@dataclass
class Counterfactual:
    """One event: what the candidate would have done, what the live policy did, what the platform did, the impact."""

    eventId: str
    eventType: str = ""
    resources: list[str] = field(default_factory=list)
    notBefore: datetime | None = None
    firstSeen: datetime | None = None
    candidateRule: str = ""
    candidateVerdict: str = ""  # the candidate's last verdict
    wouldApproveAt: datetime | None = None
    liveApprovedAt: datetime | None = None
    liveRule: str = ""
    expiredAt: datetime | None = None
    startedAt: datetime | None = None
    announcedSeconds: int | None = None
    impactSeconds: dict[str, float] = field(default_factory=dict)  # measured, by VM

    @property
    def differs(self) -> bool:
        """The candidate would have approved an event the live policy did not, or not one it did."""
        return (self.wouldApproveAt is None) != (self.liveApprovedAt is None)

    def line(self) -> str:
        would = f"would approve at {self.wouldApproveAt.isoformat()}" if self.wouldApproveAt else "would not approve"
        live = (
            f"approved at {self.liveApprovedAt.isoformat()} by {self.liveRule or '?'}"
            if self.liveApprovedAt
            else f"expired at {self.expiredAt.isoformat()}"
            if self.expiredAt
            else "not approved"
        )
        started = f"started at {self.startedAt.isoformat()}" if self.startedAt else "not started"
        worst = max(self.impactSeconds.values()) if self.impactSeconds else None
        impact = f"measured impact {worst:.1f} s" if worst is not None else "no impact measured"
        announced = "" if self.announcedSeconds in (None, -1) else f" (announced {self.announcedSeconds} s)"
        return (
            f"{self.eventType} {self.eventId} ({', '.join(self.resources)}): candidate {self.candidateRule or '-'} "
            f"{would}; live {live}; platform {started}; {impact}{announced}"
        )

    def to_json(self) -> dict[str, Any]:
        def iso(value: datetime | None) -> str | None:
            return value.isoformat() if value is not None else None

        return {
            "eventId": self.eventId,
            "eventType": self.eventType,
            "resources": self.resources,
            "notBefore": iso(self.notBefore),
            "candidateRule": self.candidateRule,
            "candidateVerdict": self.candidateVerdict,
            "wouldApproveAt": iso(self.wouldApproveAt),
            "liveApprovedAt": iso(self.liveApprovedAt),
            "liveRule": self.liveRule,
            "expiredAt": iso(self.expiredAt),
            "startedAt": iso(self.startedAt),
            "announcedSeconds": self.announcedSeconds,
            "impactSeconds": self.impactSeconds,
            "differs": self.differs,
        }


def counterfactuals(rows: Iterable[HistoryRow], *, dry_run: bool = False) -> list[Counterfactual]:
    """Each event's counterfactual, from rows in the order written (ops/policy/exports.read_history's order).
    ``dry_run``: the candidate is the live policy run in dry-run mode (its Decision rows), not a shadow policy."""
    events: dict[str, Counterfactual] = {}
    for row in rows:
        if not row.EventId:
            continue
        event = events.setdefault(row.EventId, Counterfactual(row.EventId))
        _facts(event, row)
        candidate = row.RecordType == "Shadow" or (dry_run and row.RecordType == "Decision" and row.DryRun)
        if candidate and event.wouldApproveAt is None:
            # The rule of its first approval (as infra/queries/shadow-report.kql), else of its last verdict.
            event.candidateRule, event.candidateVerdict = row.Rule, row.Outcome
            event.wouldApproveAt = row.TimeGenerated if row.Outcome == "approve" else None
        elif candidate:
            event.candidateVerdict = row.Outcome
        elif row.RecordType == "Transition":
            _transition(event, row)
        elif row.RecordType == "Impact" and row.MeasuredSeconds is not None:
            event.impactSeconds[row.VmName] = row.MeasuredSeconds
    return sorted(events.values(), key=lambda e: (e.firstSeen.timestamp() if e.firstSeen else math.inf, e.eventId))


def _facts(event: Counterfactual, row: HistoryRow) -> None:
    if event.firstSeen is None and row.RecordType == "Observation":
        event.firstSeen = row.TimeGenerated
    event.eventType = event.eventType or row.EventType
    event.resources = event.resources or list(row.Resources or [])
    event.notBefore = event.notBefore or row.NotBefore
    if event.announcedSeconds is None and row.DurationInSeconds is not None:
        event.announcedSeconds = row.DurationInSeconds


def _transition(event: Counterfactual, row: HistoryRow) -> None:
    if row.State == "Approved" and event.liveApprovedAt is None:
        event.liveApprovedAt, event.liveRule = row.TimeGenerated, row.Rule
    elif row.State == "Expired" and event.expiredAt is None:
        event.expiredAt = row.TimeGenerated
    elif row.State == "Started" and event.startedAt is None:
        event.startedAt = row.TimeGenerated


def summary(events: Sequence[Counterfactual]) -> dict[str, Any]:
    """How far the candidate differs: events it would have approved that the live policy did not (and their measured
    impact), events the live policy approved that it would not, and by how much it would have approved earlier."""
    more = [e for e in events if e.wouldApproveAt is not None and e.liveApprovedAt is None]
    fewer = [e for e in events if e.wouldApproveAt is None and e.liveApprovedAt is not None]
    both = [e for e in events if e.wouldApproveAt is not None and e.liveApprovedAt is not None]
    earlier = [(e.liveApprovedAt - e.wouldApproveAt).total_seconds() for e in both]  # type: ignore[operator]
    return {
        "events": len(events),
        "candidateApproves": sum(1 for e in events if e.wouldApproveAt is not None),
        "liveApproves": sum(1 for e in events if e.liveApprovedAt is not None),
        "onlyCandidate": [e.eventId for e in more],
        "onlyLive": [e.eventId for e in fewer],
        "candidateEarlierSecondsMedian": sorted(earlier)[len(earlier) // 2] if earlier else None,
        "impactOfOnlyCandidateSeconds": round(sum(max(e.impactSeconds.values(), default=0.0) for e in more), 3),
    }
