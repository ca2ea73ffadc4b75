"""The truth of a finished local run, gathered from the stack: the IMDS emulator's record, the platform's log (local/
platform.py), the local gate pages' log, the scenario's VMs, the policy the coordinator read and the history's
Observation rows. ``platform_facts`` (pure) turns the platform's log into spans."""

from __future__ import annotations

import json
import sqlite3
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

from emulators.imds.models import Scenario
from emulators.imds.vm_models import VmSpec
from local.expectations import HOOK_TIMEOUT_SECONDS
from local.observe import TABLE
from local.stack import LocalStack
from oracle.truth import (
    Approval,
    DeadLetter,
    Event,
    Forgery,
    GateChange,
    HistoryStep,
    Hook,
    Incarnation,
    LadderStep,
    ListenerFault,
    Observation,
    Options,
    Outage,
    Span,
    Transition,
    Truth,
    Vm,
)

__all__ = ["PlatformFacts", "collect", "ladder_steps", "platform_facts", "vm_of"]


def _time(value: Any) -> datetime:
    return datetime.fromisoformat(str(value).replace("Z", "+00:00"))


def vm_of(spec: VmSpec) -> Vm:
    return Vm(
        name=spec.name,
        scaleSet=spec.vmScaleSetName,
        location=spec.location,
        zone=spec.zone,
        faultDomain=spec.platformFaultDomain,
        updateDomain=spec.platformUpdateDomain,
        placementGroup=spec.placementGroupId,
        tags=dict(spec.tags),
        prepare=None
        if spec.hooks is None
        else [Hook(name=h.name, exitCode=h.exitCode, seconds=h.seconds) for h in spec.hooks.prepare],
        agentless=spec.agentless,
        clockSkewSeconds=spec.clockSkewSeconds,
    )


class PlatformFacts:
    """The platform's log as spans: forwarder runs, kills (and those for good), wipes, outages, listener faults,
    forgeries. ``read`` takes the log's entries in order."""

    def __init__(self) -> None:
        self.runs: dict[str, list[Span]] = {}
        self.kills: dict[str, list[datetime]] = {}
        self.permanent_kills: dict[str, list[datetime]] = {}
        self.wipes: dict[str, list[datetime]] = {}
        self.outages: list[Outage] = []
        self.listener_faults: list[ListenerFault] = []
        self.forgeries: list[Forgery] = []
        self._running: dict[str, datetime] = {}
        self._out: dict[str, datetime] = {}
        self._listeners: dict[str, tuple[datetime, float, bool]] = {}

    def read(self, entry: dict[str, Any]) -> None:
        at, action = _time(entry["at"]), str(entry["action"])
        vm = str(entry.get("vm", ""))
        if action in ("forwarder-start", "forwarder-cont"):
            self._running.setdefault(vm, at)
            if action == "forwarder-start":
                self.permanent_kills.pop(vm, None)  # a kill followed by a start on the same state loses nothing
        elif action in ("forwarder-kill", "forwarder-stop"):
            begun = self._running.pop(vm, None)
            if begun is not None:
                self.runs.setdefault(vm, []).append(Span(begin=begun, end=at))
            if action == "forwarder-kill":
                self.permanent_kills.setdefault(vm, []).append(at)
                self.kills.setdefault(vm, []).append(at)
        elif action == "wipe":
            self.wipes.setdefault(vm, []).append(at)
        elif action in ("outage-begin", "storage-stop"):
            self._out[str(entry.get("service", "storage"))] = at
        elif action in ("outage-end", "storage-cont"):
            self._outage(str(entry.get("service", "storage")), at)
        elif action == "listener":
            self._listener(vm, at)
            self._listeners[vm] = (at, float(entry.get("delaySeconds", 0.0)), bool(entry.get("dead", False)))
        elif action == "forge":
            events = [str(e) for e in entry.get("events", [])]
            forgery = Forgery(
                at=at,
                by=str(entry["by"]),
                about=str(entry["about"]),
                kind=str(entry["kind"]),
                events=events,
                sent=int(entry.get("sent", 0)),
                digests=[str(d) for d in entry.get("digests", [])],
            )
            self.forgeries.append(forgery)
        elif action == "liar":
            self._liar(entry)

    def _liar(self, entry: dict[str, Any]) -> None:
        """What a lying listener answered, on the forgery that started it."""
        answered = [(str(e), str(d)) for e, d in entry.get("answered", [])]
        for index, forgery in enumerate(self.forgeries):
            if (forgery.kind, forgery.by, forgery.about) == ("liar", entry.get("by"), entry.get("about")):
                self.forgeries[index] = forgery.model_copy(update={"answered": answered})

    def _outage(self, service: str, at: datetime | None) -> None:
        begun = self._out.pop(service, None)
        if begun is not None:
            span = Span(begin=begun, end=at)
            self.outages.append(Outage(service=service, span=span))

    def _listener(self, vm: str, at: datetime | None) -> None:
        begun = self._listeners.pop(vm, None)
        if begun is not None and (begun[1] > 0 or begun[2]):
            span = Span(begin=begun[0], end=at)
            self.listener_faults.append(ListenerFault(vm=vm, span=span, delaySeconds=begun[1], dead=begun[2]))

    def close(self) -> None:
        """What is still on when the log ends lasts until the run's end."""
        for vm, begun in self._running.items():
            self.runs.setdefault(vm, []).append(Span(begin=begun))
        self._running.clear()
        for service in list(self._out):
            self._outage(service, None)
        for vm in list(self._listeners):
            self._listener(vm, None)


