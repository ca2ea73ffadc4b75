"""The oracle's verdict on one run (pure): for every event, when the policy allows an approval and by when one is due;
then every accepted StartRequests judged against that, and every document a forwarder read looked up in the history.

**Allowed.** At a decision time d the policy allows approving event e when e is Scheduled in IMDS, no blackout is
open, and the rule that decides e at d (``oracle.rules.choose``) approves: ``approve-now`` inside its window with its
gates passing; ``approve-after-hooks`` once every affected VM's prepare phase succeeded (or its deadline passed with
``onDeadline: approve``); ``approve-within-budget`` while its domains have room; in each case a window or gate hold is
lifted ``approveBeforeSeconds`` before NotBefore with ``onNotBefore: approve``. A StartRequests accepted at t is right
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

**Due.** An approval is due once the event has been, for ``latency`` seconds without interruption (plus the slowest
delay every executor's listener or the rule's gate adds), surely allowed, reported by a VM whose forwarder runs,
executable by a VM whose forwarder runs and whose listener answers, and free of every fault above. A due approval
not accepted while the event was Scheduled is MISSED; one accepted after the due time is LATE. What is no excuse: a
slow or dead listener, or a stopped forwarder, when another VM that sees the event could execute it; another VM's
slow listener, gate or oversized envelope; a VM's clock skew (freshness is for the service's clock to judge).

**Lost.** Every document content a forwarder read whole from IMDS (the emulator records it) that listed an event, or
dropped one the forwarder's previous read listed, and that lasted at least a poll and a half (a shorter one may have
been read only by the VM's listener, which reads the document before it approves), must have an Observation row of
that VM at that DocumentIncarnation, unless the forwarder died for good or its state was wiped before it could send
it (within ``send`` seconds, longer across an Event Hubs outage), or it was killed right after the read (the read
may never have reached its spool).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction
from functools import cached_property
from typing import Literal

from coordinator.domain.policy import HooksOption, Policy, RateOption, Rule, SequenceOption
from coordinator.domain.policy_file import parse_policy
from oracle.calendar import cron_periods
from oracle.intervals import EMPTY, Intervals, seconds
from oracle.rules import choose, match_breakpoints
from oracle.truth import MAY_DELAY, Approval, Event, Hook, Incarnation, Span, Truth, Vm

__all__ = ["Bounds", "EventVerdict", "Finding", "FindingKind", "Report", "check"]

FindingKind = Literal["wrong", "missed", "duplicate", "late", "lost"]
KINDS: tuple[FindingKind, ...] = ("wrong", "missed", "duplicate", "late", "lost")
INF = math.inf


@dataclass(frozen=True)
class Bounds:
    """The pipeline's timing as the oracle grants it (real seconds)."""

    latency: float = 5.0  # from surely allowed and reportable to StartRequests accepted: poll, hub, decide, relay
    slack: float = 3.0  # from a decision to its StartRequests accepted, when nothing slows the delivery
    # After an outage or stall of L seconds: clients retrying with doubling backoff try again within about 2 L, then
    # reconnect (``recover``); an approval that failed meanwhile is retried by the timer (``retry``: its first
    # backoff, coordinator/domain/retry.py).
    recover: float = 5.0
    retry: float = 10.0
    boot: float = 4.0  # a forwarder restarted: until it has read IMDS and its listener can take a request
    conclude: float = 10.0  # IMDS concluded an event: until the coordinator surely knows
    send: float = 3.0  # a document read: until its envelope is surely in the hub (outside outages)


@dataclass(frozen=True)
class Finding:
    kind: FindingKind
    event_id: str
    label: str
    detail: str

    def line(self) -> str:
        return f"{self.kind.upper():<9} {self.label:<24} {self.detail}"


@dataclass
class EventVerdict:
    event: Event
    label: str
    rule: str
    upper: Intervals
    lower: Intervals
    due: float | None
    approvals: list[Approval]

    @property
    def outcome(self) -> str:
        if self.approvals:
            return "approved"
        return "due" if self.due is not None else "either/none"


