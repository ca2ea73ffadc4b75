"""Budget claims as they reach the table (coordinator/pipeline/fleet.py): an event's domains in one transaction, the
entities taken from what the instance saw lately rather than read again, and a refusal or a pacing hold only ever
on what the run itself read or wrote (a stale guess never holds an event back)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest

from coordinator.domain.budgets import BudgetDomain
from coordinator.domain.model import BudgetRecord
from coordinator.domain.pacing import PaceDomain
from coordinator.domain.policy import RateOption
from coordinator.pipeline.fleet import Fleet
from coordinator.pipeline.fleet_cache import FleetCache
from coordinator.state.store import ConcurrencyConflict, Stored
from tests.coordinator.helpers import DOC_NOW, event_record
from tests.coordinator.memory_store import MemoryStateStore


class Counting(MemoryStateStore):
    """Counts the budget requests; ``refuse`` makes the next transaction fail once (another instance wrote)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.refuse = False

    def get_budget(self, scale_set: str) -> Stored[BudgetRecord] | None:
        self.calls["get_budget"] += 1
        return super().get_budget(scale_set)

    def save_budget(self, record: BudgetRecord, etag: str | None) -> str:
        self.calls["save_budget"] += 1
        return super().save_budget(record, etag)

    def save_budgets(self, writes: Sequence[tuple[BudgetRecord, str | None]]) -> list[str]:
        self.calls["save_budgets"] += 1
        if self.refuse:
            self.refuse = False
            raise ConcurrencyConflict("another instance wrote one of them")
        return super().save_budgets(writes)


def domains(vm: str, *, limit: int = 1) -> list[BudgetDomain]:
    return [
        BudgetDomain("zone", "westeurope/1", frozenset({vm}), frozenset(), 10, limit),
        BudgetDomain("updateDomain", "web/0", frozenset({vm}), frozenset(), 10, limit),
    ]


def claims(store: MemoryStateStore, key: str) -> list[str]:
    stored = store.get_budget(key)
    return sorted(stored.record.claims) if stored else []


def test_an_events_domains_are_claimed_in_one_transaction_without_reading_what_the_instance_saw() -> None:
    store = Counting()
    cache = FleetCache(store)

    assert Fleet(store, cache).claim(event_record("EV-1", resources=["web_0"]), domains("web_0", limit=2), DOC_NOW) == (
        "",
        "",
    )
    # A second run of the same instance: the entities it wrote are known, so nothing is read first.
    assert Fleet(store, cache).claim(event_record("EV-2", resources=["web_1"]), domains("web_1", limit=2), DOC_NOW) == (
        "",
        "",
    )

    assert store.calls == {"save_budgets": 2}
    assert claims(store, "zone:westeurope/1") == claims(store, "updateDomain:web/0") == ["EV-1", "EV-2"]


def test_a_transaction_refused_writes_nothing_and_is_decided_again_on_what_is_stored() -> None:
    store = Counting()
    store.refuse = True

    assert Fleet(store).claim(event_record("EV-1", resources=["web_0"]), domains("web_0"), DOC_NOW) == ("", "")

    assert store.calls == {"save_budgets": 2, "get_budget": 2}  # the second attempt read both entities
    assert claims(store, "zone:westeurope/1") == ["EV-1"]


def test_a_refusal_on_what_the_instance_saw_earlier_is_read_again_and_a_freed_slot_taken() -> None:
    store = Counting()
    mine, other = FleetCache(store), FleetCache(store)
    assert Fleet(store, mine).claim(event_record("EV-1", resources=["web_0"]), domains("web_0"), DOC_NOW) == ("", "")
    for key in ("updateDomain:web/0", "zone:westeurope/1"):
        Fleet(store, other).release(key, "EV-1")  # another instance concluded EV-1
    store.calls.clear()

    # This instance still remembers the domains full; it reads them before refusing, and finds the slot free.
    assert Fleet(store, mine).claim(event_record("EV-2", resources=["web_1"]), domains("web_1"), DOC_NOW) == ("", "")

    assert store.calls["get_budget"] == 2
    assert claims(store, "zone:westeurope/1") == ["EV-2"]


