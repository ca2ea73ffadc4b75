"""The fleet controls through the coordinator (Azurite state, the IMDS emulator approving through
DirectImdsCallback): a zone budget holds fleet-wide and names its domain in the history, competing events go by
NotBefore, a VM's tag asks for a person, and a gate read from a local HTTP health endpoint holds until it passes."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from contracts.envelope import VmIdentity
from coordinator.domain.model import DecisionRecord
from coordinator.domain.policy_file import parse_policy
from coordinator.pipeline.ingest import RawMessage
from coordinator.service import Coordinator
from emulators.azurite import AzuriteEndpoints
from emulators.imds import ImdsEmulator
from forwarder.imds import tags_of
from tests.coordinator.conftest import Clock
from tests.coordinator.helpers import DOC_NOW, MemoryHistory, envelope
from tests.coordinator.runs import imds_serving, table_coordinator

VMS: list[dict[str, Any]] = [
    {"name": "web_0", "vmScaleSetName": "web", "zone": "1", "platformUpdateDomain": "0"},
    {"name": "web_1", "vmScaleSetName": "web", "zone": "3", "platformUpdateDomain": "0"},
    {"name": "api_0", "vmScaleSetName": "api", "zone": "1", "platformUpdateDomain": "0"},
    {"name": "api_1", "vmScaleSetName": "api", "zone": "2", "platformUpdateDomain": "1"},
    {"name": "db_0", "vmScaleSetName": "db", "zone": "2", "tags": {"scheduled-events": "manual"}},
]


@pytest.fixture
def zoned() -> Iterator[ImdsEmulator]:
    with imds_serving("controls", VMS) as emulator:
        yield emulator


def build(azurite: AzuriteEndpoints, imds: ImdsEmulator, policy: str, tmp: Path) -> tuple[Coordinator, MemoryHistory]:
    table = "controls" + uuid.uuid4().hex[:12]
    return table_coordinator(azurite, imds, table, tmp / "cards", Clock(DOC_NOW), policy=parse_policy(policy))


def report(imds: ImdsEmulator, name: str, sequence: int) -> RawMessage:
    """What the VM's forwarder sends: its identity as the forwarder reads it (with zone, update domain, tags) and
    its IMDS document."""
    compute = imds.state.vms[name].compute()
    fields = {k: v for k, v in compute.items() if k in VmIdentity.model_fields and k != "tags"}
    identity = VmIdentity.model_validate({**fields, "tags": tags_of(compute)}).model_dump()
    document = imds.document(name)
    data = envelope(identity, sequence=sequence, incarnation=document["DocumentIncarnation"], events=document["Events"])
    return RawMessage(body=json.dumps(data, default=str).encode(), partition_key=identity["resourceId"].lower())


def approved(imds: ImdsEmulator) -> list[str]:
    return [a["EventId"] for a in imds.approvals()]


def reboots(coordinator: Coordinator, imds: ImdsEmulator, *notices: tuple[str, int]) -> list[str]:
    """A Reboot of each VM named, with its notice (seconds), then one batch in which each VM reports it: the events'
    ids, in that order."""
    events = [imds.create_event(EventType="Reboot", Resources=[vm], NoticeSeconds=s)["EventId"] for vm, s in notices]
    coordinator.process_batch([report(imds, vm, 1) for vm, _ in notices])
    return events


def decision_of(coordinator: Coordinator, event_id: str) -> DecisionRecord:
    """The decision the coordinator stored for the event (it has one)."""
    stored = coordinator.event(event_id)
    assert stored is not None
    assert stored.record.decision is not None
    return stored.record.decision


def test_a_zone_budget_holds_across_scale_sets_and_the_history_names_the_domain(azurite, zoned, tmp_path):
    policy = """
rules:
  - name: one-per-zone
    match: {eventType: [Reboot]}
    action: approve-within-budget
    budget: {maxImpacted: 1, per: [zone]}