@dataclass
class Report:
    findings: list[Finding]
    verdicts: list[EventVerdict]
    checked_incarnations: int
    start: float = 0.0

    def counts(self) -> dict[str, int]:
        counted = Counter(finding.kind for finding in self.findings)
        return {kind: counted.get(kind, 0) for kind in KINDS}

    @property
    def ok(self) -> bool:
        return not self.findings

    def _explain(self, verdict: EventVerdict) -> list[str]:
        def spans(intervals: Intervals) -> str:
            shown = [f"[{lo - self.start:+.1f}, {hi - self.start:+.1f})" for lo, hi in intervals.spans]
            return " ".join(shown).replace("inf", "end") or "none"

        event = verdict.event
        not_before = f"{seconds(event.notBefore) - self.start:+.1f}s" if event.notBefore is not None else "-"
        states = ", ".join(f"{t.state} {seconds(t.at) - self.start:+.1f}s ({t.reason})" for t in event.transitions)
        return [
            f"{event.eventId} {event.eventSource} {event.durationInSeconds}s on {', '.join(event.resources)}; "
            f"seen by {', '.join(event.viewers)}; NotBefore {not_before}",
            f"states: {states}",
            f"allowed (upper, judges wrong): {spans(verdict.upper)}",
            f"surely allowed and deliverable (lower, decides due): {spans(verdict.lower)}",
        ]

    def lines(self, *, explain: bool = False) -> list[str]:
        """The events (with ``explain``: each one's facts, allowed sets and states), the counts, the findings."""
        out = [f"{'event':<24}{'type':<10}{'rule':<34}{'outcome':<12}due      approvals"]
        for v in self.verdicts:
            due = f"+{v.due - self.start:6.1f}s" if v.due is not None else "   -    "
            made = ", ".join(f"+{seconds(a.at) - self.start:.1f}s {a.vm}/{a.via}" for a in v.approvals) or "-"
            out.append(f"{v.label:<24}{v.event.eventType:<10}{v.rule[:33]:<34}{v.outcome:<12}{due} {made}")
            if explain:
                out.extend(f"    {line}" for line in self._explain(v))
        counts = self.counts()
        out.append(
            "oracle: "
            + ", ".join(f"{kind} {counts[kind]}" for kind in KINDS)
            + f" ({len(self.verdicts)} events, {self.checked_incarnations} incarnations read by forwarders)"
        )
        out.extend(f"  {finding.line()}" for finding in self.findings)
        return out


def _spans(spans: Iterable[Span], end: float) -> Intervals:
    return Intervals.of((seconds(s.begin), seconds(s.end) if s.end is not None else end) for s in spans)


def _limit(max_impacted: int | None, max_percent: Decimal | float | None, size: int) -> int:
    """The documented limit in exact arithmetic: at most N, or ceil(size x P / 100), the smaller, never below 1."""
    limits = [] if max_impacted is None else [max_impacted]
    if max_percent is not None:
        limits.append(max(1, math.ceil(Fraction(size) * Fraction(str(max_percent)) / 100)))
    return max(1, min(limits))


