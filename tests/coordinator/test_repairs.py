"""Repair-aware maintenance (pipeline/repairs.py): a scale set's automatic repairs suspended by the tick after a
Reboot on its VMs is approved, resumed once the event is over (by any instance, after a crash), never touched when
someone else suspended them, resumed at the bound; every step a Repairs row. The ARM calls go to ``RecordingRepairs``,
a stand-in at the ``RepairsClient`` seam (the adapter itself is tested against the IMDS emulator's ARM face in
tests/coordinator/test_repairs_arm.py)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from contracts.approval import ApprovalRequest, ApprovalResult
from contracts.envelope import VmIdentity
from coordinator.adapters.census import Census
from coordinator.adapters.repairs import RepairsError, RepairsState
from coordinator.adapters.teams import FolderCardSink
from coordinator.domain.census import CensusEntry
from coordinator.domain.controls import VmFacts
from coordinator.domain.policy_file import parse_policy
from coordinator.domain.repairs import repairs_key
from coordinator.service import Coordinator
from tests.coordinator.conftest import Clock
from tests.coordinator.helpers import DOC_NOW, SUBSCRIPTION, MemoryHistory, envelope, raw_message, scheduled_event, vm
from tests.coordinator.memory_store import MemoryStateStore
from tests.coordinator.runs import make_coordinator

POLICY = "rules:\n  - {name: reboots-now, match: {eventType: [Reboot]}, action: approve-now}\n"
GROUP = f"/subscriptions/{SUBSCRIPTION}/resourceGroups/rg-fleet"
SCALE_SET = f"{GROUP}/providers/Microsoft.Compute/virtualMachineScaleSets/web"
EVENT = "E-REBOOT"


class RecordingRepairs:
    """ARM's automatic repairs of each scale set as this test sets them, and every Suspend/Resume asked."""

    def __init__(self, state: RepairsState = "Running") -> None:
        self.states: dict[str, RepairsState] = {}
        self.initial: RepairsState = state
        self.calls: list[tuple[str, str]] = []
        self.failing = False

    def state(self, scale_set: str) -> RepairsState:
        return self.states.get(scale_set, self.initial)

    def set(self, scale_set: str, action: Literal["Suspend", "Resume"]) -> None:
        if self.failing:
            raise RepairsError(f"{scale_set}: POST setOrchestrationServiceState answered 500: try later")
        self.calls.append((scale_set, action))
        self.states[scale_set] = "Suspended" if action == "Suspend" else "Running"


class StaticCensus:
    """ARM's census of the fleet: web_0 and web_1, instances of scale set ``web``."""

    scopes: Sequence[str] = (GROUP,)

    def read(self) -> list[CensusEntry]:
        """As helpers.vm makes their identities: web_N is instance N of ``web``, its vmId from its index N + 1."""
        facts = VmFacts(scaleSet="web", location="norwayeast", placementGroup="avset-westno")
        return [
            CensusEntry(name, identity["vmId"], identity["resourceId"], facts)
            for name, identity in ((n, vm(n, scale_set="web", index=i)) for i, n in ((1, "web_0"), (2, "web_1")))
        ]


class Listener:
    def send(self, request: ApprovalRequest, *, vm: VmIdentity) -> ApprovalResult:
        return ApprovalResult(outcome="approved", eventId=request.eventId, decisionId=request.decisionId)


def build(tmp: Path, repairs: RecordingRepairs, store: MemoryStateStore, clock: Clock, **options: Any) -> Coordinator:
    return make_coordinator(
        store=store,
        history=MemoryHistory(),
        alerts=FolderCardSink(tmp / "cards"),
        callback=Listener(),
        policy=parse_policy(POLICY),
        clock=clock,
        rng=random.Random(28),
        census=Census(StaticCensus()),
        repairs=repairs,
        **options,
    )


def report(coordinator: Coordinator, clock: Clock, sequence: int, status: str | None) -> None:
    """web_0's document: the Reboot Scheduled or Started, or no event (None: it is over)."""
    identity = vm("web_0", scale_set="web", index=1)
    events = [] if status is None else [scheduled_event(EVENT, event_type="Reboot", resources=["web_0"], status=status)]
    data = envelope(identity, sequence=sequence, incarnation=sequence, events=events, observed_at=clock.now)
    coordinator.process_batch([raw_message(identity, data)])


def rows(coordinator: Coordinator) -> list[tuple[str, str, str]]:
    history = coordinator.parts.history
    assert isinstance(history, MemoryHistory)
    return [(r.Action, r.Outcome, r.ScaleSetName) for r in history.rows if r.RecordType == "Repairs"]


def approved_then_ticked(tmp: Path, repairs: RecordingRepairs, store: MemoryStateStore, clock: Clock) -> Coordinator:
    coordinator = build(tmp, repairs, store, clock)
    report(coordinator, clock, 1, "Scheduled")
    record = coordinator.event(EVENT)
    assert record is not None
    assert record.record.state == "Approved"
    clock.now += timedelta(seconds=30)
    coordinator.tick()
    return coordinator


