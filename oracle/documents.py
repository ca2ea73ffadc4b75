"""Every document a forwarder read judged (pure): LOST when no Observation row holds it.

**Lost.** Every document content a forwarder read whole from IMDS (the emulator records it) that listed an event, or
dropped one the forwarder's previous read listed, and that lasted at least a poll and a half (a shorter one may have
been read only by the VM's listener, which reads the document before it approves), must have an Observation row of
that VM at that DocumentIncarnation, unless the forwarder died for good or its state was wiped before it could send
it (within ``send`` seconds, longer across an Event Hubs outage), or it was killed right after the read (the read
may never have reached its spool).
"""

from __future__ import annotations

from oracle.facts import INF, Facts
from oracle.intervals import seconds
from oracle.truth import Incarnation
from oracle.verdict import Finding

__all__ = ["incarnation_findings"]


def incarnation_findings(run: Facts) -> tuple[list[Finding], int]:
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


def _must_reach_history(run: Facts, inc: Incarnation, served: float) -> bool:
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


def _lost(run: Facts, inc: Incarnation, served: float, gone: list[str]) -> Finding:
    listed = ", ".join(f"{e[:8]} {s}" for e, s in inc.listed) or "nothing"
    left = f"; gone {', '.join(e[:8] for e in gone)}" if gone else ""
    return Finding(
        "lost",
        inc.listed[0][0] if inc.listed else gone[0],
        inc.vm,
        f"incarnation {inc.incarnation} (read at +{served - run.start:.1f}s: lists {listed}{left}) has no "
        "Observation row",
    )
