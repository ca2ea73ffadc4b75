"""Cards: the Adaptive Cards (1.4) the coordinator posts to Teams, built from records (pure).

The sinks that deliver them live in ``coordinator/adapters/teams.py``. One alert per transition per event: the event
record remembers which alerts went out (``coordinator/pipeline/outbox.py``). The alerts of one event a run posts
together make one card (``also``): the latest one's, naming the others, since every card shows the record as it is
when posted; two cards a second apart with the same facts are noise, and a webhook takes a few a second.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from coordinator.domain.model import AlertKind, EventRecord, VmRecord
from coordinator.domain.side_records import VmReturn

CARD_VERSION = "1.4"
MAX_CARD_BYTES = 28 * 1024  # Teams refuses larger messages ("Request entity too large").

_TITLES: dict[str, tuple[str, str]] = {
    "new-event": ("New scheduled event", "Warning"),
    "approved": ("Event approved", "Good"),
    "started-without-notice": ("Event started without notice", "Attention"),
    "canceled": ("Event canceled", "Default"),
    "expired": ("Event expired unapproved", "Warning"),
    "completed": ("Event completed, its impact measured", "Good"),
    "approval-failed": ("Approval failed", "Attention"),
    "approval-refused": ("Approval refused by the VM", "Attention"),
    "not-started": ("Approved, but not started", "Attention"),
    "facts-conflict": ("Conflicting reports of an event", "Attention"),
    "heartbeat-lost": ("VM heartbeat lost", "Attention"),
    "forwarder-conflict": ("Two forwarders report as one VM", "Attention"),
    "imds-failing": ("Forwarder alive, IMDS failing", "Attention"),
    "return-late": ("Not back in service in time", "Attention"),
}
# The new-event card of an event no rule approves: it is the card that asks a person (see _explain).
NEEDS_PERSON_TITLE = "New scheduled event needs a person's approval"

_VM_TEXTS: dict[str, str] = {
    "heartbeat-lost": "Its forwarder stopped reporting: its scheduled events are not seen and cannot be approved.",
    "forwarder-conflict": (
        "Envelopes under two forwarder states arrive for this VM in turn: one of them is not this VM's forwarder "
        "(another VM sending under its name with the fleet's shared identity, or a cloned disk). Both are heard; "
        "approvals still go only where the VM's own IMDS document agrees. Find the second sender."
    ),
    "imds-failing": (
        "Its forwarder still sends heartbeats but has not read IMDS for too long: this VM's scheduled events are not "
        "seen and cannot be approved. Check the VM's access to 169.254.169.254 (proxy, firewall, route) and the "
        "forwarder's log. No further card while it lasts; another one if it fails again after recovering."
    ),
}


def _explain(kind: AlertKind, record: EventRecord) -> str:
    """What the card's kind says about this record beyond its facts (cards are built from the record alone, so an
    outbox entry sent later by the timer says the same)."""
    approval = record.approval
    if kind == "new-event" and waits_for_person(record):
        until = record.notBefore.isoformat() if record.notBefore else "its NotBefore"
        return (
            f"No rule approves it ({record.decision.reason if record.decision else 'no decision yet'}): it waits for a "
            f"person. Approve it with the link below, or the platform starts it at {until} regardless."
        )
    if kind == "not-started" and approval is not None:
        by = approval.confirmBy.isoformat() if approval.confirmBy else "its deadline"
        return (
            f"{approval.executor or 'the VM'}'s listener answered '{approval.outcome}'"
            f"{': ' + approval.reason if approval.reason else ''}, but no VM saw the event Started or gone by {by}. "
            "A listener's answer is not the platform's: the platform may still be waiting (other tenants of the host), "
            "or the answer was not true."
        )
    if kind == "facts-conflict" and record.conflicts:
        last = record.conflicts[-1]
        claims = "; ".join(
            f"{fact} {claimed!r} (recorded {recorded!r})" for fact, (recorded, claimed) in last.facts.items()
        )
        return (
            f"{record.conflictCount} sighting(s) contradict the facts on record; the latest, from {last.vm}, claims "
            f"{claims}. The record keeps its facts; a VM approves only what its own IMDS document shows."
        )
    if kind == "return-late" and record.returnToService is not None:
        watch = record.returnToService
        late = [f"{name}: {vm.waiting}" for name, vm in sorted(watch.vms.items()) if vm.status == "late"]
        return (
            f"Completed at {watch.since.isoformat()}; rule '{watch.rule}' wants its VMs back in service by "
            f"{watch.bound.isoformat()}. Not back: {'; '.join(late[:10]) or 'none now'}. They still count as "
            "impacted in every budget until they are."
        )
    return ""


def _fact(title: str, value: object) -> dict[str, str]:
    return {"title": title, "value": str(value)[:300]}


def _envelope(body: list[dict[str, Any]], actions: list[dict[str, Any]]) -> dict[str, Any]:
    content: dict[str, Any] = {
        "$schema": "http://adaptivecards.io/schemas/adaptive-card.json",
        "type": "AdaptiveCard",
        "version": CARD_VERSION,
        "body": body,
    }
    if actions:
        content["actions"] = actions
    return {
        "type": "message",
        "attachments": [
            {"contentType": "application/vnd.microsoft.card.adaptive", "contentUrl": None, "content": content}
        ],
    }


def waits_for_person(record: EventRecord) -> bool:
    """The event's decision is "wait for a person" (a rule that says so, or none matched) and it is not approved."""
    decision = record.decision
    return decision is not None and decision.action == "wait-for-person" and record.approval is None


