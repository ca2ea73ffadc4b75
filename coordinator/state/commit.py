"""The one read-modify-write with ETags that every entity the coordinator writes goes through.

Takes how to read (the attempt number: 0 may use a cache or a record just read), what to change (None: nothing to
write) and how to write conditionally on what was read; gives back what was written. A ``ConcurrencyConflict`` means
another instance wrote first: read again and redo, so each decision is taken once. Events, VM groups, budgets and
the outbox all commit through ``commit``; ``commit_event`` (coordinator/state/events.py) is it for one event record.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from coordinator.state.store import ConcurrencyConflict

COMMIT_ATTEMPTS = 8
# A transaction of many entities is retried this often before its entities are committed one by one.
BULK_ATTEMPTS = 3

Read = TypeVar("Read")
Written = TypeVar("Written")


def commit(
    read: Callable[[int], Read],
    mutate: Callable[[Read], Written | None],
    write: Callable[[Written, Read], object],
    *,
    what: str,
    attempts: int = COMMIT_ATTEMPTS,
    on_conflict: Callable[[], None] | None = None,
) -> Written | None:
    """Read, mutate, write with the ETag of what was read; on a conflict, again (at most ``attempts`` times).

    Returns what was written, or None when ``mutate`` found nothing to write. Raises ``ConcurrencyConflict`` naming
    ``what`` when every attempt met a newer ETag; ``on_conflict`` is called at each conflict (counting them)."""
    for attempt in range(attempts):
        current = read(attempt)
        change = mutate(current)
        if change is None:
            return None
        try:
            write(change, current)
        except ConcurrencyConflict:
            if on_conflict is not None:
                on_conflict()
            continue
        return change
    raise ConcurrencyConflict(f"{what}: gave up after {attempts} conflicting writes")
