"""Approval rules: a declarative YAML policy, validated with pydantic; ordered, first match wins.

Pure: ``evaluate(policy, record, fleet, now, gates=...)`` -> Decision, with no I/O. Every decision names its rule,
says why, and when something held it, what (a window, blackout, budget, gate, hooks or another delete) and until
when. The controls' own models (schedules, gates, domains) are in domain/controls.py. Above 400 lines because
the policy schema, its loader with line numbers, and the evaluation that reads it are one contract.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from coordinator.domain.controls import Blackout, DomainKind, Gate, GateResult, VmFacts, Window, claim_key, limit_for
from coordinator.domain.model import EventRecord, Verdict
from coordinator.domain.sightings import pending_delete

Action = Literal["approve-now", "approve-after-hooks", "approve-within-budget", "wait-for-person", "never-approve"]
# How a rule's approvals reach the platform: through the VM's listener (Azure Relay; the VM verifies the facts), or
# through the Maintenance RP's acknowledge (preview; no VM verifies anything: docs/security.md).
Callback = Literal["relay", "remote-acknowledge"]
Weekday = Literal["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]
WEEKDAYS: tuple[Weekday, ...] = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
NO_RULE = "(no rule matched)"
# What held a decision back (Decision.holdKind); "" when nothing did.
HoldKind = Literal["", "blackout", "window", "gate", "budget", "hooks", "delete"]
# How far each action goes towards approving: a rule chosen because of a VM's tags may not go further than the rule
# the same event would get without tags (unless it says trustTags), since tags come from the VM.
_REACH: dict[str, int] = {
    "never-approve": 0,
    "wait-for-person": 1,
    "approve-after-hooks": 2,
    "approve-within-budget": 2,
    "approve-now": 3,
}
MAX_TAG_PATTERNS = 16
_HOURS = re.compile(r"^([01]\d|2[0-3]):([0-5]\d)-([01]\d|2[0-4]):([0-5]\d)$")


class PolicyError(ValueError):
    """The policy file is not valid; the message names the file, line and field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DurationRange(_Strict):
    min: int | None = Field(default=None, ge=-1)
    max: int | None = Field(default=None, ge=-1)

    @model_validator(mode="after")
    def _ordered(self) -> DurationRange:
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min {self.min} is greater than max {self.max}")
        return self

    def contains(self, value: int) -> bool:
        return (self.min is None or value >= self.min) and (self.max is None or value <= self.max)


class TimeWindow(_Strict):
    """Days and hours in UTC; hours 'HH:MM-HH:MM', end exclusive; an end before the start wraps past midnight."""

    days: list[Weekday] = Field(default_factory=lambda: list(WEEKDAYS), min_length=1)
    hours: str = "00:00-24:00"

    @field_validator("hours")
    @classmethod
    def _hours(cls, value: str) -> str:
        if not _HOURS.match(value):
            raise ValueError(f"hours {value!r} must look like '08:00-18:00' (UTC)")
        return value

    def contains(self, now: datetime) -> bool:
        match = _HOURS.match(self.hours)
        assert match is not None  # validated above
        start = int(match.group(1)) * 60 + int(match.group(2))
        end = int(match.group(3)) * 60 + int(match.group(4))
        minute = now.hour * 60 + now.minute
        day = WEEKDAYS[now.weekday()]
        if start <= end:
            return day in self.days and start <= minute < end
        if minute >= start:
            return day in self.days
        # After midnight in a window that started the day before: the window belongs to the previous day.
        return WEEKDAYS[(now.weekday() - 1) % 7] in self.days and minute < end


class Match(_Strict):
    eventType: list[str] | None = None
    eventSource: list[str] | None = None
    durationSeconds: DurationRange | None = None
    scaleSet: list[str] | None = Field(default=None, description="glob patterns; every affected scale set must match")
    vmName: list[str] | None = Field(default=None, description="glob patterns; every affected VM must match")
    window: TimeWindow | None = None
    tags: dict[str, str] | None = Field(
        default=None,
        max_length=MAX_TAG_PATTERNS,
        description="tag name -> glob of its value ('*': any value); matches when ANY affected VM carries one",
    )

    def matches(self, record: EventRecord, now: datetime, fleet: FleetView | None = None) -> bool:  # noqa: PLR0911
        if self.eventType is not None and record.eventType not in self.eventType:
            return False
        if self.eventSource is not None and record.eventSource not in self.eventSource:
            return False
        if self.durationSeconds is not None and not self.durationSeconds.contains(record.durationInSeconds):
            return False
        if self.vmName is not None and not _all_match(record.resources, self.vmName):
            return False
        if self.scaleSet is not None:
            scale_sets = {scale_set_of(record, name) for name in record.resources} - {""}
            if not scale_sets or not _all_match(sorted(scale_sets), self.scaleSet):
                return False
        if self.tags is not None and not _tags_match(record, fleet or FleetView(), self.tags):
            return False
        return self.window is None or self.window.contains(now)


