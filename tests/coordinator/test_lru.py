"""``Lru`` (coordinator/domain/lru.py): bounded, least recently used evicted first, reads count as use."""

from __future__ import annotations

import threading

import pytest

from coordinator.domain.lru import Lru


def test_the_least_recently_used_goes_first_and_a_read_counts_as_use() -> None:
    cache: Lru[str, int] = Lru(2)
    assert cache.put("a", 1) == []
    assert cache.put("b", 2) == []
    assert cache.get("a") == 1  # "b" is now the least recently used
    assert cache.put("c", 3) == [("b", 2)]
    assert "b" not in cache
    assert (cache.get("a"), cache.get("c"), len(cache)) == (1, 3, 2)
    assert cache.put("a", 10) == []  # a new value for a key kept evicts nothing
    assert cache.get("a") == 10
    assert cache.pop("a") == 10
    assert cache.pop("a") is None
    assert cache.get("missing") is None


def test_it_holds_at_least_one_value() -> None:
    with pytest.raises(ValueError, match="at least one"):
        Lru[str, int](0)


def test_threads_writing_at_once_never_leave_it_over_its_size() -> None:
    cache: Lru[int, int] = Lru(100)
    evicted: list[int] = []

    def write(start: int) -> None:
        for key in range(start, start + 5000):
            evicted.extend(k for k, _ in cache.put(key, key))
            cache.get(key - 50)

    threads = [threading.Thread(target=write, args=(n * 10_000,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(cache) == 100
    assert len(evicted) == 4 * 5000 - 100
    assert len(set(evicted)) == len(evicted)  # each key evicted once


def test_a_check_and_put_keeps_the_value_only_over_what_it_expects_and_else_forgets_the_key() -> None:
    cache: Lru[str, int] = Lru(2)
    assert cache.put_if("a", 1, lambda held: held is None)
    assert not cache.put_if("a", 2, lambda held: held == 5)  # not what it expected: neither value is kept
    assert "a" not in cache
    cache.put("a", 1)
    assert cache.put_if("a", 2, lambda held: held == 1)
    assert cache.get("a") == 2
    cache.put("b", 3)
    assert cache.put_if("c", 4, lambda held: held is None)  # over its size: the least recently used goes
    assert ("a" in cache, cache.get("b"), cache.get("c")) == (False, 3, 4)
