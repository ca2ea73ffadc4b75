"""Sets of instants as sorted, disjoint half-open intervals of POSIX seconds, and the one way the oracle builds
them from conditions: a predicate that is constant between known breakpoints, evaluated once per piece."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

__all__ = ["EMPTY", "Intervals", "seconds", "when"]


def seconds(moment: datetime) -> float:
    return moment.timestamp()


def when(value: float) -> datetime:
    return datetime.fromtimestamp(value, UTC)


@dataclass(frozen=True)
class Intervals:
    spans: tuple[tuple[float, float], ...] = ()

    @classmethod
    def of(cls, spans: Iterable[tuple[float, float]]) -> Intervals:
        merged: list[tuple[float, float]] = []
        for lo, hi in sorted(span for span in spans if span[1] > span[0]):
            if merged and lo <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        return cls(tuple(merged))

    @classmethod
    def where(cls, breakpoints: Iterable[float], lo: float, hi: float, holds: Callable[[float], bool]) -> Intervals:
        """The instants of [lo, hi) where ``holds`` is true, for a predicate constant between ``breakpoints`` (each
        piece is judged at its middle, so a predicate that changes exactly at a breakpoint is judged right)."""
        points = sorted({lo, hi, *(point for point in breakpoints if lo < point < hi)})
        return cls.of((a, b) for a, b in itertools.pairwise(points) if holds((a + b) / 2))

    def __bool__(self) -> bool:
        return bool(self.spans)

    def __contains__(self, instant: float) -> bool:
        return any(lo <= instant < hi for lo, hi in self.spans)

    def __or__(self, other: Intervals) -> Intervals:
        return Intervals.of(self.spans + other.spans)

    def __and__(self, other: Intervals) -> Intervals:
        out = []
        for lo, hi in self.spans:
            for olo, ohi in other.spans:
                if olo < hi and lo < ohi:
                    out.append((max(lo, olo), min(hi, ohi)))
        return Intervals.of(out)

    def __sub__(self, other: Intervals) -> Intervals:
        out: list[tuple[float, float]] = []
        for lo, hi in self.spans:
            pieces = [(lo, hi)]
            for olo, ohi in other.spans:
                pieces = [
                    piece for a, b in pieces for piece in ((a, min(b, olo)), (max(a, ohi), b)) if piece[1] > piece[0]
                ]
            out.extend(pieces)
        return Intervals.of(out)

    def extended(self, *, before: float = 0.0, after: float = 0.0) -> Intervals:
        return Intervals.of((lo - before, hi + after) for lo, hi in self.spans)

    def clipped(self, lo: float, hi: float) -> Intervals:
        return self & Intervals(((lo, hi),))

    def first_run(self, length: float) -> float | None:
        """The end of the first ``length`` seconds spent inside one interval: the earliest instant t with
        [t - length, t] inside; None when no interval is that long."""
        return next((lo + length for lo, hi in self.spans if hi - lo >= length), None)

    def distance(self, instant: float) -> float:
        """How far ``instant`` lies from the set (0 inside; inf when the set is empty)."""
        if instant in self:
            return 0.0
        return min((min(abs(instant - lo), abs(instant - hi)) for lo, hi in self.spans), default=float("inf"))


EMPTY = Intervals()
