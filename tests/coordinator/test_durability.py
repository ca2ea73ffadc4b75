"""No history row lost, none doubled, when the process stops anywhere in a run (issue 33): every row is in the state's
outbox before the sink sees it, the rows of a write with that write (coordinator/pipeline/record.py), and the timer
writes what a run that stopped did not. Each test plays a process that stops at one point (a tail that never runs, a
send that never returns), then another instance's batch or tick, on the in-memory store; what the history holds is
checked by RecordId, and what the listener executed by decisionId (a listener executes a decisionId once).
tests/coordinator/test_hostile.py plays the same on Azurite with the IMDS emulator's listener."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta

import pytest

from contracts.approval import ApprovalRequest, ApprovalResult
from contracts.envelope import VmIdentity
from coordinator.domain.policy_file import DEFAULT_POLICY_PATH, load_policy
from coordinator.domain.rows import HistoryRow
from coordinator.pipeline.decide import IN_FLIGHT_GRACE
from coordinator.pipeline.ingest import RawMessage
from coordinator.pipeline.record import OUTBOX_GRACE
from coordinator.service import Coordinator
from coordinator.state.store import SetAside
from tests.coordinator.helpers import DOC_NOW, MemoryHistory, envelope, scheduled_event, vm
from tests.coordinator.memory_store import MemoryStateStore
from tests.coordinator.runs import RecordingAlerts, make_coordinator, message


class Listener:
    """A VM's listener as the forwarder's: executes a decisionId once (its ledger), answers a repeat from the
    ledger. ``dies``: the process that sent the request stops as the answer comes back."""

    def __init__(self) -> None:
        self.executed: dict[str, list[str]] = {}
        self.dies = False

    def send(self, request: ApprovalRequest, *, vm: VmIdentity) -> ApprovalResult:
        done = self.executed.setdefault(request.eventId, [])
        if request.decisionId not in done:
            done.append(request.decisionId)
        if self.dies:
            raise KeyboardInterrupt  # stands for the coordinator's process being killed
        return ApprovalResult(
            outcome="approved", eventId=request.eventId, decisionId=request.decisionId, documentIncarnation=1
        )


def coordinator(
    store: MemoryStateStore,
    history: MemoryHistory,
    listener: Listener,
    now: datetime,
    after_batch: ThreadPoolExecutor | None = None,
    *,
    alerts: RecordingAlerts | None = None,
) -> Coordinator:
    return make_coordinator(
        store=store,
        history=history,
        alerts=alerts or RecordingAlerts(),
        callback=listener,
        policy=load_policy(DEFAULT_POLICY_PATH),
        clock=lambda: now,
        after_batch=after_batch,
    )


def freeze(event_id: str, name: str = "WestNO_0", sequence: int = 1) -> RawMessage:
    """A short Freeze of ``name`` alone: the default policy approves it at once."""
    event = scheduled_event(event_id, resources=[name])
    return message(envelope(vm(name, index=1), sequence=sequence, incarnation=sequence, events=[event]))


def reboot(event_id: str, name: str = "WestNO_0") -> RawMessage:
    """The platform's Reboot: the default policy waits for a person."""
    event = scheduled_event(event_id, event_type="Reboot", resources=[name], duration=-1)
    return message(envelope(vm(name, index=1), sequence=1, incarnation=1, events=[event]))


def died_sending_freeze() -> tuple[MemoryStateStore, MemoryHistory, Listener]:
    """A batch that decided EV-A, a Freeze of WestNO_0, and whose process died as the listener's answer came back
    (the listener executed it). The listener answers again from then on."""
    store, history, listener = MemoryStateStore(), MemoryHistory(), Listener()
    listener.dies = True
    with pytest.raises(KeyboardInterrupt):
        coordinator(store, history, listener, DOC_NOW).run_batch([freeze("EV-A")])
    listener.dies = False
    return store, history, listener


def of(history: MemoryHistory, event_id: str) -> list[HistoryRow]:
    rows = [row for row in history.rows if row.EventId == event_id]
    assert len({row.RecordId for row in rows}) == len(rows), "a row written twice"
    return rows


def kinds(rows: list[HistoryRow], at: datetime) -> list[tuple[str, str]]:
    """The rows made at ``at`` (one run's), by type and outcome, in order of type."""
    return sorted((row.RecordType, row.Outcome) for row in rows if row.TimeGenerated == at)


