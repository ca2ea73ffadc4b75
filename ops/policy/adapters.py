"""Build what ``evaluate`` takes (EventRecord with its VmSightings, VmIdentity, FleetView) from plain
mappings, and decide as the coordinator does (``decide``: the rule, then delete coupling).

The one place the policy tools make models: test cases and history replay both come through here, so a field the
models gain (a VM's tags, zone, fault or update domain; health-gate results in the fleet view) needs no change
here at all when its key is the model's field name: keys these builders do not translate are passed through, and a
model that does not have such a field (yet) is refused with an ``InputError`` naming the key and the model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from contracts.envelope import VmIdentity
from coordinator import (
    BudgetRecord,
    Decision,
    DecisionRecord,
    EventRecord,
    FleetView,
    GateResult,
    GateState,
    HistoryRow,
    Policy,
    VmSighting,
    couple,
    evaluate,
    facts_of,
    scale_sets_of,
)

M = TypeVar("M", bound=BaseModel)


class InputError(ValueError):
    """A test case or history row the tools cannot turn into the policy's inputs; the message says why."""


# Names the tools accept for a VM, as the history columns and IMDS say them -> VmIdentity fields.
_VM_ALIASES = {
    "scaleSet": "vmScaleSetName",
    "ScaleSetName": "vmScaleSetName",
    "placementGroup": "placementGroupId",
    "PlacementGroupId": "placementGroupId",
    "VmName": "name",
    "VmId": "vmId",
    "VmResourceId": "resourceId",
}
# The history columns that say who the reporting VM is (coordinator/domain/history_rows.py ``vm_columns``).
HISTORY_VM_COLUMNS = ("VmName", "VmId", "VmResourceId", "ScaleSetName", "PlacementGroupId")
# IMDS event fields (as Scheduled Events and the history columns name them) -> EventRecord fields.
_EVENT_ALIASES = {
    "EventId": "eventId",
    "EventType": "eventType",
    "EventSource": "eventSource",
    "ResourceType": "resourceType",
    "Resources": "resources",
    "Description": "description",
    "DurationInSeconds": "durationInSeconds",
    "NotBefore": "notBefore",
    "State": "state",
    "FirstSeen": "createdAt",
}
# Per-VM state of one event -> VmSighting fields.
_SIGHTING_ALIASES = {"Status": "status", "EventStatus": "status"}


def _renamed(data: Mapping[str, Any], aliases: Mapping[str, str]) -> dict[str, Any]:
    return {aliases.get(key, key): value for key, value in data.items()}


def _build(model: type[M], data: dict[str, Any], *, what: str) -> M:
    unknown = sorted(set(data) - set(model.model_fields))
    if unknown:
        raise InputError(
            f"{what}: {', '.join(map(repr, unknown))} not supported by this coordinator ({model.__name__} has no such "
            f"field; known: {', '.join(sorted(model.model_fields))})"
        )
    try:
        return model.model_validate(data)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(top)'}: {e['msg']}" for e in error.errors())
        raise InputError(f"{what}: {problems}") from error


def vm_identity(spec: Mapping[str, Any]) -> VmIdentity:
    """A VM as the forwarder reports it. Only ``name`` is needed; vmId and resourceId default to ones made from it."""
    data = {k: v for k, v in _renamed(spec, _VM_ALIASES).items() if v not in (None, "")}
    name = str(data.get("name", ""))
    if not name:
        raise InputError(f"VM {dict(spec)!r}: 'name' is required")
    data.setdefault("vmId", f"vmid-{name}")
    data.setdefault("resourceId", f"/vms/{name}")
    return _build(VmIdentity, data, what=f"VM {name}")


def vm_identity_from_row(row: HistoryRow) -> VmIdentity:
    """The reporting VM of a history row (its VM columns, as ``vm_identity`` takes them)."""
    return vm_identity({column: getattr(row, column) for column in HISTORY_VM_COLUMNS})


def sighting(identity: VmIdentity, state: Mapping[str, Any], *, at: datetime) -> VmSighting:
    """What one VM said about an event: its identity, ``status`` (default Scheduled), ``hooks``/``failedHooks``
    per phase, first and last seen (default ``at``)."""
    data: dict[str, Any] = {
        "name": identity.name,
        "vmId": identity.vmId,
        "resourceId": identity.resourceId,
        "scaleSet": identity.vmScaleSetName,
        "placementGroup": identity.placementGroupId,
        "firstSeen": at,
        "lastSeen": at,
        "lastSequence": 0,
        "status": "Scheduled",
    }
    data.update(_renamed(state, _SIGHTING_ALIASES))
    return _build(VmSighting, data, what=f"VM {identity.name}'s sighting")