@dataclass
class _Run:
    """The truth turned into the sets the judgement reads."""

    truth: Truth
    bounds: Bounds
    policy: Policy = field(init=False)

    _gates: dict[tuple[str, bool], Intervals] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.policy = parse_policy(self.truth.policy, source="truth.policy")

    # ---- time and the run ------------------------------------------------------------------------------------
    @cached_property
    def start(self) -> float:
        return seconds(self.truth.started)

    @cached_property
    def end(self) -> float:
        return seconds(self.truth.ended)

    @cached_property
    def vms(self) -> dict[str, Vm]:
        return {vm.name: vm for vm in self.truth.vms}

    @cached_property
    def events(self) -> dict[str, Event]:
        """Every event by every id it had (current and former: the mock server's mode renames it as it starts)."""
        found = {}
        for event in self.truth.events:
            for event_id in (event.eventId, *event.formerIds):
                found[event_id.upper()] = event
        return found

    def label(self, event: Event) -> str:
        return event.ref or event.eventId[:8]

    def scheduled(self, event: Event) -> Intervals:
        """While IMDS showed the event Scheduled."""
        first = event.transitions[0]
        if first.state != "Scheduled":
            return EMPTY
        left = next((seconds(t.at) for t in event.transitions[1:]), self.end)
        return Intervals(((seconds(first.at), left),))

    def could_be_scheduled(self, event: Event) -> Intervals:
        """While the event would have stayed Scheduled without an approval: until NotBefore when an approval
        started it, else as long as it did (an approval must not shorten the time it was due in)."""
        span = self.scheduled(event)
        started = next((t for t in event.transitions if t.state == "Started"), None)
        if not span or started is None or started.reason != "approval" or event.notBefore is None:
            return span
        return Intervals(((span.spans[0][0], max(span.spans[0][1], seconds(event.notBefore))),))

    def left_scheduled(self, event: Event) -> float:
        spans = self.scheduled(event).spans
        return spans[-1][1] if spans else seconds(event.transitions[0].at)

    def concluded(self, event: Event) -> float:
        return next((seconds(t.at) for t in event.transitions if t.state in ("Completed", "Canceled")), INF)

    def started_at(self, event: Event) -> float:
        return next((seconds(t.at) for t in event.transitions if t.state == "Started"), INF)

    # ---- the platform ----------------------------------------------------------------------------------------
    @cached_property
    def up(self) -> dict[str, Intervals]:
        """Per VM with a forwarder: when it could take part: running, ``boot`` seconds after each start (the first
        start: from its first read of IMDS, if that came sooner)."""
        first_read: dict[str, float] = {}
        for inc in self.truth.incarnations:
            if inc.firstServed is not None:
                first_read[inc.vm] = min(first_read.get(inc.vm, INF), seconds(inc.firstServed))
        result = {}
        for name, runs in self.truth.forwarderRuns.items():
            spans = []
            for index, span in enumerate(runs):
                begin = seconds(span.begin) + self.bounds.boot
                if index == 0:
                    begin = min(begin, first_read.get(name, INF))
                spans.append((begin, seconds(span.end) if span.end is not None else self.end))
            result[name] = Intervals.of(spans)
        return result

    @cached_property
    def down(self) -> dict[str, Intervals]:
        """Per VM with a forwarder: when it was not running (killed, stopped, not yet started)."""
        return {
            name: Intervals(((self.start - 3600, self.end + 3600),)) - _spans(runs, self.end)
            for name, runs in self.truth.forwarderRuns.items()
        }

    def outages(self, *services: str) -> Intervals:
        return _spans((o.span for o in self.truth.outages if o.service in services), self.end)

    @cached_property
    def dead(self) -> dict[str, Intervals]:
        found: dict[str, list[Span]] = {}
        for fault in self.truth.listenerFaults:
            if fault.dead:
                found.setdefault(fault.vm, []).append(fault.span)
        return {vm: _spans(spans, self.end) for vm, spans in found.items()}

    def listener_delay(self, vm: str) -> float:
        return max((f.delaySeconds for f in self.truth.listenerFaults if f.vm == vm and not f.dead), default=0.0)

    @cached_property
    def slack(self) -> float:
        """The longest a decision may take to reach IMDS in this run: the base, plus the slowest listener, gate and
        storage stall (a decision read a gate, waited for storage, then the listener)."""
        listener = max((f.delaySeconds for f in self.truth.listenerFaults), default=0.0)
        gate = max((g.delaySeconds for g in self.truth.gates), default=0.0)
        stalls = [hi - lo for lo, hi in self.outages("storage").spans]
        # The Relay sender waits out an outage (no listener) within the approval's deadline, then delivers.
        relay = [hi - lo + self.bounds.recover for lo, hi in self.outages("relay").spans]
        return self.bounds.slack + listener + gate + max(stalls, default=0.0) + max(relay, default=0.0)

    def removal(self, vm: str) -> float:
        removed = self.truth.removals.get(vm)
        return seconds(removed) if removed is not None else INF

    # ---- hooks -----------------------------------------------------------------------------------------------
    def prepare_hooks(self, vm: Vm) -> list[Hook]:
        if vm.prepare is not None:
            return vm.prepare
        return [Hook(name="10-drain", exitCode=0)] if self.truth.options.defaultPrepareHook else []

    def hook_outcome(self, vm: Vm) -> str:
        hooks = self.prepare_hooks(vm)
        if not hooks:
            return "not-run"
        timeout = self.truth.options.hookTimeoutSeconds
        return "succeeded" if all(h.exitCode == 0 and h.seconds < timeout for h in hooks) else "failed"

    def hook_queue(self, vm: Vm, event: Event) -> float:
        """How long the VM's hook worker may be busy before this event's prepare phase ends: every prepare phase of
        the events naming it scheduled so far (the worker runs one phase at a time), each hook capped by the
        timeout."""
        timeout = self.truth.options.hookTimeoutSeconds
        mine = seconds(event.transitions[0].at)
        earlier = [e for e in self.truth.events if vm.name in e.resources and seconds(e.transitions[0].at) <= mine]
        return len(earlier) * sum(min(h.seconds, timeout) for h in self.prepare_hooks(vm))

    # ---- gates -----------------------------------------------------------------------------------------------
    def gate_passing(self, name: str, *, surely: bool) -> Intervals:
        key = (name, surely)
        if key not in self._gates:
            self._gates[key] = self._gate_passing(name, surely=surely)
        return self._gates[key]

    def _gate_passing(self, name: str, *, surely: bool) -> Intervals:
        """When the gate passed: ``surely`` (lower set) only a page that answered 200 in time, else (upper set) any
        answer the coordinator might have read as passing; a gate the local server does not serve is unknown."""
        gate = self.policy.gates.get(name)
        changes = sorted((g for g in self.truth.gates if g.name == name), key=lambda g: g.at)
        if gate is None or gate.http is None or not changes:
            return EMPTY if surely else Intervals(((self.start - 3600, self.end + 3600),))
        timeout = gate.http.timeoutSeconds
        spans = []
        bounds = [seconds(g.at) for g in changes[1:]] + [self.end + 3600]
        for change, until in zip(changes, bounds, strict=True):
            if change.state == "passing":
                passes = True
            elif change.state == "slow":
                passes = change.delaySeconds < timeout / 2 if surely else change.delaySeconds < timeout * 1.5
            elif change.state == "trickle":
                passes = not surely
            else:
                passes = False
            if passes:
                spans.append((seconds(change.at), until))
        return Intervals.of(spans)

    def gate_delay(self, names: list[str]) -> float:
        return max((g.delaySeconds for g in self.truth.gates if g.name in names and g.state == "slow"), default=0.0)

    # ---- periods ---------------------------------------------------------------------------------------------
    @cached_property
    def blackouts(self) -> Intervals:
        out = EMPTY
        for blackout in self.policy.blackouts:
            out = out | cron_periods(
                blackout.schedule, blackout.duration, blackout.timeZone, self.start - 3600, self.end + 3600
            )
        return out

    def window(self, rule: Rule) -> Intervals:
        if rule.window is None:
            return Intervals(((self.start - 3600, self.end + 3600),))
        w = rule.window
        return cron_periods(w.schedule, w.duration, w.timeZone, self.start - 3600, self.end + 3600)

    # ---- who can report and execute --------------------------------------------------------------------------
    def reported(self, event: Event) -> float:
        """The earliest the coordinator can surely know the event: a VM that sees it has a running forwarder (an
        agentless VM's event comes through Event Grid)."""
        created = seconds(event.transitions[0].at)
        times = []
        for name in event.viewers:
            vm = self.vms.get(name)
            if vm is not None and vm.agentless:
                times.append(created + 1.0)
            elif name in self.up:
                after = self.up[name] & Intervals(((created, INF),))
                if after:
                    times.append(after.spans[0][0])
        return min(times, default=INF)

    def candidates(self, event: Event) -> list[str]:
        """The VMs whose listener may execute the approval: a Terminate's own VM only, else any VM that sees it."""
        return list(event.resources) if event.eventType == "Terminate" else list(event.viewers)

    def executable(self, event: Event) -> list[tuple[Intervals, float]]:
        """When each VM that may execute the approval can (forwarder up, listener not dead, not removed; or the
        acknowledge API for an agentless VM), each with the delay its listener adds. Kept per VM: a slow listener
        delays an approval only while no quicker VM could execute it, and a quick one that died no longer can (seed
        114: web_1's listener died 0.5 s after the Freeze appeared, and web_0's, 25 s slow, was left: judged by
        web_1's delay, the Freeze was due 25 s too early)."""
        out: list[tuple[Intervals, float]] = []
        for name in self.candidates(event):
            vm = self.vms.get(name)
            if vm is not None and vm.agentless:
                if self.truth.options.remoteAcknowledgeFallback:
                    out.append((Intervals(((self.start - 3600, self.removal(name)),)), 0.0))
                continue
            if name not in self.up:
                continue
            up = self.up[name]
            if self.removed_by(event, name) and up:
                # Removed by this very event once it started: its own approval is what removed it.
                up = up | Intervals(((up.spans[-1][0], INF),))
            else:
                up = up - Intervals(((self.removal(name), INF),))
            usable = up - self.dead.get(name, EMPTY)
            if usable:
                out.append((usable, self.listener_delay(name)))
        return out

    @staticmethod
    def removed_by(event: Event, name: str) -> bool:
        return event.eventType in ("Terminate", "Preempt") and name in event.resources

    def relayed(self, event: Event) -> bool:
        return any(not (self.vms.get(n) and self.vms[n].agentless) for n in self.candidates(event))

    # ---- domains ---------------------------------------------------------------------------------------------
    @staticmethod
    def domain(vm: Vm, kind: str) -> str:
        if kind == "scaleSet":
            return vm.scaleSet
        if kind == "placementGroup":
            return vm.placementGroup
        if kind == "zone":
            return f"{vm.location}/{vm.zone}" if vm.zone else ""
        number = vm.faultDomain if kind == "faultDomain" else vm.updateDomain
        owner = vm.scaleSet or vm.placementGroup
        return f"{owner}/{number}" if owner and number else ""

    @cached_property
    def first_approval(self) -> dict[str, float]:
        first: dict[str, float] = {}
        for approval in self.truth.approvals:
            event = self.events.get(approval.eventId.upper())
            if event is not None:
                first[event.eventId] = min(first.get(event.eventId, INF), seconds(approval.at))
        return first