def _tags_match(record: EventRecord, fleet: FleetView, wanted: dict[str, str]) -> bool:
    """Whether any affected VM carries one of the wanted tags (names compare case-insensitively, as Azure's do).
    Any, not all: one VM asking for a person or opting out holds the whole event it shares."""
    for name in record.resources or sorted(record.vms):
        tags = {k.lower(): v for k, v in fleet.facts(record, name).tags.items()}
        for tag, pattern in wanted.items():
            value = tags.get(tag.lower())
            if value is not None and fnmatch.fnmatchcase(value, pattern):
                return True
    return False


def _all_match(values: list[str], patterns: list[str]) -> bool:
    return bool(values) and all(any(fnmatch.fnmatchcase(v, p) for p in patterns) for v in values)


class HooksOption(_Strict):
    deadlineSeconds: int = Field(default=600, gt=0)
    onDeadline: Literal["approve", "wait"] = "wait"
    # A VM whose forwarder reports the phase with no hooks at all (outcome not-run): "wait" treats it like a hook
    # not yet succeeded (until the deadline), "ready" like success. Default "wait": a VM without hooks cannot be
    # told from an install that forgot them, and the deadline bounds what waiting costs.
    noHooks: Literal["wait", "ready"] = "wait"


class BudgetOption(_Strict):
    """At most ``maxImpacted`` VMs, or ``maxPercent`` of a domain's VMs (rounded up), or the smaller of both,
    impacted at once in each domain of each kind in ``per``."""

    maxImpacted: int | None = Field(default=None, ge=1)
    maxPercent: float | None = Field(default=None, gt=0, le=100)
    per: list[DomainKind] = Field(default_factory=lambda: list[DomainKind](["scaleSet"]), min_length=1)

    @model_validator(mode="after")
    def _some_limit(self) -> BudgetOption:
        if self.maxImpacted is None and self.maxPercent is None:
            raise ValueError("a budget needs maxImpacted, maxPercent or both")
        if len(set(self.per)) != len(self.per):
            raise ValueError(f"per {self.per} names a domain kind twice")
        return self


class Rule(_Strict):
    name: str = Field(min_length=1, max_length=128)
    description: str = ""
    match: Match = Field(default_factory=Match)
    action: Action
    hooks: HooksOption | None = None
    budget: BudgetOption | None = None
    callback: Callback = "relay"
    window: Window | None = Field(default=None, description="when this rule may approve (cron + duration + zone)")
    gates: list[str] = Field(default_factory=list, max_length=8, description="named gates that must pass")
    # When NotBefore comes while a window or gate holds the event: "expire" (default) lets the platform start it at
    # NotBefore without the coordinator's approval, recorded as expired with the hold that kept it; "approve"
    # approves it approveBeforeSeconds before NotBefore (it starts then anyway; the approval is recorded, counted
    # in budgets and checked by the VM). Default expire: a window or an unhealthy gate says "not now", and an
    # approval would put the coordinator's name on an impact the operator said they did not want.
    onNotBefore: Literal["expire", "approve"] = "expire"
    # Two timer ticks (60 s each) before NotBefore, so the approval is sent before the platform moves on its own.
    approveBeforeSeconds: int = Field(default=120, ge=60, le=900)
    # A rule matched through a VM's tags may approve no more than the rule the event gets without tags, unless this
    # is true (tags come from the VM, which may lie: see docs/coordinator.md, "Tags").
    trustTags: bool = False

    @model_validator(mode="after")
    def _options_fit_action(self) -> Rule:
        if self.callback != "relay" and self.action == "never-approve":
            raise ValueError("'callback' says how approvals are sent; a 'never-approve' rule sends none")
        if self.action == "approve-within-budget" and self.budget is None:
            raise ValueError("action 'approve-within-budget' needs 'budget: {maxImpacted: N}'")
        if self.budget is not None and self.action != "approve-within-budget":
            raise ValueError(f"'budget' applies only to 'approve-within-budget', not {self.action!r}")
        if self.hooks is not None and self.action != "approve-after-hooks":
            raise ValueError(f"'hooks' applies only to 'approve-after-hooks', not {self.action!r}")
        if self.action == "approve-within-budget" and (
            self.match.eventType is None or "Terminate" in self.match.eventType
        ):
            raise ValueError(
                "'approve-within-budget' cannot decide Terminate events: the platform holds an approved delete while "
                "any other delete of its scale set is pending, so approving deletes N at a time does not pace them "
                "(they all go once every one is approved or timed out). Give this rule 'match: {eventType: [...]}' "
                "without Terminate, and decide deletes with another rule (e.g. approve-after-hooks)"
            )
        return self


