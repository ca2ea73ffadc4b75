"""Return to service (domain/returns.py, pipeline/returns.py): after a Reboot completes, each VM it named is watched
until its recover hooks are done and its rule's gates pass for it; an Impact row says how long that took; a VM not
back at the bound is late (a row, one card); until it is back it counts as impacted in the budgets, also for a
coordinator instance that starts afresh. The per-VM gate is a real HTTP page served by this test."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from contracts.approval import ApprovalRequest, ApprovalResult
from contracts.envelope import VmIdentity
from coordinator.adapters.teams import FolderCardSink
from coordinator.domain.lifecycle import EventChange
from coordinator.domain.model import EventRecord
from coordinator.domain.policy_file import PolicyError, parse_policy
from coordinator.domain.returns import RETURN_WATCH_LIMIT, begin
from coordinator.domain.rows import HistoryRow
from coordinator.service import Coordinator
from tests.coordinator.conftest import Clock
from tests.coordinator.helpers import (
    DOC_NOW,
    MemoryHistory,
    decision_record,
    envelope,
    event_record,
    raw_message,
    scheduled_event,
    vm,
)
from tests.coordinator.memory_store import MemoryStateStore
from tests.coordinator.runs import make_coordinator

IDENTITY = {name: vm(name, scale_set="web", index=i + 1) for i, name in enumerate(("web_0", "web_1"))}


def policy(*, gates: str = "", within: int = 600, budget: bool = False) -> str:
    named = ", gates: [ready]" if gates else ""
    ready = f"\n    returnToService: {{withinSeconds: {within}{named}}}"
    action = "approve-within-budget\n    budget: {maxImpacted: 1}" if budget else "approve-now"
    head = f"gates:\n  ready:\n    http: {{url: '{gates}', timeoutSeconds: 2}}\n" if gates else ""
    return f"{head}rules:\n  - name: reboots\n    match: {{eventType: [Reboot]}}\n    action: {action}{ready}\n"


class Listener:
    def send(self, request: ApprovalRequest, *, vm: VmIdentity) -> ApprovalResult:
        return ApprovalResult(outcome="approved", eventId=request.eventId, decisionId=request.decisionId)


class Fleet:
    """web_0 and web_1 of scale set web, each with its forwarder's sequence, driving one coordinator."""

    def __init__(self, tmp: Path, text: str, store: MemoryStateStore | None = None) -> None:
        self.clock = Clock(DOC_NOW)
        self.store = store or MemoryStateStore()
        self.history = MemoryHistory()
        self.tmp = tmp
        self.coordinator = self.build(text)
        self.sequence = dict.fromkeys(IDENTITY, 0)
        self.listed: dict[str, list[dict[str, Any]]] = {name: [] for name in IDENTITY}

    def build(self, text: str) -> Coordinator:
        return make_coordinator(
            store=self.store,
            history=self.history,
            alerts=FolderCardSink(self.tmp / "cards"),
            callback=Listener(),
            policy=parse_policy(text),
            clock=self.clock,
            rng=random.Random(38),
        )

    def _next(self, name: str) -> int:
        self.sequence[name] += 1
        return self.sequence[name]

    def document(self, name: str, event_id: str, status: str | None) -> None:
        """``name``'s document lists the Reboot ``event_id`` Scheduled or Started, or no longer (None)."""
        others = [e for e in self.listed[name] if e["EventId"] != event_id]
        listed = [scheduled_event(event_id, event_type="Reboot", resources=[name], status=status)] if status else []
        self.listed[name] = others + listed
        sequence = self._next(name)
        data = envelope(
            IDENTITY[name],
            sequence=sequence,
            incarnation=sequence,
            events=self.listed[name],
            observed_at=self.clock.now,
        )
        self.coordinator.process_batch([raw_message(IDENTITY[name], data)])

    def recovered(self, name: str, event_id: str, outcome: str = "not-run") -> None:
        steps = [] if outcome == "not-run" else [{"hook": "10-undrain", "outcome": outcome, "durationSeconds": 1.0}]
        hook = {"eventId": event_id, "phase": "recover", "outcome": outcome, "durationSeconds": 1.0, "steps": steps}
        data = envelope(IDENTITY[name], sequence=self._next(name), kind="hook", hook=hook, observed_at=self.clock.now)
        self.coordinator.process_batch([raw_message(IDENTITY[name], data)])

    def rebooted(self, name: str, event_id: str) -> None:
        """Scheduled (approved at once), Started, then gone: the event completes."""
        self.document(name, event_id, "Scheduled")
        self.clock.now += timedelta(seconds=5)
        self.document(name, event_id, "Started")
        self.clock.now += timedelta(seconds=60)
        self.document(name, event_id, None)

    def record(self, event_id: str) -> EventRecord:
        stored = self.coordinator.event(event_id)
        assert stored is not None
        return stored.record

    def returns(self) -> list[HistoryRow]:
        return [r for r in self.history.rows if r.ImpactMeasure == "return-to-service"]


