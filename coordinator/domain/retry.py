"""Retry timing for the coordinator, in one place: exponential backoff with full jitter."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


def backoff_delay(attempt: int, *, initial: float, maximum: float, rng: random.Random) -> float:
    """Seconds to wait before retry number ``attempt + 1`` (attempt counts from 0): uniform in
    [0, min(maximum, initial * 2**attempt)] so that many instances retrying together spread out."""
    ceiling = min(maximum, initial * (2 ** min(attempt, 30)))
    return rng.uniform(0.0, ceiling)


@dataclass(frozen=True)
class Backoff:
    """An adapter's retry delays: ``backoff_delay`` from ``initial`` doubling up to ``maximum``, jittered by ``rng``."""

    initial: float
    maximum: float
    rng: random.Random = field(default_factory=random.Random)

    def delay(self, attempt: int, *, maximum: float | None = None) -> float:
        """Seconds before retry number ``attempt + 1``; ``maximum``: this one's cap instead of the backoff's."""
        cap = self.maximum if maximum is None else maximum
        return backoff_delay(attempt, initial=self.initial, maximum=cap, rng=self.rng)
