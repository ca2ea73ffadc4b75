"""The generator's hostile input (oracle/generate.py): lies a VM sends within the fleet's shared identity, messages
no schema allows, and attacks by a process with root on one fleet VM (issue 34), as ``forge`` steps the local platform
plays (local/forgeries.py)."""

from __future__ import annotations

import random
from typing import Any, Protocol

__all__ = ["ROOTED_ATTACKS", "attackers", "forgeries", "scale_set_liars", "scale_set_rule"]

# What ``attackers`` draws from (in this order: a seed's draws stay what they were), then the kinds of their own.
_DRAWN = ("name", "silence", "name-hook", "name-impact", "squat", "malformed", "liar")
ROOTED_ATTACKS = (*_DRAWN, "scale-set")
SCALE_SET = "web"  # every generated fleet has it (generate._fleet)


class Draw(Protocol):
    """generate._Draw: a seeded stream of choices and the notes of what was drawn."""

    rng: random.Random

    def chance(self, p: float) -> bool: ...

    def pick(self, options: list[Any]) -> Any: ...

    def note(self, text: str) -> None: ...


def forgeries(draw: Draw, vms: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Lies about a peer's events (within the placement group, whose events the forger's IMDS shows), and messages
    under the forger's own identity that no schema allows (too deep) or that are as large as the door lets in."""
    steps = []
    if draw.chance(0.3):
        steps.extend(_lies(draw, vms, events))
    if draw.chance(0.2):
        by = draw.pick(vms)["name"]
        kind = draw.pick(["deep", "oversized"])
        at = draw.rng.randrange(0, 481, 30)
        steps.append({"at": at, "forge": {"by": by, "about": by, "kind": kind}})
        draw.note(f"at {at}: {by} sends {kind}")
    return steps


def _lies(draw: Draw, vms: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[str, list[str]] = {}
    for vm in vms:
        if vm.get("placementGroupId") and not vm.get("isolated"):
            groups.setdefault(vm["placementGroupId"], []).append(vm["name"])
    pairs = [(a, b) for members in groups.values() for a in members for b in members if a != b]
    targets = [e for e in events if "create" in e and e["create"].get("EventStatus") != "Started"]
    if not pairs or not targets:
        return []
    steps = []
    for _ in range(draw.rng.randint(1, 2)):
        target = draw.pick(targets)
        victims = target["create"]["Resources"]
        candidates = [(by, about) for by, about in pairs if about in victims]
        if not candidates:
            continue
        by, about = draw.pick(candidates)
        kind = draw.pick(["relabel", "user", "hook", "gone", "sequence"])
        at = target["at"] + 60
        steps.append({"at": at, "forge": {"by": by, "about": about, "kind": kind}})
        draw.note(f"at {at}: {by} forges {kind} about {about}")
    return steps


def attackers(draw: Draw, vms: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Attacks by a process with root on one fleet VM (issue 34; local/forgeries.py): another VM's name with its own
    identity (an approval to steal, a VM to silence, hooks and impact to report), a squatter on another VM's
    resource id, a damaged document, a lying listener on another VM's hybrid connection. Drawn from a stream of
    their own (``draw``), so that a seed's plan is the same with or without them."""
    if not draw.chance(0.6):
        return []
    groups: dict[str, list[str]] = {}
    for vm in vms:
        if vm.get("placementGroupId") and not vm.get("isolated"):
            groups.setdefault(vm["placementGroupId"], []).append(vm["name"])
    peers = {name: [n for n in members if n != name] for members in groups.values() for name in members}
    targets = [e for e in events if "create" in e and e["create"].get("EventStatus") != "Started"]
    steps: list[dict[str, Any]] = []
    for _ in range(draw.rng.randint(1, 2)):
        kind = draw.pick(list(_DRAWN))
        if kind == "malformed" or not targets:
            by = draw.pick(vms)["name"]
            at = draw.rng.randrange(0, 481, 30)
            steps.append({"at": at, "forge": {"by": by, "about": by, "kind": "malformed"}})
            draw.note(f"at {at}: {by} sends a damaged document")
            continue
        target = draw.pick(targets)
        named = target["create"]["Resources"]
        # A liar sits where the approval may go: a VM the event names, or a peer that sees it (any that reports it
        # first may execute it).
        about = draw.pick(sorted({*named, *peers.get(named[0], [])}) if kind == "liar" else named)
        # Its own IMDS shows the victim's events only within their placement group; the squatter (a name and a
        # resource id) and the liar (a hybrid connection) need none of them.
        others = [vm["name"] for vm in vms if vm["name"] != about]
        candidates = others if kind in ("squat", "liar") else peers.get(about, [])
        if not candidates:
            continue
        by = draw.pick(candidates)
        # With the event (heard before the truth, before it is decided); the liar listens before the approval goes.
        at = max(0, target["at"] - 30) if kind == "liar" else target["at"]
        steps.append({"at": at, "forge": {"by": by, "about": about, "kind": kind}})
        draw.note(f"at {at}: {by} with root attacks {about}: {kind}")
    return steps


def scale_set_rule(draw: Draw, policy: dict[str, Any]) -> None:
    """Sometimes, a first rule that leaves the Reboots and Redeploys of scale set web to a person, matched by scale
    set: ARM's, never a VM's own word (what ``scale_set_liars`` lie about). From a stream of its own, played with or
    without the attackers."""
    if draw.chance(0.3):
        match = {"scaleSet": [SCALE_SET], "eventType": ["Reboot", "Redeploy"]}
        policy["rules"].insert(0, {"name": "web-by-person", "match": match, "action": "wait-for-person"})
        draw.note(f"{SCALE_SET}'s Reboots and Redeploys by a person (a scaleSet rule)")


def scale_set_liars(draw: Draw, vms: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Sometimes, a VM of a scale set with root on itself reports its own events again, under its own name and
    attested identity but a scale set not its own (local/forgeries.py, ``scale-set``): believed, they would escape
    ``scale_set_rule``'s rule and its delete its scale set's. From a stream of its own."""
    members = {vm["name"] for vm in vms if vm.get("vmScaleSetName")}
    targets = [
        e
        for e in events
        if "create" in e and e["create"].get("EventStatus") != "Started" and members & set(e["create"]["Resources"])
    ]
    if not targets or not draw.chance(0.4):
        return []
    target = draw.pick(targets)
    by = draw.pick(sorted(members & set(target["create"]["Resources"])))
    at = target["at"] + 30  # once its own forwarder reported the event: the lie is what would change the decision
    draw.note(f"at {at}: {by} with root reports its events under another scale set")
    return [{"at": at, "forge": {"by": by, "about": by, "kind": "scale-set"}}]
