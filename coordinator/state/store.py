"""What the stages read and write: the ``StateStore`` protocol, and the values that cross it.

Every write is conditional, which is what lets parallel coordinator instances decide once:

- An **ETag** is the version of one entity (two entities may have the same one). Every read gives each record
  with its ETag; every successful write gives a new one, different from every ETag the entity had before (even
  when the content is the same).
- **Insert** (``etag`` None): refused with ``ConcurrencyConflict`` when the entity exists.
- **Update** (``etag`` given): If-Match; refused with ``ConcurrencyConflict`` when the entity changed since that
  ETag was read, or is gone.
- A refused write changes nothing; the caller reads again and redoes (``commit.commit``).
- **Several records in one call** (``save_events``, ``save_vm_groups``) are written in transactions of at most 100
  records of one partition each (``entities.transactions``): each transaction is all or nothing, and one stale
  ETag refuses its whole transaction with ``ConcurrencyConflict``, as does a record named twice in it.
  Transactions before the refused one stay written, those after it are not tried: after a conflict the caller
  reads every record again.
- **Too large** a record raises ``RecordTooLarge`` before anything of that call is written.
- A ``cached`` read may answer with what this instance last read or wrote, older than what is stored: a write
  with that ETag is then refused, so a stale read never commits. Every other read is fresh.
- **An entity a read cannot decode** (damaged, or written in a layout this code does not read) is left out of
  what the read answers, so that one bad entity costs only itself: a whole entity (an event, a log of sent
  cards) is copied whole to partition ``setaside`` and deleted If-Match its ETag (the event starts afresh from
  its next sighting); one VM of a VM group is blanked (its next position overwrites it). Each is dead-lettered
  (the dead-letter table: the reason and the entity), logged at ERROR, and listed by ``set_aside()`` for the run
  to count and write a ``DeadLetter`` history row. A budget is the exception: one that cannot be read raises,
  holding the decisions it counts (read as empty, it would approve beyond its limit).
- **Changes** (``events_changed_since``, ``vm_groups_changed_since``): every record written at or after a time
  of the store's own clock, compared to the millisecond (Azurite's precision): the ``watermark`` an earlier answer
  gave, less an overlap the caller chooses. An instance keeps the open events and the census current that way,
  reading what changed, not the whole fleet.

- **The outbox** (``Staged``): history rows kept in the state until the history has them. A write of events or VM
  groups takes the rows that describe it (``staged``, each naming its record in ``near``) and stores them in the
  same transaction as that record: both are written or neither (a refused write stores no rows). Rows of no record
  are stored alone (``stage``). ``outbox`` reads every entry back, ``unstage`` deletes entries once the history has
  their rows (one already gone counts as deleted). Reads of events and VM groups never see them.

``TableStateStore`` (coordinator/state/tables.py) keeps this in Azure Table Storage; how records become entities is
``coordinator/state/entities.py``. tests/coordinator/test_state_contract.py holds every implementation to this.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, Protocol, TypeVar

from pydantic import BaseModel

from coordinator.domain.claims import BudgetRecord
from coordinator.domain.model import EventRecord, SentAlerts, VmGroupRecord
from coordinator.domain.rows import HistoryRow

R = TypeVar("R", bound=BaseModel)


class ConcurrencyConflict(Exception):
    """Another writer changed (or created, or deleted) the entity since it was read; re-read and redo."""


class RecordTooLarge(ValueError):
    """The record does not fit in one table entity (1 MiB)."""


@dataclass
class Stored(Generic[R]):
    """A record as read or written, with the ETag a conditional write of it needs."""

    record: R
    etag: str | None


@dataclass(frozen=True)
class Changed(Generic[R]):
    """Records written since a time, and the store's time to ask from next (the latest write among them; None
    when there was none to see)."""

    records: list[Stored[R]]
    watermark: datetime | None


@dataclass(frozen=True)
class DeadLetter:
    """A message refused at the door: kept with the reason so that a person can look at it; never acted on."""

    reason: str
    body: bytes
    received_at: datetime
    source: dict[str, Any]


@dataclass(frozen=True)
class SetAside:
    """A stored entity, or one VM of a VM group, that a read could not decode and set aside."""

    what: str  # "event/EV-1", "vmgroup/pg:web (a VM's position)"
    reason: str


class SetAsideLog:
    """What a store set aside since it was last asked (``StateStore.set_aside``). Thread-safe: the Functions worker
    runs invocations on a thread pool that share one store."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._taken: list[SetAside] = []

    def add(self, what: str, reason: str) -> None:
        with self._lock:
            self._taken.append(SetAside(what, reason))

    def take(self) -> list[SetAside]:
        with self._lock:
            taken, self._taken = self._taken, []
        return taken


