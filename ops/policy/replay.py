"""Replay recorded events through a policy: what it would have decided, where that differs from what was recorded.

Takes history rows (ops/policy/exports.py) and a policy; gives the differences. Each event is rebuilt from
its own rows (facts from its first observation, each VM's sightings and prepare/recover outcomes from its
Observation and Hook rows, its decisions from its Decision rows), and decided again, with the fleet around it as the
history shows it then, at every instant the coordinator recorded a decision for it or heard from its VMs while it
was still Scheduled and not approved. A difference is reported when the simulated (rule, verdict) is not the
recorded one in force, once for each change on either side. ``LIMITS`` says what the history does not hold.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property

from coordinator import (
    TERMINAL_STATES,
    Decision,
    DecisionRecord,
    EventRecord,
    FleetView,
    GateResult,
    GateState,
    HistoryRow,
    Policy,
    VmSighting,
    holds_budget,
    needs_fleet,
    pending_delete,
)
from ops.policy import adapters
from ops.policy.adapters import InputError

LIMITS = (
    "decisions are replayed at the instants the history shows for each event (its recorded decisions, and the "
    "sightings and hook reports after its first decision while it was Scheduled and not approved); timer "
    "re-evaluations that changed nothing wrote no row, so a verdict that would have changed between two such "
    "instants (e.g. at another hook deadline) shows at the next one",
    "a different verdict is not played forward: later states, approvals, budgets and deletes are those recorded",
    "the fleet view is rebuilt from the events the history shows approved or started at that instant; budget "
    "claims held by other coordinator instances are not in the history",
    "VMs that never reported an event have no identity, hooks or status in it; their scale set is taken from their "
    "name ('{scale set}_{instance}'), else none",
    "nothing the history has no column for is known: VM tags, zone, fault and update domain (a percent budget's "
    "domain is only the VMs the events name); health-gate results are not recorded either: every gate of the "
    "policy is taken to be in the state --gates gives (default passing)",
    "an event's first row is when it was first seen (createdAt, from which hook deadlines count)",
    "decisions by a person (Actor person:...) are not compared; events never seen Scheduled were never decided",
    "rate and sequence budgets' claims are not reconstructed: a simulated decision is paced by none (test cases give "
    "their state as fleet.paced)",
)
_PHASE_STAYS = re.compile(r"the (\w+) phase stays ([\w-]+)")


@dataclass(frozen=True)
class Verdict:
    rule: str
    verdict: str
    reason: str
    at: datetime | None = None


@dataclass(frozen=True)
class Difference:
    eventId: str
    eventType: str
    resources: tuple[str, ...]
    at: datetime
    recorded: Verdict
    simulated: Verdict


@dataclass
class Replay:
    differences: list[Difference] = field(default_factory=list)
    events: int = 0
    compared: int = 0
    by_person: int = 0
    never_decided: int = 0
    # events that could not be rebuilt: (EventId, why); counted, the others are still replayed
    failed: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class _Event:
    """One event's rows, with their positions in the whole history (the order they were written)."""

    event_id: str
    rows: list[tuple[int, HistoryRow]] = field(default_factory=list)

    def open_at(self, at: datetime) -> bool:
        """Seen by ``at`` and not concluded (Completed or Canceled) before it."""
        return self.rows[0][1].TimeGenerated <= at and (self.concluded is None or self.concluded >= at)

    @cached_property
    def concluded(self) -> datetime | None:
        return next((row.TimeGenerated for _, row in self.rows if row.State in TERMINAL_STATES), None)

    def record(self, before: int, *, batch_at: datetime | None = None) -> EventRecord | None:
        """The event as the coordinator held it just before position ``before`` (None if not seen yet); with
        ``batch_at``, with the sightings and hook reports of that instant too (the batch being decided: the
        coordinator folds a whole batch before deciding its events)."""
        rows = [
            row
            for pos, row in self.rows
            if pos < before or (row.TimeGenerated == batch_at and row.RecordType in ("Observation", "Hook"))
        ]
        if not rows:
            return None
        facts_row = next((r for r in rows if r.Resources is not None), rows[0])
        sightings: dict[str, VmSighting] = {}
        decision: DecisionRecord | None = None
        approved = False
        for row in rows:
            if row.RecordType == "Observation" and row.VmName and row.Outcome != "conflict":
                sightings[row.VmName] = self._seen(sightings.get(row.VmName), row)
            elif row.RecordType == "Hook" and row.VmName in sightings and row.HookPhase:
                sightings[row.VmName] = _hooked(sightings[row.VmName], row)
            elif row.RecordType == "Decision":
                decision = _decision(row)
                approved = approved or (row.Outcome == "approve" and not row.DryRun)
            elif row.RecordType == "Approval" and row.Actor != "platform":
                approved = True
        facts = {
            "EventId": self.event_id,
            "EventType": facts_row.EventType,
            "EventSource": facts_row.EventSource or "Platform",
            "DurationInSeconds": facts_row.DurationInSeconds,
            "NotBefore": facts_row.NotBefore,
            "Resources": facts_row.Resources or [],
            "State": rows[-1].State or "Scheduled",
        }
        return adapters.event_record(
            facts, sightings=sightings, created_at=rows[0].TimeGenerated, decision=decision, approved=approved
        )

    @staticmethod
    def _seen(previous: VmSighting | None, row: HistoryRow) -> VmSighting:
        identity = adapters.vm_identity_from_row(row)
        state: dict[str, object] = {"status": row.EventStatus or "Scheduled", "lastSeen": row.TimeGenerated}
        if previous is not None:
            state |= {"firstSeen": previous.firstSeen, "hooks": previous.hooks, "failedHooks": previous.failedHooks}
        return adapters.sighting(identity, state, at=row.TimeGenerated)


