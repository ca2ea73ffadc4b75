"""VM positions, read and written for ``fold``: each VM's envelopes read against its stored position (its VM group)
into observations and a new position (``vm_updates``, the pure ``observations.vm_observations``), and the new
positions written back after the events, one ETag-checked write per group (``save_vm_updates``), with the rows they
describe in the outbox (``rows_near``). A VM another
instance moved meanwhile is returned as stale, for fold to redo from a fresh read; a VM whose position cannot be
stored even split and trimmed (``entities.vm_json``) is set aside, and the others' positions are written.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from contracts.envelope import Envelope
from coordinator.domain.model import EventRecord, VmGroupRecord, VmRecord, group_key
from coordinator.domain.observations import VmUpdate, merge_vm_records, vm_observations, vm_position
from coordinator.domain.rows import HistoryRow
from coordinator.pipeline.run import Run
from coordinator.state.commit import BULK_ATTEMPTS, commit
from coordinator.state.entities import vm_json
from coordinator.state.staged import Outbox
from coordinator.state.store import ConcurrencyConflict, RecordTooLarge, Staged, StateStore, Stored

__all__ = ["VmBatch", "last_heard", "save_vm_updates", "vm_updates"]

log = logging.getLogger("coordinator")


@dataclass
class VmBatch:
    groups: dict[str, Stored[VmGroupRecord]]
    key_of: dict[str, str]
    updates: dict[str, VmUpdate] = field(default_factory=dict)
    new_vms: set[str] = field(default_factory=set)
    # VMs whose envelopes could not be processed, and why (dead-lettered by the caller).
    failed: dict[str, str] = field(default_factory=dict)
    # VMs whose new position could not be written (too large even split and trimmed: entities.vm_json), and why:
    # dead-lettered after the others' positions were written.
    too_large: dict[str, str] = field(default_factory=dict)
    # Each VM's (epoch, lastSequence) in the position its observations were derived from (None: no position).
    base: dict[str, tuple[int, int] | None] = field(default_factory=dict)
    # The trace context each envelope arrived with, by (vmId, sequence) (ingest.Arrivals.traces).
    traces: dict[tuple[str, int], str] = field(default_factory=dict)
    # VMs whose position was read from another group than ``key_of``'s (``_kept_elsewhere``), by vmId -> that
    # group: removed from it once written to ``key_of``'s.
    moved: dict[str, str] = field(default_factory=dict)


def _etag(stored: Stored[Any] | None) -> str | None:
    return stored.etag if stored else None


def _set_aside(
    mine: dict[str, VmRecord], current: Stored[VmGroupRecord] | None, base: dict[str, tuple[int, int] | None]
) -> set[str]:
    """After a conflict on a VM group: takes out of ``mine`` the VMs not to write. Those already at this batch's
    position (written by an earlier part of this batch, or by an instance that processed the same envelopes), and
    those another instance moved since the position this batch started from: returned, to be redone."""
    stale = set()
    for vm_id, record in list(mine.items()):
        fresh = current.record.vms.get(vm_id) if current else None
        if fresh is None:
            continue
        if vm_position(fresh) == vm_position(record):
            del mine[vm_id]
        elif vm_position(fresh) != base.get(vm_id):
            stale.add(vm_id)
            del mine[vm_id]
    return stale


def last_heard(store: StateStore, record: EventRecord) -> dict[str, datetime]:
    """When the service last heard each VM that reported the event: its position's ``lastSeen`` (every envelope moves
    it, heartbeats included), as the timer judges every VM. A VM's sighting of an event moves only with what it
    lists: a person approving 10 minutes after the event was listed found its VM "not reported within 300 s" while
    it sent a heartbeat every minute. Read from the store's cache (the caller has just read these groups)."""
    heard: dict[str, datetime] = {}
    for stored in store.get_vm_groups(record.groups, cached=True).values():
        for vm in stored.record.vms.values():
            name = vm.identity.name
            # Only the VM that holds the sighting: another vmId once heard under its name says nothing of it.
            if name in record.vms and record.vms[name].vmId.lower() in ("", vm.identity.vmId.lower()):
                heard[name] = max(vm.lastSeen, heard.get(name, vm.lastSeen))
    return heard