def platform_facts(log: list[dict[str, Any]]) -> PlatformFacts:
    facts = PlatformFacts()
    for entry in log:
        facts.read(entry)
    facts.close()
    return facts


def _history_rows(history: Path, columns: str, where: str) -> list[Any]:
    """The run's history rows ``where`` (SQL), their ``columns``; none when the coordinator never wrote a row."""
    if not history.exists():
        return []
    db = sqlite3.connect(f"file:{history}?mode=ro", uri=True)
    try:
        return db.execute(f'SELECT {columns} FROM "{TABLE}" WHERE {where}').fetchall()  # noqa: S608 -- fixed SQL
    except sqlite3.OperationalError:  # no table yet
        return []
    finally:
        db.close()


def observations(history: Path) -> list[Observation]:
    rows = _history_rows(history, "VmName, DocumentIncarnation, EventId, EventStatus", "RecordType = 'Observation'")
    return [
        Observation(vm=str(vm), incarnation=int(n), eventId=str(event_id), status=str(status))
        for vm, n, event_id, status in rows
        if vm is not None and n is not None
    ]


def _details(value: Any) -> dict[str, Any]:
    """A row's Details column (JSON text in the local history), as a mapping; {} when none or unreadable."""
    try:
        found = json.loads(value) if isinstance(value, str) else (value or {})
    except ValueError:
        found = {}
    return found if isinstance(found, dict) else {}


def dead_letters(history: Path) -> list[DeadLetter]:
    """The history's DeadLetter rows: why each message was set aside, and its body's digest."""
    rows = _history_rows(history, "TimeGenerated, Reason, Details", "RecordType = 'DeadLetter'")
    return [
        DeadLetter(at=_time(at), reason=str(reason or "")[:1000], sha256=str(_details(details).get("bodySha256", "")))
        for at, reason, details in rows
    ]


def ladder_steps(details: Any) -> list[LadderStep]:
    """The escalation steps a Decision row's Details say its decision took (none when unreadable)."""
    found = _details(details).get("escalation")
    steps = []
    for item in found if isinstance(found, list) else []:
        try:
            steps.append(LadderStep.model_validate({**item, "at": _time(item["at"])}))
        except (KeyError, TypeError, ValueError):
            continue
    return steps


def history_steps(history: Path) -> list[HistoryStep]:
    rows = _history_rows(
        history,
        "TimeGenerated, RecordType, EventId, Outcome, VmName, Reason, Rule, DecisionId, Details",
        "RecordType IN ('Decision', 'Approval') ORDER BY rowid",
    )
    return [
        HistoryStep(
            at=_time(at),
            kind=kind,
            eventId=str(event_id),
            outcome=str(outcome or ""),
            vm=str(vm or ""),
            reason=str(reason or "")[:300],
            rule=str(rule or ""),
            decisionId=str(decision_id or ""),
            escalation=ladder_steps(details) if kind == "Decision" else [],
        )
        for at, kind, event_id, outcome, vm, reason, rule, decision_id, details in rows
        if event_id
    ]


