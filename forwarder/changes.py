"""Pure decisions of the poll loop: has the document changed, and which events are new or gone for this VM.

No I/O here, so that every case (up, down, reset, same incarnation with different content) is a plain unit test.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from contracts.wire import ScheduledEvent, ScheduledEventsDocument

ChangeReason = Literal["first", "up", "down", "content"]


def canonical(document: ScheduledEventsDocument) -> str:
    """The document's content independent of key order and whitespace (what "same content" means)."""
    return json.dumps(document.to_mapping(), sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class Change:
    document: ScheduledEventsDocument
    canonical: str
    reason: ChangeReason
    # This VM's events that are new to the list (run prepare hooks) and that left it (run recover hooks),
    # as the docs recommend: prepare for new, recover from gone, remember the list for the next round.
    prepare: tuple[ScheduledEvent, ...]
    recover: tuple[ScheduledEvent, ...]
    # (before, after): a Scheduled event that left as a Started one of the same maintenance appeared under
    # another EventId (see `renamed`). Neither is in prepare nor recover.
    renamed: tuple[tuple[ScheduledEvent, ScheduledEvent], ...] = ()


def _maintenance(event: ScheduledEvent) -> tuple[str, frozenset[str]]:
    return event.EventType, frozenset(event.Resources)


def renamed(
    gone: tuple[ScheduledEvent, ...], new: tuple[ScheduledEvent, ...]
) -> tuple[tuple[ScheduledEvent, ScheduledEvent], ...]:
    """Pairs (gone, new) that are one maintenance whose EventId changed when it started.

    Microsoft's public mock server (and, by its authors' account, the platform at times) gives a Started event
    a new EventId. Read literally, the list says "the Scheduled one ended, a new one started": recover would run
    mid-maintenance and prepare would run once the impact is already under way. So a Scheduled event that leaves
    in the same change in which a Started event with the same EventType and the same set of Resources appears is
    taken for the same maintenance. Each side pairs at most once, in document order.
    """
    pairs: list[tuple[ScheduledEvent, ScheduledEvent]] = []
    taken: set[str] = set()
    for before in gone:
        if before.EventStatus != "Scheduled":
            continue
        match = next(
            (
                after
                for after in new
                if after.EventStatus == "Started"
                and after.EventId not in taken
                and _maintenance(after) == _maintenance(before)
            ),
            None,
        )
        if match is not None:
            taken.add(match.EventId)
            pairs.append((before, match))
    return tuple(pairs)


def detect(
    previous: ScheduledEventsDocument | None,
    previous_canonical: str | None,
    current: ScheduledEventsDocument,
    *,
    vm_name: str,
    set_aside: frozenset[str] = frozenset(),
) -> Change | None:
    """The change from `previous` to `current`, or None when nothing changed.

    A different DocumentIncarnation in either direction is a change (IMDS starts over after 24 h without a
    request), and so is different content under the same incarnation, which IMDS should never produce but
    which must not be missed if it does.

    `set_aside` names the EventIds still listed by IMDS but left out of `current` because they were invalid:
    such an event has not left, so it is not recovered (and hooks never run for an invalid event).
    """
    current_canonical = canonical(current)
    if previous is None:
        reason: ChangeReason = "first"
    elif current.DocumentIncarnation > previous.DocumentIncarnation:
        reason = "up"
    elif current.DocumentIncarnation < previous.DocumentIncarnation:
        reason = "down"
    elif current_canonical != (previous_canonical if previous_canonical is not None else canonical(previous)):
        reason = "content"
    else:
        return None
    before = {e.EventId: e for e in previous.Events} if previous is not None else {}
    now = {e.EventId for e in current.Events} | set_aside
    new = tuple(e for e in current.Events if e.EventId not in before and e.concerns(vm_name))
    gone = tuple(e for e in before.values() if e.EventId not in now and e.concerns(vm_name))
    pairs = renamed(gone, new)
    old_ids = {b.EventId for b, _ in pairs}
    new_ids = {a.EventId for _, a in pairs}
    return Change(
        document=current,
        canonical=current_canonical,
        reason=reason,
        prepare=tuple(e for e in new if e.EventId not in new_ids),
        recover=tuple(e for e in gone if e.EventId not in old_ids),
        renamed=pairs,
    )