@dataclass
class _Judge:
    """The allowed sets of one event."""

    run: _Run
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
            holds = (approved <= at + run.slack or run.started_at(other) <= at) and concluded + lag > at
            competes = at in run.scheduled(other) and self._ahead(other) and self._may_approve(other, at)
            if holds or competes:
                taken |= names
        return taken

    def _ahead(self, other: Event) -> bool:
        """Whether ``other`` comes first for a budget slot: closer to its NotBefore (then by EventId)."""

        def order(event: Event) -> tuple[float, str]:
            return (seconds(event.notBefore) if event.notBefore is not None else INF, event.eventId)

        return order(other) < order(self.event)

    def _may_approve(self, other: Event, at: float) -> bool:
        rule, _ = choose(self.run.policy, other, self.run.vms, at)
        return rule is not None and rule.action not in ("wait-for-person", "never-approve")

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
        return ok, "" if ok else f"{why}: {held}"

    @cached_property
    def upper(self) -> Intervals:
        run = self.run
        span = run.scheduled(self.event)
        return (
            Intervals.where(
                self.breakpoints, run.start - 3600, run.end + 3600, lambda t: self.allows(t, surely=False)[0]
            )
            & span
        )

    @cached_property
    def own_lower(self) -> Intervals:
        run = self.run
        span = run.could_be_scheduled(self.event)
        return (
            Intervals.where(
                self.breakpoints, run.start - 3600, run.end + 3600, lambda t: self.allows(t, surely=True)[0]
            )
            & span
        )


