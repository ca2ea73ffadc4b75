"""Retry timing (coordinator/domain/retry.py): exponential backoff with full jitter, capped."""

from __future__ import annotations

import random

import pytest

from coordinator.domain.retry import backoff_delay
from tests.coordinator.runs import Bound


@pytest.mark.parametrize(("attempt", "ceiling"), [(0, 5.0), (1, 10.0), (2, 20.0), (3, 40.0), (4, 60.0), (30, 60.0)])
def test_the_ceiling_doubles_from_initial_up_to_maximum(attempt, ceiling):
    rng = Bound(high=True)
    assert backoff_delay(attempt, initial=5.0, maximum=60.0, rng=rng) == ceiling
    # Full jitter: anywhere from no wait at all up to the ceiling.
    assert rng.asked == [(0.0, ceiling)]
    assert backoff_delay(attempt, initial=5.0, maximum=60.0, rng=Bound(high=False)) == 0.0


def test_a_huge_attempt_number_neither_overflows_nor_passes_the_maximum():
    # A retry counter stored for weeks (or corrupted) must not raise OverflowError in 2**attempt.
    assert backoff_delay(10**6, initial=0.5, maximum=8.0, rng=Bound(high=True)) == 8.0


def test_delays_are_spread_within_the_bounds():
    rng = random.Random(7)
    delays = [backoff_delay(3, initial=1.0, maximum=100.0, rng=rng) for _ in range(500)]
    assert all(0.0 <= d <= 8.0 for d in delays)
    # Instances retrying together spread out rather than wait the same time.
    assert len({round(d, 3) for d in delays}) > 400
    assert min(delays) < 1.0
    assert max(delays) > 7.0


def test_the_same_seed_gives_the_same_delays():
    first = [backoff_delay(n, initial=1.0, maximum=30.0, rng=random.Random(3)) for n in range(6)]
    again = [backoff_delay(n, initial=1.0, maximum=30.0, rng=random.Random(3)) for n in range(6)]
    assert first == again