def test_back_once_its_recover_hooks_are_done_with_the_seconds_since_the_completion(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, policy())
    fleet.rebooted("web_0", "E-0")
    record = fleet.record("E-0")
    assert record.state == "Completed"
    assert record.returning == ["web_0"]
    assert record.returnToService is not None
    assert record.returnToService.vms["web_0"].waiting == "recover hooks not reported yet"
    completed = record.stateSince
    fleet.clock.now += timedelta(seconds=42)
    fleet.recovered("web_0", "E-0", "succeeded")
    record = fleet.record("E-0")
    assert record.returning == []
    assert record.returnToService is not None
    assert record.returnToService.doneAt == fleet.clock.now
    [row] = fleet.returns()
    assert (row.VmName, row.Outcome, row.Rule) == ("web_0", "back", "reboots")
    assert row.ReturnToServiceSeconds == pytest.approx((fleet.clock.now - completed).total_seconds())
    assert row.ImpactStart == completed
    assert row.ImpactEnd == fleet.clock.now


def test_a_vm_not_back_holds_its_budget_slot_until_it_is_also_for_a_fresh_instance(tmp_path: Path) -> None:
    text = policy(budget=True)
    fleet = Fleet(tmp_path, text)
    fleet.rebooted("web_0", "E-0")
    fleet.document("web_1", "E-1", "Scheduled")
    assert fleet.record("E-1").state == "Scheduled"
    decision = fleet.record("E-1").decision
    assert decision is not None
    assert decision.holdKind == "budget"
    # Another instance, its caches empty, loads the event whose VM is not back and holds the slot too.
    fresh = Fleet(tmp_path, text, store=fleet.store)
    fresh.clock.now = fleet.clock.now + timedelta(seconds=60)
    fresh.coordinator.tick()
    assert fresh.record("E-1").state == "Scheduled"
    fleet.clock.now = fresh.clock.now + timedelta(seconds=5)
    fleet.recovered("web_0", "E-0")
    fleet.clock.now += timedelta(seconds=60)
    fleet.coordinator.tick()
    assert fleet.record("E-1").state == "Approved"
    assert [r.Outcome for r in fleet.returns()] == ["back"]


def test_late_at_the_bound_with_one_card_then_abandoned_a_day_later(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, policy(within=300))
    fleet.rebooted("web_0", "E-0")
    fleet.recovered("web_0", "E-0", "failed")
    fleet.clock.now += timedelta(seconds=200)
    fleet.coordinator.tick()
    assert fleet.returns() == []
    fleet.clock.now += timedelta(seconds=120)
    fleet.coordinator.tick()
    fleet.clock.now += timedelta(seconds=60)
    fleet.coordinator.tick()
    [late] = fleet.returns()
    assert (late.Outcome, late.ReturnToServiceSeconds) == ("late", None)
    assert "recover hooks failed (10-undrain)" in late.Reason
    record = fleet.record("E-0")
    assert record.alerts.count("return-late") == 1
    assert record.returning == ["web_0"]
    cards = [p.read_text() for p in (tmp_path / "cards").iterdir()]
    assert sum("Not back in service in time" in c for c in cards) == 1
    fleet.clock.now += RETURN_WATCH_LIMIT
    fleet.coordinator.tick()
    assert [r.Outcome for r in fleet.returns()] == ["late", "abandoned"]
    assert fleet.record("E-0").returning == []


