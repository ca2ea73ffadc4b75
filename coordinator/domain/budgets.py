"""Budgets: the domains an ``approve-within-budget`` rule counts an event in, each with the VMs impacted there and
the limit the rule sets on a domain of its size.

Pure: takes the policy, the event and the fleet view; coordinator/domain/evaluation.py decides with these domains
and coordinator/pipeline/decide.py claims them fleet-wide.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import chain

from coordinator.domain.claims import BudgetClaim
from coordinator.domain.controls import DomainKind, claim_entity, claim_key, limit_for
from coordinator.domain.fleet_view import FleetView, scale_set_of
from coordinator.domain.model import EventRecord
from coordinator.domain.policy import Policy

__all__ = ["BudgetDomain", "budget_domains", "budget_limit", "impacted_by"]


def impacted_by(record: EventRecord) -> dict[str, set[str]]:
    """The VMs this event impacts, per scale set."""
    mine: dict[str, set[str]] = {}
    for name in record.resources:
        mine.setdefault(scale_set_of(record, name), set()).add(name)
    return mine


def budget_limit(policy: Policy, rule_name: str) -> int | None:
    """maxImpacted of the named approve-within-budget rule; None for any other rule (or one no longer there, or a
    percent-only budget: its limit depends on the domain, see ``budget_domains``)."""
    rule = policy.rule(rule_name)
    return rule.budget.maxImpacted if rule is not None and rule.budget is not None else None


@dataclass(frozen=True)
class BudgetDomain:
    """One domain an event's budget rule counts in: its kind and key, the event's VMs in it, the VMs other events
    take there (impacted, or queued ahead; may include the event's own: ``count_with`` counts each once), its size
    (known VMs not retired) and the limit that sets."""

    kind: DomainKind
    key: str
    mine: frozenset[str]
    others: frozenset[str]
    size: int
    limit: int

    def count_with(self, extra: Iterable[str] = ()) -> int:
        """How many VMs the domain has impacted with this event's (and ``extra``), each counted once, without
        copying ``others`` (a zone's can be thousands, and every held decision counts them)."""
        return len(self.others) + len({name for name in chain(self.mine, extra) if name not in self.others})

    @property
    def claim_key(self) -> str:
        """The domain's name in a hold (``holdName``): the kind and the domain."""
        return claim_key(self.kind, self.key)

    @property
    def entity_key(self) -> str:
        """The budget entity its claims are in (``claim_entity``): its own, or its scale set's for fault and update
        domains, where a claim places each VM (``BudgetClaim.placed``)."""
        return claim_entity(self.kind, self.key)

    @property
    def shares_entity(self) -> bool:
        """Whether its claims are in an entity other domains' are in too (a claim then places each of its VMs)."""
        return self.entity_key != self.claim_key

    def counted(self, claims: Iterable[BudgetClaim]) -> Iterator[str]:
        """The VMs that ``claims`` (of this domain's entity) take in this domain: all of them in an entity of its
        own; in a shared one, those placed in it."""
        shared = self.shares_entity
        for claim in claims:
            yield from (name for name in claim.vms if not shared or claim.placed.get(name) == self.key)

    def describe(self, count: int) -> str:
        return f"{self.kind} {self.key or '(none)'!r} would have {count} impacted instances (limit {self.limit})"


def budget_domains(policy: Policy, rule_name: str, record: EventRecord, fleet: FleetView) -> list[BudgetDomain]:
    """The domains the named budget rule counts this event in (empty for any other rule). A scale set's budget
    counts a VM without a scale set under '' as before; the other kinds skip VMs without that domain (a regional
    VM has no zone) rather than lump them together."""
    rule = policy.rule(rule_name)
    if rule is None or rule.budget is None:
        return []
    budget = rule.budget
    affected = record.resources or sorted(record.vms)
    out: list[BudgetDomain] = []
    for kind in budget.per:
        keyed: dict[str, set[str]] = {}
        for name in affected:
            key = fleet.facts(record, name).domain(kind)
            if key or kind == "scaleSet":
                keyed.setdefault(key, set()).add(name)
        for key, mine in sorted(keyed.items()):
            size = fleet.size_with(kind, key, mine)
            limit = limit_for(max_impacted=budget.maxImpacted, max_percent=budget.maxPercent, size=size)
            others = fleet.taken_in(kind, key, record)
            out.append(BudgetDomain(kind, key, frozenset(mine), others, size, limit))
    return out