def test_suspended_while_the_reboot_is_in_flight_and_resumed_once_it_is_over(tmp_path: Path) -> None:
    repairs, store, clock = RecordingRepairs(), MemoryStateStore(), Clock(DOC_NOW)
    coordinator = approved_then_ticked(tmp_path, repairs, store, clock)
    assert repairs.calls == [(SCALE_SET, "Suspend")]
    assert rows(coordinator) == [("Suspend", "suspended", "web")]
    held = store.get_budget(repairs_key(SCALE_SET))
    assert held is not None
    assert list(held.record.claims) == [EVENT]
    clock.now += timedelta(seconds=30)
    report(coordinator, clock, 2, "Started")
    coordinator.tick()
    assert repairs.calls == [(SCALE_SET, "Suspend")]  # still in flight: held, not asked again
    clock.now += timedelta(seconds=60)
    report(coordinator, clock, 3, None)
    coordinator.tick()
    record = coordinator.event(EVENT)
    assert record is not None
    assert record.record.state == "Completed"
    assert repairs.calls == [(SCALE_SET, "Suspend"), (SCALE_SET, "Resume")]
    assert rows(coordinator) == [("Suspend", "suspended", "web"), ("Resume", "resumed", "web")]
    assert store.get_budget(repairs_key(SCALE_SET)) is None


def test_kept_suspended_until_the_vm_is_back_in_service_under_return_to_service(tmp_path: Path) -> None:
    repairs, store, clock = RecordingRepairs(), MemoryStateStore(), Clock(DOC_NOW)
    coordinator = build(tmp_path, repairs, store, clock)
    returning = POLICY.rstrip("}\n") + ", returnToService: {withinSeconds: 600}}\n"
    coordinator.policy = parse_policy(returning)
    report(coordinator, clock, 1, "Scheduled")
    clock.now += timedelta(seconds=30)
    coordinator.tick()
    clock.now += timedelta(seconds=60)
    report(coordinator, clock, 2, None)
    coordinator.tick()
    record = coordinator.event(EVENT)
    assert record is not None
    assert (record.record.state, record.record.returning) == ("Completed", ["web_0"])
    assert repairs.calls == [(SCALE_SET, "Suspend")]  # over, but web_0 is not serving yet: not replaced either
    identity = vm("web_0", scale_set="web", index=1)
    hook = {"eventId": EVENT, "phase": "recover", "outcome": "not-run", "durationSeconds": 0.1, "steps": []}
    data = envelope(identity, sequence=3, kind="hook", hook=hook, observed_at=clock.now)
    coordinator.process_batch([raw_message(identity, data)])
    clock.now += timedelta(seconds=60)
    coordinator.tick()
    assert repairs.calls == [(SCALE_SET, "Suspend"), (SCALE_SET, "Resume")]


def test_another_instance_resumes_what_a_crashed_one_suspended(tmp_path: Path) -> None:
    repairs, store, clock = RecordingRepairs(), MemoryStateStore(), Clock(DOC_NOW)
    approved_then_ticked(tmp_path, repairs, store, clock)  # suspended, then the instance is gone
    other = build(tmp_path, repairs, store, clock)
    clock.now += timedelta(seconds=60)
    report(other, clock, 2, "Started")
    clock.now += timedelta(seconds=60)
    report(other, clock, 3, None)
    other.tick()
    assert repairs.calls == [(SCALE_SET, "Suspend"), (SCALE_SET, "Resume")]
    assert rows(other) == [("Resume", "resumed", "web")]


def test_repairs_someone_else_suspended_are_left_alone(tmp_path: Path) -> None:
    repairs, store, clock = RecordingRepairs("Suspended"), MemoryStateStore(), Clock(DOC_NOW)
    coordinator = approved_then_ticked(tmp_path, repairs, store, clock)
    clock.now += timedelta(seconds=60)
    report(coordinator, clock, 2, None)
    coordinator.tick()
    assert repairs.calls == []
    assert rows(coordinator) == []
    assert store.get_budget(repairs_key(SCALE_SET)) is None


def test_a_failed_suspend_is_a_row_and_is_tried_again_next_tick(tmp_path: Path) -> None:
    repairs, store, clock = RecordingRepairs(), MemoryStateStore(), Clock(DOC_NOW)
    repairs.failing = True
    coordinator = approved_then_ticked(tmp_path, repairs, store, clock)
    assert rows(coordinator) == [("Suspend", "failed", "web")]
    repairs.failing = False
    clock.now += timedelta(seconds=60)
    coordinator.tick()
    assert repairs.calls == [(SCALE_SET, "Suspend")]
    assert rows(coordinator)[-1] == ("Suspend", "suspended", "web")


def test_resumed_at_the_bound_and_not_suspended_again_for_the_same_events(tmp_path: Path) -> None:
    repairs, store, clock = RecordingRepairs(), MemoryStateStore(), Clock(DOC_NOW)
    coordinator = approved_then_ticked(tmp_path, repairs, store, clock)
    coordinator.options = dataclasses.replace(coordinator.options, repairs_bound=timedelta(minutes=10))
    report(coordinator, clock, 2, "Started")
    for minutes in (5, 11, 12):
        clock.now = DOC_NOW + timedelta(minutes=minutes)
        report(coordinator, clock, 2 + minutes, "Started")
        coordinator.tick()
    assert repairs.calls == [(SCALE_SET, "Suspend"), (SCALE_SET, "Resume")]
    assert [r[:2] for r in rows(coordinator)] == [("Suspend", "suspended"), ("Resume", "resumed")]
    history = coordinator.parts.history
    assert isinstance(history, MemoryHistory)
    assert "the bound" in [r.Reason for r in history.rows if r.RecordType == "Repairs"][-1]
