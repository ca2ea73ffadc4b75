"""Validated inputs of the IMDS emulator: simulated VMs, event requests, faults, scenarios, StartRequests.

Every boundary (control API bodies, scenario files, the IMDS POST body) is parsed into one of these models, so a
bad input fails with an error that names the field and the reason.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from emulators.imds.local_steps import (
    ForgeStep,
    GateStep,
    HealthPage,
    HealthPageStatus,
    ListenerStep,
    OutageStep,
    SignalStep,
)
from emulators.imds.vm_models import GUID, ScaleSetSpec, VmSpec

EventTypeName = Literal["Freeze", "Reboot", "Redeploy", "Preempt", "Terminate"]
EventSourceName = Literal["Platform", "User"]
NotBeforeStyle = Literal["RFC1123", "ISO8601"]
# Azure seconds an accepted approval waits before the event starts (other tenants of the host), or "NotBefore":
# the platform ignores approvals and starts the event at NotBefore.
StartDelay = Annotated[float, Field(ge=0)] | Literal["NotBefore"]

# Minimum notice per type in the docs (Azure seconds; divided by the time scale). Terminate comes from the
# scale set's terminateNotificationProfile.notBeforeTimeout instead.
DEFAULT_NOTICE_SECONDS: dict[str, float] = {"Freeze": 900, "Reboot": 900, "Redeploy": 600, "Preempt": 30}
DEFAULT_DURATION_SECONDS: dict[str, int] = {"Freeze": 5, "Reboot": -1, "Redeploy": -1, "Preempt": -1, "Terminate": -1}
# Descriptions the docs list as examples (learn.microsoft.com, "Scheduled Events", Event properties) and the ones
# Microsoft's scheduled-events mock server replays from events captured on Azure VMs. The default is chosen by type,
# status and source (`default_description`), so a hardware failure does not read like a user's request.
DESCRIPTION_LIVE_MIGRATION = "Virtual machine is being paused because of a memory-preserving Live Migration operation."
DESCRIPTION_HOST_MAINTENANCE = "Host server is undergoing maintenance."
DESCRIPTION_INFRASTRUCTURE_MAINTENANCE = "Host Server infrastructure is undergoing maintenance."
DESCRIPTION_EMERGENCY_REPAIR = "Host server is undergoing an emergency repair."
DESCRIPTION_EVICTION = "The Virtual Machine will be evicted."  # mock server capture
# Not documented: the emulator's wording for a platform-initiated delete (autoscale scale-in).
DESCRIPTION_SCALE_IN = "Virtual machine is going to be deleted because of a scale-in operation."
# "Virtual machine is going to be restarted as requested by authorized user." (documented) and "… redeployed as
# requested by authorized user." (mock server capture) share one pattern; the other types follow it.
_USER_VERBS: dict[str, str] = {
    "Freeze": "paused",
    "Reboot": "restarted",
    "Redeploy": "redeployed",
    "Preempt": "evicted",
    "Terminate": "deleted",
}


def default_description(event_type: str, *, source: str, created_started: bool) -> str:
    """The Description Azure would show for this kind of event when the request gives none."""
    if source == "User":
        return f"Virtual machine is going to be {_USER_VERBS[event_type]} as requested by authorized user."
    if created_started and event_type in ("Reboot", "Redeploy"):
        return DESCRIPTION_EMERGENCY_REPAIR  # an actual hardware failure: no notice, already Started
    return {
        "Freeze": DESCRIPTION_LIVE_MIGRATION,
        "Reboot": DESCRIPTION_HOST_MAINTENANCE,
        "Redeploy": DESCRIPTION_INFRASTRUCTURE_MAINTENANCE,
        "Preempt": DESCRIPTION_EVICTION,
        "Terminate": DESCRIPTION_SCALE_IN,
    }[event_type]


class ScenarioError(ValueError):
    """A scenario file or control-API body failed validation; the message names the field and the reason."""


# A model validator's message that names the field it is about first ("steps.2.cancel: ..."): its line is that one's.
_NAMED_FIELD = re.compile(r"^(?P<path>[A-Za-z_]\w*(?:\.\w+)*): ")

Lines = dict[tuple[str, ...], int]


def describe_validation_error(error: ValidationError, *, source: str, lines: Lines | None = None) -> str:
    """One line naming the source and, per problem, the field, its line in the file when ``lines`` (from
    ``yaml_lines``) knows it, and the reason."""
    problems = []
    for item in error.errors():
        path = tuple(str(part) for part in item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        named = _NAMED_FIELD.match(message)
        if named:
            path = (*path, *named["path"].split("."))
            message = message[named.end() :]
        where = ".".join(path) or "(root)"
        line = _line_of(path, lines) if lines else None
        problems.append(f"{where} (line {line}): {message}" if line else f"{where}: {message}")
    return f"{source} is invalid: {'; '.join(problems)}"


def yaml_lines(text: str) -> Lines:
    """The line of every key and item of a YAML (or JSON) document, by its path of keys and indexes as text."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return {}
    lines: Lines = {}

    def walk(node: yaml.Node, path: tuple[str, ...]) -> None:
        lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                lines[(*path, str(key.value))] = key.start_mark.line + 1
                walk(value, (*path, str(key.value)))
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                walk(item, (*path, str(index)))

    if root is not None:
        walk(root, ())
    return lines


