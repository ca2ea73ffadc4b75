"""A batch's bindings (coordinator/pipeline/bindings.py): read by partition, remembered (misses too), written
together, insert-only, each claim judged by what the table holds; those of VMs ARM's census vouched for left to the
timer's backlog."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, cast

from contracts.envelope import Envelope
from coordinator.domain.attestation import Attestations
from coordinator.domain.bindings import BindingBacklog, BindingCache
from coordinator.pipeline.attest import Pending, binding_problems
from coordinator.pipeline.bindings import BACKLOG_CHUNK, Wanted, name_claim, resolve, write_backlog
from coordinator.state.entities import CLAIM_PARTITIONS
from tests.coordinator.helpers import envelope, vm
from tests.coordinator.memory_store import MemoryStateStore


class Counting(MemoryStateStore):
    """Counts the claim calls; ``before_write`` runs once, before the first write (another instance, meanwhile)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.before_write: Any = None

    def claimed(self, name: str) -> str | None:
        self.calls["claimed"] += 1
        return super().claimed(name)

    def claims_in(self, partition: str) -> dict[str, str]:
        self.calls["claims_in"] += 1
        return super().claims_in(partition)

    def claim_many(self, items: Sequence[tuple[str, str]]) -> dict[str, str]:
        self.calls["claim_many"] += 1
        if self.before_write is not None:
            self.before_write, meanwhile = None, self.before_write
            meanwhile()
        return super().claim_many(items)


def wanted(n: int, *, claim: bool = True, name: str | None = None) -> Wanted:
    return Wanted(f"id-{n}", f"/subscriptions/s/vm{n}", name or f"vm{n}", claim)


def test_a_batch_of_new_vms_reads_each_partition_once_and_writes_its_claims_together() -> None:
    store, cache = Counting(), BindingCache()
    bound = resolve(cache, store, [wanted(n) for n in range(200)])

    assert store.calls == {"claims_in": CLAIM_PARTITIONS, "claim_many": 1}
    assert all(values == wanted(n).claims() for n, values in enumerate(bound))
    assert store.claimed(name_claim("vm7")) == "id-7"
    # Known now, by this instance: the same VMs again cost nothing.
    store.calls.clear()
    assert resolve(cache, store, [wanted(n) for n in range(200)]) == bound
    assert store.calls == {}


def test_a_miss_is_remembered() -> None:
    # Envelopes that bind nothing (unattested, attestation not required) find their names free: read once.
    store, cache = Counting(), BindingCache()
    now = [0.0]
    for _ in range(2):
        assert resolve(cache, store, [wanted(1, claim=False)], clock=lambda: now[0]) == [
            dict.fromkeys(wanted(1).claims())
        ]
        now[0] += 30.0
    reads = store.calls["claims_in"]
    assert 0 < reads <= 4
    # ...and read again once the partitions' read is older than a check that binds nothing may take.
    now[0] = 61.0
    resolve(cache, store, [wanted(1, claim=False)], clock=lambda: now[0])
    assert store.calls["claims_in"] == 2 * reads


def test_a_claim_bound_meanwhile_by_another_instance_is_not_bound_over_and_the_others_are_written() -> None:
    """Another instance binds vm3's name to its own VM after this one read the partitions: the grouped write is
    refused for that name alone; vm3 is judged by the name's holder (refused), every other VM is bound."""
    store, cache = Counting(), BindingCache()
    store.before_write = lambda: store.claim(name_claim("vm3"), "id-squatter")
    identities = [vm(f"vm{n}", index=n) for n in range(6)]
    attestations = Attestations(cast(Any, None), cache)
    pending = [
        Pending(Envelope.model_validate({**envelope(i, sequence=1, incarnation=1), "stateId": "s"}), claim=True)
        for i in identities
    ]

    problems = binding_problems(attestations, store, pending)

    assert [bool(p) for p in problems] == [False, False, False, True, False, False]
    assert "another VM speaks under its name" in problems[3]
    assert store.claimed(name_claim("vm3")) == "id-squatter"
    assert all(store.claimed(name_claim(f"vm{n}")) == str(identities[n]["vmId"]).lower() for n in (0, 1, 2, 4, 5))


