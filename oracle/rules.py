"""Which rule of the policy decides an event at a given time, by the documented matching (docs/policy.md,
*Policy reference*, *Tags*), written again here rather than taken from the coordinator: the oracle reads the policy
file with the coordinator's schema (the file format is the contract) but not its matching code.

- every criterion given must hold; rules are ordered, the first match wins, no match waits for a person;
- ``scaleSet``/``vmName``: globs every affected scale set / VM must match (VMs without a scale set have none);
- ``tags``: any affected VM carrying one of the tags (names case-insensitive, values globs);
- ``match.window``: UTC days and hours (the rule does not match outside them);
- a rule matched through tags may not approve more than the rule the event gets with every tag ignored, unless it
  says ``trustTags`` (approve-now > approve-after-hooks = approve-within-budget > wait-for-person > never-approve);
- an escalation ladder (``escalate``): step k's time is NotBefore minus its ``beforeNotBeforeSeconds``; while its
  rule waits, the first run at or after that time takes it. A ladder whose last step is ``approve`` makes the rule
  approve from that step's time (no blackout open) until ``SEND_MARGIN`` before NotBefore (an approval sent later
  could only land after NotBefore): ``ladder_approval``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

from coordinator import Match, Policy, Rule
from oracle.calendar import utc_window_spans
from oracle.intervals import EMPTY, Intervals, seconds
from oracle.truth import Event, Vm

__all__ = [
    "REACH",
    "SEND_MARGIN",
    "Choice",
    "choose",
    "ladder_approval",
    "ladder_approves",
    "match_breakpoints",
    "steps",
]

# How long before NotBefore an approval is still sent (docs: an approval sent later could only land after NotBefore,
# or be refused by the VM): the coordinator's margin, 5 s.
SEND_MARGIN = 5.0

REACH = {
    "never-approve": 0,
    "wait-for-person": 1,
    "approve-after-hooks": 2,
    "approve-within-budget": 2,
    "approve-now": 3,
}

# (the rule that decides, or None: nobody approves; why, in words)
Choice = tuple[Rule | None, str]


def _all_match(values: list[str], patterns: list[str]) -> bool:
    return bool(values) and all(any(fnmatch.fnmatchcase(v, p) for p in patterns) for v in values)


def _tagged(event: Event, vms: Mapping[str, Vm], wanted: dict[str, str]) -> bool:
    for name in event.resources:
        vm = vms.get(name)
        tags = {k.lower(): v for k, v in (vm.tags if vm else {}).items()}
        for tag, pattern in wanted.items():
            value = tags.get(tag.lower())
            if value is not None and fnmatch.fnmatchcase(value, pattern):
                return True
    return False


def _matches(match: Match, event: Event, vms: Mapping[str, Vm], at: float, *, tags: bool) -> bool:  # noqa: PLR0911
    if match.eventType is not None and event.eventType not in match.eventType:
        return False
    if match.eventSource is not None and event.eventSource not in match.eventSource:
        return False
    duration = match.durationSeconds
    if duration is not None and not (
        (duration.min is None or event.durationInSeconds >= duration.min)
        and (duration.max is None or event.durationInSeconds <= duration.max)
    ):
        return False
    if match.vmName is not None and not _all_match(event.resources, match.vmName):
        return False
    if match.scaleSet is not None:
        sets = sorted({vms[n].scaleSet for n in event.resources if n in vms} - {""})
        if not _all_match(sets, match.scaleSet):
            return False
    if match.tags is not None and not (tags and _tagged(event, vms, match.tags)):
        return False
    window = match.window
    return window is None or at in utc_window_spans(list(window.days), window.hours, at - 1, at + 1)


def _first(policy: Policy, event: Event, vms: Mapping[str, Vm], at: float, *, tags: bool) -> Rule | None:
    return next((rule for rule in policy.rules if _matches(rule.match, event, vms, at, tags=tags)), None)


def choose(policy: Policy, event: Event, vms: Mapping[str, Vm], at: float) -> Choice:
    """The rule that decides ``event`` at ``at`` (None when nobody approves by rule), and why."""
    rule = _first(policy, event, vms, at, tags=True)
    if rule is None:
        return None, "no rule matches: a person decides"
    if rule.match.tags is not None and not rule.trustTags:
        plain = _first(policy, event, vms, at, tags=False)
        if plain is None:
            return None, f"rule {rule.name!r} matched by tags, and no rule without them: a person decides"
        if REACH[plain.action] < REACH[rule.action]:
            return plain, f"rule {rule.name!r} matched by tags may not widen rule {plain.name!r}"
    return rule, f"rule {rule.name!r}"


def match_breakpoints(policy: Policy, lo: float, hi: float) -> list[float]:
    """Where the choice of rule may change: the edges of every rule's ``match.window``."""
    points: list[float] = []
    for rule in policy.rules:
        window = rule.match.window
        if window is not None:
            spans: Intervals = utc_window_spans(list(window.days), window.hours, lo, hi)
            points.extend(edge for span in spans.spans for edge in span)
    return points


def steps(rule: Rule, event: Event) -> list[tuple[int, str, int, float]]:
    """The rule's escalation steps for an event with a NotBefore: (place from 1, what it does, its lead, its time)."""
    if event.notBefore is None:
        return []
    not_before = seconds(event.notBefore)
    return [
        (index, step.do, step.beforeNotBeforeSeconds, not_before - step.beforeNotBeforeSeconds)
        for index, step in enumerate(rule.escalate, start=1)
    ]


def ladder_approves(rule: Rule, *, forced: bool = True) -> bool:
    """Whether the rule's ladder ends by approving: ``approve``, or ``force`` (``forced``: its approval executes only
    once the VM's own force hook succeeded, which the oracle does not know beforehand, so it is allowed, never due)."""
    last = rule.escalate[-1].do if rule.escalate else ""
    return last == "approve" or (forced and last == "force")


def ladder_approval(rule: Rule, event: Event, *, surely: bool = False) -> Intervals:
    """When the rule's ladder approves the event while the rule itself waits (blackouts aside): from its last step's
    time, when that step is ``approve`` (or, not ``surely``, ``force``), until ``SEND_MARGIN`` before NotBefore."""
    if not ladder_approves(rule, forced=not surely) or event.notBefore is None:
        return EMPTY
    not_before = seconds(event.notBefore)
    return Intervals.of([(not_before - rule.escalate[-1].beforeNotBeforeSeconds, not_before - SEND_MARGIN)])
