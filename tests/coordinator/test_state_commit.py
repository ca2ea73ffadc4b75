"""``commit.commit``, the one read-modify-write with ETags, on the in-memory store: what it writes, how it redoes
after a conflict, when it gives up."""

from __future__ import annotations

import pytest

from coordinator.domain.claims import BudgetClaim, BudgetRecord
from coordinator.state.commit import COMMIT_ATTEMPTS, commit
from coordinator.state.store import ConcurrencyConflict, RecordTooLarge, Stored
from tests.coordinator.helpers import DOC_NOW
from tests.coordinator.memory_store import MemoryStateStore


def with_claim(record: BudgetRecord, event_id: str) -> BudgetRecord:
    claim = BudgetClaim(eventId=event_id, vms=["web_0"], claimedAt=DOC_NOW)
    return record.model_copy(update={"claims": {**record.claims, event_id: claim}})


class Budget:
    """A commit of one claim on the budget ``web``, counting its reads, writes and conflicts; ``meddle`` runs
    between its read and its write (another instance writing first) while it returns True."""

    def __init__(self, store: MemoryStateStore, event_id: str) -> None:
        self.store = store
        self.event_id = event_id
        self.reads: list[int] = []
        self.writes = 0
        self.conflicts = 0
        self.meddling = 0

    def read(self, attempt: int) -> Stored[BudgetRecord]:
        self.reads.append(attempt)
        stored = self.store.get_budget("web")
        assert stored is not None
        return stored

    def mutate(self, stored: Stored[BudgetRecord]) -> BudgetRecord | None:
        if self.event_id in stored.record.claims:
            return None
        if self.meddling:
            self.meddling -= 1
            self.store.save_budget(with_claim(stored.record, f"other-{self.meddling}"), stored.etag)
        return with_claim(stored.record, self.event_id)

    def write(self, record: BudgetRecord, stored: Stored[BudgetRecord]) -> str:
        self.writes += 1
        return self.store.save_budget(record, stored.etag)

    def count(self) -> None:
        self.conflicts += 1

    def commit(self, *, attempts: int = COMMIT_ATTEMPTS) -> BudgetRecord | None:
        return commit(self.read, self.mutate, self.write, what="budget web", attempts=attempts, on_conflict=self.count)


@pytest.fixture
def store() -> MemoryStateStore:
    store = MemoryStateStore()
    store.save_budget(BudgetRecord(scaleSet="web"), None)
    return store


def test_what_mutate_gives_is_written_with_the_etag_read_and_returned(store):
    budget = Budget(store, "EV-1")

    written = budget.commit()

    assert written == with_claim(BudgetRecord(scaleSet="web"), "EV-1")
    assert store.get_budget("web") == Stored(written, store.get_budget("web").etag)
    assert (budget.reads, budget.writes, budget.conflicts) == ([0], 1, 0)


def test_nothing_to_write_writes_nothing(store):
    budget = Budget(store, "EV-1")
    budget.commit()
    etag = store.get_budget("web").etag

    assert budget.commit() is None
    assert budget.writes == 1
    assert store.get_budget("web").etag == etag


def test_a_conflict_reads_again_and_redoes_on_what_the_other_wrote(store):
    budget = Budget(store, "EV-1")
    budget.meddling = 2

    written = budget.commit()

    assert written is not None
    assert sorted(written.claims) == ["EV-1", "other-0", "other-1"]  # nothing the others wrote is lost
    assert store.get_budget("web").record == written
    assert (budget.reads, budget.writes, budget.conflicts) == ([0, 1, 2], 3, 2)


def test_it_gives_up_naming_what_after_every_attempt_conflicted(store):
    budget = Budget(store, "EV-1")
    budget.meddling = COMMIT_ATTEMPTS

    with pytest.raises(ConcurrencyConflict, match=f"budget web: gave up after {COMMIT_ATTEMPTS} conflicting writes"):
        budget.commit()

    assert budget.reads == list(range(COMMIT_ATTEMPTS))
    assert budget.conflicts == COMMIT_ATTEMPTS
    assert "EV-1" not in store.get_budget("web").record.claims


def test_attempts_bounds_the_redos(store):
    budget = Budget(store, "EV-1")
    budget.meddling = 1

    with pytest.raises(ConcurrencyConflict, match="gave up after 1 conflicting writes"):
        budget.commit(attempts=1)
    assert (budget.reads, budget.conflicts) == ([0], 1)


def test_an_error_other_than_a_conflict_is_not_redone(store):
    budget = Budget(store, "EV-1")

    def too_large(record: BudgetRecord, stored: Stored[BudgetRecord]) -> str:
        budget.writes += 1
        raise RecordTooLarge("budget web")

    with pytest.raises(RecordTooLarge):
        commit(budget.read, budget.mutate, too_large, what="budget web", on_conflict=budget.count)
    assert (budget.reads, budget.writes, budget.conflicts) == ([0], 1, 0)
