"""Replay recorded events through a policy: what it would have decided, where that differs from what was recorded.

Takes history rows (ops/policy/exports.py) and a policy; gives the differences. Each event is rebuilt from
its own rows (facts from its first observation, each VM's sightings and prepare/recover outcomes from its
Observation and Hook rows, its decisions from its Decision rows), and decided again, with the fleet around it as the
history shows it then, at every instant the coordinator recorded a decision for it or heard from its VMs while it
was still Scheduled and not approved, and at the step times of the escalation ladder of the simulated policy's rule
that decides it (NotBefore minus each step's lead: the coordinator's timer, which ticks each minute, takes a step
then, whether or not the history has a row there). A difference is reported when the simulated (rule, verdict) is
not the recorded one in force, once for each change on either side. ``LIMITS`` says what the history does not hold.

The steps a recorded decision took (its row's ``Details.escalation``) are read back onto the rebuilt event
(``EventRecord.escalation``) and shown beside the recorded verdict (``Verdict.escalation``); a simulated step is
replayed at the instant the history shows that step taken, else at the event's first recorded instant within a
timer period after its time (a run the coordinator made then), else at its time.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import cached_property
from typing import Any

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
from ops.policy.instants import SAME_TIME, TICK, Instants, Point, Positions, step_time, steps_taken

LIMITS = (
    "decisions are replayed at the instants the history shows for each event (its recorded decisions, and the "
    "sightings and hook reports after its first decision while it was Scheduled and not approved), and at the step "
    "times of the escalation ladder of the rule the simulated policy decides it by (NotBefore minus each step's "
    "lead: the coordinator takes a step at its first run at or after that time, taken here as the run the history "
    "shows taking a step of that time, else the event's first row in the minute after, else the step's time "
    "itself); other timer re-evaluations that changed nothing wrote no row, so a verdict that would have changed "
    "between two such instants (e.g. at another hook deadline) shows at the next one. Only (rule, verdict) is "
    "compared: a notify or hold step changes neither, and shows only in the escalation steps beside a difference",
    "a different verdict is not played forward: later states, approvals, budgets and deletes are those recorded",
    "the fleet view is rebuilt from the events the history shows approved or started at that instant; budget "
    "claims held by other coordinator instances are not in the history",
    "VMs that never reported an event have no identity, hooks or status in it; their scale set is taken from their "
    "name ('{scale set}_{instance}'), else none",
    "nothing the history has no column for is known: VM tags (a notify step names its owner, not its ownerTag's "
    "values), zone, fault and update domain (a percent budget's domain is only the VMs the events name); "
    "health-gate results are not recorded either: every gate of the policy is taken to be in the state --gates "
    "gives (default passing)",
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
    # Recorded: the escalation steps the event had taken (the Details.escalation of its decisions up to this one);
    # simulated: the steps of its rule's ladder reached. By number, from 1.
    escalation: tuple[int, ...] = ()


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

    @cached_property
    def taken(self) -> list[tuple[datetime, int, datetime | None]]:
        """The escalation steps the history shows taken: (when, the step's number, its time), in order."""
        return [
            (row.TimeGenerated, int(step.get("step", 0) or 0), step_time(step.get("at")))
            for _, row in self.rows
            if row.RecordType == "Decision"
            for step in steps_taken(row)
        ]

    def steps_by(self, decided: HistoryRow) -> tuple[int, ...]:
        """The escalation steps taken by the recorded decision ``decided`` and those before it."""
        return tuple(step for when, step, _ in self.taken if when <= decided.TimeGenerated)

    def in_force(self, at: datetime) -> HistoryRow | None:
        """The last decision recorded at or before ``at``."""
        decisions = (row for _, row in reversed(self.rows) if row.RecordType == "Decision")
        return next((row for row in decisions if row.TimeGenerated <= at), None)

    def step_instant(self, at: datetime) -> datetime:
        """When the coordinator would take a ladder step whose time is ``at``: when the history shows a step of that
        time taken; else at the event's first recorded instant within a timer period after it (a run it made then,
        the first at or after the step's time the history knows of); else at ``at`` itself."""
        when = next((when for when, _, time in self.taken if time is not None and abs(time - at) < SAME_TIME), None)
        if when is not None:
            return when
        return next((row.TimeGenerated for _, row in self.rows if at <= row.TimeGenerated < at + TICK), at)

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
        taken: list[dict[str, Any]] = []
        for row in rows:
            if row.RecordType == "Observation" and row.VmName and row.Outcome != "conflict":
                sightings[row.VmName] = self._seen(sightings.get(row.VmName), row)
            elif row.RecordType == "Hook" and row.VmName in sightings and row.HookPhase:
                sightings[row.VmName] = _hooked(sightings[row.VmName], row)
            elif row.RecordType == "Decision":
                decision = _decision(row)
                taken.extend(steps_taken(row))
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
            "escalation": taken,  # EventRecord.escalation: each step taken, by which decision, when
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
    """Replays the history's decisions through ``policy``, every health gate taken to be ``gates``; when a rule of it
    has an escalation ladder, at its steps' instants too, each placed among ``rows`` by its time (``Positions``)."""
    results = adapters.gate_results(policy, {}, default=gates)
    positions = Positions(rows) if any(rule.escalate for rule in policy.rules) else None
    events: dict[str, _Event] = {}
    for position, row in enumerate(rows):
        if row.EventId:
            events.setdefault(row.EventId, _Event(row.EventId)).rows.append((position, row))
    result = Replay(events=len(events))
    for event in events.values():
        try:
            _replay_event(policy, event, events, result, since=since, until=until, gates=results, positions=positions)
        except InputError as error:
            result.failed.append((event.event_id, str(error)))
    result.differences.sort(key=lambda d: (d.at, d.eventId))
    return result


def _points(event: _Event) -> list[Point]:
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
    positions: Positions | None,
) -> None:
    points = _points(event)
    if not points:
        result.never_decided += 1
        return
    # Points before --since are decided too when a rule has a ladder: the rule deciding then names the steps to come.
    ladders = positions is not None
    queue = Instants(points)
    last: tuple[object, ...] = ()
    while queue:
        position, at, decided, own = queue.pop()
        early = since is not None and at < since
        if (until and at > until) or (early and not ladders):
            continue
        if decided.Actor.startswith("person:"):
            result.by_person += own and not early
            continue
        record = _as_decided(event.record(position), own=own)
        if record is None:
            continue
        simulated = _decide(policy, record, events, position, at, gates=gates)
        if positions is not None and simulated.verdict == "wait":
            queue.add(_step_points(policy, event, simulated.rule, record, at, positions=positions))
        if early:
            continue
        result.compared += 1
        key = (id(decided), simulated.rule, simulated.verdict)
        if key == last:
            continue
        last = key
        if (simulated.rule, simulated.verdict) != (decided.Rule, decided.Outcome):
            result.differences.append(_difference(event, record, at, decided, simulated))


