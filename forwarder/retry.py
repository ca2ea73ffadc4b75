"""Backoff with jitter, and the process-wide IMDS rate limiter: the forwarder's one place for retry timing."""

from __future__ import annotations

import random
import threading
import time


class Backoff:
    """Exponential backoff with "equal jitter": the delay is uniform in [d/2, d], d = min(maximum, initial·2ⁿ).

    Half the delay is kept so that a fleet of VMs hitting the same outage still spreads out but never retries in a
    tight loop. A server-supplied Retry-After wins when it is longer.
    """

    def __init__(self, *, initial: float = 1.0, maximum: float = 60.0, rng: random.Random | None = None) -> None:
        if initial <= 0 or maximum < initial:
            raise ValueError("Backoff needs 0 < initial <= maximum")
        self._initial = initial
        self._maximum = maximum
        self._attempts = 0
        self._rng = rng or random.Random()  # noqa: S311 - jitter, not cryptography

    @property
    def attempts(self) -> int:
        return self._attempts

    def next_delay(self, *, retry_after: float | None = None) -> float:
        ceiling = min(self._maximum, self._initial * (2 ** min(self._attempts, 30)))
        self._attempts += 1
        delay = self._rng.uniform(ceiling / 2, ceiling)
        if retry_after is not None and retry_after > delay:
            return min(retry_after, self._maximum)
        return delay

    def reset(self) -> None:
        self._attempts = 0


class RateLimiter:
    """A token bucket shared by every IMDS caller of the process (the poll loop and the relay listener's approvals):
    IMDS throttles at about 5 requests/s per VM, and a throttled poll is a missed poll."""

    def __init__(self, *, per_second: float, burst: int = 1) -> None:
        if per_second <= 0 or burst < 1:
            raise ValueError("RateLimiter needs per_second > 0 and burst >= 1")
        self._interval = 1.0 / per_second
        self._burst = burst
        self._lock = threading.Lock()
        self._tokens = float(burst)
        self._stamp = time.monotonic()

    @property
    def per_second(self) -> float:
        return 1.0 / self._interval

    @property
    def burst(self) -> int:
        return self._burst

    def acquire(self) -> None:
        """Block until one request may go out."""
        while True:
            with self._lock:
                now = time.monotonic()
                self._tokens = min(self._burst, self._tokens + (now - self._stamp) / self._interval)
                self._stamp = now
                if self._tokens >= 1:
                    self._tokens -= 1
                    return
                wait = (1 - self._tokens) * self._interval
            time.sleep(wait)


# IMDS throttles at about 5 requests/s per VM. A bucket of 3 refilled at 2/s lets at most 3 + 2 = 5 requests into any
# one-second window, sustains the 1/s poll, and still has two tokens when an approval arrives just after a poll, so
# the approver's fresh GET and its POST go out at once instead of 250 ms apart (a bucket of 1 at 4/s did that).
IMDS_LIMITER = RateLimiter(per_second=2.0, burst=3)