def _coupled(run: _Run, judges: dict[str, _Judge], event: Event) -> Intervals:
    """A Terminate is surely allowed only while every other Scheduled Terminate of its scale set surely is too (the
    coordinator approves a scale set's pending deletes together)."""
    own = judges[event.eventId].own_lower
    if event.eventType != "Terminate":
        return own
    sets = {run.vms[n].scaleSet for n in event.resources if n in run.vms}
    for other in run.truth.events:
        if other.eventId == event.eventId or other.eventType != "Terminate":
            continue
        if not sets & {run.vms[n].scaleSet for n in other.resources if n in run.vms}:
            continue
        pending = run.scheduled(other)
        own = own - (pending - judges[other.eventId].own_lower)
    return own


def _impediments(run: _Run, event: Event) -> Intervals:
    """What keeps the pipeline from approving this event, through no fault of the coordinator's design: outages
    and stalls (with their recovery), and forged envelopes about the event (which may make it wait)."""
    blocked = EMPTY
    for outage in run.truth.outages:
        if outage.service == "relay" and not run.relayed(event):
            continue
        begin = seconds(outage.span.begin)
        end = seconds(outage.span.end) if outage.span.end is not None else run.end
        after = run.bounds.recover + 2 * (end - begin) + (run.bounds.retry if outage.service == "relay" else 0.0)
        blocked = blocked | Intervals(((begin, end + after),))
    for forgery in run.truth.forgeries:
        # Only the lies that may make the coordinator wait (truth.MAY_DELAY) excuse a delay.
        if forgery.kind in MAY_DELAY and (forgery.about in event.resources or event.eventId in forgery.events):
            blocked = blocked | Intervals(((seconds(forgery.at), INF),))
    return blocked


