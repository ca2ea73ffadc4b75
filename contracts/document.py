"""The IMDS Scheduled Events document, as the service returns it (api-version 2020-07-01 and older).

Field names keep IMDS's PascalCase so that a document round-trips unchanged; unknown fields are kept.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from contracts.wire_rules import EVENT_TYPES, EventStatus, parse_not_before

__all__ = ["EVENT_TYPES", "EventStatus", "ScheduledEvent", "ScheduledEventsDocument", "parse_not_before"]


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
        """NotBefore as an aware UTC datetime; None when empty (a Started event), unparseable or without a zone.

        IMDS writes RFC 1123 (``Mon, 11 Apr 2022 22:26:58 GMT``); Microsoft's public mock server writes ISO 8601
        (``2022-04-11T22:26:58Z`` or with an offset). Both are accepted; a time without a zone names no instant.
        """
        return parse_not_before(self.NotBefore)

    def concerns(self, vm_name: str) -> bool:
        """Whether this VM (by its IMDS compute name, never the hostname) is among the affected resources."""
        return vm_name in self.Resources

    def executable_by(self, vm_name: str) -> bool:
        """Whether an approval of this event could be executed through this VM's listener (``approver.judge``'s
        preconditions that need no request): still Scheduled, naming its Resources, and, for a Terminate, naming
        this VM (a Terminate is approved only by the VM it deletes; the coordinator never sends it to a peer)."""
        if self.EventStatus != "Scheduled" or not self.Resources:
            return False
        return self.EventType != "Terminate" or self.concerns(vm_name)


class ScheduledEventsDocument(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    DocumentIncarnation: int
    Events: list[ScheduledEvent] = Field(default_factory=list)

    def event(self, event_id: str) -> ScheduledEvent | None:
        return next((e for e in self.Events if e.EventId == event_id), None)