def test_a_batch_whose_tail_never_ran_loses_no_row_and_the_timer_writes_each_once():
    """The process stops once the batch has returned (its tail never runs: the executor is gone). Before, its rows
    lived only in the tail's memory: the Observation and the intent were lost, and the timer made up a Decision."""
    store, history, listener = MemoryStateStore(), MemoryHistory(), Listener()
    stopped = ThreadPoolExecutor(max_workers=1)
    stopped.shutdown()
    coordinator(store, history, listener, DOC_NOW, after_batch=stopped).run_batch([freeze("EV-A")])
    assert history.rows == []
    kept = {row.RecordId for entry in store.outbox() for row in entry.rows}

    # Another instance's timer, once the approval's in-flight grace has passed.
    later = DOC_NOW + IN_FLIGHT_GRACE + timedelta(seconds=1)
    coordinator(store, history, listener, later).tick()
    rows = of(history, "EV-A")
    assert kinds(rows, DOC_NOW) == [("Approval", "sending"), ("Decision", "approve"), ("Observation", "")]
    assert kept <= {row.RecordId for row in history.rows}  # every row the batch made, once
    outcomes = [(row.RecordType, row.Outcome) for row in rows if row.TimeGenerated == later]
    assert [outcome for kind, outcome in outcomes if kind == "Approval"] == ["unknown", "sending", "approved"]
    assert len(listener.executed["EV-A"]) == 1  # the same decision sent again: executed once
    assert store.outbox() == []


def test_a_batch_that_dies_sending_is_replayed_and_each_row_is_written_once():
    """The process dies while the approval is on its way: after the deciding write, before the VM positions. Event
    Hubs delivers the batch again to another instance (no checkpoint): the sighting's Observation row is made again
    (its position was never written, nor its row), the Decision and the intent are not (they were committed with
    the deciding write)."""
    store, history, listener = died_sending_freeze()
    assert history.rows == []
    kept = [(r.RecordType, r.Outcome) for entry in store.outbox() for r in entry.rows]
    assert kept == [("Decision", "approve"), ("Approval", "sending")]

    replayed = DOC_NOW + timedelta(seconds=30)
    coordinator(store, history, listener, replayed).run_batch([freeze("EV-A")])
    later = DOC_NOW + IN_FLIGHT_GRACE + timedelta(seconds=1)
    coordinator(store, history, listener, later).tick()
    rows = of(history, "EV-A")
    assert kinds(rows, DOC_NOW) == [("Approval", "sending"), ("Decision", "approve")]
    assert kinds(rows, replayed) == [("Observation", "")]
    assert [row.RecordType for row in rows].count("Decision") == 1
    assert len(listener.executed["EV-A"]) == 1
    assert store.outbox() == []


def test_a_persons_approval_that_dies_sending_leaves_its_decision_and_intent_to_the_timer():
    store, history, listener = MemoryStateStore(), MemoryHistory(), Listener()
    coordinator(store, history, listener, DOC_NOW).run_batch([reboot("EV-R")])  # waits for a person
    approving = DOC_NOW + timedelta(minutes=1)
    listener.dies = True
    with pytest.raises(KeyboardInterrupt):
        coordinator(store, history, listener, approving).approve_manually("EV-R", person="ops@example.com")
    assert kinds(of(history, "EV-R"), approving) == []

    listener.dies = False
    later = approving + max(IN_FLIGHT_GRACE, OUTBOX_GRACE) + timedelta(seconds=1)
    coordinator(store, history, listener, later).tick()
    rows = of(history, "EV-R")
    assert kinds(rows, approving) == [("Approval", "sending"), ("Decision", "approve")]
    assert rows[[r.TimeGenerated for r in rows].index(approving)].Actor == "person:ops@example.com"
    assert len(listener.executed["EV-R"]) == 1
    assert store.outbox() == []


def test_a_tick_that_runs_while_a_tail_is_still_writing_leaves_its_rows_to_it():
    """The timer takes over only rows older than OUTBOX_GRACE: a batch's tail still running writes its own."""
    store, history, listener = MemoryStateStore(), MemoryHistory(), Listener()
    stopped = ThreadPoolExecutor(max_workers=1)
    stopped.shutdown()
    coordinator(store, history, listener, DOC_NOW, after_batch=stopped).run_batch([freeze("EV-A")])
    coordinator(store, history, listener, DOC_NOW + OUTBOX_GRACE - timedelta(seconds=1)).tick()
    assert kinds(of(history, "EV-A"), DOC_NOW) == []
    assert store.outbox() != []


