"""When the replay decides an event again (ops/policy/replay.py): its decision points in time order, with the ladder
steps' instants added as they are found, and where an instant falls among the history's rows.

Pure: history rows in, points out. A decision point is (position in the history, instant, the recorded Decision row
in force, whether the point is that decision); ``Instants`` gives each instant once, earliest first. An escalation
step a recorded decision took is read from its row's ``Details.escalation`` (``steps_taken``).
"""

from __future__ import annotations

import heapq
import itertools
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any

from coordinator import HistoryRow
from ops.policy import adapters

__all__ = ["SAME_TIME", "TICK", "Instants", "Point", "Positions", "step_time", "steps_taken"]

# The coordinator's timer period (coordinator/domain/expiry.py TIMER_PERIOD): a ladder step is taken by its first run
# at or after the step's time, so a recorded run within this after it is the one that would have taken it.
TICK = timedelta(seconds=60)
# A recorded step's time (Details.escalation's ``at``, ISO-8601) and one made from the NotBefore column are the same
# step within this (an export may keep a time's milliseconds only).
SAME_TIME = timedelta(seconds=1)
Point = tuple[int, datetime, HistoryRow, bool]


class Instants:
    """An event's decision points in time order: the history's, and its ladder steps' as they are found, each once."""

    def __init__(self, points: Iterable[Point]) -> None:
        self._order = itertools.count()
        self._heap: list[tuple[datetime, int, Point]] = []
        self._seen: set[datetime] = set()
        self.add(points)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def add(self, points: Iterable[Point]) -> None:
        for point in points:
            if point[1] not in self._seen:
                self._seen.add(point[1])
                heapq.heappush(self._heap, (point[1], next(self._order), point))

    def pop(self) -> Point:
        return heapq.heappop(self._heap)[2]


class Positions:
    """Where an instant falls in the history: just after every row of it at or before that instant (the rows need
    not be in time order: ``read_history`` sorts them, a caller's own list may not be)."""

    def __init__(self, rows: Sequence[HistoryRow]) -> None:
        ordered = sorted((row.TimeGenerated, position) for position, row in enumerate(rows))
        self._times = [at for at, _ in ordered]
        self._after = list(itertools.accumulate((position + 1 for _, position in ordered), max))

    def after(self, at: datetime) -> int:
        index = bisect_right(self._times, at)
        return self._after[index - 1] if index else 0


def steps_taken(row: HistoryRow) -> list[dict[str, Any]]:
    """The escalation steps a recorded Decision row took (its Details.escalation: step, of, do,
    beforeNotBeforeSeconds, at, owners), with when and by which decision, as EventRecord.escalation holds them."""
    steps = (row.Details or {}).get("escalation")
    if not isinstance(steps, list):
        return []
    return [
        {**step, "takenAt": row.TimeGenerated, "decisionId": row.DecisionId} for step in steps if isinstance(step, dict)
    ]


def step_time(value: object) -> datetime | None:
    """A recorded step's ``at`` as a time (None when it is not one)."""
    if isinstance(value, datetime):
        return adapters.aware(value)
    try:
        return adapters.aware(datetime.fromisoformat(str(value).replace("Z", "+00:00")))
    except ValueError:
        return None
