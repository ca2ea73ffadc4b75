"""What a run should end with, decided before looking at what happened (pure, no I/O).

For every event the IMDS emulator created, the policy's first matching rule says whether the coordinator should
approve it: ``approve`` (approve-now; approve-after-hooks when the forwarders have a prepare hook that succeeds),
``no-approval`` (wait-for-person, never-approve, no rule; and every event that appeared already Started) or
``either`` (a budget rule, a rate or a sequence depends on the rest of the fleet; a rule with a window or gates, or a
policy with blackouts, depends on the time and on health; a notice too short for any pipeline to act on). Rules match
the scenario VMs' tags as the coordinator matches the tags their forwarders report.

Scenario hooks count: an approve-after-hooks event one of whose VMs has a prepare hook that fails (or outlasts the
forwarder's hook timeout) is not approved before the rule's hook deadline (``no-approval`` with onDeadline=wait,
``either`` with onDeadline=approve). Delete coupling counts: a Terminate that would be approved but overlaps a
Terminate of the same scale set that is not expected to be approved waits for it (``either``: the platform may
start either first).

A scenario run with its own policy says what becomes of the events where the rules alone cannot (``expect`` on a
create step: a budget, a gate, a window depend on the rest of the run, which the scenario knows): ``with_declared``
puts its word over the rules', and keeps the rules' own to show a contradiction.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any, Literal

from coordinator import EventRecord, FleetView, HooksOption, Policy, Rule, VmFacts, first_match
from emulators.imds import VmSpec

Expectation = Literal["approve", "no-approval", "either"]
# An approval needs a poll, an Event Hubs hop, a decision and a relay round trip; below this notice (real
# seconds) the platform may start the event first, and no expectation is set.
MIN_NOTICE_SECONDS = 3.0
# A ladder's approve step is made while at least the send margin (5 s) is left before NotBefore, and a step comes
# with a timer tick (2 s locally): below this notice (real seconds) on top of MIN_NOTICE_SECONDS, no expectation.
LADDER_MARGIN_SECONDS = 8.0
# The local forwarders' --hook-timeout (local.stack): a hook that sleeps this long is killed, its phase timed out.
HOOK_TIMEOUT_SECONDS = 30.0


@dataclass(frozen=True)
class Expected:
    event_id: str
    label: str
    event_type: str
    approval: Expectation
    rule: str
    terminal_state: str  # the coordinator's state once the event is over: Completed or Canceled
    # When the scenario declared ``approval``: what the rules alone expected (None when nothing was declared).
    computed: Expectation | None = None


def _parse_time(value: Any) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        if value.endswith("GMT"):
            return parsedate_to_datetime(value).astimezone(UTC)
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except (TypeError, ValueError):
        return None


def prepare_fails(vm: VmSpec | None, rule: Rule) -> bool | None:
    """Whether the VM's prepare phase (as the scenario gives it) does not count as ready for ``rule``: True when a
    hook fails or times out, or there is none and the rule waits for VMs without hooks; None when the scenario
    says nothing (the run's default hooks)."""
    if vm is None or vm.hooks is None:
        return None
    options = rule.hooks or HooksOption()
    if not vm.hooks.prepare:
        return options.noHooks == "wait"
    return any(hook.exitCode != 0 or hook.seconds >= HOOK_TIMEOUT_SECONDS for hook in vm.hooks.prepare)


def expect(
    event: dict[str, Any],
    policy: Policy,
    *,
    prepare_hooks: bool,
    vms: dict[str, VmSpec] | None = None,
    time_scale: float = 1.0,
) -> Expected:
    """The expectation for one event as listed by the IMDS emulator's ``GET /_emulator/events``; ``vms`` (the
    scenario's VMs by name) brings in their hooks; ``time_scale`` turns the emulator's notice (Azure seconds)
    into the real seconds the coordinator's hook deadline is counted in."""
    scheduled_at = _parse_time(event.get("scheduledAt")) or datetime.now(UTC)
    record = EventRecord(
        eventId=str(event["EventId"]),
        eventType=str(event["EventType"]),
        eventSource=str(event.get("EventSource") or "Platform"),
        resources=[str(name) for name in event.get("Resources", [])],
        durationInSeconds=int(event.get("DurationInSeconds", -1)),
        stateSince=scheduled_at,
        createdAt=scheduled_at,
    )
    label = str(event.get("ref") or record.eventId)
    terminal = "Canceled" if event.get("state") == "Canceled" else "Completed"
    fleet = FleetView(vms={name: VmFacts(scaleSet=vm.vmScaleSetName, tags=vm.tags) for name, vm in (vms or {}).items()})
    rule = first_match(policy, record, scheduled_at, fleet)
    rule_name = rule.name if rule is not None else "(no rule matched)"
    approval = _by_rule(event, record, rule, policy, prepare_hooks=prepare_hooks, vms=vms or {}, time_scale=time_scale)
    not_before = _parse_time(event.get("NotBefore"))
    # A ladder's approval is made only until the send margin before NotBefore (coordinator/domain/expiry.py).
    least = MIN_NOTICE_SECONDS + (LADDER_MARGIN_SECONDS if rule is not None and rule.escalate else 0.0)
    if approval == "approve" and (not_before is None or (not_before - scheduled_at).total_seconds() < least):
        approval = "either"
    if approval == "approve" and event.get("state") == "Canceled":
        approval = "either"
    return Expected(record.eventId, label, record.eventType, approval, rule_name, terminal)


def _by_rule(
    event: dict[str, Any],
    record: EventRecord,
    rule: Rule | None,
    policy: Policy,
    *,
    prepare_hooks: bool,
    vms: dict[str, VmSpec],
    time_scale: float,
) -> Expectation:
    """What the rule that decides the event makes of it, before its notice and its end are considered."""
    scheduled_at = record.createdAt
    if event.get("startedBy") == "hardware-failure" or rule is None:
        return "no-approval"
    if rule.escalate and rule.escalate[-1].do in ("approve", "force"):
        # The ladder's last step approves whatever held it (a person, hooks, a window, a gate), in time for its VM
        # to execute it before NotBefore, unless a blackout is open then (policy's blackouts: time-dependent); a
        # force step only once the VM's own force hook succeeded, which is the VM's (its scenario's hooks) to say.
        forced = rule.escalate[-1].do == "force"
        return "either" if policy.blackouts or forced else "approve"
    if rule.action in ("wait-for-person", "never-approve"):
        return "no-approval"
    if rule.action == "approve-after-hooks" and any(prepare_fails(vms.get(name), rule) for name in record.resources):
        options = rule.hooks or HooksOption()
        not_before = _parse_time(event.get("NotBefore"))
        notice = (not_before - scheduled_at).total_seconds() / time_scale if not_before is not None else math.inf
        # The deadline is real seconds from the coordinator's first sighting: it passes within the notice or not.
        return "either" if options.onDeadline == "approve" and options.deadlineSeconds < notice else "no-approval"
    if (
        rule.action == "approve-within-budget"
        or rule.rate is not None
        or rule.sequence is not None
        or rule.window is not None
        or rule.gates
        or policy.blackouts
        or (
            rule.action == "approve-after-hooks"
            and not prepare_hooks
            and any(prepare_fails(vms.get(name), rule) is None for name in record.resources)
        )
    ):
        return "either"
    return "approve"


def _span(event: dict[str, Any]) -> tuple[datetime, datetime]:
    """From scheduled until the platform started or removed the event (or now, if neither yet)."""
    start = _parse_time(event.get("scheduledAt")) or datetime.now(UTC)
    end = _parse_time(event.get("startedAt")) or _parse_time(event.get("removedAt")) or datetime.now(UTC)
    return start, end


def _coupled(events: list[dict[str, Any]], expected: list[Expected], vms: dict[str, VmSpec]) -> list[Expected]:
    """A Terminate expected to be approved overlapping a Terminate of the same scale set that is not: the
    coordinator holds the former while the latter is pending, so the platform may start it first."""

    def scale_sets(event: dict[str, Any]) -> set[str]:
        return {
            str(vms[name].vmScaleSetName)
            for name in event.get("Resources", [])
            if name in vms and vms[name].vmScaleSetName
        }

    result = []
    for event, item in zip(events, expected, strict=True):
        if item.approval == "approve" and item.event_type == "Terminate":
            mine, (start, end) = scale_sets(event), _span(event)
            for other, other_item in zip(events, expected, strict=True):
                if (
                    other_item.event_id != item.event_id
                    and other_item.event_type == "Terminate"
                    and other_item.approval != "approve"
                    and mine & scale_sets(other)
                    and _span(other)[0] <= end
                    and start <= _span(other)[1]
                ):
                    item = replace(item, approval="either")  # noqa: PLW2901 -- the same event, coupled
                    break
        result.append(item)
    return result


def expect_all(
    events: list[dict[str, Any]],
    policy: Policy,
    *,
    prepare_hooks: bool,
    vms: list[VmSpec] | None = None,
    time_scale: float = 1.0,
) -> list[Expected]:
    by_name = {vm.name: vm for vm in vms or []}
    expected = [
        expect(event, policy, prepare_hooks=prepare_hooks, vms=by_name, time_scale=time_scale) for event in events
    ]
    return _coupled(events, expected, by_name)


def with_declared(expected: list[Expected], declared: Mapping[str, Expectation]) -> list[Expected]:
    """The scenario's expectation (by the event's ref, its label) over the rules' one, which is kept in ``computed``."""
    return [
        replace(item, approval=declared[item.label], computed=item.approval) if item.label in declared else item
        for item in expected
    ]
