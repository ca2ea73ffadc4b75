"""Evaluation: the policy's decision on one event, with the rule that made it, why, and what held it until when.

Pure: ``evaluate(policy, record, fleet, now, gates=...)`` -> ``Decision``, with no I/O; the gates' results are read
in coordinator/adapters/gates.py and fed in. The pending deletes of a scale set are coupled afterwards
(coordinator/domain/deletes.py ``couple``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

from coordinator.domain.budgets import budget_domains
from coordinator.domain.controls import GateResult
from coordinator.domain.escalation import Rung, climb
from coordinator.domain.expiry import SEND_MARGIN, deadline_lead
from coordinator.domain.fleet_view import FleetView
from coordinator.domain.matching import first_match
from coordinator.domain.model import DecisionRecord, EventRecord, Verdict
from coordinator.domain.pacing import PaceHold, pace_domains, pace_hold
from coordinator.domain.policy import Action, Callback, HooksOption, Policy, Rule

__all__ = [
    "NO_RULE",
    "Decision",
    "HoldKind",
    "callback_of",
    "escalated",
    "evaluate",
    "hooks_required",
    "needs_fleet",
    "paced_hold",
    "same_decision",
]

NO_RULE = "(no rule matched)"
_FIGURES = re.compile(r"\d+")
# What held a decision back (Decision.holdKind); "" when nothing did.
HoldKind = Literal["", "blackout", "window", "gate", "budget", "hooks", "delete", "census"]
# How far each action goes towards approving: a rule chosen because of a VM's tags may not go further than the rule
# the same event would get without tags (unless it says trustTags), since tags come from the VM.
_REACH: dict[str, int] = {
    "never-approve": 0,
    "wait-for-person": 1,
    "approve-after-hooks": 2,
    "approve-within-budget": 2,
    "approve-now": 3,
}


def _reach(rule: Rule) -> int:
    """How far a rule goes towards approving: its action's, or an approve-after-hooks' when its ladder ends in an
    approve or force step (a tag may not widen a rule through its ladder either)."""
    ladder = 2 if rule.escalate and rule.escalate[-1].do in ("approve", "force") else 0
    return max(_REACH[rule.action], ladder)


@dataclass(frozen=True)
class Decision:
    """The policy's verdict on one event: the rule and action that gave it, why, and what held it until when."""

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
    # An approval at the deadline (onNotBefore: approve, or an escalation's approve step): its window or gates held,
    # and NotBefore let it go, so they do not bound it (domain/expiry.py).
    atDeadline: bool = False
    # The rule's escalation steps reached (domain/escalation.py), and for an approval made by one, how near NotBefore
    # must be for the VM to execute it (its lead: the VM checks it against its own document and clock).
    escalation: tuple[Rung, ...] = ()
    nearNotBeforeSeconds: int | None = None
    forceHook: str = ""  # an escalation's force step: the VM runs its own hook of this name before it executes


def hooks_required(policy: Policy, rule_name: str, record: EventRecord) -> list[str]:
    """The VMs whose prepare hooks an approval by the named rule rested on: for an ``approve-after-hooks`` rule,
    the affected VMs that reported the prepare phase succeeded (each one's listener checks its own ledger);
    empty for any other rule. A VM approved past the hook deadline without success is not listed: the decision
    did not rest on it."""
    rule = policy.rule(rule_name)
    if rule is None or rule.action != "approve-after-hooks":
        return []
    affected = record.resources or sorted(record.vms)
    return [n for n in affected if n in record.vms and record.vms[n].hooks.get("prepare") == "succeeded"]


def callback_of(policy: Policy, rule_name: str) -> Callback:
    """The callback the named rule asks for; "relay" for a person's approval or a rule no longer there."""
    rule = policy.rule(rule_name)
    return rule.callback if rule is not None else "relay"


def needs_fleet(policy: Policy, record: EventRecord, now: datetime) -> bool:
    """Whether deciding the event reads the fleet view: the VMs' facts, a scale set's (ARM's, with its census: a
    ``scaleSet`` match rests on it as a tag rule does), a budget."""
    if policy.needs_census or policy.matches_scale_set:
        return True
    rule = first_match(policy, record, now)
    return rule is not None and rule.action == "approve-within-budget"


def evaluate(
    policy: Policy,
    record: EventRecord,
    fleet: FleetView,
    now: datetime,
    *,
    gates: Mapping[str, GateResult] | None = None,
) -> Decision:
    """The policy's decision. ``gates``: each named gate's result for this batch/tick (a gate a rule names but
    missing here counts as an error: not known to pass). An approval is then paced by the rule's rate and sequence
    as far as the view knows their state (``FleetView.paced``; the coordinator claims them afterwards)."""
    decision = escalated(policy, _evaluate(policy, record, fleet, now, gates or {}), record, fleet, now)
    if decision.verdict != "approve":
        return decision
    for domain in pace_domains(policy, decision.rule, record, fleet):
        hold = pace_hold(domain, fleet.paced.get(domain.key), record.eventId, now)
        if hold is not None:
            # A rule with a rate or sequence has no approve step (refused at load): its ladder only tells and holds.
            return escalated(policy, paced_hold(decision, record, hold), record, fleet, now)
    return decision


