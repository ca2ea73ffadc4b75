"""Records an event keeps beside its own decision: the escalation steps taken (``EventRecord.escalation``; the steps
themselves: domain/escalation.py) and the shadow policy's verdict (``EventRecord.shadow``: pipeline/shadow.py)."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["EscalationTaken", "ShadowVerdict"]


class EscalationTaken(BaseModel):
    """A step of its rule's escalation ladder the event reached (coordinator/domain/escalation.py): which of how many,
    what it did, its time (NotBefore minus its lead), when and by which decision it was taken, whom it told."""

    model_config = ConfigDict(extra="ignore")

    step: int
    of: int
    do: str
    beforeNotBeforeSeconds: int
    at: datetime
    takenAt: datetime
    decisionId: str
    owners: list[str] = Field(default_factory=list)


class ShadowVerdict(BaseModel):
    """The shadow policy's decision on the event (a candidate evaluated beside the live policy, never sent), as last
    recorded with a Shadow row: its rule, action, verdict and reason, when, under which version of the candidate, and
    when it first would have approved (kept once set: "would have approved at X")."""

    model_config = ConfigDict(extra="ignore")

    rule: str
    action: str
    verdict: str
    reason: str
    decidedAt: datetime
    policyVersion: str
    approveAt: datetime | None = None
