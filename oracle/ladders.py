"""Escalation ladders judged (pure): each step of a rule's ``escalate`` ladder taken once, never before its time, in
time, and never left out, from the run's Decision rows (their ``Details.escalation``: the steps each decision took)
against the oracle's own reading of the policy (``oracle.rules.steps``) and IMDS's truth.

A step's **time** is the event's NotBefore, as IMDS showed it, minus the step's lead. While the rule that decides
the event waits (a person, a window, a gate, hooks, a budget; or a blackout holds it), the first coordinator run at or
after that time takes the step, and every earlier one not yet taken, each once per event. The step is **due** once
the rule has surely waited (``Judge.rule_allows``' upper set excludes it, or a blackout is open), from the later of
its time and when the coordinator surely knew the event (``Judge.reported``), for a timer period plus the pipeline's
latency (plus the slowest gate read a run may wait for), clear of outages, stalls and lies about the event
(``Facts.impediments``). Judged only when the rule surely waited from the event's creation until then (before, an
approval may have been pending, and a pending approval takes no step):

- **wrong**: a row took a step before its time (less ``GRANULARITY``: NotBefore is shown in whole seconds), or a
  step that the ladder of the row's rule does not have (another lead or action, or no such place);
- **duplicate**: more than one decision took the same step of one event;
- **late**: its first row came after it was due;
- **missed**: due, the event still Scheduled and unapproved in IMDS well after (``Bounds.slack`` before NotBefore
  or its leaving Scheduled, the first approval's ``slack`` before its acceptance), and no row took it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator import Rule
from oracle.allowed import Judge
from oracle.facts import INF, Facts
from oracle.intervals import Intervals, seconds
from oracle.rules import choose, steps
from oracle.truth import Event, HistoryStep, LadderStep
from oracle.verdict import Finding, FindingKind

__all__ = ["GRANULARITY", "ladder_findings"]

# NotBefore is shown in whole seconds (RFC 1123): a step's time is known to within a second.
GRANULARITY = 1.0


@dataclass(frozen=True)
class _Taken:
    """A step as one Decision row took it."""

    row: HistoryStep
    rung: LadderStep


def ladder_findings(run: Facts, judges: dict[str, Judge]) -> list[Finding]:
    """Every event's escalation steps judged: taken early, late or twice, or missed."""
    taken: dict[str, list[_Taken]] = {}
    seen: set[tuple[str, str, int]] = set()
    for row in run.truth.history:
        event = run.events.get(row.eventId.upper())
        if event is None or row.kind != "Decision":
            continue
        for rung in row.escalation:
            # The same row written twice (the history's sink is at least once) is one decision.
            key = (event.eventId, row.decisionId or row.at.isoformat(), rung.step)
            if key not in seen:
                seen.add(key)
                taken.setdefault(event.eventId, []).append(_Taken(row, rung))
    findings: list[Finding] = []
    for event in run.truth.events:
        ladder = _Ladder(run, judges[event.eventId])
        mine = sorted(taken.get(event.eventId, []), key=lambda t: t.row.at)
        findings.extend(ladder.taken_findings(mine))
        findings.extend(ladder.missed({t.rung.step for t in mine}))
    return findings