def _approval_findings(run: _Run, judges: dict[str, _Judge]) -> list[Finding]:
    findings = []
    by_event: dict[str, list[Approval]] = {}
    for approval in sorted(run.truth.approvals, key=lambda a: a.at):
        event = run.events.get(approval.eventId.upper())
        at = seconds(approval.at)
        if event is None:
            findings.append(Finding("wrong", approval.eventId, approval.eventId[:8], "approval of an unknown event"))
            continue
        by_event.setdefault(event.eventId, []).append(approval)
        judge = judges[event.eventId]
        window = Intervals(((at - run.slack, at + 1e-6),))
        if judge.upper & window:
            continue
        ok, why = judge.allows(at, surely=False)
        if ok and at not in run.scheduled(event):
            left = run.left_scheduled(event) - run.start
            why = f"the event was {approval.statusBefore} (it left Scheduled at +{left:.1f}s)"
        distance = judge.upper.distance(at)
        outside = f"; nearest allowed instant {distance:.1f} s away" if distance != INF else "; never allowed"
        outside += _history_note(run, event, at)
        findings.append(
            Finding(
                "wrong",
                event.eventId,
                run.label(event),
                f"StartRequests through {approval.vm} ({approval.via}) at +{at - run.start:.1f}s: {why}{outside}",
            )
        )
    for event_id, approvals in by_event.items():
        for extra in approvals[1:]:
            event = run.events[event_id.upper()]
            first = approvals[0]
            findings.append(
                Finding(
                    "duplicate",
                    event_id,
                    run.label(event),
                    f"StartRequests through {extra.vm} ({extra.via}) at +{seconds(extra.at) - run.start:.1f}s after "
                    f"one through {first.vm} ({first.via}) at +{seconds(first.at) - run.start:.1f}s",
                )
            )
    return findings


def _history_note(run: _Run, event: Event, at: float) -> str:
    """What the coordinator's history says of this approval: when it decided to approve, how often it sent it."""
    ids = {event.eventId.upper(), *(former.upper() for former in event.formerIds)}
    steps = [step for step in run.truth.history if step.eventId.upper() in ids and seconds(step.at) <= at + 1.0]
    decided = [step for step in steps if step.kind == "Decision" and step.outcome == "approve"]
    sent = [step for step in steps if step.kind == "Approval" and step.outcome == "sending"]
    if not decided:
        return ""
    note = f"; history: decided approve at +{seconds(decided[-1].at) - run.start:.1f}s"
    if len(sent) > 1:
        note += f", sent {len(sent)} times (last: {sent[-1].reason[:80]})"
    return note


def _incarnation_findings(run: _Run) -> tuple[list[Finding], int]:
    rows = {(o.vm, o.incarnation, o.eventId.upper(), o.status) for o in run.truth.observations}
    findings = []
    checked = 0
    # When each content gave way to the next (a removed VM's last one lasts until its removal).
    ends: dict[tuple[str, int], float] = {}
    for inc in run.truth.incarnations:
        ends[(inc.vm, inc.serial - 1)] = seconds(inc.at)
    shortest = 1.5 * run.truth.options.pollInterval
    # Per VM, what the poll loop last read: an event is gone for the forwarder when the document it last read listed
    # it and this one does not (not when IMDS's previous content did: the forwarder may never have read that one).
    read_before: dict[str, tuple[float, set[str]]] = {}
    for inc in sorted(run.truth.incarnations, key=lambda i: (i.vm, i.serial)):
        vm = run.vms.get(inc.vm)
        if vm is None or vm.agentless or inc.firstServed is None:
            continue
        lasted = min(ends.get((inc.vm, inc.serial), run.end), run.removal(inc.vm)) - seconds(inc.at)
        if lasted < shortest:
            # Shorter than a poll and a half: the read may have been the listener's (it reads the document before
            # it approves, and the approval ends this content), not the poll loop's, which sends what it reads.
            continue
        served = seconds(inc.firstServed)
        listed_ids = {event_id.upper() for event_id, _ in inc.listed}
        before_at, before = read_before.get(inc.vm, (-INF, set()))
        if any(before_at < seconds(wipe) <= served for wipe in run.truth.wipes.get(inc.vm, [])):
            before = set()  # a wiped forwarder starts with no document
        read_before[inc.vm] = (served, listed_ids)
        gone = sorted(before - listed_ids)
        if (inc.listed or gone) and _must_reach_history(run, inc, served):
            checked += 1
            wanted = {(inc.vm, inc.incarnation, event_id.upper(), status) for event_id, status in inc.listed}
            wanted |= {(inc.vm, inc.incarnation, event_id, "Gone") for event_id in gone}
            if not wanted & rows:
                findings.append(_lost(run, inc, served, gone))
    return findings, checked