class Policy(_Strict):
    version: Literal[1] = 1
    dryRun: bool = False
    blackouts: list[Blackout] = Field(default_factory=list, max_length=32)
    gates: dict[str, Gate] = Field(default_factory=dict, max_length=16)
    rules: list[Rule] = Field(min_length=1)

    @model_validator(mode="after")
    def _gates_defined(self) -> Policy:
        for rule in self.rules:
            unknown = [name for name in rule.gates if name not in self.gates]
            if unknown:
                raise ValueError(f"rule {rule.name!r} names gates {unknown} that 'gates:' does not define")
        return self

    def gates_of(self, rule_name: str) -> list[str]:
        rule = next((r for r in self.rules if r.name == rule_name), None)
        return list(rule.gates) if rule is not None else []

    @property
    def needs_census(self) -> bool:
        """Whether deciding reads the VMs' facts (the VM groups, once per batch/tick): a rule matches tags, or sets
        a budget by percent or by a domain other than the scale set (a count per scale set needs only the events)."""
        return any(
            rule.match.tags is not None
            or (rule.budget is not None and (rule.budget.maxPercent is not None or rule.budget.per != ["scaleSet"]))
            for rule in self.rules
        )

    @field_validator("rules")
    @classmethod
    def _unique_names(cls, rules: list[Rule]) -> list[Rule]:
        seen: set[str] = set()
        for rule in rules:
            if rule.name in seen:
                raise ValueError(f"rule name {rule.name!r} is used twice; names identify decisions")
            seen.add(rule.name)
        return rules


@dataclass(frozen=True)
class FleetView:
    """What other events do to the fleet right now: per scale set, the VM names impacted by an Approved or
    Started event (the budget rule counts these); every impacted VM (``impactedVms``, for the other domain kinds);
    and the census, the facts of every VM the coordinator knows that is not retired (``vms``: domain sizes for
    percent budgets, tags and domains for rules)."""

    impacted: dict[str, frozenset[str]] = field(default_factory=dict)
    vms: Mapping[str, VmFacts] = field(default_factory=dict)
    impactedVms: frozenset[str] = frozenset()
    # Events waiting for budget (their last decision was held by one), as (NotBefore, EventId, VMs): an event
    # later in that order counts their VMs as taken, so a freed slot goes to the event closest to its NotBefore
    # even when a later one is decided first (a new event's batch before the timer's tick).
    queued: tuple[tuple[datetime, str, frozenset[str]], ...] = ()

    def with_event(self, record: EventRecord) -> FleetView:
        impacted = {k: set(v) for k, v in self.impacted.items()}
        for name in record.resources:
            impacted.setdefault(scale_set_of(record, name), set()).add(name)
        return FleetView(
            {k: frozenset(v) for k, v in impacted.items() if k},
            self.vms,
            self.impactedVms | frozenset(record.resources),
            tuple(q for q in self.queued if q[1] != record.eventId),
        )

    def ahead_of(self, record: EventRecord) -> set[str]:
        """The VMs of the events queued for budget ahead of this one (closer to their NotBefore)."""
        mine = (record.notBefore or datetime.max.replace(tzinfo=UTC), record.eventId)
        return {vm for not_before, event_id, vms in self.queued if (not_before, event_id) < mine for vm in vms}

    def facts(self, record: EventRecord, name: str) -> VmFacts:
        """A VM's facts: from the census, else what the event's own sighting (or the VM's name) says."""
        known = self.vms.get(name)
        if known is not None:
            return known
        sighting = record.vms.get(name)
        return VmFacts(scaleSet=scale_set_of(record, name), placementGroup=sighting.placementGroup if sighting else "")

    def untagged(self) -> FleetView:
        return FleetView(
            self.impacted,
            {name: dataclasses.replace(facts, tags={}) for name, facts in self.vms.items()},
            self.impactedVms,
            self.queued,
        )


