"""The generator's escalation ladders (oracle/generate.py): in 6 seeds in 10 one rule of the generated policy gets an
``escalate`` ladder, and most of the events that rule decides a notice long enough for its steps to fall inside the
run. Drawn from a stream of their own (``ladders-N``), so that a seed's plan is otherwise what it was before.

- **the rule**: one that decides some generated event (else any), never a ``never-approve`` one (the policy refuses
  a ladder there);
- **the ladder**: 1-3 steps, leads of 60-95 real seconds (the policy's bounds are 60 s to a week; the coordinator's
  clock is the wall clock, not the scenario's), strictly decreasing; each but the last ``notify`` (an owner, the VMs'
  ``owner`` tag, or both), the last ``notify``, ``hold`` or ``approve``; ``approve`` only on a rule with no budget,
  rate or sequence (the policy refuses it) and not matched by tags (a tag rule's approve step would approve what its
  VM's tag asked for);
- **the notices**: each Scheduled event the rule decides, 7 in 10, a notice 6, 12 or 20 real seconds longer than one
  of the ladder's leads (times the time scale, in Azure seconds), so that step and those after it come inside the run
  and the earlier ones at first sight; the others keep theirs (600-1500 Azure seconds: 5-12.5 s at 120), where every
  step is reached at once, at first sight;
- **owners**: sometimes a VM or two tagged ``owner: team-<name>`` (read from ARM's census by ``ownerTag`` steps);
- **force** (``forces``, a stream of its own, ``force-N``): half the ladders that end in ``approve`` end in ``force``
  instead (hook ``drain-force``), and every VM gets that force hook, succeeding (2 in 3) or failing, 0.5 or 2 s long.
"""

from __future__ import annotations

from typing import Any

import yaml

from coordinator import Policy, parse_policy
from emulators.imds.models import DEFAULT_DURATION_SECONDS
from oracle.hostile import Draw
from oracle.rules import choose
from oracle.truth import Event, Vm

__all__ = ["FORCE_HOOK", "LEADS", "PAST_LEAD", "forces", "ladders"]

LEADS = (95, 80, 70, 60)  # real seconds before NotBefore
FORCE_HOOK = "drain-force"
# The drain hook the local runner installs for a VM the scenario gives none (local/forwarders.py, PREPARE_HOOK).
_DEFAULT_PREPARE = [{"name": "10-drain", "exitCode": 0, "seconds": 0}]
# Real seconds of notice past a lead of the ladder: that step, and those after it, come that long after creation.
PAST_LEAD = (6, 12, 20)
OWNERS: tuple[dict[str, str], ...] = (
    {"owner": "sre-oncall"},
    {"ownerTag": "owner"},
    {"ownerTag": "owner", "owner": "sre-oncall"},
)


def _stub(create: dict[str, Any]) -> Event:
    """The event a create step makes, as far as choosing its rule needs."""
    kind = str(create["EventType"])
    return Event(
        eventId=str(create.get("ref", "?")),
        eventType=kind,
        eventSource=str(create.get("EventSource") or ("User" if kind == "Terminate" else "Platform")),
        durationInSeconds=int(create.get("DurationInSeconds", DEFAULT_DURATION_SECONDS[kind])),
        resources=list(create["Resources"]),
        viewers=[],
        notBefore=None,
        transitions=[],
    )


def _decided_by(
    policy: Policy, vms: list[dict[str, Any]], steps: list[dict[str, Any]]
) -> dict[str, list[dict[str, Any]]]:
    """Per rule, the create steps of Scheduled events it decides."""
    fleet = {
        vm["name"]: Vm(name=vm["name"], scaleSet=vm.get("vmScaleSetName", ""), tags=vm.get("tags", {})) for vm in vms
    }
    found: dict[str, list[dict[str, Any]]] = {}
    for step in steps:
        create = step.get("create")
        if create is None or create.get("EventStatus") == "Started":
            continue
        rule, _ = choose(policy, _stub(create), fleet, 0.0)
        if rule is not None:
            found.setdefault(rule.name, []).append(create)
    return found


def _ladder(draw: Draw, rule: dict[str, Any]) -> list[dict[str, Any]]:
    may_approve = not ({"budget", "rate", "sequence"} & set(rule)) and "tags" not in rule.get("match", {})
    leads = sorted(draw.rng.sample(LEADS, draw.rng.randint(1, 3)), reverse=True)
    last = draw.pick(["approve", "approve", "hold", "notify"] if may_approve else ["hold", "notify"])
    ladder: list[dict[str, Any]] = [
        {"beforeNotBeforeSeconds": lead, "do": "notify", **draw.pick(list(OWNERS))} for lead in leads
    ]
    if last != "notify":
        ladder[-1] = {"beforeNotBeforeSeconds": leads[-1], "do": last}
    return ladder


def ladders(
    draw: Draw, policy: dict[str, Any], vms: list[dict[str, Any]], steps: list[dict[str, Any]], scale: float
) -> None:
    """Maybe one rule of ``policy`` given a ladder, the notices of the events it decides lengthened and owners tagged
    (all changed in place)."""
    if not draw.chance(0.6):
        return
    decided = _decided_by(parse_policy(yaml.safe_dump(policy), source="generated"), vms, steps)
    rules = [r for r in policy["rules"] if r["action"] != "never-approve"]
    deciding = [r for r in rules if decided.get(r["name"])]
    rule = draw.pick(deciding or rules)
    rule["escalate"] = _ladder(draw, rule)
    shown = ", ".join(f"{s['do']} {s['beforeNotBeforeSeconds']}s" for s in rule["escalate"])
    draw.note(f"{rule['name']} escalates: {shown}")
    for create in decided.get(rule["name"], []):
        if "NoticeSeconds" in create and draw.chance(0.7):
            notice = draw.pick([s["beforeNotBeforeSeconds"] for s in rule["escalate"]]) + draw.pick(list(PAST_LEAD))
            create["NoticeSeconds"] = int(notice * scale)
            draw.note(f"{create.get('ref', '?')} notice {notice} s")
    if draw.chance(0.5):
        for vm in draw.rng.sample(vms, min(2, len(vms))):
            vm["tags"] = {**vm.get("tags", {}), "owner": f"team-{vm['name'].split('_')[0].split('-')[0]}"}


def forces(draw: Draw, policy: dict[str, Any], vms: list[dict[str, Any]]) -> None:
    """Maybe the ladder's last ``approve`` made a ``force`` step, and each VM given the force hook it names (its
    listener runs it, then starts the event only if it succeeded: the oracle allows that approval, never dues it)."""
    laddered = [r for r in policy["rules"] if r.get("escalate") and r["escalate"][-1]["do"] == "approve"]
    if not laddered or not draw.chance(0.5):
        return
    step = laddered[0]["escalate"][-1]
    step.update(do="force", hook=FORCE_HOOK)
    draw.note(f"{laddered[0]['name']} forces at {step['beforeNotBeforeSeconds']}s")
    for vm in vms:
        exit_code, seconds = draw.pick([0, 0, 1]), draw.pick([0.5, 2])
        hooks = vm.setdefault("hooks", {"prepare": list(_DEFAULT_PREPARE)})
        hooks["force"] = [{"name": FORCE_HOOK, "exitCode": exit_code, "seconds": seconds}]
        draw.note(f"{vm['name']} force hook exit {exit_code} in {seconds} s")