def test_two_vms_of_one_batch_claiming_one_name_bind_it_once() -> None:
    store, cache = Counting(), BindingCache()
    first, second = wanted(1, name="web"), wanted(2, name="web")
    bound = resolve(cache, store, [first, second])
    assert bound[0] == first.claims()
    assert bound[1][name_claim("web")] == "id-1"
    # The refused one binds nothing of its own.
    assert bound[1]["vm-id:id-2"] is None
    assert store.claimed("vm-id:id-2") is None


def pending_of(n: int, *, verdict: str | None) -> Pending:
    identity = vm(f"vm{n}", index=n)
    data = {**envelope(identity, sequence=1, incarnation=1), "stateId": "s"}
    return Pending(Envelope.model_validate(data), claim=True, verdict=verdict)


def test_vms_arms_census_vouched_for_wait_for_no_claim_and_the_timer_writes_theirs() -> None:
    """ARM's census accepted them ("" verdict): the batch reads and writes no binding; the claims wait in the
    instance's backlog, count as bound for a VM the census does not list, and are written in steps, insert-only."""
    store, cache = Counting(), BindingCache()
    attestations = Attestations(cast(Any, None), cache)
    vouched = [pending_of(n, verdict="") for n in range(300)]

    assert binding_problems(attestations, store, vouched) == [""] * 300
    assert store.calls == {}
    assert len(attestations.backlog) == 4 * 300

    # vm0's own vmId under a name ARM does not list (no verdict: the bindings decide): its vmId's claim waits in
    # the backlog for vm0's own name, so it is refused, and nothing of it is written.
    ghost = vm("ghost", index=0) | {"vmId": vouched[0].envelope.vm.vmId}
    stray = Pending(Envelope.model_validate({**envelope(ghost, sequence=1, incarnation=1), "stateId": "s"}), claim=True)
    (problem,) = binding_problems(attestations, store, [stray])
    assert "speaks under another VM's name" in problem
    assert store.claimed(name_claim("ghost")) is None

    store.claim(name_claim("vm5"), "id-squatter")  # another instance, meanwhile
    ticks = [0.0]

    def clock() -> float:  # each step takes a second of the tick's two
        ticks[0] += 1.0
        return ticks[0]

    store.calls.clear()
    first = write_backlog(cache, attestations.backlog, store, within=3.0, clock=clock)
    # One step, then the time was up: its partitions read first, so vm5's name (the squatter's) is not sent.
    assert first == BACKLOG_CHUNK - 1
    assert store.calls["claim_many"] == 1
    assert 0 < store.calls["claims_in"] <= CLAIM_PARTITIONS  # those the stray's check had not read already
    rest = write_backlog(cache, attestations.backlog, store, within=60.0, clock=clock)
    assert first + rest == 4 * 300 - 1
    assert len(attestations.backlog) == 0
    assert store.calls["claimed"] == 0  # no claim refused and read back one at a time
    assert store.claimed(name_claim("vm7")) == str(vouched[7].envelope.vm.vmId).lower()
    assert store.claimed(name_claim("vm5")) == "id-squatter"  # not bound over
    assert cache.get(name_claim("vm5")) == "id-squatter"


def test_the_backlog_keeps_the_oldest_first_and_drops_the_oldest_beyond_its_size() -> None:
    backlog = BindingBacklog(size=3)
    backlog.add({"a": "1", "b": "2"})
    backlog.add({"a": "other", "c": "3", "d": "4"})

    assert (len(backlog), backlog.dropped, backlog.get("a")) == (3, 1, None)
    assert backlog.take(2) == [("b", "2"), ("c", "3")]
    assert backlog.take(5) == [("d", "4")]
    assert backlog.take(5) == []
