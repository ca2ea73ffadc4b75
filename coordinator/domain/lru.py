"""``Lru``: at most ``size`` values by key, the least recently used evicted first; thread-safe.

The coordinator's caches (verified attested documents, proven certificate chains, the certificate sets PKCS7s
carry, bindings, the state store's records) are shared by the Functions worker's invocations on its thread pool.
``functools.lru_cache`` keys on the call's arguments and holds them; these caches key on a digest or a name and
are filled by whoever computed the value, so they share this one type instead.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["Lru"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Lru(Generic[K, V]):
    """A bounded mapping whose reads count as use (``get``), whose writes return what they evicted (``put``)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"an LRU cache holds at least one value, not {size}")
        self.size = size
        self._values: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key: K) -> bool:
        with self._lock:
            return key in self._values

    def get(self, key: K) -> V | None:
        """The value (now the most recently used), or None."""
        with self._lock:
            value = self._values.get(key)
            if value is not None:
                self._values.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> list[tuple[K, V]]:
        """Keeps ``value`` as the most recently used; the entries this evicted, oldest first."""
        with self._lock:
            self._values[key] = value
            self._values.move_to_end(key)
            evicted = []
            while len(self._values) > self.size:
                evicted.append(self._values.popitem(last=False))
            return evicted

    def put_if(self, key: K, value: V, keep: Callable[[V | None], bool]) -> bool:
        """Keeps ``value`` if ``keep`` says so of the value held now (checked and put under one lock: no other
        thread's put comes between), else forgets ``key``; whether it was kept."""
        with self._lock:
            if not keep(self._values.get(key)):
                self._values.pop(key, None)
                return False
            self._values[key] = value
            self._values.move_to_end(key)
            while len(self._values) > self.size:
                self._values.popitem(last=False)
            return True

    def pop(self, key: K) -> V | None:
        """Forgets ``key``; its value, or None."""
        with self._lock:
            return self._values.pop(key, None)
