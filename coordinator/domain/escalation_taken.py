"""The record of an escalation step taken (``EventRecord.escalation``; the steps themselves: domain/escalation.py)."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["EscalationTaken"]


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
