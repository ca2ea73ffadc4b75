"""Pacing: a rule's rate budget (at most N approvals in any sliding period, per scope) and its sequence (one domain at
a time, with an optional gap after the last event of a domain concluded), each kept as one claim entity per key.

Pure: the keys an event's rule claims (``pace_domains``), what holds it given a key's state (``pace_hold``), and the
state with its claim added (``claimed``), released (``released``) or lapsed (``settled``).
coordinator/pipeline/budget_claims.py reads and writes the state with ETags (so two instances never over-claim);
coordinator/domain/evaluation.py checks the state a fleet view carries (ops/policy's test cases give one).

Keys: ``rate:RULE:fleet``, ``rate:RULE:KIND:DOMAIN`` (one count per domain), ``sequence:RULE:KIND``. Both count
this rule's approvals only: two rules pace independently.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from coordinator.domain.claims import BudgetClaim, BudgetRecord
from coordinator.domain.fleet_view import FleetView
from coordinator.domain.model import EventRecord
from coordinator.domain.policy import Policy, RateOption, SequenceOption

__all__ = [
    "RATE",
    "SEQUENCE",
    "PaceDomain",
    "PaceHold",
    "claimed",
    "is_rate",
    "is_sequence",
    "pace_domains",
    "pace_hold",
    "released",
    "settled",
]

RATE = "rate:"
SEQUENCE = "sequence:"


def is_rate(key: str) -> bool:
    return key.startswith(RATE)


def is_sequence(key: str) -> bool:
    return key.startswith(SEQUENCE)


@dataclass(frozen=True)
class PaceDomain:
    """One key an event's rule paces it by: a rate (``rate``) or a sequence (``sequence``), the event's VMs counted
    there and, for a sequence, the domains they are in."""

    key: str
    rule: str
    vms: frozenset[str]
    rate: RateOption | None = None
    sequence: SequenceOption | None = None
    domains: frozenset[str] = frozenset()


@dataclass(frozen=True)
class PaceHold:
    """Why a pacing key holds an event, and until when (None: until events conclude, not known in advance)."""

    key: str
    reason: str
    until: datetime | None


def pace_domains(policy: Policy, rule_name: str, record: EventRecord, fleet: FleetView) -> list[PaceDomain]:
    """The keys the named rule paces this event by (none for a rule without rate or sequence, or one no longer
    there). A rate per domain counts the event once in each domain its VMs are in
    (VMs without that domain, e.g. a regional VM for ``zone``, are not counted; a scale set's counts VMs without one
    under ''); a sequence counts the domains its VMs are in (none: the sequence does not hold it)."""
    rule = policy.rule(rule_name)
    if rule is None:
        return []
    rate, sequence = rule.rate, rule.sequence
    affected = record.resources or sorted(record.vms)
    out: list[PaceDomain] = []
    if rate is not None:
        if rate.per == "fleet":
            out.append(PaceDomain(f"{RATE}{rule_name}:fleet", rule_name, frozenset(affected), rate=rate))
        else:
            keyed: dict[str, set[str]] = {}
            for name in affected:
                key = fleet.facts(record, name).domain(rate.per)
                if key or rate.per == "scaleSet":
                    keyed.setdefault(key, set()).add(name)
            out.extend(
                PaceDomain(f"{RATE}{rule_name}:{rate.per}:{key}", rule_name, frozenset(vms), rate=rate)
                for key, vms in sorted(keyed.items())
            )
    if sequence is not None:
        domains = {fleet.facts(record, name).domain(sequence.per) for name in affected} - {""}
        if domains:
            out.append(
                PaceDomain(
                    f"{SEQUENCE}{rule_name}:{sequence.per}",
                    rule_name,
                    frozenset(affected),
                    sequence=sequence,
                    domains=frozenset(domains),
                )
            )
    return out


def pace_hold(domain: PaceDomain, state: BudgetRecord | None, event_id: str, now: datetime) -> PaceHold | None:
    """What holds this event at this key (None: room). ``state``: the key's live claims (``settled``), the event's
    own left out.

    Rate: the approvals decided in (now - period, now] number fewer than the maximum; else held until enough of the
    oldest age out. Sequence: nothing is in progress and the gap since the last domain concluded has passed (or the
    event touches only that domain again), or every domain it touches is already in progress."""
    claims = {k: c for k, c in (state.claims if state is not None else {}).items() if k != event_id}
    if domain.rate is not None:
        return _rate_hold(domain, domain.rate, claims, now)
    assert domain.sequence is not None  # a PaceDomain is one or the other
    return _sequence_hold(domain, domain.sequence, state, claims, now)


def _rate_hold(domain: PaceDomain, rate: RateOption, claims: dict[str, BudgetClaim], now: datetime) -> PaceHold | None:
    period = timedelta(seconds=rate.periodSeconds)
    within = sorted(c.claimedAt for c in claims.values() if c.claimedAt > now - period)
    limit = rate.maxApprovals
    if len(within) < limit:
        return None
    # Room again once all but limit - 1 of them have aged out.
    until = within[len(within) - limit] + period
    return PaceHold(
        domain.key,
        f"rate {domain.key!r}: {len(within)} approvals by rule {domain.rule!r} in the last {rate.periodSeconds} s "
        f"(at most {limit}); a slot frees at {until.isoformat()}",
        until,
    )


def _sequence_hold(
    domain: PaceDomain,
    sequence: SequenceOption,
    state: BudgetRecord | None,
    claims: dict[str, BudgetClaim],
    now: datetime,
) -> PaceHold | None:
    kind, gap = sequence.per, timedelta(seconds=sequence.gapSeconds)
    active = {d for c in claims.values() for d in c.domains}
    if active:
        if domain.domains <= active:
            return None
        # The first event that took it (claims in the order taken) and how many in all: a later claim changes only a
        # figure, so an event held by the same domain stays the same decision (evaluation.same_decision: no event
        # write or Decision row as the domain's events queue up).
        first = min(claims.items(), key=lambda item: item[1].claimedAt)[0]
        holders = f"{first} first, {len(claims)} in all"
        return PaceHold(
            domain.key,
            f"sequence {domain.key!r}: {kind} {', '.join(sorted(active))} in progress ({holders}); "
            f"{', '.join(sorted(domain.domains - active))} waits until its events conclude"
            + (f", then {sequence.gapSeconds} s" if gap else ""),
            None,
        )
    if state is None or state.doneAt is None or domain.domains <= set(state.lastDomains):
        return None
    until = state.doneAt + gap
    if now >= until:
        return None
    return PaceHold(
        domain.key,
        f"sequence {domain.key!r}: {kind} {', '.join(state.lastDomains)} concluded at {state.doneAt.isoformat()}; "
        f"the next {kind} waits {sequence.gapSeconds} s, until {until.isoformat()}",
        until,
    )


def claimed(domain: PaceDomain, state: BudgetRecord | None, event_id: str, now: datetime) -> BudgetRecord:
    """The key's state with this event's claim added (a rate's claims that aged out dropped: they count no more)."""
    base = state if state is not None else BudgetRecord(scaleSet=domain.key)
    claims = dict(base.claims)
    update: dict[str, object] = {}
    if domain.rate is not None:
        period = timedelta(seconds=domain.rate.periodSeconds)
        claims = {k: c for k, c in claims.items() if c.claimedAt > now - period}
        update["periodSeconds"] = domain.rate.periodSeconds
    claims[event_id] = BudgetClaim(
        eventId=event_id, vms=sorted(domain.vms), claimedAt=now, domains=sorted(domain.domains)
    )
    update["claims"] = claims
    return base.model_copy(update=update)


def released(state: BudgetRecord, event_id: str, *, concluded_at: datetime | None) -> BudgetRecord | None:
    """The state without this event's claim (None: nothing to change). ``concluded_at``: the event concluded then
    (not a withdrawn approval): a rate's approval still counts until it ages out, so its claim stays; a sequence's
    domain is done, and its gap runs from then."""
    claim = state.claims.get(event_id)
    if claim is None or (concluded_at is not None and is_rate(state.scaleSet)):
        return None
    return settled(state, {event_id: concluded_at})


def settled(state: BudgetRecord, gone: Mapping[str, datetime | None]) -> BudgetRecord:
    """The state without the claims of ``gone`` (event -> when it concluded, or None: it never ran, e.g. an
    approval withdrawn or a claim whose approval was never written). A sequence remembers the domains of the last
    one to conclude and when."""
    claims = {k: c for k, c in state.claims.items() if k not in gone}
    update: dict[str, object] = {"claims": claims}
    for event_id, at in gone.items():
        claim = state.claims.get(event_id)
        if claim is None or at is None or not is_sequence(state.scaleSet):
            continue
        if state.doneAt is None or at >= state.doneAt:
            update["doneAt"], update["lastDomains"] = at, list(claim.domains)
            state = state.model_copy(update={"doneAt": at})
    return state.model_copy(update=update)