def _line_of(path: tuple[str, ...], lines: Lines) -> int | None:
    """The line of ``path``, else of its nearest ancestor the file has (a missing field: where it belongs)."""
    for end in range(len(path), 0, -1):
        if path[:end] in lines:
            return lines[path[:end]]
    return None


class EventCreate(BaseModel):
    """A request to schedule an event (control API body or scenario `create` step)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    EventType: EventTypeName
    Resources: list[str] = Field(min_length=1)
    EventId: str | None = None
    EventSource: EventSourceName | None = None
    DurationInSeconds: int | None = Field(default=None, ge=-1)
    Description: str | None = None
    # Notice in Azure seconds (scaled by the time scale); or an absolute NotBefore (RFC 1123 or ISO 8601).
    NoticeSeconds: float | None = Field(default=None, ge=0)
    NotBefore: datetime | None = None
    # "Started" models an event without notice: an actual hardware failure (Platform) or a user operation the
    # scheduledEventsPolicy approves automatically (User).
    EventStatus: Literal["Scheduled", "Started"] = "Scheduled"
    # None: the scenario's setting (see Scenario).
    StartDelaySeconds: StartDelay | None = None
    # Microsoft's mock server compatibility: NotBefore as ISO 8601, and a new EventId once Started.
    NotBeforeFormat: NotBeforeStyle | None = None
    NewEventIdWhenStarted: bool | None = None

    @field_validator("NotBefore", mode="before")
    @classmethod
    def _parse_time(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        text = value.strip()
        try:
            return datetime.fromisoformat(text)
        except ValueError:
            pass
        try:
            return parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError) as error:
            raise ValueError(
                f"NotBefore {value!r} is neither ISO 8601 (2026-03-02T15:30:00+05:30) "
                "nor RFC 1123 (Mon, 02 Mar 2026 10:00:00 GMT)"
            ) from error

    @field_validator("NotBefore")
    @classmethod
    def _utc(cls, value: datetime | None) -> datetime | None:
        # Any offset is kept as the instant it names; a time without one is taken as UTC (IMDS speaks GMT).
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)

    @field_validator("EventId")
    @classmethod
    def _guid(cls, value: str | None) -> str | None:
        if value is not None and not GUID.match(value):
            raise ValueError("EventId must be a GUID")
        return value.upper() if value else value

    @model_validator(mode="after")
    def _consistent(self) -> EventCreate:
        if self.NoticeSeconds is not None and self.NotBefore is not None:
            raise ValueError("give NoticeSeconds or NotBefore, not both")
        if self.EventStatus == "Started" and (self.NoticeSeconds or self.NotBefore):
            raise ValueError("an event created Started (hardware failure) has no notice")
        if self.EventStatus == "Started" and self.StartDelaySeconds is not None:
            raise ValueError("an event created Started has no approval to delay (StartDelaySeconds)")
        if self.EventStatus == "Started" and self.NewEventIdWhenStarted:
            raise ValueError("an event created Started never turns Started later (NewEventIdWhenStarted)")
        if len(set(self.Resources)) != len(self.Resources):
            raise ValueError("Resources lists a VM twice")
        return self


FaultKind = Literal["first-call-delay", "error-burst", "hang", "malformed-json", "incarnation-reset", "throttle"]
FaultEndpoint = Literal["scheduledevents", "instance", "identity", "attested", "all"]


class FaultSpec(BaseModel):
    """A fault to inject. `vm` None means every VM."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: FaultKind
    vm: str | None = None
    endpoint: FaultEndpoint = "scheduledevents"
    # error-burst / hang / malformed-json: how many responses are affected.
    count: int = Field(default=1, ge=1, le=10_000)
    # error-burst: the status to answer.
    status: int = Field(default=500, ge=500, le=599)
    # first-call-delay: Azure seconds (scaled); hang: real seconds (a client's timeout is real time).
    seconds: float = Field(default=0, ge=0, le=600)
    # throttle: requests per second per VM above which IMDS answers 429; 0 turns throttling off.
    requestsPerSecond: float = Field(default=5, ge=0)

    @model_validator(mode="after")
    def _needs_seconds(self) -> FaultSpec:
        if self.kind in ("first-call-delay", "hang") and self.seconds <= 0:
            raise ValueError(f"a {self.kind!r} fault needs seconds > 0")
        return self