"""
    coordinator, history = build(azurite, zoned, policy, tmp_path)
    first = zoned.create_event(EventType="Reboot", Resources=["web_0"], NoticeSeconds=900)["EventId"]
    second = zoned.create_event(EventType="Reboot", Resources=["api_0"], NoticeSeconds=900)["EventId"]
    other_zone = zoned.create_event(EventType="Reboot", Resources=["api_1"], NoticeSeconds=900)["EventId"]

    coordinator.process_batch([report(zoned, "web_0", 1)])
    coordinator.process_batch([report(zoned, "api_0", 1), report(zoned, "api_1", 1)])

    assert sorted(approved(zoned)) == sorted([first, other_zone])
    held = decision_of(coordinator, second)
    assert (held.holdKind, held.holdName) == ("budget", "zone:westeurope/1")
    row = next(r for r in history.rows if r.RecordType == "Decision" and r.EventId == second)
    assert (row.HoldKind, row.HoldName, row.Outcome) == ("budget", "zone:westeurope/1", "wait")
    budget = coordinator.parts.store.get_budget("zone:westeurope/1")
    assert budget is not None
    assert list(budget.record.claims) == [first]


def test_competing_events_go_closest_to_notbefore_first(azurite, zoned, tmp_path):
    policy = """
rules:
  - name: one-per-update-domain
    match: {eventType: [Reboot]}
    action: approve-within-budget
    budget: {maxPercent: 10, per: [updateDomain]}
"""
    coordinator, _ = build(azurite, zoned, policy, tmp_path)
    # web_0 and web_1: update domain 0 of scale set web (10% of 2 VMs, rounded up: 1 at a time). The later one
    # is reported first in the batch; the sooner one still gets the slot.
    later, sooner = reboots(coordinator, zoned, ("web_0", 1800), ("web_1", 600))

    assert approved(zoned) == [sooner]
    assert decision_of(coordinator, later).holdName == "updateDomain:web/0"


def test_a_vm_tag_asking_for_a_person_holds_its_event(azurite, zoned, tmp_path):
    policy = """
rules:
  - name: tagged-manual
    match: {tags: {scheduled-events: manual}}
    action: wait-for-person
  - name: reboots
    match: {eventType: [Reboot]}
    action: approve-now
"""
    coordinator, _ = build(azurite, zoned, policy, tmp_path)
    manual, plain = reboots(coordinator, zoned, ("db_0", 900), ("api_1", 900))

    assert approved(zoned) == [plain]
    assert decision_of(coordinator, manual).rule == "tagged-manual"


def test_a_failing_gate_holds_since_it_first_failed_and_the_timer_approves_once_it_passes(
    azurite, zoned, tmp_path, health
):
    url, page = health
    page.status = 503
    policy = f"""
gates:
  app-health: {{http: {{url: "{url}", expectStatus: [200], timeoutSeconds: 2}}}}
rules:
  - name: reboots-while-healthy
    match: {{eventType: [Reboot]}}
    action: approve-now
    gates: [app-health]
"""
    coordinator, history = build(azurite, zoned, policy, tmp_path)
    (event_id,) = reboots(coordinator, zoned, ("web_0", 900))
    assert isinstance(coordinator.parts.clock, Clock)
    coordinator.parts.clock.now += timedelta(seconds=60)
    coordinator.tick()

    assert approved(zoned) == []
    decision = decision_of(coordinator, event_id)
    assert (decision.holdKind, decision.holdName, decision.holdSince) == ("gate", "app-health", DOC_NOW)
    assert "gate 'app-health' is failing (HTTP 503, expected [200])" in decision.reason

    page.status = 200
    coordinator.parts.clock.now += timedelta(seconds=60)
    coordinator.tick()
    assert approved(zoned) == [event_id]
    rows = [r for r in history.rows if r.RecordType == "Decision" and r.EventId == event_id]
    assert [(r.Outcome, r.HoldKind) for r in rows] == [("wait", "gate"), ("approve", "")]


def gate(url: str) -> str:
    """A policy's gate ``app-health``: the page at ``url``, 3 s to answer."""
    return f'gates:\n  app-health: {{http: {{url: "{url}", expectStatus: [200], timeoutSeconds: 3}}}}'


