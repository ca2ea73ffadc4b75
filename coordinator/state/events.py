"""Event records as the stages see them: read with their VMs' sightings, and committed one at a time with ETags.

An event's entity holds the record without its per-VM sightings, which live with the VMs' positions (VM groups);
``assemble`` puts them back. ``commit_event`` is ``commit.commit`` for one event: every single-event
read-modify-write (a held delete re-decided, an approval's outcome, a tick's re-evaluation, a person's approval, an
outbox entry cleared) goes through it, the change's history rows stored with it (``outbox``).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from coordinator.domain.lifecycle import EventChange
from coordinator.domain.model import EventRecord, VmGroupRecord, VmSighting
from coordinator.state.commit import commit
from coordinator.state.staged import Outbox
from coordinator.state.store import StateStore, Stored


def assemble(
    events: dict[str, Stored[EventRecord]], groups: dict[str, Stored[VmGroupRecord]]
) -> dict[str, Stored[EventRecord]]:
    """Puts each event's per-VM sightings (kept with the VMs' positions) back into the record."""
    out: dict[str, Stored[EventRecord]] = {}
    for event_id, stored in events.items():
        vms: dict[str, VmSighting] = {}
        ranks: dict[str, tuple[bool, datetime, tuple[int, int]]] = {}
        for key in stored.record.groups:
            group = groups.get(key)
            for vm in group.record.vms.values() if group else ():
                sighting = vm.sightings.get(event_id)
                if sighting is None:
                    continue
                # Two records of one VM name: an agentless one from Event Grid, made before the VM's forwarder first
                # reported (a forwarder's is above every Event Grid one), or two vmIds, of which the door now admits
                # one under the name (a VM created again; a name ARM's census gave its real VM after another had
                # claimed it): the VM heard last holds it. Positions of two VMs never compare: a sequence of 2^62
                # under one would silence the other.
                rank = (sighting.epoch >= 0, vm.lastSeen, _position(sighting))
                if vm.identity.name not in ranks or rank > ranks[vm.identity.name]:
                    ranks[vm.identity.name] = rank
                    vms[vm.identity.name] = sighting.model_copy(
                        update={
                            "name": vm.identity.name,
                            "vmId": vm.identity.vmId,
                            "resourceId": vm.identity.resourceId,
                            "scaleSet": vm.identity.vmScaleSetName,
                            "placementGroup": vm.identity.placementGroupId,
                        }
                    )
        out[event_id] = Stored(stored.record.model_copy(update={"vms": vms}), stored.etag)
    return out


def _position(sighting: VmSighting) -> tuple[int, int]:
    return (sighting.epoch, sighting.lastSequence)


def read_event(store: StateStore, event_id: str) -> Stored[EventRecord] | None:
    """The event as stored now (fresh read), with its VMs' sightings."""
    stored = store.get_events([event_id])
    if event_id not in stored:
        return None
    groups = store.get_vm_groups(stored[event_id].record.groups)
    return assemble(stored, groups)[event_id]


def aggregate(record: EventRecord) -> str:
    """The part of a record that lives in the event entity (sightings live with the VMs)."""
    return record.model_dump_json(exclude={"vms"})


def commit_event(
    store: StateStore,
    event_id: str,
    mutate: Callable[[EventRecord | None], EventChange | None],
    *,
    read: Stored[EventRecord] | None = None,
    on_conflict: Callable[[], None] | None = None,
    etags: dict[str, str] | None = None,
    outbox: Outbox | None = None,
) -> EventChange | None:
    """Read-modify-write of one event with its ETag; ``read`` is a record just read fresh or written (the first
    attempt uses it instead of reading again); ``on_conflict`` is called for each write that met a newer one;
    ``etags`` receives the new ETag of what was written; ``outbox``: the change's history rows are stored with it, in
    one transaction, and noted there. Raises ``ConcurrencyConflict`` when every attempt met a newer write."""

    def current(attempt: int) -> Stored[EventRecord] | None:
        return read if attempt == 0 and read is not None else read_event(store, event_id)

    def changed(stored: Stored[EventRecord] | None) -> EventChange | None:
        change = mutate(stored.record if stored else None)
        return change if change is not None and change.changed else None

    def write(change: EventChange, stored: Stored[EventRecord] | None) -> None:
        staged = outbox.pieces(f"event:{event_id}", change.rows) if outbox is not None else []
        etag = store.save_event(change.record, stored.etag if stored else None, staged=staged)
        if outbox is not None:
            outbox.written.extend(staged)
        if etags is not None:
            etags[event_id] = etag

    return commit(current, changed, write, what=f"event {event_id}", on_conflict=on_conflict)
