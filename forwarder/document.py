"""The IMDS Scheduled Events document, as the service returns it (api-version 2020-07-01 and older).

Field names keep IMDS's PascalCase so that a document round-trips unchanged; unknown fields are kept.
"""

from __future__ import annotations

from datetime import datetime
from email.utils import parsedate_to_datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

EVENT_TYPES = ("Freeze", "Reboot", "Redeploy", "Preempt", "Terminate")
EventStatus = Literal["Scheduled", "Started"]


class ScheduledEvent(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    EventId: str = Field(min_length=1, max_length=128)
    # A str, not a Literal: a new platform event type must reach the rules (which default to "wait for a
    # person"), not be dropped as bad input.
    EventType: str = Field(min_length=1, max_length=64)
    ResourceType: str = "VirtualMachine"
    Resources: list[str] = Field(default_factory=list)
    EventStatus: EventStatus
    NotBefore: str = ""
    Description: str = ""
    EventSource: str = "Platform"
    DurationInSeconds: int = -1

    def not_before(self) -> datetime | None:
        """NotBefore as an aware UTC datetime; None when empty (a Started event) or unparseable."""
        if not self.NotBefore:
            return None
        try:
            return parsedate_to_datetime(self.NotBefore)
        except (TypeError, ValueError):
            return None

    def concerns(self, vm_name: str) -> bool:
        """Whether this VM (by its IMDS compute name, never the hostname) is among the affected resources."""
        return vm_name in self.Resources


class ScheduledEventsDocument(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    DocumentIncarnation: int
    Events: list[ScheduledEvent] = Field(default_factory=list)

    def event(self, event_id: str) -> ScheduledEvent | None:
        return next((e for e in self.Events if e.EventId == event_id), None)
