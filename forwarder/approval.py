"""The approval contract (coordinator -> Azure Relay -> the VM's listener -> IMDS). Both sides import this.

The listener approves only an EventId that is in its current IMDS document, still Scheduled, and concerns this
VM's group (a Terminate: this VM itself); it answers with what it did. IMDS answers 200 to any valid EventId, so
an "approved" result means "StartRequests was accepted", not "the event started": the coordinator confirms by
seeing Started or gone.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

ApprovalOutcome = Literal["approved", "not-found", "not-scheduled", "rejected"]


class ApprovalRequest(BaseModel):
    model_config = ConfigDict(frozen=True)

    eventId: str = Field(min_length=1, max_length=128)
    decisionId: str = Field(min_length=1, max_length=128)
    rule: str = Field(min_length=1, max_length=256)
    issuedAt: datetime
    expiresAt: datetime


class ApprovalResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    outcome: ApprovalOutcome
    eventId: str
    decisionId: str
    documentIncarnation: int | None = None
    reason: str = ""