def answer_once_approved(page: Any, imds: ImdsEmulator, *, armed: threading.Event | None = None) -> list[list[str]]:
    """The gate page answers 200 once IMDS has approved something (5 s at most), and notes what it had approved then
    (the list returned); while ``armed`` is given and not set, it answers 503 at once."""
    seen: list[list[str]] = []

    def answer(handler: Any) -> None:
        waits = armed is None or armed.is_set()
        if waits:
            deadline = time.monotonic() + 5
            while not approved(imds) and time.monotonic() < deadline:
                time.sleep(0.02)
            seen.append(approved(imds))
        handler.send_response(200 if waits else 503)
        handler.end_headers()

    page.do_GET = answer
    return seen


def test_a_slow_gate_holds_only_the_events_that_need_it(azurite, zoned, tmp_path, health):
    """A Freeze's gate answers only once the batch's Reboot (whose rule reads no gate) is approved in IMDS: the
    Reboot's approval leaves without waiting for the gate, and the Freeze is decided once the gate has answered,
    in the same batch. Deciding the batch behind the gate, the page would wait out its 3 s deadline instead (the
    Reboot not sent), the gate would be an error and the Freeze held (oracle seed 824)."""
    url, page = health
    seen_first = answer_once_approved(page, zoned)
    policy = f"""{gate(url)}
rules:
  - name: reboots
    match: {{eventType: [Reboot]}}
    action: approve-now
  - name: freezes-while-healthy
    match: {{eventType: [Freeze]}}
    action: approve-now
    gates: [app-health]
"""
    coordinator, history = build(azurite, zoned, policy, tmp_path)
    # The Freeze is the closer to NotBefore: decided first, it would hold the Reboot behind its gate.
    freeze = zoned.create_event(EventType="Freeze", Resources=["api_1"], NoticeSeconds=600)["EventId"]
    reboot = zoned.create_event(EventType="Reboot", Resources=["web_0"], NoticeSeconds=900)["EventId"]
    coordinator.process_batch([report(zoned, "api_1", 1), report(zoned, "web_0", 1)])

    assert seen_first == [[reboot]]
    assert sorted(approved(zoned)) == sorted([freeze, reboot])
    decision = decision_of(coordinator, freeze)
    assert (decision.verdict, decision.rule) == ("approve", "freezes-while-healthy")
    rows = [(r.EventId, r.Outcome) for r in history.rows if r.RecordType == "Decision"]
    assert sorted(rows) == sorted([(freeze, "approve"), (reboot, "approve")])  # one decision each, none undone


def test_a_slow_gate_holds_only_the_events_that_need_it_in_a_tick_too(azurite, zoned, tmp_path, health):
    """The tick decides the Freeze first (the closer NotBefore), whose gate answers only once the Reboot the same
    tick approves at its deadline is approved in IMDS: the tick sends the Reboot's approval before it waits for the
    gate, then approves the Freeze. Waiting for the gate first, the page would wait out its 3 s deadline and the
    Freeze would stay held."""
    url, page = health
    block = threading.Event()  # in the batch, the page fails at once; in the tick, it waits for an approval
    seen_first = answer_once_approved(page, zoned, armed=block)
    policy = f"""{gate(url)}
rules:
  - {{name: freezes-while-healthy, match: {{eventType: [Freeze]}}, action: approve-now, gates: [app-health]}}
  - name: reboots-at-night
    match: {{eventType: [Reboot]}}
    action: approve-now
    window: {{schedule: "0 3 * * *", duration: 1h}}
    onNotBefore: approve
"""
    coordinator, _ = build(azurite, zoned, policy, tmp_path)
    freeze = zoned.create_event(EventType="Freeze", Resources=["api_1"], NoticeSeconds=100)["EventId"]
    reboot = zoned.create_event(EventType="Reboot", Resources=["web_0"], NoticeSeconds=150)["EventId"]
    coordinator.process_batch([report(zoned, "api_1", 1), report(zoned, "web_0", 1)])
    assert approved(zoned) == []  # the gate failing; the Reboot out of its window (DOC_NOW is 22:11 UTC)

    block.set()
    assert isinstance(coordinator.parts.clock, Clock)
    coordinator.parts.clock.now += timedelta(seconds=60)  # within the Reboot's 120 s lead before NotBefore
    coordinator.tick()

    assert seen_first == [[reboot]]
    assert sorted(approved(zoned)) == sorted([freeze, reboot])
    assert decision_of(coordinator, freeze).rule == "freezes-while-healthy"