@dataclass(frozen=True)
class Decision:
    rule: str
    action: Action
    verdict: Verdict
    reason: str
    # Set when the rule approves a Terminate but another pending delete of its scale set is not ready (couple()).
    heldBy: str = ""
    heldByVm: str = ""
    heldUntil: datetime | None = None
    # What held the event back ("" when nothing did), its name (the blackout, gate, budget domain, holding delete)
    # and since when it holds (set by pipeline/decide.py from the previous decision: the rules are stateless).
    holdKind: HoldKind = ""
    holdName: str = ""
    holdSince: datetime | None = None


def scale_set_of(record: EventRecord, vm_name: str) -> str:
    sighting = record.vms.get(vm_name)
    if sighting is not None:
        return sighting.scaleSet
    # Scale-set instance names are '{scale-set-name}_{instance-id}' (documented): a fallback for silent VMs.
    head, sep, tail = vm_name.rpartition("_")
    return head if sep and tail.isdigit() else ""


def impacted_by(record: EventRecord) -> dict[str, set[str]]:
    """The VMs this event impacts, per scale set."""
    mine: dict[str, set[str]] = {}
    for name in record.resources:
        mine.setdefault(scale_set_of(record, name), set()).add(name)
    return mine


def budget_limit(policy: Policy, rule_name: str) -> int | None:
    """maxImpacted of the named approve-within-budget rule; None for any other rule (or one no longer there, or a
    percent-only budget: its limit depends on the domain, see ``budget_domains``)."""
    rule = next((r for r in policy.rules if r.name == rule_name), None)
    return rule.budget.maxImpacted if rule is not None and rule.budget is not None else None


@dataclass(frozen=True)
class BudgetDomain:
    """One domain an event's budget rule counts in: its kind and key, the event's VMs in it, the VMs other events
    impact there, its size (known VMs not retired) and the limit that sets."""

    kind: DomainKind
    key: str
    mine: frozenset[str]
    others: frozenset[str]
    size: int
    limit: int

    @property
    def claim_key(self) -> str:
        return claim_key(self.kind, self.key)

    def describe(self, count: int) -> str:
        return f"{self.kind} {self.key or '(none)'!r} would have {count} impacted instances (limit {self.limit})"


def budget_domains(policy: Policy, rule_name: str, record: EventRecord, fleet: FleetView) -> list[BudgetDomain]:
    """The domains the named budget rule counts this event in (empty for any other rule). A scale set's budget
    counts a VM without a scale set under '' as before; the other kinds skip VMs without that domain (a regional
    VM has no zone) rather than lump them together."""
    rule = next((r for r in policy.rules if r.name == rule_name), None)
    if rule is None or rule.budget is None:
        return []
    budget = rule.budget
    affected = record.resources or sorted(record.vms)
    ahead = fleet.ahead_of(record)
    out: list[BudgetDomain] = []
    for kind in budget.per:
        keyed: dict[str, set[str]] = {}
        for name in affected:
            key = fleet.facts(record, name).domain(kind)
            if key or kind == "scaleSet":
                keyed.setdefault(key, set()).add(name)
        for key, mine in sorted(keyed.items()):
            if kind == "scaleSet":
                others = set(fleet.impacted.get(key, frozenset()))
            else:
                others = {n for n in fleet.impactedVms if n in fleet.vms and fleet.vms[n].domain(kind) == key}
            others |= {n for n in ahead if fleet.facts(record, n).domain(kind) == key}
            members = {n for n, facts in fleet.vms.items() if facts.domain(kind) == key} | mine
            limit = limit_for(max_impacted=budget.maxImpacted, max_percent=budget.maxPercent, size=len(members))
            out.append(BudgetDomain(kind, key, frozenset(mine), frozenset(others - mine), len(members), limit))
    return out


