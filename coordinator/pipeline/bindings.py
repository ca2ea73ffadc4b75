"""A batch's VM bindings, read and written together (pipeline/attest.py says what they are and what they decide).

Each envelope asks for its VM's four claims: its resource id's and its name's vmId, its vmId's resource id and name
(``Wanted.claims``). For a whole batch at once:

1. **Read what is not known**: a name neither bound nor known free in this instance's ``BindingCache`` has its
   partition read whole (one query, paged), which makes every name of it known; a partition is read again only
   when one of its bindings was evicted, or, for an envelope that binds nothing (unattested, with attestation not
   required), when it was read more than ``MISS_FRESH_SECONDS`` ago. A fleet whose VMs are all bound costs no read.
2. **Decide in order**, each envelope against what is bound and what the envelopes before it in the batch are
   about to bind: one whose four claims are free or its own binds those that are free; one that meets another
   VM's binds nothing (it is refused: a refused envelope binds nothing).
3. **Write the new claims together**, insert-only, in transactions of one partition (``StateStore.claim_many``),
   instead of four round trips a VM. A claim another instance made since the partition was read is refused by the
   table, not written; its value is read and answered instead, and the envelope's VM is judged by it (refused
   when it is another VM's, never bound over it). Its other claims were written: they name only that VM itself,
   as when two envelopes race (attest.py).

A VM ARM's census vouches for (pipeline/attest.py) does not wait for its claims: they go to the instance's
``BindingBacklog`` and the timer writes them (``write_backlog``, bounded in time), so a wave of VMs new to the
coordinator costs no claim on the batches' path; a claim in the backlog counts as bound for the VMs the census does
not list (a VM ARM vouched for under its name cannot bind itself to another meanwhile).

A store that fails raises ``StoreOutage``: the batch fails and is delivered again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from coordinator.domain.bindings import BindingBacklog, BindingCache
from coordinator.state.entities import CLAIM_PARTITIONS, claim_partition
from coordinator.state.store import StateStore

T = TypeVar("T")

# How long a tick spends writing the backlog at most: a 10,000-VM fleet new to the coordinator (40,000 claims) is
# written in a few ticks while ARM's census vouches for its VMs.
BACKLOG_SECONDS = 5.0
# Claims the timer writes a step (``write_backlog``): about 100 a claim partition, one transaction each.
BACKLOG_CHUNK = 100 * CLAIM_PARTITIONS

# How old a partition's read may be to call a name in it free for an envelope that binds nothing: another instance
# may have bound the name since, and such an envelope meets no conditional write that would tell.
MISS_FRESH_SECONDS = 60.0


class StoreOutage(Exception):
    """The state store failed while a message was read at the door: nothing in the message is at fault, and no
    message is refused for want of a read, so the batch fails (Event Hubs delivers it again)."""


def store_call(call: Callable[[], T], what: str) -> T:
    try:
        return call()
    except Exception as error:
        raise StoreOutage(f"the state store failed to {what}: {type(error).__name__}: {str(error)[:300]}") from error


def resource_claim(resource_id: str) -> str:
    return f"vm-resource:{resource_id.lower()}"


def vm_claim(vm_id: str) -> str:
    return f"vm-id:{vm_id.lower()}"


def name_claim(name: str) -> str:
    return f"vm-name:{name.lower()}"


def vm_name_claim(vm_id: str) -> str:
    return f"vm-id-name:{vm_id.lower()}"


@dataclass(frozen=True)
class Wanted:
    """One envelope's VM as it names itself (lower case), and whether it may bind (an attested envelope)."""

    vm_id: str
    resource: str
    name: str
    claim: bool

    def claims(self) -> dict[str, str]:
        """Each claim's name and the value this VM wants bound to it."""
        return {
            vm_claim(self.vm_id): self.resource,
            resource_claim(self.resource): self.vm_id,
            vm_name_claim(self.vm_id): self.name,
            name_claim(self.name): self.vm_id,
        }


def remember(cache: BindingCache, name: str, value: str) -> str:
    """A binding known to be stored (read, or written by this instance)."""
    return cache.put(name, value, claim_partition(name))


def resolve(
    cache: BindingCache,
    store: StateStore,
    wanted: Sequence[Wanted],
    *,
    backlog: BindingBacklog | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> list[dict[str, str | None]]:
    """Each envelope's claims and the value bound to each (None: free), after the batch's new claims were written.
    A claim in ``backlog`` (vouched for by ARM's census, not written yet) counts as bound. Raises ``StoreOutage``."""
    _read_unknown(cache, store, wanted, clock)

    def known(name: str) -> str | None:
        return cache.get(name) or (backlog.get(name) if backlog is not None else None)

    planned: dict[str, str] = {}
    for one in wanted:
        claims = one.claims()
        bound = {name: known(name) or planned.get(name) for name in claims}
        if one.claim and None in bound.values() and all(bound[n] in (None, v) for n, v in claims.items()):
            planned.update({name: value for name, value in claims.items() if bound[name] is None})
    if planned:
        written = store_call(lambda: store.claim_many(list(planned.items())), "write bindings")
        for name, value in written.items():
            remember(cache, name, value)
    return [{name: known(name) for name in one.claims()} for one in wanted]


def write_backlog(
    cache: BindingCache, backlog: BindingBacklog, store: StateStore, *, within: float,
    clock: Callable[[], float] = time.monotonic,
) -> int:  # fmt: skip
    """The backlog's claims written, oldest first, ``BACKLOG_CHUNK`` at a time until it is empty or ``within``
    seconds have passed (the rest at the next tick); each insert-only, as a batch's are (one bound meanwhile keeps
    its value, remembered). Returns how many were written. Raises ``StoreOutage``: what it took is dropped, and
    asked for again by its VM's next envelope while still not bound."""
    deadline, written = clock() + within, 0
    while clock() < deadline:
        taken = backlog.take(BACKLOG_CHUNK)
        if not taken:
            break
        # What the table holds already (an instance started again: its cache is empty, its fleet bound) is read,
        # a partition at a time, not met as one refused insert and one read per claim.
        _read_partitions(cache, store, ((name, None) for name, _ in taken), clock)
        part = [(name, value) for name, value in taken if cache.get(name) is None]
        if part:
            bound = store_call(lambda: store.claim_many(part), "write the backlog of bindings")  # noqa: B023 - now
            for name, value in bound.items():
                remember(cache, name, value)
        written += len(part)
    return written


def _read_unknown(cache: BindingCache, store: StateStore, wanted: Sequence[Wanted], clock: Callable[[], float]) -> None:
    """Every partition holding a name of the batch that is neither bound nor known free, read whole."""
    names = ((name, None if one.claim else MISS_FRESH_SECONDS) for one in wanted for name in one.claims())
    _read_partitions(cache, store, names, clock)


def _read_partitions(
    cache: BindingCache, store: StateStore, names: Iterable[tuple[str, float | None]], clock: Callable[[], float]
) -> None:
    """Every partition holding one of ``names`` (each with how fresh a miss must be, None: any) that is neither
    bound nor known free, read whole."""
    at = clock()
    stale: set[str] = set()
    for name, fresh in names:
        partition = claim_partition(name)
        if partition not in stale and cache.get(name) is None and not cache.free(name, partition, at=at, fresh=fresh):
            stale.add(partition)
    for partition in sorted(stale):
        cache.load(partition, _read_partition(store, partition), at)


def _read_partition(store: StateStore, partition: str) -> dict[str, str]:
    return store_call(lambda: store.claims_in(partition), f"read the bindings of {partition}")
