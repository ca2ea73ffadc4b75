"""Deliver's outcomes written together (coordinator/pipeline/act.py): the outcomes of sends whose records the run's
own deciding write left go to the table in one transaction per event partition with their rows, and one that
another instance wrote meanwhile is committed on its own, on what was written, once."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from coordinator.domain.model import EventRecord
from coordinator.pipeline import act
from coordinator.pipeline.run import Delivery, Run
from coordinator.state.entities import event_partition
from coordinator.state.events import read_event
from coordinator.state.store import RecordTooLarge, Staged
from tests.coordinator.helpers import approval_record, event_record
from tests.coordinator.memory_store import MemoryStateStore
from tests.coordinator.runs import NOT_BEFORE, Bench, RecordingCallback, put_event

# EV-0 and EV-2 share an event partition, EV-1 is in another.
SAME, OTHER = ("EV-0", "EV-2"), "EV-1"


class Counting(MemoryStateStore):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def save_event(self, record: EventRecord, etag: str | None, *, staged: Sequence[Staged] = ()) -> str:
        self.calls["save_event"] += 1
        return super().save_event(record, etag, staged=staged)

    def save_events(
        self, items: Sequence[tuple[EventRecord, str | None]], *, staged: Sequence[Staged] = ()
    ) -> list[str]:
        self.calls["save_events"] += 1
        return super().save_events(items, staged=staged)


def decided(bench: Bench, *event_ids: str) -> Run:
    """A run whose deciding write left these approved Freezes (their records and ETags), two VMs each."""
    run = bench.run()
    for n, event_id in enumerate(event_ids):
        approval = approval_record(decisionId=f"d-{event_id}", rule="short-freeze", actor="rule:short-freeze")
        vms = (f"WestNO_{2 * n}", f"WestNO_{2 * n + 1}")
        fields: dict[str, Any] = {"eventType": "Freeze", "durationInSeconds": 5, "notBefore": NOT_BEFORE}
        put_event(bench.store, event_id, vms=vms, approval=approval, **fields)
        stored = read_event(bench.store, event_id)
        assert stored is not None
        assert stored.etag is not None
        run.work.records[event_id], run.work.etags[event_id] = stored.record, stored.etag
    run.work.deliveries = list(event_ids)
    return run


def test_outcomes_are_written_in_one_transaction_per_event_partition() -> None:
    assert event_partition(SAME[0]) == event_partition(SAME[1]) != event_partition(OTHER)
    store = Counting()
    bench = Bench(store=store)
    run = decided(bench, *SAME, OTHER)
    store.calls.clear()

    act.deliver(run, last_seen=None)

    assert store.calls == {"save_events": 2}
    for event_id in (*SAME, OTHER):
        record = bench.event(event_id)
        assert record.state == "Approved"
        assert record.approval is not None
        assert record.approval.attempts == 1
    assert run.report.approvals_sent == 3
    assert Counter(r.EventId for r in run.work.rows if r.Outcome == "approved") == {e: 1 for e in (*SAME, OTHER)}


def test_an_event_another_instance_wrote_meanwhile_is_committed_on_its_own_once() -> None:
    store = Counting()
    bench = Bench(store=store)
    run = decided(bench, *SAME)
    stored = read_event(store, SAME[1])
    assert stored is not None
    store.save_event(stored.record.model_copy(update={"description": "touched elsewhere"}), stored.etag)
    store.calls.clear()

    act.deliver(run, last_seen=None)

    # The transaction of the two is refused whole; each is then committed on its own, the touched one again after
    # reading what was written (the memory store's save_event is a transaction of one: save_events 1 + 3).
    assert store.calls == {"save_events": 4, "save_event": 3}
    assert [bench.event(e).state for e in SAME] == ["Approved", "Approved"]
    assert bench.event(SAME[1]).description == "touched elsewhere"
    assert Counter(r.EventId for r in run.work.rows if r.Outcome == "approved") == {SAME[0]: 1, SAME[1]: 1}


def plan(n: int) -> Delivery:
    return Delivery(event_id=f"EV-{n}", decision_id=f"d-{n}", executor="WestNO_0", callback=RecordingCallback())


def test_outcomes_are_cut_so_that_each_write_is_one_transaction() -> None:
    large = {f"EV-{n}": event_record(f"EV-{n}", description="x" * 300_000) for n in range(8)}
    small = {f"EV-{n}": event_record(f"EV-{n}") for n in range(30)}

    by_size = [[p.event_id for p in part] for part in act._transactions([plan(n) for n in range(8)], large)]
    by_count = [len(part) for part in act._transactions([plan(n) for n in range(30)], small)]

    # About 300,000 characters a record: three a transaction stay under TOGETHER_CHARS; small ones 25 at most.
    assert by_size == [["EV-0", "EV-1", "EV-2"], ["EV-3", "EV-4", "EV-5"], ["EV-6", "EV-7"]]
    assert by_count == [act.TOGETHER, 30 - act.TOGETHER]


def test_a_record_too_large_among_them_costs_the_others_nothing() -> None:
    class RefusesTogether(Counting):
        def save_events(
            self, items: Sequence[tuple[EventRecord, str | None]], *, staged: Sequence[Staged] = ()
        ) -> list[str]:
            if len(items) > 1:
                raise RecordTooLarge("one of them is too large to store")
            return super().save_events(items, staged=staged)

    store = RefusesTogether()
    bench = Bench(store=store)
    run = decided(bench, *SAME)

    act.deliver(run, last_seen=None)

    assert [bench.event(e).state for e in SAME] == ["Approved", "Approved"]
    assert Counter(r.EventId for r in run.work.rows if r.Outcome == "approved") == {SAME[0]: 1, SAME[1]: 1}
