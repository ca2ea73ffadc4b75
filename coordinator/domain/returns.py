"""Return to service: after a Freeze, Reboot or Redeploy completes, is each VM it named serving again?

A rule's ``returnToService`` (coordinator/domain/policy.py) says what "back" means: the VM's recover hooks done
(succeeded, or none installed: the forwarder reports ``not-run``) and every gate it names passing for that VM, within
``withinSeconds`` of the completion. The event keeps a ``ReturnWatch`` (``begin``, as it completes); each run that
touches it (a batch bringing a recover report, the timer's tick) moves its VMs on (``follow``): back (an Impact row,
``return-to-service``, with the seconds since the completion), late once the bound passed first (a row each and one
card for the event), abandoned ``RETURN_WATCH_LIMIT`` after the bound. A VM not back counts as impacted in every budget
(``EventRecord.impacting``), and the event's budget claims are released only once none is.

Pure: gate results come in (pipeline/returns.py reads them), rows and the card go out through the change.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta

from contracts.envelope import VmIdentity
from coordinator.domain.controls import GateResult
from coordinator.domain.history_rows import impact_row
from coordinator.domain.lifecycle import EventChange, raise_alert
from coordinator.domain.model import EventRecord, VmSighting
from coordinator.domain.policy import Policy
from coordinator.domain.side_records import ReturnWatch, VmReturn

__all__ = ["RETURNING_TYPES", "RETURN_WATCH_LIMIT", "begin", "follow", "needs_gates", "rule_of"]

# The events after which a VM comes back: a Terminate or Preempt removes it.
RETURNING_TYPES = frozenset({"Freeze", "Reboot", "Redeploy"})
# How long past its bound a late VM is still watched (and counted impacted): a VM that never comes back must not
# hold a budget slot for ever; its late card and row said so a day earlier.
RETURN_WATCH_LIMIT = timedelta(hours=24)
_HOOKS_DONE = frozenset({"succeeded", "not-run"})


def rule_of(policy: Policy, record: EventRecord) -> str:
    """The rule whose ``returnToService`` applies: the one that approved the event, else the one that decided it last
    (a person's approval, rule "manual", is the deciding rule's ``wait-for-person``); "" when the policy has neither."""
    for name in (record.approval.rule if record.approval else "", record.decision.rule if record.decision else ""):
        if name and policy.rule(name) is not None:
            return name
    return ""


def begin(policy: Policy, change: EventChange, now: datetime) -> None:
    """Starts watching the VMs of an event that just completed, when its rule asks for it: those it named that
    reported it and that it did not remove. Their clock starts at the completion; an event that completed longer ago
    than its bound (one written before this watch existed, touched again by a late report) is not watched."""
    record = change.record
    if record.state != "Completed" or record.returnToService is not None or record.eventType not in RETURNING_TYPES:
        return
    name = rule_of(policy, record)
    rule = policy.rule(name)
    option = rule.returnToService if rule is not None else None
    names = sorted(n for n in record.resources if n in record.vms and n not in record.removed)
    if option is None or not names or now - record.stateSince > timedelta(seconds=option.withinSeconds):
        return
    record.returnToService = ReturnWatch(
        rule=name,
        since=record.stateSince,
        bound=record.stateSince + timedelta(seconds=option.withinSeconds),
        gates=list(option.gates),
        vms={name: VmReturn(waiting="recover hooks not reported yet") for name in names},
    )
    change.changed = True


def needs_gates(record: EventRecord) -> list[str]:
    """The VMs whose gates are worth reading now: watched, their recover hooks done (a VM still recovering is not
    back whatever its gates say)."""
    watch = record.returnToService
    if watch is None or not watch.gates or watch.doneAt is not None:
        return []
    return [name for name in watch.watched if not _hooks_waiting(record.vms.get(name))]


def follow(change: EventChange, now: datetime, gates: Mapping[str, Mapping[str, GateResult]] | None = None) -> None:
    """Moves each watched VM on: back when its hooks are done and its gates pass (``gates``: the results by VM, then
    gate, for those read this run; None or a VM missing: not read, so not back by gates yet), else late at the bound,
    abandoned ``RETURN_WATCH_LIMIT`` later. The watch is done once no VM is watched."""
    record = change.record
    watch = record.returnToService
    if watch is None or watch.doneAt is not None:
        return
    vms = dict(watch.vms)
    rows: list[tuple[str, str, str, float | None]] = []
    for name in watch.watched:
        moved = _moved(watch, record, name, now, (gates or {}).get(name))
        if moved is not None:
            vms[name], said = moved
            rows += [(name, vms[name].status, said, vms[name].seconds)] if said else []
    if vms == watch.vms:
        return
    record.returnToService = watch = watch.model_copy(update={"vms": vms})
    if not watch.watched:
        record.returnToService = watch.model_copy(update={"doneAt": now})
    change.changed = True
    for name, outcome, said, seconds in rows:
        identity = (
            record.vms[name].identity()
            if name in record.vms
            else VmIdentity.model_construct(name=name, vmId="", resourceId="")
        )
        change.rows.append(
            impact_row(
                record=record,
                now=now,
                vm=identity,
                measure="return-to-service",
                measured_seconds=None,
                start=watch.since,
                end=now if outcome == "back" else None,
                observed_at=now,
                sequence=-1,  # the coordinator's measure, of no envelope
                actor="coordinator",
                details={"bound": watch.bound.isoformat(), "gates": watch.gates},
                outcome=outcome,
                reason=f"{name} {said}",
                returned=(watch.rule, seconds),
            )
        )
    if any(outcome == "late" for _, outcome, _, _ in rows):
        raise_alert(change, "return-late", now)


def _moved(
    watch: ReturnWatch, record: EventRecord, name: str, now: datetime, read: Mapping[str, GateResult] | None
) -> tuple[VmReturn, str] | None:
    """One watched VM's next status and what its row says ("" for none), or None when nothing changed."""
    vm = watch.vms[name]
    waiting = _hooks_waiting(record.vms.get(name))
    if not waiting and watch.gates:
        # Not read this run (a batch reads no gate for one VM): what the last reading said, or that none has.
        unread = vm.waiting if vm.waiting.startswith("gate ") else "gates not read yet"
        waiting = _gates_waiting(watch.gates, read) if read is not None else unread
    what = record.eventType
    if not waiting:
        seconds = (now - watch.since).total_seconds()
        late = f", {(now - watch.bound).total_seconds():.0f} s past its bound" if vm.status == "late" else ""
        back = VmReturn(status="back", backAt=now, seconds=seconds)
        return back, f"back in service {seconds:.0f} s after the {what} completed{late}"
    if now >= watch.bound + RETURN_WATCH_LIMIT:
        said = f"no longer watched, {RETURN_WATCH_LIMIT.total_seconds():.0f} s past its bound: {waiting}"
        return vm.model_copy(update={"status": "abandoned", "waiting": waiting}), said
    if vm.status == "returning" and now >= watch.bound:
        bound = (watch.bound - watch.since).total_seconds()
        said = f"not back in service {bound:.0f} s after the {what} completed: {waiting}"
        return vm.model_copy(update={"status": "late", "waiting": waiting}), said
    return (vm.model_copy(update={"waiting": waiting}), "") if waiting != vm.waiting else None


def _hooks_waiting(sighting: VmSighting | None) -> str:
    """What the VM's recover phase still keeps it from ("" when done)."""
    if sighting is None:
        return "no sighting of the event"
    if sighting.epoch < 0:
        return ""  # known only from Event Grid: no forwarder, so no hooks to wait for
    outcome = sighting.hooks.get("recover", "")
    if outcome in _HOOKS_DONE:
        return ""
    if not outcome:
        return "recover hooks not reported yet"
    failed = sighting.failedHooks.get("recover", "")
    return f"recover hooks {outcome}" + (f" ({failed})" if failed else "")


def _gates_waiting(names: list[str], results: Mapping[str, GateResult]) -> str:
    failing = []
    for name in names:
        result = results.get(name, GateResult("error", "not read"))
        if result.state != "passing":
            failing.append(f"{name} {result.state}" + (f" ({result.detail})" if result.detail else ""))
    return "gate " + "; ".join(failing) if failing else ""
