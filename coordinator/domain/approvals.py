"""An approval's way after the decision: through which VM it is sent, and when the platform is late to start it.

Pure: takes an event record and when its VMs last reported; gives the executing VM (``choose_executor``) and
whether a delivered approval's Started is overdue (``start_overdue``: the listener's word is not the platform's).
"""

from __future__ import annotations

from datetime import datetime

from coordinator.domain.deletes import REMOVING_EVENTS
from coordinator.domain.model import EventRecord, VmSighting

__all__ = ["choose_executor", "start_overdue"]


def choose_executor(
    record: EventRecord,
    last_seen: dict[str, datetime],
    alive_after: datetime,
    *,
    leaving: dict[str, str] | None = None,
    avoid: frozenset[str] = frozenset(),
) -> VmSighting | None:
    """Which VM executes the approval: the first VM in Resources whose forwarder reported recently (the leader
    the docs suggest); otherwise any recently reporting VM that still lists the event (same placement group,
    since the event reached it). Never a VM that another event is removing (``leaving_vms``). A Terminate is
    approved only through the VM it deletes ("every VM in the scale set is only approving the EventID relevant for
    that VM only"): never a peer, so None when that VM is silent.

    ``avoid``: VMs whose listener did not answer the approval's last attempt (hung, gone, its VM dead): any other
    VM that can execute it goes first, so that an approval whose executor died is rerouted within one attempt
    rather than after the heartbeat timeout; an avoided VM only when none is left (a Terminate's own VM)."""
    leaving = leaving or {}
    candidates = {
        name: s
        for name, s in record.vms.items()
        if s.status != "Gone"
        # An Event Grid sighting (coordinator/pipeline/event_grid.py) is no forwarder's: no listener to execute it.
        and s.epoch >= 0
        and last_seen.get(name, s.lastSeen) >= alive_after
        and leaving.get(name, record.eventId) == record.eventId
    }
    if record.eventType == "Terminate":
        candidates = {name: s for name, s in candidates.items() if name in record.resources}
    candidates = {name: s for name, s in candidates.items() if name not in avoid} or candidates
    for name in record.resources:
        if name in candidates:
            return candidates[name]
    if not candidates:
        return None
    return max(candidates.values(), key=lambda s: (last_seen.get(s.name, s.lastSeen), s.name))


def start_overdue(record: EventRecord, now: datetime, last_seen: dict[str, datetime]) -> bool:
    """Whether an approval a listener answered "approved" was not followed by Started (or by the event leaving) by
    its ``confirmBy``: the listener's word is not the platform's. A delete the platform holds is not overdue (its
    time starts again when the hold is lifted). A Terminate/Preempt is overdue only while a VM it removes still
    speaks after that time: a removed VM says nothing more, and its retirement concludes the event."""
    approval = record.approval
    if (
        not record.open
        or record.state != "Approved"
        or record.everStarted
        or approval is None
        or not approval.delivered
        or approval.confirmBy is None
        or now < approval.confirmBy
        or record.platformHold is not None
    ):
        return False
    if any(s.status == "Gone" for s in record.vms.values()):
        return False
    if record.eventType in REMOVING_EVENTS:
        since = approval.confirmBy
        return any(seen >= since for name in record.resources if (seen := last_seen.get(name)) is not None)
    return True