def test_within_one_run_a_refusal_rests_on_what_the_run_read_without_reading_again() -> None:
    store = Counting()
    fleet = Fleet(store)
    assert fleet.claim(event_record("EV-1", resources=["web_0"]), domains("web_0"), DOC_NOW) == ("", "")
    store.calls.clear()

    refused, where = fleet.claim(event_record("EV-2", resources=["web_1"]), domains("web_1"), DOC_NOW)

    assert where == "updateDomain:web/0"
    assert "held fleet-wide by EV-1" in refused
    assert store.calls == {}


def test_a_rate_held_on_what_the_instance_saw_earlier_is_read_again() -> None:
    store = Counting()
    mine, other = FleetCache(store), FleetCache(store)
    rate = PaceDomain(
        "rate:paced:fleet", "paced", frozenset({"a_0"}), rate=RateOption(maxApprovals=1, periodSeconds=600)
    )
    assert Fleet(store, mine).pace(event_record("EV-1"), [rate], DOC_NOW) is None
    Fleet(store, other).release(rate.key, "EV-1")  # withdrawn on another instance: it never ran
    store.calls.clear()

    assert Fleet(store, mine).pace(event_record("EV-2"), [rate], DOC_NOW) is None

    assert store.calls["get_budget"] == 1
    assert claims(store, rate.key) == ["EV-2"]


def test_a_batchs_deferred_claims_are_written_together_and_one_given_back_before_is_never_written() -> None:
    store = Counting()
    fleet = Fleet(store)
    fleet.defer_claims = True
    for n in range(3):
        vm = f"web_{n}"
        assert fleet.claim(event_record(f"EV-{n}", resources=[vm]), domains(vm, limit=3), DOC_NOW) == ("", "")
    # A fourth is over the limit of 3 once the first three count: a batch's later claims build on its earlier ones.
    refused, _ = fleet.claim(event_record("EV-3", resources=["web_3"]), domains("web_3", limit=3), DOC_NOW)
    assert "held fleet-wide by EV-0, EV-1, EV-2" in refused
    fleet.release("zone:westeurope/1", "EV-1")  # e.g. held by its pacing after its impact claim
    fleet.release("updateDomain:web/0", "EV-1")
    fleet.defer_claims = False
    assert store.calls == {}

    fleet.flush_claims()

    assert store.calls == {"save_budgets": 1}
    assert claims(store, "zone:westeurope/1") == claims(store, "updateDomain:web/0") == ["EV-0", "EV-2"]


def test_deferred_claims_refused_by_the_table_are_forgotten_and_read_fresh_when_decided_again() -> None:
    store = Counting()
    cache = FleetCache(store)
    assert (
        Fleet(store, cache).claim(event_record("EV-0", resources=["web_0"]), domains("web_0", limit=2), DOC_NOW)[0]
        == ""
    )
    Fleet(store).release("zone:westeurope/1", "EV-0")  # another instance: this one's knowledge is now stale
    fleet = Fleet(store, cache)
    fleet.defer_claims = True
    fleet.claim(event_record("EV-1", resources=["web_1"]), domains("web_1", limit=2), DOC_NOW)
    store.calls.clear()

    with pytest.raises(ConcurrencyConflict):
        fleet.flush_claims()
    fleet.claim(event_record("EV-1", resources=["web_1"]), domains("web_1", limit=2), DOC_NOW)  # decided again
    fleet.flush_claims()

    assert store.calls == {"save_budgets": 2, "get_budget": 2}
    assert claims(store, "zone:westeurope/1") == ["EV-1"]
    assert claims(store, "updateDomain:web/0") == ["EV-0", "EV-1"]