def _must_reach_history(run: _Run, inc: Incarnation, served: float) -> bool:
    """Whether a document the forwarder read must have reached the history: not when the forwarder died for good or
    lost its state before its envelope surely reached the hub (the send bound, stretched across an outage it met),
    nor when it was killed right after the read and never read that content again (the read may not have reached
    its spool, and what it read after its restart was another content)."""
    until = served + run.bounds.send
    for lo, hi in run.outages("eventhubs").spans:
        if lo <= until and hi >= served:
            until = max(until, hi + 2 * (hi - lo) + run.bounds.recover)
    ended = [seconds(t) for t in run.truth.permanentKills.get(inc.vm, []) + run.truth.wipes.get(inc.vm, [])]
    if any(served <= end <= until for end in ended):
        return False
    last = seconds(inc.lastServed or inc.firstServed or inc.at)
    kills = [seconds(k) for k in run.truth.kills.get(inc.vm, [])]
    return not any(served < kill <= served + 1.0 and last <= kill for kill in kills)


def _lost(run: _Run, inc: Incarnation, served: float, gone: list[str]) -> Finding:
    listed = ", ".join(f"{e[:8]} {s}" for e, s in inc.listed) or "nothing"
    left = f"; gone {', '.join(e[:8] for e in gone)}" if gone else ""
    return Finding(
        "lost",
        inc.listed[0][0] if inc.listed else gone[0],
        inc.vm,
        f"incarnation {inc.incarnation} (read at +{served - run.start:.1f}s: lists {listed}{left}) has no "
        "Observation row",
    )


def check(truth: Truth, bounds: Bounds | None = None) -> Report:
    run = _Run(truth, bounds or Bounds())
    judges = {event.eventId: _Judge(run, event) for event in truth.events}
    verdicts = []
    findings: list[Finding] = []
    for event in truth.events:
        judge = judges[event.eventId]
        created = seconds(event.transitions[0].at)
        rule, why = choose(run.policy, event, run.vms, created)
        gates = run.policy.gates_of(rule.name) if rule is not None else []
        allowed = (_coupled(run, judges, event) & Intervals(((judge.reported, INF),))) - _impediments(run, event)
        lower, due = EMPTY, None
        for usable, delay in run.executable(event):
            # Due through one VM that stays usable for the whole latency its listener (and the rule's gate) adds.
            through = allowed & usable
            lower = lower | through
            first = through.first_run(run.bounds.latency + delay + run.gate_delay(gates))
            if first is not None and (due is None or first < due):
                due = first
        left = run.left_scheduled(event)
        could = run.could_be_scheduled(event)
        if due is not None and (not could or due >= could.spans[-1][1]):
            due = None
        approvals = [a for a in truth.approvals if run.events.get(a.eventId.upper()) is event]
        verdict = EventVerdict(event, run.label(event), why, judge.upper, lower, due, approvals)
        verdicts.append(verdict)
        if due is None:
            continue
        in_time = [a for a in approvals if seconds(a.at) <= left]
        if not in_time:
            missing = f"due at +{due - run.start:.1f}s (allowed from +{lower.spans[0][0] - run.start:.1f}s)"
            findings.append(
                Finding(
                    "missed",
                    event.eventId,
                    run.label(event),
                    f"{why}: {missing}, none made before it left Scheduled at +{left - run.start:.1f}s",
                )
            )
        elif seconds(in_time[0].at) > due:
            late = seconds(in_time[0].at) - due
            findings.append(
                Finding(
                    "late",
                    event.eventId,
                    run.label(event),
                    f"{why}: due at +{due - run.start:.1f}s, made at +{seconds(in_time[0].at) - run.start:.1f}s "
                    f"({late:.1f} s late) through {in_time[0].vm}",
                )
            )
    findings.extend(_approval_findings(run, judges))
    lost, checked = _incarnation_findings(run)
    findings.extend(lost)
    order = {kind: index for index, kind in enumerate(KINDS)}
    findings.sort(key=lambda f: (order[f.kind], f.label))
    return Report(findings, verdicts, checked, start=run.start)