def _as_decided(record: EventRecord | None, *, own: bool) -> EventRecord | None:
    """The event to decide again at a point; None when the coordinator would not have decided it then."""
    if record is None:
        return None
    if own:  # the coordinator decided it then, so it was Scheduled and unapproved
        return record.model_copy(update={"state": "Scheduled", "approval": None})
    return record if record.state == "Scheduled" and record.approval is None else None


def _step_points(
    policy: Policy, event: _Event, rule_name: str, record: EventRecord, after: datetime, *, positions: Positions
) -> list[Point]:
    """The instants after ``after`` the named rule's escalation steps would be taken at (``_Event.step_instant``),
    each with the history's position then and the recorded decision in force."""
    rule = policy.rule(rule_name)
    if rule is None or record.notBefore is None:
        return []
    points: list[Point] = []
    for step in rule.escalate:
        instant = event.step_instant(record.notBefore - timedelta(seconds=step.beforeNotBeforeSeconds))
        decided = event.in_force(instant)
        if instant > after and decided is not None:
            points.append((positions.after(instant), instant, decided, False))
    return points


def _difference(
    event: _Event, record: EventRecord, at: datetime, decided: HistoryRow, simulated: Decision
) -> Difference:
    return Difference(
        eventId=event.event_id,
        eventType=record.eventType,
        resources=tuple(record.resources),
        at=at,
        recorded=Verdict(decided.Rule, decided.Outcome, decided.Reason, decided.TimeGenerated, event.steps_by(decided)),
        simulated=Verdict(
            simulated.rule, simulated.verdict, simulated.reason, at, tuple(r.step for r in simulated.escalation)
        ),
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
