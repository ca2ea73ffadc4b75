"""Pure decisions of the poll loop: has the document changed, and which events are new or gone for this VM.

No I/O here, so that every case (up, down, reset, same incarnation with different content) is a plain unit test.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from forwarder.document import ScheduledEvent, ScheduledEventsDocument

ChangeReason = Literal["first", "up", "down", "content"]


def canonical(document: ScheduledEventsDocument) -> str:
    """The document's content independent of key order and whitespace (what "same content" means)."""
    return json.dumps(document.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class Change:
    document: ScheduledEventsDocument
    canonical: str
    reason: ChangeReason
    # This VM's events that are new to the list (run prepare hooks) and that left it (run recover hooks),
    # as the docs recommend: prepare for new, recover from gone, remember the list for the next round.
    prepare: tuple[ScheduledEvent, ...]
    recover: tuple[ScheduledEvent, ...]


def detect(
    previous: ScheduledEventsDocument | None,
    previous_canonical: str | None,
    current: ScheduledEventsDocument,
    *,
    vm_name: str,
) -> Change | None:
    """The change from `previous` to `current`, or None when nothing changed.

    A different DocumentIncarnation in either direction is a change (IMDS starts over after 24 h without a
    request), and so is different content under the same incarnation, which IMDS should never produce but
    which must not be missed if it does.
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
    now = {e.EventId for e in current.Events}
    prepare = tuple(e for e in current.Events if e.EventId not in before and e.concerns(vm_name))
    recover = tuple(e for e in before.values() if e.EventId not in now and e.concerns(vm_name))
    return Change(document=current, canonical=current_canonical, reason=reason, prepare=prepare, recover=recover)
