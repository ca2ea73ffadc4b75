"""Backoff with jitter, and the process-wide IMDS rate limiter: the forwarder's one place for retry timing."""

from __future__ import annotations

import random
import threading
import time
from collections import deque


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
    """At most ``requests`` requests in any window of ``per_seconds``, shared by every IMDS caller of the process (the
    poll loop, the attestor, the relay listener's approvals): IMDS throttles at about 5 requests/s per VM, and a
    throttled poll is a missed poll. A sliding window rather than a token bucket: a bucket small enough to keep any
    second under the throttle refills in quanta (2/s: one token per 0.5 s), and an approval's calls right after a
    poll waited for them."""

    def __init__(self, *, requests: int, per_seconds: float = 1.0) -> None:
        if requests < 1 or per_seconds <= 0:
            raise ValueError("RateLimiter needs requests >= 1 and per_seconds > 0")
        self._requests = requests
        self._window = per_seconds
        self._lock = threading.Lock()
        self._sent: deque[float] = deque()  # when each request of the current window went out (monotonic)

    @property
    def requests(self) -> int:
        return self._requests

    @property
    def per_seconds(self) -> float:
        return self._window

    def acquire(self) -> None:
        """Block until one request may go out."""
        while True:
            with self._lock:
                now = time.monotonic()
                while self._sent and now - self._sent[0] >= self._window:
                    self._sent.popleft()
                if len(self._sent) < self._requests:
                    self._sent.append(now)
                    return
                wait = self._sent[0] + self._window - now
            time.sleep(wait)


# IMDS throttles at about 5 requests/s per VM; 4 in any second keeps one under it. An approval that comes right after
# the poll that saw its event makes three calls (the attested document that proves the answer, the fresh GET, the
# StartRequests POST): with the poll that is four, all at once. The bucket of 3 refilled at 2/s it replaces held the
# GET and the POST back to the next half second (listener.imds_get and listener.start_requests ~430 and ~500 ms in
# benchmarks.pipeline_latency's traces), and the batch that sent the approval held its Event Hubs partition meanwhile.
IMDS_LIMITER = RateLimiter(requests=4, per_seconds=1.0)
