"""History rows, one builder per RecordType: every row of a type carries the same columns, whoever writes it.

Pure: takes a record (or a VM, or a refused message) and what happened to it; gives a ``HistoryRow``
(coordinator/domain/rows.py, the columns of coordinator/history_columns.json). The domain and the stages build rows
only here, so a column given to one row of a type is given to every row of it: each builder passes all its type's
columns, empty when a case has nothing to say (the sinks leave empty values out, so this costs no space).
tests/coordinator/test_history_rows.py checks that, and that each RecordType below has its builder.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal, TypedDict

from contracts.envelope import HookReport, VmIdentity
from coordinator.domain.model import DecisionRecord, EventRecord, VmRecord
from coordinator.domain.rows import HistoryRow

__all__ = [
    "RecordType",
    "alert_row",
    "approval_row",
    "dead_letter_row",
    "decision_row",
    "heartbeat_row",
    "hook_row",
    "impact_row",
    "observation_row",
    "repairs_row",
    "shadow_row",
    "transition_row",
    "vm_columns",
]

# The history's row types (history_columns.json lists them in RecordType's description).
RecordType = Literal[
    "Observation",
    "Transition",
    "Decision",
    "Approval",
    "Hook",
    "Heartbeat",
    "DeadLetter",
    "Alert",
    "Impact",
    "Shadow",
    "Repairs",
]

# What a VM card's Alert row says about an event: nothing.
_NO_EVENT: dict[str, Any] = {
    "EventId": "",
    "EventType": "",
    "EventSource": "",
    "State": "",
    "NotBefore": None,
    "DurationInSeconds": None,
    "Resources": None,
}
_NO_VM: dict[str, Any] = {"VmName": "", "VmId": "", "VmResourceId": "", "ScaleSetName": "", "PlacementGroupId": ""}


def _event_columns(record: EventRecord) -> dict[str, Any]:
    """The columns that say which event a row is about, and its state after the row."""
    return {
        "EventId": record.eventId,
        "EventType": record.eventType,
        "EventSource": record.eventSource,
        "State": record.state,
        "NotBefore": record.notBefore,
        "DurationInSeconds": record.durationInSeconds,
        "Resources": list(record.resources),
    }


def vm_columns(vm: VmIdentity) -> dict[str, Any]:
    """The columns that say which VM reported (or is) what a row is about."""
    return {
        "VmName": vm.name,
        "VmId": vm.vmId,
        "VmResourceId": vm.resourceId,
        "ScaleSetName": vm.vmScaleSetName,
        "PlacementGroupId": vm.placementGroupId,
    }


def observation_row(
    *,
    record: EventRecord,
    now: datetime,
    vm: VmIdentity,
    status: str,
    incarnation: int,
    observed_at: datetime,
    sequence: int,
    outcome: str = "",
    reason: str = "",
    details: dict[str, Any] | None = None,
) -> HistoryRow:
    """What one VM's IMDS document said of an event (``status``: Scheduled, Started, Gone). ``outcome`` "conflict":
    a sighting that contradicts the record's facts, kept beside it (``reason`` and ``details`` say what it
    claimed)."""
    return HistoryRow(
        TimeGenerated=now,
        RecordType="Observation",
        **_event_columns(record),
        **vm_columns(vm),
        EventStatus=status,
        DocumentIncarnation=incarnation,
        ObservedAt=observed_at,
        Sequence=sequence,
        Actor="platform",
        Outcome=outcome,
        Reason=reason,
        Details=details,
    )


def transition_row(
    *,
    record: EventRecord,
    now: datetime,
    previous: str,
    reason: str,
    rule: str = "",
    actor: str = "",
    decision_id: str = "",
    vm: str = "",
) -> HistoryRow:
    """The event's state moved from ``previous`` to ``record.state``; an approval's transition also names its rule,
    actor, decision and the VM that executed it."""
    return HistoryRow(
        TimeGenerated=now,
        RecordType="Transition",
        **_event_columns(record),
        PreviousState=previous,
        Reason=reason,
        Rule=rule,
        Actor=actor,
        DecisionId=decision_id,
        VmName=vm,
    )


def decision_row(*, record: EventRecord, now: datetime) -> HistoryRow:
    """The record's decision (``record.decision``, just made): the rule, the verdict, what held it, and the approval
    it withdrew, if it did (the Reason starts with that)."""
    decision = record.decision
    if decision is None:
        raise ValueError(f"event {record.eventId} has no decision to record")
    return HistoryRow(
        TimeGenerated=now,
        RecordType="Decision",
        **_event_columns(record),
        Rule=decision.rule,
        Action=decision.action,
        DecisionId=decision.decisionId,
        Actor=decision.actor,
        Outcome=decision.verdict,
        Reason=decision.withdrawal + decision.reason,
        DryRun=decision.dryRun,
        HoldKind=decision.holdKind,
        HoldName=decision.holdName,
        HoldSince=decision.holdSince,
        HeldUntil=decision.heldUntil,
        Details=_decision_details(record, decision),
    )


def repairs_row(
    *, scale_set: str, action: str, outcome: str, reason: str, events: list[str], now: datetime
) -> HistoryRow:
    """A scale set's automatic repairs suspended or resumed by the coordinator (pipeline/repairs.py): the scale set
    (its name in ScaleSetName, its ARM id and the events in flight in Details), Action Suspend or Resume, Outcome
    suspended, resumed or failed, and why."""
    return HistoryRow(
        TimeGenerated=now,
        RecordType="Repairs",
        ScaleSetName=scale_set.rstrip("/").rsplit("/", 1)[-1],
        Action=action,
        Actor="coordinator",
        Outcome=outcome,
        Reason=reason,
        Details={"scaleSetId": scale_set, "events": events[:100]},
    )


def shadow_row(*, record: EventRecord, now: datetime) -> HistoryRow:
    """The shadow policy's decision just recorded (``record.shadow``): a candidate's verdict, never sent (DryRun),
    its Actor ``shadow:RULE``; Details name the candidate's version and when it first would have approved."""
    shadow = record.shadow
    if shadow is None:
        raise ValueError(f"event {record.eventId} has no shadow decision to record")
    return HistoryRow(
        TimeGenerated=now,
        RecordType="Shadow",
        **_event_columns(record),
        Rule=shadow.rule,
        Action=shadow.action,
        Actor=f"shadow:{shadow.rule}",
        Outcome=shadow.verdict,
        Reason=shadow.reason,
        DryRun=True,
        Details={
            "policyVersion": shadow.policyVersion,
            "approveAt": shadow.approveAt.isoformat() if shadow.approveAt else None,
        },
    )


