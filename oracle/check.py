"""The oracle's verdict on one run (pure): for every event, when the policy allows an approval (``oracle.allowed``) and
by when one is due; then every accepted StartRequests judged against that (``oracle.approvals``), every escalation
step the Decision rows took judged against its ladder (``oracle.ladders``), and every document a forwarder read looked
up in the history (``oracle.documents``).

**Due.** An approval is due once the event has been, for ``latency`` seconds without interruption (plus the slowest
delay every executor's listener or the rule's gate adds), surely allowed, reported by a VM whose forwarder runs,
executable by a VM whose forwarder runs and whose listener answers, and free of every fault ``oracle.allowed`` lists
under *Either*. A due approval not accepted while the event was Scheduled is MISSED; one accepted after the due time
is LATE. What is no excuse: a slow or dead listener, or a stopped forwarder, when another VM that sees the event could
execute it; another VM's slow listener, gate or oversized envelope; a VM's clock skew (freshness is for the service's
clock to judge).
"""

from __future__ import annotations

from oracle.allowed import Judge
from oracle.approvals import approval_findings
from oracle.documents import incarnation_findings
from oracle.facts import INF, Facts
from oracle.intervals import EMPTY, Intervals, seconds
from oracle.ladders import ladder_findings
from oracle.rules import choose
from oracle.truth import Event, Truth
from oracle.verdict import KINDS, Bounds, EventVerdict, Finding, Report

__all__ = ["check"]


def _coupled(run: Facts, judges: dict[str, Judge], event: Event) -> Intervals:
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


def check(truth: Truth, bounds: Bounds | None = None) -> Report:
    run = Facts(truth, bounds or Bounds())
    judges = {event.eventId: Judge(run, event) for event in truth.events}
    verdicts = []
    findings: list[Finding] = []
    for event in truth.events:
        judge = judges[event.eventId]
        created = seconds(event.transitions[0].at)
        rule, why = choose(run.policy, event, run.vms, created)
        gates = run.policy.gates_of(rule.name) if rule is not None else []
        allowed = (_coupled(run, judges, event) & Intervals(((judge.reported, INF),))) - run.impediments(event)
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
    findings.extend(approval_findings(run, judges))
    findings.extend(ladder_findings(run, judges))
    lost, checked = incarnation_findings(run)
    findings.extend(lost)
    order = {kind: index for index, kind in enumerate(KINDS)}
    findings.sort(key=lambda f: (order[f.kind], f.label))
    return Report(findings, verdicts, checked, start=run.start)
