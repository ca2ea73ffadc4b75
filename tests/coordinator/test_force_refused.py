"""A force step's approval that its VM refused after its force hook failed: the event is decided again, and the
rule's own approval goes as soon as the rule gives one (the prepare hooks succeeded), never the force again (oracle
seed 1043: web_1's Terminate, forced at first sight, its force hook failed, its prepare hook succeeded just before;
the coordinator kept the refused force approval open until its deadline and the event was missed)."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

from contracts import wire
from contracts.approval import ApprovalRequest, ApprovalResult
from contracts.envelope import VmIdentity
from coordinator.service import Coordinator
from forwarder.approval_rules import judge
from tests.coordinator.conftest import Clock
from tests.coordinator.helpers import MemoryHistory, envelope, raw_message, scheduled_event, vm
from tests.coordinator.test_escalation import EVENT, NOT_BEFORE, ForcingListener, build, reboot, report, stored

POLICY = """
rules:
  - name: reboots-after-hooks
    match: {eventType: [Reboot]}
    action: approve-after-hooks
    hooks: {deadlineSeconds: 3600, onDeadline: wait}
    escalate:
      - {beforeNotBeforeSeconds: 120, do: force, hook: drain-force}
"""
WEB_0 = vm("web_0", scale_set="web", index=1)


class HookedListener(ForcingListener):
    """web_0's listener: a force request is "accepted" (its hook runs); any other request is judged against the VM's
    own hook ledger (``ledger``: the prepare phase's outcome), as forwarder/approver.py does."""

    def __init__(self, clock: Clock, document: dict[str, Any]) -> None:
        super().__init__(clock, document)
        self.ledger: dict[str, str] = {}

    def send(self, request: ApprovalRequest, *, vm: VmIdentity) -> ApprovalResult:
        if request.facts is not None and request.facts.forceHook:
            return super().send(request, vm=vm)
        self.requests.append(request)
        wired = wire.ApprovalRequest.from_mapping(request.model_dump())
        ledger = self.ledger.get
        outcome, reason = judge(wired, self.document, vm_name=vm.name, prepare_outcome=ledger, now=self.clock())
        self.answers.append((outcome, reason))
        return ApprovalResult(outcome=outcome, eventId=request.eventId, decisionId=request.decisionId, reason=reason)


L = TypeVar("L", bound="HookedListener")


def first_seen(tmp: Path, kind: type[L]) -> tuple[Coordinator, L, Clock, MemoryHistory]:
    """web_0's Reboot first seen 100 s before NotBefore, no hook reported yet: the force step is reached at once and
    its approval sent to web_0's listener (``kind``)."""
    coordinator, history, _listener, clock = build(POLICY, tmp)
    listener = kind(clock, {"DocumentIncarnation": 2, "Events": [reboot()]})
    coordinator.parts = dataclasses.replace(coordinator.parts, callback=listener)
    clock.now = NOT_BEFORE - timedelta(seconds=100)
    report(coordinator, clock)
    coordinator.tick()
    return coordinator, listener, clock, history


def forced(tmp: Path) -> tuple[Coordinator, HookedListener, Clock, MemoryHistory]:
    """As ``first_seen``, the force approval accepted (the VM runs drain-force)."""
    coordinator, listener, clock, history = first_seen(tmp, HookedListener)
    [request] = listener.requests
    assert request.facts is not None
    assert request.facts.forceHook == "drain-force"
    record = stored(coordinator)
    assert record.approval is not None
    assert record.approval.outcome == "accepted"
    return coordinator, listener, clock, history


def ticks(coordinator: Coordinator, clock: Clock, count: int = 3) -> None:
    """``count`` timer ticks 10 s apart, web_0 reporting its document before each."""
    for _ in range(count):
        clock.now += timedelta(seconds=10)
        report(coordinator, clock)
        coordinator.tick()


def hook(coordinator: Coordinator, clock: Clock, phase: str, outcome: str, sequence: int) -> None:
    """web_0's forwarder reports its ``phase`` hooks of the Reboot (a phase report, as forwarder/hooks.py sends)."""
    step = {"hook": "drain-force" if phase == "force" else "10-drain", "outcome": outcome, "durationSeconds": 1.0}
    report = {"eventId": EVENT, "phase": phase, "outcome": outcome, "durationSeconds": 1.0, "steps": [step]}
    data = envelope(WEB_0, sequence=sequence, kind="hook", hook=report, observed_at=clock.now)
    coordinator.process_batch([raw_message(WEB_0, data)])


def test_a_refused_force_gives_way_to_the_rules_own_approval_once_the_prepare_hooks_succeeded(tmp_path: Path) -> None:
    coordinator, listener, clock, _history = forced(tmp_path)
    clock.now += timedelta(seconds=1)
    listener.ledger[EVENT] = "succeeded"
    hook(coordinator, clock, "prepare", "succeeded", 1000)
    assert len(listener.requests) == 1  # the force request may still execute: nothing else is sent meanwhile
    clock.now += timedelta(seconds=2)
    hook(coordinator, clock, "force", "failed", 1001)
    assert len(listener.requests) == 2, listener.answers
    again = listener.requests[-1]
    assert again.facts is not None
    assert (again.facts.forceHook, again.facts.hooksRequired) == (None, ["web_0"])
    assert again.decisionId != listener.requests[0].decisionId
    assert listener.answers[-1][0] == "approved", listener.answers
    record = stored(coordinator)
    assert record.approval is not None
    assert (record.approval.outcome, record.approval.forceHook) == ("approved", "")
    assert record.decision is not None
    assert "refused by web_0: its force hook drain-force failed" in record.decision.withdrawal


def test_a_refused_force_is_not_sent_again_and_the_event_waits_for_its_hooks(tmp_path: Path) -> None:
    coordinator, listener, clock, _history = forced(tmp_path)
    clock.now += timedelta(seconds=2)
    hook(coordinator, clock, "force", "failed", 1000)
    ticks(coordinator, clock)
    assert len(listener.requests) == 1  # neither the force again nor an approval the rule does not give
    record = stored(coordinator)
    assert record.approval is None
    assert record.openRequest is None  # the VM refused it: no request of it stays open
    assert record.decision is not None
    assert record.decision.verdict == "wait"
    assert "force hook drain-force failed on web_0: not forced again" in record.decision.reason
    # Its prepare hooks succeed later: the rule approves.
    listener.ledger[EVENT] = "succeeded"
    hook(coordinator, clock, "prepare", "succeeded", 1001)
    assert len(listener.requests) == 2
    assert stored(coordinator).approval is not None


class NoForceHookListener(HookedListener):
    """web_0 without the force hook installed: a force request is refused at once (forwarder/approver.py)."""

    def send(self, request: ApprovalRequest, *, vm: VmIdentity) -> ApprovalResult:
        if request.facts is not None and request.facts.forceHook:
            self.requests.append(request)
            self.answers.append(("rejected", "force hook drain-force is not installed on this VM"))
            return ApprovalResult(outcome="rejected", eventId=request.eventId, decisionId=request.decisionId)
        return super().send(request, vm=vm)


def test_a_retry_decided_as_the_rules_own_approval_is_sent_as_that_not_as_the_force(tmp_path: Path) -> None:
    """An approval retried is decided again; when the rule now approves on its own (the hooks succeeded), the
    request is the rule's (no force hook, its hooks required), not the force step's again (it kept the first
    decision's form: the VM was asked to run a force hook it refused)."""
    coordinator, listener, clock, _history = first_seen(tmp_path, NoForceHookListener)
    assert [r.facts.forceHook if r.facts else None for r in listener.requests] == ["drain-force"]
    listener.ledger[EVENT] = "succeeded"
    clock.now += timedelta(seconds=1)
    hook(coordinator, clock, "prepare", "succeeded", 1000)
    ticks(coordinator, clock)
    last = listener.requests[-1]
    assert last.facts is not None
    assert (last.facts.forceHook, last.facts.hooksRequired) == (None, ["web_0"])
    assert listener.answers[-1][0] == "approved", listener.answers


def test_a_refused_force_started_at_not_before_says_so_in_its_started_row(tmp_path: Path) -> None:
    coordinator, _listener, clock, history = forced(tmp_path)
    clock.now += timedelta(seconds=2)
    hook(coordinator, clock, "force", "failed", 1000)
    clock.now = NOT_BEFORE + timedelta(seconds=1)
    started = scheduled_event(EVENT, event_type="Reboot", resources=["web_0"], duration=-1, status="Started")
    data = envelope(WEB_0, sequence=1001, incarnation=3, events=[started], observed_at=clock.now)
    coordinator.process_batch([raw_message(WEB_0, data)])
    [row] = [row for row in history.rows if row.RecordType == "Transition" and row.State == "Started"]
    assert "web_0 refused the force step's approval: its force hook drain-force failed" in row.Reason
