"""The truth of one run turned into the sets the oracle's judgement reads (pure): while each event was Scheduled,
when each forwarder could take part and each listener answered, the outages, the hooks' outcomes, the gates' passing,
the blackouts and windows, who could report and who execute each event, and the budget domains of each VM."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property

from coordinator import Policy, Rule, parse_policy
from oracle.calendar import cron_periods
from oracle.intervals import EMPTY, Intervals, seconds
from oracle.truth import MAY_DELAY, Event, Hook, Span, Truth, Vm
from oracle.verdict import Bounds

__all__ = ["INF", "Facts"]

INF = math.inf


def _spans(spans: Iterable[Span], end: float) -> Intervals:
    return Intervals.of((seconds(s.begin), seconds(s.end) if s.end is not None else end) for s in spans)


@dataclass
class Facts:
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

    def paused(self, vm: str) -> Intervals:
        """When the VM's forwarder was stopped between two runs (a Freeze's or a fault's SIGSTOP, a reboot), not
        killed: a request its listener was sent then waits in the process (after a kill, no listener answers)."""
        runs = self.truth.forwarderRuns.get(vm, [])
        kills = {seconds(k) for k in self.truth.kills.get(vm, [])}
        gaps = [
            (seconds(a.end), seconds(b.begin))
            for a, b in itertools.pairwise(runs)
            if a.end is not None and not any(abs(seconds(a.end) - k) < 0.5 for k in kills)
        ]
        return Intervals.of(gaps)

    def delivery_slack(self, vm: str, at: float) -> float:
        """The slack before a StartRequests accepted at ``at`` through ``vm``: ``slack`` of the forwarder's running
        time, skipping each pause just before (``paused``: a request that reached its listener then was executed
        once the process ran again; seed 31's ladder approval, sent 0.1 s before its send margin, waited 2 s for
        web_0's Freeze)."""
        begin, running = at, self.slack
        for lo, hi in reversed((self.paused(vm) & Intervals(((-INF, at),))).spans):
            if hi <= begin - running:
                break
            running -= begin - hi
            begin = lo
        return at - (begin - running)

    def impediments(self, event: Event) -> Intervals:
        """What keeps the pipeline from deciding or approving this event, through no fault of the coordinator's
        design: outages and stalls (with their recovery), and forged envelopes about the event (which may make it
        wait)."""
        blocked = EMPTY
        for outage in self.truth.outages:
            if outage.service == "relay" and not self.relayed(event):
                continue
            begin = seconds(outage.span.begin)
            end = seconds(outage.span.end) if outage.span.end is not None else self.end
            retry = self.bounds.retry if outage.service == "relay" else 0.0
            blocked = blocked | Intervals(((begin, end + self.bounds.recover + 2 * (end - begin) + retry),))
        for forgery in self.truth.forgeries:
            # Only the lies that may make the coordinator wait (truth.MAY_DELAY) excuse a delay.
            if forgery.kind in MAY_DELAY and (forgery.about in event.resources or event.eventId in forgery.events):
                blocked = blocked | Intervals(((seconds(forgery.at), INF),))
        return blocked

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
