"""The timer's housekeeping: each tick the bindings' backlog; hourly (or while a backlog is left) what no longer
counts is removed: the positions of VMs retired long ago, the stray copies of VMs kept in another group, the budget
entities no claim holds, concluded events past the retention, and the hybrid connections no VM needs.

Every removal is bounded per run (a backlog goes on at the next tick) and If-Match what was read, so that a write
made meanwhile by a batch or another instance is never undone.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from coordinator.domain.model import VmGroupRecord
from coordinator.pipeline.bindings import BACKLOG_SECONDS, StoreOutage, write_backlog
from coordinator.pipeline.fleet_cache import KnownVm
from coordinator.pipeline.run import Run
from coordinator.state.store import ConcurrencyConflict

__all__ = [
    "PURGE_BUDGETS_PER_RUN",
    "PURGE_GROUPS_PER_RUN",
    "RETIRED_RETENTION",
    "Housekeeping",
    "purge_budgets",
    "purge_positions",
    "run_housekeeping",
    "write_bindings",
]

log = logging.getLogger("coordinator")

# A retired VM's position (its group's property) is removed this long after it was retired: its sightings served the
# "gone" checks of the events it reported, which are kept a week after a VM stops listing an event, and by then its
# events have concluded (a removed VM's events conclude at the next tick) and its hybrid connection is deleted.
RETIRED_RETENTION = timedelta(days=7)
# Housekeeping removes at most this many groups' positions (each a read and a write) and this many budget
# entities per run, so that a backlog (a scale set deleted at once) never makes one tick long; what is left is
# taken up by the next tick.
PURGE_GROUPS_PER_RUN = 200
PURGE_BUDGETS_PER_RUN = 200


@dataclass
class Housekeeping:
    """Hourly, not every tick: the retention purge, and ``cleanup`` (given every VM's hybrid connection and when it
    last reported: the VMs' hybrid connections no VM needs are deleted). Kept by the coordinator across ticks.
    ``backlog``: the last purge left work for the next tick."""

    cleanup: Callable[[dict[str, datetime], datetime], None] | None = None
    due: datetime | None = None
    backlog: bool = False


def purge_positions(run: Run, known: list[KnownVm], strays: list[KnownVm]) -> bool:
    """Removes from their groups (a group left with none is deleted), each group If-Match its fresh ETag, at most
    ``PURGE_GROUPS_PER_RUN`` groups: the positions of VMs retired longer than ``RETIRED_RETENTION``, and the stray
    copies (``FleetCache.strays``: a VM kept in another group than its newest copy's, left where it was when it
    moved to the group ARM places it in) silent for the heartbeat timeout and still older than the VM's newest
    copy as read now. Returns whether more is left."""
    cutoff, silent = run.now - RETIRED_RETENTION, run.now - run.options.heartbeat_timeout
    newest = {vm.vm_id: vm.last_seen for vm in known}
    strays_in: dict[str, set[str]] = defaultdict(set)
    for copy in strays:
        strays_in[copy.group].add(copy.vm_id)
    retiring = {vm.group for vm in known if vm.retired_at is not None and vm.retired_at < cutoff}
    due = sorted(retiring | strays_in.keys())
    store, cache = run.parts.store, run.fleet.cache
    fresh = store.get_vm_groups(due[:PURGE_GROUPS_PER_RUN])
    for key in due[:PURGE_GROUPS_PER_RUN]:
        stored = fresh.get(key)
        if stored is None:  # gone already (another instance's housekeeping)
            cache.forget_vms(vm.vm_id for vm in known if vm.group == key and vm.retired_at is not None)
            cache.forget_copies(key, strays_in[key])
            continue
        vms = stored.record.vms
        retired = {i for i, held in vms.items() if held.retired is not None and held.retired.at < cutoff}
        # Re-checked on what is stored now: a copy written since it was found stray (a batch placed the VM here
        # again) is not one any more.
        stray = {
            i for i in strays_in[key] if (held := vms.get(i)) and held.lastSeen < min(silent, newest.get(i, silent))
        }
        gone = retired | stray
        if not gone:
            cache.forget_copies(key, strays_in[key] - vms.keys())
            continue
        kept = {i: vm for i, vm in vms.items() if i not in gone}
        try:
            store.prune_vm_group(VmGroupRecord(group=key, vms=kept), stored.etag or "")
        except ConcurrencyConflict:
            continue  # a VM of the group reported meanwhile: the next run
        cache.forget_vms(retired)
        cache.forget_copies(key, stray | (strays_in[key] - vms.keys()))
        run.report.vms_purged += len(retired)
        run.report.copies_removed += len(stray)
    return len(due) > PURGE_GROUPS_PER_RUN


def purge_budgets(run: Run) -> bool:
    """Deletes the budget entities whose claims were all released (or lapsed: ``Fleet.spent``), each If-Match its
    ETag, at most ``PURGE_BUDGETS_PER_RUN``. Returns whether more is left."""
    spent = [s for s in run.parts.store.budgets() if run.fleet.budgets.spent(s.record, run.now)]
    for stored in spent[:PURGE_BUDGETS_PER_RUN]:
        if run.parts.store.delete_budget(stored.record.scaleSet, stored.etag or ""):
            run.report.budgets_purged += 1
    return len(spent) > PURGE_BUDGETS_PER_RUN


def write_bindings(run: Run) -> None:
    """The claims of VMs ARM's census vouched for, written from the instance's backlog for ``BACKLOG_SECONDS`` at
    most (pipeline/bindings.py). A store that fails stops it until the next tick; the VMs ask again."""
    attestations = run.parts.attestations
    if attestations is None or not len(attestations.backlog):
        return
    try:
        run.report.bindings_written = write_backlog(
            attestations.bindings, attestations.backlog, run.parts.store, within=BACKLOG_SECONDS
        )
    except StoreOutage as outage:
        log.warning("bindings: the backlog's claims were not written (%s); the next tick goes on", outage)


def run_housekeeping(run: Run, known: list[KnownVm], housekeeping: Housekeeping) -> None:
    """Each tick, the backlog of bindings (``write_bindings``). Hourly: deletes concluded events older than the
    retention, the positions of VMs retired longer than ``RETIRED_RETENTION``, the stray copies of moved VMs and the
    budget entities no claim holds (bounded: a backlog goes on at the next tick), and lists ARM resources (the VMs'
    hybrid connections) to delete the stale ones."""
    write_bindings(run)
    now, store = run.now, run.parts.store
    hourly = housekeeping.due is None or now >= housekeeping.due
    if hourly or housekeeping.backlog:
        try:
            strays = run.fleet.cache.strays()
            housekeeping.backlog = purge_positions(run, known, strays) | purge_budgets(run)
        except Exception:  # never let cleanup stop the timer's real work; it runs again next time
            log.exception("purging retired VMs, stray copies and released budgets failed")
    if not hourly:
        return
    housekeeping.due = now + run.options.housekeeping_interval
    try:
        old = store.concluded_events_before(now - run.options.retention)
        run.report.events_purged = store.delete_events([(s.record.eventId, s.etag) for s in old])
    except Exception:  # never let cleanup stop the timer's real work; it runs again next hour
        log.exception("purging concluded events failed")
    if housekeeping.cleanup is None:
        return
    last_seen: dict[str, datetime] = {}
    for vm in known:
        if vm.retired_by:
            continue  # left out: a connection the fleet does not know is deleted (hybrid_connections_to_delete)
        name = vm.hybrid_connection
        last_seen[name] = max(vm.last_seen, last_seen.get(name, vm.last_seen))
    try:
        housekeeping.cleanup(last_seen, now)
    except Exception:  # never let cleanup stop the timer's real work; it runs again next hour
        log.exception("housekeeping failed")
