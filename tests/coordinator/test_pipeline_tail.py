"""The tail (coordinator/pipeline/tail.py) every run ends with: approvals out, then cards, then budgets freed, then
history, in that order, whatever started the run; the timer's tail clears the outboxes instead of logging."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from contracts.approval import ApprovalRequest, ApprovalResult
from contracts.envelope import VmIdentity
from coordinator.domain.claims import BudgetClaim, BudgetRecord
from coordinator.domain.history_rows import dead_letter_row
from coordinator.domain.model import ApprovalRecord
from coordinator.domain.rows import HistoryRow
from coordinator.pipeline import tail
from coordinator.pipeline.run import Run
from tests.coordinator.helpers import DOC_NOW, MemoryHistory, event_record
from tests.coordinator.memory_store import MemoryStateStore
from tests.coordinator.runs import NOT_BEFORE, Bench, RecordingAlerts, RecordingCallback, put_event

TAIL = ["deliver", "cards", "budgets", "history"]


class Journal:
    """What each part was asked to do, in the order asked, across the parts."""

    def __init__(self) -> None:
        self.entries: list[str] = []


class JournaledCallback(RecordingCallback):
    def __init__(self, journal: Journal) -> None:
        super().__init__()
        self.journal = journal

    def send(self, request: ApprovalRequest, *, vm: VmIdentity) -> ApprovalResult:
        self.journal.entries.append("deliver")
        return super().send(request, vm=vm)


class JournaledAlerts(RecordingAlerts):
    def __init__(self, journal: Journal) -> None:
        super().__init__()
        self.journal = journal

    def send(self, card: dict[str, Any], *, key: str) -> None:
        self.journal.entries.append("cards")
        super().send(card, key=key)


class JournaledStore(MemoryStateStore):
    def __init__(self, journal: Journal) -> None:
        super().__init__()
        self.journal = journal

    def save_budget(self, record: BudgetRecord, etag: str | None) -> str:
        self.journal.entries.append("budgets")
        return super().save_budget(record, etag)


class JournaledHistory(MemoryHistory):
    def __init__(self, journal: Journal) -> None:
        super().__init__()
        self.journal = journal

    def write(self, rows: Sequence[HistoryRow]) -> None:
        self.journal.entries.append("history")
        super().write(rows)


def busy_run(bench: Bench) -> Run:
    """A run with something for every step: an approval to deliver (whose answer raises a card), a concluded
    event holding a budget slot, and a history row of its own."""
    approval = ApprovalRecord(decisionId="d-1", rule="short-freeze", actor="rule:short-freeze", decidedAt=DOC_NOW)
    put_event(bench.store, "EV-F", eventType="Freeze", durationInSeconds=5, notBefore=NOT_BEFORE, approval=approval)
    claim = BudgetClaim(eventId="EV-DONE", vms=["web_0"], claimedAt=DOC_NOW)
    bench.store.save_budget(BudgetRecord(scaleSet="web", claims={"EV-DONE": claim}), None)
    run = bench.run()
    run.work.deliveries = ["EV-F"]
    done = approval.model_copy(update={"budgetKeys": ["web"], "delivered": True})
    run.work.records["EV-DONE"] = event_record("EV-DONE", state="Completed", resources=["web_0"], approval=done)
    run.work.rows = [dead_letter_row(now=DOC_NOW, reason="a message of this batch", details={})]
    return run


def test_the_tail_delivers_then_posts_cards_then_frees_budgets_then_writes_history():
    journal = Journal()
    bench = Bench(
        store=JournaledStore(journal),
        history=JournaledHistory(journal),
        alerts=JournaledAlerts(journal),
        callback=JournaledCallback(journal),
    )
    try:
        run = busy_run(bench)
        journal.entries.clear()  # what setting up stored is not the tail's
        tail.finish(run)
    finally:
        bench.close()
    assert run.stages == TAIL
    # The approval leaves first (issue 23: right after its deciding write); every history row, its intent among
    # them, is written last.
    assert journal.entries == ["deliver", "cards", "budgets", "history"]
    assert [r.RecordType for r in bench.history.rows] == ["DeadLetter", "Approval", "Approval", "Transition", "Alert"]
    assert bench.alerts.keys == ["EV-F-approved"]
    budget = bench.store.get_budget("web")
    assert budget is not None
    assert budget.record.claims == {}
    assert run.report.history_rows == 5
    assert run.work.rows == []


def test_a_batchs_tail_logs_the_cards_it_sent_and_leaves_the_outbox_to_the_timer(bench: Bench):
    run = busy_run(bench)
    tail.finish(run)
    [(_, log)] = bench.store.sent_alert_logs()
    assert log.events == {"EV-F": ["approved"]}
    assert bench.event("EV-F").pendingAlerts == ["approved"]


def test_the_timers_tail_clears_the_outbox_and_logs_nothing(bench: Bench):
    run = busy_run(bench)
    tail.finish(run, last_seen={"WestNO_0": DOC_NOW}, settled=tail.Settled(events={}, vms={}))
    assert run.stages == TAIL
    assert bench.alerts.keys == ["EV-F-approved"]
    assert bench.store.sent_alert_logs() == []
    assert bench.event("EV-F").pendingAlerts == []


def test_a_run_with_nothing_to_do_still_takes_every_step_and_writes_nothing(bench: Bench):
    run = bench.run("person")
    tail.finish(run)
    assert run.stages == TAIL
    assert (bench.callback.sent, bench.alerts.cards, bench.history.rows) == ([], [], [])
    assert bench.store.sent_alert_logs() == []