def _decision_details(record: EventRecord, decision: DecisionRecord) -> dict[str, Any] | None:
    """What a Decision row's columns do not say: the delete that holds it, and the escalation steps it took (each
    its place, action, lead, time and owners: the oracle judges when each was taken from these)."""
    details: dict[str, Any] = {}
    if decision.heldBy:
        details |= {
            "heldBy": decision.heldBy,
            "heldByVm": decision.heldByVm,
            "heldUntil": decision.heldUntil.isoformat() if decision.heldUntil else None,
        }
    steps = [step for step in record.escalation if step.decisionId == decision.decisionId]
    if steps:
        details["escalation"] = [
            {
                "step": step.step,
                "of": step.of,
                "do": step.do,
                "beforeNotBeforeSeconds": step.beforeNotBeforeSeconds,
                "at": step.at.isoformat(),
                "owners": step.owners,
            }
            for step in steps
        ]
    return details or None


def approval_row(
    *,
    record: EventRecord,
    now: datetime,
    outcome: str,
    reason: str,
    vm: str = "",
    rule: str = "",
    decision_id: str = "",
    actor: str = "",
    incarnation: int | None = None,
    details: dict[str, Any] | None = None,
) -> HistoryRow:
    """A step of an approval's delivery (sending, the listener's answer, unknown, not started) or the platform's
    hold on it (Actor platform, held or released). ``vm``: the VM that executes it; ``incarnation``: the
    DocumentIncarnation the listener approved in."""
    return HistoryRow(
        TimeGenerated=now,
        RecordType="Approval",
        **_event_columns(record),
        VmName=vm,
        Rule=rule,
        DecisionId=decision_id,
        Actor=actor,
        Outcome=outcome,
        Reason=reason,
        DocumentIncarnation=incarnation,
        Details=details,
    )


def hook_row(
    *,
    record: EventRecord,
    now: datetime,
    vm: VmIdentity,
    observed_at: datetime,
    sequence: int,
    hook: HookReport,
    phase_outcome: str,
) -> HistoryRow:
    """A VM's hook report; ``phase_outcome`` is the phase's outcome on that VM after it. Actor is the hook that
    failed (else the hook, or "hook"); Reason lists every step of a phase report."""
    details: dict[str, Any] | None
    if hook.steps is not None:
        steps = "; ".join(
            f"{s.hook} {s.outcome} ({'' if s.exitCode is None else f'exit {s.exitCode}, '}{s.durationSeconds:.1f} s)"
            for s in hook.steps
        )
        reason = f"{hook.phase} phase {hook.outcome}: " + (steps or "no hooks installed")
        details = {
            "steps": [
                {
                    **s.model_dump(include={"hook", "outcome", "exitCode", "durationSeconds"}),
                    "outputTail": s.outputTail[-256:],
                }
                for s in hook.steps
            ],
            "failedHook": hook.failed_hook,
        }
    else:
        reason = f"{hook.hook or 'hook'} {hook.outcome}, exit code {hook.exitCode}, {hook.durationSeconds:.1f} s"
        if phase_outcome != hook.outcome:
            reason += f"; the {hook.phase} phase stays {phase_outcome} (an earlier hook of this phase did not succeed)"
        details = {"outputTail": hook.outputTail[-1024:]} if hook.outputTail else None
    return HistoryRow(
        TimeGenerated=now,
        RecordType="Hook",
        **_event_columns(record),
        **vm_columns(vm),
        HookPhase=hook.phase,
        Outcome=hook.outcome,
        ObservedAt=observed_at,
        Sequence=sequence,
        Actor=hook.failed_hook or hook.hook or "hook",
        Reason=reason[:4000],
        Details=details,
    )