def _escalation(kind: AlertKind, record: EventRecord) -> tuple[str, str, str]:
    """An escalation step's card (its kind names the step): its title, colour and what it says."""
    number = int(kind.rsplit("-", 1)[1])
    step = next((s for s in record.escalation if s.step == number), None)
    if step is None:
        return f"Escalation step {number}", "Attention", ""
    until = record.notBefore.isoformat() if record.notBefore else "its NotBefore"
    said = {
        "notify": f"For {', '.join(step.owners) or 'its owner (none named: no VM carries the tag in ARM)'}: this event "
        f"is not approved and the platform starts it at {until}. Approve it with the link below, or the next step "
        "of its rule's ladder decides.",
        "approve": f"Approved anyway, {step.beforeNotBeforeSeconds} s before NotBefore ({until}); the VM executes it "
        "only that near NotBefore on its own clock.",
        "force": f"Approved once the VM's own force hook {step.hook} succeeds: its listener runs it, then starts the "
        f"event itself (the VM checks NotBefore, {until}, is that near); if it fails, the platform starts it then.",
        "hold": f"Not approved by the coordinator: the platform starts it at {until}.",
    }.get(step.do, "")
    title = f"Escalation step {step.step} of {step.of}: {step.do}"
    return title, "Warning" if step.do == "notify" else "Attention", said


def _decision_facts(record: EventRecord) -> list[dict[str, str]]:
    """The decision, what held it, the escalation steps taken and the approval, as card facts."""
    facts: list[dict[str, str]] = []
    if record.decision is not None:
        facts.append(_fact("Decision", f"{record.decision.verdict} by rule '{record.decision.rule}'"))
        decision = record.decision
        if decision.heldBy and record.approval is None:
            facts.append(_fact("Held", decision.reason))
        elif decision.holdKind and record.approval is None:
            # The window, blackout, gate, budget or hooks that held it, since and until when (the expired card says
            # why the coordinator let NotBefore come).
            since = f" since {decision.holdSince.isoformat()}" if decision.holdSince else ""
            until = f" until {decision.heldUntil.isoformat()}" if decision.heldUntil else ""
            facts.append(_fact("Held", f"{decision.holdKind} '{decision.holdName}'{since}{until}: {decision.reason}"))
    if record.escalation:
        # The ladder's steps taken, each with its time: what was done as NotBefore neared.
        taken = [f"{s.step}/{s.of} {s.do} at {s.takenAt.isoformat()}" for s in record.escalation]
        facts.append(_fact("Escalation", "; ".join(taken)))
    if record.approval is not None:
        facts.append(_fact("Approved by", record.approval.actor))
        if record.approval.outcome:
            facts.append(_fact("Approval outcome", f"{record.approval.outcome} {record.approval.reason}".strip()))
    return facts


