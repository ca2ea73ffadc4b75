"""Matching: which rule of the policy takes an event (the first whose ``match`` holds).

Pure: takes the policy, the event, the time and, for tags, the fleet view; coordinator/domain/evaluation.py decides
with the rule found.
"""

from __future__ import annotations

import fnmatch
from datetime import datetime

from coordinator.domain.fleet_view import FleetView, scale_set_of
from coordinator.domain.model import EventRecord
from coordinator.domain.policy import Match, Policy, Rule

__all__ = ["first_match", "matches"]


def first_match(policy: Policy, record: EventRecord, now: datetime, fleet: FleetView | None = None) -> Rule | None:
    return next((rule for rule in policy.rules if matches(rule.match, record, now, fleet)), None)


def matches(match: Match, record: EventRecord, now: datetime, fleet: FleetView | None = None) -> bool:  # noqa: PLR0911
    """Whether ``match`` takes the event at ``now``; ``fleet`` says the VMs' tags (none without it) and scale sets."""
    if match.eventType is not None and record.eventType not in match.eventType:
        return False
    if match.eventSource is not None and record.eventSource not in match.eventSource:
        return False
    if match.durationSeconds is not None and not match.durationSeconds.contains(record.durationInSeconds):
        return False
    if match.vmName is not None and not _all_match(record.resources, match.vmName):
        return False
    if match.scaleSet is not None:
        scale_sets = {_scale_set(record, name, fleet) for name in record.resources} - {""}
        if not scale_sets or not _all_match(sorted(scale_sets), match.scaleSet):
            return False
    if match.tags is not None and not _tags_match(record, fleet or FleetView(), match.tags):
        return False
    return match.window is None or match.window.contains(now)


def _scale_set(record: EventRecord, name: str, fleet: FleetView | None) -> str:
    """A VM's scale set as the fleet view says it: ARM's when the census is ARM's (none for a VM it does not list),
    so that a VM's own word (its sightings' ``vmScaleSetName``) neither escapes a scale set's rule nor earns one;
    else its sightings' (or its name's)."""
    return fleet.facts(record, name).scaleSet if fleet is not None else scale_set_of(record, name)


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
