"""A VM's stray copy (its position left in the group it was kept in before it moved to the group ARM places it in,
when every removal met a newer write: pipeline/positions.py) is never taken for the VM: the timer and the fleet
cache count a VM's newest copy only, so the copy's silence raises no lost-heartbeat card and its cards are not
sent, and the housekeeping removes it once it is silent (pipeline/housekeeping.py). On the in-memory store.

Measured before: the tick marked web_0 lost from its old copy beside a truly silent VM (two cards instead of one),
and the copy stayed in its old group for good.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest

from coordinator.domain.model import VmGroupRecord
from coordinator.pipeline import housekeeping, timer
from coordinator.pipeline.fleet_cache import FleetCache
from coordinator.pipeline.housekeeping import Housekeeping
from coordinator.pipeline.run import Run
from tests.coordinator.helpers import DOC_NOW, vm_position
from tests.coordinator.memory_store import MemoryStateStore
from tests.coordinator.runs import Bench

OLD, NEW = "pg:old", "vmss:sub/rg-fleet/web#3"
WEB_0, DB_1 = 11, 12  # the VMs' indexes (their vmIds)


def keep(store: MemoryStateStore, key: str, name: str, index: int, seen: datetime, **fields: Any) -> str:
    """Stores ``name``'s position, last seen at ``seen``, in the group ``key`` beside what it holds."""
    current = store.get_vm_groups([key]).get(key)
    vms = dict(current.record.vms) if current else {}
    record = vm_position(name, index=index, lastSeen=seen, **fields)
    vms[record.identity.vmId.lower()] = record
    store.save_vm_group(VmGroupRecord(group=key, vms=vms), current.etag if current else None)
    return record.identity.vmId.lower()


def tick(bench: Bench, at: datetime = DOC_NOW, hourly: Housekeeping | None = None) -> Run:
    bench.now = at
    run = bench.run("tick")
    timer.tick(run, hourly or Housekeeping())
    return run


@pytest.mark.parametrize("old_first", [True, False], ids=["old-copy-stored-first", "new-copy-stored-first"])
def test_a_moved_vms_old_copy_raises_no_card_and_goes_once_silent(bench: Bench, old_first: bool):
    copies = [(OLD, DOC_NOW - timedelta(hours=2)), (NEW, DOC_NOW)]
    for key, seen in copies if old_first else copies[::-1]:
        web_0 = keep(bench.store, key, "web_0", WEB_0, seen)
    db_1 = keep(bench.store, OLD, "db_1", DB_1, DOC_NOW - timedelta(hours=2))  # truly silent, beside the copy

    run = tick(bench)

    assert run.report.heartbeats_lost == 1
    assert [row.VmName for row in bench.rows("Heartbeat", Outcome="lost")] == ["db_1"]
    assert [key.split("-heartbeat-lost")[0] for key in bench.alerts.keys] == [db_1]
    assert run.report.copies_removed == 1
    groups = bench.store.get_vm_groups([OLD, NEW])
    assert list(groups[OLD].record.vms) == [db_1]
    assert list(groups[NEW].record.vms) == [web_0]
    assert not groups[NEW].record.vms[web_0].heartbeatLost


def test_a_copy_not_silent_yet_is_kept_and_its_vm_lost_only_from_its_newest_copy(bench: Bench):
    keep(bench.store, OLD, "web_0", WEB_0, DOC_NOW - timedelta(minutes=1))
    web_0 = keep(bench.store, NEW, "web_0", WEB_0, DOC_NOW)
    hourly = Housekeeping()

    first = tick(bench, DOC_NOW + timedelta(minutes=2), hourly)
    assert (first.report.copies_removed, first.report.heartbeats_lost) == (0, 0)

    later = tick(bench, DOC_NOW + timedelta(minutes=6), hourly)  # both silent now; the housekeeping not due
    assert (later.report.copies_removed, later.report.heartbeats_lost) == (0, 1)
    assert [row.VmName for row in bench.rows("Heartbeat", Outcome="lost")] == ["web_0"]
    groups = bench.store.get_vm_groups([OLD, NEW])
    assert groups[NEW].record.vms[web_0].heartbeatLost  # the VM: its newest copy
    assert not groups[OLD].record.vms[web_0].heartbeatLost  # the copy: not a VM of its own


def test_a_stray_copys_pending_card_is_not_sent_the_vms_own_is(bench: Bench):
    pending = {"pendingAlerts": ["imds-failing"], "pendingSince": DOC_NOW - timedelta(minutes=5)}
    keep(bench.store, OLD, "web_0", WEB_0, DOC_NOW - timedelta(minutes=2), **pending)
    keep(bench.store, OLD, "db_1", DB_1, DOC_NOW - timedelta(minutes=2), **pending)  # OLD is read for its card
    keep(bench.store, NEW, "web_0", WEB_0, DOC_NOW)

    tick(bench)

    assert [key.split("-imds-failing")[0] for key in bench.alerts.keys] == [
        vm_position("db_1", index=DB_1).identity.vmId
    ]


def test_a_copy_written_again_since_it_was_found_stray_is_kept(bench: Bench):
    keep(bench.store, OLD, "web_0", WEB_0, DOC_NOW - timedelta(hours=2))
    web_0 = keep(bench.store, NEW, "web_0", WEB_0, DOC_NOW - timedelta(hours=1))
    run = bench.run("tick")
    known, strays = run.fleet.cache.vms(force=True), run.fleet.cache.strays()
    assert [(copy.group, copy.vm_id) for copy in strays] == [(OLD, web_0)]
    keep(bench.store, OLD, "web_0", WEB_0, DOC_NOW - timedelta(minutes=30))  # a batch placed it there again

    housekeeping.purge_positions(run, known, strays)

    assert run.report.copies_removed == 0
    assert web_0 in bench.store.get_vm_groups([OLD])[OLD].record.vms


@pytest.mark.parametrize("old_first", [True, False])
def test_the_fleet_cache_knows_a_vm_by_its_newest_copy_whatever_the_order_read(old_first: bool):
    store = MemoryStateStore()
    copies = [(OLD, DOC_NOW - timedelta(hours=2)), (NEW, DOC_NOW)]
    for key, seen in copies if old_first else copies[::-1]:
        web_0 = keep(store, key, "web_0", WEB_0, seen)
    cache = FleetCache(store)

    assert [(vm.group, vm.last_seen) for vm in cache.vms(force=True)] == [(NEW, DOC_NOW)]
    assert [(copy.group, copy.vm_id) for copy in cache.strays()] == [(OLD, web_0)]
    assert list(cache.known_census()) == ["web_0"]

    # The copy removed (the group gone with it): forgotten once the housekeeping says so.
    cache.forget_copies(OLD, [web_0])
    assert cache.strays() == []
