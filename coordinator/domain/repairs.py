"""Repair-aware maintenance, the pure part: which events keep a scale set's automatic repairs suspended, and under
which claim entity and ARM id (pipeline/repairs.py suspends and resumes them).

VMSS automatic repairs replace an instance whose health probe fails for the policy's grace period (10 to 90 min): a
maintenance reboot looks like a failure. While an event that takes VMs down (``DISRUPTIVE``) is in flight on a scale
set's VMs (approved or started, until it concludes and, under a ``returnToService``, its VMs are back in service),
the coordinator keeps its repairs suspended. The scale set is ARM's: the VM's resource id as the census lists it,
never what a VM reports.
"""

from __future__ import annotations

from coordinator.domain.model import EventRecord

__all__ = ["DISRUPTIVE", "REPAIRS_PREFIX", "in_flight", "is_repairs", "repairs_key"]

# A Terminate or Preempt removes its VMs (nothing to repair); the others take them down for a while.
DISRUPTIVE = frozenset({"Reboot", "Redeploy", "Freeze"})
REPAIRS_PREFIX = "repairs:"


def repairs_key(scale_set: str) -> str:
    """The claim entity of a scale set's repairs (coordinator/domain/claims.py), by its ARM id."""
    return REPAIRS_PREFIX + scale_set.lower()


def is_repairs(key: str) -> bool:
    return key.startswith(REPAIRS_PREFIX)


def in_flight(record: EventRecord) -> bool:
    """The event takes its VMs down now or soon: approved (by a rule, a person or a ladder) or started, not over; or
    over, with VMs not back in service yet (its rule's ``returnToService``: a VM still recovering must not be
    replaced either). Its VMs still down: ``EventRecord.impacting``."""
    return record.eventType in DISRUPTIVE and (record.state in ("Approved", "Started") or bool(record.returning))
