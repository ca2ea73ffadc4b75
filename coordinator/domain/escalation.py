"""Escalation ladders: what a rule's ``escalate`` steps do as an event it has not approved nears NotBefore.

Pure. A step's time is NotBefore minus its ``beforeNotBeforeSeconds``; the first run at or after it (a batch, or the
timer's tick each minute) reaches it, and every step before it. ``climb`` says what the steps reached make of a
waiting decision: a note for its reason (each new step changes the reason, so the decision is recorded anew with a
Decision row), and, when the ladder's last step reached is ``approve``, an approval made anyway. pipeline/decide.py
takes each step once (``EventRecord.escalation``) and raises its card; the VM checks an escalation's approval
against its own IMDS document (``ApprovalFacts.nearNotBeforeSeconds``: NotBefore must be that near on its clock).

Whom a ``notify`` step tells: the value of its ``ownerTag`` on the affected VMs, read only from ARM's census (a VM's
own report of its tags is its word, and no VM names the owner of an event it shares with others), else the step's
``owner``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from coordinator.domain.expiry import SEND_MARGIN
from coordinator.domain.fleet_view import FleetView
from coordinator.domain.lifecycle import EventChange, raise_alert
from coordinator.domain.model import ESCALATION_KINDS, EventRecord
from coordinator.domain.policy import EscalationStep, Rule
from coordinator.domain.side_records import EscalationTaken, refused_force

__all__ = ["MAX_OWNERS", "Climb", "Rung", "climb", "force_spent", "not_taken", "reached", "take"]

# Owners named on one step's card (one per distinct tag value of the affected VMs), at most.
MAX_OWNERS = 20


@dataclass(frozen=True)
class Rung:
    """A step reached: its place in the ladder (from 1), what it does, its lead and time, whom it tells."""

    step: int
    of: int
    do: str
    beforeNotBeforeSeconds: int
    at: datetime
    owners: tuple[str, ...] = ()
    hook: str = ""  # a force step's hook

    def describe(self) -> str:
        told = f": tell {', '.join(self.owners)}" if self.owners else ""
        if self.do == "notify" and not self.owners:
            told = ": no owner named (the tag is on none of the VMs in ARM's census, and the step names no owner)"
        what = f"force hook {self.hook}" if self.do == "force" else self.do
        lead = f"{what}, {self.beforeNotBeforeSeconds} s before NotBefore"
        return f"escalation step {self.step} of {self.of} ({lead}){told}"


@dataclass(frozen=True)
class Climb:
    """What the steps reached make of a waiting decision: the steps, a note for its reason, and whether it now
    approves (the last step reached is ``approve``, nothing forbids it, and it can still reach the VM in time)."""

    rungs: tuple[Rung, ...]
    note: str
    approve: bool = False
    near_seconds: int | None = None
    force_hook: str = ""  # a force step's approval: the VM runs this hook of its own first


def reached(rule: Rule, record: EventRecord, view: FleetView, now: datetime) -> tuple[Rung, ...]:
    """The rule's steps whose time has come for a Scheduled event with a NotBefore, in order."""
    if not rule.escalate or record.notBefore is None or record.state != "Scheduled":
        return ()
    rungs: list[Rung] = []
    for index, step in enumerate(rule.escalate, start=1):
        at = record.notBefore - timedelta(seconds=step.beforeNotBeforeSeconds)
        if now < at:
            break
        owners = _owners(step, record, view)
        rungs.append(Rung(index, len(rule.escalate), step.do, step.beforeNotBeforeSeconds, at, owners, step.hook))
    return tuple(rungs)


def climb(rule: Rule, record: EventRecord, view: FleetView, now: datetime, *, blocked: str = "") -> Climb | None:
    """The ladder on a decision that waits; None when no step is reached. ``blocked``: what forbids any approval
    now whatever the rule says (a blackout), named in the note when the last step reached would approve."""
    rungs = reached(rule, record, view, now)
    if not rungs:
        return None
    last = rungs[-1]
    note = last.describe()
    if last.do == "hold":
        return Climb(rungs, f"{note}: held, the platform starts it at NotBefore")
    if last.do not in ("approve", "force"):
        return Climb(rungs, note)
    spent = refused_force(record.escalation) if last.do == "force" else None
    refused = spent.refusedBy if spent is not None else ""
    if blocked or refused:
        # A refused force: the VM's own hook said it cannot be drained by force; running it again would say the
        # same, and the rule's own approval (its hooks succeeded) still goes when the rule gives it.
        why = (
            f"not approved, {blocked} holds it"
            if blocked
            else f"force hook {last.hook} failed on {refused}: not forced again, the platform starts it at NotBefore "
            "unless the rule approves it first"
        )
        return Climb(rungs, f"{note}: {why}")
    assert record.notBefore is not None  # reached() needs it
    send_by = record.notBefore - SEND_MARGIN
    if now >= send_by:
        # Past its send deadline an approval could only land after NotBefore, or be refused by the VM.
        return Climb(
            rungs,
            f"{note}: too near NotBefore to deliver an approval (sent only until {send_by.isoformat()}): left to "
            "expire",
        )
    forced = f": approved once the VM's force hook {last.hook} succeeded (the VM runs it, then starts it)"
    said = note + (forced if last.do == "force" else ": approved anyway")
    return Climb(rungs, said, approve=True, near_seconds=last.beforeNotBeforeSeconds, force_hook=last.hook)


def force_spent(record: EventRecord, decision_id: str, refused_by: str) -> None:
    """A force approval (``decision_id``) its VM refused after its force hook failed: its request closed (the
    listener keeps the refusal: nothing executes it unless it is sent again, and it is not) and the force step marked
    refused, so that the ladder does not force again."""
    if record.openRequest is not None and record.openRequest.decisionId == decision_id:
        record.openRequest = None
    for step in record.escalation:
        if step.do == "force" and not step.refusedBy:
            step.refusedBy = refused_by


def not_taken(record: EventRecord, rungs: Sequence[Rung]) -> list[Rung]:
    """The steps reached that the event has not taken yet."""
    taken = {step.step for step in record.escalation}
    return [rung for rung in rungs if rung.step not in taken]


def take(change: EventChange, rungs: Sequence[Rung], now: datetime, *, cards: bool = True) -> None:
    """Each step taken once, by the decision just recorded on ``change``'s record: kept on the record (whatever
    decisions come after) and, with ``cards``, its card raised."""
    record = change.record
    assert record.decision is not None  # recorded just before
    for rung in rungs:
        taken = {**dataclasses.asdict(rung), "owners": list(rung.owners)}
        record.escalation.append(EscalationTaken(**taken, takenAt=now, decisionId=record.decision.decisionId))
        if cards:
            raise_alert(change, ESCALATION_KINDS[rung.step - 1], now)


def _owners(step: EscalationStep, record: EventRecord, view: FleetView) -> tuple[str, ...]:
    if step.do != "notify":
        return ()
    named: set[str] = set()
    if step.ownerTag and view.authoritative:
        wanted = step.ownerTag.casefold()  # ARM's tag names are case-insensitive
        for name in record.resources or sorted(record.vms):
            tags = view.facts(record, name).tags
            named.update(value[:256] for key, value in tags.items() if key.casefold() == wanted and value)
    if not named and step.owner:
        named.add(step.owner)
    return tuple(sorted(named)[:MAX_OWNERS])