def hooks_required(policy: Policy, rule_name: str, record: EventRecord) -> list[str]:
    """The VMs whose prepare hooks an approval by the named rule rested on: for an ``approve-after-hooks`` rule,
    the affected VMs that reported the prepare phase succeeded (each one's listener checks its own ledger);
    empty for any other rule. A VM approved past the hook deadline without success is not listed: the decision
    did not rest on it."""
    rule = next((r for r in policy.rules if r.name == rule_name), None)
    if rule is None or rule.action != "approve-after-hooks":
        return []
    affected = record.resources or sorted(record.vms)
    return [n for n in affected if n in record.vms and record.vms[n].hooks.get("prepare") == "succeeded"]


def callback_of(policy: Policy, rule_name: str) -> Callback:
    """The callback the named rule asks for; "relay" for a person's approval or a rule no longer there."""
    rule = next((r for r in policy.rules if r.name == rule_name), None)
    return rule.callback if rule is not None else "relay"


def needs_fleet(policy: Policy, record: EventRecord, now: datetime) -> bool:
    if policy.needs_census:
        return True
    rule = first_match(policy, record, now)
    return rule is not None and rule.action == "approve-within-budget"


def first_match(policy: Policy, record: EventRecord, now: datetime, fleet: FleetView | None = None) -> Rule | None:
    return next((rule for rule in policy.rules if rule.match.matches(record, now, fleet)), None)


def evaluate(  # noqa: PLR0911 -- one return per action, each explained
    policy: Policy,
    record: EventRecord,
    fleet: FleetView,
    now: datetime,
    *,
    gates: Mapping[str, GateResult] | None = None,
) -> Decision:
    """The policy's decision. ``gates``: each named gate's result for this batch/tick (a gate a rule names but
    missing here counts as an error: not known to pass)."""
    rule = first_match(policy, record, now, fleet)
    if rule is None:
        return Decision(NO_RULE, "wait-for-person", "wait", "no rule matched; a person decides")
    note = ""
    if rule.match.tags is not None and not rule.trustTags:
        plain = first_match(policy, record, now, fleet.untagged())
        if plain is None or _REACH[plain.action] < _REACH[rule.action]:
            why = f"rule {plain.name!r}" if plain is not None else "no rule"
            note = (
                f"rule {rule.name!r} matched by a VM's tags would approve more than {why} does without tags; tags "
                "may only restrict (trustTags: false): "
            )
            if plain is None:
                return Decision(NO_RULE, "wait-for-person", "wait", note + "a person decides")
            rule = plain
    if rule.action == "approve-now":
        return _hold(policy, rule, record, now, gates or {}) or Decision(
            rule.name, rule.action, "approve", f"{note}rule {rule.name!r} approves at once"
        )
    if rule.action == "never-approve":
        return Decision(rule.name, rule.action, "never", f"{note}rule {rule.name!r} lets NotBefore run out")
    if rule.action == "wait-for-person":
        return Decision(rule.name, rule.action, "wait", f"{note}rule {rule.name!r} waits for a person")
    held = _hold(policy, rule, record, now, gates or {})
    if held is not None and held.verdict == "wait":
        return held
    decision = (
        _after_hooks(rule, record, now)
        if rule.action == "approve-after-hooks"
        else _within_budget(policy, rule, record, fleet)
    )
    prefix = note + (f"{held.reason}; " if held is not None else "")
    return dataclasses.replace(decision, reason=prefix + decision.reason) if prefix else decision


