"""The approval policy's schema: rules (ordered, first match wins), what each matches and does, and the fleet
controls they name, as pydantic models that refuse what they do not know.

Pure data and validation: the YAML file is read in coordinator/domain/policy_file.py, a rule is matched in
coordinator/domain/matching.py and decided in coordinator/domain/evaluation.py. The controls' own models
(schedules, gates, domains) are in coordinator/domain/controls.py.
"""

from __future__ import annotations

import functools
import hashlib
import re
from datetime import datetime
from decimal import Decimal
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from contracts.wire_rules import HOOK_NAME
from coordinator.domain.controls import Blackout, DomainKind, Gate, Window

__all__ = [
    "Action",
    "BudgetOption",
    "Callback",
    "DurationRange",
    "EscalationStep",
    "HooksOption",
    "Match",
    "Policy",
    "RateOption",
    "ReturnToService",
    "Rule",
    "SequenceOption",
    "TimeWindow",
]

Action = Literal["approve-now", "approve-after-hooks", "approve-within-budget", "wait-for-person", "never-approve"]
# How a rule's approvals reach the platform: through the VM's listener (Azure Relay; the VM verifies the facts), or
# through the Maintenance RP's acknowledge (preview; no VM verifies anything: docs/security.md).
Callback = Literal["relay", "remote-acknowledge"]
Weekday = Literal["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]
WEEKDAYS: tuple[Weekday, ...] = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
MAX_TAG_PATTERNS = 16
_HOURS = re.compile(r"^([01]\d|2[0-3]):([0-5]\d)-([01]\d|2[0-4]):([0-5]\d)$")


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
    # A Decimal, not a float: the limit is P% of the domain rounded up, and a float's P is not the P written
    # (64.4 is 64.400000000000006, so 64.4% of 250 came to 162 where the rule says 161). pydantic reads the number
    # YAML gives as the shortest decimal that names it: what the operator wrote.
    maxPercent: Decimal | None = Field(default=None, gt=0, le=100, allow_inf_nan=False)
    per: list[DomainKind] = Field(default_factory=lambda: list[DomainKind](["scaleSet"]), min_length=1)

    @model_validator(mode="after")
    def _some_limit(self) -> BudgetOption:
        if self.maxImpacted is None and self.maxPercent is None:
            raise ValueError("a budget needs maxImpacted, maxPercent or both")
        if len(set(self.per)) != len(self.per):
            raise ValueError(f"per {self.per} names a domain kind twice")
        return self


# Where a rate budget counts: one count for the whole fleet, or one per domain of a kind (domain/controls.py).
RateScope = Literal["fleet", "scaleSet", "zone", "faultDomain", "updateDomain", "placementGroup"]
# The domains a sequence walks one at a time: those the platform itself walks (zones, fault and update domains).
SequenceKind = Literal["zone", "faultDomain", "updateDomain"]
# A sequence's gap, and a rate's period, are bounded: longer is a schedule (a window), not pacing; housekeeping keeps a
# sequence's state this long after its last event concluded (coordinator/pipeline/timer.py).
MAX_PACING_SECONDS = 86400


class RateOption(_Strict):
    """At most ``maxApprovals`` approvals by this rule in any ``periodSeconds`` (a sliding window: an approval
    counts from when it was decided until ``periodSeconds`` later, whatever became of its event), per ``per``."""

    maxApprovals: int = Field(ge=1)
    periodSeconds: int = Field(ge=1, le=MAX_PACING_SECONDS)
    per: RateScope = "fleet"


class SequenceOption(_Strict):
    """One domain of kind ``per`` at a time: an event touching a domain other than those this rule's approved
    events are in waits until every one of them has concluded, and then ``gapSeconds`` more."""

    per: SequenceKind
    gapSeconds: int = Field(default=0, ge=0, le=MAX_PACING_SECONDS)


# A ladder step is taken by the first run at or after its time (a tick each minute), and an approval it makes must
# still reach the VM before NotBefore (domain/expiry.py SEND_MARGIN): a step closer to NotBefore than this could not.
MIN_STEP_SECONDS, MAX_STEP_SECONDS, MAX_STEPS = 60, 7 * 86400, 8
# A force step's approval stays valid while its hook runs, up to NotBefore; a VM's listener refuses any approval valid
# further ahead than 15 minutes (forwarder/approval_rules.py, ``Freshness.max_validity``).
MAX_FORCE_SECONDS = 900


class EscalationStep(_Strict):
    """One step of a rule's escalation ladder (coordinator/domain/escalation.py), taken once, by the first run at or
    after ``beforeNotBeforeSeconds`` before the event's NotBefore while the rule has not approved it: ``notify`` the
    owner (``ownerTag``: the value of that ARM tag on the affected VMs, read from the census; else ``owner``),
    ``approve`` anyway, ``force`` (approve once the VM's own force hook ``hook`` succeeded: its listener runs
    ``force.d/<hook>`` first), or ``hold`` (no approval from the coordinator: the platform starts it at NotBefore)."""

    beforeNotBeforeSeconds: int = Field(ge=MIN_STEP_SECONDS, le=MAX_STEP_SECONDS)
    do: Literal["notify", "approve", "force", "hold"]
    hook: str = Field(default="", pattern=f"^({HOOK_NAME})?$", description="the VM's force.d hook to run")
    owner: str = Field(default="", max_length=256, description="who is told (a name, an address, a channel)")
    ownerTag: str = Field(default="", max_length=128, description="the ARM tag naming the owner on each VM")

    @model_validator(mode="after")
    def _owner_named(self) -> EscalationStep:
        if self.do == "notify" and not (self.owner or self.ownerTag):
            raise ValueError("a 'notify' step needs 'owner' or 'ownerTag' (the ARM tag that names each VM's owner)")
        if self.do != "notify" and (self.owner or self.ownerTag):
            raise ValueError(f"'owner' and 'ownerTag' name whom a 'notify' step tells; a {self.do!r} step tells no one")
        if (self.do == "force") != bool(self.hook):
            raise ValueError("a 'force' step names its 'hook' (a file of force.d on the VM); no other step has one")
        if self.do == "force" and self.beforeNotBeforeSeconds > MAX_FORCE_SECONDS:
            raise ValueError(
                f"a 'force' step comes at most {MAX_FORCE_SECONDS} s before NotBefore: its approval stays valid until "
                "then, and a VM refuses an approval valid further ahead"
            )
        return self


MIN_RETURN_SECONDS, MAX_RETURN_SECONDS = 60, 86400


class ReturnToService(_Strict):
    """What "back in service" means after a Freeze, Reboot or Redeploy this rule decided completes (domain/returns.py):
    each affected VM's recover hooks done (succeeded, or none installed) and every gate of ``gates`` passing for it
    (an HTTP gate's URL or a query may name the VM as ``{vm}``), within ``withinSeconds`` of the completion. Until
    then the VM counts as impacted in every budget; one not back in time raises a card and a row."""

    withinSeconds: int = Field(ge=MIN_RETURN_SECONDS, le=MAX_RETURN_SECONDS)
    gates: list[str] = Field(default_factory=list, max_length=8, description="named gates a returned VM must pass")


class Rule(_Strict):
    name: str = Field(min_length=1, max_length=128)
    description: str = ""
    match: Match = Field(default_factory=Match)
    action: Action
    hooks: HooksOption | None = None
    budget: BudgetOption | None = None
    # Pacing, on any rule that approves (coordinator/domain/pacing.py): at most N approvals per period, and one
    # domain at a time. Both hold fleet-wide (claimed with ETags) and count this rule's approvals only.
    rate: RateOption | None = None
    sequence: SequenceOption | None = None
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
    # Steps by time left to NotBefore while this rule has not approved (coordinator/domain/escalation.py).
    escalate: list[EscalationStep] = Field(default_factory=list, max_length=MAX_STEPS)
    # After the event completes: when its VMs count as back in service (coordinator/domain/returns.py).
    returnToService: ReturnToService | None = None

    @model_validator(mode="after")
    def _ladder(self) -> Rule:
        steps = [s.beforeNotBeforeSeconds for s in self.escalate]
        if steps != sorted(steps, reverse=True) or len(set(steps)) != len(steps):
            raise ValueError(f"escalate: steps must come in order of time left to NotBefore, each its own ({steps})")
        final = [i for i, s in enumerate(self.escalate) if s.do != "notify"]
        if final and final != [len(steps) - 1]:
            raise ValueError("escalate: 'approve', 'force' or 'hold' ends the ladder: only its last step may be one")
        if self.escalate and self.action == "never-approve":
            raise ValueError("'never-approve' lets NotBefore run out; it has no ladder to climb")
        approves = any(s.do in ("approve", "force") for s in self.escalate)
        if approves and (self.budget is not None or self.rate is not None or self.sequence is not None):
            raise ValueError(
                "an 'approve' or 'force' step would approve past the rule's budget, rate or sequence, which bound what "
                "is impacted at once; end its ladder with 'hold' (or 'notify')"
            )
        return self

    @model_validator(mode="after")
    def _options_fit_action(self) -> Rule:
        if self.callback != "relay" and self.action == "never-approve":
            raise ValueError("'callback' says how approvals are sent; a 'never-approve' rule sends none")
        if self.action == "approve-within-budget" and self.budget is None:
            raise ValueError("action 'approve-within-budget' needs 'budget: {maxImpacted: N}'")
        if self.budget is not None and self.action != "approve-within-budget":
            raise ValueError(f"'budget' applies only to 'approve-within-budget', not {self.action!r}")
        paced = [name for name, option in (("rate", self.rate), ("sequence", self.sequence)) if option is not None]
        if paced and self.action in ("wait-for-person", "never-approve"):
            raise ValueError(f"{' and '.join(paced)} pace a rule's approvals; a {self.action!r} rule makes none")
        if paced and (self.match.eventType is None or "Terminate" in self.match.eventType):
            raise ValueError(
                f"{' and '.join(paced)} cannot pace Terminate events: the platform holds an approved delete while any "
                "other delete of its scale set is pending, so approving deletes one at a time does not pace them. "
                "Give this rule 'match: {eventType: [...]}' without Terminate"
            )
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
            back = rule.returnToService
            unknown = [name for name in back.gates if name not in self.gates] if back is not None else []
            if unknown:
                raise ValueError(
                    f"rule {rule.name!r}: returnToService names gates {unknown} that 'gates:' does not define"
                )
            per_vm = [name for name in rule.gates if self.gates[name].per_vm]
            if per_vm:
                raise ValueError(
                    f"rule {rule.name!r} gates its approvals on {per_vm}, which name {{vm}}: a gate read for one VM "
                    "serves only 'returnToService'"
                )
        return self

    @functools.cached_property
    def fingerprint(self) -> str:
        """The policy's version as approvals carry it: a digest of everything it says, not of the file's text (a
        comment or a reformatted line leaves it alone; any rule, gate, blackout or option changed changes it)."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:16]

    def rule(self, name: str) -> Rule | None:
        """The rule of that name (names are unique), None when the policy has none: the one lookup every decision,
        budget, pacing and expiry step makes of the rule that decided."""
        return self._by_name.get(name)

    @functools.cached_property
    def _by_name(self) -> dict[str, Rule]:
        return {rule.name: rule for rule in self.rules}

    def gates_of(self, rule_name: str) -> list[str]:
        rule = self.rule(rule_name)
        return list(rule.gates) if rule is not None else []

    @functools.cached_property
    def matches_scale_set(self) -> bool:
        """Whether a rule matches by scale set (read from the fleet view: ARM's, with its census)."""
        return any(rule.match.scaleSet is not None for rule in self.rules)

    @property
    def needs_census(self) -> bool:
        """Whether deciding reads the VMs' facts (the VM groups, once per batch/tick): a rule matches tags, or sets
        a budget by percent or by a domain other than the scale set (a count per scale set needs only the events),
        or paces by zone, fault or update domain (a sequence always; a rate per such a domain), or names an owner
        by a tag in its escalation ladder."""
        return any(
            rule.match.tags is not None
            or any(step.ownerTag for step in rule.escalate)
            or (rule.budget is not None and (rule.budget.maxPercent is not None or rule.budget.per != ["scaleSet"]))
            or rule.sequence is not None
            or (rule.rate is not None and rule.rate.per not in ("fleet", "scaleSet"))
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