class StepCreate(EventCreate):
    # A label later steps use to cancel this event (its EventId is generated at run time).
    ref: str | None = None


Expectation = Literal["approve", "no-approval", "either"]


class ScenarioStep(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    at: float = Field(ge=0, description="offset from the start, Azure seconds (scaled by the time scale)")
    create: StepCreate | None = None
    cancel: str | None = None  # a `ref` of an earlier create step, or an EventId
    fault: FaultSpec | None = None
    # The local runner's business, which the emulator only validates (the VM or page must exist): a VM whose
    # forwarder loses its durable state at this moment; a health page that answers another status from now on; and
    # the faults below (local/platform.py plays them).
    wipeForwarderState: str | None = None
    healthPage: HealthPageStatus | None = None
    signal: SignalStep | None = None
    outage: OutageStep | None = None
    listener: ListenerStep | None = None
    gate: GateStep | None = None
    forge: ForgeStep | None = None
    # For the local runner: whether the coordinator approves the event this step creates, under the scenario's
    # policy. "either" only where the platform's own timing makes both outcomes correct, and `because` says why.
    expect: Expectation | None = None
    because: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _one_action(self) -> ScenarioStep:
        actions = [name for name in _STEP_ACTIONS if getattr(self, name) is not None]
        if len(actions) != 1:
            raise ValueError(f"a step needs exactly one of {', '.join(_STEP_ACTIONS)} (got {actions or 'none'})")
        if self.expect is not None and (self.create is None or not self.create.ref):
            raise ValueError("expect: only a create step with a ref can say what becomes of its event")
        if self.expect == "either" and self.because is None:
            raise ValueError("because: an 'either' expectation says why both outcomes are correct")
        if self.because is not None and self.expect is None:
            raise ValueError("because: explains an expect, and this step has none")
        return self


_STEP_ACTIONS = (
    "create",
    "cancel",
    "fault",
    "wipeForwarderState",
    "healthPage",
    "signal",
    "outage",
    "listener",
    "gate",
    "forge",
)


class Scenario(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "scenario"
    description: str = ""
    # The approval policy the local runner runs the scenario with (a path relative to the scenario file; made
    # relative to the working folder by from_file). The emulator itself has no policy.
    policy: str | None = None
    # A candidate policy the coordinator decides beside it, recorded as Shadow rows and never sent (same paths).
    shadowPolicy: str | None = None
    healthPages: dict[str, HealthPage] = Field(default_factory=dict)
    scaleSets: dict[str, ScaleSetSpec] = Field(default_factory=dict)
    vms: list[VmSpec] = Field(min_length=1)
    steps: list[ScenarioStep] = Field(default_factory=list)
    # Defaults for every event (an event's own field wins). Azure seconds, scaled by the time scale.
    startDelaySeconds: StartDelay = 0
    # How long a VM deleted by Terminate or evicted by Preempt still answers IMDS after the event turned Started.
    vmGoneAfterStartedSeconds: float = Field(default=0, ge=0)
    notBeforeFormat: NotBeforeStyle = "RFC1123"
    newEventIdWhenStarted: bool = False

    @model_validator(mode="after")
    def _references(self) -> Scenario:
        names = [vm.name for vm in self.vms]
        # Azure VM names are case-insensitive: web_0 and WEB_0 would be one VM. (Counted once: a scenario of
        # 100,000 VMs, benchmarks/wave.py's, is validated in linear time.)
        folded = Counter(name.lower() for name in names)
        duplicates = sorted({name for name in names if folded[name.lower()] > 1})
        if duplicates:
            raise ValueError(f"vms: duplicate names {duplicates} (VM names are case-insensitive)")
        refs: set[str] = set()
        # In the order they play (by time; the file's order among steps of one time): a cancel needs its create
        # played before it.
        for index, step in sorted(enumerate(self.steps), key=lambda item: item[1].at):
            where = f"steps.{index}"
            if step.create is not None:
                unknown = [name for name in step.create.Resources if name not in names]
                if unknown:
                    raise ValueError(f"{where}.create.Resources: unknown VMs {unknown}")
                if step.create.ref:
                    if step.create.ref in refs:
                        raise ValueError(f"{where}.create.ref: {step.create.ref!r} used twice")
                    refs.add(step.create.ref)
            if step.cancel is not None and step.cancel not in refs and not GUID.match(step.cancel):
                raise ValueError(f"{where}.cancel: {step.cancel!r} is no earlier create ref")
            if step.fault is not None and step.fault.vm is not None and step.fault.vm not in names:
                raise ValueError(f"{where}.fault.vm: unknown VM {step.fault.vm!r}")
            if step.wipeForwarderState is not None and step.wipeForwarderState not in names:
                raise ValueError(f"{where}.wipeForwarderState: unknown VM {step.wipeForwarderState!r}")
            if step.healthPage is not None and step.healthPage.name not in self.healthPages:
                raise ValueError(f"{where}.healthPage.name: no health page {step.healthPage.name!r} in healthPages")
            named = {
                "signal.vm": step.signal.vm if step.signal else None,
                "listener.vm": step.listener.vm if step.listener else None,
                "forge.by": step.forge.by if step.forge else None,
                "forge.about": step.forge.about if step.forge else None,
            }
            for field_name, vm_name in named.items():
                if vm_name is not None and vm_name not in names:
                    raise ValueError(f"{where}.{field_name}: unknown VM {vm_name!r}")
        return self

    @classmethod
    def from_mapping(cls, data: Any, *, source: str = "scenario", lines: Lines | None = None) -> Scenario:
        try:
            return cls.model_validate(data)
        except ValidationError as error:
            raise ScenarioError(describe_validation_error(error, source=source, lines=lines)) from error

    @classmethod
    def from_file(cls, path: str | Path) -> Scenario:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as error:
            raise ScenarioError(f"scenario {path} cannot be read: {error}") from error
        try:
            data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError) as error:
            kind = "JSON" if path.suffix == ".json" else "YAML"
            raise ScenarioError(f"scenario {path} is not valid {kind}: {error}") from error
        scenario = cls.from_mapping(data, source=f"scenario {path}", lines=yaml_lines(text))
        named = {"policy": scenario.policy, "shadowPolicy": scenario.shadowPolicy}
        relative = {k: os.path.normpath(path.parent / v) for k, v in named.items() if v and not Path(v).is_absolute()}
        return scenario.model_copy(update=relative) if relative else scenario

    def expectations(self) -> dict[str, tuple[Expectation, str | None]]:
        """The scenario's ref -> (expect, because) of each create step that says what becomes of its event."""
        return {
            step.create.ref: (step.expect, step.because)
            for step in self.steps
            if step.expect is not None and step.create is not None and step.create.ref
        }

    @classmethod
    def default(cls) -> Scenario:
        """Two VMs of one availability set, as in the docs' example; no events."""
        return cls(
            name="default",
            vms=[
                VmSpec(name="WestNO_0", placementGroupId="avset-westno", platformFaultDomain="0"),
                VmSpec(name="WestNO_1", placementGroupId="avset-westno", platformFaultDomain="1"),
            ],
        )


class StartRequest(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    EventId: Annotated[str, Field(min_length=1, max_length=128)]


class StartRequestsBody(BaseModel):
    """The IMDS approval body: {"StartRequests": [{"EventId": "…"}, …]}."""

    model_config = ConfigDict(extra="allow", frozen=True)

    StartRequests: list[StartRequest] = Field(min_length=1)
