"""Retry timing for the coordinator, in one place: exponential backoff with full jitter."""

from __future__ import annotations

import random


def backoff_delay(attempt: int, *, initial: float, maximum: float, rng: random.Random) -> float:
    """Seconds to wait before retry number ``attempt + 1`` (attempt counts from 0): uniform in
    [0, min(maximum, initial * 2**attempt)] so that many instances retrying together spread out."""
    ceiling = min(maximum, initial * (2 ** min(attempt, 30)))
    return rng.uniform(0.0, ceiling)