def _hold(
    policy: Policy, rule: Rule, record: EventRecord, now: datetime, gates: Mapping[str, GateResult]
) -> Decision | None:
    """What keeps this rule from approving now: a blackout (always), the rule's window or a gate (until NotBefore
    is near, when ``onNotBefore: approve`` lets it go: an approve Decision whose reason says so). None: nothing."""
    for blackout in policy.blackouts:
        until = blackout.open_until(now)
        if until is not None:
            return Decision(
                rule.name,
                rule.action,
                "wait",
                f"blackout {blackout.name!r} approves nothing until {until.isoformat()}"
                + _expiry(record, until, "blackout"),
                heldUntil=until,
                holdKind="blackout",
                holdName=blackout.name,
            )
    held: Decision | None = None
    if rule.window is not None and rule.window.open_until(now) is None:
        opens = rule.window.next_open(now)
        held = Decision(
            rule.name,
            rule.action,
            "wait",
            f"rule {rule.name!r} approves only in its window ({rule.window.schedule!r} for {rule.window.duration}, "
            f"{rule.window.timeZone}); next opens {opens.isoformat()}",
            heldUntil=opens,
            holdKind="window",
            holdName=rule.name,
        )
    for name in [] if held is not None else rule.gates:
        result = gates.get(name, GateResult("error", "not read this batch/tick"))
        if result.state != "passing":
            held = Decision(
                rule.name,
                rule.action,
                "wait",
                f"gate {name!r} is {result.state}" + (f" ({result.detail[:300]})" if result.detail else ""),
                holdKind="gate",
                holdName=name,
            )
            break
    if held is None:
        return None
    deadline = record.notBefore - timedelta(seconds=rule.approveBeforeSeconds) if record.notBefore else None
    if rule.onNotBefore == "approve" and deadline is not None and now >= deadline:
        return dataclasses.replace(
            held,
            verdict="approve",
            reason=f"{held.reason}; NotBefore {record.notBefore.isoformat() if record.notBefore else ''} is near: "
            "approved at the deadline (onNotBefore: approve)",
        )
    return dataclasses.replace(held, reason=held.reason + _expiry(record, held.heldUntil, "onNotBefore: expire"))


def _expiry(record: EventRecord, until: datetime | None, why: str) -> str:
    """The note that NotBefore comes before the hold ends, so the event will start unapproved."""
    if record.notBefore is None or (until is not None and record.notBefore >= until):
        return ""
    return f"; NotBefore {record.notBefore.isoformat()} comes first: left to expire ({why})"


def _after_hooks(rule: Rule, record: EventRecord, now: datetime) -> Decision:
    options = rule.hooks or HooksOption()
    affected = record.resources or sorted(record.vms)
    outcomes = {name: (record.vms[name].hooks.get("prepare", "") if name in record.vms else "") for name in affected}
    ready = {"succeeded", "not-run"} if options.noHooks == "ready" else {"succeeded"}
    missing = sorted(name for name, outcome in outcomes.items() if outcome not in ready)
    if not missing:
        return Decision(rule.name, rule.action, "approve", f"prepare hooks succeeded on all {len(affected)} VMs")
    deadline = record.createdAt + timedelta(seconds=options.deadlineSeconds)
    detail = ", ".join(_hook_state(record, name, outcomes[name]) for name in missing[:10])
    if now >= deadline:
        verdict: Verdict = "approve" if options.onDeadline == "approve" else "wait"
        return Decision(
            rule.name,
            rule.action,
            verdict,
            f"hook deadline {options.deadlineSeconds} s passed without success on {detail}; onDeadline="
            f"{options.onDeadline}",
        )
    return Decision(
        rule.name,
        rule.action,
        "wait",
        f"waiting for prepare hooks until {deadline.isoformat()}: {detail}",
        heldUntil=deadline,
        holdKind="hooks",
        holdName=", ".join(missing[:10]),
    )


def _hook_state(record: EventRecord, name: str, outcome: str) -> str:
    """'web_2=failed (10-check)': the VM, its prepare phase's outcome and the hook that failed it."""
    if outcome == "not-run":
        return f"{name}=not-run (no hooks installed; noHooks=wait)"
    failed = record.vms[name].failedHooks.get("prepare", "") if name in record.vms else ""
    return f"{name}={outcome or 'none'}" + (f" ({failed})" if failed else "")


def ready_to_go(record: EventRecord) -> bool:
    """Whether a pending delete's own rule approves it (its stored decision says approve, or held only by
    another delete)."""
    decision = record.decision
    return decision is not None and (decision.verdict == "approve" or bool(decision.heldBy))