def event_record(
    facts: Mapping[str, Any],
    *,
    sightings: Mapping[str, VmSighting],
    created_at: datetime,
    decision: DecisionRecord | None = None,
    approved: bool = False,
) -> EventRecord:
    """An event as the coordinator holds it: ``facts`` in IMDS names (EventType, EventSource, DurationInSeconds,
    NotBefore, Resources; State, FirstSeen), the VMs' sightings, its current decision; ``approved`` when an
    approval was decided (the event then holds budget)."""
    data: dict[str, Any] = {"eventId": "", "stateSince": created_at, "createdAt": created_at}
    data.update({k: v for k, v in _renamed(facts, _EVENT_ALIASES).items() if v is not None})
    data["vms"] = dict(sightings)
    data["decision"] = decision
    if approved:
        when = decision.decidedAt if decision else created_at
        data["approval"] = {
            "decisionId": decision.decisionId if decision else "",
            "rule": "",
            "actor": "",
            "decidedAt": when,
        }
    record = _build(EventRecord, data, what=f"event {data.get('eventId') or '(no EventId)'}")
    record.scaleSets = scale_sets_of(record)
    if record.notBefore is not None:  # a YAML or exported time without an offset is UTC, as the history writes
        record.notBefore = aware(record.notBefore)
    return record


def fleet_view(
    impacting: Iterable[EventRecord],
    extra: Mapping[str, Any] | None = None,
    *,
    census: Iterable[VmIdentity] = (),
) -> FleetView:
    """The fleet view a decision sees: the events impacting VMs (approved or started) and the census (the VMs
    known, with their domains and tags, as fleet.census builds it); ``extra`` goes to FleetView as is, but for
    ``paced``: the rate and sequence budgets' state by key, each ``{claims: {EventId: {claimedAt, domains}},
    lastDomains, doneAt}`` (the claim entities' shape; coordinator/domain/pacing.py)."""
    fields = dict(extra or {})
    if "paced" in fields:
        fields["paced"] = _paced(fields["paced"])
    try:
        view = FleetView(**fields)
        known = {identity.name: facts_of(identity) for identity in census}
        if known:
            view = dataclasses.replace(view, vms={**view.vms, **known})
    except TypeError as error:
        raise InputError(
            f"fleet: {', '.join(map(repr, sorted(extra or {})))} not supported by this coordinator's "
            f"FleetView ({error})"
        ) from error
    for record in impacting:
        view = view.with_event(record)
    return view


def _paced(value: Any) -> dict[str, BudgetRecord]:
    if not isinstance(value, Mapping):
        raise InputError("fleet.paced: a mapping of budget keys (e.g. 'rate:RULE:fleet') to their claims")
    out: dict[str, BudgetRecord] = {}
    for key, state in value.items():
        data = dict(state or {})
        claims = {
            str(event_id): {"eventId": str(event_id), "vms": [], **dict(claim or {})}
            for event_id, claim in dict(data.pop("claims", {}) or {}).items()
        }
        out[str(key)] = _build(
            BudgetRecord, {"scaleSet": str(key), "claims": claims, **data}, what=f"fleet.paced {key}"
        )
    return out


def gate_results(
    policy: Policy, states: Mapping[str, GateState], *, default: GateState | None
) -> dict[str, GateResult]:
    """The policy's gates as a decision sees them: ``states`` by name, the rest ``default`` (None: left out, which
    the rules read as unknown and hold, as the coordinator does with a gate it could not read)."""
    unknown = sorted(set(states) - set(policy.gates))
    if unknown:
        raise InputError(f"gates {unknown}: the policy defines no such gate (it has {sorted(policy.gates)})")
    results = {name: GateResult(state) for name, state in states.items()}
    if default is not None:
        for name in policy.gates:
            results.setdefault(name, GateResult(default, "assumed"))
    return results


def decide(
    policy: Policy,
    record: EventRecord,
    fleet: FleetView,
    deletes: Iterable[EventRecord],
    now: datetime,
    *,
    gates: Mapping[str, GateResult] | None = None,
) -> Decision:
    """The decision pipeline/decide.py makes (without the fleet-wide budget claim): the first matching rule's,
    with these health-gate results, then, for a Terminate, held while another pending delete of its scale set is
    not ready."""
    decision = evaluate(policy, record, fleet, now, gates=gates)
    if record.eventType == "Terminate" and record.scaleSets:
        decision = couple(decision, record, deletes, now)
    return decision


def own_verdict(policy: Policy, record: EventRecord, now: datetime) -> EventRecord:
    """A pending delete with its own rule's decision (as decide_all notes one before coupling the others)."""
    own = evaluate(policy, record, FleetView(), now)
    decision = DecisionRecord(
        decisionId="", rule=own.rule, action=own.action, verdict=own.verdict, reason=own.reason, decidedAt=now
    )
    return record.model_copy(update={"decision": decision})


def aware(value: datetime) -> datetime:
    return value if value.tzinfo else value.replace(tzinfo=UTC)
