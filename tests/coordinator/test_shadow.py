"""The shadow policy (pipeline/shadow.py): a candidate decided beside the live policy on the same events at the same
instants, its verdicts recorded as Shadow rows (only when they change, with when it first would have approved) and
never sent; the live policy's decisions and approvals are what they would be without it."""

from __future__ import annotations

import random
from datetime import timedelta
from pathlib import Path

from contracts.approval import ApprovalRequest, ApprovalResult
from contracts.envelope import VmIdentity
from coordinator.adapters.teams import FolderCardSink
from coordinator.domain.policy_file import parse_policy
from coordinator.service import Coordinator
from tests.coordinator.conftest import Clock
from tests.coordinator.helpers import DOC_NOW, MemoryHistory, envelope, raw_message, scheduled_event, vm
from tests.coordinator.memory_store import MemoryStateStore
from tests.coordinator.runs import make_coordinator

LIVE = """
rules:
  - {name: freezes-now, match: {eventType: [Freeze]}, action: approve-now}
  - {name: everything-else-waits, action: wait-for-person}
"""
CANDIDATE = """
rules:
  - {name: reboots-now, match: {eventType: [Reboot]}, action: approve-now}
  - {name: rest-waits, action: wait-for-person}
"""


class Listener:
    def __init__(self) -> None:
        self.requests: list[ApprovalRequest] = []

    def send(self, request: ApprovalRequest, *, vm: VmIdentity) -> ApprovalResult:
        self.requests.append(request)
        return ApprovalResult(outcome="approved", eventId=request.eventId, decisionId=request.decisionId)


def build(tmp: Path, *, shadow: str | None = CANDIDATE) -> tuple[Coordinator, MemoryHistory, Listener, Clock]:
    clock = Clock(DOC_NOW)
    history, listener = MemoryHistory(), Listener()
    coordinator = make_coordinator(
        store=MemoryStateStore(),
        history=history,
        alerts=FolderCardSink(tmp / "cards"),
        callback=listener,
        policy=parse_policy(LIVE),
        clock=clock,
        rng=random.Random(4),
    )
    coordinator.shadow = parse_policy(shadow) if shadow is not None else None
    return coordinator, history, listener, clock


def report(coordinator: Coordinator, clock: Clock, events: list[dict[str, object]], sequence: int) -> None:
    identity = vm("web_0", scale_set="web", index=1)
    data = envelope(identity, sequence=sequence, incarnation=sequence + 1, events=events, observed_at=clock.now)
    coordinator.process_batch([raw_message(identity, data)])


def test_the_candidates_verdicts_are_rows_once_each_and_nothing_it_approves_is_sent(tmp_path: Path) -> None:
    coordinator, history, listener, clock = build(tmp_path)
    reboot = scheduled_event("E-REBOOT", event_type="Reboot", resources=["web_0"], duration=-1)
    freeze = scheduled_event("E-FREEZE", event_type="Freeze", resources=["web_0"], duration=5)
    report(coordinator, clock, [reboot, freeze], 1)
    clock.now = DOC_NOW + timedelta(minutes=1)
    report(coordinator, clock, [reboot, freeze], 2)
    coordinator.tick()

    shadows = {row.EventId: row for row in history.rows if row.RecordType == "Shadow"}
    assert sorted((r.EventId, r.Rule, r.Outcome, r.Actor, r.DryRun) for r in shadows.values()) == [
        ("E-FREEZE", "rest-waits", "wait", "shadow:rest-waits", True),
        ("E-REBOOT", "reboots-now", "approve", "shadow:reboots-now", True),
    ]
    assert len([row for row in history.rows if row.RecordType == "Shadow"]) == 2  # unchanged verdicts: no new rows
    assert shadows["E-REBOOT"].Details is not None
    assert shadows["E-REBOOT"].Details["approveAt"] == DOC_NOW.isoformat()
    # Only the live policy's approval (the Freeze) went to the VM; the Reboot waits for a person, as it would alone.
    assert [request.eventId for request in listener.requests] == ["E-FREEZE"]
    reboot_record = coordinator.event("E-REBOOT")
    assert reboot_record is not None
    assert reboot_record.record.decision is not None
    assert (reboot_record.record.decision.verdict, reboot_record.record.approval) == ("wait", None)


def test_without_a_shadow_no_shadow_row_is_written(tmp_path: Path) -> None:
    coordinator, history, _, clock = build(tmp_path, shadow=None)
    report(coordinator, clock, [scheduled_event("E-REBOOT", event_type="Reboot", resources=["web_0"])], 1)
    assert [row for row in history.rows if row.RecordType == "Shadow"] == []
    record = coordinator.event("E-REBOOT")
    assert record is not None
    assert record.record.shadow is None
