"""When the policy allows approving one event (pure): the oracle's own reading of the policy over a run's facts.

**Allowed.** At a decision time d the policy allows approving event e when e is Scheduled in IMDS, no blackout is
open, and the rule that decides e at d (``oracle.rules.choose``) approves: ``approve-now`` inside its window with its
gates passing; ``approve-after-hooks`` once every affected VM's prepare phase succeeded (or its deadline passed with
``onDeadline: approve``); ``approve-within-budget`` while its domains have room; in each case a window or gate hold is
lifted ``approveBeforeSeconds`` before NotBefore with ``onNotBefore: approve``. Whatever the rule waits for (a person, a
window, a gate, hooks), an escalation ladder ending in ``approve`` approves from that step's time (NotBefore minus its
lead) until ``SEND_MARGIN`` before NotBefore (``oracle.rules.ladder_approval``), in both sets: an approval it makes
is then due like any other. A StartRequests accepted at t is right
when the policy allowed it at some d in [t - slack, t] (slack: the longest decision-to-IMDS delivery the run's faults
allow). Two sets are computed: the **upper** set (everything the policy could allow: where the truth cannot tell,
allowed) judges WRONG; the **lower** set (only what the policy surely allows) decides what is DUE.

**Either** (neither wrong if made nor missed if not), and why:
- a gate the local gate server does not serve (its state is unknown), a trickling gate (its status is 200, its body
  may not arrive within the timeout), a gate slow by close to its timeout;
- hooks whose forwarder was killed or stopped while they ran or before their report was sent (the phase may be
  reported interrupted, or its report arrive after the restart);
- budgets: a slot is counted taken in the upper set only when another event's approval was accepted before (so
  it was decided before) and its event is still live in IMDS; in the lower set every event that may
  hold a slot counts (approved or started, until well after IMDS concluded it: the coordinator learns it late, and a
  removed VM only at its retirement) and so does every other Scheduled event of the domain that some rule might
  approve and that comes first (closer to its NotBefore: the coordinator serves those first; an event behind it
  that was decided before this one was seen holds its slot as an approved one);
- deletes of a scale set are approved together: a Terminate is due only while every other Scheduled Terminate of its
  scale set is surely allowed too, but approving one early is not wrong by the policy (the platform holds it);
- an event a forged envelope was about (docs/security.md: a lying VM can make the coordinator wait);
- anything a fault touches: an Event Hubs or Relay outage or a storage stall (and after it, twice its length plus
  ``recover`` seconds: the clients' doubling backoff and reconnects; after a Relay outage also ``retry``, the timer's
  first retry of an approval that failed meanwhile), every VM that could execute the approval down, dead or
  removed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from functools import cached_property

from coordinator import RETURN_WATCH_LIMIT, RETURNING_TYPES, HooksOption, RateOption, Rule, SequenceOption
from oracle.facts import INF, Facts
from oracle.intervals import EMPTY, Intervals, seconds
from oracle.rules import SEND_MARGIN, choose, ladder_approval, ladder_approves, match_breakpoints, steps
from oracle.truth import Event

__all__ = ["Judge"]


def _limit(max_impacted: int | None, max_percent: Decimal | float | None, size: int) -> int:
    """The documented limit in exact arithmetic: at most N, or ceil(size x P / 100), the smaller, never below 1."""
    limits = [] if max_impacted is None else [max_impacted]
    if max_percent is not None:
        limits.append(max(1, math.ceil(Fraction(size) * Fraction(str(max_percent)) / 100)))
    return max(1, min(limits))


@dataclass
class Judge:
    """The allowed sets of one event."""

    run: Facts
    event: Event

    @cached_property
    def breakpoints(self) -> list[float]:
        run, event = self.run, self.event
        lo, hi = run.start - 3600, run.end + 3600
        points = [*match_breakpoints(run.policy, lo, hi)]
        for spans in (run.blackouts, *(run.window(r) for r in run.policy.rules)):
            points.extend(edge for span in spans.spans for edge in span)
        for name in run.policy.gates:
            for surely in (True, False):
                points.extend(edge for span in run.gate_passing(name, surely=surely).spans for edge in span)
        for other in run.truth.events:
            points.extend(seconds(t.at) for t in other.transitions)
            points.extend(seconds(t.at) + d for t in other.transitions for d in (run.bounds.conclude, -run.slack))
            retire = run.truth.options.retireGraceSeconds + run.bounds.conclude
            points.extend(seconds(t.at) + retire for t in other.transitions)
        for approval in run.truth.approvals:
            points.extend(seconds(approval.at) + d for d in (0.0, run.slack, -run.slack))
        points.extend(self._pacing_points())
        for removed in run.truth.removals.values():
            points.extend(seconds(removed) + d for d in (0.0, -run.truth.options.retireGraceSeconds - 10.0))
        created = seconds(event.transitions[0].at)
        for rule in run.policy.rules:
            if event.notBefore is not None:
                points.append(seconds(event.notBefore) - rule.approveBeforeSeconds)
                points.extend(at for *_, at in steps(rule, event))
                points.append(seconds(event.notBefore) - SEND_MARGIN)
            if rule.hooks is not None:
                points.extend(created + rule.hooks.deadlineSeconds + d for d in (0.0, self.reported - created))
        points.extend(self.hooks_ready(surely=True).values())
        points.extend(self.hooks_ready(surely=False).values())
        return points

    def _pacing_points(self) -> list[float]:
        """Where a rate's period or a sequence's gap ends, after an approval or a transition."""
        run, points = self.run, list[float]()
        for rule in run.policy.rules:
            lengths = [float(rule.rate.periodSeconds)] if rule.rate is not None else []
            lengths += [float(rule.sequence.gapSeconds)] if rule.sequence is not None else []
            for length in lengths:
                points.extend(seconds(a.at) + length + d for a in run.truth.approvals for d in (0.0, -run.slack))
                for other in run.truth.events:
                    for t in other.transitions:
                        points.extend(seconds(t.at) + length + d for d in (run.slack, run.bounds.conclude))
        return points

    @cached_property
    def reported(self) -> float:
        return self.run.reported(self.event)

    def hooks_ready(self, *, surely: bool) -> dict[str, float]:
        """Per affected VM whose prepare phase succeeds: from when its success may be known (upper: the hooks' own
        run time after creation; lower: after its forwarder saw the event and the worker's queue ran, unless a kill
        or stop of its forwarder may have interrupted the phase)."""
        run, event = self.run, self.event
        created = seconds(event.transitions[0].at)
        ready = {}
        for name in event.resources:
            vm = run.vms.get(name)
            if vm is None or run.hook_outcome(vm) != "succeeded":
                continue
            if not surely:
                ready[name] = created + sum(h.seconds for h in run.prepare_hooks(vm))
                continue
            if name not in run.up:
                continue
            seen = run.up[name] & Intervals(((created, INF),))
            if not seen:
                continue
            done = seen.spans[0][0] + run.hook_queue(vm, event)
            if run.down.get(name, EMPTY) & Intervals(((created, done + run.bounds.send),)):
                continue  # the phase, or its report, may have been interrupted (reported failed, or late)
            ready[name] = done
        return ready

    def rule_allows(self, rule: Rule, at: float, *, surely: bool) -> tuple[bool, str]:
        """Whether ``rule`` approves at ``at`` (blackouts aside), and if not, what holds it."""
        run, event = self.run, self.event
        held = ""
        if at not in run.window(rule):
            held = f"rule {rule.name!r}'s window is closed"
        for gate in [] if held else rule.gates:
            if at not in run.gate_passing(gate, surely=surely):
                held = f"gate {gate!r} is not passing"
                break
        if held:
            deadline = seconds(event.notBefore) - rule.approveBeforeSeconds if event.notBefore is not None else INF
            if not (rule.onNotBefore == "approve" and at >= deadline):
                return False, held
        if rule.action == "approve-now":
            ok, why = True, ""
        elif rule.action == "approve-after-hooks":
            ok, why = self.hooks_allow(rule, at, surely=surely)
        elif rule.action == "approve-within-budget":
            ok, why = self.budget_allows(rule, at, surely=surely)
        else:
            return False, f"rule {rule.name!r} does not approve ({rule.action})"
        if ok and rule.rate is not None:
            ok, why = self.rate_allows(rule, rule.rate, at, surely=surely)
        if ok and rule.sequence is not None:
            ok, why = self.sequence_allows(rule, rule.sequence, at, surely=surely)
        return ok, why

    def _in_progress(
        self, rule: Rule, sequence: SequenceOption, at: float
    ) -> tuple[set[str], list[set[str]], list[tuple[float, set[str]]]]:
        """For ``sequence_allows``: the domains surely in progress, each maybe in progress (one set per event), and
        (concluded, domains) of the rule's approved events concluded by ``at``."""
        run = self.run
        sure: set[str] = set()
        maybe: list[set[str]] = []
        gaps: list[tuple[float, set[str]]] = []
        for other in run.truth.events:
            domains = self._keys(other, sequence.per)
            if other.eventId == self.event.eventId or not domains:
                continue
            approved = run.first_approval.get(other.eventId, INF)
            concluded = run.concluded(other)
            if approved < INF and self._same_rule(other, rule, approved):
                if approved <= at < concluded:
                    sure |= domains
                if approved - run.slack <= at < concluded + run.bounds.conclude:
                    maybe.append(domains)
                if concluded <= at:
                    gaps.append((concluded, domains))
            elif at in run.could_be_scheduled(other) and self._same_rule(other, rule, at):
                maybe.append(domains)
        return sure, maybe, gaps

    # ---- pacing: rate and sequence (docs/oracle.md, *Rate and sequence budgets*) -------------------------------
    def _same_rule(self, other: Event, rule: Rule, at: float) -> bool:
        chosen, _ = choose(self.run.policy, other, self.run.vms, at)
        return chosen is not None and chosen.name == rule.name

    def _keys(self, event: Event, per: str) -> set[str]:
        """The domains of ``per`` an event's VMs are in ('' for the fleet; a scale set counts VMs without one under
        '', the other kinds leave them out)."""
        if per == "fleet":
            return {""}
        keys = {self.run.domain(self.run.vms[n], per) for n in event.resources if n in self.run.vms}
        return keys if per == "scaleSet" else keys - {""}

    def rate_allows(self, rule: Rule, rate: RateOption, at: float, *, surely: bool) -> tuple[bool, str]:
        """Upper: fewer than the maximum of the rule's other approvals surely count at ``at`` (accepted by then,
        and decided at most ``slack`` before that, so counted until then plus the period). Lower: fewer than the
        maximum of the rule's other events were Scheduled at any time in the period before ``at`` (give or take the
        slack): each may hold a claim, accepted or not."""
        run, period = self.run, float(rate.periodSeconds)
        for key in sorted(self._keys(self.event, rate.per)):
            count = 0
            for other in run.truth.events:
                if other.eventId == self.event.eventId or key not in self._keys(other, rate.per):
                    continue
                if not surely:
                    approved = run.first_approval.get(other.eventId, INF)
                    counts = approved <= at < approved - run.slack + period and self._same_rule(other, rule, approved)
                else:
                    recent = run.could_be_scheduled(other) & Intervals(((at - period - run.slack, at + run.slack),))
                    counts = bool(recent) and self._same_rule(other, rule, at)
                count += counts
            if count >= rate.maxApprovals:
                return False, f"rate of {rule.name!r} {key or 'fleet'}: {count} approvals (at most {rate.maxApprovals})"
        return True, ""

    def sequence_allows(self, rule: Rule, sequence: SequenceOption, at: float, *, surely: bool) -> tuple[bool, str]:
        """One domain at a time. In progress surely: the domains of the rule's other approved events from their
        acceptance to their conclusion in IMDS; maybe: from ``slack`` before the acceptance to ``conclude`` after
        the conclusion (the coordinator learns it late), and every other Scheduled event of the rule (it may be
        approved first). Upper (surely held): something surely in progress and no maybe-in-progress set covers the
        event's domains; or nothing surely in progress and a gap surely running after a domain that does not cover
        them. Lower (surely allowed): every domain of the event surely in progress; or each maybe (and each gap that
        may run) covering the event's domains."""
        mine = self._keys(self.event, sequence.per)
        if not mine:
            return True, ""
        gap, conclude = float(sequence.gapSeconds), self.run.bounds.conclude
        sure, maybe, gaps = self._in_progress(rule, sequence, at)
        held = ""
        if not surely:
            running = [d for c, d in gaps if c <= at < c + gap]
            if sure and not mine <= set().union(*maybe):
                held = f"{', '.join(sorted(sure))} in progress"
            elif not sure and running and not any(mine <= d for _, d in gaps):
                held = f"the gap after {', '.join(sorted(running[0]))}"
        elif not mine <= sure:
            blocking = [d for d in maybe if not mine <= d]
            blocking += [d for c, d in gaps if at < c + conclude + gap and not mine <= d]
            held = f"{', '.join(sorted(blocking[0]))} may be in progress" if blocking else ""
        return not held, f"sequence of {rule.name!r}: {held}" if held else ""

    def hooks_allow(self, rule: Rule, at: float, *, surely: bool) -> tuple[bool, str]:
        run, event = self.run, self.event
        options = rule.hooks or HooksOption()  # the schema's defaults are the documented ones
        created = seconds(event.transitions[0].at)
        first_sighting = self.reported if surely else created
        if options.onDeadline == "approve" and at >= first_sighting + options.deadlineSeconds:
            return True, ""
        ready = self.hooks_ready(surely=surely)
        waiting = []
        for name in event.resources:
            vm = run.vms.get(name)
            outcome = run.hook_outcome(vm) if vm is not None else "unknown"
            if outcome == "not-run" and options.noHooks == "ready":
                if surely and at < self.reported:
                    waiting.append(f"{name} not reported yet")
                continue
            if outcome != "succeeded":
                waiting.append(f"{name}'s prepare phase {outcome}")
            elif name not in ready or at < ready[name]:
                waiting.append(f"{name}'s hooks not done")
        if waiting:
            return False, "hooks: " + ", ".join(waiting)
        return True, ""

    def budget_allows(self, rule: Rule, at: float, *, surely: bool) -> tuple[bool, str]:
        run, event = self.run, self.event
        budget = rule.budget
        assert budget is not None  # validated with the action
        mine = [run.vms[n] for n in event.resources if n in run.vms]
        for kind in budget.per:
            keys = {run.domain(vm, kind) for vm in mine}
            for key in sorted(keys):
                if not key and kind != "scaleSet":
                    continue
                members = {vm.name for vm in mine if run.domain(vm, kind) == key}
                others = self.impacted(kind, key, at, surely=surely) - members
                size = self.size(kind, key, at, surely=surely) | members
                limit = _limit(budget.maxImpacted, budget.maxPercent, len(size))
                if len(others | members) > limit:
                    return False, f"budget {kind} {key!r}: {len(others | members)} impacted (limit {limit})"
        return True, ""

    def impacted(self, kind: str, key: str, at: float, *, surely: bool) -> set[str]:
        """Other events' VMs in the domain: upper set (surely=False: what surely holds a slot, so that the budget
        is surely exceeded when it says so) or lower set (surely=True: everything that may hold one, and every other
        Scheduled event that may compete for it)."""
        run, event = self.run, self.event
        if kind == "scaleSet" and not key:
            return set()
        taken: set[str] = set()
        for other in run.truth.events:
            if other.eventId == event.eventId:
                continue
            names = {n for n in other.resources if n in run.vms and run.domain(run.vms[n], kind) == key}
            if not names:
                continue
            approved = run.first_approval.get(other.eventId, INF)
            concluded = run.concluded(other)
            if not surely:
                # Its decision came before ``at`` (it was accepted by then, and decided before that), and the
                # coordinator cannot have concluded it (IMDS had not).
                if approved <= at < concluded:
                    taken |= names
                continue
            lag = run.bounds.conclude + (
                run.truth.options.retireGraceSeconds if other.eventType in ("Terminate", "Preempt") else 0.0
            )
            lag += self._returning(other, at)
            holds = (approved <= at + run.slack or run.started_at(other) <= at) and concluded + lag > at
            competes = at in run.scheduled(other) and self._ahead(other) and self._may_approve(other, at)
            if holds or competes:
                taken |= names
        return taken

    def _returning(self, other: Event, at: float) -> float:
        """How long after ``other`` concluded its VMs may still count impacted: its rule's ``returnToService`` keeps
        them until they are back in service (recover hooks done, gates passing), at most its bound and the watch's
        limit after it; the oracle does not read readiness, so it allows the whole of that."""
        if other.eventType not in RETURNING_TYPES:
            return 0.0
        rule, _ = choose(self.run.policy, other, self.run.vms, at)
        back = rule.returnToService if rule is not None else None
        return 0.0 if back is None else back.withinSeconds + RETURN_WATCH_LIMIT.total_seconds()

    def _ahead(self, other: Event) -> bool:
        """Whether ``other`` comes first for a budget slot: closer to its NotBefore (then by EventId)."""

        def order(event: Event) -> tuple[float, str]:
            return (seconds(event.notBefore) if event.notBefore is not None else INF, event.eventId)

        return order(other) < order(self.event)

    def _may_approve(self, other: Event, at: float) -> bool:
        rule, _ = choose(self.run.policy, other, self.run.vms, at)
        if rule is None:
            return False
        return rule.action not in ("wait-for-person", "never-approve") or ladder_approves(rule)

    def size(self, kind: str, key: str, at: float, *, surely: bool) -> set[str]:
        """The domain's VMs the coordinator counts (known, not retired): upper set (surely=False) the most it may
        count, every VM until its retirement surely happened; lower set only VMs that reported and are not removed."""
        run = self.run
        retire = run.truth.options.retireGraceSeconds + run.bounds.conclude
        found = set()
        for vm in run.truth.vms:
            if run.domain(vm, kind) != key:
                continue
            removed = run.removal(vm.name)
            if surely:
                if vm.agentless or vm.name not in run.up or not (run.up[vm.name] & Intervals(((-INF, at),))):
                    continue
                if removed <= at:
                    continue
            elif removed + retire <= at:
                continue
            found.add(vm.name)
        return found

    def allows(self, at: float, *, surely: bool) -> tuple[bool, str]:
        run = self.run
        if run.policy.dryRun:
            return False, "the policy is in dry run"
        if at in run.blackouts:
            return False, "a blackout is open"
        rule, why = choose(run.policy, self.event, run.vms, at)
        if rule is None:
            return False, why
        ok, held = self.rule_allows(rule, at, surely=surely)
        ladder = ladder_approval(rule, self.event, surely=surely)
        if not ok and at in ladder:
            return True, ""  # its escalation ladder approves anyway
        if not ok and ladder:
            lo, hi = ladder.spans[0]
            held += f" (its escalation ladder approves only from +{lo - run.start:.1f}s to +{hi - run.start:.1f}s)"
        return ok, "" if ok else f"{why}: {held}"

    def _allowed_within(self, span: Intervals, *, surely: bool) -> Intervals:
        """The moments of ``span`` at which the policy allows the event (``surely``, or may), over the run and an hour
        either side."""
        run = self.run
        allowed = Intervals.where(
            self.breakpoints, run.start - 3600, run.end + 3600, lambda t: self.allows(t, surely=surely)[0]
        )
        return allowed & span

    @cached_property
    def upper(self) -> Intervals:
        return self._allowed_within(self.run.scheduled(self.event), surely=False)

    @cached_property
    def own_lower(self) -> Intervals:
        return self._allowed_within(self.run.could_be_scheduled(self.event), surely=True)