def _hooked(sighting: VmSighting, row: HistoryRow) -> VmSighting:
    """The phase's outcome after a Hook row: the row's Outcome, unless its reason says the phase stayed failed."""
    stays = _PHASE_STAYS.search(row.Reason)
    outcome = stays.group(2) if stays and stays.group(1) == row.HookPhase else row.Outcome
    hooks = {**sighting.hooks, row.HookPhase: outcome}
    failed = dict(sighting.failedHooks)
    failed_hook = (row.Details or {}).get("failedHook") or (row.Actor if outcome == row.Outcome != "succeeded" else "")
    if outcome == "succeeded":
        failed.pop(row.HookPhase, None)
    elif failed_hook and failed_hook != "hook":
        failed[row.HookPhase] = str(failed_hook)
    return sighting.model_copy(update={"hooks": hooks, "failedHooks": failed})


def _decision(row: HistoryRow) -> DecisionRecord:
    details = row.Details or {}
    return DecisionRecord(
        decisionId=row.DecisionId,
        rule=row.Rule,
        action=row.Action,
        verdict=row.Outcome if row.Outcome in ("approve", "wait", "never") else "wait",
        reason=row.Reason,
        decidedAt=row.TimeGenerated,
        dryRun=bool(row.DryRun),
        actor=row.Actor,
        heldBy=str(details.get("heldBy") or ""),
        heldByVm=str(details.get("heldByVm") or ""),
    )


def replay(
    policy: Policy,
    rows: Sequence[HistoryRow],
    *,
    since: datetime | None = None,
    until: datetime | None = None,
    gates: GateState = "passing",
) -> Replay:
    """Replays the history's decisions through ``policy``, every health gate taken to be ``gates``."""
    results = adapters.gate_results(policy, {}, default=gates)
    events: dict[str, _Event] = {}
    for position, row in enumerate(rows):
        if row.EventId:
            events.setdefault(row.EventId, _Event(row.EventId)).rows.append((position, row))
    result = Replay(events=len(events))
    for event in events.values():
        try:
            _replay_event(policy, event, events, result, since=since, until=until, gates=results)
        except InputError as error:
            result.failed.append((event.event_id, str(error)))
    result.differences.sort(key=lambda d: (d.at, d.eventId))
    return result


def _points(event: _Event) -> list[tuple[int, datetime, HistoryRow, bool]]:
    """(position, instant, the recorded Decision row in force, whether the point is that decision) at each instant
    to decide again: each recorded decision, and the last sighting or hook row of each later instant."""
    points: dict[datetime, tuple[int, HistoryRow, bool]] = {}
    in_force: HistoryRow | None = None
    for position, row in event.rows:
        if row.RecordType == "Decision":
            in_force = row
            points[row.TimeGenerated] = (position, row, True)
            continue
        decided_here = row.TimeGenerated in points and points[row.TimeGenerated][2]  # a decision at t stays
        if row.RecordType in ("Observation", "Hook") and in_force is not None and not decided_here:
            points[row.TimeGenerated] = (position + 1, in_force, False)
    return [(position, at, decided, own) for at, (position, decided, own) in points.items()]


def _replay_event(
    policy: Policy,
    event: _Event,
    events: dict[str, _Event],
    result: Replay,
    *,
    since: datetime | None,
    until: datetime | None,
    gates: Mapping[str, GateResult],
) -> None:
    points = _points(event)
    if not points:
        result.never_decided += 1
        return
    last: tuple[object, ...] = ()
    for position, at, decided, own in points:
        if (since and at < since) or (until and at > until):
            continue
        if decided.Actor.startswith("person:"):
            result.by_person += own
            continue
        record = event.record(position)
        if record is None:
            continue
        if own:  # the coordinator decided it then, so it was Scheduled and unapproved
            record = record.model_copy(update={"state": "Scheduled", "approval": None})
        elif record.state != "Scheduled" or record.approval is not None:
            continue
        simulated = _decide(policy, record, events, position, at, gates=gates)
        result.compared += 1
        key = (id(decided), simulated.rule, simulated.verdict)
        if key == last:
            continue
        last = key
        if (simulated.rule, simulated.verdict) != (decided.Rule, decided.Outcome):
            result.differences.append(
                Difference(
                    eventId=event.event_id,
                    eventType=record.eventType,
                    resources=tuple(record.resources),
                    at=at,
                    recorded=Verdict(decided.Rule, decided.Outcome, decided.Reason, decided.TimeGenerated),
                    simulated=Verdict(simulated.rule, simulated.verdict, simulated.reason, at),
                )
            )


def _decide(
    policy: Policy,
    record: EventRecord,
    events: dict[str, _Event],
    position: int,
    at: datetime,
    *,
    gates: Mapping[str, GateResult],
) -> Decision:
    wants_fleet = needs_fleet(policy, record, at)
    if not wants_fleet and record.eventType != "Terminate":
        return adapters.decide(policy, record, FleetView(), [], at, gates=gates)
    others = [e for e in events.values() if e.event_id != record.eventId and e.open_at(at)]
    fleet = FleetView()
    if wants_fleet:
        impacting = (r for r in (e.record(position) for e in others) if r is not None and holds_budget(r))
        fleet = adapters.fleet_view(impacting)
    deletes: list[EventRecord] = []
    if record.eventType == "Terminate":
        batch = (e.record(position, batch_at=at) for e in others if e.rows[0][1].EventType == "Terminate")
        deletes = [adapters.own_verdict(policy, r, at) for r in batch if r is not None and pending_delete(r, at)]
    return adapters.decide(policy, record, fleet, deletes, at, gates=gates)
