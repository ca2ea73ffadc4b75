"""The process's collector policy (coordinator/adapters/heap.py): what survives a full pass is frozen, so the next
full passes do not traverse it; the tick's whole collection every SETTLE_EVERY reclaims cycles among frozen objects."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from coordinator.adapters.heap import HEAP, SETTLE_EVERY, HeapSettler


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Node:
    other: object = None


@pytest.fixture
def heap() -> Iterator[tuple[HeapSettler, Clock]]:
    # Another test of this process may have installed the coordinator's own (wiring.build_coordinator).
    was_installed = HEAP._after_pass in gc.callbacks
    HEAP.uninstall()
    clock = Clock()
    settler = HeapSettler(clock=clock)
    settler.install()
    yield settler, clock
    settler.uninstall()
    if was_installed:
        HEAP.install()


def test_what_survives_a_full_pass_is_frozen_and_a_younger_cycle_is_still_collected(
    heap: tuple[HeapSettler, Clock],
) -> None:
    settler, _ = heap
    settler.install()  # twice: once installed
    assert gc.callbacks.count(settler._after_pass) == 1
    assert settler.full_passes == 1  # what was alive when it was installed
    survivor = Node()
    survivor.other = survivor
    kept = weakref.ref(survivor)
    gc.collect()
    assert settler.full_passes == 2
    assert gc.get_freeze_count() > 0
    del survivor
    gc.collect()
    assert kept() is not None  # frozen: the passes after it skip it, until the tick settles the heap
    young = Node()
    young.other = young
    gone = weakref.ref(young)
    del young
    gc.collect()
    assert gone() is None  # made since the last full pass: collected as before


def test_the_tick_reclaims_frozen_cycles_every_settle_every(heap: tuple[HeapSettler, Clock]) -> None:
    settler, clock = heap
    node = Node()
    node.other = node
    kept = weakref.ref(node)
    gc.collect()
    del node
    assert settler.tick() is False  # installed just now
    assert kept() is not None
    clock.now += SETTLE_EVERY
    assert settler.tick() is True
    assert kept() is None
    assert settler.settles == 1
    assert gc.get_freeze_count() > 0  # what survived the whole collection is frozen again


def test_uninstalled_nothing_is_frozen(heap: tuple[HeapSettler, Clock]) -> None:
    settler, clock = heap
    settler.uninstall()
    gc.collect()
    assert gc.get_freeze_count() == 0
    clock.now += SETTLE_EVERY
    assert settler.tick() is False