@dataclass
class _Ladder:
    """One event's ladder steps, judged."""

    run: Facts
    judge: Judge
    _waiting: dict[str, Intervals] = field(default_factory=dict)

    @property
    def event(self) -> Event:
        return self.judge.event

    def _at(self, value: float) -> str:
        return f"+{value - self.run.start:.1f}s"

    def waiting(self, rule: Rule) -> Intervals:
        """While IMDS showed the event Scheduled, ``rule`` decided it and surely waited: it could not approve (its
        upper set, the ladder aside) or a blackout held it."""
        run, judge = self.run, self.judge
        if rule.name in self._waiting:
            return self._waiting[rule.name]

        def waits(at: float) -> bool:
            chosen, _ = choose(run.policy, self.event, run.vms, at)
            if chosen is None or chosen.name != rule.name:
                return False
            return at in run.blackouts or not judge.rule_allows(rule, at, surely=False)[0]

        lo, hi = run.start - 3600, run.end + 3600
        found = Intervals.where(judge.breakpoints, lo, hi, waits) & run.scheduled(self.event)
        self._waiting[rule.name] = found
        return found

    def due(self, rule: Rule, at: float) -> float | None:
        """When a step of ``rule`` whose time is ``at`` is due; None when not judged (the rule did not surely wait
        from the event's creation until then, or faults never left it long enough)."""
        run = self.run
        start = max(at, self.judge.reported)
        if start == INF:
            return None
        waiting = self.waiting(rule)
        # A tick reads the gates it needs before it decides: the slowest page may hold it that long.
        gate = max((g.delaySeconds for g in run.truth.gates), default=0.0)
        length = run.truth.options.timerInterval + run.bounds.latency + gate
        clear = (waiting & Intervals(((start, INF),))) - run.impediments(self.event)
        deadline = clear.first_run(length)
        if deadline is None:
            return None
        created = seconds(self.event.transitions[0].at)
        return None if Intervals(((created, deadline),)) - waiting else deadline

    def _name(self, rung: LadderStep) -> str:
        return f"escalation step {rung.step} of {rung.of} ({rung.do}, {rung.beforeNotBeforeSeconds} s before NotBefore)"

    def taken_findings(self, taken: list[_Taken]) -> list[Finding]:
        """Each step's rows: more than one decision (duplicate); the first's step not in its rule's ladder (wrong),
        before its time (wrong), or after it was due (late)."""
        findings: list[Finding] = []
        by_step: dict[int, list[_Taken]] = {}
        for took in taken:
            by_step.setdefault(took.rung.step, []).append(took)
        for rows in by_step.values():
            first = rows[0]
            name = self._name(first.rung)
            for extra in rows[1:]:
                detail = (
                    f"{name} taken again at {self._at(seconds(extra.row.at))} (decision {extra.row.decisionId[:8]})"
                )
                findings.append(self._finding("duplicate", f"{detail}, first at {self._at(seconds(first.row.at))}"))
            finding = self._first(first, name)
            if finding is not None:
                findings.append(finding)
        return findings

    def _first(self, took: _Taken, name: str) -> Finding | None:
        run, rung = self.run, took.rung
        when = seconds(took.row.at)
        rule = run.policy.rule(took.row.rule)
        ladder = {index: (do, lead, at) for index, do, lead, at in steps(rule, self.event)} if rule else {}
        if ladder.get(rung.step, ("", 0, 0.0))[:2] != (rung.do, rung.beforeNotBeforeSeconds):
            mine = [(do, lead) for do, lead, _ in ladder.values()]
            return self._finding("wrong", f"{name} taken by rule {took.row.rule!r}, whose ladder is {mine}")
        assert rule is not None  # a step found in its ladder
        at = ladder[rung.step][2]
        if when < at - GRANULARITY:
            return self._finding(
                "wrong", f"{name} taken at {self._at(when)}, {at - when:.1f} s before its time {self._at(at)}"
            )
        deadline = self.due(rule, at)
        if deadline is not None and when > deadline:
            late = f"{when - deadline:.1f} s late"
            return self._finding("late", f"{name}: due at {self._at(deadline)}, taken at {self._at(when)} ({late})")
        return None

    def missed(self, taken: set[int]) -> list[Finding]:
        """The steps of the deciding rule's ladder that were due while the event was still Scheduled and unapproved,
        well before NotBefore, and that no row took."""
        run, event = self.run, self.event
        created = seconds(event.transitions[0].at)
        rule, why = choose(run.policy, event, run.vms, created)
        if rule is None or not rule.escalate or event.notBefore is None:
            return []
        # The coordinator expires the event at NotBefore and learns of its start, conclusion or approval late.
        until = min(run.left_scheduled(event), seconds(event.notBefore)) - run.bounds.slack
        until = min(until, run.first_approval.get(event.eventId, INF) - run.slack)
        findings = []
        for index, do, lead, at in steps(rule, event):
            if index in taken:
                continue
            deadline = self.due(rule, at)
            if deadline is None or deadline >= until:
                continue
            name = f"escalation step {index} of {len(rule.escalate)} ({do}, {lead} s before NotBefore)"
            detail = f"{why}: {name} at {self._at(at)}, due at {self._at(deadline)}, never taken"
            findings.append(
                self._finding("missed", f"{detail} (Scheduled until {self._at(run.left_scheduled(event))})")
            )
        return findings

    def _finding(self, kind: FindingKind, detail: str) -> Finding:
        return Finding(kind, self.event.eventId, self.run.label(self.event), detail)
