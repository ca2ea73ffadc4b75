"""Clocks for the IMDS emulator: the wall clock in service, a hand-driven one in tests.

The emulator's state machine never reads the time itself; it is handed ``now`` by whoever drives it. Time
scaling is applied to durations (a 15-minute notice lasts 15 s at scale 60), never to the clock, so every
timestamp the emulator shows (NotBefore, startedAt, …) is real UTC wall time that a client can compare with
its own clock.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from typing import Protocol


class Clock(Protocol):
    def now(self) -> datetime:
        """The current time, timezone-aware UTC."""
        ...


class SystemClock:
    def now(self) -> datetime:
        return datetime.now(UTC)


class ManualClock:
    """A clock that moves only when told to; deterministic lifecycle tests use it."""

    def __init__(self, start: datetime | None = None) -> None:
        self._now = start or datetime(2026, 1, 5, 12, 0, 0, tzinfo=UTC)
        if self._now.tzinfo is None:
            raise ValueError("ManualClock start must be timezone-aware")
        self._lock = threading.Lock()

    def now(self) -> datetime:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> datetime:
        with self._lock:
            self._now += timedelta(seconds=seconds)
            return self._now
