"""Budget claims as they reach the table (coordinator/pipeline/budget_claims.py): an event's domains in one
transaction, the entities taken from what the instance saw lately rather than read again, and a refusal or a pacing
hold only ever on what the run itself read or wrote (a stale guess never holds an event back)."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import pytest

from coordinator.domain.budgets import BudgetDomain
from coordinator.domain.claims import BudgetClaim, BudgetRecord
from coordinator.domain.pacing import PaceDomain
from coordinator.domain.policy import RateOption
from coordinator.pipeline.budget_claims import CLAIM_LEASE
from coordinator.pipeline.fleet import Fleet
from coordinator.pipeline.fleet_cache import FleetCache
from coordinator.state.store import ConcurrencyConflict, StateStore, Stored
from coordinator.state.tables import TableStateStore
from tests.coordinator.helpers import DOC_NOW, approval_record, event_record
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

    def budget_etag(self, scale_set: str) -> str | None:
        self.calls["budget_etag"] += 1
        return super().budget_etag(scale_set)

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


def claim(store: MemoryStateStore, cache: FleetCache, n: int, *, limit: int = 1) -> tuple[str, str]:
    """Event EV-n of VM web_n claims its zone and update domain in a run of the instance that has ``cache``."""
    vm = f"web_{n}"
    return Fleet(store, cache).budgets.claim(event_record(f"EV-{n}", resources=[vm]), domains(vm, limit=limit), DOC_NOW)


def claims(store: StateStore, key: str) -> list[str]:
    stored = store.get_budget(key)
    return sorted(stored.record.claims) if stored else []


def test_an_events_domains_are_claimed_in_one_transaction_without_reading_what_the_instance_saw() -> None:
    store = Counting()
    cache = FleetCache(store)

    assert claim(store, cache, 1, limit=2) == ("", "")
    # A second run of the same instance: the entities it wrote are known, so nothing is read first.
    assert claim(store, cache, 2, limit=2) == ("", "")

    assert store.calls == {"save_budgets": 2}
    assert claims(store, "zone:westeurope/1") == claims(store, "updateDomains:web") == ["EV-1", "EV-2"]


def test_a_transaction_refused_writes_nothing_and_is_decided_again_on_what_is_stored() -> None:
    store = Counting()
    store.refuse = True

    assert Fleet(store).budgets.claim(event_record("EV-1", resources=["web_0"]), domains("web_0"), DOC_NOW) == ("", "")

    assert store.calls == {"save_budgets": 2, "get_budget": 2}  # the second attempt read both entities
    assert claims(store, "zone:westeurope/1") == ["EV-1"]


def test_a_refusal_on_what_the_instance_saw_earlier_is_read_again_and_a_freed_slot_taken() -> None:
    store = Counting()
    mine, other = FleetCache(store), FleetCache(store)
    assert claim(store, mine, 1) == ("", "")
    for key in ("updateDomains:web", "zone:westeurope/1"):
        Fleet(store, other).budgets.release(key, "EV-1")  # another instance concluded EV-1
    store.calls.clear()

    # This instance still remembers the domains full; it reads them before refusing, and finds the slot free.
    assert claim(store, mine, 2) == ("", "")

    assert store.calls["get_budget"] == 2
    assert claims(store, "zone:westeurope/1") == ["EV-2"]


def test_a_fresh_read_of_what_the_instance_saw_unchanged_asks_only_its_etag() -> None:
    store = Counting()
    cache = FleetCache(store)
    assert claim(store, cache, 1) == ("", "")
    store.calls.clear()

    # Full on what this instance wrote: read fresh before refusing, and found as written (the same ETags).
    refused, where = claim(store, cache, 2)

    assert where == "updateDomain:web/0"
    assert "held fleet-wide by EV-1" in refused
    assert store.calls == {"budget_etag": 1}  # the claims were not read again
    other = FleetCache(store)
    for key in ("updateDomains:web", "zone:westeurope/1"):
        Fleet(store, other).budgets.release(key, "EV-1")  # another instance concluded EV-1
    store.calls.clear()

    assert claim(store, cache, 2) == ("", "")  # their ETags changed: read whole, the slots found free

    assert store.calls["get_budget"] == 2
    assert claims(store, "updateDomains:web") == claims(store, "zone:westeurope/1") == ["EV-2"]


def test_within_one_run_a_refusal_rests_on_what_the_run_read_without_reading_again() -> None:
    store = Counting()
    fleet = Fleet(store)
    assert fleet.budgets.claim(event_record("EV-1", resources=["web_0"]), domains("web_0"), DOC_NOW) == ("", "")
    store.calls.clear()

    refused, where = fleet.budgets.claim(event_record("EV-2", resources=["web_1"]), domains("web_1"), DOC_NOW)

    assert where == "updateDomain:web/0"
    assert "held fleet-wide by EV-1" in refused
    assert store.calls == {}


def test_a_rate_held_on_what_the_instance_saw_earlier_is_read_again() -> None:
    store = Counting()
    mine, other = FleetCache(store), FleetCache(store)
    rate = PaceDomain(
        "rate:paced:fleet", "paced", frozenset({"a_0"}), rate=RateOption(maxApprovals=1, periodSeconds=600)
    )
    assert Fleet(store, mine).budgets.pace(event_record("EV-1"), [rate], DOC_NOW) is None
    Fleet(store, other).budgets.release(rate.key, "EV-1")  # withdrawn on another instance: it never ran
    store.calls.clear()

    assert Fleet(store, mine).budgets.pace(event_record("EV-2"), [rate], DOC_NOW) is None

    assert store.calls["get_budget"] == 1
    assert claims(store, rate.key) == ["EV-2"]


def test_a_batchs_deferred_claims_are_written_together_and_one_given_back_before_is_never_written() -> None:
    store = Counting()
    fleet = Fleet(store)
    fleet.budgets.defer = True
    for n in range(3):
        vm = f"web_{n}"
        assert fleet.budgets.claim(event_record(f"EV-{n}", resources=[vm]), domains(vm, limit=3), DOC_NOW) == ("", "")
    # A fourth is over the limit of 3 once the first three count: a batch's later claims build on its earlier ones.
    refused, _ = fleet.budgets.claim(event_record("EV-3", resources=["web_3"]), domains("web_3", limit=3), DOC_NOW)
    assert "held fleet-wide by EV-0, EV-1, EV-2" in refused
    fleet.budgets.release("zone:westeurope/1", "EV-1")  # e.g. held by its pacing after its impact claim
    fleet.budgets.release("updateDomains:web", "EV-1")
    fleet.budgets.defer = False
    assert store.calls == {}

    fleet.budgets.flush()

    assert store.calls == {"save_budgets": 1}
    assert claims(store, "zone:westeurope/1") == claims(store, "updateDomains:web") == ["EV-0", "EV-2"]


def test_deferred_claims_refused_by_the_table_are_forgotten_and_read_fresh_when_decided_again() -> None:
    store = Counting()
    cache = FleetCache(store)
    assert claim(store, cache, 0, limit=2) == ("", "")
    Fleet(store).budgets.release("zone:westeurope/1", "EV-0")  # another instance: this one's knowledge is now stale
    fleet = Fleet(store, cache)
    fleet.budgets.defer = True
    fleet.budgets.claim(event_record("EV-1", resources=["web_1"]), domains("web_1", limit=2), DOC_NOW)
    store.calls.clear()

    with pytest.raises(ConcurrencyConflict):
        fleet.budgets.flush()
    fleet.budgets.claim(event_record("EV-1", resources=["web_1"]), domains("web_1", limit=2), DOC_NOW)  # decided again
    fleet.budgets.flush()

    assert store.calls == {"save_budgets": 2, "get_budget": 2}
    assert claims(store, "zone:westeurope/1") == ["EV-1"]
    assert claims(store, "updateDomains:web") == ["EV-0", "EV-1"]


def test_the_events_of_claims_past_their_lease_are_read_once_a_run_however_many_events_it_holds() -> None:
    class CountingReads(MemoryStateStore):
        reads = 0

        def get_events(self, event_ids: Any, **options: Any) -> Any:
            self.reads += 1
            return super().get_events(event_ids, **options)

    store = CountingReads()
    rate = PaceDomain(
        "rate:paced:fleet", "paced", frozenset({"a_0"}), rate=RateOption(maxApprovals=2, periodSeconds=600)
    )
    old = DOC_NOW - CLAIM_LEASE - timedelta(seconds=1)
    for n in range(2):  # two approvals past their lease, their events still holding them: the rate is spent
        store.save_event(event_record(f"EV-OLD-{n}", approval=approval_record(decisionId=f"d-{n}")), None)
    held = {f"EV-OLD-{n}": BudgetClaim(eventId=f"EV-OLD-{n}", vms=["a_0"], claimedAt=old) for n in range(2)}
    store.save_budget(BudgetRecord(scaleSet=rate.key, claims=held, periodSeconds=600), None)
    fleet = Fleet(store)  # one run (a timer's tick) re-deciding every held event

    holds = [fleet.budgets.pace(event_record(f"EV-{n}"), [rate], DOC_NOW) for n in range(5)]

    assert all(hold is not None for hold in holds)
    assert store.reads == 1


def test_a_batchs_rate_claims_are_deferred_with_its_budget_claims_and_written_in_the_same_transaction() -> None:
    store = Counting()
    fleet = Fleet(store)
    rate = PaceDomain(
        "rate:paced:fleet", "paced", frozenset({"a_0"}), rate=RateOption(maxApprovals=2, periodSeconds=600)
    )
    with fleet.budgets.deferred():
        for n in range(3):
            assert (
                fleet.budgets.claim(
                    event_record(f"EV-{n}", resources=[f"web_{n}"]), domains(f"web_{n}", limit=5), DOC_NOW
                )[0]
                == ""
            )
        holds = [fleet.budgets.pace(event_record(f"EV-{n}"), [rate], DOC_NOW) for n in range(3)]
    assert store.calls == {}
    assert [hold is None for hold in holds] == [True, True, False]  # the third is over the batch's own two

    fleet.budgets.flush()

    assert store.calls == {"save_budgets": 1}
    assert claims(store, rate.key) == ["EV-0", "EV-1"]
    assert claims(store, "zone:westeurope/1") == ["EV-0", "EV-1", "EV-2"]


def test_a_batchs_claims_too_large_for_one_transaction_are_written_in_several(azurite: Any) -> None:
    # Eight zone entities of about 430,000 characters each (one claim naming 3,500 VMs): over the store's 3 MB cut.
    store = TableStateStore.from_connection_string(azurite.connection_string, table_name="bc" + uuid.uuid4().hex[:12])
    fleet = Fleet(store)
    many = frozenset(f"vm_{i:05d}_" + "x" * 110 for i in range(3500))
    with fleet.budgets.deferred():
        for zone in range(8):
            domain = BudgetDomain("zone", f"westeurope/{zone}", many, frozenset(), 10**5, 10**5)
            assert fleet.budgets.claim(event_record(f"EV-{zone}"), [domain], DOC_NOW) == ("", "")

    fleet.budgets.flush()

    assert [claims(store, f"zone:westeurope/{zone}") for zone in range(8)] == [[f"EV-{zone}"] for zone in range(8)]


def test_a_claim_refused_after_a_write_cut_in_two_gives_back_what_the_first_part_made() -> None:
    class CutThenFilled(MemoryStateStore):
        """The first transaction holds one entity and is written; the second is refused, another instance having
        taken the last slot of its domain meanwhile."""

        def save_budgets(self, writes: Sequence[tuple[BudgetRecord, str | None]]) -> list[str]:
            super().save_budget(*writes[0])
            other = BudgetClaim(eventId="EV-OTHER", vms=["web_9"], claimedAt=DOC_NOW)
            current = super().get_budget(writes[1][0].scaleSet)
            super().save_budget(
                BudgetRecord(scaleSet=writes[1][0].scaleSet, claims={"EV-OTHER": other}),
                current.etag if current else None,
            )
            raise ConcurrencyConflict("the second transaction was refused")

    store = CutThenFilled()

    refused, where = Fleet(store).budgets.claim(event_record("EV-1", resources=["web_0"]), domains("web_0"), DOC_NOW)

    assert where == "zone:westeurope/1"
    assert "held fleet-wide by EV-OTHER" in refused
    assert claims(store, "updateDomains:web") == []  # all or none: the first part's claim given back


def test_a_scale_sets_update_domains_share_one_entity_and_each_domain_counts_only_its_own_vms() -> None:
    def update_domains(vms: dict[str, str], *, limit: int = 1) -> list[BudgetDomain]:
        by_domain: dict[str, set[str]] = {}
        for vm, number in vms.items():
            by_domain.setdefault(f"web/{number}", set()).add(vm)
        return [BudgetDomain("updateDomain", k, frozenset(v), frozenset(), 20, limit) for k, v in by_domain.items()]

    store = Counting()
    fleet = Fleet(store)
    # One event on VMs in update domains 0, 1 and 2 of scale set web: one entity written, not three.
    spread = update_domains({"web_0": "0", "web_1": "1", "web_2": "2"})
    assert fleet.budgets.claim(event_record("EV-A", resources=["web_0", "web_1", "web_2"]), spread, DOC_NOW) == ("", "")
    assert store.calls == {"save_budget": 1}  # one entity, one write
    stored = store.get_budget("updateDomains:web")
    assert stored is not None
    assert stored.record.claims["EV-A"].placed == {"web_0": "web/0", "web_1": "web/1", "web_2": "web/2"}
    assert [store.get_budget(f"updateDomain:web/{n}") for n in range(3)] == [None, None, None]

    # Update domain 1 is full (1 VM), 4 is not: counted apart although their claims share the entity.
    refused, where = fleet.budgets.claim(
        event_record("EV-B", resources=["web_6"]), update_domains({"web_6": "1"}), DOC_NOW
    )
    assert where == "updateDomain:web/1"
    assert "would have 2 impacted instances (limit 1); held fleet-wide by EV-A" in refused
    assert fleet.budgets.claim(event_record("EV-C", resources=["web_9"]), update_domains({"web_9": "4"}), DOC_NOW) == (
        "",
        "",
    )
    assert claims(store, "updateDomains:web") == ["EV-A", "EV-C"]

    fleet.budgets.release("updateDomains:web", "EV-A")  # its approval concluded: every domain it held is free
    assert fleet.budgets.claim(event_record("EV-B", resources=["web_6"]), update_domains({"web_6": "1"}), DOC_NOW) == (
        "",
        "",
    )
    assert claims(store, "updateDomains:web") == ["EV-B", "EV-C"]


def test_an_events_claim_left_by_an_earlier_approval_is_widened_to_the_vms_it_lacks_within_the_limits() -> None:
    store = Counting()
    fleet = Fleet(store)

    def update_domain(vm: str, number: str) -> BudgetDomain:
        return BudgetDomain("updateDomain", f"web/{number}", frozenset({vm}), frozenset(), 20, 1)

    assert fleet.budgets.claim(event_record("EV-A", resources=["web_0"]), [update_domain("web_0", "0")], DOC_NOW) == (
        "",
        "",
    )
    # Approved again once its Resources grew to a VM in update domain 1: the claim (in the scale set's entity, which
    # has no other claim for domain 1) takes that VM too.
    grown = [update_domain("web_0", "0"), update_domain("web_5", "1")]
    assert fleet.budgets.claim(event_record("EV-A", resources=["web_0", "web_5"]), grown, DOC_NOW) == ("", "")
    stored = store.get_budget("updateDomains:web")
    assert stored is not None
    assert stored.record.claims["EV-A"].placed == {"web_0": "web/0", "web_5": "web/1"}
    refused, where = fleet.budgets.claim(
        event_record("EV-B", resources=["web_6"]), [update_domain("web_6", "1")], DOC_NOW
    )
    assert (where, "held fleet-wide by EV-A" in refused) == ("updateDomain:web/1", True)

    # A VM it lacks in a domain another event fills: refused, the claim as it was.
    more = [*grown, update_domain("web_7", "2")]
    assert fleet.budgets.claim(event_record("EV-C", resources=["web_8"]), [update_domain("web_8", "2")], DOC_NOW) == (
        "",
        "",
    )
    refused, where = fleet.budgets.claim(event_record("EV-A", resources=["web_0", "web_5", "web_7"]), more, DOC_NOW)
    assert (where, "held fleet-wide by EV-C" in refused) == ("updateDomain:web/2", True)
    stored = store.get_budget("updateDomains:web")
    assert stored is not None
    assert stored.record.claims["EV-A"].vms == ["web_0", "web_5"]