@dataclass(frozen=True)
class Staged:
    """History rows in the outbox: stored with the write of the record whose change they describe (``near``:
    ``event:<EventId>`` or ``group:<key>``), or alone (``near`` ""), under an ``id`` no other entry has; ``at``: when
    the writer staged them (its clock), which the timer reads to leave a running tail's rows to that tail."""

    near: str
    id: str
    rows: tuple[HistoryRow, ...]
    at: datetime
    # Written over the entry of the same id, which this run stored with the same record earlier (``Outbox.joined``:
    # an approval's outcome rows added to its decision's entry, so its tail deletes one entry, not two).
    replaces: bool = False


class StateStore(Protocol):
    """The coordinator's state: event records, VM groups (every VM's position and sightings), budget claims, the
    log of sent cards, keys shared by every instance, and dead letters. Keys that come from input may hold any
    character: a store maps them to valid keys and answers with the keys it was asked for."""

    # events: the record without its ``vms`` (the sightings live with the VM groups; events.assemble puts them
    # back), so a read answers ``vms`` empty or as this instance last wrote it.
    def get_events(self, event_ids: Iterable[str], *, cached: bool = False) -> dict[str, Stored[EventRecord]]:
        """The events found, by the id asked for (absent ones are left out)."""

    def get_event(self, event_id: str) -> Stored[EventRecord] | None:
        """One event, read fresh."""

    def open_events(self) -> list[Stored[EventRecord]]:
        """Every event not Completed or Canceled, read fresh."""

    def events_changed_since(self, since: datetime | None) -> Changed[EventRecord]:
        """``since`` None: every open event (as ``open_events``) and every concluded one with VMs not back in
        service (they hold budget: ``EventRecord.returning``). Else every event written at or after ``since`` (the
        store's clock), open or concluded."""

    def closed_events_with_pending_alerts(self) -> list[Stored[EventRecord]]:
        """Concluded events the timer still has work on: cards left in the outbox, an approval's outcome to record,
        VMs not back in service (the ``Pending`` column; open ones come with open_events)."""

    def concluded_events_before(self, cutoff: datetime) -> list[Stored[EventRecord]]:
        """Completed/Canceled events that concluded (``stateSince``) before ``cutoff`` and have no card left to
        send."""

    def save_event(self, record: EventRecord, etag: str | None, *, staged: Sequence[Staged] = ()) -> str:
        """Inserts (``etag`` None) or replaces the event If-Match ``etag``, with ``staged`` (near the event) in the
        same transaction; gives the new ETag. The record's ``revision`` is set one past the one it carried."""

    def save_events(
        self, items: Sequence[tuple[EventRecord, str | None]], *, staged: Sequence[Staged] = ()
    ) -> list[str]:
        """``save_event`` for each, in transactions of 100 (all or nothing each; each event with what is staged near
        it, which must be one of them); the new ETags in order."""

    def delete_events(self, items: Sequence[tuple[str, str | None]]) -> int:
        """Deletes each event If-Match its ETag (required: ``ValueError`` without one). One changed since is kept,
        one already gone counts as deleted; gives how many were deleted."""

    # VM groups: one entity per group, one property per VM, so a write sends only the VMs it moved.
    def get_vm_groups(self, keys: Iterable[str], *, cached: bool = False) -> dict[str, Stored[VmGroupRecord]]:
        """The groups found, by the key asked for (absent ones are left out)."""

    def all_vm_groups(self) -> list[Stored[VmGroupRecord]]:
        """Every group, read fresh."""

    def vm_groups_changed_since(self, since: datetime | None) -> Changed[VmGroupRecord]:
        """``since`` None: every group (as ``all_vm_groups``). Else every group written at or after ``since``."""

    def save_vm_group(
        self,
        record: VmGroupRecord,
        etag: str | None,
        *,
        vm_ids: Iterable[str] | None = None,
        staged: Sequence[Staged] = (),
    ) -> str:
        """Inserts the group with all its VMs (``etag`` None), or merges the VMs ``vm_ids`` (None: every VM of
        ``record``) into it If-Match ``etag``: VMs not sent keep what is stored. ``staged`` (near the group) in the
        same transaction. Gives the new ETag: ``save_vm_groups`` of one."""
        return self.save_vm_groups([(record, etag, vm_ids)], staged=staged)[0]

    def prune_vm_group(self, record: VmGroupRecord, etag: str) -> str | None:
        """Replaces the group If-Match ``etag`` with only the VMs of ``record`` (the VMs not in it are removed, which
        a merge cannot do), or deletes it when ``record`` has none; gives the new ETag (None: deleted).
        ``ConcurrencyConflict`` when the group changed since or is gone."""

    def save_vm_groups(
        self,
        items: Sequence[tuple[VmGroupRecord, str | None, Iterable[str] | None]],
        *,
        staged: Sequence[Staged] = (),
    ) -> list[str]:
        """``save_vm_group`` for each, in transactions of 100 (all or nothing each; each group with what is staged
        near it, which must be one of them); the new ETags in order."""

    # budgets: the claims on one budget domain (a claim writes If-Match what it decided on, so it decides against
    # what every instance holds now).
    def get_budget(self, scale_set: str) -> Stored[BudgetRecord] | None: ...

    def budget_etag(self, scale_set: str) -> str | None:
        """The budget's ETag alone (None when absent): whether it changed since it was read, without its claims."""

    def save_budget(self, record: BudgetRecord, etag: str | None) -> str:
        """Inserts (``etag`` None) or replaces the budget If-Match ``etag``; gives the new ETag."""

    def save_budgets(self, writes: Sequence[tuple[BudgetRecord, str | None]]) -> list[str]:
        """``save_budget`` for each, in transactions of 100 (all or nothing each; ``ConcurrencyConflict`` when one is
        refused, the transactions before it written); the new ETags in order."""

    def budgets(self) -> list[Stored[BudgetRecord]]:
        """Every budget domain's entity, read fresh (housekeeping removes those whose claims were all released)."""

    def delete_budget(self, key: str, etag: str) -> bool:
        """Deletes the budget If-Match ``etag``; False when it changed since (kept), True when deleted or gone."""

    # the log of sent cards: one entry per batch that sent cards, cleared in bulk by the timer.
    def log_sent_alerts(self, record: SentAlerts) -> None:
        """Adds an entry (never conflicts: each has a key of its own)."""

    def sent_alert_logs(self) -> list[tuple[str, SentAlerts]]:
        """Every entry with its key, oldest ``sentAt`` first."""

    def delete_sent_alert_logs(self, keys: Sequence[str]) -> None:
        """Deletes the entries, unconditionally; one already gone counts as deleted (two timer runs that overlap
        settle the same logs)."""

    # the outbox: history rows kept until the history has them.
    def stage(self, staged: Sequence[Staged]) -> None:
        """Stores each entry on its own (as near its record when it names one, which need not exist)."""

    def outbox(self) -> list[Staged]:
        """Every entry, read fresh, oldest ``at`` first."""

    def unstage(self, staged: Iterable[Staged]) -> None:
        """Deletes the entries, unconditionally; one already gone counts as deleted."""

    def shared_key(self, name: str) -> bytes:
        """A random 32-byte key, the same for every instance: the first to ask creates it (insert-only, so the
        first writer wins and the others read its key)."""

    # claims: a value bound to a name for good, first writer wins (which VM a resource id is: pipeline/attest.py).
    def claim(self, name: str, value: str) -> str:
        """Binds ``value`` to ``name`` unless a value is bound already (insert-only); gives the value bound."""

    def claimed(self, name: str) -> str | None:
        """The value bound to ``name``, read fresh (None: nothing yet)."""

    def claims_in(self, partition: str) -> dict[str, str]:
        """Every claim of one partition (``entities.claim_partition``), name to value, read fresh."""

    def claim_many(self, items: Sequence[tuple[str, str]]) -> dict[str, str]:
        """``claim`` for each (names distinct): the value bound to each name, its own or the one bound before. In
        transactions of at most 100 claims of one partition: one that a name bound already refuses is sent again
        without it, so every other claim is still written, and that name answers with the value it holds."""

    def set_aside(self) -> list[SetAside]:
        """The entities reads set aside since the last call (each listed once, to the run that asks)."""

    # dead letters: kept apart from the state, one row per refused message, in partitions of their day.
    def put_dead_letters(self, letters: Sequence[DeadLetter]) -> None: ...

    def dead_letters(self) -> list[dict[str, Any]]:
        """Every dead letter as stored (``entities.dead_letter_entity``), by day then arrival."""