def vm_updates(
    run: Run,
    by_vm: dict[str, list[Envelope]],
    *,
    cached: bool,
    traces: dict[tuple[str, int], str],
    heard: dict[str, list[datetime]],
) -> VmBatch:
    """Each VM's envelopes read against its stored position: its observations and its new position, its freshness
    from ``heard`` (when the service heard each envelope: fold.heard_times)."""
    store = run.parts.store
    key_of = {vm_id: run.fleet.group_of(envelopes[-1].vm) for vm_id, envelopes in by_vm.items()}
    groups = store.get_vm_groups(set(key_of.values()), cached=cached)
    batch = VmBatch(groups=groups, key_of=key_of, traces=traces)
    batch.moved = _kept_elsewhere(store, by_vm, batch, cached=cached)
    for vm_id, envelopes in by_vm.items():
        stored = groups.get(key_of[vm_id])
        if vm_id in batch.moved:
            stored = groups[batch.moved[vm_id]]
        previous = stored.record.vms.get(vm_id) if stored else None
        try:
            batch.updates[vm_id] = vm_observations(previous, envelopes, heard_at=heard[vm_id])
        except Exception as error:  # contained to this VM; the caller dead-letters its envelopes
            log.exception("VM %s: its envelopes could not be read against its position", vm_id)
            batch.failed[vm_id] = f"{type(error).__name__}: {str(error)[:500]}"
            del key_of[vm_id]
            continue
        batch.base[vm_id] = vm_position(previous) if previous else None
        if previous is None:
            batch.new_vms.add(vm_id)
    return batch


def _kept_elsewhere(
    store: StateStore, by_vm: dict[str, list[Envelope]], batch: VmBatch, *, cached: bool
) -> dict[str, str]:
    """The VMs whose position is not in the group ARM places them in but in the group their envelopes name (where a
    VM was kept before ARM's census listed it, or before the coordinator placed VMs by ARM), by vmId -> that group:
    read from there, written to ARM's group, removed from there (``save_vm_updates``). A read (the store's cache,
    most often) only for a VM whose two groups differ and whose position is not in ARM's: none once it moved."""
    elsewhere = {
        vm_id: named
        for vm_id, envelopes in by_vm.items()
        if (named := group_key(envelopes[-1].vm)) != (key := batch.key_of[vm_id])
        and (key not in batch.groups or vm_id not in batch.groups[key].record.vms)
    }
    if not elsewhere:
        return {}
    batch.groups.update(store.get_vm_groups(set(elsewhere.values()) - set(batch.groups), cached=cached))
    return {
        vm_id: key for vm_id, key in elsewhere.items() if key in batch.groups and vm_id in batch.groups[key].record.vms
    }


def unstorable(batch: VmBatch, names: set[str]) -> frozenset[str]:
    """The VMs among ``names`` whose new position cannot be stored even trimmed (``save_vm_updates`` will set them
    aside): their sightings are not written, so none of them executes an approval decided in this batch (the
    approvals leave before the positions are written). Nothing to look at for no names (most batches approve none)."""
    found: set[str] = set()
    for update in batch.updates.values() if names else ():
        name = update.record.identity.name
        if update.applied and name in names:
            try:
                vm_json(update.record)
            except RecordTooLarge:
                found.add(name)
    return frozenset(found)


