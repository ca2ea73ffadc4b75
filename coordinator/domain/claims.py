"""The fleet-wide claim records: one entity per budget domain, rate, sequence, or scale set whose automatic repairs
are suspended (PartitionKey ``budget``), each written If-Match so two instances never both take what one may."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["BudgetClaim", "BudgetRecord"]


class BudgetClaim(BaseModel):
    """One event's hold on a budget domain (a scale set, zone, fault/update domain, placement group): its VMs count
    as impacted there while the claim lives."""

    model_config = ConfigDict(extra="ignore")

    eventId: str
    vms: list[str]
    claimedAt: datetime
    # A sequence's claim: the domains (keys) the event touches, in progress while the claim lives.
    domains: list[str] = Field(default_factory=list)
    # In an entity shared by a scale set's fault or update domains (controls.claim_entity): each VM's domain.
    placed: dict[str, str] = Field(default_factory=dict)


class BudgetRecord(BaseModel):
    """The claims on one budget domain's "at most N (or P%) impacted" budget, fleet-wide: every instance that
    approves within budget adds its claim here with an ETag-checked write first, so two instances cannot both take
    the last slot. ``scaleSet`` is the domain's key (coordinator/controls.claim_key: a scale set's name, or the
    kind-prefixed key of another domain)."""

    model_config = ConfigDict(extra="ignore")

    scaleSet: str
    claims: dict[str, BudgetClaim] = Field(default_factory=dict)
    # A rate budget's period when last claimed (housekeeping keeps the entity while a claim is within it).
    periodSeconds: int = 0
    # A sequence: the domains of the event that concluded last, and when (its gap runs from then).
    lastDomains: list[str] = Field(default_factory=list)
    doneAt: datetime | None = None
    # A scale set's automatic repairs (key ``repairs:`` + its ARM id, pipeline/repairs.py): the claims are the
    # in-flight events that want them suspended; ``resource`` the scale set's id; ``suspendedAt`` when this
    # coordinator suspended them (None: it did not, or resumed them), ``resumedAt`` when it resumed them at the bound.
    resource: str = ""
    suspendedAt: datetime | None = None
    resumedAt: datetime | None = None