def _event(summary: dict[str, Any]) -> Event:
    return Event(
        eventId=str(summary["EventId"]),
        formerIds=[str(e) for e in summary.get("formerEventIds", [])],
        ref=summary.get("ref"),
        eventType=str(summary["EventType"]),
        eventSource=str(summary["EventSource"]),
        durationInSeconds=int(summary["DurationInSeconds"]),
        resources=[str(n) for n in summary["Resources"]],
        viewers=[str(n) for n in summary.get("viewers", [])],
        notBefore=_time_or_none(summary.get("NotBefore")),
        transitions=[
            Transition(at=_time(t["at"]), state=t["state"], reason=str(t.get("reason", "")))
            for t in summary["transitions"]
        ],
    )


def _time_or_none(value: Any) -> datetime | None:
    if not value:
        return None
    text = str(value)
    if text.endswith("GMT"):
        return parsedate_to_datetime(text).astimezone(UTC)
    return _time(text)


def collect(stack: LocalStack, *, started: datetime, scenario: Scenario) -> Truth:
    """The truth of the run ``stack`` played (call it once the run is settled, before the stack stops)."""
    assert stack.imds is not None
    stack.drain()  # the history rows of the batches' tails
    record = stack.imds.truth()
    facts = platform_facts(stack.platform.log)
    # The policy the run used: the one with the local gates' addresses, else StackOptions.policy (--policy, else the
    # scenario's own, else the default; the scenario's own was missed when only ``policy_path`` was read).
    policy_path = stack.workdir / "policy.yaml" if stack.gates is not None else stack.options.policy
    policy = policy_path.read_text(encoding="utf-8")
    gates = [
        GateChange(at=change.at, name=change.name, state=change.behaviour, delaySeconds=change.delay_seconds)
        for change in (stack.gates.log if stack.gates is not None else [])
    ]
    return Truth(
        scenario=scenario.name,
        started=started,
        ended=datetime.now(UTC),
        policy=policy,
        options=_options(stack, scenario),
        vms=[vm_of(spec) for spec in scenario.vms],
        events=[_event(summary) for summary in record["events"]],
        approvals=[_approval(summary) for summary in record["approvals"]],
        incarnations=[_incarnation(summary) for summary in record["incarnations"]],
        forwarderRuns=facts.runs,
        kills=facts.kills,
        permanentKills=facts.permanent_kills,
        wipes=facts.wipes,
        removals={vm: _time(r["at"]) for vm, r in record["removedVms"].items()},
        outages=facts.outages,
        listenerFaults=facts.listener_faults,
        gates=gates,
        forgeries=facts.forgeries,
        deadLetters=dead_letters(stack.history_path),
        observations=observations(stack.history_path),
        history=history_steps(stack.history_path),
    )


def _options(stack: LocalStack, scenario: Scenario) -> Options:
    """The run's settings the oracle's bounds depend on."""
    options = stack.options
    return Options(
        timeScale=options.time_scale,
        pollInterval=options.poll_interval,
        timerInterval=options.timer_interval,
        heartbeatInterval=options.heartbeat_interval,
        hookTimeoutSeconds=HOOK_TIMEOUT_SECONDS,
        defaultPrepareHook=options.prepare_hooks,
        retireGraceSeconds=float(stack.retire_grace_seconds),
        remoteAcknowledgeFallback=any(vm.agentless for vm in scenario.vms),
    )


def _approval(summary: dict[str, Any]) -> Approval:
    """An approval the IMDS emulator accepted, from its summary."""
    return Approval(
        eventId=str(summary["EventId"]),
        vm=str(summary["vm"]),
        at=_time(summary["at"]),
        via=summary.get("via", "imds"),
        statusBefore=str(summary.get("statusBefore", "Scheduled")),
    )


def _incarnation(summary: dict[str, Any]) -> Incarnation:
    """One document content of a VM and when a client read it whole, from the IMDS emulator's summary."""
    return Incarnation(
        vm=str(summary["vm"]),
        incarnation=int(summary["incarnation"]),
        serial=int(summary["serial"]),
        at=_time(summary["at"]),
        listed=[(str(e["EventId"]), str(e["EventStatus"])) for e in summary["listed"]],
        gone=[str(e) for e in summary["gone"]],
        firstServed=_time_or_none(summary.get("firstServed")),
        lastServed=_time_or_none(summary.get("lastServed")),
    )