def save_vm_updates(run: Run, batch: VmBatch) -> set[str]:
    """Writes the VMs' new positions; returns the VMs whose cached position turned out stale (not written). A
    position too large to store costs only its VM (``batch.too_large``), never the batch: the others' positions and
    sightings are written (the events were written before, with what that VM's envelopes said)."""
    mine: dict[str, dict[str, VmRecord]] = defaultdict(dict)
    for vm_id, update in batch.updates.items():
        if update.applied:
            mine[batch.key_of[vm_id]][vm_id] = update.record
    stale: set[str] = set()
    if not mine:
        return stale
    try:
        write_vm_groups(run, batch, mine, stale)
    except RecordTooLarge:
        _write_one_by_one(run, batch, mine, stale)
    if batch.moved:
        leave_old_groups(run, batch, stale)
    return stale


def _write_one_by_one(run: Run, batch: VmBatch, mine: dict[str, dict[str, VmRecord]], stale: set[str]) -> None:
    for vms in mine.values():
        for vm_id, record in list(vms.items()):
            try:
                vm_json(record)
            except RecordTooLarge as error:
                log.error("VM %s: its position cannot be stored and is set aside: %s", vm_id, error)
                batch.too_large[vm_id] = f"its position cannot be stored: {error}"
                del vms[vm_id]
    # One group at a time: a group the table refuses as a whole (an entity over 1 MiB) costs only the VMs this batch
    # moved in it.
    for key, vms in mine.items():
        try:
            write_vm_groups(run, batch, {key: vms}, stale)
        except RecordTooLarge as error:
            log.error("VM group %s: refused as too large; its VMs of this batch are set aside: %s", key, error)
            batch.too_large.update(dict.fromkeys(vms, f"its VM group {key} cannot be stored: {error}"))


def leave_old_groups(run: Run, batch: VmBatch, stale: set[str]) -> None:
    """Removes each moved VM (``batch.moved``) from the group it was found in, once its position is in the group
    ARM places it in (as the store now holds that group: a write left contended moves it at the VM's next
    envelope). Each old group If-Match its fresh ETag, within ``commit``'s attempts; a copy left there when every
    attempt met a newer write is a stray copy: never taken for the VM (the timer counts a VM's newest copy only)
    and removed by the housekeeping once silent (pipeline/housekeeping.py)."""
    store = run.parts.store
    now_in = store.get_vm_groups({batch.key_of[vm_id] for vm_id in batch.moved}, cached=True)
    leaving: dict[str, set[str]] = defaultdict(set)
    for vm_id, old in batch.moved.items():
        held = now_in.get(batch.key_of[vm_id])
        if vm_id not in stale and vm_id not in batch.too_large and held and vm_id in held.record.vms:
            leaving[old].add(vm_id)
    for old, vm_ids in leaving.items():

        def without(current: Stored[VmGroupRecord] | None, vm_ids: set[str] = vm_ids) -> VmGroupRecord | None:
            if current is None or not vm_ids & set(current.record.vms):
                return None
            kept = {vm_id: vm for vm_id, vm in current.record.vms.items() if vm_id not in vm_ids}
            return VmGroupRecord(group=current.record.group, vms=kept)

        def prune(record: VmGroupRecord, current: Stored[VmGroupRecord] | None) -> None:
            store.prune_vm_group(record, current.etag or "" if current is not None else "")

        try:
            commit(
                lambda _attempt, old=old: store.get_vm_groups([old]).get(old),  # type: ignore[misc]
                without,
                prune,
                what=f"VM group {old}",
                on_conflict=run.report.count_conflict,
            )
            run.report.vms_moved += len(vm_ids)
            log.info("VM group %s: %d VMs moved to the group ARM places them in", old, len(vm_ids))
        except ConcurrencyConflict:
            log.warning(
                "VM group %s: still holds copies of %d VMs moved to ARM's group (contended); the housekeeping "
                "removes them once silent",
                old,
                len(vm_ids),
            )