def couple(decision: Decision, record: EventRecord, deletes: Iterable[EventRecord], now: datetime) -> Decision:
    """The pending deletes of a scale set are decided as one unit: the platform holds an approved delete while
    another delete of its scale set is pending ("Approve all pending deletes"), and simultaneous deletes go
    only when all are approved. So a Terminate that its own rule approves waits while another pending Terminate
    of the same scale set is not ready, naming the one that holds it (the latest NotBefore among them: the
    longest the hold can last); once every one is ready they are approved together."""
    if record.eventType != "Terminate" or decision.verdict != "approve":
        return decision
    mine = set(record.scaleSets)
    blockers = [
        other
        for other in deletes
        if other.eventId != record.eventId
        and mine & set(other.scaleSets)
        and pending_delete(other, now)
        and not ready_to_go(other)
    ]
    if not blockers:
        return decision
    far = datetime.max.replace(tzinfo=UTC)
    holder = max(blockers, key=lambda other: (other.notBefore or far, other.eventId))
    vm = ", ".join(holder.resources[:3]) or holder.eventId
    until = holder.notBefore.isoformat() if holder.notBefore else "its NotBefore"
    why = holder.decision.reason if holder.decision is not None else "not decided yet"
    scale_set = ", ".join(sorted(mine & set(holder.scaleSets)))
    more = f" (and {len(blockers) - 1} more)" if len(blockers) > 1 else ""
    return Decision(
        decision.rule,
        decision.action,
        "wait",
        f"ready ({decision.reason}), held with the pending deletes of scale set {scale_set}: delete of {vm} "
        f"({holder.eventId}){more} is not ready ({why[:300]}), pending until {until}; deletes of a scale set are "
        "approved together once each is ready",
        heldBy=holder.eventId,
        heldByVm=vm,
        heldUntil=holder.notBefore,
        holdKind="delete",
        holdName=holder.eventId,
    )


def _within_budget(policy: Policy, rule: Rule, record: EventRecord, fleet: FleetView) -> Decision:
    domains = budget_domains(policy, rule.name, record, fleet)
    for domain in domains:
        count = len(domain.mine | domain.others)
        if count > domain.limit:
            return Decision(
                rule.name,
                rule.action,
                "wait",
                domain.describe(count),
                holdKind="budget",
                holdName=domain.claim_key,
            )
    kinds = ", ".join(sorted({d.kind for d in domains})) or "scaleSet"
    return Decision(rule.name, rule.action, "approve", f"within budget per {kinds} ({_limits(rule)})")


def _limits(rule: Rule) -> str:
    assert rule.budget is not None  # only budget rules get here
    parts = [f"{rule.budget.maxImpacted} impacted instances"] if rule.budget.maxImpacted is not None else []
    if rule.budget.maxPercent is not None:
        parts.append(f"{rule.budget.maxPercent:g}% of the domain")
    return " and ".join(parts)


def _line_index(node: yaml.Node, path: tuple[Any, ...], out: dict[tuple[Any, ...], int]) -> None:
    out.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            key_path = (*path, key.value)
            out[key_path] = key.start_mark.line + 1
            _line_index(value, key_path, out)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _line_index(item, (*path, index), out)


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, line: int, first_line: int) -> None:
        super().__init__(f"{line}: duplicate key {key!r} (first on line {first_line})")
        self.line = line


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping: plain YAML keeps the last one silently, so a
    policy could mean something else than what its reader sees first."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise _DuplicateKey(key, line, seen[key])
            except TypeError:  # an unhashable key: the base class reports it
                break
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def parse_policy(text: str, *, source: str = "<policy>") -> Policy:
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 -- a SafeLoader subclass
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except _DuplicateKey as error:
        raise PolicyError(f"{source}:{error}") from error
    except yaml.YAMLError as error:
        raise PolicyError(f"{source}: not valid YAML: {error}") from error
    if not isinstance(data, dict):
        raise PolicyError(f"{source}: a policy is a mapping with 'rules:'; got {type(data).__name__}")
    lines: dict[tuple[Any, ...], int] = {}
    if root is not None:
        _line_index(root, (), lines)
    try:
        return Policy.model_validate(data)
    except ValidationError as error:
        problems = []
        for item in error.errors():
            loc = tuple(item["loc"])
            prefix = next((loc[:n] for n in range(len(loc), -1, -1) if loc[:n] in lines), ())
            where = ".".join(str(part) for part in loc) or "(top)"
            problems.append(f"{source}:{lines.get(prefix, 1)}: {where}: {item['msg']}")
        raise PolicyError("invalid policy:\n  " + "\n  ".join(problems)) from error


def load_policy(path: str | Path) -> Policy:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise PolicyError(f"cannot read policy file {path}: {error.strerror}") from error
    return parse_policy(text, source=str(path))


DEFAULT_POLICY_PATH = Path(__file__).parent.parent / "policies" / "default.yaml"
