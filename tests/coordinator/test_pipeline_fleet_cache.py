"""The instance's fleet cache (coordinator/pipeline/fleet_cache.py): a copy of an event goes in only if it is newer
than the one held (``EventRecord.revision``, one more at every write), and a concluded event never comes back from an
older copy. A batch's tail absorbs what it committed at its very end, seconds later: an event concluded meanwhile
came back as Approved, and a budget rule held the next event of its domain until the cache was refreshed."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import timedelta

import pytest

from coordinator.domain.model import VmGroupRecord
from coordinator.domain.policy_file import parse_policy
from coordinator.domain.rows import HistoryRow
from coordinator.pipeline.fleet_cache import FleetCache
from coordinator.pipeline.ingest import RawMessage
from coordinator.state.store import Stored
from local.runner import wait_until
from tests.coordinator.helpers import DOC_NOW, MemoryHistory, envelope, event_record, scheduled_event, vm, vm_position
from tests.coordinator.memory_store import MemoryStateStore
from tests.coordinator.runs import RecordingAlerts, RecordingCallback, make_coordinator, message

POLICY = parse_policy(
    """
version: 1
rules:
  - name: westno-one-at-a-time
    match: {eventType: [Reboot]}
    action: approve-within-budget
    budget: {maxImpacted: 1}
"""
)


def loaded(store: MemoryStateStore) -> FleetCache:
    cache = FleetCache(store)
    cache.open_events()  # loaded: what is absorbed from now on goes in
    return cache


def test_an_older_copy_of_an_event_does_not_replace_a_newer_one():
    store = MemoryStateStore()
    cache = loaded(store)
    approved = event_record("EV-1", state="Approved", revision=2)
    newer = event_record("EV-1", state="Approved", revision=3, description="newer")
    cache.absorb([newer])
    cache.absorb([approved])
    assert cache.open_events()["EV-1"].description == "newer"


def test_a_concluded_event_never_comes_back_from_a_copy_older_than_its_conclusion():
    store = MemoryStateStore()
    cache = loaded(store)
    cache.absorb([event_record("EV-1", state="Approved", revision=2)])
    cache.absorb([event_record("EV-1", state="Completed", revision=3)])
    cache.absorb([event_record("EV-1", state="Approved", revision=2)])  # a tail's copy, put late
    assert "EV-1" not in cache.open_events()
    assert not cache.budget_events()[0]
    cache.absorb([event_record("EV-1", state="Approved", revision=3)])  # as old as the conclusion: not newer
    assert "EV-1" not in cache.open_events()
    # A later write opens it again (a VM it names lists it after a 'gone' that was not true): that one comes in.
    cache.absorb([event_record("EV-1", state="Scheduled", revision=4)])
    assert cache.open_events()["EV-1"].revision == 4


def test_every_write_of_an_event_is_one_revision_more():
    store = MemoryStateStore()
    record = event_record("EV-1")
    etag = store.save_event(record, None)
    assert record.revision == 1
    stored = store.get_event("EV-1")
    assert stored is not None
    assert stored.record.revision == 1
    store.save_events([(stored.record, etag)])
    again = store.get_event("EV-1")
    assert again is not None
    assert again.record.revision == 2


class HeldHistory(MemoryHistory):
    """History whose first write waits until ``release`` is set: a batch's tail slow in its last steps."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.first = True

    def write(self, rows: Sequence[HistoryRow]) -> None:
        if self.first:
            self.first = False
            self.release.wait(timeout=10)
        super().write(rows)


@pytest.fixture
def after_batch() -> Iterator[ThreadPoolExecutor]:
    executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="cache-test")
    yield executor
    executor.shutdown(wait=True, cancel_futures=True)


def reboot_of(name: str, index: int, sequence: int, event_id: str | None) -> RawMessage:
    identity = vm(name, scale_set="westno", group="pg-westno", index=index)
    events = [scheduled_event(event_id, event_type="Reboot", resources=[name])] if event_id else []
    return message(envelope(identity, sequence=sequence, incarnation=sequence, events=events))


def test_a_slow_tail_does_not_bring_back_an_event_that_completed_meanwhile(after_batch: ThreadPoolExecutor):
    """EV-A is approved in batch 1, whose tail then waits on its history; batch 2 sees EV-A gone (Completed, its
    budget slot freed); batch 1's tail ends and absorbs its Approved copy. Batch 3's Reboot of the same scale set
    must find the budget free, not held by EV-A."""
    history = HeldHistory()
    coordinator = make_coordinator(
        store=MemoryStateStore(),
        history=history,
        alerts=RecordingAlerts(),
        callback=RecordingCallback(),
        policy=POLICY,
        clock=lambda: DOC_NOW,
        after_batch=after_batch,
    )
    coordinator.run_batch([reboot_of("WestNO_0", 1, 1, "EV-A")])

    def state(event_id: str) -> str:
        stored = coordinator.event(event_id)
        return stored.record.state if stored is not None else "none"

    assert wait_until(lambda: state("EV-A") == "Approved", timeout=5.0, interval=0.02)
    coordinator.parts = replace(coordinator.parts, clock=lambda: DOC_NOW + timedelta(seconds=30))
    coordinator.run_batch([reboot_of("WestNO_0", 1, 2, None)])
    assert state("EV-A") == "Completed"
    history.release.set()
    assert coordinator.drain(timeout=5.0)

    coordinator.parts = replace(coordinator.parts, clock=lambda: DOC_NOW + timedelta(seconds=31))
    coordinator.run_batch([reboot_of("WestNO_1", 2, 1, "EV-B")])
    assert coordinator.drain(timeout=5.0)
    record = coordinator.event("EV-B")
    assert record is not None
    decision = record.record.decision
    assert decision is not None
    assert decision.verdict == "approve", decision.reason
    assert record.record.approval is not None


def test_the_events_neither_open_nor_sighted_by_the_batch_s_vms_are_probably_new():
    store = MemoryStateStore()
    cache = loaded(store)
    cache.absorb([event_record("EV-OPEN")])
    sighting = {"firstSeen": DOC_NOW, "lastSeen": DOC_NOW, "lastSequence": 1, "status": "Scheduled"}
    seen = vm_position("web_1", index=1, sightings={"EV-SEEN": sighting, "EV-OTHER": sighting})
    group = VmGroupRecord(group="g", vms={"a": vm_position("web_0", index=0), "b": seen})

    assert cache.probably_new(["EV-OPEN", "EV-SEEN", "EV-NEW"], [Stored(group, "etag")]) == {"EV-NEW"}
    assert cache.probably_new(["EV-SEEN"], [Stored(group, "etag")]) == set()
    assert FleetCache(store).probably_new(["EV-NEW"], [Stored(group, "etag")]) == set()  # not loaded: none known new