def test_an_approval_whose_sender_died_gets_an_outcome_row_when_its_event_started_before_any_retry():
    """The process dies while the approval is on its way (the listener executed it), and the VM reports the event
    Started before the in-flight grace has passed: no retry comes (the event left Scheduled), so nothing would ever
    record the approval's outcome. The timer records what is known, once: an Approval row ``unknown``."""
    store, history, listener = died_sending_freeze()
    started = scheduled_event("EV-A", resources=["WestNO_0"], status="Started")
    seen = DOC_NOW + timedelta(seconds=5)
    coordinator(store, history, listener, seen).run_batch(
        [
            freeze("EV-A"),  # the batch again (no checkpoint), then the VM's next document
            message(envelope(vm("WestNO_0", index=1), sequence=2, incarnation=2, events=[started])),
        ]
    )
    later = DOC_NOW + IN_FLIGHT_GRACE + timedelta(seconds=1)
    coordinator(store, history, listener, later).tick()
    coordinator(store, history, listener, later + timedelta(minutes=1)).tick()
    rows = of(history, "EV-A")
    approvals = [(row.Outcome, row.TimeGenerated) for row in rows if row.RecordType == "Approval"]
    assert approvals == [("sending", DOC_NOW), ("unknown", later)], approvals
    (unknown,) = [row for row in rows if row.RecordType == "Approval" and row.Outcome == "unknown"]
    assert "Started" in unknown.Reason
    assert unknown.DecisionId == next(r.DecisionId for r in rows if r.RecordType == "Decision")
    assert listener.executed["EV-A"] == [unknown.DecisionId]  # nothing sent again
    assert store.outbox() == []


def test_an_approval_whose_sender_died_gets_an_outcome_row_when_its_event_concluded_before_any_retry():
    """As above, but the short Freeze is over (gone from the VM's document: Completed) before the grace has passed:
    the concluded event stays in the timer's view until its approval's outcome is recorded, then leaves it."""
    store, history, listener = died_sending_freeze()
    started = scheduled_event("EV-A", resources=["WestNO_0"], status="Started")
    identity = vm("WestNO_0", index=1)
    seen = DOC_NOW + timedelta(seconds=5)
    coordinator(store, history, listener, seen).run_batch(
        [
            message(envelope(identity, sequence=2, incarnation=2, events=[started])),
            message(envelope(identity, sequence=3, incarnation=3, events=[])),
        ]
    )
    (record,) = [s.record for s in store.closed_events_with_pending_alerts()]
    assert (record.state, record.awaiting_outcome) == ("Completed", True)
    coordinator(store, history, listener, seen + timedelta(seconds=1)).tick()  # within the grace: not yet
    later = DOC_NOW + IN_FLIGHT_GRACE + timedelta(seconds=1)
    coordinator(store, history, listener, later).tick()
    coordinator(store, history, listener, later + timedelta(minutes=1)).tick()
    approvals = [(row.Outcome, row.TimeGenerated) for row in of(history, "EV-A") if row.RecordType == "Approval"]
    assert approvals == [("sending", DOC_NOW), ("unknown", later)], approvals
    assert store.closed_events_with_pending_alerts() == []
    assert len(listener.executed["EV-A"]) == 1
    assert store.outbox() == []


class StopsAfterCards(MemoryStateStore):
    """The state store of a process that stops right after its cards were posted and logged as sent, before the
    rest of its tail (``stopping``: the next read of set-aside entities, the history step's first)."""

    stopping = False

    def set_aside(self) -> list[SetAside]:
        if self.stopping:
            self.stopping = False
            raise KeyboardInterrupt  # stands for the coordinator's process being killed
        return super().set_aside()


def test_a_cards_alert_row_survives_a_process_that_stops_after_logging_the_card_sent():
    """The card is posted and logged as sent (so no run posts it again), then the process stops before its history
    step: the card's Alert row was stored in the outbox before the log, and the timer writes it, once."""
    store, listener = StopsAfterCards(), Listener()
    store.stopping = True
    alerts = RecordingAlerts()
    with pytest.raises(KeyboardInterrupt):
        coordinator(store, MemoryHistory(), listener, DOC_NOW, alerts=alerts).run_batch([reboot("EV-R")])
    assert len(alerts.cards) == 1
    assert store.sent_alert_logs(), "the card was logged as sent"
    history = MemoryHistory()
    later = DOC_NOW + OUTBOX_GRACE + timedelta(seconds=1)
    timer = coordinator(store, history, listener, later, alerts=alerts)
    timer.tick()
    timer.tick()
    assert [(row.RecordType, row.Outcome) for row in of(history, "EV-R") if row.RecordType == "Alert"] == [
        ("Alert", "sent")
    ]
    assert len(alerts.cards) == 1, "the card was not posted again"
    assert store.outbox() == []
