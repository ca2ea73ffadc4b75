"""The census from Azure Resource Manager as one coordinator instance keeps it: the last good read
(``census_arm.ArmCensusReader``: where each VM of the fleet sits and its tags, read with the coordinator's own
identity, never from what the VMs report), shared by the instance's runs.

It is read again when it is older than ``refresh_every`` (the timer asks), when a run meets a VM it does not list
(a scale-out, or a name nobody listed: at most once per ``min_interval``, so a flood of invented names costs one read
per interval), and at the next need after the fleet's membership changed (``membership_changed``: the timer retired
a VM). A read that fails keeps the last good one; one older than ``usable_for`` is not usable, and decisions that
need it hold (coordinator/pipeline/decide.py).

A read runs on a thread of its own and a run waits for it a bounded time: ``FIRST_READ_WAIT`` while there is no
census to decide on, ``REREAD_WAIT`` for a VM it does not list, and no more than the first of these in all, however
many of its envelopes ask (``CensusView``). Why: each page of ARM's lists is bounded by its call's deadline (arm.py),
but a read is as many pages as the fleet needs (a 100,000-VM fleet's are many) and a throttled ARM answers each with
a Retry-After, so a read as a whole has no bound a batch could wait out, and its Event Hubs partition would wait with
it. A read that outlasts the wait lands for the runs after. Meanwhile a VM the census does not list is what it is
without one: its attested vmId and the bindings decide its name (coordinator/pipeline/attest.py), and ARM outranks
them once a read lists it (docs/security.md, *Without ARM's census, the first speaker binds a name*).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from coordinator.adapters.census_arm import API_VERSION, ArmCensusReader, CensusError, CensusReader, resource_group_id
from coordinator.domain.census import CensusEntry
from coordinator.domain.controls import VmFacts
from coordinator.domain.fleet_view import Census as IndexedCensus

__all__ = [
    "API_VERSION",
    "FIRST_READ_WAIT",
    "REREAD_WAIT",
    "ArmCensusReader",
    "Census",
    "CensusError",
    "CensusReader",
    "CensusView",
    "resource_group_id",
]

log = logging.getLogger("coordinator")

# How long a run waits for a read while there is no census yet, rather than decide without one: it would hold every
# census rule's event ("never read") while a run beside it approves. Shorter than a batch's approval deadline (30 s).
FIRST_READ_WAIT = timedelta(seconds=10)
# How long a run waits for a read that may list a VM it met (a scale-out's new VM): a small fleet's read is well
# within it; a large or throttled one's lands for the runs after.
REREAD_WAIT = timedelta(seconds=3)
REFRESH_EVERY = timedelta(minutes=5)
MIN_INTERVAL = timedelta(seconds=30)
USABLE_FOR = timedelta(minutes=15)


@dataclass
class _Snapshot:
    entries: Mapping[str, CensusEntry] = field(default_factory=dict)  # by name, lower case
    read_at: datetime | None = None
    by_resource: Mapping[str, CensusEntry] = field(default_factory=dict)  # by resource id, lower case
    # By domain, set once (under the lock): with the read (off the batches' path) once wanted, else by the first
    # run that asks (a policy without budgets never pays ~1 s of CPU and tens of MB a read of a 100k fleet).
    indexed: IndexedCensus | None = None


class Census:
    """The last good census read, shared by the runs of one coordinator instance (module docstring: when it is read
    again). Thread-safe: a read happens outside the lock, and its result replaces the snapshot whole."""

    def __init__(
        self,
        reader: CensusReader,
        *,
        refresh_every: timedelta = REFRESH_EVERY,
        min_interval: timedelta = MIN_INTERVAL,
        usable_for: timedelta = USABLE_FOR,
        index_at_read: bool = False,
    ) -> None:
        """``index_at_read``: the domain index built with every read (else from the first run that asks for it)."""
        if not min_interval <= refresh_every < usable_for:
            raise ValueError("the census needs min_interval <= refresh_every < usable_for")
        self._reader = reader
        self.refresh_every = refresh_every
        self.min_interval = min_interval
        self.usable_for = usable_for
        self._snapshot = _Snapshot()
        self._lock = threading.Lock()
        self._attempted: datetime | None = None
        self._reading: threading.Event | None = None  # set once the read in flight ends
        self._stale = False
        self._index_wanted = index_at_read  # a run asked for the index: later reads build it with the read
        self.error = ""  # why the last read failed; "" after a good one
        self.reads = 0

    @property
    def scopes(self) -> Sequence[str]:
        return self._reader.scopes

    def at(self, now: datetime) -> CensusView:
        """The census as one run at ``now`` sees it."""
        return CensusView(self, now)

    def membership_changed(self) -> None:
        """VMs left the fleet (the timer retired them) or joined: read again at the next need."""
        with self._lock:
            self._stale = True

    def refresh_if_due(self, now: datetime) -> None:
        """The timer's part: a read when the last good one is older than ``refresh_every``, or after a membership
        change, or when there is none yet; waited for ``REREAD_WAIT`` at most (the tick goes on with the census it
        has, usable for ``usable_for``)."""
        snapshot = self._snapshot
        if self._stale or snapshot.read_at is None or now - snapshot.read_at >= self.refresh_every:
            self.refresh(now, why="timer" if not self._stale else "membership changed", wait=REREAD_WAIT)

    def refresh(self, now: datetime, *, why: str, wait: timedelta | None = None) -> bool:
        """Reads ARM unless another read was attempted less than ``min_interval`` ago (the first read is never held
        back), on a thread of its own, and waits for it ``wait`` at most (None: until it ends); a read already on
        its way, whoever started it, is waited for the same way. True when a good read replaced the census while
        the caller waited."""
        with self._lock:
            reads, reading = self.reads, self._reading
            if reading is None:
                if self._attempted is not None and now - self._attempted < self.min_interval:
                    return False
                self._attempted, self._stale = now, False
                reading = self._reading = threading.Event()
                started = threading.Thread(
                    target=self._read_in_background, args=(now, why, reading), name="census-read", daemon=True
                )
            else:
                started = None
        if started is not None:
            started.start()
        reading.wait(None if wait is None else max(0.0, wait.total_seconds()))
        return self.reads > reads

    def wait_for_read(self, within: timedelta) -> None:
        """Until the read under way (if any) ends, ``within`` at most."""
        reading = self._reading
        if reading is not None:
            reading.wait(max(0.0, within.total_seconds()))

    def _read_in_background(self, now: datetime, why: str, done: threading.Event) -> None:
        try:
            self._read(now, why=why)
        finally:
            with self._lock:
                self._reading = None
            done.set()

    def _read(self, now: datetime, *, why: str) -> bool:
        try:
            entries = self._reader.read()
        except Exception as error:  # kept as the reason; the last good census stays in use while it is usable
            log.warning("census: reading ARM failed (%s): %s", why, error)
            with self._lock:
                self.error = f"{type(error).__name__}: {str(error)[:500]}"
            return False
        by_name: dict[str, CensusEntry] = {}
        by_resource: dict[str, CensusEntry] = {}
        for entry in entries:
            by_name.setdefault(entry.name.lower(), entry)
            by_resource.setdefault(entry.resourceId.lower(), entry)
        indexed = IndexedCensus((e.name, e.facts) for e in by_name.values()) if self._index_wanted else None
        with self._lock:
            self._snapshot = _Snapshot(entries=by_name, read_at=now, by_resource=by_resource, indexed=indexed)
            self.error = ""
            self.reads += 1
        log.info("census: %d VMs in %s read from ARM (%s)", len(by_name), ", ".join(self.scopes), why)
        return True

    def snapshot(self) -> tuple[Mapping[str, CensusEntry], datetime | None]:
        snapshot = self._snapshot
        return snapshot.entries, snapshot.read_at

    def snapshot_by_resource(self) -> Mapping[str, CensusEntry]:
        return self._snapshot.by_resource

    def snapshot_indexed(self) -> IndexedCensus:
        snapshot = self._snapshot
        if snapshot.indexed is None:
            # Outside the lock: two runs asking at once build it twice, one kept.
            built = IndexedCensus((e.name, e.facts) for e in snapshot.entries.values())
            with self._lock:
                self._index_wanted = True
                if snapshot.indexed is None:
                    snapshot.indexed = built
        return snapshot.indexed


class CensusView:
    """The census for one run at one instant: the first need reads ARM if nothing was read yet; ``ensure`` reads
    again (rate-limited) for VMs it does not list. The run waits for reads a bounded time in all (module docstring):
    from its first wait, ``FIRST_READ_WAIT`` or ``REREAD_WAIT`` (whichever that wait was for) at most."""

    def __init__(self, census: Census, now: datetime) -> None:
        self.census = census
        self.now = now
        self._waits_end: float | None = None  # monotonic: when this run stops waiting for reads

    def _wait(self, longest: timedelta) -> timedelta:
        clock = time.monotonic()
        if self._waits_end is None:
            self._waits_end = clock + longest.total_seconds()
        return min(longest, timedelta(seconds=max(0.0, self._waits_end - clock)))

    def entries(self) -> Mapping[str, CensusEntry]:
        """The VMs ARM lists, by name in lower case."""
        entries, read_at = self.census.snapshot()
        if read_at is None:
            self.census.refresh(self.now, why="first need", wait=self._wait(FIRST_READ_WAIT))
            entries, _ = self.census.snapshot()
        return entries

    def entry(self, name: str) -> CensusEntry | None:
        return self.entries().get(name.lower())

    def entry_of_resource(self, resource_id: str) -> CensusEntry | None:
        """The VM ARM lists under ``resource_id`` (any case), from the last good read (read first if none yet)."""
        self.entries()
        return self.census.snapshot_by_resource().get(resource_id.lower())

    def facts(self) -> dict[str, VmFacts]:
        """Every listed VM's facts, by its name as ARM spells it."""
        return {entry.name: entry.facts for entry in self.entries().values()}

    def indexed(self) -> IndexedCensus:
        """The same facts indexed by budget domain (made by the first run that asks, then with each read; read,
        never changed)."""
        self.entries()
        return self.census.snapshot_indexed()

    def ensure(self, names: Iterable[str]) -> bool:
        """Reads ARM again when one of ``names`` is not listed (a VM that joined since the last read; or a name no
        VM has, which the rate limit makes cheap). True when it read ARM again."""
        listed = self.entries()
        missing = sorted({name for name in names if name.lower() not in listed})
        if not missing:
            return False
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        return self.census.refresh(self.now, why=f"not listed yet: {shown}", wait=self._wait(REREAD_WAIT))

    def usable(self) -> bool:
        """Whether the census may be decided on: a good read no older than ``usable_for``."""
        self.entries()
        _, read_at = self.census.snapshot()
        return read_at is not None and self.now - read_at < self.census.usable_for

    def why_not_usable(self) -> str:
        _, read_at = self.census.snapshot()
        since = f"last read {read_at.isoformat()}" if read_at is not None else "never read"
        error = f": {self.census.error}" if self.census.error else ""
        return f"the census from ARM ({', '.join(self.census.scopes)}) is not usable ({since}){error}"
