"""Approval rules: a declarative YAML policy, validated with pydantic; ordered, first match wins.

Pure: ``evaluate(policy, record, fleet, now)`` -> Decision, with no I/O. Every decision names its rule and says why.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from coordinator.model import EventRecord, Verdict
from coordinator.sightings import pending_delete

Action = Literal["approve-now", "approve-after-hooks", "approve-within-budget", "wait-for-person", "never-approve"]
# How a rule's approvals reach the platform: through the VM's listener (Azure Relay; the VM verifies the facts), or
# through the Maintenance RP's acknowledge (preview; no VM verifies anything: docs/security.md).
Callback = Literal["relay", "remote-acknowledge"]
Weekday = Literal["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]
WEEKDAYS: tuple[Weekday, ...] = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
NO_RULE = "(no rule matched)"
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

    def matches(self, record: EventRecord, now: datetime) -> bool:
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
        return self.window is None or self.window.contains(now)


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
    maxImpacted: int = Field(ge=1)


class Rule(_Strict):
    name: str = Field(min_length=1, max_length=128)
    description: str = ""
    match: Match = Field(default_factory=Match)
    action: Action
    hooks: HooksOption | None = None
    budget: BudgetOption | None = None
    callback: Callback = "relay"

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
    rules: list[Rule] = Field(min_length=1)

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
    Started event (the budget rule counts these)."""

    impacted: dict[str, frozenset[str]] = field(default_factory=dict)

    def with_event(self, record: EventRecord) -> FleetView:
        impacted = {k: set(v) for k, v in self.impacted.items()}
        for name in record.resources:
            impacted.setdefault(scale_set_of(record, name), set()).add(name)
        return FleetView({k: frozenset(v) for k, v in impacted.items() if k})


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
    """maxImpacted of the named approve-within-budget rule; None for any other rule (or one no longer there)."""
    rule = next((r for r in policy.rules if r.name == rule_name), None)
    return rule.budget.maxImpacted if rule is not None and rule.budget is not None else None


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
    rule = first_match(policy, record, now)
    return rule is not None and rule.action == "approve-within-budget"


def first_match(policy: Policy, record: EventRecord, now: datetime) -> Rule | None:
    return next((rule for rule in policy.rules if rule.match.matches(record, now)), None)


def evaluate(policy: Policy, record: EventRecord, fleet: FleetView, now: datetime) -> Decision:
    rule = first_match(policy, record, now)
    if rule is None:
        return Decision(NO_RULE, "wait-for-person", "wait", "no rule matched; a person decides")
    if rule.action == "approve-now":
        return Decision(rule.name, rule.action, "approve", f"rule {rule.name!r} approves at once")
    if rule.action == "never-approve":
        return Decision(rule.name, rule.action, "never", f"rule {rule.name!r} lets NotBefore run out")
    if rule.action == "wait-for-person":
        return Decision(rule.name, rule.action, "wait", f"rule {rule.name!r} waits for a person")
    if rule.action == "approve-after-hooks":
        return _after_hooks(rule, record, now)
    return _within_budget(rule, record, fleet)


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
    return Decision(rule.name, rule.action, "wait", f"waiting for prepare hooks until {deadline.isoformat()}: {detail}")


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
    )


def _within_budget(rule: Rule, record: EventRecord, fleet: FleetView) -> Decision:
    assert rule.budget is not None  # enforced by Rule._options_fit_action
    limit = rule.budget.maxImpacted
    for scale_set, names in sorted(impacted_by(record).items()):
        together = set(fleet.impacted.get(scale_set, frozenset())) | names
        if len(together) > limit:
            return Decision(
                rule.name,
                rule.action,
                "wait",
                f"scale set {scale_set or '(none)'!r} would have {len(together)} impacted instances (limit {limit})",
            )
    return Decision(rule.name, rule.action, "approve", f"within budget of {limit} impacted instances per scale set")


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


DEFAULT_POLICY_PATH = Path(__file__).with_name("policies") / "default.yaml"
