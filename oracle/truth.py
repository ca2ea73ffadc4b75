"""The truth of one run, as the oracle judges it: what IMDS did (events, their states and times, every accepted
approval, every document content of every VM and when it was read), what the platform did around the pipeline
(processes down, services out, listeners slow or dead, gates' answers, forged envelopes), the scenario's VMs and
hooks, the policy, the run's options, and the history's Observation rows.

Plain data (pydantic, JSON both ways): a run writes ``truth.json`` and ``python -m oracle check truth.json`` judges
it again. Times are aware UTC datetimes (the wall clock the coordinator also reads); the spans are half-open.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "MAY_DELAY",
    "Approval",
    "DeadLetter",
    "Event",
    "Forgery",
    "GateChange",
    "HistoryStep",
    "Hook",
    "Incarnation",
    "LadderStep",
    "ListenerFault",
    "Observation",
    "Options",
    "Outage",
    "Span",
    "Transition",
    "Truth",
    "Vm",
]


class _Data(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Span(_Data):
    """[begin, end); end None: until the run ended."""

    begin: datetime
    end: datetime | None = None


class Hook(_Data):
    name: str
    exitCode: int
    seconds: float = 0.0


class Vm(_Data):
    """A scenario VM: where it sits (budget domains), its tags, its prepare hooks (None: the run's default), whether
    it runs the forwarder, and its clock's skew."""

    name: str
    scaleSet: str = ""
    location: str = ""
    zone: str = ""
    faultDomain: str = ""
    updateDomain: str = ""
    placementGroup: str = ""
    tags: dict[str, str] = Field(default_factory=dict)
    prepare: list[Hook] | None = None
    agentless: bool = False
    clockSkewSeconds: float = 0.0


class Transition(_Data):
    at: datetime
    state: Literal["Scheduled", "Started", "Completed", "Canceled"]
    reason: str = ""


class Event(_Data):
    """An event as IMDS created it: its facts, the VMs whose documents show it, and every state it took."""

    eventId: str
    formerIds: list[str] = Field(default_factory=list)
    ref: str | None = None
    eventType: str
    eventSource: str
    durationInSeconds: int
    resources: list[str]
    viewers: list[str]
    notBefore: datetime | None
    transitions: list[Transition]


class Approval(_Data):
    """A StartRequests IMDS accepted: which event, from which VM, when, by which path, in which state it found it."""

    eventId: str
    vm: str
    at: datetime
    via: Literal["imds", "arm"] = "imds"
    statusBefore: str = "Scheduled"


class Incarnation(_Data):
    """One document content of one VM: since when, what it listed, what had left, when a client read it whole."""

    vm: str
    incarnation: int
    serial: int
    at: datetime
    listed: list[tuple[str, str]]
    gone: list[str]
    firstServed: datetime | None = None
    lastServed: datetime | None = None


class Outage(_Data):
    service: Literal["eventhubs", "relay", "storage"]
    span: Span


class ListenerFault(_Data):
    """Requests to this VM's listener held ``delaySeconds``, or never delivered (``dead``), during ``span``."""

    vm: str
    span: Span
    delaySeconds: float = 0.0
    dead: bool = False


class GateChange(_Data):
    """From ``at`` on, the local page of gate ``name`` answers as ``state`` says (local/gates.py)."""

    at: datetime
    name: str
    state: Literal["passing", "failing", "slow", "trickle", "dead"]
    delaySeconds: float = 0.0


# The forgeries that may make the coordinator wait for an event they are about (docs/security.md: a lying VM can): the
# lies without root, as they were judged before attestation refused them at the door. A sequence hijack silences no
# one (sequences compare within a forwarder state), and no lie with root on the forger's VM may delay another VM's
# event (issue 34: each is refused at the door, or its answers are not taken for the VM's).
MAY_DELAY = frozenset({"relabel", "user", "hook", "gone", "deep", "oversized"})


class Forgery(_Data):
    """What a hostile process on VM ``by`` did about VM ``about`` (local/forgeries.py): the messages it sent (their
    bodies' SHA-256, as dead letters name them), or, a lying listener, the requests it answered."""

    at: datetime
    by: str
    about: str
    kind: str
    events: list[str]
    sent: int = 0
    digests: list[str] = Field(default_factory=list)
    answered: list[tuple[str, str]] = Field(default_factory=list)  # (eventId, decisionId)


class DeadLetter(_Data):
    """A message the coordinator set aside (a DeadLetter history row): why, and its body's SHA-256."""

    at: datetime
    reason: str
    sha256: str = ""


class Observation(_Data):
    """A history Observation row: which VM's document, at which incarnation, said what of which event."""

    vm: str
    incarnation: int
    eventId: str
    status: str


class LadderStep(_Data):
    """An escalation step a Decision row says its decision took (its ``Details.escalation``): its place in the
    rule's ladder (from 1) of how many, what it does, its lead, its time as the coordinator computed it (NotBefore
    minus the lead) and whom it told."""

    step: int
    of: int
    do: str
    beforeNotBeforeSeconds: int
    at: datetime
    owners: list[str] = Field(default_factory=list)


class HistoryStep(_Data):
    """A Decision or Approval row of the history: what the coordinator says it decided and sent, and when. Not
    truth: the oracle judges approvals by IMDS; these rows explain a finding (when the approval was decided, how
    often it was sent), and are themselves what escalation steps are judged by: a step is taken by writing its
    Decision row (``escalation``, with the row's rule and decision)."""

    at: datetime
    kind: Literal["Decision", "Approval"]
    eventId: str
    outcome: str = ""
    vm: str = ""
    reason: str = ""
    rule: str = ""
    decisionId: str = ""
    escalation: list[LadderStep] = Field(default_factory=list)


class Options(_Data):
    """How the run was played: what bounds the pipeline's timing."""

    timeScale: float
    pollInterval: float = 1.0
    timerInterval: float = 1.0
    heartbeatInterval: float = 2.0
    hookTimeoutSeconds: float = 30.0
    # The run's default hooks for a VM whose scenario entry gives none: one succeeding prepare hook, or none.
    defaultPrepareHook: bool = True
    retireGraceSeconds: float = 6.0
    remoteAcknowledgeFallback: bool = False


class Truth(_Data):
    scenario: str
    started: datetime
    ended: datetime
    policy: str  # the policy's YAML text as the coordinator read it
    options: Options
    vms: list[Vm]
    events: list[Event]
    approvals: list[Approval]
    incarnations: list[Incarnation]
    # Per VM with a forwarder: when its forwarder process ran (not killed, not stopped).
    forwarderRuns: dict[str, list[Span]] = Field(default_factory=dict)
    # Every SIGKILL of a forwarder; those after which no forwarder ran again (VMs removed by the platform).
    kills: dict[str, list[datetime]] = Field(default_factory=dict)
    permanentKills: dict[str, list[datetime]] = Field(default_factory=dict)
    wipes: dict[str, list[datetime]] = Field(default_factory=dict)
    removals: dict[str, datetime] = Field(default_factory=dict)
    outages: list[Outage] = Field(default_factory=list)
    listenerFaults: list[ListenerFault] = Field(default_factory=list)
    gates: list[GateChange] = Field(default_factory=list)
    forgeries: list[Forgery] = Field(default_factory=list)
    deadLetters: list[DeadLetter] = Field(default_factory=list)
    observations: list[Observation] = Field(default_factory=list)
    history: list[HistoryStep] = Field(default_factory=list)

    def write(self, path: Path) -> None:
        path.write_text(self.model_dump_json(indent=1), encoding="utf-8")

    @classmethod
    def read(cls, path: Path) -> Truth:
        return cls.model_validate_json(path.read_text(encoding="utf-8"))
