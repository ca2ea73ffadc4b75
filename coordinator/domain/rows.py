"""One history row: the columns of coordinator/history_columns.json as a pydantic model (pure, no I/O).

The JSON file is the single definition; a test checks that this model's fields are exactly its columns. Every row
has a stable ``RecordId`` from the moment it is built (a hash of its other columns; of a VM's report, of the
report's own: ``_REPORT_VIEW``): the outbox keeps rows with it, and an upload made twice adds nothing to a store that
keeps rows by it (docs/liveness.md, *The outbox*).
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

COLUMNS_FILE = Path(__file__).parent.parent / "history_columns.json"


@cache
def history_schema() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(COLUMNS_FILE.read_text(encoding="utf-8"))
    return schema


def column_types() -> dict[str, str]:
    return {column["name"]: column["type"] for column in history_schema()["columns"]}


# What a VM's own envelope said at its position (an Observation, a Hook, an Impact it measured) is one fact whichever
# instance records it and at whatever ``now``: two instances that fold the same envelope (a partition handed over
# and its last batch delivered to both, each write otherwise correct) write one row. Its id leaves out the
# coordinator's side of the row: when it was written and the event as that run saw it (its state, its facts, and an
# Observation's reason, which compares the sighting with them).
_EVENT_VIEW = frozenset(
    {"TimeGenerated", "State", "EventType", "EventSource", "NotBefore", "DurationInSeconds", "Resources"}
)
_REPORT_VIEW = {
    "Observation": _EVENT_VIEW | {"Reason", "Details"},
    "Hook": _EVENT_VIEW,
    "Impact": _EVENT_VIEW | {"Reason"},
}


class HistoryRow(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    TimeGenerated: datetime
    RecordType: str
    EventId: str = ""
    EventType: str = ""
    EventSource: str = ""
    EventStatus: str = ""
    State: str = ""
    PreviousState: str = ""
    NotBefore: datetime | None = None
    DurationInSeconds: int | None = None
    Resources: list[str] | None = None
    VmName: str = ""
    VmId: str = ""
    VmResourceId: str = ""
    ScaleSetName: str = ""
    PlacementGroupId: str = ""
    DocumentIncarnation: int | None = None
    ObservedAt: datetime | None = None
    Sequence: int | None = None
    Rule: str = ""
    Action: str = ""
    DecisionId: str = ""
    Actor: str = ""
    Outcome: str = ""
    HookPhase: str = ""
    Reason: str = ""
    HoldKind: str = ""
    HoldName: str = ""
    HoldSince: datetime | None = None
    HeldUntil: datetime | None = None
    DryRun: bool | None = None
    Details: dict[str, Any] | None = None
    ImpactMeasure: str = ""
    MeasuredSeconds: float | None = None
    ImpactStart: datetime | None = None
    ImpactEnd: datetime | None = None
    ReturnToServiceSeconds: float | None = None
    RecordId: str = ""

    @model_validator(mode="after")
    def _identified(self) -> HistoryRow:
        # From the content, not at random: the same row built twice by one run (a write redone after a conflict
        # re-derives its rows at the run's one ``now``) is one row.
        if not self.RecordId:
            leave_out = _REPORT_VIEW.get(self.RecordType, frozenset()) | {"RecordId"}
            digest = hashlib.sha256(self.model_dump_json(exclude=set(leave_out)).encode("utf-8")).hexdigest()
            object.__setattr__(self, "RecordId", digest[:32])  # frozen: set once, while it is being built
        return self

    def to_log(self) -> dict[str, Any]:
        """The Logs Ingestion shape: ISO-8601 datetimes, JSON for dynamic columns, empty values left out."""
        data: dict[str, Any] = self.model_dump(mode="json", exclude_none=True)
        return {key: value for key, value in data.items() if value != ""}