def build_card(
    kind: AlertKind,
    record: EventRecord,
    *,
    now: datetime,
    approve_url: str | None = None,
    detail: str = "",
    also: Sequence[AlertKind] = (),
) -> dict[str, Any]:
    """The card of alert ``kind`` about ``record``; ``also``: the event's earlier alerts this card stands for too
    (posted with it), each named with what it says."""
    if kind.startswith("escalation-"):
        title, color, said = _escalation(kind, record)
        detail = detail or said
    else:
        title, color = _TITLES[kind]
    if kind == "new-event" and waits_for_person(record):
        title = NEEDS_PERSON_TITLE
    resources = record.resources
    shown = ", ".join(resources[:20]) + (f" … (+{len(resources) - 20})" if len(resources) > 20 else "")
    facts = [
        _fact("EventId", record.eventId),
        _fact("Type", f"{record.eventType} ({record.eventSource})"),
        _fact("State", record.state),
        _fact("NotBefore", record.notBefore.isoformat() if record.notBefore else "—"),
        _fact("Duration", "unknown" if record.durationInSeconds < 0 else f"{record.durationInSeconds} s"),
        _fact("Resources", shown or "—"),
        _fact("Scale sets", ", ".join(sorted(record.scale_sets)) or "—"),
    ]
    facts += _decision_facts(record)
    if record.platformHold is not None:
        facts.append(_fact("Held", record.platformHold.describe()))
    failed = [
        f"{name}: {phase} hook '{hook}' {sighting.hooks.get(phase, 'failed')}"
        for name, sighting in sorted(record.vms.items())
        for phase, hook in sorted(sighting.failedHooks.items())
    ]
    if failed:
        facts.append(
            _fact("Failed hooks", "; ".join(failed[:10]) + (f" … (+{len(failed) - 10})" if len(failed) > 10 else ""))
        )
    if record.removed:
        facts.append(_fact("Removed", ", ".join(record.removed[:20])))
    impacts = [
        f"{name}: {sighting.impactMeasure} {sighting.impactSeconds:.1f} s"
        for name, sighting in sorted(record.vms.items())
        if sighting.impactSeconds is not None
    ]
    if impacts:
        announced = "not announced" if record.durationInSeconds < 0 else f"announced {record.durationInSeconds} s"
        shown_impacts = "; ".join(impacts[:20]) + (f" … (+{len(impacts) - 20})" if len(impacts) > 20 else "")
        facts.append(_fact("Impact measured", f"{shown_impacts} ({announced})"))
    if record.returnToService is not None:
        returns = [f"{name}: {_return(vm)}" for name, vm in sorted(record.returnToService.vms.items())]
        facts.append(_fact("Return to service", "; ".join(returns[:20]) + (" …" if len(returns) > 20 else "")))
    body: list[dict[str, Any]] = [
        {
            "type": "TextBlock",
            "text": f"{title}: {record.eventType}",
            "weight": "Bolder",
            "size": "Medium",
            "color": color,
        },
        {"type": "TextBlock", "text": (record.description or "—")[:500], "wrap": True},
        {"type": "FactSet", "facts": facts},
    ]
    detail = detail or _explain(kind, record)
    if detail:
        body.append({"type": "TextBlock", "text": detail[:1000], "wrap": True, "isSubtle": True})
    if also:
        body.append({"type": "TextBlock", "text": _also(also, record), "wrap": True, "isSubtle": True})
    body.append({"type": "TextBlock", "text": f"Coordinator time {now.isoformat()}", "isSubtle": True, "size": "Small"})
    actions = []
    asks = kind in ("new-event", "approval-failed") or (kind.startswith("escalation-") and record.approval is None)
    if approve_url and record.state == "Scheduled" and asks:
        actions.append({"type": "Action.OpenUrl", "title": "Approve now", "url": approve_url})
    return _envelope(body, actions)


def _also(kinds: Sequence[AlertKind], record: EventRecord) -> str:
    """The earlier alerts a card stands for: each one's title, and what it says beyond the facts."""
    said = []
    for kind in kinds:
        title = _escalation(kind, record)[0] if kind.startswith("escalation-") else _TITLES[kind][0]
        explained = _explain(kind, record)
        said.append(f"{title}{': ' + explained[:300] if explained else ''}")
    return ("Also since the last card: " + "; ".join(said))[:1500]


def _return(vm: VmReturn) -> str:
    if vm.status == "back" and vm.seconds is not None:
        return f"back after {vm.seconds:.0f} s"
    return f"{vm.status} ({vm.waiting})" if vm.waiting else vm.status


def build_vm_card(
    kind: AlertKind, vm: VmRecord, *, now: datetime, timeout_seconds: int | None = None
) -> dict[str, Any]:
    title, color = _TITLES[kind]
    identity = vm.identity
    facts = [
        _fact("VM", identity.name),
        _fact("vmId", identity.vmId),
        _fact("Scale set", identity.vmScaleSetName or "—"),
        _fact("Placement group", identity.placementGroupId or "—"),
        _fact("Last seen", vm.lastSeen.isoformat()),
    ]
    if timeout_seconds is not None:
        facts.append(_fact("Timeout", f"{timeout_seconds} s"))
    if kind == "imds-failing" and vm.imdsFailing is not None:
        facts.append(_fact("Failing since", vm.imdsFailing.since.isoformat()))
        facts.append(_fact("Health", vm.imdsFailing.reason))
    body: list[dict[str, Any]] = [
        {
            "type": "TextBlock",
            "text": f"{title}: {identity.name}",
            "weight": "Bolder",
            "size": "Medium",
            "color": color,
        },
        {"type": "TextBlock", "text": _VM_TEXTS.get(kind, ""), "wrap": True},
        {"type": "FactSet", "facts": facts},
        {"type": "TextBlock", "text": f"Coordinator time {now.isoformat()}", "isSubtle": True, "size": "Small"},
    ]
    return _envelope(body, [])


def card_bytes(card: dict[str, Any]) -> bytes:
    return json.dumps(card, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def raise_vm_alert(vm: VmRecord, kind: AlertKind, now: datetime) -> VmRecord:
    """The VM with ``kind`` in its outbox: the caller writes it with the VM's position (the condition's own write),
    and puts it in the run's ``Work.vm_alerts`` to be sent after that write."""
    if kind in vm.pendingAlerts:
        return vm
    return vm.model_copy(update={"pendingAlerts": [*vm.pendingAlerts, kind], "pendingSince": vm.pendingSince or now})
