"""Policy test cases: an event, the fleet around it and a time -> the verdict and rule expected, and optionally the
steps of the rule's escalation ladder reached (YAML).

Takes a cases file and a policy; gives one ``CaseResult`` per case. The file::

    cases:
      - name: a short freeze is approved at once          # required, unique
        at: 2026-01-05T10:00:00Z                          # the decision time (UTC unless it says otherwise)
        event:                                            # IMDS field names
          EventType: Freeze
          EventSource: Platform                           # default Platform
          DurationInSeconds: 5                            # default -1 (unknown)
          NotBefore: 2026-01-05T10:15:00Z                 # optional
          Resources: [web_0]
          FirstSeen: 2026-01-05T10:00:00Z                 # when the coordinator first saw it; default: at
          Status: Scheduled                               # each VM's status unless ``vms`` says (default)
          vms:                                            # what each VM reported; default: each of Resources,
            web_0: {status: Scheduled, hooks: {prepare: succeeded}, failedHooks: {}}   # Scheduled, no hooks
        vms:                                              # the VMs' identities (name required)
          - {name: web_0, scaleSet: web, placementGroup: pg-web}
        fleet:
          events:                                         # other open events, same shape as event, with State:
            - {EventType: Reboot, Resources: [web_1], State: Started}       # Approved/Started: counted by budgets
            - {EventType: Terminate, Resources: [web_2], NotBefore: ...}    # Scheduled: a pending delete (coupling)
        expect: {verdict: wait, rule: everything-else-waits, reason: waits for a person}   # reason: a substring
        # expect may also say which steps of the rule's escalation ladder are reached at ``at``, by number:
        #   escalation: [1, 2]  ([] none; not checked when left out)

Keys other than these in a VM, an event or ``fleet`` are passed to the models as they are (ops/policy/
adapters.py), which refuse, naming the key, those they do not support (``fleet: {authoritative: true}``: ``vms`` is
ARM's census, whose tags name a ``notify`` step's owners by its ``ownerTag``). The cases of ``policies/NAME.yaml`` live
in ``policies/NAME.tests.yaml``, found by ``cases_path``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from contracts.envelope import VmIdentity
from coordinator import Decision, EventRecord, GateState, Policy
from ops.policy import adapters
from ops.policy.adapters import InputError


class Expect(BaseModel):
    model_config = ConfigDict(extra="forbid")

    verdict: Literal["approve", "wait", "never"]
    rule: str
    reason: str = ""
    # The steps of the rule's escalation ladder reached at ``at`` (coordinator/domain/escalation.py), by number from
    # 1, in order; [] for none. None (left out): not checked.
    escalation: list[Annotated[int, Field(ge=1)]] | None = None


class Fleet(BaseModel):
    model_config = ConfigDict(extra="allow")  # the rest goes to FleetView (e.g. health-gate results)

    events: list[dict[str, Any]] = Field(default_factory=list)


class Case(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    description: str = ""
    at: datetime
    event: dict[str, Any]
    vms: list[dict[str, Any]] = Field(default_factory=list)
    fleet: Fleet = Field(default_factory=Fleet)
    # The policy's health gates as read at ``at``, by name; a gate left out is unknown, which holds as an unreadable
    # gate holds in the coordinator.
    gates: dict[str, GateState] = Field(default_factory=dict)
    expect: Expect


class CasesFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cases: list[Case] = Field(min_length=1)


@dataclass(frozen=True)
class CaseResult:
    name: str
    line: int
    passed: bool
    expected: Expect
    got: Decision | None
    error: str = ""

    @property
    def status(self) -> str:
        return "ERROR" if self.error else "PASS" if self.passed else "FAIL"

    @property
    def steps(self) -> list[int]:
        """The escalation steps the decision reached, by number ([] when none, or no decision)."""
        return steps_reached(self.got) if self.got is not None else []


def steps_reached(decision: Decision) -> list[int]:
    return [rung.step for rung in decision.escalation]


def cases_path(policy_path: Path) -> Path:
    """Where a policy's cases live by convention: ``default.yaml`` -> ``default.tests.yaml`` beside it."""
    return policy_path.with_name(policy_path.stem + ".tests.yaml")


