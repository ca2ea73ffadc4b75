"""The fleet-wide budget claims of one run (a batch, tick or person): each budget domain (a scale set's fault or update
domains together: controls.claim_entity), rate and sequence key is one ``budget`` entity whose claims by EventId are
written If-Match, so of two instances that both see the last slot free one write fails and re-reads it taken; no
instance ever over-claims.

What costs a request is kept to one per batch: an event's domains go in one entity group transaction (the ``budget``
partition holds them all); a batch's claims are kept while it decides (``deferred``) and written together before its
events (``flush``, from pipeline/fold.py); the entities are taken as the instance last saw them (``KnownBudgets``,
pipeline/fleet_cache.py) rather than read before each claim. Only what the run itself read or wrote may refuse a
claim or hold an event by a rate or sequence: a refusal on the instance's older view is read again first. Releases
always read the entity (a release must see the claim whoever wrote it).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime, timedelta

from coordinator.domain.budgets import BudgetDomain
from coordinator.domain.claims import BudgetClaim, BudgetRecord
from coordinator.domain.model import EventRecord
from coordinator.domain.pacing import PaceDomain, PaceHold, claimed, is_rate, is_sequence, pace_hold, released, settled
from coordinator.domain.policy import MAX_PACING_SECONDS
from coordinator.domain.repairs import is_repairs
from coordinator.pipeline.fleet_cache import KnownBudgets, holds_budget
from coordinator.state.commit import COMMIT_ATTEMPTS, commit
from coordinator.state.store import ConcurrencyConflict, StateStore, Stored

__all__ = ["CLAIM_LEASE", "BudgetClaims"]

log = logging.getLogger("coordinator")

# A budget claim counts unconditionally this long (its approval is written right after it); then only while its
# event holds an approval.
CLAIM_LEASE = timedelta(seconds=90)


class BudgetClaims:
    """One run's budget claims: ``claim`` (impact budgets), ``pace`` (rates and sequences), ``release``, and the
    housekeeping's ``spent``. ``noted``: the run's own latest records (they win over what was read)."""

    def __init__(self, store: StateStore, known: KnownBudgets, noted: Mapping[str, EventRecord]) -> None:
        self._store = store
        self._known = known
        self._noted = noted
        # Budget entities as this run read or wrote them (``known`` is only a guess), and the claims deferred
        # (``defer``): per entity, what it was read as, which its write is conditioned on.
        self._budgets_seen: dict[str, Stored[BudgetRecord] | None] = {}
        self._pending: dict[str, Stored[BudgetRecord] | None] = {}
        self._guessing = True
        self.defer = False
        self._claimants_read: dict[str, EventRecord | None] = {}  # ``_claimants``: None when not stored

    def claim(self, record: EventRecord, domains: Sequence[BudgetDomain], now: datetime) -> tuple[str, str]:
        """Takes this event's slots in every budget domain it counts in, or none. Returns ("", "") when claimed,
        else why not and the domain (claim key) that refused.

        Each domain's claims are one entity written with its ETag: of two instances that see the last slot
        free, one write fails, and that instance re-reads and sees the slot taken. An event's domains are written
        in one entity group transaction (they share the budget partition): all or none, one request (entities too
        many or too large for one are cut in several by the store; a later attempt refused gives back what an
        earlier one wrote). A claim is made before the approval is written, so a crash in between can leave a claim
        without an approval: claims older than CLAIM_LEASE count only while their event still holds an approval
        (checked fresh), so none leaks. The entities are read from what this instance last saw (``KnownBudgets``)
        on the first attempt."""
        entities: dict[str, list[BudgetDomain]] = {}  # a scale set's fault or update domains share one
        for domain in sorted(domains, key=lambda d: d.claim_key):
            entities.setdefault(domain.entity_key, []).append(domain)
        keys = sorted(entities)
        if not keys:
            return "", ""
        for attempt in range(COMMIT_ATTEMPTS):
            writes: list[tuple[BudgetRecord, Stored[BudgetRecord] | None]] = []
            for index, key in enumerate(keys):
                stored, fresh = self._budget(key, guess=attempt == 0)
                change, refused, full = self._with_claim(key, entities[key], stored, record.eventId, now)
                if refused and not fresh:  # refused on a guess: only what this run read or wrote may refuse
                    stored, fresh = self._budget(key, guess=False)
                    change, refused, full = self._with_claim(key, entities[key], stored, record.eventId, now)
                if refused:
                    if attempt > 0:  # an earlier attempt's write may have been cut, part of it made: all or none
                        for earlier in keys[:index]:
                            self.release(earlier, record.eventId)
                    return refused, full
                if change is not None:
                    writes.append((change, stored))
            if self.defer:
                self._defer(writes)
                return "", ""
            try:
                self._save_budgets(writes)
            except ConcurrencyConflict:
                continue  # another instance claimed or released meanwhile: decide again on what it wrote
            return "", ""
        first = entities[keys[0]][0].claim_key
        return f"budget {first!r}: contended for {COMMIT_ATTEMPTS} attempts; retried by the timer", first

    def _defer(self, writes: Sequence[tuple[BudgetRecord, Stored[BudgetRecord] | None]]) -> None:
        """Keeps the claims for ``flush``: each entity's write stays conditioned on what it was first read as
        in this run, and later claims of the run build on it."""
        for record, stored in writes:
            self._pending.setdefault(record.scaleSet, stored)
            self._budgets_seen[record.scaleSet] = Stored(record, "")

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """While inside, claims are kept (``flush`` writes them): a batch's decisions."""
        self.defer = True
        try:
            yield
        finally:
            self.defer = False

    def flush(self) -> None:
        """Writes the claims deferred while ``defer`` (a batch's decisions, before their events are written),
        in transactions of up to 100 entities: one request for a batch's claims instead of one per approval. On a
        conflict nothing is known of those entities any more and the run reads them fresh from then on; the caller
        decides again (ConcurrencyConflict), finding made what a transaction before the refused one wrote."""
        pending, self._pending = self._pending, {}
        writes = [(seen.record, base) for key, base in pending.items() if (seen := self._budgets_seen.get(key))]
        try:
            self._save_budgets(writes)
        except ConcurrencyConflict:
            for key in pending:
                self._budgets_seen.pop(key, None)
                self._known.forget(key)
            self._guessing = False
            raise

    def _with_claim(
        self,
        key: str,
        domains: Sequence[BudgetDomain],
        stored: Stored[BudgetRecord] | None,
        event_id: str,
        now: datetime,
    ) -> tuple[BudgetRecord | None, str, str]:
        """The entity ``key`` with this event's claim on ``domains`` (those it holds) added (None: it has it already,
        with every VM), or why a domain refuses and which (its claim key). A claim an earlier approval of the event
        left (withdrawn, approved again) that lacks some of its VMs now (its Resources grew) is widened, within the
        limits: in an entity shared by a scale set's domains, the new VM's domain may have no claim of its own."""
        claims = dict(stored.record.claims) if stored else {}
        wanted = {name: domain.key for domain in domains for name in domain.mine}
        held = claims.get(event_id)
        if held is not None and wanted.keys() <= set(held.vms):
            return None, "", ""
        live = self.live(claims, now)
        for domain in domains:
            count = domain.count_with(domain.counted(live.values()))
            if count > domain.limit:
                others = (e for e, c in live.items() if e != event_id and any(domain.counted([c])))
                holders = ", ".join(sorted(others)[:5])
                why = f"{domain.describe(count)}; held fleet-wide by {holders or 'approved events'}"
                return None, why, domain.claim_key
        shared = any(domain.shares_entity for domain in domains)
        before = live.get(event_id)
        live[event_id] = BudgetClaim(
            eventId=event_id,
            vms=sorted({*wanted, *(before.vms if before else ())}),
            claimedAt=now,
            placed={**(before.placed if before else {}), **wanted} if shared else {},
        )
        return BudgetRecord(scaleSet=key, claims=live), "", ""

    def _budget(self, key: str, *, guess: bool) -> tuple[Stored[BudgetRecord] | None, bool]:
        """The budget entity, and whether it is as this run read or wrote it (only that may refuse a claim or hold
        an event). Else, with ``guess``, as this instance saw it lately (``KnownBudgets``; a key not seen lately is
        taken as absent, and its write, an insert, fails if it exists); else read now."""
        if key in self._budgets_seen:
            return self._budgets_seen[key], True
        if guess and self._guessing:
            return self._known.known(key), False
        return self._read_budget(key), True

    def _read_budget(self, key: str) -> Stored[BudgetRecord] | None:
        # Read fresh, but the claims only when they changed: an entity whose ETag is the one this instance last saw
        # is what it saw. A rate's or sequence's entity holds a claim per event it paced (up to the 1 MiB entity
        # limit) and each batch that holds an event reads it fresh (a hold rests only on what the run read); the
        # ETag's answer stays small. In the waves it saved little (the request is most of a read; docs/changelog.md,
        # *An approval's parts*).
        last = self._known.last(key)
        if last is not None and last.etag and self._store.budget_etag(key) == last.etag:
            stored: Stored[BudgetRecord] | None = last
        else:
            stored = self._store.get_budget(key)
        self._saw_budget(key, stored)
        return stored

    def _saw_budget(self, key: str, stored: Stored[BudgetRecord] | None) -> None:
        self._budgets_seen[key] = stored
        self._known.saw(key, stored)

    def _save_budgets(self, writes: Sequence[tuple[BudgetRecord, Stored[BudgetRecord] | None]]) -> None:
        """Each entity If-Match what it was read as (an insert when it was absent), in transactions of up to 100
        (all or none each); what is written is remembered, and on a refusal all of them forgotten so that the next
        attempt reads them."""
        if not writes:
            return
        pairs = [(record, stored.etag if stored else None) for record, stored in writes]
        try:
            etags = [self._store.save_budget(*pairs[0])] if len(pairs) == 1 else self._store.save_budgets(pairs)
        except ConcurrencyConflict:
            for record, _ in writes:
                self._budgets_seen.pop(record.scaleSet, None)
                self._known.forget(record.scaleSet)
            raise
        for (record, _), etag in zip(writes, etags, strict=True):
            self._saw_budget(record.scaleSet, Stored(record, etag))

    def pace(self, record: EventRecord, domains: Sequence[PaceDomain], now: datetime) -> PaceHold | None:
        """Takes this event's claims on its rule's rate and sequence keys, or none: None when claimed, else what
        held it. Each key is one entity written with its ETag after checking its live claims (``pace_hold``), so of
        two instances that both see the last slot free one write fails and re-reads it taken."""
        taken: list[str] = []
        for domain in sorted(domains, key=lambda d: d.key):
            hold = self._pace_one(domain, record.eventId, now)
            if hold is not None:
                for key in taken:
                    self.release(key, record.eventId)
                return hold
            taken.append(domain.key)
        return None

    def _pace_one(self, domain: PaceDomain, event_id: str, now: datetime) -> PaceHold | None:
        hold: PaceHold | None = None
        guessed = False

        def claim(stored: Stored[BudgetRecord] | None) -> BudgetRecord | None:
            nonlocal hold
            state = self.settle(stored.record, now) if stored is not None else None
            if state is not None and event_id in state.claims:
                hold = None
                return None
            hold = pace_hold(domain, state, event_id, now)
            return None if hold is not None else claimed(domain, state, event_id, now)

        def read(attempt: int) -> Stored[BudgetRecord] | None:
            nonlocal guessed
            stored, fresh = self._budget(domain.key, guess=attempt == 0 and not guessed)
            guessed = guessed or not fresh
            return stored

        try:
            self._commit_budget(domain.key, claim, read=read, defer=self.defer)
            if hold is not None and guessed and domain.key not in self._budgets_seen:
                # Held on a guess: decided again on a fresh read.
                self._commit_budget(domain.key, claim, read=read, defer=self.defer)
        except ConcurrencyConflict:
            return PaceHold(
                domain.key,
                f"budget {domain.key!r}: contended for {COMMIT_ATTEMPTS} attempts; retried by the timer",
                None,
            )
        return hold

    def _commit_budget(
        self,
        key: str,
        change: Callable[[Stored[BudgetRecord] | None], BudgetRecord | None],
        *,
        read: Callable[[int], Stored[BudgetRecord] | None] | None = None,
        defer: bool = False,
    ) -> None:
        """``change`` on the budget entity ``key``: read (by default from the table: a release must see the claim
        whoever wrote it), written If-Match (``defer``: kept for ``flush``), decided again on a conflict
        (ConcurrencyConflict once the attempts are spent); ``change`` gives None to write nothing."""
        commit(
            read or (lambda _attempt: self._read_budget(key)),
            change,
            lambda record, stored: self._defer([(record, stored)]) if defer else self._save_budgets([(record, stored)]),
            what=f"budget of {key}",
        )

    def settle(self, state: BudgetRecord, now: datetime) -> BudgetRecord:
        """A rate or sequence key's state without the claims that lapsed: past ``CLAIM_LEASE``, a claim counts only
        while its event (read fresh) holds its approval, a rate's also once concluded (until it ages out); a
        sequence's concluded event is done (its gap from when it concluded), which covers a release that never ran."""
        old = [event_id for event_id, claim in state.claims.items() if claim.claimedAt < now - CLAIM_LEASE]
        events = self._claimants(old)
        gone: dict[str, datetime | None] = {}
        for event_id in old:
            event = events.get(event_id)
            if event is None or event.approval is None:
                gone[event_id] = None
            elif not holds_budget(event) and is_sequence(state.scaleSet):
                done = event.returnToService.doneAt if event.returnToService is not None else None
                gone[event_id] = done or event.stateSince
        return settled(state, gone) if gone else state

    def spent(self, state: BudgetRecord, now: datetime) -> bool:
        """Whether housekeeping may delete a budget entity: no claim counts any more, and, for a sequence, its last
        domain concluded longer ago than any gap may last (a rate's claims count only within its period)."""
        if is_repairs(state.scaleSet):  # pipeline/repairs.py deletes its own, once resumed and released
            return state.suspendedAt is None and not state.claims
        if is_rate(state.scaleSet):
            period = timedelta(seconds=state.periodSeconds)
            return not any(c.claimedAt > now - period for c in self.settle(state, now).claims.values())
        if is_sequence(state.scaleSet):
            quiet = state.doneAt is None or state.doneAt < now - timedelta(seconds=MAX_PACING_SECONDS)
            return quiet and not self.settle(state, now).claims
        return not self.live(dict(state.claims), now)

    def live(self, claims: dict[str, BudgetClaim], now: datetime) -> dict[str, BudgetClaim]:
        """The claims that still count: those within their lease, and older ones whose event (read fresh) still
        holds an approval."""
        old = [event_id for event_id, claim in claims.items() if claim.claimedAt < now - CLAIM_LEASE]
        events = self._claimants(old)
        return {
            event_id: claim
            for event_id, claim in claims.items()
            if event_id not in old or (event_id in events and holds_budget(events[event_id]))
        }

    def _claimants(self, event_ids: Sequence[str]) -> dict[str, EventRecord]:
        """The events of claims past their lease, as stored when this run first asked (then as the run changed
        them): a timer's tick re-decides every held event, and reading the old claims' events again for each made
        a warm tick cost held events × old claims."""
        wanted = [event_id for event_id in event_ids if event_id not in self._claimants_read]
        if wanted:
            stored = self._store.get_events(wanted)
            self._claimants_read.update({i: stored[i].record if i in stored else None for i in wanted})
        out: dict[str, EventRecord] = {}
        for event_id in event_ids:
            record = self._noted.get(event_id) or self._claimants_read[event_id]
            if record is not None:
                out[event_id] = record
        return out

    def release(self, key: str, event_id: str, *, concluded_at: datetime | None = None) -> None:
        """Frees the event's claim on ``key``. ``concluded_at``: the event concluded then (a rate's claim stays until
        it ages out; a sequence's gap runs from then); None: its approval was withdrawn, it never ran."""

        def release(stored: Stored[BudgetRecord] | None) -> BudgetRecord | None:
            if stored is None or event_id not in stored.record.claims:
                return None
            return released(stored.record, event_id, concluded_at=concluded_at)

        if key in self._pending:  # claimed in this run and not written yet: given back before it is
            seen = self._budgets_seen.get(key)
            if seen is not None and (after := release(seen)) is not None:
                self._budgets_seen[key] = Stored(after, "")
            return
        try:
            self._commit_budget(key, release)
        except ConcurrencyConflict:
            log.warning("budget of %s: claim of %s not released (contended); it lapses by itself", key, event_id)
