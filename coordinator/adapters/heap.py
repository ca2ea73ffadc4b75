"""The instance's heap: what survived a full pass of the garbage collector is not traversed by the next ones.

CPython's cyclic collector traverses every container object alive at each full (generation 2) pass, and an instance
of a large fleet holds millions for its whole life (ARM's census and its index, the fleet cache, the bindings). After
each full pass, what survived it moves to the permanent generation (``gc.freeze``, from the collector's own callback:
the merge is O(1)), so each full pass traverses only what was made since the one before. Objects freed by their
reference count are freed as before; only cycles among the frozen ones wait, until the timer's tick settles the heap
every ``SETTLE_EVERY`` (``gc.unfreeze``, one whole collection, ``gc.freeze`` again), so the frozen generation never
outgrows the live heap for long.

Installed once per process by the composition root (``wiring.build_coordinator``). Measured with the 10k- and
100k-VM waves (``python -m benchmarks.wave``; docs/limits.md, *Figures missed*).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["HEAP", "SETTLE_EVERY", "HeapSettler"]

log = logging.getLogger("coordinator")

# Seconds between the tick's whole collections: cycles among frozen objects (a census replaced every 5 minutes, a
# run's leftovers) are reclaimed within this; one whole collection of a large heap takes a few hundred milliseconds.
SETTLE_EVERY = 600.0


class HeapSettler:
    """The process's collector policy (``gc`` is one per process: the coordinator uses ``HEAP``)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._installed = False
        self._last: float | None = None
        self.full_passes = 0
        self.settles = 0

    def install(self) -> None:
        """From now on, what survives a full pass is frozen, starting with what is alive now (idempotent): the
        collector runs its next full pass only once a quarter of what it holds is new, and until then each pass of
        a large heap left unfrozen would traverse all of it."""
        with self._lock:
            if self._installed:
                return
            self._installed = True
            self._last = self._clock()
        gc.callbacks.append(self._after_pass)
        gc.collect()

    def uninstall(self) -> None:
        with self._lock:
            if not self._installed:
                return
            self._installed = False
        gc.callbacks.remove(self._after_pass)
        gc.unfreeze()

    def _after_pass(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "stop" and info.get("generation") == 2:
            self.full_passes += 1
            gc.freeze()

    def tick(self) -> bool:
        """The timer's part: a whole collection, frozen objects included, every ``SETTLE_EVERY``."""
        now = self._clock()
        with self._lock:
            if not self._installed or (self._last is not None and now - self._last < SETTLE_EVERY):
                return False
            self._last = now
        started = time.perf_counter()
        gc.unfreeze()
        collected = gc.collect()  # its own callback freezes what survived
        self.settles += 1
        log.info(
            "heap settled: %d objects kept out of the collector's passes, %d collected, %.0f ms",
            gc.get_freeze_count(),
            collected,
            (time.perf_counter() - started) * 1000,
        )
        return True


HEAP = HeapSettler()