def heartbeat_row(
    *,
    vm: VmIdentity,
    now: datetime,
    outcome: str,
    reason: str,
    observed_at: datetime,
    sequence: int,
    incarnation: int | None = None,
    actor: str = "",
    event_id: str = "",
    event_type: str = "",
    details: dict[str, Any] | None = None,
) -> HistoryRow:
    """A VM's condition moved (lost, resumed, retired by ``event_id``, a forwarder state reset or conflict, IMDS
    failing or recovered), at its position (``observed_at``, ``sequence``, ``incarnation``)."""
    return HistoryRow(
        TimeGenerated=now,
        RecordType="Heartbeat",
        **vm_columns(vm),
        ObservedAt=observed_at,
        Sequence=sequence,
        DocumentIncarnation=incarnation,
        Outcome=outcome,
        Actor=actor,
        Reason=reason,
        EventId=event_id,
        EventType=event_type,
        Details=details,
    )


class Position(TypedDict):
    """Where a VM stands (its last envelope's time, sequence and incarnation), as ``heartbeat_row`` takes it."""

    vm: VmIdentity
    observed_at: datetime
    sequence: int
    incarnation: int | None


def position_of(vm: VmRecord) -> Position:
    """A VM's stored position, for a Heartbeat row about it: ``heartbeat_row(**position_of(vm), ...)``."""
    return Position(vm=vm.identity, observed_at=vm.lastSeen, sequence=vm.lastSequence, incarnation=vm.lastIncarnation)


def dead_letter_row(*, now: datetime, reason: str, details: dict[str, Any], event_id: str = "") -> HistoryRow:
    """Something set aside rather than acted on: a refused message, or an event's observations that failed."""
    return HistoryRow(TimeGenerated=now, RecordType="DeadLetter", EventId=event_id, Reason=reason, Details=details)


def alert_row(
    *, about: EventRecord | VmIdentity, kind: str, now: datetime, outcome: str, reason: str = ""
) -> HistoryRow:
    """A card of ``kind`` about an event or a VM, sent or failed (``reason``: why it failed)."""
    event, vm = (_event_columns(about), _NO_VM) if isinstance(about, EventRecord) else (_NO_EVENT, vm_columns(about))
    return HistoryRow(
        TimeGenerated=now,
        RecordType="Alert",
        **event,
        **vm,
        Action=kind,
        Actor="teams",
        Outcome=outcome,
        Reason=reason,
    )


def impact_row(
    *,
    record: EventRecord,
    now: datetime,
    vm: VmIdentity,
    measure: str,
    measured_seconds: float | None,
    start: datetime | None,
    end: datetime | None,
    observed_at: datetime,
    sequence: int,
    actor: str,
    details: dict[str, Any] | None = None,
    outcome: str = "",
    reason: str = "",
    returned: tuple[str, float | None] = ("", None),
) -> HistoryRow:
    """What ``record`` did to ``vm``: the announced DurationInSeconds (an event column) beside the measured
    seconds, how they were measured (``pause``, ``restart`` or ``removed``) and the stretch measured. ``actor``
    says who measured it: the VM's forwarder, or the coordinator for a VM that is gone. A return to service
    (``return-to-service``, domain/returns.py) has its own ``outcome`` (back | late | abandoned) and ``reason``, and
    ``returned``: the rule that asked for it and the seconds from the completion to the VM back (None: not back)."""
    announced = "not announced" if record.durationInSeconds < 0 else f"announced {record.durationInSeconds} s"
    rule, returned_seconds = returned
    return HistoryRow(
        TimeGenerated=now,
        RecordType="Impact",
        **_event_columns(record),
        **vm_columns(vm),
        ObservedAt=observed_at,
        Sequence=sequence,
        Actor=actor,
        Rule=rule,
        Outcome=outcome or measure,
        Reason=reason or f"{record.eventType} {measure}: measured {measured_seconds or 0:.1f} s, {announced}",
        ImpactMeasure=measure,
        MeasuredSeconds=None if measured_seconds is None else round(measured_seconds, 3),
        ImpactStart=start,
        ImpactEnd=end,
        ReturnToServiceSeconds=None if returned_seconds is None else round(returned_seconds, 3),
        Details=details,
    )