def load_cases(path: Path) -> list[tuple[Case, int]]:
    """The cases of a file, each with its line; an error names the file, line and field."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise InputError(f"cannot read test cases {path}: {error.strerror}") from error
    try:
        data = yaml.safe_load(text)
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as error:
        raise InputError(f"{path}: not valid YAML: {error}") from error
    lines = _case_lines(root)
    try:
        parsed = CasesFile.model_validate(data)
    except ValidationError as error:
        problems = []
        for item in error.errors():
            loc = item["loc"]
            index = loc[1] if len(loc) > 1 and loc[0] == "cases" and isinstance(loc[1], int) else None
            line = lines[index] if index is not None and index < len(lines) else 1
            problems.append(f"{path}:{line}: {'.'.join(map(str, loc)) or '(top)'}: {item['msg']}")
        raise InputError("invalid test cases:\n  " + "\n  ".join(problems)) from error
    names = [case.name for case in parsed.cases]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise InputError(f"{path}: case names used twice: {', '.join(twice)}")
    return [(case, lines[i] if i < len(lines) else 1) for i, case in enumerate(parsed.cases)]


def _case_lines(root: yaml.Node | None) -> list[int]:
    if not isinstance(root, yaml.MappingNode):
        return []
    for key, value in root.value:
        if key.value == "cases" and isinstance(value, yaml.SequenceNode):
            return [item.start_mark.line + 1 for item in value.value]
    return []


def run_case(policy: Policy, case: Case, *, line: int = 0) -> CaseResult:
    try:
        now = adapters.aware(case.at)
        identities = {i.name: i for i in (adapters.vm_identity(spec) for spec in case.vms)}
        record = _event(case.event, identities, now)
        others = [_event(spec, identities, now) for spec in case.fleet.events]
        view = adapters.fleet_view(
            (r for r in others if r.state in ("Approved", "Started")),
            case.fleet.model_extra,
            census=identities.values(),
        )
        deletes = [adapters.own_verdict(policy, r, now) for r in others if r.state == "Scheduled"]
        gates = adapters.gate_results(policy, case.gates, default=None)
        got = adapters.decide(policy, record, view, deletes, now, gates=gates)
    except (InputError, ValueError) as error:
        return CaseResult(case.name, line, False, case.expect, None, str(error))
    expect = case.expect
    passed = (
        (got.verdict, got.rule) == (expect.verdict, expect.rule)
        and expect.reason in got.reason
        and (expect.escalation is None or steps_reached(got) == expect.escalation)
    )
    return CaseResult(case.name, line, passed, expect, got)


def _event(spec: dict[str, Any], identities: dict[str, VmIdentity], now: datetime) -> EventRecord:
    facts = dict(spec)
    reported = facts.pop("vms", None)
    status = facts.pop("Status", "Scheduled")
    if reported is None:
        reported = {name: {} for name in facts.get("Resources", [])}
    facts.setdefault("EventId", f"case-{facts.get('EventType', 'event')}-{'-'.join(facts.get('Resources', []))}")
    created = adapters.aware(_time(facts.pop("FirstSeen", None)) or now)
    if not isinstance(reported, dict):
        raise InputError("event.vms: a mapping of VM name -> what it reported (status, hooks, failedHooks)")
    sightings = {
        name: adapters.sighting(
            identities.get(name) or adapters.vm_identity({"name": name}),
            {"status": status, **(state or {})},
            at=created,
        )
        for name, state in reported.items()
    }
    return adapters.event_record(
        facts, sightings=sightings, created_at=created, approved=facts.get("State") in ("Approved", "Started")
    )


def _time(value: Any) -> datetime | None:
    if value is None or isinstance(value, datetime):
        return value
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError as error:
        raise InputError(f"FirstSeen: not a time: {value!r}") from error
