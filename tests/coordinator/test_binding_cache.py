"""The bindings an instance keeps (coordinator/domain/bindings.py): least recently used evicted, misses known from
partitions read whole."""

from __future__ import annotations

from coordinator.domain.bindings import BindingCache


def test_eviction_drops_the_least_recently_used_and_keeps_the_hot() -> None:
    cache = BindingCache(size=3)
    for name in ("a", "b", "c"):
        cache.put(name, f"v-{name}", "claim-0")
    assert cache.get("a") == "v-a"  # used: now the most recent
    cache.put("d", "v-d", "claim-0")
    assert [cache.get(n) for n in ("a", "b", "c", "d")] == ["v-a", None, "v-c", "v-d"]
    assert len(cache) == 3


def test_a_partition_read_whole_makes_its_other_names_known_free() -> None:
    cache = BindingCache()
    assert not cache.free("vm-name:web_0", "claim-1", at=0.0, fresh=None)  # never read: unknown, not free
    cache.load("claim-1", {"vm-name:web_1": "id-1"}, at=10.0)
    assert cache.free("vm-name:web_0", "claim-1", at=500.0, fresh=None)
    assert not cache.free("vm-name:web_1", "claim-1", at=500.0, fresh=None)  # bound
    assert not cache.free("vm-name:web_2", "claim-2", at=500.0, fresh=None)  # another partition
    # A check that binds nothing takes a miss only from a recent read.
    assert cache.free("vm-name:web_0", "claim-1", at=60.0, fresh=60.0)
    assert not cache.free("vm-name:web_0", "claim-1", at=71.0, fresh=60.0)


def test_a_partition_one_of_whose_bindings_was_evicted_is_no_longer_known_whole() -> None:
    cache = BindingCache(size=2)
    cache.load("claim-1", {"x": "1"}, at=0.0)
    cache.put("y", "2", "claim-2")
    cache.put("z", "3", "claim-2")  # evicts x, of claim-1
    assert cache.whole_since("claim-1") is None
    assert not cache.free("w", "claim-1", at=1.0, fresh=None)
