"""An approval's way after the decision: through which VM it is sent, and when the platform is late to start it.

Pure: takes an event record and when its VMs last reported; gives the executing VM (``choose_executor``), when
another VM may be sent it after one that did not answer (``reroute_at``), how long a request that a peer may have to
take over stays valid when NotBefore is near (``reroutable_within``), whether a delivered approval's Started
is overdue (``start_overdue``: the listener's word is not the platform's), and why one not delivered was withdrawn
(``withdrawal``).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from coordinator.domain.deletes import REMOVING_EVENTS
from coordinator.domain.model import ApprovalRecord, EventRecord, OpenRequest, VmSighting

__all__ = [
    "MIN_REQUEST_VALIDITY",
    "REROUTE_LEAD",
    "REROUTE_MARGIN",
    "choose_executor",
    "reroutable_within",
    "reroute_at",
    "start_overdue",
    "withdrawal",
]

# After an unanswered request's notAfter, how long before another VM (or another decision) is sent the event: the
# listener checks notAfter again right before its StartRequests POST (forwarder/approver.py), and this covers that
# POST's own way to IMDS (the process's IMDS rate limiter may hold it a token or two, 0.5 s each) (*Liveness*).
REROUTE_MARGIN = timedelta(seconds=1)
# From the instant a peer may be sent the event to its listener's StartRequests: the delivery run that takes the
# approval over (already waiting for that instant, pipeline/handover.py lapse_wait: a read, a decision, a write; 0.1 s
# alone, around a second on two loaded cores) and the peer's listener (its IMDS read and POST, 0.1-0.3 s).
REROUTE_LEAD = timedelta(seconds=1.5)
# The shortest validity a first request is given however near NotBefore is: a listener that answers does so in 5-41
# ms, one connecting as it is sent within 0.1 s, and the relay sender's "no listener" retries come within 1 s.
MIN_REQUEST_VALIDITY = timedelta(seconds=1.5)


def choose_executor(
    record: EventRecord,
    last_seen: dict[str, datetime],
    alive_after: datetime,
    *,
    leaving: dict[str, str] | None = None,
    avoid: frozenset[str] = frozenset(),
    busy: frozenset[str] = frozenset(),
) -> VmSighting | None:
    """Which VM executes the approval: the first VM in Resources whose forwarder reported recently (the leader
    the docs suggest); otherwise any recently reporting VM that still lists the event (same placement group,
    since the event reached it). Never a VM that another event is removing (``leaving_vms``). A Terminate is
    approved only through the VM it deletes ("every VM in the scale set is only approving the EventID relevant for
    that VM only"): never a peer, so None when that VM is silent; so is a force step's (its executor's hook runs).

    ``avoid``: VMs whose listener did not answer the approval's last attempt (hung, gone, its VM dead): any other
    VM that can execute it goes first, so that an approval whose executor died is rerouted within one attempt
    rather than after the heartbeat timeout; an avoided VM only when none is left (a Terminate's own VM).

    ``busy``: VMs another event disrupts now or is about to (approved or Started): a Reboot under way takes the
    listener away mid-request, and the approval then waits for that request to lapse before a peer may take it
    over, which can be past NotBefore. Any other VM that can execute it goes first; a busy one only when none is
    left."""
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
    forced = record.approval is not None and bool(record.approval.forceHook)
    if record.eventType == "Terminate" or forced:
        # A force step's approval too: the executor runs its own force hook first, which must drain a VM the event
        # names, never a peer.
        candidates = {name: s for name, s in candidates.items() if name in record.resources}
    candidates = {name: s for name, s in candidates.items() if name not in avoid} or candidates
    candidates = {name: s for name, s in candidates.items() if name not in busy} or candidates
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


def reroute_at(open_request: OpenRequest | None, executor: str, decision_id: str, now: datetime) -> datetime | None:
    """When a request for ``decision_id`` may go to ``executor``, if not now: a request another VM (or the same VM
    for another decision) has not answered may still be executed by it until its notAfter (its listener refuses it
    from then, its clock within the tolerance of ours; ``REROUTE_MARGIN`` more for a POST it began just before).
    The same executor and decision again is always safe: its listener executes a decisionId once."""
    if open_request is None or (open_request.executor, open_request.decisionId) == (executor, decision_id):
        return None
    free = open_request.until + REROUTE_MARGIN
    return free if now < free else None


def reroutable_within(
    valid_for: timedelta, not_before: datetime | None, now: datetime, *, tolerance: timedelta
) -> timedelta:
    """How long a request sent at ``now`` that a peer may have to take over stays valid (its notAfter is ``now`` +
    this + ``tolerance``, request_bound): ``valid_for``, but no longer than lets a peer still execute the event
    before its NotBefore once the request has lapsed (``REROUTE_MARGIN`` after its notAfter, reroute_at): the peer's
    way there (``REROUTE_LEAD``) and its own request's tolerance before NotBefore. A validity fixed whatever NotBefore
    is would keep a dead listener's request open past a near NotBefore, and no peer could be sent the event in time.
    Never shortened below ``MIN_REQUEST_VALIDITY``: a listener that answers at all does so within it."""
    if not_before is None:
        return valid_for
    room = not_before - now - 2 * tolerance - REROUTE_MARGIN - REROUTE_LEAD
    return min(valid_for, max(MIN_REQUEST_VALIDITY, room))


def withdrawal(approval: ApprovalRecord, fingerprint: str, now: datetime, *, refused_by: str = "") -> str:
    """Why an approval was withdrawn, as the start of the decision that replaces it (``fingerprint``: the policy's
    version now; ``refused_by``: the VM that refused a force approval after its force hook failed)."""
    if refused_by:
        return (
            f"approval {approval.decisionId} by rule {approval.rule!r} refused by {refused_by}: its force hook "
            f"{approval.forceHook} failed, so it starts nothing; decided again: "
        )
    held = (
        f", valid until {approval.notAfter.isoformat()} ({approval.notAfterReason})"
        if approval.notAfter is not None and approval.notAfter <= now
        else ""
    )
    changed = (
        f"; the policy changed since (version {approval.policyVersion}, now {fingerprint})"
        if approval.policyVersion and approval.policyVersion != fingerprint
        else ""
    )
    return (
        f"approval {approval.decisionId} by rule {approval.rule!r} (decided {approval.decidedAt.isoformat()}{held}, "
        f"not delivered{changed}) withdrawn, decided again: "
    )