def escalated(
    policy: Policy, decision: Decision, record: EventRecord, fleet: FleetView, now: datetime, *, held: str = ""
) -> Decision:
    """A waiting decision as its rule's escalation ladder leaves it (domain/escalation.py): its reason noting the
    steps reached; an approval when the last of them approves, unless a blackout is open or ``held`` names what
    else holds it (pipeline/decide.py: an approval the census, a delete or a budget claim held after the rules).
    A decision that already carries its steps is left as it is."""
    rule = policy.rule(decision.rule)
    if decision.verdict != "wait" or decision.escalation or rule is None or not rule.escalate:
        return decision
    # A wait-for-person rule is never held by a blackout (it approves nothing): its approve step must be.
    blackout = next((b.name for b in policy.blackouts if b.open_until(now) is not None), None)
    blocked = f"blackout {blackout!r}" if blackout is not None else held
    ladder = climb(rule, record, fleet, now, blocked=blocked)
    if ladder is None:
        return decision
    reason = f"{decision.reason}; {ladder.note}"
    if not ladder.approve:
        return dataclasses.replace(decision, reason=reason, escalation=ladder.rungs)
    return Decision(
        rule.name,
        decision.action,
        "approve",
        reason,
        atDeadline=True,
        escalation=ladder.rungs,
        nearNotBeforeSeconds=ladder.near_seconds,
        forceHook=ladder.force_hook,
    )


def paced_hold(decision: Decision, record: EventRecord, hold: PaceHold) -> Decision:
    """The approval ``decision`` held by a rate or sequence: a budget hold named by its key, until when it is known."""
    return Decision(
        decision.rule,
        decision.action,
        "wait",
        # Until a sequence's domain concludes is not known: whether NotBefore comes first is not either.
        hold.reason + (_expiry(record, hold.until, "a budget holds it") if hold.until is not None else ""),
        heldUntil=hold.until,
        holdKind="budget",
        holdName=hold.key,
        escalation=decision.escalation,
    )


def _evaluate(  # noqa: PLR0911 -- one return per action, each explained
    policy: Policy,
    record: EventRecord,
    fleet: FleetView,
    now: datetime,
    gates: Mapping[str, GateResult],
) -> Decision:
    rule = first_match(policy, record, now, fleet)
    if rule is None:
        return Decision(NO_RULE, "wait-for-person", "wait", "no rule matched; a person decides")
    note = ""
    if rule.match.tags is not None and not rule.trustTags:
        plain = first_match(policy, record, now, fleet.untagged())
        if plain is None or _reach(plain) < _reach(rule):
            why = f"rule {plain.name!r}" if plain is not None else "no rule"
            note = (
                f"rule {rule.name!r} matched by a VM's tags would approve more than {why} does without tags; tags "
                "may only restrict (trustTags: false): "
            )
            if plain is None:
                return Decision(NO_RULE, "wait-for-person", "wait", note + "a person decides")
            rule = plain
    if rule.action == "approve-now":
        return _hold(policy, rule, record, now, gates) or Decision(
            rule.name, rule.action, "approve", f"{note}rule {rule.name!r} approves at once"
        )
    if rule.action == "never-approve":
        return Decision(rule.name, rule.action, "never", f"{note}rule {rule.name!r} lets NotBefore run out")
    if rule.action == "wait-for-person":
        return Decision(rule.name, rule.action, "wait", f"{note}rule {rule.name!r} waits for a person")
    held = _hold(policy, rule, record, now, gates)
    if held is not None and held.verdict == "wait":
        return held
    decision = (
        _after_hooks(rule, record, now)
        if rule.action == "approve-after-hooks"
        else _within_budget(policy, rule, record, fleet)
    )
    prefix = note + (f"{held.reason}; " if held is not None else "")
    if not prefix:
        return decision
    # A hold that let the event go is an approval at the deadline.
    at_deadline = held is not None and decision.verdict == "approve"
    return dataclasses.replace(decision, reason=prefix + decision.reason, atDeadline=at_deadline)


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
    if rule.onNotBefore == "approve" and record.notBefore is not None and now >= record.notBefore - deadline_lead(rule):
        not_before = record.notBefore.isoformat()
        send_by = record.notBefore - SEND_MARGIN
        if now < send_by:
            return dataclasses.replace(
                held,
                verdict="approve",
                reason=f"{held.reason}; NotBefore {not_before} is near: approved at the deadline (onNotBefore: "
                f"approve), to be sent by {send_by.isoformat()}",
                atDeadline=True,
            )
        # Past its send deadline an approval could only land after NotBefore, or be refused by the VM: none is made.
        return dataclasses.replace(
            held,
            reason=f"{held.reason}; NotBefore {not_before} is too near to deliver an approval before it (sent only "
            f"until {SEND_MARGIN.total_seconds():g} s before): left to expire (onNotBefore: approve)",
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


def _within_budget(policy: Policy, rule: Rule, record: EventRecord, fleet: FleetView) -> Decision:
    domains = budget_domains(policy, rule.name, record, fleet)
    for domain in domains:
        count = domain.count_with()
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


def same_decision(previous: DecisionRecord, decision: Decision, *, dry_run: bool) -> bool:
    """Whether a re-evaluation found the decision already recorded: the same rule and verdict, held by the same hold
    (kind, name, event or VM, until when), for the same reason but for its figures. A held event is evaluated again
    at each batch that carries its VMs and at each tick, and a budget's count grows as events queue behind it ("zone
    ... would have 70 impacted instances" then 75, 80): each count was a new decision, an event write and a Decision
    row, about 2 per held event in benchmarks/wave_budgets.py's zone wave. The figures are those of when the hold
    began (holdSince); what holds it, or until when, changing is a new decision."""
    return _decision_key(previous, previous.dryRun) == _decision_key(decision, dry_run)


def _decision_key(d: Decision | DecisionRecord, dry_run: bool) -> tuple[object, ...]:
    held = (d.heldBy, d.heldByVm, d.holdKind, d.holdName, d.heldUntil)
    return (d.rule, d.verdict, dry_run, *held, _FIGURES.sub("#", d.reason))
