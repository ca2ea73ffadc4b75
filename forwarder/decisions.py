"""The listener's decision ledger: what it did with each decisionId, so that a decision is executed at most once.

The durable ledger is the forwarder's SQLite state (``forwarder.durable_state.Store``, next to the spool, so it
survives a restart); ``MemoryLedger`` keeps the same bounds in memory for a listener without a state directory and
for tests. How the listener uses it: ``forwarder/approver.py``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal, Protocol

__all__ = [
    "DECISION_LEDGER_ENTRIES",
    "DECISION_LEDGER_KEEP",
    "DecisionLedger",
    "DecisionStatus",
    "LedgerEntry",
    "MemoryLedger",
]

# An entry is kept this long and at most this many: far longer than any request the listener accepts stays valid
# (its notAfter is at most 15 minutes ahead, refused past it), so a request whose entry was dropped is refused on its
# own dates; a day also outlasts a VM clock that was set back by hours.
DECISION_LEDGER_KEEP = timedelta(hours=24)
DECISION_LEDGER_ENTRIES = 10_000
DecisionStatus = Literal["forcing", "executing", "approved", "refused"]


@dataclass(frozen=True)
class LedgerEntry:
    """What the listener did with one decisionId: ``forcing`` while its force hook runs (a request naming
    ``facts.forceHook``, answered "accepted": forwarder/force.py), ``executing`` from just before its StartRequests
    POST until IMDS answered (an entry left ``forcing`` or ``executing`` by a crash is judged again, on a fresh
    document), ``approved`` (IMDS took it) or ``refused``; ``result`` is the ApprovalResult JSON it answered ("" while
    executing)."""

    decision_id: str
    event_id: str
    status: DecisionStatus
    at: datetime
    result: str = ""


class DecisionLedger(Protocol):
    """Where the listener keeps what it did with each decisionId (``forwarder.durable_state.Store``, or
    ``MemoryLedger``)."""

    def decision(self, decision_id: str) -> LedgerEntry | None: ...

    def remember_decision(self, entry: LedgerEntry) -> None: ...

    def forget_decision(self, decision_id: str) -> None: ...


class MemoryLedger:
    """The decision ledger in memory, with the durable one's bounds: for a listener without a state directory and
    for tests. Lost on a restart, so only the durable one makes "at most once" hold across restarts."""

    def __init__(self, *, keep: timedelta = DECISION_LEDGER_KEEP, max_entries: int = DECISION_LEDGER_ENTRIES) -> None:
        self._keep = keep
        self._max_entries = max_entries
        self._entries: OrderedDict[str, LedgerEntry] = OrderedDict()

    def decision(self, decision_id: str) -> LedgerEntry | None:
        return self._entries.get(decision_id)

    def remember_decision(self, entry: LedgerEntry) -> None:
        self._entries[entry.decision_id] = entry
        self._entries.move_to_end(entry.decision_id)
        for key in [k for k, e in self._entries.items() if e.at < entry.at - self._keep]:
            del self._entries[key]
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)

    def forget_decision(self, decision_id: str) -> None:
        self._entries.pop(decision_id, None)
