"""The shadow policy: a candidate evaluated beside the live one on the same events at the same instants, its
decisions recorded and never sent (``COORDINATOR_SHADOW_POLICY``; ``Run.shadow``).

Entered from ``decide.decide`` for each Scheduled event the live policy decides, before it: the candidate's verdict
(``EventRecord.shadow``, a Shadow history row when its rule, verdict or reason changes, with when it first would
have approved) rides in the same ETag-checked write as the live decision. ``ops.policy shadow-report`` reads the
rows back beside what the platform did (when it started each event, the impact each VM measured): "would have
approved at X, the platform started at Y, measured impact Z".

What the candidate sees is the live fleet: its budgets count the live approvals (it claims none), its rate and
sequence hold nothing (their state is claimed by approvals, and it makes none), its gates are read with the live
ones, once per run. So it answers "what would this rule have decided of this event", not "what fleet would it have
made": docs/policy.md, *Shadow policy*.
"""

from __future__ import annotations

from coordinator.domain.evaluation import evaluate, needs_fleet
from coordinator.domain.fleet_view import FleetView
from coordinator.domain.history_rows import shadow_row
from coordinator.domain.lifecycle import EventChange
from coordinator.domain.side_records import ShadowVerdict
from coordinator.pipeline.run import Run

__all__ = ["consider"]


def consider(run: Run, change: EventChange) -> None:
    """The candidate's verdict on a Scheduled event, into ``change`` when it changed (no-op without a shadow)."""
    shadow, record, now = run.shadow, change.record, run.now
    if shadow is None or record.state != "Scheduled":
        return
    needed = needs_fleet(shadow, record, now)
    view = run.fleet.view(census=shadow.needs_census) if needed else FleetView()
    gates = run.fleet.rule_gates(shadow, run.parts.monitor, record, now, view)
    decision = evaluate(shadow, record, view, now, gates=gates)
    previous = record.shadow
    if previous is not None and (previous.rule, previous.verdict, previous.reason, previous.policyVersion) == (
        decision.rule,
        decision.verdict,
        decision.reason,
        shadow.fingerprint,
    ):
        return
    first_approval = previous.approveAt if previous is not None else None
    record.shadow = ShadowVerdict(
        rule=decision.rule,
        action=decision.action,
        verdict=decision.verdict,
        reason=decision.reason,
        decidedAt=now,
        policyVersion=shadow.fingerprint,
        approveAt=first_approval or (now if decision.verdict == "approve" else None),
    )
    change.rows.append(shadow_row(record=record, now=now))
    change.changed = True