class Readiness:
    """A load balancer's view of each backend: /ready/<vm> answers 503 until the test says it is in."""

    def __init__(self) -> None:
        self.ready: set[str] = set()
        self.asked: list[str] = []
        pages = self

        class Page(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                name = self.path.rsplit("/", 1)[-1]
                pages.asked.append(name)
                self.send_response(200 if name in pages.ready else 503)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/ready/{{vm}}"


@pytest.fixture
def readiness() -> Iterator[Readiness]:
    pages = Readiness()
    yield pages
    pages.server.shutdown()
    pages.server.server_close()


def test_back_only_once_its_own_readiness_page_passes_read_by_the_timer(tmp_path: Path, readiness: Readiness) -> None:
    fleet = Fleet(tmp_path, policy(gates=readiness.url))
    fleet.rebooted("web_0", "E-0")
    fleet.recovered("web_0", "E-0")
    assert readiness.asked == []  # a batch reads no gate for one VM
    fleet.clock.now += timedelta(seconds=60)
    fleet.coordinator.tick()
    assert readiness.asked == ["web_0"]
    record = fleet.record("E-0")
    assert record.returning == ["web_0"]
    assert record.returnToService is not None
    assert record.returnToService.vms["web_0"].waiting.startswith("gate ready failing (HTTP 503")
    readiness.ready.add("web_0")
    fleet.clock.now += timedelta(seconds=60)
    fleet.coordinator.tick()
    [row] = fleet.returns()
    assert row.Outcome == "back"
    assert row.ReturnToServiceSeconds == pytest.approx(120.0)


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (
            "gates:\n  ready: {http: {url: 'http://lb/{vm}'}}\n"
            "rules:\n  - {name: r, action: approve-now, gates: [ready]}\n",
            "a gate read for one VM serves only 'returnToService'",
        ),
        (
            "rules:\n  - {name: r, action: approve-now, returnToService: {withinSeconds: 600, gates: [nope]}}\n",
            "returnToService names gates ['nope']",
        ),
        ("rules:\n  - {name: r, action: approve-now, returnToService: {withinSeconds: 10}}\n", "withinSeconds"),
    ],
)
def test_a_policy_that_cannot_say_back_is_refused_at_load(text: str, said: str) -> None:
    with pytest.raises(PolicyError, match=said.replace("[", r"\[").replace("]", r"\]")):
        parse_policy(text)


def test_a_gate_read_for_one_vm_names_it_encoded_and_refuses_a_name_that_is_not_azures() -> None:
    example = parse_policy(
        "gates:\n"
        "  lb: {http: {url: 'https://lb.example.com/backends/{vm}?pool=web'}}\n"
        "  logs: {logQuery: {workspaceId: '00000000-0000-0000-0000-000000000000', query: \"H | where Vm == '{vm}'\"}}\n"
        "rules:\n  - {name: r, action: approve-now, returnToService: {withinSeconds: 60, gates: [lb, logs]}}\n"
    )
    lb, logs = example.gates["lb"], example.gates["logs"]
    assert lb.per_vm
    assert logs.per_vm
    assert lb.for_vm("web_0").http is not None
    assert lb.for_vm("web_0").http.url == "https://lb.example.com/backends/web_0?pool=web"  # type: ignore[union-attr]
    assert logs.for_vm("db-1.a").logQuery.query == "H | where Vm == 'db-1.a'"  # type: ignore[union-attr]
    for name in ("web_0' or 1 == 1", "a/b", "", "-x"):
        with pytest.raises(ValueError, match="cannot be put in a gate"):
            lb.for_vm(name)


@pytest.mark.parametrize(("ago", "watched"), [(10, True), (599, True), (601, False), (86400, False)])
def test_only_an_event_that_completed_within_its_bound_is_watched(ago: int, watched: bool) -> None:
    """An event that completed before the watch existed, touched again by a late report long after, raises no
    late card: its moment has passed."""
    sighting = {"firstSeen": DOC_NOW, "lastSeen": DOC_NOW, "lastSequence": 3, "status": "Gone"}
    record = event_record(
        "E-OLD",
        state="Completed",
        resources=["web_0"],
        stateSince=DOC_NOW - timedelta(seconds=ago),
        decision=decision_record(rule="reboots", action="approve-now", verdict="approve"),
        vms={"web_0": sighting},
    )
    change = EventChange(record=record)
    begin(parse_policy(policy(within=600)), change, DOC_NOW)
    assert (record.returnToService is not None) == watched
    assert change.changed == watched


def test_the_ticks_reads_for_vms_of_different_events_share_one_pool(tmp_path: Path) -> None:
    """web_0's and web_1's Reboots, two events, both recovered: their pages answer 200 only while both are being read
    at once (a barrier of two), so both VMs are back in one tick only if their reads are not one event after the
    other."""
    together = threading.Barrier(2, timeout=1.5)

    class Page(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            try:
                together.wait()
                status = 200
            except threading.BrokenBarrierError:
                status = 503
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        fleet = Fleet(tmp_path, policy(gates=f"http://127.0.0.1:{server.server_address[1]}/ready/{{vm}}"))
        fleet.rebooted("web_0", "E-0")
        fleet.rebooted("web_1", "E-1")
        fleet.recovered("web_0", "E-0")
        fleet.recovered("web_1", "E-1")
        fleet.clock.now += timedelta(seconds=60)
        fleet.coordinator.tick()
        assert sorted((r.EventId, r.Outcome) for r in fleet.returns()) == [("E-0", "back"), ("E-1", "back")]
    finally:
        server.shutdown()
        server.server_close()