def rows_near(
    run: Run, outbox: Outbox, mine: dict[str, dict[str, VmRecord]], keys: list[str], *, loose: bool
) -> list[Staged]:
    """The run's rows not in the outbox yet, as entries near the groups of ``keys`` that are written: a VM's rows
    (its Heartbeat, Hook, Impact and Observation rows) with its group, so that a replay of its envelopes, which
    starts from its stored position, makes them again only if they were not stored; with ``loose``, the rows of no
    VM written here (dead letters) with the first group."""
    owner = {vm_id: key for key in keys for vm_id in mine[key]}
    near: dict[str, list[HistoryRow]] = defaultdict(list)
    for row in run.work.unstaged():
        key = owner.get(row.VmId.lower()) or (keys[0] if loose and keys else None)
        if key is not None:
            near[key].append(row)
    return [piece for key, rows in near.items() for piece in outbox.pieces(f"group:{key}", rows)]


def write_vm_groups(run: Run, batch: VmBatch, mine: dict[str, dict[str, VmRecord]], stale: set[str]) -> None:
    """The groups' moved VMs in one transaction (retried on conflicts), else group by group, merging per VM; adds
    to ``stale`` the VMs another instance moved meanwhile. Raises ``RecordTooLarge``."""
    store = run.parts.store

    def merged(key: str, current: Stored[VmGroupRecord] | None) -> VmGroupRecord:
        vms = dict(current.record.vms) if current else {}
        for vm_id, record in mine[key].items():
            vms[vm_id] = merge_vm_records(record, vms[vm_id]) if vm_id in vms else record
        return VmGroupRecord(group=key, vms=vms)

    def groups_now(attempt: int) -> dict[str, Stored[VmGroupRecord]]:
        if attempt == 0:
            return batch.groups
        groups = store.get_vm_groups(mine)
        for key, vms in mine.items():
            stale.update(_set_aside(vms, groups.get(key), batch.base))
        return groups

    def all_groups(
        groups: dict[str, Stored[VmGroupRecord]],
    ) -> list[tuple[VmGroupRecord, str | None, Iterable[str] | None]]:
        return [(merged(key, groups.get(key)), _etag(groups.get(key)), vms) for key, vms in mine.items() if vms]

    outbox = run.outbox()
    staging: list[Staged] = []

    def save_all(items: list[tuple[VmGroupRecord, str | None, Iterable[str] | None]]) -> None:
        staging[:] = rows_near(run, outbox, mine, [record.group for record, _, _ in items], loose=True)
        store.save_vm_groups(items, staged=staging)

    count = run.report.count_conflict
    try:
        commit(
            groups_now,
            all_groups,
            lambda items, _groups: save_all(items),
            what="VM groups",
            attempts=BULK_ATTEMPTS,
            on_conflict=count,
        )
        outbox.written.extend(staging)
        return
    except ConcurrencyConflict:
        pass
    # Another instance wrote one of these groups (its VMs sit on other Event Hubs partitions): merge per VM.
    for key, vms in mine.items():

        def group_now(_attempt: int, key: str = key, vms: dict[str, VmRecord] = vms) -> Stored[VmGroupRecord] | None:
            current = store.get_vm_groups([key]).get(key)
            stale.update(_set_aside(vms, current, batch.base))
            return current

        def moved(
            current: Stored[VmGroupRecord] | None, key: str = key, vms: dict[str, VmRecord] = vms
        ) -> tuple[VmGroupRecord, dict[str, VmRecord]] | None:
            return (merged(key, current), vms) if vms else None

        def save_one(
            write: tuple[VmGroupRecord, dict[str, VmRecord]], current: Stored[VmGroupRecord] | None, key: str = key
        ) -> None:
            staging[:] = rows_near(run, outbox, mine, [key], loose=False)
            store.save_vm_group(write[0], _etag(current), vm_ids=write[1], staged=staging)

        try:
            commit(group_now, moved, save_one, what=f"VM group {key}", on_conflict=count)
            outbox.written.extend(staging)
        except ConcurrencyConflict:
            log.warning("VM group %s: not written (contended); its VMs' next envelopes move it", key)
