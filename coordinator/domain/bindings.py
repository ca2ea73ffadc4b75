"""The VM bindings an instance knows (pipeline/bindings.py reads and writes them): which vmId a resource id or a name
is, and which resource id and name a vmId is, each a claim bound for good in the state table.

Two kinds of knowledge, both kept for the process:

- **A binding**: a name and the value bound to it. It never changes, so it is kept until the cache is full, then
  the least recently used goes first (clearing the whole cache at its limit made every VM of a fleet larger than
  half of it read again, and again).
- **A miss**: a name with nothing bound. The claims are spread over a few partitions, and an instance reads a
  partition whole (``load``): every name of it not read is then known to be free, with no read of its own. A miss
  may go stale (another instance binds the name later): a claim written on it is insert-only, so it cannot bind a
  name twice, and a check that binds nothing asks for a partition read at most ``fresh`` seconds ago. A partition
  one of whose bindings was evicted is no longer known whole: its misses are read again.

A third, ``BindingBacklog``: the claims of VMs ARM's census vouched for, not written yet. While the census is
usable it decides who a VM is and the claims decide nothing; they are kept for an instance whose census cannot be
read, so they are written by the timer, off the batches' path (pipeline/bindings.py, ``write_backlog``).

Pure and thread-safe; the clock (seconds, any origin) is the caller's.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from itertools import islice

from coordinator.domain.lru import Lru

# Four bindings a VM (its resource id's and its name's vmId, its vmId's resource id and name), for 100,000 VMs.
BINDINGS_CACHED = 4 * 100_000
# Claims waiting to be written, at most: a 100,000-VM fleet's. Beyond, the oldest go; a VM's next envelope (its
# heartbeat, each minute) asks for what is still not bound again.
BACKLOG_KEPT = 4 * 100_000


class BindingCache:
    """Bindings by name, least recently used evicted first, and the partitions known whole since when."""

    def __init__(self, size: int = BINDINGS_CACHED) -> None:
        self.size = size
        self._bound: Lru[str, tuple[str, str]] = Lru(size)  # name -> (value, its partition)
        self._whole: dict[str, float] = {}  # partition -> when it was read whole
        # Over both: a partition is whole only while none of its bindings was evicted.
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._bound)

    def get(self, name: str) -> str | None:
        hit = self._bound.get(name)
        return None if hit is None else hit[0]

    def put(self, name: str, value: str, partition: str) -> str:
        with self._lock:
            self._put(name, value, partition)
        return value

    def load(self, partition: str, bound: dict[str, str], at: float) -> None:
        """A whole partition read at ``at``: its bindings, and every other name of it known free."""
        with self._lock:
            for name, value in bound.items():
                self._put(name, value, partition)
            if len(bound) < self.size:
                self._whole[partition] = at

    def whole_since(self, partition: str) -> float | None:
        """When the partition was read whole (None: never, or one of its bindings was evicted since)."""
        with self._lock:
            return self._whole.get(partition)

    def free(self, name: str, partition: str, *, at: float, fresh: float | None) -> bool:
        """Whether ``name`` is known to be free: not bound, in a partition read whole (at most ``fresh`` seconds
        before ``at`` when given)."""
        with self._lock:
            if name in self._bound:
                return False
            since = self._whole.get(partition)
        return since is not None and (fresh is None or at - since <= fresh)

    def _put(self, name: str, value: str, partition: str) -> None:
        for _, (_, evicted) in self._bound.put(name, (value, partition)):
            self._whole.pop(evicted, None)


class BindingBacklog:
    """Claims to write (name -> the value to bind), oldest first; a name asked for again keeps its place."""

    def __init__(self, size: int = BACKLOG_KEPT) -> None:
        self.size = size
        self._claims: dict[str, str] = {}
        self.dropped = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._claims)

    def get(self, name: str) -> str | None:
        return self._claims.get(name)

    def add(self, claims: Mapping[str, str]) -> None:
        with self._lock:
            for name, value in claims.items():
                self._claims.setdefault(name, value)
            while len(self._claims) > self.size:
                del self._claims[next(iter(self._claims))]
                self.dropped += 1

    def take(self, count: int) -> list[tuple[str, str]]:
        """Up to ``count`` of the oldest claims, no longer kept here."""
        with self._lock:
            names = list(islice(self._claims, count))
            return [(name, self._claims.pop(name)) for name in names]
