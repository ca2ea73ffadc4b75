"""Record history: one builder per history row type the stages write, and the write itself.

Takes records and what happened to them; gives ``HistoryRow``s (the columns of coordinator/history_columns.json) and
hands them to the history sink. Observation, transition and hook rows are built with the state they describe, in
coordinator/domain/sightings.py (``event_row``). A history failure is logged and never stops the pipeline.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from coordinator.adapters import telemetry
from coordinator.domain.model import ApprovalRecord, EventRecord, VmRecord
from coordinator.domain.rows import HistoryRow
from coordinator.domain.sightings import event_row
from coordinator.pipeline.run import Run

log = logging.getLogger("coordinator")


def history(run: Run) -> None:
    """The last step of every run's tail: the run's history rows, written once."""
    run.enter("history")
    write(run, run.work.rows)
    run.work.rows = []


def write(run: Run, rows: list[HistoryRow]) -> None:
    """Hands rows to the history sink (also the approvals' intents, written before they are sent)."""
    if not rows:
        return
    telemetry.history_written(rows)
    try:
        run.parts.history.write(rows)
        run.report.history_rows += len(rows)
    except Exception:  # history must never stop the pipeline; the sink keeps what it could not send
        log.exception("history: could not write %d rows", len(rows))


def decision_row(record: EventRecord, now: datetime) -> HistoryRow:
    decision = record.decision
    assert decision is not None
    return event_row(
        record,
        now,
        "Decision",
        Rule=decision.rule,
        Action=decision.action,
        DecisionId=decision.decisionId,
        Actor=decision.actor,
        Outcome=decision.verdict,
        Reason=decision.reason,
        DryRun=decision.dryRun,
        HoldKind=decision.holdKind,
        HoldName=decision.holdName,
        HoldSince=decision.holdSince,
        HeldUntil=decision.heldUntil,
        Details=(
            {
                "heldBy": decision.heldBy,
                "heldByVm": decision.heldByVm,
                "heldUntil": decision.heldUntil.isoformat() if decision.heldUntil else None,
            }
            if decision.heldBy
            else None
        ),
    )


def approval_row(record: EventRecord, approval: ApprovalRecord, now: datetime, *, vm: str, **values: Any) -> HistoryRow:
    """An ``Approval`` history row: the event's and the approval's columns, then ``values`` (outcome, reason)."""
    columns: dict[str, Any] = {
        "TimeGenerated": now,
        "RecordType": "Approval",
        "EventId": record.eventId,
        "EventType": record.eventType,
        "EventSource": record.eventSource,
        "State": record.state,
        "NotBefore": record.notBefore,
        "VmName": vm,
        "Rule": approval.rule,
        "DecisionId": approval.decisionId,
        "Actor": approval.actor,
    }
    return HistoryRow.model_validate(columns | values)


def unknown_outcome_row(record: EventRecord, approval: ApprovalRecord, now: datetime) -> HistoryRow:
    return event_row(
        record,
        now,
        "Approval",
        Rule=approval.rule,
        DecisionId=approval.decisionId,
        Actor=approval.actor,
        Outcome="unknown",
        Reason=(
            f"approval decided at {approval.decidedAt.isoformat()} has no recorded outcome (the sender stopped before "
            "recording it); sent again with the same decisionId (the listener answers a repeat without approving twice)"
        ),
    )


def platform_hold_row(record: EventRecord, now: datetime) -> HistoryRow:
    """An approved delete held (or no longer held) by the platform: an ``Approval`` row with Actor platform."""
    hold = record.platformHold
    reason = hold.describe() if hold else "no longer held by the platform: no other delete of its scale set pending"
    return event_row(
        record,
        now,
        "Approval",
        Actor="platform",
        Outcome="held" if hold else "released",
        Reason=reason,
        DecisionId=record.approval.decisionId if record.approval else "",
        Details=(
            {
                "heldBy": hold.eventId,
                "heldByVm": hold.vm,
                "until": hold.until.isoformat() if hold.until else None,
            }
            if hold
            else None
        ),
    )


def alert_row(record: EventRecord, kind: str, now: datetime, outcome: str, reason: str) -> HistoryRow:
    return HistoryRow(
        TimeGenerated=now,
        RecordType="Alert",
        EventId=record.eventId,
        EventType=record.eventType,
        EventSource=record.eventSource,
        State=record.state,
        Action=kind,
        Actor="teams",
        Outcome=outcome,
        Reason=reason,
    )


def vm_alert_row(vm: VmRecord, kind: str, now: datetime, outcome: str, reason: str) -> HistoryRow:
    """An ``Alert`` row for a card about a VM (no EventId): the VM's columns, the kind in Action."""
    identity = vm.identity
    return HistoryRow(
        TimeGenerated=now,
        RecordType="Alert",
        VmName=identity.name,
        VmId=identity.vmId,
        VmResourceId=identity.resourceId,
        ScaleSetName=identity.vmScaleSetName,
        PlacementGroupId=identity.placementGroupId,
        Action=kind,
        Actor="teams",
        Outcome=outcome,
        Reason=reason,
    )


def vm_row(vm: VmRecord, now: datetime, reason: str) -> HistoryRow:
    """A ``Heartbeat`` row for one VM: lost or resumed (the caller changes Outcome for retired)."""
    identity = vm.identity
    return HistoryRow(
        TimeGenerated=now,
        RecordType="Heartbeat",
        VmName=identity.name,
        VmId=identity.vmId,
        VmResourceId=identity.resourceId,
        ScaleSetName=identity.vmScaleSetName,
        PlacementGroupId=identity.placementGroupId,
        ObservedAt=vm.lastSeen,
        Sequence=vm.lastSequence,
        DocumentIncarnation=vm.lastIncarnation,
        Outcome="lost" if vm.heartbeatLost else "resumed",
        Reason=reason,
    )
